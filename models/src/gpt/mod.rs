//! A GPT-style decoder: token and position embeddings, pre-norm transformer blocks with
//! causal self-attention and an MLP, a final norm and a (tied or untied) output head; and
//! a rank's part of it on a device mesh ([`Gpt::new_split`]).

mod lora;
mod parallel;
#[cfg(test)]
mod tests;

use burn::module::Module;
use burn::nn::attention::{MultiHeadAttention, MultiHeadAttentionConfig};
use burn::nn::{Embedding, EmbeddingConfig, Initializer, LayerNorm, LayerNormConfig, Linear, LinearConfig};
use burn::tensor::activation::gelu;
use burn::tensor::{Device, Int, Tensor};
use serde::{Deserialize, Serialize};

use self::lora::adapted;
pub use self::lora::{BlockAdapters, lora_sizes};
use super::causal_lm::{CausalLm, decoder_unit, head_loss, inputs, unit_loss};
use super::lm_batch::{LmBatch, Packing};
use crate::layers::{attention, positions, split_heads};
use crate::mesh_part::MeshPart;
use zerotrain::engine::{UnitModel, UnitSpec};
use zerotrain::nn::parallel::{ModelSplit, ParallelGroup, row_parallel_linear};

/// The `model` section of a config: a GPT's shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct GptConfig {
    /// Transformer blocks. Default 2.
    #[serde(default = "defaults::n_layer")]
    pub n_layer: usize,
    /// Attention heads per block (must divide `n_embd`). Default 4.
    #[serde(default = "defaults::n_head")]
    pub n_head: usize,
    /// Model width. Default 64.
    #[serde(default = "defaults::n_embd")]
    pub n_embd: usize,
    /// Context length in tokens. Default 32.
    #[serde(default = "defaults::block_size")]
    pub block_size: usize,
    /// Vocabulary size; 0 (default) takes it from the corpus.
    #[serde(default)]
    pub vocab_size: usize,
    /// Share the token embedding with the output head. Default true.
    #[serde(default = "defaults::tied_head")]
    pub tied_head: bool,
}

mod defaults {
    pub fn n_layer() -> usize {
        2
    }
    pub fn n_head() -> usize {
        4
    }
    pub fn n_embd() -> usize {
        64
    }
    pub fn block_size() -> usize {
        32
    }
    pub fn tied_head() -> bool {
        true
    }
}

impl Default for GptConfig {
    fn default() -> Self {
        serde_json::from_str("{}").expect("every field has a default")
    }
}

impl GptConfig {
    /// Checks the shape, naming the first bad field.
    pub fn validate(&self) -> Result<(), String> {
        let positive = [
            ("n_layer", self.n_layer),
            ("n_head", self.n_head),
            ("n_embd", self.n_embd),
            ("vocab_size", self.vocab_size),
        ];
        if let Some((name, _)) = positive.iter().find(|(_, v)| *v == 0) {
            return Err(format!("model.{name} must be at least 1"));
        }
        if self.block_size < 2 {
            return Err(format!("model.block_size must be at least 2, got {}", self.block_size));
        }
        if !self.n_embd.is_multiple_of(self.n_head) {
            return Err(format!("model.n_embd ({}) must be a multiple of model.n_head ({})", self.n_embd, self.n_head));
        }
        let limits = [
            ("n_layer", self.n_layer, 1 << 10),
            ("n_embd", self.n_embd, 1 << 16),
            ("block_size", self.block_size, 1 << 16),
            ("vocab_size", self.vocab_size, 1 << 24),
        ];
        if let Some((name, value, limit)) = limits.iter().find(|(_, v, limit)| v > limit) {
            return Err(format!("model.{name} is {value}, more than the built-in GPT's limit of {limit}"));
        }
        if self.num_params() > MAX_PARAMS {
            return Err(format!(
                "model.n_embd and model.n_layer give {} parameters, more than the built-in GPT's limit of {MAX_PARAMS}",
                self.num_params()
            ));
        }
        Ok(())
    }

    /// The units the [`Gpt`] declares, with their parameter counts, and the root's count
    /// (the tied token embedding; 0 when untied), for shapes within the limits.
    pub fn unit_params(&self) -> (Vec<(String, u64)>, u64) {
        let (d, v, t) = (self.n_embd as u64, self.vocab_size as u64, self.block_size as u64);
        let block = 4 * d * d + 3 * d + 4 * d + (d * 4 * d + 4 * d) + (4 * d * d + d);
        let (embed, head, root) =
            if self.tied_head { (t * d, 2 * d, v * d) } else { (t * d + v * d, 2 * d + d * v + v, 0) };
        let mut units = vec![("embed".to_string(), embed)];
        units.extend((0..self.n_layer).map(|i| (format!("blocks.{i}"), block)));
        units.push(("head".to_string(), head));
        (units, root)
    }

    /// Trainable parameters of this shape (no key bias; see [`Gpt`]). Saturates at
    /// `u64::MAX` for shapes far beyond [`validate`](Self::validate)'s limits.
    pub fn num_params(&self) -> u64 {
        if [self.n_embd, self.vocab_size, self.block_size, self.n_layer].iter().any(|&x| x as u64 > 1 << 32) {
            return u64::MAX;
        }
        let (d, v, t) = (self.n_embd as u128, self.vocab_size as u128, self.block_size as u128);
        // q, k, v, out projections (k without bias), 2 norms, MLP up and down.
        let block = 4 * d * d + 3 * d + 4 * d + (d * 4 * d + 4 * d) + (4 * d * d + d);
        let head = if self.tied_head { 0 } else { d * v + v };
        let total = v * d + t * d + self.n_layer as u128 * block + 2 * d + head;
        u64::try_from(total).unwrap_or(u64::MAX)
    }
}

/// Largest built-in GPT, in parameters (16 GiB of fp32 weights alone).
pub const MAX_PARAMS: u64 = 1 << 32;

const EMBEDDING_INIT: Initializer = Initializer::Normal { mean: 0.0, std: 0.02 };

/// One pre-norm transformer block.
#[derive(Module, Debug)]
pub struct Block {
    norm_attn: LayerNorm,
    attn: MultiHeadAttention,
    norm_mlp: LayerNorm,
    mlp_up: Linear,
    mlp_down: Linear,
    /// Low-rank adapters beside its layers ([`Gpt::with_lora`]); none by default.
    adapters: BlockAdapters,
}

/// The GPT. Attention has no key bias: softmax cancels it, so its gradient is zero.
#[derive(Module, Debug)]
pub struct Gpt {
    token: Embedding,
    position: Embedding,
    blocks: Vec<Block>,
    norm: LayerNorm,
    head: Option<Linear>,
    /// Its place on a device mesh (`None`: the whole model).
    #[module(skip)]
    mesh: Option<MeshPart>,
    /// The paths of the parameters [`Gpt::with_lora`] froze.
    #[module(skip)]
    frozen: Vec<String>,
}

impl Gpt {
    /// A model of shape `config` on `device`.
    pub fn new(config: &GptConfig, device: &Device) -> Self {
        let d = config.n_embd;
        let blocks = (0..config.n_layer).map(|_| Block::new(d, config.n_head, device)).collect();
        Self {
            // GPT-2's N(0, 0.02): Burn's default N(0, 1) makes tied-head logits huge at start.
            token: EmbeddingConfig::new(config.vocab_size, d).with_initializer(EMBEDDING_INIT).init(device),
            position: EmbeddingConfig::new(config.block_size, d).with_initializer(EMBEDDING_INIT).init(device),
            blocks,
            norm: LayerNormConfig::new(d).init(device),
            head: (!config.tied_head).then(|| LinearConfig::new(d, config.vocab_size).init(device)),
            mesh: None,
            frozen: Vec::new(),
        }
    }

    /// Logits `[batch, time, vocab]` for tokens `[batch, time]`.
    pub fn forward(&self, tokens: Tensor<2, Int>) -> Tensor<3> {
        self.head(self.trunk(tokens))
    }

    /// The residual stream after the last block `[batch, time, d]`.
    fn trunk(&self, tokens: Tensor<2, Int>) -> Tensor<3> {
        let at = positions(0, tokens.dims()[1], None, &tokens.device());
        let mut h = self.embed(tokens, at);
        for block in &self.blocks {
            h = block.run(h, self.tensor_group(), (None, None));
        }
        h
    }

    /// The group its layers are split over, on a mesh.
    fn tensor_group(&self) -> Option<&ParallelGroup> {
        self.mesh.as_ref().map(MeshPart::group)
    }

    /// The mean next-token loss of `tokens` `[batch, time + 1]` through the units' path
    /// (the head and loss over blocks of tokens).
    pub(crate) fn whole_loss(&self, tokens: &Tensor<2, Int>) -> Tensor<1> {
        unit_loss(self.head_loss(self.trunk(inputs(tokens)), (&LmBatch::new(tokens.clone()), 0)))
    }

    /// The final norm, the head and the mean next-token loss against `tokens`, whose
    /// position `first` is `h`'s first (the last unit), without the whole logits (nor, on
    /// a mesh, the whole vocabulary's).
    fn head_loss(&self, h: Tensor<3>, tokens: (&LmBatch, usize)) -> Tensor<3> {
        let h = self.norm.forward(h);
        let (weight, bias) = match &self.head {
            Some(head) => (head.weight.val().transpose(), head.bias.as_ref().map(|b| b.val())),
            None => (self.token.weight.val(), None),
        };
        head_loss(h, (weight, bias), tokens, self.mesh.as_ref().and_then(MeshPart::vocabulary))
    }

    /// Token plus position embeddings `[batch, time, d]` for tokens `[batch, time]` at
    /// `positions` (`[1, time]` or `[batch, time]`: [`positions`]).
    fn embed(&self, tokens: Tensor<2, Int>, positions: Tensor<2, Int>) -> Tensor<3> {
        let token = match &self.mesh {
            Some(mesh) => mesh.lookup(self.token.weight.val(), tokens),
            None => self.token.forward(tokens),
        };
        token + self.position.forward(positions)
    }

    /// The final norm and the output head (the token embedding, transposed, when tied);
    /// on a mesh, the vocabulary's parts gathered from the group.
    fn head(&self, h: Tensor<3>) -> Tensor<3> {
        let h = self.norm.forward(h);
        let h = match self.tensor_group() {
            Some(group) => group.copy_to(h),
            None => h,
        };
        let [b, t, d] = h.dims();
        let logits = match &self.head {
            Some(head) => head.forward(h),
            None => {
                let weight = self.token.weight.val(); // [vocab, d]
                let vocab = weight.dims()[0];
                h.reshape([b * t, d]).matmul(weight.transpose()).reshape([b, t, vocab])
            }
        };
        match &self.mesh {
            Some(mesh) => mesh.logits(logits),
            None => logits,
        }
    }

    /// Mean next-token cross-entropy (in f32) over `tokens` `[batch, time + 1]`.
    pub fn loss(&self, tokens: Tensor<2, Int>) -> Tensor<1> {
        self.next_token_loss(&tokens)
    }
}

impl Block {
    /// A block of width `d` with `n_head` heads and an MLP of width `4 d`, without dropout
    /// or attention key bias (softmax cancels it, so its gradient is zero and it would
    /// train on rounding noise).
    pub fn new(d: usize, n_head: usize, device: &Device) -> Self {
        Self {
            norm_attn: LayerNormConfig::new(d).init(device),
            attn: MultiHeadAttentionConfig::new(d, n_head).with_dropout(0.0).with_key_bias(false).init(device),
            norm_mlp: LayerNormConfig::new(d).init(device),
            mlp_up: LinearConfig::new(d, 4 * d).init(device),
            mlp_down: LinearConfig::new(4 * d, d).init(device),
            adapters: BlockAdapters::none(),
        }
    }

    /// Causal self-attention and the MLP, each residual, on `[batch, time, d]`. The
    /// attention is burn-nn's `MultiHeadAttention`'s projections around
    /// [`zerotrain::nn::causal_attention`] (what its `forward` computes with a causal mask,
    /// without keeping the `[time, time]` probabilities for backward).
    pub fn forward(&self, h: Tensor<3>) -> Tensor<3> {
        self.run(h, None, (None, None))
    }

    /// [`forward`](Self::forward) of this rank's part of the block: with `tensor`, its
    /// heads and its columns of the MLP (Megatron's column- and row-parallel pairs: each
    /// region entered through the group's copy, left through its sum, a row-parallel bias
    /// added once after it); with `seq`, `h` is this rank's part of each sequence and
    /// attention trades parts for heads over that group (DeepSpeed-Ulysses).
    fn run(
        &self,
        h: Tensor<3>,
        tensor: Option<&ParallelGroup>,
        (seq, packed): (Option<&ParallelGroup>, Option<&Packing>),
    ) -> Tensor<3> {
        let enter = |x: Tensor<3>| match tensor {
            Some(group) => group.copy_to(x),
            None => x,
        };
        let leave = |linear: &Linear, x: Tensor<3>| match tensor {
            Some(group) => {
                row_parallel_linear(x.clone(), linear.weight.val(), linear.bias.as_ref().map(|b| b.val()), group)
            }
            None => linear.forward(x.clone()),
        };
        let [query, key, value, output, up, down] = self.adapters.layers();
        let x = enter(self.norm_attn.forward(h.clone()));
        let attn = &self.attn;
        let heads = |linear: &Linear, adapter| {
            split_heads(adapted(adapter, linear.forward(x.clone()), x.clone()), attn.n_heads)
        };
        let (q, k, v) = (heads(&attn.query, query), heads(&attn.key, key), heads(&attn.value, value));
        let context = attention(q, k, v, seq, packed);
        let h = h + adapted(output, leave(&attn.output, context.clone()), context);
        let x = enter(self.norm_mlp.forward(h.clone()));
        let x = gelu(adapted(up, self.mlp_up.forward(x.clone()), x));
        h + adapted(down, leave(&self.mlp_down, x.clone()), x)
    }
}

/// One unit per block, the embeddings and the head. A tied token embedding is used by the
/// first and the last unit, so it is left to the root unit (gathered for the whole pass,
/// its two gradient contributions summed); untied, it belongs to the embedding unit and
/// the head to the last.
impl UnitModel for Gpt {
    /// Token sequences `[batch, time + 1]` (inputs and next-token targets) and which
    /// targets count.
    type Batch = LmBatch;
    /// The residual stream `[batch, time, d]`; after the last unit, the mean loss
    /// `[1, 1, 1]`.
    type Hidden = Tensor<3>;

    fn units(&self) -> Vec<UnitSpec> {
        let tied = self.head.is_none();
        let embed: &[&str] = if tied { &["position"] } else { &["token", "position"] };
        let head: &[&str] = if tied { &["norm"] } else { &["norm", "head"] };
        let blocks = (0..self.blocks.len()).map(|i| UnitSpec::new(format!("blocks.{i}"), [format!("blocks.{i}")]));
        std::iter::once(UnitSpec::new("embed", embed.iter().copied()))
            .chain(blocks)
            .chain(std::iter::once(UnitSpec::new("head", head.iter().copied())))
            .collect()
    }

    fn shared(&self) -> Vec<String> {
        // The tied token embedding serves the first unit and the head.
        if self.head.is_none() { vec!["token".into()] } else { Vec::new() }
    }

    fn forward_unit(&self, unit: usize, input: Option<Tensor<3>>, tokens: &Self::Batch) -> Tensor<3> {
        let blocks = &self.blocks;
        // On a mesh with sequence parallelism, this rank's part of every sequence.
        let mesh = self.mesh.as_ref();
        let seq = mesh.and_then(MeshPart::sequence);
        let embed = |ids: Tensor<2, Int>| {
            let (ids, first) = match mesh {
                Some(mesh) => mesh.inputs(ids),
                None => (ids, 0),
            };
            let t = ids.dims()[1];
            let at = positions(first, t, tokens.packing(first, t).as_ref(), &ids.device());
            self.embed(ids, at)
        };
        let head = |h: Tensor<3>| {
            let first = mesh.map_or(0, |m| m.first(h.dims()[1]));
            self.head_loss(h, (tokens, first))
        };
        let block = |i: usize, h: Tensor<3>| {
            let t = h.dims()[1];
            let first = mesh.map_or(0, |m| m.first(t));
            blocks[i].run(h, self.tensor_group(), (seq, tokens.packing(first, t).as_ref()))
        };
        decoder_unit(unit, input, tokens, blocks.len(), embed, block, head)
    }

    fn output_loss(&self, loss: Tensor<3>, _: &Self::Batch) -> Tensor<1> {
        unit_loss(loss)
    }

    fn batch_size(&self, batch: &Self::Batch) -> Option<usize> {
        Some(batch.rows())
    }

    /// The base [`Gpt::with_lora`] froze; none otherwise.
    fn frozen_parameters(&self) -> Vec<String> {
        self.frozen.clone()
    }

    /// On a mesh ([`Gpt::new_split`]), its split; the whole model has none.
    fn model_split(&self) -> Option<ModelSplit> {
        self.mesh.as_ref().map(MeshPart::model_split)
    }

    /// The blocks' six linear layers (`blocks.{i}.attn.query` ... `blocks.{i}.mlp_down`):
    /// the embedding and head units hold matrices too, which QLoRA keeps as they are.
    fn quantizable_parameters(&self) -> Option<Vec<String>> {
        Some(lora::block_linears(self.blocks.len()).collect())
    }
}
