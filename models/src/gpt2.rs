//! GPT-2 as Hugging Face's `GPT2LMHeadModel` lays it out: module paths are its tensor
//! names (`transformer.h.0.attn.c_attn.weight`, ...), projections are `Conv1D` `[in, out]`,
//! and the head is the token embedding `transformer.wte`, transposed.

use std::sync::Arc;

use burn::module::Module;
use burn::tensor::activation::gelu_approximate;
use burn::tensor::{Int, Tensor};

use super::causal_lm::{decoder_unit, head_loss, inputs, last_position, unit_loss};
use super::layers::{Conv1D, Embed, KvCache, Norm, attention, positions, split_heads, with_cached};
use super::lm_batch::{LmBatch, Packing};
use crate::hf::config::Gpt2Shape;
use crate::hf::weights::{Init, Weights};
use crate::mesh_part::MeshPart;
use zerotrain::engine::{InitialValues, UnitModel, UnitSpec};
use zerotrain::nn::parallel::{ModelSplit, ParallelGroup};

/// GPT-2's body: token and position embeddings, blocks, the final LayerNorm.
#[derive(Module, Debug)]
pub struct Gpt2Body {
    wte: Embed,
    wpe: Embed,
    h: Vec<Gpt2Block>,
    ln_f: Norm,
}

/// `GPT2LMHeadModel`: the body under `transformer`, the head tied to `transformer.wte`.
#[derive(Module, Debug)]
pub struct Gpt2 {
    transformer: Gpt2Body,
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

/// One pre-norm block: attention with a fused q/k/v projection, and a tanh-GELU MLP.
#[derive(Module, Debug)]
pub struct Gpt2Block {
    ln_1: Norm,
    attn: Gpt2Attention,
    ln_2: Norm,
    mlp: Gpt2Mlp,
}

/// `c_attn` `[d, 3d]` gives q, k and v; `c_proj` mixes the heads.
#[derive(Module, Debug)]
pub struct Gpt2Attention {
    c_attn: Conv1D,
    c_proj: Conv1D,
    /// This rank's heads (all of them without tensor parallelism).
    #[module(skip)]
    n_head: usize,
}

/// `c_fc` `[d, n_inner]`, tanh-GELU, `c_proj` `[n_inner, d]`.
#[derive(Module, Debug)]
pub struct Gpt2Mlp {
    c_fc: Conv1D,
    c_proj: Conv1D,
}

impl Gpt2 {
    /// The model of `shape`, its parameters from `w` (lazy: see [`Weights`]); built for a
    /// tensor-parallel group (`w`'s), this rank's part of it: `c_attn` split by heads (its
    /// q, k and v alike), `c_fc` by output features, both `c_proj` by input features, the
    /// token embedding (and so the tied head) by vocabulary; norms and positions whole.
    /// Head counts and the MLP width that do not divide are refused by their config field.
    pub fn new(shape: &Gpt2Shape, w: &Weights) -> Self {
        let (d, eps) = (shape.n_embd, shape.layer_norm_epsilon);
        let tp = w.tensor_parallel().clone();
        crate::mesh_part::refuse_undivided(w, &[("n_head", shape.n_head, true), ("n_inner", shape.n_inner, false)]);
        // Hugging Face's `GPT2PreTrainedModel._init_weights`: the residual projections at
        // initializer_range / sqrt(2 n_layer), so the residual stream's variance does not
        // grow with depth.
        let residual = Init::ScaledNormal(1.0 / (2.0 * shape.n_layer as f64).sqrt());
        let h = (0..shape.n_layer)
            .map(|i| {
                let at = |part: &str| format!("transformer.h.{i}.{part}");
                Gpt2Block {
                    ln_1: Norm::new(w, &at("ln_1"), d, eps),
                    attn: Gpt2Attention {
                        c_attn: Conv1D::column(w, &at("attn.c_attn"), d, 3 * d, Init::Normal, 3),
                        c_proj: Conv1D::row(w, &at("attn.c_proj"), d, d, residual),
                        n_head: shape.n_head / tp.size(),
                    },
                    ln_2: Norm::new(w, &at("ln_2"), d, eps),
                    mlp: Gpt2Mlp {
                        c_fc: Conv1D::column(w, &at("mlp.c_fc"), d, shape.n_inner, Init::Normal, 1),
                        c_proj: Conv1D::row(w, &at("mlp.c_proj"), shape.n_inner, d, residual),
                    },
                }
            })
            .collect();
        Self {
            transformer: Gpt2Body {
                wte: Embed::vocabulary(w, "transformer.wte", shape.vocab_size, d),
                wpe: Embed::new(w, "transformer.wpe", shape.n_positions, d),
                h,
                ln_f: Norm::new(w, "transformer.ln_f", d, eps),
            },
            values: w.initial_values(),
            part: MeshPart::of(w, shape.vocab_size),
            frozen: w.frozen_parameters(),
        }
    }

    /// Token plus position embeddings `[batch, time, d]` at `positions` (`[1, time]` or
    /// `[batch, time]`: [`positions`]).
    fn embed(&self, ids: Tensor<2, Int>, positions: Tensor<2, Int>) -> Tensor<3> {
        self.transformer.wte.forward(ids) + self.transformer.wpe.forward(positions)
    }

    /// The final norm and the tied head: logits `[batch, time, vocab]` (gathered from the
    /// group's ranks where the vocabulary is split).
    fn head(&self, h: Tensor<3>) -> Tensor<3> {
        let logits = self.transformer.wte.logits(self.transformer.ln_f.forward(h));
        self.part.logits(logits)
    }

    /// The final norm, the tied head and the mean next-token loss against `tokens` (the
    /// last unit), without the whole logits.
    fn head_loss(&self, h: Tensor<3>, tokens: (&LmBatch, usize)) -> Tensor<3> {
        let head = (self.transformer.wte.table(), None);
        head_loss(self.transformer.ln_f.forward(h), head, tokens, self.part.vocabulary())
    }

    /// Logits `[batch, time, vocab]` for token ids `[batch, time]`.
    pub fn forward(&self, ids: Tensor<2, Int>) -> Tensor<3> {
        self.head(self.trunk(ids))
    }

    /// The residual stream after the last block `[batch, time, d]`.
    fn trunk(&self, ids: Tensor<2, Int>) -> Tensor<3> {
        let mut h = self.embed(ids.clone(), positions(0, ids.dims()[1], None, &ids.device()));
        for block in &self.transformer.h {
            h = block.forward(h, None, (None, None));
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
        let mut h = self.embed(ids.clone(), positions(start, ids.dims()[1], None, &ids.device()));
        for (i, block) in self.transformer.h.iter().enumerate() {
            h = block.forward(h, Some((&mut *cache, i)), (None, None));
        }
        self.head(last_position(h))
    }
}

impl Gpt2Block {
    /// `h` `[batch, time, d]`, attending also to the earlier positions a cache holds (block
    /// `i` of it), to which this block's keys and values join.
    /// With `seq`, `h` is this rank's part of each sequence and attention trades parts for
    /// heads over the group (DeepSpeed-Ulysses).
    fn forward(
        &self,
        h: Tensor<3>,
        cache: Option<(&mut KvCache, usize)>,
        (seq, packed): (Option<&ParallelGroup>, Option<&Packing>),
    ) -> Tensor<3> {
        let n_head = self.attn.n_head;
        let qkv = self.attn.c_attn.forward(self.ln_1.forward(h.clone()));
        let [q, k, v]: [Tensor<3>; 3] = qkv.chunk(3, 2).try_into().expect("c_attn is [d, 3d]");
        let (k, v) = with_cached(cache, split_heads(k, n_head), split_heads(v, n_head));
        let a = attention(split_heads(q, n_head), k, v, seq, packed);
        let h = h + self.attn.c_proj.forward(a);
        let m = self.mlp.c_proj.forward(gelu_approximate(self.mlp.c_fc.forward(self.ln_2.forward(h.clone()))));
        h + m
    }
}

/// Names a GPT-2 checkpoint may use instead: the original `gpt2` files have no
/// `transformer.` prefix.
pub fn alias(name: &str) -> Option<String> {
    name.strip_prefix("transformer.").map(str::to_string)
}

/// Tensors of a GPT-2 checkpoint that are not parameters: the attention masks older
/// checkpoints store, and a head saved beside the table it is tied to.
pub fn ignored(name: &str) -> bool {
    name.ends_with(".attn.bias") || name.ends_with(".attn.masked_bias") || name == "lm_head.weight"
}

/// Units: the position embedding, each block, the final norm; the tied token embedding is
/// the root's (used by the first and the last unit).
impl UnitModel for Gpt2 {
    /// Token ids `[batch, time + 1]`: inputs and next-token targets.
    type Batch = LmBatch;
    /// The residual stream `[batch, time, d]`; after the last unit, the mean loss
    /// `[1, 1, 1]`.
    type Hidden = Tensor<3>;

    fn units(&self) -> Vec<UnitSpec> {
        let blocks = (0..self.transformer.h.len())
            .map(|i| UnitSpec::new(format!("transformer.h.{i}"), [format!("transformer.h.{i}")]));
        std::iter::once(UnitSpec::new("embed", ["transformer.wpe"]))
            .chain(blocks)
            .chain(std::iter::once(UnitSpec::new("head", ["transformer.ln_f"])))
            .collect()
    }

    fn frozen_parameters(&self) -> Vec<String> {
        self.frozen.clone()
    }

    fn shared(&self) -> Vec<String> {
        vec!["transformer.wte".into()]
    }

    fn forward_unit(&self, unit: usize, input: Option<Tensor<3>>, tokens: &Self::Batch) -> Tensor<3> {
        let blocks = &self.transformer.h;
        // With sequence parallelism, this rank's part of every sequence.
        let part = &self.part;
        let block = |i: usize, h: Tensor<3>| {
            let (first, t) = (part.first(h.dims()[1]), h.dims()[1]);
            blocks[i].forward(h, None, (part.sequence(), tokens.packing(first, t).as_ref()))
        };
        let head = |h: Tensor<3>| {
            let first = part.first(h.dims()[1]);
            self.head_loss(h, (tokens, first))
        };
        let embed = |ids: Tensor<2, Int>| {
            let (ids, first) = part.inputs(ids);
            let t = ids.dims()[1];
            let at = positions(first, t, tokens.packing(first, t).as_ref(), &ids.device());
            self.embed(ids, at)
        };
        decoder_unit(unit, input, tokens, blocks.len(), embed, block, head)
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
