//! A GPT-style decoder: token and position embeddings, pre-norm transformer blocks with
//! causal self-attention and an MLP, a final norm and a (tied or untied) output head.

use burn::module::Module;
use burn::nn::attention::{MultiHeadAttention, MultiHeadAttentionConfig};
use burn::nn::{Embedding, EmbeddingConfig, Initializer, LayerNorm, LayerNormConfig, Linear, LinearConfig};
use burn::tensor::activation::gelu;
use burn::tensor::{Device, Int, Tensor};
use serde::{Deserialize, Serialize};

use super::causal_lm::{CausalLm, decoder_unit, head_loss, inputs, unit_loss};
use zerotrain::engine::{UnitModel, UnitSpec};
use zerotrain::nn::causal_attention;

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
}

/// The GPT. Attention has no key bias: softmax cancels it, so its gradient is zero.
#[derive(Module, Debug)]
pub struct Gpt {
    token: Embedding,
    position: Embedding,
    blocks: Vec<Block>,
    norm: LayerNorm,
    head: Option<Linear>,
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
        }
    }

    /// Logits `[batch, time, vocab]` for tokens `[batch, time]`.
    pub fn forward(&self, tokens: Tensor<2, Int>) -> Tensor<3> {
        self.head(self.trunk(tokens))
    }

    /// The residual stream after the last block `[batch, time, d]`.
    fn trunk(&self, tokens: Tensor<2, Int>) -> Tensor<3> {
        let mut h = self.embed(tokens);
        for block in &self.blocks {
            h = block.forward(h);
        }
        h
    }

    /// The mean next-token loss of `tokens` `[batch, time + 1]` through the units' path
    /// (the head and loss over blocks of tokens).
    pub(crate) fn whole_loss(&self, tokens: &Tensor<2, Int>) -> Tensor<1> {
        unit_loss(self.head_loss(self.trunk(inputs(tokens)), tokens))
    }

    /// The final norm, the head and the mean next-token loss against `tokens` (the last
    /// unit), without the whole logits.
    fn head_loss(&self, h: Tensor<3>, tokens: &Tensor<2, Int>) -> Tensor<3> {
        let h = self.norm.forward(h);
        let (weight, bias) = match &self.head {
            Some(head) => (head.weight.val().transpose(), head.bias.as_ref().map(|b| b.val())),
            None => (self.token.weight.val(), None),
        };
        head_loss(h, (weight, bias), (tokens, 0), None)
    }

    /// Token plus position embeddings `[batch, time, d]` for tokens `[batch, time]`.
    fn embed(&self, tokens: Tensor<2, Int>) -> Tensor<3> {
        let [_, t] = tokens.dims();
        let positions = Tensor::<1, Int>::arange(0..t as i64, &tokens.device()).reshape([1, t]);
        self.token.forward(tokens) + self.position.forward(positions)
    }

    /// The final norm and the output head (the token embedding, transposed, when tied).
    fn head(&self, h: Tensor<3>) -> Tensor<3> {
        let h = self.norm.forward(h);
        let [b, t, d] = h.dims();
        match &self.head {
            Some(head) => head.forward(h),
            None => {
                let weight = self.token.weight.val(); // [vocab, d]
                let vocab = weight.dims()[0];
                h.reshape([b * t, d]).matmul(weight.transpose()).reshape([b, t, vocab])
            }
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
        }
    }

    /// Causal self-attention and the MLP, each residual, on `[batch, time, d]`. The
    /// attention is burn-nn's `MultiHeadAttention`'s projections around
    /// [`zerotrain::nn::causal_attention`] (what its `forward` computes with a causal mask,
    /// without keeping the `[time, time]` probabilities for backward).
    pub fn forward(&self, h: Tensor<3>) -> Tensor<3> {
        let [b, t, d] = h.dims();
        let x = self.norm_attn.forward(h.clone());
        let attn = &self.attn;
        let heads = |linear: &Linear| linear.forward(x.clone()).reshape([b, t, attn.n_heads, attn.d_k]).swap_dims(1, 2);
        let scale = (attn.d_k as f32).sqrt().recip();
        let context = causal_attention(heads(&attn.query), heads(&attn.key), heads(&attn.value), scale);
        let h = h + attn.output.forward(context.swap_dims(1, 2).reshape([b, t, d]));
        let m = self.mlp_down.forward(gelu(self.mlp_up.forward(self.norm_mlp.forward(h.clone()))));
        h + m
    }
}

/// One unit per block, the embeddings and the head. A tied token embedding is used by the
/// first and the last unit, so it is left to the root unit (gathered for the whole pass,
/// its two gradient contributions summed); untied, it belongs to the embedding unit and
/// the head to the last.
impl UnitModel for Gpt {
    /// Token sequences `[batch, time + 1]`: inputs and next-token targets.
    type Batch = Tensor<2, Int>;
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
        decoder_unit(
            unit,
            input,
            tokens,
            blocks.len(),
            |ids| self.embed(ids),
            |i, h| blocks[i].forward(h),
            |h| self.head_loss(h, tokens),
        )
    }

    fn output_loss(&self, loss: Tensor<3>, _: &Self::Batch) -> Tensor<1> {
        unit_loss(loss)
    }

    fn batch_size(&self, tokens: &Self::Batch) -> Option<usize> {
        Some(tokens.dims()[0])
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::tensor::TensorData;
    use zerotrain::engine::ParamCount;

    #[test]
    fn the_parameter_formula_counts_the_built_model() {
        let device = Device::flex().autodiff();
        for tied_head in [true, false] {
            let config = GptConfig { n_layer: 2, n_head: 2, n_embd: 16, block_size: 8, vocab_size: 11, tied_head };
            let model = Gpt::new(&config, &device);
            assert_eq!(ParamCount::trainable(&model), config.num_params(), "tied {tied_head}");
            let (units, root) = config.unit_params();
            assert_eq!(units.iter().map(|(_, n)| n).sum::<u64>() + root, config.num_params());
            assert_eq!(units.len(), model.units().len());
            let loss =
                model.loss(Tensor::<2, Int>::from_data(TensorData::new(vec![1i64, 2, 3, 4, 5, 6], [2, 3]), &device));
            assert!(loss.into_scalar::<f32>() > 0.0);
        }
        assert!(
            GptConfig { n_head: 3, vocab_size: 5, ..GptConfig::default() }.validate().unwrap_err().contains("multiple")
        );
    }
}
