//! The validated plan a config resolves to: every value concrete, every default applied,
//! every `"auto"` resolved and noted.

use std::time::Duration;

use serde::Serialize;
use zerotrain_precision::{DynamicScaleConfig, LossScaler, Precision};
use zerotrain_zero::ZeroStage;
use zerotrain_zero::pipeline::{PartitionMethod, ScheduleKind};

use super::ConfigError;
use crate::schedule::LrSchedule;

/// Largest `train_micro_batch_size_per_gpu`: samples one rank holds at once; beyond a
/// million it is a typo, and a batch that size would fail to allocate rather than train.
pub const MAX_MICRO_BATCH: u64 = 1 << 20;
/// Largest `gradient_accumulation_steps`.
pub const MAX_ACCUMULATION_STEPS: u64 = 1 << 20;
/// Largest world size of the threads backend (ranks are threads of one process; under
/// `mpirun` the process count decides and is not limited here).
pub const MAX_THREAD_RANKS: usize = 1024;

/// Batch sizes after DeepSpeed's rule: `train_batch_size = micro x accumulation x world`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct BatchPlan {
    /// Samples per optimizer step over all ranks.
    pub train_batch_size: u64,
    /// Samples per rank per micro-step.
    pub micro_batch_per_rank: u64,
    /// Micro-steps per optimizer step.
    pub gradient_accumulation_steps: u64,
}

impl BatchPlan {
    /// Applies DeepSpeed's rule: any two of the three sizes give the third; all three must
    /// agree; with only one of train/micro, accumulation is 1. `None` means absent.
    pub fn derive(
        train: Option<u64>,
        micro: Option<u64>,
        gas: Option<u64>,
        world_size: u64,
    ) -> Result<Self, ConfigError> {
        let mismatch = |t: Option<u64>, m: Option<u64>, g: Option<u64>| ConfigError::BatchMismatch {
            train_batch_size: t,
            micro_batch_per_rank: m,
            gradient_accumulation_steps: g,
            world_size,
        };
        if [train, micro, gas].contains(&Some(0)) {
            return Err(mismatch(train, micro, gas));
        }
        // Checked arithmetic throughout: a product beyond u64 is a mismatch, not a panic.
        let mul = |a: u64, b: u64| a.checked_mul(b).ok_or(mismatch(train, micro, gas));
        let divide =
            |num: u64, den: u64| num.is_multiple_of(den).then_some(num / den).ok_or(mismatch(train, micro, gas));
        let (t, m, g) = match (train, micro, gas) {
            (Some(t), Some(m), Some(g)) => (t, m, g),
            (Some(t), Some(m), None) => (t, m, divide(t, mul(m, world_size)?)?),
            (Some(t), None, Some(g)) => (t, divide(t, mul(g, world_size)?)?, g),
            (None, Some(m), Some(g)) => (mul(mul(m, g)?, world_size)?, m, g),
            (Some(t), None, None) => (t, divide(t, world_size)?, 1),
            (None, Some(m), None) => (mul(m, world_size)?, m, 1),
            (None, None, _) => return Err(ConfigError::MissingBatchSize),
        };
        if Some(t) != m.checked_mul(g).and_then(|mg| mg.checked_mul(world_size)) {
            return Err(mismatch(train, micro, gas));
        }
        for (key, value, limit) in [
            ("train_micro_batch_size_per_gpu", m, MAX_MICRO_BATCH),
            ("gradient_accumulation_steps", g, MAX_ACCUMULATION_STEPS),
        ] {
            if value > limit {
                return Err(ConfigError::InvalidValue {
                    origin: "config".into(),
                    key: key.into(),
                    message: format!("{value} is more than the {limit} zerotrain accepts"),
                });
            }
        }
        Ok(Self { train_batch_size: t, micro_batch_per_rank: m, gradient_accumulation_steps: g })
    }
}

/// The optimizer, with every hyper-parameter explicit.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "type")]
pub enum OptimizerPlan {
    /// Adam; `decoupled_weight_decay` makes it AdamW.
    Adam {
        /// Learning rate (the schedule may override it per step).
        lr: f64,
        /// (beta1, beta2).
        betas: [f64; 2],
        /// Epsilon added to sqrt(v).
        eps: f64,
        /// Weight decay coefficient.
        weight_decay: f64,
        /// AdamW (true) or L2 regularisation (false).
        decoupled_weight_decay: bool,
        /// AMSGrad variant.
        amsgrad: bool,
    },
    /// SGD with optional momentum.
    Sgd {
        /// Learning rate.
        lr: f64,
        /// Momentum factor (0: none).
        momentum: f64,
        /// Dampening of the momentum.
        dampening: f64,
        /// Nesterov momentum.
        nesterov: bool,
        /// L2 weight decay.
        weight_decay: f64,
    },
}

impl OptimizerPlan {
    /// The optimizer's name as DeepSpeed spells it: `Adam`, `AdamW` or `SGD`.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Adam { decoupled_weight_decay: true, .. } => "AdamW",
            Self::Adam { .. } => "Adam",
            Self::Sgd { .. } => "SGD",
        }
    }

    /// The configured learning rate.
    pub fn lr(&self) -> f64 {
        match self {
            Self::Adam { lr, .. } | Self::Sgd { lr, .. } => *lr,
        }
    }

    /// fp32 optimizer-state bytes per parameter (Adam: m and v; AMSGrad adds max v; SGD:
    /// the velocity when momentum is on).
    pub fn state_bytes_per_param(&self) -> u64 {
        match self {
            Self::Adam { amsgrad, .. } => {
                if *amsgrad {
                    12
                } else {
                    8
                }
            }
            Self::Sgd { momentum, .. } => {
                if *momentum > 0.0 {
                    4
                } else {
                    0
                }
            }
        }
    }
}

/// ZeRO settings after defaults.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ZeroPlan {
    /// The stage.
    #[serde(serialize_with = "stage_index")]
    pub stage: ZeroStage,
    /// Stage 1-2: reduce-scatter (true) or all-reduce (false) the gradients.
    pub reduce_scatter: bool,
    /// Stages 2-3: most elements (over all ranks) in one gradient reduce-scatter.
    pub reduce_bucket_size: u64,
    /// Elements per all-gather bucket (accepted; parameters are gathered one unit at a time).
    pub allgather_bucket_size: u64,
    /// Reductions run on the communication thread while backward goes on.
    pub overlap_comm: bool,
    /// Stage 3: parameters with at most this many elements stay resident.
    pub param_persistence_threshold: u64,
    /// Stage 3: the next unit is prefetched if it has at most this many elements (0: never).
    pub prefetch_bucket_size: u64,
    /// Stage 3: most gathered elements alive besides the unit in use.
    pub max_live_parameters: u64,
}

fn stage_index<S: serde::Serializer>(stage: &ZeroStage, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_u8(stage.index())
}

/// fp16 loss scaling.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
#[serde(tag = "type")]
pub enum LossScalePlan {
    /// A fixed scale (`fp16.loss_scale > 0`).
    Static {
        /// The scale.
        scale: f64,
    },
    /// DeepSpeed's dynamic scaling (`fp16.loss_scale: 0`).
    Dynamic(DynamicScaleConfig),
}

impl LossScalePlan {
    /// A scaler at its initial state.
    pub fn scaler(&self) -> LossScaler {
        match *self {
            Self::Static { scale } => LossScaler::Static { scale },
            Self::Dynamic(config) => LossScaler::dynamic(config),
        }
    }
}

/// Which collective backend runs the ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Backend {
    /// Decided by [`launch`](crate::launch): threads, unless this process turns out to
    /// have been started by `mpirun` (then MPI, if the plan's world size is mpirun's
    /// process count; an error otherwise). What `backend: auto` resolves to when the
    /// [`Overrides`](super::Overrides) say nothing about `mpirun`.
    Auto,
    /// One thread per rank in this process.
    Threads,
    /// One process per rank, started by `mpirun` (needs the `mpi` feature).
    Mpi,
}

/// Where each rank computes (`zerotrain.device`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ComputeDevice {
    /// The CPU, through Burn's Flex backend; every rank of a process shares it.
    #[default]
    Cpu,
    /// A GPU through Burn's wgpu backend (the `wgpu` feature).
    Wgpu,
    /// An NVIDIA GPU through Burn's CUDA backend (the `cuda` feature).
    Cuda,
}

impl ComputeDevice {
    /// The value `zerotrain.device` names it by.
    pub fn name(self) -> &'static str {
        match self {
            Self::Cpu => "cpu",
            Self::Wgpu => "wgpu",
            Self::Cuda => "cuda",
        }
    }

    /// Whether this build can compute on it (the Cargo feature it needs is on).
    pub fn is_built(self) -> bool {
        match self {
            Self::Cpu => true,
            Self::Wgpu => cfg!(feature = "wgpu"),
            Self::Cuda => cfg!(feature = "cuda"),
        }
    }
}

impl std::str::FromStr for ComputeDevice {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "cpu" => Ok(Self::Cpu),
            "wgpu" => Ok(Self::Wgpu),
            "cuda" => Ok(Self::Cuda),
            other => Err(format!("unknown device `{other}`; available: cpu, wgpu, cuda")),
        }
    }
}

/// Pipeline parallelism (see [`zerotrain_zero::pipeline`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct PipelinePlan {
    /// Stages `K`; the world's ranks are `K` stages of `world_size / K` data-parallel ranks.
    pub stages: usize,
    /// How units are divided between the stages.
    pub partition: PartitionMethod,
    /// The order of each stage's forward and backward passes.
    pub schedule: ScheduleKind,
    /// Recompute every this many units (0: keep every unit's activations).
    pub checkpoint_interval: usize,
}

impl PipelinePlan {
    /// Data-parallel ranks per stage for `world_size` ranks.
    pub fn data_parallel(&self, world_size: usize) -> usize {
        world_size / self.stages
    }
}

/// A validated config: what the engine and the launcher run.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Plan {
    /// Number of ranks.
    pub world_size: usize,
    /// The collective backend.
    pub backend: Backend,
    /// Where each rank computes.
    pub device: ComputeDevice,
    /// How long a collective waits for the other ranks.
    #[serde(serialize_with = "seconds")]
    pub comm_timeout: Duration,
    /// Batch sizes.
    pub batch: BatchPlan,
    /// ZeRO settings.
    pub zero: ZeroPlan,
    /// The compute dtype: parameters and activations.
    pub precision: Precision,
    /// The dtype gradients are reduced in.
    pub comm_dtype: Precision,
    /// The dtype gradients accumulate in between optimizer steps.
    pub grad_accum_dtype: Precision,
    /// fp16's loss scaling; `None` for fp32 and bf16.
    pub loss_scale: Option<LossScalePlan>,
    /// Max global gradient norm; 0 disables clipping.
    pub gradient_clipping: f64,
    /// Recompute each unit in backward instead of keeping its activations (models declared
    /// in units).
    pub activation_checkpointing: bool,
    /// Pipeline parallelism; `None` without (one stage).
    pub pipeline: Option<PipelinePlan>,
    /// Skip (and count) a step whose gradients are not finite, instead of applying it.
    /// The check is the global norm: NaN/inf anywhere, on any rank, makes it non-finite
    /// (as does a squared norm beyond f32's range, i.e. a norm above 1.8e19).
    pub check_grad_overflow: bool,
    /// Log every this many steps.
    pub steps_per_print: u64,
    /// Add per-phase step times to the log lines.
    pub wall_clock_breakdown: bool,
    /// Seed for initialisation and data.
    pub seed: u64,
    /// The optimizer.
    pub optimizer: OptimizerPlan,
    /// The learning-rate schedule.
    pub schedule: LrSchedule,
    /// Checkpoints to keep in a directory (the oldest beyond are removed after a save).
    pub keep_last_n_checkpoints: Option<usize>,
    /// How each `"auto"` was resolved.
    pub auto_resolved: Vec<String>,
    /// Active DeepSpeed keys that zerotrain accepted without implementing them.
    pub not_implemented: Vec<String>,
}

fn seconds<S: serde::Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_f64(d.as_secs_f64())
}

impl Plan {
    /// The one warning for accepted-but-unimplemented keys, if any.
    pub fn warning(&self) -> Option<String> {
        (!self.not_implemented.is_empty()).then(|| {
            format!(
                "zerotrain accepts but does not implement these DeepSpeed keys; they have no effect: {}",
                self.not_implemented.join(", ")
            )
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn any_two_batch_sizes_give_the_third() {
        let p = |t, m, g| {
            BatchPlan::derive(t, m, g, 4)
                .map(|b| (b.train_batch_size, b.micro_batch_per_rank, b.gradient_accumulation_steps))
        };
        assert_eq!(p(Some(32), Some(2), None).unwrap(), (32, 2, 4));
        assert_eq!(p(Some(32), None, Some(2)).unwrap(), (32, 4, 2));
        assert_eq!(p(None, Some(2), Some(3)).unwrap(), (24, 2, 3));
        assert_eq!(p(Some(32), Some(2), Some(4)).unwrap(), (32, 2, 4));
        assert_eq!(p(Some(8), None, None).unwrap(), (8, 2, 1));
        assert_eq!(p(None, Some(3), None).unwrap(), (12, 3, 1));
    }

    #[test]
    fn inconsistent_batch_sizes_name_all_four_numbers() {
        let err = BatchPlan::derive(Some(32), Some(2), Some(3), 4).unwrap_err().to_string();
        for needle in [
            "train_batch_size (32)",
            "train_micro_batch_size_per_gpu (2)",
            "gradient_accumulation_steps (3)",
            "world size (4)",
        ] {
            assert!(err.contains(needle), "{err}");
        }
        let err = BatchPlan::derive(Some(30), Some(4), None, 4).unwrap_err().to_string();
        assert!(
            err.contains("train_batch_size (30)") && err.contains("gradient_accumulation_steps (not set)"),
            "{err}"
        );
        assert!(matches!(BatchPlan::derive(None, None, Some(2), 1), Err(ConfigError::MissingBatchSize)));
        assert!(BatchPlan::derive(Some(0), None, None, 1).is_err());
    }
}
