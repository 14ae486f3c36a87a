//! The LLaMA family (`LlamaForCausalLM`, `Qwen2ForCausalLM`, `Qwen3ForCausalLM`,
//! `MistralForCausalLM`) as Hugging Face lays it out: module paths are its tensor names
//! (`model.layers.0.self_attn.q_proj.weight`, ...), projections are `nn.Linear` `[out, in]`.
//! RMSNorm, rotary positions, a SwiGLU MLP, grouped-query attention (Qwen3's with each
//! head's queries and keys normalised); the head is `lm_head`, or `model.embed_tokens` when
//! tied.

use std::sync::Arc;

use burn::module::Module;
use burn::tensor::activation::silu;
use burn::tensor::{Int, Tensor};

use super::causal_lm::{decoder_unit, head_loss, inputs, last_position, unit_loss};
use super::layers::{Dense, Embed, KvCache, RmsNorm, Rope, attention, split_heads, with_cached};
use super::lm_batch::{LmBatch, Packing};
use crate::hf::config::LlamaShape;
use crate::hf::weights::Weights;
use crate::mesh_part::MeshPart;
use zerotrain::engine::{InitialValues, UnitModel, UnitSpec};
use zerotrain::nn::parallel::{ModelSplit, ParallelGroup};

/// The decoder under `model`: the token embedding, the layers, the final norm.
#[derive(Module, Debug)]
pub struct LlamaBody {
    embed_tokens: Embed,
    layers: Vec<LlamaLayer>,
    norm: RmsNorm,
}

/// `*ForCausalLM`: the decoder and its head (none when tied to the embedding).
#[derive(Module, Debug)]
pub struct Llama {
    model: LlamaBody,
    lm_head: Option<Dense>,
    /// Where an engine reads the first values of the still-lazy parameters (an imported
    /// checkpoint's files).
    #[module(skip)]
    values: Option<Arc<dyn InitialValues>>,
    /// Its place on a device mesh (the whole model without one).
    #[module(skip)]
    part: MeshPart,
    /// Its frozen parameters' paths (a LoRA run's base).
    #[module(skip)]
    frozen: Vec<String>,
}

/// One pre-norm layer.
#[derive(Module, Debug)]
pub struct LlamaLayer {
    input_layernorm: RmsNorm,
    self_attn: LlamaAttention,
    post_attention_layernorm: RmsNorm,
    mlp: LlamaMlp,
}

/// Grouped-query attention with rotary positions.
#[derive(Module, Debug)]
pub struct LlamaAttention {
    q_proj: Dense,
    k_proj: Dense,
    v_proj: Dense,
    o_proj: Dense,
    /// Qwen3's RMSNorm over each head's queries, and over its keys, before the rotation.
    q_norm: Option<RmsNorm>,
    k_norm: Option<RmsNorm>,
    /// This rank's query heads and kv heads (all of them without tensor parallelism).
    #[module(skip)]
    heads: (usize, usize),
    #[module(skip)]
    rope: Rope,
}

/// `down(silu(gate(x)) * up(x))`.
#[derive(Module, Debug)]
pub struct LlamaMlp {
    gate_proj: Dense,
    up_proj: Dense,
    down_proj: Dense,
}

impl Llama {
    /// The model of `shape`, its parameters from `w` (lazy: see [`Weights`]); built for a
    /// tensor-parallel group (`w`'s), this rank's part of it: q, k, v, the MLP's gate and up
    /// split by output features (whole heads, whole kv heads), the attention's output and
    /// the MLP's down by input features, the embedding and the head by vocabulary; norms
    /// whole. Head counts and the MLP width that do not divide over the group are refused
    /// by their config field (through `w`'s [`finish`](Weights::finish)).
    pub fn new(shape: &LlamaShape, w: &Weights) -> Self {
        let (d, hd, eps) = (shape.hidden_size, shape.head_dim, shape.rms_norm_eps);
        let (heads, kv, ffn) = (shape.num_attention_heads, shape.num_key_value_heads, shape.intermediate_size);
        let tp = w.tensor_parallel().clone();
        crate::mesh_part::refuse_undivided(
            w,
            &[
                ("num_attention_heads", heads, true),
                ("num_key_value_heads", kv, true),
                ("intermediate_size", ffn, false),
            ],
        );
        let rope = Rope::new(hd, shape.rope_theta, shape.rope_scaling);
        let layers = (0..shape.num_hidden_layers)
            .map(|i| {
                let at = |part: &str| format!("model.layers.{i}.{part}");
                let column = |part: &str, d_in, out, bias| Dense::column(w, &at(part), d_in, out, bias);
                let row = |part: &str, d_in, out, bias| Dense::row(w, &at(part), d_in, out, bias);
                LlamaLayer {
                    input_layernorm: RmsNorm::new(w, &at("input_layernorm"), d, eps),
                    self_attn: LlamaAttention {
                        q_proj: column("self_attn.q_proj", d, heads * hd, shape.qkv_bias),
                        k_proj: column("self_attn.k_proj", d, kv * hd, shape.qkv_bias),
                        v_proj: column("self_attn.v_proj", d, kv * hd, shape.qkv_bias),
                        o_proj: row("self_attn.o_proj", heads * hd, d, shape.o_bias),
                        q_norm: shape.qk_norm.then(|| RmsNorm::new(w, &at("self_attn.q_norm"), hd, eps)),
                        k_norm: shape.qk_norm.then(|| RmsNorm::new(w, &at("self_attn.k_norm"), hd, eps)),
                        heads: (heads / tp.size(), kv / tp.size()),
                        rope: rope.clone(),
                    },
                    post_attention_layernorm: RmsNorm::new(w, &at("post_attention_layernorm"), d, eps),
                    mlp: LlamaMlp {
                        gate_proj: column("mlp.gate_proj", d, ffn, shape.mlp_bias),
                        up_proj: column("mlp.up_proj", d, ffn, shape.mlp_bias),
                        down_proj: row("mlp.down_proj", ffn, d, shape.mlp_bias),
                    },
                }
            })
            .collect();
        let vocab = shape.vocab_size;
        Self {
            model: LlamaBody {
                embed_tokens: Embed::vocabulary(w, "model.embed_tokens", vocab, d),
                layers,
                norm: RmsNorm::new(w, "model.norm", d, eps),
            },
            lm_head: (!shape.tie_word_embeddings).then(|| Dense::vocabulary(w, "lm_head", d, vocab)),
            values: w.initial_values(),
            part: MeshPart::of(w, vocab),
            frozen: w.frozen_parameters(),
        }
    }

    /// The final norm and the head: logits `[batch, time, vocab]` (gathered from the
    /// group's ranks where the vocabulary is split).
    fn head(&self, h: Tensor<3>) -> Tensor<3> {
        let h = self.model.norm.forward(h);
        let logits = match &self.lm_head {
            Some(head) => head.forward(h),
            None => self.model.embed_tokens.logits(h),
        };
        self.part.logits(logits)
    }

    /// The final norm, the head and the mean next-token loss against `tokens` (the last
    /// unit), without the whole logits.
    fn head_loss(&self, h: Tensor<3>, tokens: (&LmBatch, usize)) -> Tensor<3> {
        let h = self.model.norm.forward(h);
        let head = match &self.lm_head {
            Some(head) => head.weight_and_bias(),
            None => (self.model.embed_tokens.table(), None),
        };
        head_loss(h, head, tokens, self.part.vocabulary())
    }

    /// Logits `[batch, time, vocab]` for token ids `[batch, time]`.
    pub fn forward(&self, ids: Tensor<2, Int>) -> Tensor<3> {
        self.head(self.trunk(ids))
    }

    /// The residual stream after the last layer `[batch, time, d]`.
    fn trunk(&self, ids: Tensor<2, Int>) -> Tensor<3> {
        let mut h = self.model.embed_tokens.forward(ids);
        for layer in &self.model.layers {
            h = layer.forward(h, 0, None, (None, None));
        }
        h
    }

    /// The mean next-token loss of `tokens` `[batch, time + 1]` through the units' path.
    pub(crate) fn whole_loss(&self, tokens: &Tensor<2, Int>) -> Tensor<1> {
        unit_loss(self.head_loss(self.trunk(inputs(tokens)), (&LmBatch::new(tokens.clone()), 0)))
    }

    /// Logits `[batch, 1, vocab]` of the token after `ids` `[batch, time]`, which follow
    /// the tokens `cache` holds; their keys and values join it.
    pub fn forward_cached(&self, ids: Tensor<2, Int>, cache: &mut KvCache) -> Tensor<3> {
        let start = cache.advance(ids.dims()[1]);
        let mut h = self.model.embed_tokens.forward(ids);
        for (i, layer) in self.model.layers.iter().enumerate() {
            h = layer.forward(h, start, Some((&mut *cache, i)), (None, None));
        }
        self.head(last_position(h))
    }
}

/// `x` `[batch, heads, time, head_dim]` normalised by `norm` over each head's vector.
fn per_head(norm: &Option<RmsNorm>, x: Tensor<4>) -> Tensor<4> {
    let Some(norm) = norm else { return x };
    let [b, h, t, hd] = x.dims();
    norm.forward(x.reshape([b, h * t, hd])).reshape([b, h, t, hd])
}

impl LlamaLayer {
    /// `h` `[batch, time, d]` at positions `start..`, attending also to the earlier
    /// positions a cache holds (layer `i` of it), to which this layer's keys and values join.
    /// With `seq`, `h` is this rank's part of each sequence (at positions `start..`), and
    /// attention trades parts for heads over the group (DeepSpeed-Ulysses). Where rows pack
    /// sequences (`packed`), positions are each token's in its sequence and attention stays
    /// inside it.
    fn forward(
        &self,
        h: Tensor<3>,
        start: usize,
        cache: Option<(&mut KvCache, usize)>,
        (seq, packed): (Option<&ParallelGroup>, Option<&Packing>),
    ) -> Tensor<3> {
        let a = &self.self_attn;
        let (heads, kv) = a.heads;
        // One copy into the tensor-parallel region for q, k and v, one for gate and up.
        let x = a.q_proj.enter(self.input_layernorm.forward(h.clone()));
        let q = per_head(&a.q_norm, split_heads(a.q_proj.forward_entered(x.clone()), heads));
        let k = per_head(&a.k_norm, split_heads(a.k_proj.forward_entered(x.clone()), kv));
        let (q, k) = match packed {
            Some(p) => a.rope.rotate_at(q, k, &p.positions, p.starts.dims()[1]),
            None => a.rope.rotate(q, k, start),
        };
        let (k, v) = with_cached(cache, k, split_heads(a.v_proj.forward_entered(x), kv));
        let attended = attention(q, k, v, seq, packed);
        let h = h + a.o_proj.forward(attended);
        let m = &self.mlp;
        let x = m.gate_proj.enter(self.post_attention_layernorm.forward(h.clone()));
        h + m.down_proj.forward(silu(m.gate_proj.forward_entered(x.clone())) * m.up_proj.forward_entered(x))
    }
}

/// Tensors of a LLaMA-family checkpoint that are not parameters: rotary tables older
/// checkpoints store, and a head saved beside the table it is tied to.
pub fn ignored(name: &str, tied: bool) -> bool {
    name.ends_with(".rotary_emb.inv_freq") || (tied && name == "lm_head.weight")
}

/// Units: the token embedding (the root's when tied), each layer, the norm and head.
impl UnitModel for Llama {
    /// Token ids `[batch, time + 1]`: inputs and next-token targets.
    type Batch = LmBatch;
    /// The residual stream `[batch, time, d]`; after the last unit, the mean loss
    /// `[1, 1, 1]`.
    type Hidden = Tensor<3>;

    fn units(&self) -> Vec<UnitSpec> {
        let tied = self.lm_head.is_none();
        let layers = (0..self.model.layers.len())
            .map(|i| UnitSpec::new(format!("model.layers.{i}"), [format!("model.layers.{i}")]));
        let head: &[&str] = if tied { &["model.norm"] } else { &["model.norm", "lm_head"] };
        let embed = if tied {
            UnitSpec::new("embed", Vec::<String>::new())
        } else {
            UnitSpec::new("embed", ["model.embed_tokens"])
        };
        std::iter::once(embed)
            .chain(layers)
            .chain(std::iter::once(UnitSpec::new("head", head.iter().copied())))
            .collect()
    }

    fn frozen_parameters(&self) -> Vec<String> {
        self.frozen.clone()
    }

    fn shared(&self) -> Vec<String> {
        if self.lm_head.is_none() { vec!["model.embed_tokens".into()] } else { Vec::new() }
    }

    fn forward_unit(&self, unit: usize, input: Option<Tensor<3>>, tokens: &Self::Batch) -> Tensor<3> {
        let (embed, layers) = (&self.model.embed_tokens, &self.model.layers);
        // With sequence parallelism, this rank's part of every sequence.
        let part = &self.part;
        let layer = |i: usize, h: Tensor<3>| {
            let (first, t) = (part.first(h.dims()[1]), h.dims()[1]);
            layers[i].forward(h, first, None, (part.sequence(), tokens.packing(first, t).as_ref()))
        };
        let head = |h: Tensor<3>| {
            let first = part.first(h.dims()[1]);
            self.head_loss(h, (tokens, first))
        };
        let embed = |ids: Tensor<2, Int>| embed.forward(part.inputs(ids).0);
        decoder_unit(unit, input, tokens, layers.len(), embed, layer, head)
    }

    fn output_loss(&self, loss: Tensor<3>, _: &Self::Batch) -> Tensor<1> {
        unit_loss(loss)
    }

    fn batch_size(&self, batch: &Self::Batch) -> Option<usize> {
        Some(batch.rows())
    }

    fn initial_values(&self) -> Option<Arc<dyn InitialValues>> {
        self.values.clone()
    }

    fn model_split(&self) -> Option<ModelSplit> {
        Some(self.part.model_split())
    }
}
