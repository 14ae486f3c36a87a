//! A Hugging Face `config.json`, read into the shape of one of the built-in families
//! ([`Family`]): GPT-2 (`GPT2LMHeadModel`) or the LLaMA family (`LlamaForCausalLM`,
//! `Qwen2ForCausalLM`, `Qwen3ForCausalLM`, `MistralForCausalLM`). The file's own JSON is kept, so an export
//! writes it back with only what training changed.

use std::path::Path;

use serde_json::Value;

use super::fields::{field, positive, required};
use super::rope::{self, RopeScaling};
use crate::file_error::FileError;

/// The built-in model family a `config.json` describes, with its shape.
#[derive(Debug, Clone, PartialEq)]
pub enum Family {
    /// `model_type: "gpt2"`.
    Gpt2(Gpt2Shape),
    /// `model_type: "llama" | "qwen2" | "qwen3" | "mistral"`.
    Llama(LlamaShape),
}

/// GPT-2's shape: learned positions, LayerNorm, a tanh-GELU MLP, a head tied to the token
/// embedding.
#[derive(Debug, Clone, PartialEq)]
pub struct Gpt2Shape {
    /// `vocab_size`: rows of the token embedding and the head.
    pub vocab_size: usize,
    /// `n_positions`: the longest context.
    pub n_positions: usize,
    /// `n_embd`: the model's width.
    pub n_embd: usize,
    /// `n_layer`: blocks.
    pub n_layer: usize,
    /// `n_head`: attention heads (dividing `n_embd`).
    pub n_head: usize,
    /// `n_inner`, `4 * n_embd` when null.
    pub n_inner: usize,
    /// `layer_norm_epsilon`.
    pub layer_norm_epsilon: f64,
}

/// The LLaMA family's shape: RMSNorm, rotary positions, a SwiGLU MLP, grouped-query
/// attention.
#[derive(Debug, Clone, PartialEq)]
pub struct LlamaShape {
    /// `model_type`, as written (`llama`, `qwen2`, `qwen3` or `mistral`).
    pub model_type: String,
    /// `vocab_size`.
    pub vocab_size: usize,
    /// `hidden_size`: the model's width.
    pub hidden_size: usize,
    /// `intermediate_size`: the MLP's width.
    pub intermediate_size: usize,
    /// `num_hidden_layers`.
    pub num_hidden_layers: usize,
    /// `num_attention_heads`: query heads.
    pub num_attention_heads: usize,
    /// `num_key_value_heads` (default: as many as query heads): each serves
    /// `num_attention_heads / num_key_value_heads` query heads.
    pub num_key_value_heads: usize,
    /// `head_dim` (default `hidden_size / num_attention_heads`).
    pub head_dim: usize,
    /// `max_position_embeddings`: the longest context.
    pub max_position_embeddings: usize,
    /// `rms_norm_eps`.
    pub rms_norm_eps: f64,
    /// `rope_theta` (or `rope_parameters.rope_theta`): the rotary base (default 10000).
    pub rope_theta: f64,
    /// `rope_scaling` (or `rope_parameters`' scaling).
    pub rope_scaling: RopeScaling,
    /// `tie_word_embeddings`: the head is the token embedding, transposed.
    pub tie_word_embeddings: bool,
    /// Biases on the q, k and v projections (`attention_bias`; always in Qwen2).
    pub qkv_bias: bool,
    /// A bias on the output projection (`attention_bias` in LLaMA; never in Qwen2).
    pub o_bias: bool,
    /// Biases on the MLP's projections (`mlp_bias`).
    pub mlp_bias: bool,
    /// An RMSNorm over each head's queries and keys before the rotation (`q_norm`,
    /// `k_norm`: Qwen3).
    pub qk_norm: bool,
    /// `sliding_window`, where it is in effect (Qwen2's only with `use_sliding_window`) and
    /// shorter than the positions: each token attends to the last `sliding_window` tokens
    /// only. Not built: a run's context may be at most this long, where the window covers
    /// it and attention is the full causal one.
    pub sliding_window: Option<usize>,
}

/// A `config.json`: its family and shape, and the JSON as read.
#[derive(Debug, Clone)]
pub struct HfConfig {
    /// The family and its shape.
    pub family: Family,
    /// The file's JSON object, written back by an export.
    pub json: Value,
}

impl HfConfig {
    /// Reads `path`.
    pub fn read(path: &Path) -> Result<Self, FileError> {
        let error = |message: String| FileError::new(path, message);
        let text = crate::file_error::read_text(path)?;
        let json: Value = serde_json::from_str(&text).map_err(|e| error(format!("not JSON: {e}")))?;
        Self::from_json(json).map_err(error)
    }

    /// The family and shape of a `config.json`'s JSON, or what is wrong, naming the field.
    pub fn from_json(json: Value) -> Result<Self, String> {
        let Some(object) = json.as_object() else { return Err("not a JSON object".into()) };
        let model_type = match object.get("model_type") {
            Some(Value::String(s)) => s.clone(),
            Some(other) => return Err(format!("model_type must be a string, not {other}")),
            None => return Err("has no model_type (gpt2, llama, qwen2, qwen3 or mistral)".into()),
        };
        let family = match model_type.as_str() {
            "gpt2" => Family::Gpt2(gpt2(&json)?),
            "llama" | "qwen2" | "qwen3" | "mistral" => Family::Llama(llama(&json, model_type)?),
            other => {
                return Err(format!(
                    "model_type `{other}` is not a family zerotrain builds: gpt2, llama, qwen2, qwen3 or mistral"
                ));
            }
        };
        Ok(Self { family, json })
    }

    /// Its `model_type` (`gpt2`, `llama`, `qwen2`, `qwen3` or `mistral`).
    pub fn model_type(&self) -> &str {
        self.json.get("model_type").and_then(Value::as_str).unwrap_or("?")
    }

    /// The vocabulary size.
    pub fn vocab_size(&self) -> usize {
        match &self.family {
            Family::Gpt2(s) => s.vocab_size,
            Family::Llama(s) => s.vocab_size,
        }
    }

    /// Its blocks (`n_layer` or `num_hidden_layers`).
    pub fn num_layers(&self) -> usize {
        match &self.family {
            Family::Gpt2(s) => s.n_layer,
            Family::Llama(s) => s.num_hidden_layers,
        }
    }

    /// The longest context the model's positions cover.
    pub fn max_context(&self) -> usize {
        match &self.family {
            Family::Gpt2(s) => s.n_positions,
            Family::Llama(s) => s.max_position_embeddings,
        }
    }

    /// The config key of [`exact_context`](Self::exact_context)'s bound (`n_positions`,
    /// `max_position_embeddings` or `sliding_window`).
    pub fn context_key(&self) -> &'static str {
        match &self.family {
            Family::Gpt2(_) => "n_positions",
            Family::Llama(LlamaShape { sliding_window: Some(_), .. }) => "sliding_window",
            Family::Llama(_) => "max_position_embeddings",
        }
    }

    /// The longest context the built model computes exactly: its positions', or a sliding
    /// attention window's where one is shorter. Its message names the bound.
    pub fn exact_context(&self) -> (usize, String) {
        match &self.family {
            Family::Llama(LlamaShape { sliding_window: Some(window), .. }) => (
                *window,
                format!(
                    "the model's sliding_window ({window}): sliding-window attention is not built, and within it attention is the full causal one"
                ),
            ),
            _ => (self.max_context(), format!("the model's positions ({})", self.max_context())),
        }
    }
}

/// A positive size, at most `limit`.
fn size(json: &Value, name: &str, default: Option<usize>) -> Result<usize, String> {
    let value = match default {
        Some(d) => field(json, name)?.unwrap_or(d),
        None => required(json, name)?,
    };
    if value == 0 || value > 1 << 24 {
        return Err(format!("{name} is {value}: it must be between 1 and {}", 1 << 24));
    }
    Ok(value)
}

/// A positive number, `default` where the file has none.
fn positive_or(json: &Value, name: &str, default: f64) -> Result<f64, String> {
    positive(field(json, name)?.unwrap_or(default), name)
}

fn gpt2(json: &Value) -> Result<Gpt2Shape, String> {
    let n_embd = size(json, "n_embd", Some(768))?;
    let n_head = size(json, "n_head", Some(12))?;
    if !n_embd.is_multiple_of(n_head) {
        return Err(format!("n_embd ({n_embd}) must be a multiple of n_head ({n_head})"));
    }
    let activation: Option<String> = field(json, "activation_function")?;
    if let Some(a) = activation.filter(|a| a != "gelu_new" && a != "gelu_pytorch_tanh") {
        return Err(format!("activation_function `{a}` is not built: GPT-2's is gelu_new"));
    }
    if field::<bool>(json, "tie_word_embeddings")? == Some(false) {
        return Err(
            "tie_word_embeddings is false: the built GPT-2 ties its head to wte, as GPT2LMHeadModel does".into()
        );
    }
    for flag in ["scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn"] {
        if field::<bool>(json, flag)? == Some(true) {
            return Err(format!("{flag} is true: not built (GPT-2's checkpoints leave it false)"));
        }
    }
    if field::<bool>(json, "scale_attn_weights")? == Some(false) {
        return Err("scale_attn_weights is false: not built (GPT-2 scales by 1/sqrt(head size))".into());
    }
    Ok(Gpt2Shape {
        vocab_size: size(json, "vocab_size", Some(50257))?,
        n_positions: size(json, "n_positions", Some(1024))?,
        n_embd,
        n_layer: size(json, "n_layer", Some(12))?,
        n_head,
        n_inner: size(json, "n_inner", Some(4 * n_embd))?,
        layer_norm_epsilon: positive_or(json, "layer_norm_epsilon", 1e-5)?,
    })
}

fn llama(json: &Value, model_type: String) -> Result<LlamaShape, String> {
    let hidden_size = size(json, "hidden_size", None)?;
    let heads = size(json, "num_attention_heads", None)?;
    let kv_heads = size(json, "num_key_value_heads", Some(heads))?;
    if !heads.is_multiple_of(kv_heads) {
        return Err(format!("num_attention_heads ({heads}) must be a multiple of num_key_value_heads ({kv_heads})"));
    }
    if field::<usize>(json, "head_dim")?.is_none() && !hidden_size.is_multiple_of(heads) {
        return Err(format!("hidden_size ({hidden_size}) must be a multiple of num_attention_heads ({heads})"));
    }
    let head_dim = size(json, "head_dim", Some(hidden_size / heads))?;
    if !head_dim.is_multiple_of(2) {
        return Err(format!("head_dim ({head_dim}) must be even for rotary positions"));
    }
    let act: String = field(json, "hidden_act")?.unwrap_or_else(|| "silu".into());
    if act != "silu" {
        return Err(format!("hidden_act `{act}` is not built: the LLaMA family's is silu"));
    }
    let max_positions = size(json, "max_position_embeddings", Some(2048))?;
    let sliding: Option<usize> = field(json, "sliding_window")?;
    let sliding_on = match model_type.as_str() {
        "qwen2" | "qwen3" => field::<bool>(json, "use_sliding_window")?.unwrap_or(false),
        _ => true,
    };
    let sliding_window = sliding.filter(|&w| sliding_on && w < max_positions);
    let (rope_theta, rope_scaling) = rope::rotary(json)?;
    let qwen = model_type == "qwen2";
    let attention_bias = field::<bool>(json, "attention_bias")?.unwrap_or(false);
    Ok(LlamaShape {
        vocab_size: size(json, "vocab_size", None)?,
        hidden_size,
        intermediate_size: size(json, "intermediate_size", None)?,
        num_hidden_layers: size(json, "num_hidden_layers", None)?,
        num_attention_heads: heads,
        num_key_value_heads: kv_heads,
        head_dim,
        max_position_embeddings: max_positions,
        rms_norm_eps: positive_or(json, "rms_norm_eps", 1e-6)?,
        rope_theta,
        rope_scaling,
        tie_word_embeddings: field(json, "tie_word_embeddings")?.unwrap_or(false),
        qkv_bias: qwen || attention_bias,
        o_bias: !qwen && attention_bias,
        mlp_bias: field(json, "mlp_bias")?.unwrap_or(false),
        qk_norm: model_type == "qwen3",
        sliding_window,
        model_type,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn parse(v: Value) -> Result<Family, String> {
        HfConfig::from_json(v).map(|c| c.family)
    }

    #[test]
    fn families_read_their_fields_and_defaults() {
        let Family::Gpt2(g) = parse(json!({"model_type": "gpt2", "n_embd": 64, "n_head": 4})).unwrap() else {
            panic!("gpt2")
        };
        assert_eq!((g.n_inner, g.vocab_size, g.n_positions, g.n_layer), (256, 50257, 1024, 12));
        let qwen = json!({"model_type": "qwen2", "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100, "tie_word_embeddings": true,
            "sliding_window": 32, "use_sliding_window": false, "rope_theta": 1e6});
        let Family::Llama(q) = parse(qwen).unwrap() else { panic!("qwen2") };
        assert_eq!(
            (q.head_dim, q.qkv_bias, q.o_bias, q.tie_word_embeddings, q.rope_theta),
            (16, true, false, true, 1e6)
        );
        let qwen3 = json!({"model_type": "qwen3", "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 100});
        let Family::Llama(q) = parse(qwen3).unwrap() else { panic!("qwen3") };
        assert_eq!((q.head_dim, q.qk_norm, q.qkv_bias, q.o_bias), (32, true, false, false));
    }

    #[test]
    fn what_is_not_built_is_refused_by_field() {
        let base = json!({"model_type": "llama", "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
            "num_attention_heads": 4, "vocab_size": 100});
        fn with_ok(base: &Value, key: &str, value: Value) -> Value {
            let mut v = base.clone();
            v[key] = value;
            v
        }
        let with = |key: &str, value: Value| {
            let mut v = base.clone();
            v[key] = value;
            parse(v).unwrap_err()
        };
        assert!(with("num_key_value_heads", json!(3)).contains("num_key_value_heads"));
        assert!(with("rope_scaling", json!({"rope_type": "yarn", "factor": 2.0})).contains("rope_scaling.rope_type"));
        assert!(with("rope_scaling", json!({"rope_type": "linear"})).contains("factor"));
        assert!(with("hidden_act", json!("gelu")).contains("hidden_act"));
        assert!(with("model_type", json!("bert")).contains("`bert`"));
        let Family::Llama(windowed) = parse(with_ok(&base, "sliding_window", json!(16))).unwrap() else { panic!() };
        assert_eq!(windowed.sliding_window, Some(16));
        assert!(with("hidden_size", json!(0)).contains("hidden_size is 0"));
        assert!(parse(json!({"n_embd": 4})).unwrap_err().contains("model_type"));
        let err = HfConfig::read(Path::new("/nonexistent/config.json")).unwrap_err().to_string();
        assert!(err.starts_with("/nonexistent/config.json: cannot read it"), "{err}");
    }
}
