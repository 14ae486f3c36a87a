//! PEFT's `LoraConfig`, read by its own key names: from a config's `zerotrain.lora` section
//! or from the `adapter_config.json` PEFT writes beside an adapter ([`LoraConfig::from_json`]),
//! and written back as PEFT writes it ([`LoraConfig::to_peft_json`], in `peft_file.rs`).
//!
//! # Note: what is accepted
//! Every key PEFT's `LoraConfig` writes is accepted. Those zerotrain builds take any value
//! PEFT allows (`r`, `lora_alpha`, `lora_dropout`, `target_modules`, `exclude_modules`,
//! `use_rslora`, `modules_to_save`, `init_lora_weights` true, `"gaussian"` or false,
//! `layers_to_transform`, `layers_pattern`, `rank_pattern`, `alpha_pattern`,
//! `fan_in_fan_out`); those that only say where the adapter came from are kept as they are
//! (`base_model_name_or_path`, `revision`, `peft_version`, `inference_mode`, `auto_mapping`,
//! `task_type` `CAUSAL_LM`); the rest ask for variants zerotrain does not build (DoRA, LoRA
//! biases, LoftQ, Megatron's layers, ...) and are accepted only at the value that turns them
//! off, any other value refused by its key. A key PEFT does not write either is refused
//! unless its value is empty (`null`, `false`, `{}`, `[]`): a newer PEFT's switch left off
//! changes nothing, one turned on would otherwise be dropped silently.

use std::collections::BTreeMap;

use regex::Regex;
use serde_json::{Map, Value, json};

pub use super::matching::Targets;
use crate::config::ConfigError;

/// How a new adapter's factors start (`init_lora_weights`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LoraInit {
    /// `true`: A as PyTorch's `nn.Linear` (Kaiming-uniform, bound `1 / sqrt(in)`), B zero:
    /// the adapted model starts as the base.
    KaimingZero,
    /// `"gaussian"`: A normal with standard deviation `1 / r`, B zero.
    GaussianZero,
    /// `false`: both as `nn.Linear` (B's bound `1 / sqrt(r)`), so the adapter is not zero
    /// (PEFT's option for tests).
    Random,
}

/// The adapter one module gets: its rank, alpha, scaling, dropout and initialisation.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdapterSpec {
    /// Rank `r`.
    pub r: usize,
    /// `lora_alpha` (or the module's `alpha_pattern` entry).
    pub alpha: f64,
    /// The factor of `B A x`: `alpha / r`, or `alpha / sqrt(r)` with rslora.
    pub scaling: f64,
    /// Dropout probability on the adapter's input.
    pub dropout: f64,
    /// How the factors start.
    pub init: LoraInit,
}

/// PEFT's `LoraConfig` (see the module note on what is accepted).
#[derive(Debug, Clone)]
pub struct LoraConfig {
    /// Default rank. PEFT's default 8.
    pub r: usize,
    /// Default alpha. PEFT's default 8.
    pub lora_alpha: f64,
    /// Dropout on each adapter's input, in `[0, 1)`. Default 0.
    pub lora_dropout: f64,
    /// The modules adapted; `None`: the family's defaults (PEFT's table: LLaMA's `q_proj`
    /// and `v_proj`, GPT-2's `c_attn`).
    pub target_modules: Option<Targets>,
    /// Modules left without an adapter even where `target_modules` names them.
    pub exclude_modules: Option<Targets>,
    /// Scale by `alpha / sqrt(r)` instead of `alpha / r`.
    pub use_rslora: bool,
    /// Modules trained whole beside the adapters (their path, or a name it ends in).
    pub modules_to_save: Vec<String>,
    /// How new adapters start.
    pub init_lora_weights: LoraInit,
    /// Only the layers of these indices are adapted (`None`: all).
    pub layers_to_transform: Option<Vec<usize>>,
    /// The names of the module lists whose index `layers_to_transform` reads (`None`: the
    /// first number in the path after a dot).
    pub layers_pattern: Option<Vec<String>>,
    /// Per-module ranks, by pattern (`(.*\.)?pattern` must match the whole path).
    pub rank_pattern: BTreeMap<String, usize>,
    /// Per-module alphas, by pattern.
    pub alpha_pattern: BTreeMap<String, f64>,
    /// The base stores its weight `[in, out]` (GPT-2's `Conv1D`); PEFT writes it per model.
    pub fan_in_fan_out: bool,
    /// The keys as given that only describe the adapter's origin (`base_model_name_or_path`,
    /// `revision`, ...), written back unchanged.
    pub provenance: Map<String, Value>,
    pub(super) rank_regex: Vec<(String, Regex)>,
    pub(super) alpha_regex: Vec<(String, Regex)>,
}

/// Keys PEFT writes that ask for a variant zerotrain does not build: (key, the values that
/// turn it off, what it asks for).
fn off_only() -> Vec<(&'static str, Vec<Value>, &'static str)> {
    vec![
        ("use_dora", vec![json!(false)], "DoRA"),
        ("lora_bias", vec![json!(false)], "LoRA's trained bias on B"),
        ("use_qalora", vec![json!(false)], "QA-LoRA"),
        ("use_bdlora", vec![Value::Null, json!(false)], "block-diagonal LoRA"),
        ("megatron_config", vec![Value::Null], "Megatron-LM's parallel layers"),
        ("layer_replication", vec![Value::Null], "layer replication"),
        ("loftq_config", vec![json!({}), Value::Null], "LoftQ initialisation"),
        ("eva_config", vec![Value::Null], "EVA initialisation"),
        ("corda_config", vec![Value::Null], "CorDA initialisation"),
        ("lora_ga_config", vec![Value::Null], "LoRA-GA initialisation"),
        ("target_parameters", vec![Value::Null, json!([])], "LoRA on parameters (fused experts)"),
        ("trainable_token_indices", vec![Value::Null], "training chosen token embeddings"),
        ("alora_invocation_tokens", vec![Value::Null], "activated LoRA"),
        ("arrow_config", vec![Value::Null], "Arrow routing"),
        ("kasa_config", vec![Value::Null], "KaSA"),
        ("monteclora_config", vec![Value::Null], "MonteCLoRA"),
        ("velora_config", vec![Value::Null], "VeLoRA"),
        ("ensure_weight_tying", vec![json!(false)], "tying adapted embeddings"),
    ]
}

/// Keys that describe where an adapter came from, kept as given.
const PROVENANCE: &[&str] = &[
    "base_model_name_or_path",
    "revision",
    "peft_version",
    "inference_mode",
    "auto_mapping",
    "megatron_core",
    "qalora_group_size",
];

/// Keys read into [`LoraConfig`]'s fields.
const READ: &[&str] = &[
    "peft_type",
    "task_type",
    "r",
    "lora_alpha",
    "lora_dropout",
    "target_modules",
    "exclude_modules",
    "use_rslora",
    "bias",
    "modules_to_save",
    "init_lora_weights",
    "layers_to_transform",
    "layers_pattern",
    "rank_pattern",
    "alpha_pattern",
    "fan_in_fan_out",
];

impl Default for LoraConfig {
    fn default() -> Self {
        Self::from_json(&json!({}), "<default>", "").expect("the empty config is PEFT's defaults")
    }
}

impl LoraConfig {
    /// Reads PEFT's keys from `value` (an object), `origin` (the file) and `prefix` (the
    /// keys' dotted parent, `zerotrain.lora` or empty) naming a refused key.
    pub fn from_json(value: &Value, origin: &str, prefix: &str) -> Result<Self, ConfigError> {
        let at = |key: &str| if prefix.is_empty() { key.to_string() } else { format!("{prefix}.{key}") };
        let bad = |key: &str, message: String| ConfigError::InvalidValue {
            origin: origin.to_string(),
            key: at(key),
            message,
        };
        let empty = Map::new();
        let map = match value {
            Value::Object(map) => map,
            Value::Null => &empty,
            other => return Err(bad("", format!("must be an object of PEFT's LoraConfig keys, not {other}"))),
        };
        let off = off_only();
        for (key, value) in map {
            if READ.contains(&key.as_str()) || PROVENANCE.contains(&key.as_str()) {
                continue;
            }
            if let Some((_, offs, what)) = off.iter().find(|(k, _, _)| k == key) {
                if !offs.contains(value) {
                    return Err(bad(
                        key,
                        format!("{what} is not built in zerotrain; set it to {} or leave it out", offs[0]),
                    ));
                }
                continue;
            }
            if !is_empty(value) {
                return Err(ConfigError::UnknownKey {
                    origin: origin.to_string(),
                    key: at(key),
                    suggestion: closest(key, off.iter().map(|o| o.0).chain(READ.iter().copied())),
                });
            }
        }
        let get = |key: &str| map.get(key).filter(|v| !v.is_null());
        let string = |key: &str| -> Result<Option<&str>, ConfigError> {
            get(key).map(|v| v.as_str().ok_or_else(|| bad(key, format!("must be a string, not {v}")))).transpose()
        };
        let flag = |key: &str| -> Result<bool, ConfigError> {
            get(key)
                .map_or(Ok(false), |v| v.as_bool().ok_or_else(|| bad(key, format!("must be true or false, not {v}"))))
        };
        if let Some(kind) = string("peft_type")?
            && kind != "LORA"
        {
            return Err(bad("peft_type", format!("is {kind:?}: only LoRA adapters (\"LORA\") are built")));
        }
        if let Some(task) = string("task_type")?
            && task != "CAUSAL_LM"
        {
            return Err(bad(
                "task_type",
                format!("is {task:?}: zerotrain's models are causal language models (\"CAUSAL_LM\")"),
            ));
        }
        if let Some(bias) = string("bias")?
            && bias != "none"
        {
            return Err(bad("bias", format!("is {bias:?}: training the base's biases is not built; set \"none\"")));
        }
        let r = match get("r") {
            None => 8,
            Some(v) => {
                positive_count(v).ok_or_else(|| bad("r", format!("must be a whole number of at least 1, not {v}")))?
            }
        };
        let number = |key: &str, default: f64| -> Result<f64, ConfigError> {
            get(key).map_or(Ok(default), |v| v.as_f64().ok_or_else(|| bad(key, format!("must be a number, not {v}"))))
        };
        let lora_alpha = number("lora_alpha", 8.0)?;
        if !lora_alpha.is_finite() {
            return Err(bad("lora_alpha", format!("must be finite, not {lora_alpha}")));
        }
        let lora_dropout = number("lora_dropout", 0.0)?;
        if !(0.0..1.0).contains(&lora_dropout) {
            return Err(bad("lora_dropout", format!("is {lora_dropout}: a dropout probability is in [0, 1)")));
        }
        let targets = |key: &str| -> Result<Option<Targets>, ConfigError> {
            match get(key) {
                None => Ok(None),
                Some(Value::String(s)) if s == "all-linear" => Ok(Some(Targets::AllLinear)),
                Some(Value::String(s)) => {
                    let re = Regex::new(&format!("^(?:{s})$"))
                        .map_err(|e| bad(key, format!("{s:?} is not a regular expression: {e}")))?;
                    Ok(Some(Targets::Pattern(s.clone(), re)))
                }
                Some(Value::Array(items)) => {
                    let names: Option<Vec<String>> = items.iter().map(|i| i.as_str().map(str::to_string)).collect();
                    let names = names.ok_or_else(|| bad(key, "must list module names as strings".to_string()))?;
                    if names.is_empty() {
                        return Err(bad(key, "is an empty list: it names no module".to_string()));
                    }
                    Ok(Some(Targets::Names(names)))
                }
                Some(v) => Err(bad(key, format!("must be a list of module names or a regular expression, not {v}"))),
            }
        };
        let target_modules = targets("target_modules")?;
        let exclude_modules = targets("exclude_modules")?;
        let modules_to_save = match get("modules_to_save") {
            None => Vec::new(),
            Some(Value::Array(items)) => items
                .iter()
                .map(|i| i.as_str().map(str::to_string))
                .collect::<Option<_>>()
                .ok_or_else(|| bad("modules_to_save", "must list module names as strings".to_string()))?,
            Some(v) => return Err(bad("modules_to_save", format!("must be a list of module names, not {v}"))),
        };
        let init_lora_weights = match get("init_lora_weights") {
            None | Some(Value::Bool(true)) => LoraInit::KaimingZero,
            Some(Value::Bool(false)) => LoraInit::Random,
            Some(Value::String(s)) if s == "gaussian" => LoraInit::GaussianZero,
            Some(v) => {
                return Err(bad(
                    "init_lora_weights",
                    format!("{v} is not built: zerotrain starts adapters as true, \"gaussian\" or false say"),
                ));
            }
        };
        let layers_to_transform = match get("layers_to_transform") {
            None => None,
            Some(v @ Value::Number(_)) => {
                Some(vec![count(v).ok_or_else(|| bad("layers_to_transform", format!("{v} is not a layer index")))?])
            }
            Some(Value::Array(items)) => {
                Some(
                    items.iter().map(count).collect::<Option<_>>().ok_or_else(|| {
                        bad("layers_to_transform", "must list layer indices (whole numbers)".to_string())
                    })?,
                )
            }
            Some(v) => {
                return Err(bad("layers_to_transform", format!("must be a layer index or a list of them, not {v}")));
            }
        };
        let layers_pattern = match get("layers_pattern") {
            None => None,
            Some(Value::String(s)) => Some(vec![s.clone()]),
            Some(Value::Array(items)) => Some(
                items
                    .iter()
                    .map(|i| i.as_str().map(str::to_string))
                    .collect::<Option<_>>()
                    .ok_or_else(|| bad("layers_pattern", "must list names as strings".to_string()))?,
            ),
            Some(v) => return Err(bad("layers_pattern", format!("must be a name or a list of names, not {v}"))),
        };
        if layers_pattern.is_some() && layers_to_transform.is_none() {
            return Err(bad("layers_pattern", "is set without layers_to_transform, which it serves".to_string()));
        }
        if matches!(target_modules, Some(Targets::Pattern(..))) && layers_to_transform.is_some() {
            return Err(bad(
                "layers_to_transform",
                "cannot be used with a regular expression as target_modules (as PEFT says): put the layers in the \
                 expression"
                    .to_string(),
            ));
        }
        let patterns = |key: &str| -> Result<Vec<(String, Value)>, ConfigError> {
            match get(key) {
                None => Ok(Vec::new()),
                Some(Value::Object(m)) => Ok(m.iter().map(|(k, v)| (k.clone(), v.clone())).collect()),
                Some(v) => Err(bad(key, format!("must be an object of pattern: value, not {v}"))),
            }
        };
        let compile = |key: &str, pattern: &str| {
            Regex::new(&format!(r"^(?:.*\.)?(?:{pattern})$"))
                .map_err(|e| bad(key, format!("{pattern:?} is not a regular expression: {e}")))
        };
        let (mut rank_pattern, mut rank_regex) = (BTreeMap::new(), Vec::new());
        for (pattern, v) in patterns("rank_pattern")? {
            let rank = positive_count(&v).ok_or_else(|| {
                bad("rank_pattern", format!("{pattern:?}: a rank is a whole number of at least 1, not {v}"))
            })?;
            rank_regex.push((pattern.clone(), compile("rank_pattern", &pattern)?));
            rank_pattern.insert(pattern, rank);
        }
        let (mut alpha_pattern, mut alpha_regex) = (BTreeMap::new(), Vec::new());
        for (pattern, v) in patterns("alpha_pattern")? {
            let alpha = v.as_f64().filter(|a| a.is_finite());
            let alpha =
                alpha.ok_or_else(|| bad("alpha_pattern", format!("{pattern:?}: an alpha is a number, not {v}")))?;
            alpha_regex.push((pattern.clone(), compile("alpha_pattern", &pattern)?));
            alpha_pattern.insert(pattern, alpha);
        }
        let provenance =
            map.iter().filter(|(k, _)| PROVENANCE.contains(&k.as_str())).map(|(k, v)| (k.clone(), v.clone()));
        Ok(Self {
            r,
            lora_alpha,
            lora_dropout,
            target_modules,
            exclude_modules,
            use_rslora: flag("use_rslora")?,
            modules_to_save,
            init_lora_weights,
            layers_to_transform,
            layers_pattern,
            rank_pattern,
            alpha_pattern,
            fan_in_fan_out: flag("fan_in_fan_out")?,
            provenance: provenance.collect(),
            rank_regex,
            alpha_regex,
        })
    }
}

/// Whether `value` says nothing: `null`, `false`, an empty object, list or string.
fn is_empty(value: &Value) -> bool {
    match value {
        Value::Null | Value::Bool(false) => true,
        Value::Object(m) => m.is_empty(),
        Value::Array(a) => a.is_empty(),
        Value::String(s) => s.is_empty(),
        Value::Number(_) | Value::Bool(true) => false,
    }
}

/// A whole number `>= 0` (a float holding one, as Python writes `8.0`, too).
fn count(v: &Value) -> Option<usize> {
    v.as_u64()
        .or_else(|| v.as_f64().filter(|f| f.fract() == 0.0 && *f >= 0.0 && *f < 1e15).map(|f| f as u64))
        .map(|n| n as usize)
}

fn positive_count(v: &Value) -> Option<usize> {
    count(v).filter(|&n| n >= 1)
}

/// The known key closest to `key`, if close.
fn closest<'a>(key: &str, known: impl Iterator<Item = &'a str>) -> Option<String> {
    known
        .map(|k| (strsim::levenshtein(key, k), k))
        .filter(|(d, k)| *d <= 2.max(k.len() / 4))
        .min()
        .map(|(_, k)| k.to_string())
}
