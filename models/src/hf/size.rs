//! The size of a family's model from its `config.json` alone, before anything is built
//! ([`ModelSize`]): a config may ask for millions of layers, and building even lazy
//! parameters for them would take the machine's memory before any check against the
//! weights or the estimate could refuse it.

use super::config::{Family, Gpt2Shape, HfConfig, LlamaShape};

/// Bytes of memory one parameter tensor costs before it holds a value (Burn's lazy
/// parameter, its initialiser, the name and shape recorded while the model is built):
/// an upper bound, measured at a few hundred bytes.
pub const BYTES_PER_LAZY_TENSOR: u64 = 1024;

/// What a model of a config holds: tensors, parameters, and its largest layer (a block, or
/// an embedding or head), saturating at `u64::MAX` for shapes no machine holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ModelSize {
    /// Parameter tensors.
    pub tensors: u64,
    /// Parameters.
    pub params: u64,
    /// Parameters of the largest layer.
    pub largest_layer: u64,
}

impl ModelSize {
    /// The size of `config`'s model.
    pub fn of(config: &HfConfig) -> Self {
        match &config.family {
            Family::Gpt2(s) => gpt2(s),
            Family::Llama(s) => llama(s),
        }
    }

    /// The memory building the model costs before any parameter holds a value.
    pub fn build_bytes(&self) -> u64 {
        self.tensors.saturating_mul(BYTES_PER_LAZY_TENSOR)
    }
}

/// `blocks` blocks of `block` (tensors, parameters) between the other layers, in u128 and
/// then saturated.
fn total(blocks: usize, block: (u128, u128), others: &[(u128, u128)]) -> ModelSize {
    let n = blocks as u128;
    let tensors = n * block.0 + others.iter().map(|o| o.0).sum::<u128>();
    let params = n * block.1 + others.iter().map(|o| o.1).sum::<u128>();
    let largest = others.iter().map(|o| o.1).chain((blocks > 0).then_some(block.1)).max().unwrap_or(0);
    let sat = |x: u128| u64::try_from(x).unwrap_or(u64::MAX);
    ModelSize { tensors: sat(tensors), params: sat(params), largest_layer: sat(largest) }
}

/// GPT-2: token and position embeddings (the head is the token embedding), blocks of two
/// LayerNorms, the fused q/k/v and output projections and the MLP, all with biases, and
/// the final LayerNorm.
fn gpt2(s: &Gpt2Shape) -> ModelSize {
    let (d, inner) = (s.n_embd as u128, s.n_inner as u128);
    let linear = |i: u128, o: u128| (2, i * o + o);
    let parts = [(2, 2 * d), linear(d, 3 * d), linear(d, d), (2, 2 * d), linear(d, inner), linear(inner, d)];
    let block = parts.iter().fold((0, 0), |a, p| (a.0 + p.0, a.1 + p.1));
    let (vocab, positions) = (s.vocab_size as u128, s.n_positions as u128);
    total(s.n_layer, block, &[(1, vocab * d), (1, positions * d), (2, 2 * d)])
}

/// The LLaMA family: the token embedding, blocks of two RMSNorms, the q/k/v/o projections
/// (biases as the config says, Qwen3's per-head norms) and the gated MLP, the final norm,
/// and the head unless tied.
fn llama(s: &LlamaShape) -> ModelSize {
    let (d, hd, inner) = (s.hidden_size as u128, s.head_dim as u128, s.intermediate_size as u128);
    let (q, kv) = (s.num_attention_heads as u128 * hd, s.num_key_value_heads as u128 * hd);
    let linear = |i: u128, o: u128, bias: bool| (1 + u128::from(bias), i * o + if bias { o } else { 0 });
    let mut parts = vec![
        (1, d),
        linear(d, q, s.qkv_bias),
        linear(d, kv, s.qkv_bias),
        linear(d, kv, s.qkv_bias),
        linear(q, d, s.o_bias),
        (1, d),
        linear(d, inner, s.mlp_bias),
        linear(d, inner, s.mlp_bias),
        linear(inner, d, s.mlp_bias),
    ];
    if s.qk_norm {
        parts.extend([(1, hd), (1, hd)]);
    }
    let block = parts.iter().fold((0, 0), |a, p| (a.0 + p.0, a.1 + p.1));
    let embed = (1, s.vocab_size as u128 * d);
    let head = if s.tie_word_embeddings { (0, 0) } else { embed };
    total(s.num_hidden_layers, block, &[embed, (1, d), head])
}

/// Bytes of activations a training step keeps for a micro-batch of `micro` sequences of
/// `context` tokens in f32, as the models here run: per layer Megatron's count of 34
/// values per token and width (in 2-byte values: doubled), without its 5 per token pair
/// and head (the fused attention keeps no `[time, time]` scores); with recomputation
/// (`recompute`), each layer's input instead and one layer's activations at a time. The
/// loss holds one block of logits at a time, with their log-softmax and gradient
/// (3 values each; [`LinearCrossEntropy`](zerotrain::nn::LinearCrossEntropy)'s blocks).
pub fn activation_bytes(config: &HfConfig, micro: u64, context: usize, recompute: bool) -> u64 {
    let (layers, width) = match &config.family {
        Family::Gpt2(s) => (s.n_layer, s.n_embd),
        Family::Llama(s) => (s.num_hidden_layers, s.hidden_size),
    };
    let (t, b, layers, width) = (context as u128, u128::from(micro), layers as u128, width as u128);
    let layer = 2 * 34 * t * width * b;
    let kept = match recompute {
        false => layers * layer,
        true => layers * 4 * t * width * b + layer,
    };
    let block = (t * b * config.vocab_size() as u128).min(zerotrain::nn::LinearCrossEntropy::BLOCK_ELEMENTS as u128);
    u64::try_from(kept + 12 * block).unwrap_or(u64::MAX)
}

/// The memory this machine can still give (Linux's `MemAvailable`), in bytes; `None` where
/// it does not say.
pub fn available_memory() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemAvailable:"))?;
    line.split_whitespace().nth(1)?.parse::<u64>().ok().map(|kib| kib.saturating_mul(1024))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// The sizes computed from the shape equal what building the model records (every
    /// family, biases, per-head norms, tied and untied heads, an MLP width of its own).
    #[test]
    fn the_size_from_the_config_is_the_built_models() {
        let configs = [
            json!({"model_type": "gpt2", "n_embd": 16, "n_layer": 3, "n_head": 2, "n_positions": 12, "vocab_size": 50}),
            json!({"model_type": "gpt2", "n_embd": 8, "n_layer": 1, "n_head": 2, "n_positions": 4, "vocab_size": 9,
                   "n_inner": 20}),
            json!({"model_type": "llama", "hidden_size": 16, "intermediate_size": 24, "num_hidden_layers": 2,
                   "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 30, "tie_word_embeddings": false,
                   "attention_bias": true, "mlp_bias": true, "head_dim": 6}),
            json!({"model_type": "qwen2", "hidden_size": 8, "intermediate_size": 12, "num_hidden_layers": 3,
                   "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 20, "tie_word_embeddings": true}),
            json!({"model_type": "qwen3", "hidden_size": 8, "intermediate_size": 12, "num_hidden_layers": 2,
                   "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 20, "head_dim": 6}),
        ];
        for json in configs {
            let config = HfConfig::from_json(json.clone()).unwrap();
            let names = crate::family::parameter_names(&config);
            let params: Vec<u64> = names.iter().map(|(_, s)| s.iter().product::<usize>() as u64).collect();
            let mut layers: std::collections::BTreeMap<String, u64> = Default::default();
            for ((path, _), n) in names.iter().zip(&params) {
                let parts: Vec<&str> = path.split('.').collect();
                let depth = if parts.len() > 3 && parts[2].parse::<usize>().is_ok() { 3 } else { parts.len() - 1 };
                *layers.entry(parts[..depth].join(".")).or_default() += n;
            }
            let built = ModelSize {
                tensors: names.len() as u64,
                params: params.iter().sum(),
                largest_layer: layers.values().copied().max().unwrap(),
            };
            assert_eq!(ModelSize::of(&config), built, "{json}");
        }
    }

    /// The largest shape a config may ask for is sized without building anything, and
    /// saturates rather than overflowing.
    #[test]
    fn a_config_of_millions_of_layers_is_sized_not_built() {
        let json = json!({"model_type": "llama", "hidden_size": 1 << 24, "intermediate_size": 1 << 24,
            "num_hidden_layers": 1 << 24, "num_attention_heads": 1, "vocab_size": 1 << 24});
        let size = ModelSize::of(&HfConfig::from_json(json).unwrap());
        assert_eq!(size.tensors, 9 * (1 << 24) + 3);
        assert_eq!(size.params, u64::MAX);
        assert!(size.build_bytes() > 100 << 30, "more than any machine here has");
    }
}
