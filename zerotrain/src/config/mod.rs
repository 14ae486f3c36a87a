//! Configuration: DeepSpeed's `ds_config.json` fields (so existing files work) plus a
//! `zerotrain` section, parsed in two stages: [`Config`] is the file as written, checked
//! key by key; [`Config::resolve`] turns it into a [`Plan`] with every value concrete.
//!
//! Unknown keys are errors naming the key path and the closest known key. Known DeepSpeed
//! keys that zerotrain does not implement ([`keys::NOT_IMPLEMENTED`]), and switches for
//! behaviour it fixes one way set otherwise ([`keys::FIXED_BEHAVIOUR`]), load with one
//! warning ([`Plan::warning`]).
//! A program that keeps its own keys in the same file (the `zerotrain` command keeps its
//! model and cadence there) reads them with [`Config::parse_with`] and a
//! [`ConfigExtension`]; the library's [`Plan`] never sees them.
//! `"auto"` is derived where possible (batch sizes from each other, `warmup_max_lr` from the
//! optimizer's `lr`), else set to DeepSpeed's default; each resolution is listed in
//! [`PlanNotes::auto_resolved`]. A required value given as `"auto"` that nothing can supply is an
//! error naming the key.
//!
//! Resolution is a pure function of the file and the [`Overrides`]: nothing is read from
//! the environment. Under `mpirun`, pass what [`detect_mpirun`](crate::detect_mpirun) finds.

mod autos;
mod batch;
mod describe;
pub mod keys;
mod lora;
mod mesh;
mod offload;
mod optim;
mod parallel;
mod parse;
mod plan;
mod precision;
pub mod raw;
mod replicas;
mod resolve;
mod runtime;
mod value;

use std::path::{Path, PathBuf};

pub use batch::{MAX_ACCUMULATION_STEPS, MAX_MICRO_BATCH};
pub use mesh::MeshPlan;
pub use parse::{ConfigExtension, MAX_CONFIG_BYTES};
pub use plan::{
    AioPlan, Backend, BatchPlan, Collectives, ComputeDevice, LoraPlan, LossScalePlan, MAX_THREAD_RANKS, OffloadPlan,
    OptimPlan, OptimizerPlan, OuterOptimizer, ParamGroupPlan, PipelinePlan, Plan, PlanNotes, PrecisionPlan,
    Quantization, ReplicaMode, ReplicaPlan, RuntimePlan, Tier, TlsPlan, ZeroPlan,
};
pub use raw::DeepSpeedConfig;
pub use value::{AutoOr, Count};

/// Errors from reading or resolving a config. Each names the file or key at fault.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// The file could not be read.
    #[error("cannot read config {path}: {cause}")]
    Io {
        /// The file.
        path: PathBuf,
        /// Why.
        cause: std::io::Error,
    },
    /// The file is larger than [`MAX_CONFIG_BYTES`].
    #[error("config {path} is larger than {limit} bytes; it is not a config file")]
    TooLarge {
        /// The file.
        path: PathBuf,
        /// The limit in bytes.
        limit: u64,
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
    /// Active keys from [`keys::NOT_IMPLEMENTED`] and [`keys::FIXED_BEHAVIOUR`] found in
    /// the file (the latter with why they have no effect).
    pub not_implemented: Vec<String>,
}

/// Values the caller supplies or overrides: the command line's flags, and what the
/// launcher's environment says.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Overrides {
    /// Overrides `zerotrain.world_size`.
    pub world_size: Option<usize>,
    /// Total optimizer steps of the run, used for `total_num_steps: "auto"`.
    pub total_steps: Option<u64>,
    /// This process's place in an `mpirun` job, if it is in one (see
    /// [`detect_mpirun`](crate::detect_mpirun)). With `zerotrain.backend` `auto` (the
    /// default) it selects the MPI backend, and its process count is the world size.
    pub mpirun: Option<MpirunEnvironment>,
    /// This process's place in a job whose processes a launcher started (`zerotrain
    /// launch`, torchrun, a cluster's operator; see
    /// [`detect_launcher`](crate::detect_launcher)). With `zerotrain.backend` `auto` it
    /// selects the launcher backend, and its process count is the world size.
    pub launcher: Option<LauncherEnvironment>,
    /// Overrides `zerotrain.device`.
    pub device: Option<ComputeDevice>,
}

/// This process's place in a job started by `mpirun`, as the launcher's environment says.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct MpirunEnvironment {
    /// This process's rank.
    pub rank: usize,
    /// The number of processes `mpirun` started.
    pub world_size: usize,
}

/// This process's place in a job whose processes a launcher started, as its environment
/// (`RANK`, `WORLD_SIZE`) says.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct LauncherEnvironment {
    /// This process's rank (`RANK`).
    pub rank: usize,
    /// The number of processes (`WORLD_SIZE`).
    pub world_size: usize,
}

impl Config {
    /// Reads and checks `path` (at most [`MAX_CONFIG_BYTES`]).
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self, ConfigError> {
        let path = path.as_ref();
        Self::parse(&parse::read_file(path)?, &path.display().to_string())
    }

    /// Reads and checks `path` holding the library's keys and `X`'s.
    pub fn from_file_with<X: ConfigExtension>(path: impl AsRef<Path>) -> Result<(Self, X), ConfigError> {
        let path = path.as_ref();
        Self::parse_with(&parse::read_file(path)?, &path.display().to_string())
    }

    /// Parses JSON text; `origin` names it in errors (a file path, or `<string>`).
    pub fn parse(text: &str, origin: &str) -> Result<Self, ConfigError> {
        Self::parse_value(parse::json(text, origin)?, origin, &[])
    }

    /// Parses JSON text holding the library's keys and the keys of a program's extension
    /// `X` (see [`ConfigExtension`]); both are checked key by key.
    pub fn parse_with<X: ConfigExtension>(text: &str, origin: &str) -> Result<(Self, X), ConfigError> {
        let mut value = parse::json(text, origin)?;
        let extension = parse::split_off(&mut value, X::KEYS);
        let config = Self::parse_value(value, origin, X::KEYS)?;
        Ok((config, parse::typed(extension, origin, &X::known_keys)?))
    }

    /// The library's part of a parsed file; `extension_keys` only feed suggestions.
    fn parse_value(
        mut value: serde_json::Value,
        origin: &str,
        extension_keys: &[&'static str],
    ) -> Result<Self, ConfigError> {
        if !value.is_object() {
            return Err(ConfigError::InvalidValue {
                origin: origin.to_string(),
                key: String::new(),
                message: "a config is a JSON object".into(),
            });
        }
        keys::normalize_legacy(&mut value);
        let not_implemented = keys::take_not_implemented(&mut value);
        let raw = parse::typed(value, origin, &|parent| parse::library_keys(parent, extension_keys))?;
        Ok(Self { raw, not_implemented })
    }

    /// Validates into a [`Plan`].
    pub fn resolve(&self, overrides: Overrides) -> Result<Plan, ConfigError> {
        resolve::resolve(self, overrides)
    }
}

#[cfg(test)]
mod tests;
