//! PEFT's `LoraConfig`, read by its own key names: from a config's `zerotrain.lora` section
//! or from the `adapter_config.json` PEFT writes beside an adapter ([`LoraConfig::from_json`]),
//! and written back as PEFT writes it ([`LoraConfig::to_peft_json`]).
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

use crate::config::ConfigError;

/// Which modules get an adapter (`target_modules`) or are left without one
/// (`exclude_modules`), as PEFT matches them against a module's path.
#[derive(Debug, Clone)]
pub enum Targets {
    /// A list of names: a module whose path equals one or ends in `.name`.
    Names(Vec<String>),
    /// A regular expression the whole path must match (its source kept for writing back).
    Pattern(String, Regex),
    /// `"all-linear"`: every linear layer but the output head.
    AllLinear,
}

impl Targets {
    /// Whether the module at `path` (a linear layer when `linear`; `head` when it is the
    /// model's output head) is named.
    fn names(&self, path: &str, linear: bool, head: bool) -> bool {
        match self {
            Self::Names(names) => names.iter().any(|n| ends_with_name(path, n)),
            Self::Pattern(_, re) => re.is_match(path),
            Self::AllLinear => linear && !head,
        }
    }

    fn to_json(&self) -> Value {
        match self {
            Self::Names(names) => json!(names),
            Self::Pattern(source, _) => json!(source),
            Self::AllLinear => json!("all-linear"),
        }
    }
}

/// Whether `path` is module `name` or inside it, `name` being whole dotted parts of it
/// (PEFT's rule keeping adapters off `modules_to_save`).
fn contains_module(path: &str, name: &str) -> bool {
    let (path, name) = (format!(".{path}."), format!(".{name}."));
    path.contains(&name)
}

/// Whether `path` equals `name` or ends in `.name` (PEFT's rule for a list of names).
fn ends_with_name(path: &str, name: &str) -> bool {
    path == name || path.strip_suffix(name).is_some_and(|head| head.ends_with('.'))
}

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
    rank_regex: Vec<(String, Regex)>,
    alpha_regex: Vec<(String, Regex)>,
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

    /// The adapter of the module at `path`, if it gets one: `linear` says whether it is a
    /// linear layer (only those are adapted), `head` whether it is the output head (left
    /// out by `"all-linear"`), `defaults` the family's targets where `target_modules` is not
    /// set. An error where two `rank_pattern` (or `alpha_pattern`) entries name the module
    /// (PEFT would take the first in its file's order, which JSON does not keep).
    pub fn adapter(
        &self,
        path: &str,
        linear: bool,
        head: bool,
        defaults: &[&str],
    ) -> Result<Option<AdapterSpec>, String> {
        let named = match &self.target_modules {
            Some(targets) => targets.names(path, linear, head),
            None => defaults.iter().any(|n| ends_with_name(path, n)),
        };
        let saved = self.modules_to_save.iter().any(|m| contains_module(path, m));
        if !named || !linear || saved || self.excluded(path, linear, head) || !self.in_layers(path) {
            return Ok(None);
        }
        let pick = |regexes: &[(String, Regex)], key: &str| -> Result<Option<String>, String> {
            let hits: Vec<&String> = regexes.iter().filter(|(_, re)| re.is_match(path)).map(|(p, _)| p).collect();
            match hits.as_slice() {
                [] => Ok(None),
                [one] => Ok(Some((*one).clone())),
                [a, b, ..] => {
                    Err(format!("{key}: both {a:?} and {b:?} match module `{path}`; make one pattern name it"))
                }
            }
        };
        let r = pick(&self.rank_regex, "rank_pattern")?.map_or(self.r, |p| self.rank_pattern[&p]);
        let alpha = pick(&self.alpha_regex, "alpha_pattern")?.map_or(self.lora_alpha, |p| self.alpha_pattern[&p]);
        let scaling = if self.use_rslora { alpha / (r as f64).sqrt() } else { alpha / r as f64 };
        Ok(Some(AdapterSpec { r, alpha, scaling, dropout: self.lora_dropout, init: self.init_lora_weights }))
    }

    /// The scaling of an adapter of rank `r` on the module at `path`: its `alpha_pattern`
    /// entry or `lora_alpha`, over `r` (its root with rslora); the rank is the adapter's own
    /// (a trained one's factors say it).
    pub fn scaling_of(&self, path: &str, r: usize) -> Result<f64, String> {
        let hits: Vec<&String> = self.alpha_regex.iter().filter(|(_, re)| re.is_match(path)).map(|(p, _)| p).collect();
        let alpha = match hits.as_slice() {
            [] => self.lora_alpha,
            [one] => self.alpha_pattern[*one],
            [a, b, ..] => return Err(format!("alpha_pattern: both {a:?} and {b:?} match module `{path}`")),
        };
        Ok(if self.use_rslora { alpha / (r as f64).sqrt() } else { alpha / r as f64 })
    }

    /// Whether the module at `path` is trained whole (`modules_to_save`; PEFT's rule: the
    /// path ends in the name, dotted or not, so `norm` names `input_layernorm` too).
    pub fn saves(&self, path: &str) -> bool {
        self.modules_to_save.iter().any(|n| path.ends_with(n.as_str()))
    }

    fn excluded(&self, path: &str, linear: bool, head: bool) -> bool {
        self.exclude_modules.as_ref().is_some_and(|t| t.names(path, linear, head))
    }

    /// Whether `path` is in one of `layers_to_transform` (PEFT's rule: the number after the
    /// first `.<pattern>.`, or after any dotted name where no pattern is given).
    fn in_layers(&self, path: &str) -> bool {
        let Some(layers) = &self.layers_to_transform else { return true };
        let parts: Vec<&str> = path.split('.').collect();
        let index = parts.windows(2).enumerate().find_map(|(i, w)| {
            // PEFT's expressions: the first number after a dotted name (which follows a dot
            // itself), or after one of the patterns, followed by a dot.
            let named = match &self.layers_pattern {
                None => i > 0,
                Some(patterns) => patterns.iter().any(|p| p == w[0]),
            };
            let digits = !w[1].is_empty() && w[1].bytes().all(|b| b.is_ascii_digit());
            (named && digits && i + 2 < parts.len()).then(|| w[1].parse::<usize>().ok()).flatten()
        });
        index.is_some_and(|i| layers.contains(&i))
    }

    /// Checks the targets against the model's modules: `linears` (path, whether it is the
    /// head) and `modules` (every module path). An error naming the pattern and a few paths
    /// that exist where `target_modules` adapts nothing, or a `modules_to_save` entry that
    /// names no module.
    pub fn check_against(
        &self,
        linears: &[(String, bool)],
        modules: &[String],
        defaults: &[&str],
    ) -> Result<(), String> {
        let mut adapted = 0;
        for (path, head) in linears {
            adapted += usize::from(self.adapter(path, true, *head, defaults)?.is_some());
        }
        if adapted == 0 {
            let asked = match &self.target_modules {
                Some(t) => t.to_json().to_string(),
                None => format!("{defaults:?} (the family's default)"),
            };
            let some: Vec<&str> = linears.iter().take(6).map(|(p, _)| p.as_str()).collect();
            return Err(format!(
                "target_modules {asked} matches none of the model's {} linear layers{}; they are named like {}",
                linears.len(),
                if self.layers_to_transform.is_some() || self.exclude_modules.is_some() {
                    " (after exclude_modules and layers_to_transform)"
                } else {
                    ""
                },
                some.join(", ")
            ));
        }
        for name in &self.modules_to_save {
            if !modules.iter().any(|m| m.ends_with(name.as_str())) {
                let tops: Vec<&str> = modules.iter().take(6).map(String::as_str).collect();
                return Err(format!(
                    "modules_to_save: {name:?} names no module of the model; its modules are named like {}",
                    tops.join(", ")
                ));
            }
        }
        Ok(())
    }

    /// The `adapter_config.json` PEFT writes for this adapter: every `LoraConfig` key,
    /// `target_modules` as the module names adapted (`adapted`, PEFT's form after it
    /// resolves `"all-linear"`), the base model and the base's weight layout.
    pub fn to_peft_json(&self, base_model: &str, adapted: &[String], fan_in_fan_out: bool) -> Value {
        let mut names: Vec<String> = adapted.iter().map(|p| p.rsplit('.').next().unwrap_or(p).to_string()).collect();
        names.sort();
        names.dedup();
        let target_modules = match &self.target_modules {
            Some(Targets::Pattern(source, _)) => json!(source),
            _ => json!(names),
        };
        let mut out = json!({
            "alpha_pattern": self.alpha_pattern,
            "auto_mapping": null,
            "base_model_name_or_path": base_model,
            "bias": "none",
            "corda_config": null,
            "eva_config": null,
            "exclude_modules": self.exclude_modules.as_ref().map(Targets::to_json),
            "fan_in_fan_out": fan_in_fan_out,
            "inference_mode": true,
            "init_lora_weights": match self.init_lora_weights {
                LoraInit::KaimingZero => json!(true),
                LoraInit::GaussianZero => json!("gaussian"),
                LoraInit::Random => json!(false),
            },
            "layer_replication": null,
            "layers_pattern": self.layers_pattern,
            "layers_to_transform": self.layers_to_transform,
            "loftq_config": {},
            "lora_alpha": self.lora_alpha,
            "lora_bias": false,
            "lora_dropout": self.lora_dropout,
            "megatron_config": null,
            "megatron_core": "megatron.core",
            "modules_to_save": if self.modules_to_save.is_empty() { Value::Null } else { json!(self.modules_to_save) },
            "peft_type": "LORA",
            "r": self.r,
            "rank_pattern": self.rank_pattern,
            "revision": null,
            "target_modules": target_modules,
            "target_parameters": null,
            "task_type": "CAUSAL_LM",
            "trainable_token_indices": null,
            "use_dora": false,
            "use_rslora": self.use_rslora,
        });
        for (key, value) in &self.provenance {
            if key != "base_model_name_or_path" && key != "inference_mode" {
                out[key] = value.clone();
            }
        }
        out
    }

    /// The first key whose value differs between this config and `other` (an adapter's
    /// own `adapter_config.json`), as PEFT would read them; `None` when they agree on every
    /// key that shapes the adapter.
    pub fn first_difference(&self, other: &LoraConfig) -> Option<&'static str> {
        let targets = |t: &Option<Targets>| t.as_ref().map(Targets::to_json);
        [
            ("r", self.r == other.r),
            ("lora_alpha", self.lora_alpha == other.lora_alpha),
            ("lora_dropout", self.lora_dropout == other.lora_dropout),
            ("target_modules", targets(&self.target_modules) == targets(&other.target_modules)),
            ("exclude_modules", targets(&self.exclude_modules) == targets(&other.exclude_modules)),
            ("use_rslora", self.use_rslora == other.use_rslora),
            ("modules_to_save", self.modules_to_save == other.modules_to_save),
            ("layers_to_transform", self.layers_to_transform == other.layers_to_transform),
            ("layers_pattern", self.layers_pattern == other.layers_pattern),
            ("rank_pattern", self.rank_pattern == other.rank_pattern),
            ("alpha_pattern", self.alpha_pattern == other.alpha_pattern),
        ]
        .into_iter()
        .find(|(_, same)| !same)
        .map(|(key, _)| key)
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
