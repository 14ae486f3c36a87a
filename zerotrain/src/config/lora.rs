//! `zerotrain.lora`: PEFT's `LoraConfig` by its own key names, for fine-tuning low-rank
//! adapters on a frozen model ([`LoraConfig`] reads and checks it).

use std::sync::Arc;

use serde::{Serialize, Serializer};
use serde_json::Value;

use super::{Config, ConfigError};
use crate::nn::lora::LoraConfig;

/// The config's LoRA section, read: the adapters a model builds, and the section as given
/// (what the plan compares and prints).
#[derive(Debug, Clone)]
pub struct LoraPlan {
    /// PEFT's config, checked.
    pub config: Arc<LoraConfig>,
    json: Value,
}

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
        Ok(Self { config: Arc::new(config), json })
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

    /// The section as given (with what [`with_base_model`](Self::with_base_model) added).
    pub fn json(&self) -> &Value {
        &self.json
    }
}

/// `zerotrain.lora`, if the config has one.
pub(super) fn resolve(config: &Config) -> Result<Option<LoraPlan>, ConfigError> {
    let Some(json) = config.raw.zerotrain.as_ref().and_then(|z| z.lora.clone()) else { return Ok(None) };
    let lora = LoraConfig::from_json(&json, "config", "zerotrain.lora")?;
    Ok(Some(LoraPlan { config: Arc::new(lora), json }))
}
