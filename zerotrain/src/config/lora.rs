//! `zerotrain.lora`: PEFT's `LoraConfig` by its own key names, for fine-tuning low-rank
//! adapters on a frozen model ([`LoraConfig`] reads and checks it).

use std::sync::Arc;

use serde::{Serialize, Serializer};
use serde_json::Value;

use super::{Config, ConfigError};
use crate::nn::lora::LoraConfig;

/// The config's LoRA section, read: the adapters a model builds, how the frozen base is
/// stored, and the section as given (what the plan compares and prints).
#[derive(Debug, Clone)]
pub struct LoraPlan {
    /// PEFT's config, checked.
    pub config: Arc<LoraConfig>,
    /// How the frozen base is stored (`zerotrain.lora.quantize`, zerotrain's own key: PEFT
    /// records no quantisation in an adapter's files). `None`: in the compute dtype.
    pub quantize: Option<Quantization>,
    json: Value,
}

/// A frozen base's storage format (QLoRA).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum Quantization {
    /// `"nf4"`: bitsandbytes' NormalFloat4, blocks of 64 values with one f32 absmax each.
    Nf4,
}

/// The key of [`LoraPlan::quantize`] in `zerotrain.lora`.
const QUANTIZE: &str = "quantize";

impl PartialEq for LoraPlan {
    fn eq(&self, other: &Self) -> bool {
        self.json == other.json
    }
}

impl Serialize for LoraPlan {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        self.json.serialize(s)
    }
}

impl LoraPlan {
    /// The plan of PEFT config `json` (an adapter's `adapter_config.json`, say), checked;
    /// `origin` names it in an error.
    pub fn from_json(json: Value, origin: &str) -> Result<Self, ConfigError> {
        let config = LoraConfig::from_json(&json, origin, "")?;
        Ok(Self { config: Arc::new(config), quantize: None, json })
    }

    /// The same adapters recording `base` as the model they adapt
    /// (`base_model_name_or_path`, which PEFT's files carry), unless one is recorded.
    pub fn with_base_model(mut self, base: &str) -> Self {
        if self
            .config
            .provenance
            .get("base_model_name_or_path")
            .is_some_and(|v| v.as_str().is_some_and(|s| !s.is_empty()))
        {
            return self;
        }
        if let Value::Object(map) = &mut self.json {
            map.insert("base_model_name_or_path".into(), Value::from(base));
        }
        Arc::make_mut(&mut self.config).provenance.insert("base_model_name_or_path".into(), Value::from(base));
        self
    }

    /// The same adapters with `quantize` as the base's storage (an adapter folder's config
    /// under a `zerotrain.lora` that says how the base is stored).
    pub fn with_quantize(mut self, quantize: Option<Quantization>) -> Self {
        if let (Some(q), Value::Object(map)) = (quantize, &mut self.json) {
            map.insert(QUANTIZE.into(), Value::from(q.key()));
        }
        self.quantize = quantize;
        self
    }

    /// The section as given (with what [`with_base_model`](Self::with_base_model) added).
    pub fn json(&self) -> &Value {
        &self.json
    }
}

/// `zerotrain.lora`, if the config has one.
pub(super) fn resolve(config: &Config) -> Result<Option<LoraPlan>, ConfigError> {
    let Some(json) = config.raw.zerotrain.as_ref().and_then(|z| z.lora.clone()) else { return Ok(None) };
    let mut peft = json.clone();
    let quantize = match peft.as_object_mut().and_then(|map| map.remove(QUANTIZE)) {
        None | Some(Value::Null) => None,
        Some(value) => Quantization::from_json(&value)?,
    };
    let lora = LoraConfig::from_json(&peft, "config", "zerotrain.lora")?;
    Ok(Some(LoraPlan { config: Arc::new(lora), quantize, json }))
}

impl Quantization {
    /// Its value in `zerotrain.lora.quantize`.
    pub fn key(self) -> &'static str {
        match self {
            Self::Nf4 => "nf4",
        }
    }

    fn from_json(value: &Value) -> Result<Option<Self>, ConfigError> {
        let key = format!("zerotrain.lora.{QUANTIZE}");
        let bad = |message: String| ConfigError::InvalidValue { origin: "config".into(), key: key.clone(), message };
        match value.as_str() {
            Some("nf4") => Ok(Some(Self::Nf4)),
            Some("none") => Ok(None),
            Some("fp4" | "int8" | "int4") => {
                Err(bad(format!("{value} is not built in zerotrain: \"nf4\" (QLoRA's NormalFloat4) or \"none\"")))
            }
            _ => Err(bad(format!("must be \"nf4\" (QLoRA's NormalFloat4) or \"none\", not {value}"))),
        }
    }
}

/// Refuses a quantised base where the plan cannot hold it: it lives in stage 3's shards
/// (`stage3`: whether parameters are sharded), dequantised a unit at a time after each
/// gather. (On a tensor-parallel mesh the engine checks that each cut falls on the
/// quantisation's blocks, which needs the model's shapes.)
pub(super) fn check_quantize(lora: &Option<LoraPlan>, stage3: bool) -> Result<(), ConfigError> {
    let Some(q) = lora.as_ref().and_then(|l| l.quantize) else { return Ok(()) };
    if !stage3 {
        return Err(ConfigError::Unsupported {
            key: format!("zerotrain.lora.{QUANTIZE}"),
            message: format!(
                "a {} base is held in ZeRO stage 3's shards and dequantised a unit at a time: set \
                 zero_optimization.stage to 3 (on one rank too, where it is QLoRA's single-device run)",
                q.key()
            ),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::super::tests::plan;
    use super::*;

    fn config(stage: u8, quantize: &str, tp: u8) -> String {
        format!(
            r#"{{"train_micro_batch_size_per_gpu": 1, "zero_optimization": {{"stage": {stage}}},
            "tensor_parallel": {{"autotp_size": {tp}}}, "zerotrain": {{"world_size": {tp}, "lora": {{"r": 4, "quantize": {quantize}}}}}}}"#
        )
    }

    /// `quantize` is read beside PEFT's keys (not one of them: the PEFT config knows nothing
    /// of it) and refused by its key where the base cannot be held so; a tensor-parallel
    /// mesh is the engine's to check.
    #[test]
    fn quantize_is_read_at_stage_3_and_refused_by_key_elsewhere() {
        for tp in [1, 2] {
            let lora = plan(&config(3, r#""nf4""#, tp)).unwrap().lora.unwrap();
            assert_eq!((lora.quantize, lora.config.r), (Some(Quantization::Nf4), 4), "tp {tp}");
        }
        for none in [r#""none""#, "null"] {
            assert_eq!(plan(&config(3, none, 1)).unwrap().lora.unwrap().quantize, None, "{none}");
        }
        let refused = |json: String, words: &[&str]| {
            let err = plan(&json).unwrap_err();
            let text = err.to_string();
            assert!(text.contains("zerotrain.lora.quantize") && words.iter().all(|w| text.contains(w)), "{text}");
        };
        refused(config(2, r#""nf4""#, 1), &["stage", "3"]);
        refused(config(3, r#""fp4""#, 1), &["not built"]);
        refused(config(3, "4", 1), &["\"nf4\""]);
    }
}
