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

/// `zerotrain.lora`, if the config has one.
pub(super) fn resolve(config: &Config) -> Result<Option<LoraPlan>, ConfigError> {
    let Some(json) = config.raw.zerotrain.as_ref().and_then(|z| z.lora.clone()) else { return Ok(None) };
    let lora = LoraConfig::from_json(&json, "config", "zerotrain.lora")?;
    Ok(Some(LoraPlan { config: Arc::new(lora), json }))
}
