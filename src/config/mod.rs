//! Configuration: DeepSpeed's `ds_config.json` fields (so existing files work) plus a
//! `zerotrain` section, parsed in two stages: [`Config`] is the file as written, checked
//! key by key; [`Config::resolve`] turns it into a [`Plan`] with every value concrete.
//!
//! Unknown keys are errors naming the key path and the closest known key. Known DeepSpeed
//! keys that zerotrain does not implement ([`keys::NOT_IMPLEMENTED`]) load with one warning.
//! `"auto"` is derived where possible (batch sizes from each other, `warmup_max_lr` from the
//! optimizer's `lr`), else set to DeepSpeed's default; each resolution is listed in
//! [`Plan::auto_resolved`]. A required value given as `"auto"` that nothing can supply is an
//! error naming the key.

mod describe;
pub mod keys;
mod plan;
mod precision;
pub mod raw;
mod resolve;
mod value;

use std::path::{Path, PathBuf};

pub use plan::{Backend, BatchPlan, LossScalePlan, OptimizerPlan, Plan, ZeroPlan};
pub use raw::DeepSpeedConfig;
pub use value::{AutoOr, Count};

/// Errors from reading or resolving a config. Each names the file or key at fault.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// The file could not be read.
    #[error("cannot read config {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The file is not valid JSON.
    #[error("{origin}: invalid JSON at line {line}, column {column}: {message}")]
    Json {
        /// The file, or `<string>`.
        origin: String,
        /// 1-based line.
        line: usize,
        /// 1-based column.
        column: usize,
        /// serde_json's description.
        message: String,
    },
    /// A key zerotrain does not know.
    #[error("{origin}: unknown key `{key}`{}", suggestion.as_ref().map(|s| format!(" (did you mean `{s}`?)")).unwrap_or_default())]
    UnknownKey {
        /// The file, or `<string>`.
        origin: String,
        /// Full dotted path of the key.
        key: String,
        /// The closest known key at the same level, if one is close.
        suggestion: Option<String>,
    },
    /// A value of the wrong type or out of range.
    #[error("{origin}: `{key}`: {message}")]
    InvalidValue {
        /// The file, or `<string>`.
        origin: String,
        /// Full dotted path of the key.
        key: String,
        /// What was expected.
        message: String,
    },
    /// `"auto"` where nothing can supply a value.
    #[error("`{key}` is \"auto\" but {why}")]
    UnresolvableAuto {
        /// Full dotted path of the key.
        key: String,
        /// Why it cannot be derived.
        why: String,
    },
    /// The batch sizes do not satisfy train = micro x accumulation x world.
    #[error(
        "batch sizes are inconsistent: train_batch_size ({}) must equal train_micro_batch_size_per_gpu ({}) x gradient_accumulation_steps ({}) x world size ({world_size}), all at least 1",
        show(train_batch_size),
        show(micro_batch_per_rank),
        show(gradient_accumulation_steps)
    )]
    BatchMismatch {
        /// `train_batch_size`, if given.
        train_batch_size: Option<u64>,
        /// `train_micro_batch_size_per_gpu`, if given.
        micro_batch_per_rank: Option<u64>,
        /// `gradient_accumulation_steps`, if given.
        gradient_accumulation_steps: Option<u64>,
        /// The world size.
        world_size: u64,
    },
    /// Neither `train_batch_size` nor `train_micro_batch_size_per_gpu` is given.
    #[error("either `train_batch_size` or `train_micro_batch_size_per_gpu` must be given")]
    MissingBatchSize,
    /// A valid DeepSpeed setting that zerotrain cannot honour (would otherwise be a silent
    /// downgrade).
    #[error("`{key}`: {message}")]
    Unsupported {
        /// Full dotted path of the key.
        key: String,
        /// What is not supported and what to do instead.
        message: String,
    },
}

fn show(v: &Option<u64>) -> String {
    v.map_or_else(|| "not set".to_string(), |v| v.to_string())
}

/// A parsed config file: the typed fields plus the keys accepted without effect.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Config {
    /// The typed fields.
    pub raw: DeepSpeedConfig,
    /// Active keys from [`keys::NOT_IMPLEMENTED`] found in the file.
    pub not_implemented: Vec<String>,
}

/// Values the command line can supply or override.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Overrides {
    /// Overrides `zerotrain.world_size`.
    pub world_size: Option<usize>,
    /// Total optimizer steps of the run, used for `total_num_steps: "auto"`.
    pub total_steps: Option<u64>,
}

impl Config {
    /// Reads and checks `path`.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self, ConfigError> {
        let path = path.as_ref();
        let text =
            std::fs::read_to_string(path).map_err(|source| ConfigError::Io { path: path.to_path_buf(), source })?;
        Self::parse(&text, &path.display().to_string())
    }

    /// Parses JSON text; `origin` names it in errors (a file path, or `<string>`).
    pub fn parse(text: &str, origin: &str) -> Result<Self, ConfigError> {
        let mut value: serde_json::Value = serde_json::from_str(text).map_err(|e| ConfigError::Json {
            origin: origin.to_string(),
            line: e.line(),
            column: e.column(),
            message: e.to_string(),
        })?;
        if value.is_null() {
            value = keys::empty();
        }
        keys::normalize_legacy(&mut value);
        let not_implemented = keys::take_not_implemented(&mut value);
        let raw = serde_path_to_error::deserialize(value).map_err(|e| {
            let path = e.path().to_string();
            let path = if path == "." { String::new() } else { path };
            let message = e.inner().to_string();
            // The path ends with the unknown key itself; suggestions come from its parent.
            let parent = path.rsplit_once('.').map_or("", |(parent, _)| parent);
            match keys::unknown_field(&message, parent) {
                Some((key, suggestion)) => {
                    ConfigError::UnknownKey { origin: origin.to_string(), key: keys::join(parent, &key), suggestion }
                }
                None => ConfigError::InvalidValue { origin: origin.to_string(), key: path, message },
            }
        })?;
        Ok(Self { raw, not_implemented })
    }

    /// Validates into a [`Plan`].
    pub fn resolve(&self, overrides: Overrides) -> Result<Plan, ConfigError> {
        resolve::resolve(self, overrides)
    }
}

#[cfg(test)]
mod tests;
