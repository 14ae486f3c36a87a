//! The validated plan a config resolves to: every value concrete, every default applied,
//! every `"auto"` resolved and noted. A [`Plan`] is a handful of sub-plans, one per
//! concern, each resolved by its own module: [`RuntimePlan`] (`runtime.rs`),
//! [`BatchPlan`](super::BatchPlan) (`batch.rs`), [`ZeroPlan`] and [`PipelinePlan`]
//! (`parallel.rs`), [`PrecisionPlan`] (`precision.rs`) and [`OptimPlan`] (`optim.rs`).

use std::time::Duration;

use serde::Serialize;
use zerotrain_precision::{DynamicScaleConfig, LossScaler, Precision};
use zerotrain_zero::ZeroStage;
use zerotrain_zero::pipeline::{PartitionMethod, ScheduleKind};

use super::MeshPlan;

pub use super::batch::BatchPlan;
pub use super::lora::{LoraPlan, Quantization};
pub use super::offload::{AioPlan, OffloadPlan, Tier};
pub use super::optim::{OptimPlan, OptimizerPlan, ParamGroupPlan};

/// Largest world size of the threads backend (ranks are threads of one process; under
/// `mpirun` the process count decides and is not limited here).
pub const MAX_THREAD_RANKS: usize = 1024;

/// A validated config: what the engine and the launcher run.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Plan {
    /// Ranks, backend, device, timeouts and logging.
    pub runtime: RuntimePlan,
    /// Batch sizes.
    pub batch: BatchPlan,
    /// ZeRO settings.
    pub zero: ZeroPlan,
    /// Pipeline parallelism; `None` without (one stage).
    pub pipeline: Option<PipelinePlan>,
    /// Replica groups (`local_sgd`); `None` without (one synchronous job).
    pub replicas: Option<ReplicaPlan>,
    /// The device mesh: ranks splitting each layer and each sequence (1 and 1 without).
    pub mesh: MeshPlan,
    /// Dtypes, loss scaling and the non-finite gradient check.
    pub precision: PrecisionPlan,
    /// The optimizer, its parameter groups, the lr schedule and clipping.
    pub optim: OptimPlan,
    /// Recompute each unit in backward instead of keeping its activations (models declared
    /// in units; an engine built with `Engine::new` is one unit and warns that it cannot).
    pub activation_checkpointing: bool,
    /// With recomputation (above, or a pipeline's `activation_checkpoint_interval`): at most
    /// this many units, the first of the model (of each pipeline stage), are recomputed and
    /// the rest keep their activations (`zerotrain.recompute_units`); `None`: every unit.
    pub recompute_units: Option<usize>,
    /// Low-rank adapters fine-tuned on a frozen model (`zerotrain.lora`); `None`: every
    /// parameter the model leaves trainable trains.
    pub lora: Option<LoraPlan>,
    /// How `"auto"` values were resolved, and the keys that have no effect.
    pub notes: PlanNotes,
    /// Settings outside the config's DeepSpeed keys that every rank of a job of processes
    /// must share, by name (an application's: the context it trains at, say). The
    /// rendezvous compares them, as it compares the plan's own values, before any rank
    /// trains. Empty after [`Config::resolve`](crate::Config::resolve).
    pub agreed: std::collections::BTreeMap<String, String>,
}

impl Plan {
    /// Number of ranks.
    pub fn world_size(&self) -> usize {
        self.runtime.world_size
    }

    /// Ranks that hold the same units and split each batch between them: the world, or a
    /// pipeline stage's data-parallel group, over the mesh's `tp * sp` (ZeRO's group).
    pub fn data_parallel_size(&self) -> usize {
        let stage = self.pipeline.map_or(self.runtime.world_size, |p| p.data_parallel(self.runtime.world_size));
        stage / self.mesh.model_parallel()
    }

    /// Ranks ZeRO shards each unit over: a stage's data-parallel places and their sequence
    /// ranks (which hold the same part of the model), within one replica group where the
    /// job's ranks are several groups.
    pub fn sharding_size(&self) -> usize {
        let groups = self.replicas.as_ref().filter(|r| r.group.is_none()).map_or(1, |r| r.groups);
        self.data_parallel_size() * self.mesh.sp / groups.max(1)
    }

    /// Sequences read per optimizer step by every rank that shares the data: the global
    /// batch `train_batch_size`, times the groups when this job is one replica group
    /// through parameter servers (each group reads its own part of every step, as the
    /// groups of one job do). A sampler that strides through a corpus step by step strides
    /// by this, so that no two groups read the same sequence.
    pub fn sequences_per_step(&self) -> u64 {
        let groups = self.replicas.as_ref().filter(|r| r.group.is_some()).map_or(1, |r| r.groups as u64);
        self.batch.train_batch_size.saturating_mul(groups)
    }

    /// The one warning for accepted keys that have no effect, if any.
    pub fn warning(&self) -> Option<String> {
        self.notes.warning()
    }
}

/// Where and how the ranks run.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RuntimePlan {
    /// Number of ranks.
    pub world_size: usize,
    /// The collective backend.
    pub backend: Backend,
    /// Where each rank computes.
    pub device: ComputeDevice,
    /// Which library runs the collectives (`zerotrain.collectives`).
    pub collectives: Collectives,
    /// How long a collective waits for the other ranks.
    #[serde(serialize_with = "seconds")]
    pub comm_timeout: Duration,
    /// Seed for initialisation and data.
    pub seed: u64,
    /// Log every this many steps.
    pub steps_per_print: u64,
    /// Add per-phase step times to the log lines.
    pub wall_clock_breakdown: bool,
    /// Checkpoints to keep in a directory (the oldest beyond are removed after a save).
    pub keep_last_n_checkpoints: Option<usize>,
}

fn seconds<S: serde::Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_f64(d.as_secs_f64())
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
    /// One thread per rank in this process (refused inside a multi-process `mpirun` job:
    /// each process would train a separate copy).
    Threads,
    /// One process per rank, started by `mpirun` (needs the `mpi` feature).
    Mpi,
    /// One process per rank, started by `zerotrain launch`, torchrun or a cluster's operator
    /// (`RANK`, `WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`): joined over TCP through rank 0,
    /// collectives over NCCL on CUDA devices.
    Launcher,
}

/// Which library runs the ranks' reductions and gathers (`zerotrain.collectives`); where
/// `auto` lands is decided at launch, when the devices are known.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Collectives {
    /// NCCL where the ranks are on CUDA devices and it can run, the host backend otherwise.
    #[default]
    Auto,
    /// NCCL on every rank's GPU (`zerotrain.device: "cuda"`); an error where it cannot run.
    Nccl,
    /// The host backend (threads or MPI) over host memory, on every device.
    Host,
}

impl std::str::FromStr for Collectives {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(Self::Auto),
            "nccl" => Ok(Self::Nccl),
            "host" => Ok(Self::Host),
            other => Err(format!("unknown collectives `{other}`; available: auto, nccl, host")),
        }
    }
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

/// ZeRO settings after defaults.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ZeroPlan {
    /// The stage.
    #[serde(serialize_with = "stage_index")]
    pub stage: ZeroStage,
    /// Stage 1: reduce-scatter (true) or all-reduce (false) the gradients at the boundary.
    pub reduce_scatter: bool,
    /// Stages 2-3: most elements (over all ranks) in one gradient reduce-scatter.
    pub reduce_bucket_size: u64,
    /// Reductions run on the communication thread while backward goes on.
    pub overlap_comm: bool,
    /// Stage 3: parameters with at most this many elements stay resident.
    pub param_persistence_threshold: u64,
    /// Stage 3: the next unit is prefetched if it has at most this many elements (0: never).
    pub prefetch_bucket_size: u64,
    /// Stage 3: most gathered elements alive besides the unit in use.
    pub max_live_parameters: u64,
    /// Where master weights, optimizer state and parameter shards live between uses.
    pub offload: OffloadPlan,
}

fn stage_index<S: serde::Serializer>(stage: &ZeroStage, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_u8(stage.index())
}

/// Replica groups (`local_sgd`): the world's ranks are `groups` groups of contiguous
/// ranks, each a data-parallel ZeRO job; every `sync_every` steps the groups average their
/// progress through the outer optimizer.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ReplicaPlan {
    /// Groups, at least 2 in one job (any number across jobs).
    pub groups: usize,
    /// Optimizer steps between synchronisations, at least 1.
    pub sync_every: u64,
    /// The optimizer of the global weights.
    pub outer: OuterOptimizer,
    /// dtype the pseudo-gradients travel in.
    pub comm_dtype: Precision,
    /// Parameter servers; empty: the groups are in this job.
    pub servers: Vec<String>,
    /// With servers: this job's group (the whole job is one group).
    pub group: Option<usize>,
    /// How the servers apply pushes.
    pub mode: ReplicaMode,
    /// With servers: how long a group may keep the others waiting before the servers drop
    /// it from the quorum.
    #[serde(serialize_with = "seconds")]
    pub group_timeout: Duration,
    /// With servers: a server with a checkpoint folder saves every this many rounds.
    pub checkpoint_every: u64,
    /// With servers: the file of the token calls carry (`local_sgd.auth_token_file`).
    pub auth_token_file: Option<std::path::PathBuf>,
    /// With servers: TLS on every call (`local_sgd.tls`).
    pub tls: Option<TlsPlan>,
}

/// `local_sgd.tls`: the PEM files of a server's identity and of the authority workers trust
/// it by.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct TlsPlan {
    /// The server's certificate chain.
    pub cert_file: Option<std::path::PathBuf>,
    /// The server's private key.
    pub key_file: Option<std::path::PathBuf>,
    /// What workers trust the server's certificate by.
    pub ca_file: Option<std::path::PathBuf>,
    /// The name workers expect in the certificate (default: each server's host).
    pub domain: Option<String>,
}

/// `local_sgd.mode`: when the global weights move.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ReplicaMode {
    /// A round applies once every live group has pushed it (the mean, in group order).
    Sync,
    /// Each push applies as it arrives (Delayed Nesterov); a group more than
    /// `max_staleness` rounds ahead of the slowest live one waits.
    Async {
        /// Rounds a group may run ahead of the slowest live group.
        max_staleness: u64,
    },
}

impl ReplicaPlan {
    /// Ranks per group for `world_size` ranks (the whole job with servers).
    pub fn group_size(&self, world_size: usize) -> usize {
        if self.servers.is_empty() { world_size / self.groups } else { world_size }
    }
}

/// SGD on the global weights with the pseudo-gradient (global minus the groups' mean), as
/// PyTorch's `torch.optim.SGD` steps it: `buf = momentum * buf + g` (`buf = g` at first),
/// then `w -= lr * (g + momentum * buf)` with Nesterov, `w -= lr * buf` without.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct OuterOptimizer {
    /// Learning rate.
    pub lr: f64,
    /// Momentum (0: none).
    pub momentum: f64,
    /// Nesterov momentum.
    pub nesterov: bool,
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

/// Dtypes, loss scaling and the non-finite check.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct PrecisionPlan {
    /// The compute dtype: parameters and activations.
    pub compute: Precision,
    /// The dtype gradients are reduced in.
    pub comm: Precision,
    /// The dtype gradients accumulate in between optimizer steps.
    pub grad_accum: Precision,
    /// fp16's loss scaling; `None` for fp32 and bf16.
    pub loss_scale: Option<LossScalePlan>,
    /// Skip (and count) a step whose gradients are not finite, instead of applying it.
    /// The check is the global norm: NaN/inf anywhere, on any rank, makes it non-finite
    /// (as does a squared norm beyond f32's range, i.e. a norm above 1.8e19).
    pub check_grad_overflow: bool,
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

/// What resolution decided on the user's behalf, to show them.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct PlanNotes {
    /// How each `"auto"` was resolved.
    pub auto_resolved: Vec<String>,
    /// Keys the config sets that have no effect here, each with why (DeepSpeed keys
    /// zerotrain does not implement, and settings the chosen path ignores).
    pub no_effect: Vec<String>,
}

impl PlanNotes {
    /// The one warning for accepted keys that have no effect, if any.
    pub fn warning(&self) -> Option<String> {
        (!self.no_effect.is_empty()).then(|| {
            format!("zerotrain accepts these keys but they have no effect here: {}", self.no_effect.join(", "))
        })
    }
}
