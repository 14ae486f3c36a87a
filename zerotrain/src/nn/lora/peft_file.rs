//! A [`LoraConfig`] as PEFT's `adapter_config.json` holds it: written as PEFT writes it,
//! and compared with an adapter's own file.

use serde_json::{Value, json};

use super::config::{LoraConfig, LoraInit, Targets};

impl LoraConfig {
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
