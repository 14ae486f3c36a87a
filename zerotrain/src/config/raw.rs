//! The config file as written: DeepSpeed's field names, every one optional, validated into
//! a [`Plan`](super::Plan) by [`Config::resolve`](super::Config::resolve).
//!
//! Known DeepSpeed keys that zerotrain does not implement, and DeepSpeed switches for
//! behaviour zerotrain fixes one way, are not fields here: they are listed in
//! `keys::NOT_IMPLEMENTED` and `keys::FIXED_BEHAVIOUR`, removed before parsing and
//! reported in one warning when they would matter.
//! Unknown keys are rejected by [`Config::parse`](super::Config::parse), not by these
//! structs (they have no `deny_unknown_fields`): deserialise them through it.

use serde::{Deserialize, Serialize};

pub use super::mesh::{MeshConfig, TensorParallelConfig};
pub use super::replicas::{LocalSgdConfig, OuterOptimizerConfig};
use super::value::{AutoOr, Count};

/// A DeepSpeed `ds_config.json`, plus zerotrain's own `zerotrain` section.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct DeepSpeedConfig {
    /// Global batch size per optimizer step: micro batch x accumulation steps x world size.
    /// Any two of the three batch keys determine the third.
    pub train_batch_size: Option<AutoOr<Count>>,
    /// Samples per rank per forward/backward pass. Default when every batch key is `"auto"`: 1.
    pub train_micro_batch_size_per_gpu: Option<AutoOr<Count>>,
    /// Micro-steps per optimizer step; the loss is divided by it. Default 1.
    pub gradient_accumulation_steps: Option<AutoOr<Count>>,
    /// Maximum global L2 norm of the gradients; 0 turns clipping off. Default 0.
    pub gradient_clipping: Option<AutoOr<f64>>,
    /// Print a log line every this many optimizer steps. Default 10.
    pub steps_per_print: Option<AutoOr<Count>>,
    /// Add the step's time per phase (forward, backward, reduce, optimizer, gather) to the
    /// log lines. Default false.
    pub wall_clock_breakdown: Option<bool>,
    /// Seed for the examples' and CLI's model initialisation and data. Default 42.
    pub seed: Option<Count>,
    /// The optimizer. Default: Adam (AdamW mode) with lr 1e-3.
    pub optimizer: Option<OptimizerConfig>,
    /// The learning-rate schedule. Default: none (constant lr).
    pub scheduler: Option<SchedulerConfig>,
    /// ZeRO settings. Default: stage 0.
    pub zero_optimization: Option<ZeroConfig>,
    /// fp16 mixed precision with loss scaling. Default off.
    pub fp16: Option<Fp16Config>,
    /// bf16 mixed precision (alias `bfloat16`). Default off.
    #[serde(alias = "bfloat16")]
    pub bf16: Option<Bf16Config>,
    /// dtype gradients are reduced in: `fp32`, `fp16` or `bf16`. Default: the compute dtype.
    pub communication_data_type: Option<AutoOr<String>>,
    /// DeepSpeed's `data_types` section.
    pub data_types: Option<DataTypesConfig>,
    /// Pipeline parallelism over a model's units. Default: none.
    pub pipeline: Option<PipelineConfig>,
    /// Tensor parallelism (DeepSpeed's AutoTP training section). Default: none.
    pub tensor_parallel: Option<TensorParallelConfig>,
    /// Activation checkpointing: present (even `{}`), a model declared in units
    /// ([`UnitModel`](crate::engine::UnitModel)) keeps only the activations between units in
    /// forward and recomputes each unit in backward. Default: absent (off).
    pub activation_checkpointing: Option<ActivationCheckpointingConfig>,
    /// Asynchronous I/O of the NVMe offload tiers (DeepSpeed's `aio` section). Default: the
    /// values each key documents.
    pub aio: Option<AioConfig>,
    /// Replica groups that train apart and meet every `sync_every` steps (DiLoCo-style
    /// local SGD; not a DeepSpeed section). Default: none (one synchronous job).
    pub local_sgd: Option<LocalSgdConfig>,
    /// zerotrain's own settings (DeepSpeed ignores nothing here: it is our section).
    pub zerotrain: Option<ZerotrainConfig>,
}

/// `optimizer`: `{"type": ..., "params": {...}}`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct OptimizerConfig {
    /// `Adam`, `AdamW` or `SGD` (case-insensitive). DeepSpeed's `Adam` is AdamW unless
    /// `adam_w_mode` is false.
    #[serde(rename = "type")]
    pub kind: String,
    /// The optimizer's parameters (PyTorch names).
    #[serde(default)]
    pub params: OptimizerParams,
}

/// `optimizer.params`, the union of the supported optimizers' PyTorch parameter names.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct OptimizerParams {
    /// Learning rate. Default 1e-3 (FusedAdam's and torch's default).
    pub lr: Option<AutoOr<f64>>,
    /// Adam's (beta1, beta2). Default [0.9, 0.999].
    pub betas: Option<AutoOr<[f64; 2]>>,
    /// Adam's epsilon, added to sqrt(v). Default 1e-8 (Burn's own default is 1e-5).
    pub eps: Option<AutoOr<f64>>,
    /// Weight decay: decoupled for AdamW, L2 for Adam with `adam_w_mode: false` and SGD.
    /// Default 0.
    pub weight_decay: Option<AutoOr<f64>>,
    /// Adam only: `true` (default) is AdamW; `false` is Adam with L2 weight decay.
    pub adam_w_mode: Option<bool>,
    /// Adam only: use the AMSGrad variant. Default false.
    pub amsgrad: Option<bool>,
    /// Adam only: bias correction. Must be true (the default); false is refused.
    pub bias_correction: Option<bool>,
    /// SGD only: momentum factor. Default 0 (no momentum).
    pub momentum: Option<f64>,
    /// SGD only: dampening for momentum. Default 0 (PyTorch's; Burn's own default is 0.1).
    pub dampening: Option<f64>,
    /// SGD only: Nesterov momentum. Default false.
    pub nesterov: Option<bool>,
}

/// `scheduler`: `{"type": ..., "params": {...}}`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SchedulerConfig {
    /// `WarmupLR`, `WarmupDecayLR`, `WarmupCosineLR` or `OneCycle`.
    #[serde(rename = "type")]
    pub kind: String,
    /// The schedule's parameters.
    #[serde(default)]
    pub params: SchedulerParams,
}

/// `scheduler.params`, the union of the supported schedules' parameters (DeepSpeed names).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct SchedulerParams {
    /// Warmup start lr. Default 0.
    pub warmup_min_lr: Option<AutoOr<f64>>,
    /// Warmup end lr. Default: the optimizer's lr (WarmupLR), 1e-3 (WarmupDecayLR).
    pub warmup_max_lr: Option<AutoOr<f64>>,
    /// Warmup length in optimizer steps (values below 2 act as 2). Default 1000.
    pub warmup_num_steps: Option<AutoOr<Count>>,
    /// `log` (default) or `linear`.
    pub warmup_type: Option<String>,
    /// WarmupDecayLR / WarmupCosineLR: total optimizer steps. Required (`"auto"` takes
    /// the CLI's `--steps`).
    pub total_num_steps: Option<AutoOr<Count>>,
    /// WarmupCosineLR: ratio of the lr at the start of warmup. Default 0.
    pub warmup_min_ratio: Option<f64>,
    /// WarmupCosineLR: ratio of the lr at the end of the decay. Default 1e-4.
    pub cos_min_ratio: Option<f64>,
    /// OneCycle: lower lr of the cycle. Required.
    pub cycle_min_lr: Option<f64>,
    /// OneCycle: upper lr of the cycle. Required.
    pub cycle_max_lr: Option<f64>,
    /// OneCycle: post-cycle decay rate. Default 0.
    pub decay_lr_rate: Option<f64>,
    /// OneCycle: steps in the rising half. Default 2000.
    pub cycle_first_step_size: Option<Count>,
    /// OneCycle: steps in the falling half. Default: `cycle_first_step_size`.
    pub cycle_second_step_size: Option<Count>,
    /// OneCycle: stairs in the rising half (0: continuous). Default 0.
    pub cycle_first_stair_count: Option<Count>,
    /// OneCycle: stairs in the falling half. Default: `cycle_first_stair_count`.
    pub cycle_second_stair_count: Option<Count>,
    /// OneCycle: interval of the post-cycle decay (0: none). Default 0.
    pub decay_step_size: Option<Count>,
    /// OneCycle: cycle the momentum too. Accepted; only `false` is implemented, so `true`
    /// (DeepSpeed's default) gives a warning.
    pub cycle_momentum: Option<bool>,
    /// OneCycle momentum bounds and decay: accepted, not applied (see `cycle_momentum`).
    pub cycle_min_mom: Option<f64>,
    /// See `cycle_min_mom`.
    pub cycle_max_mom: Option<f64>,
    /// See `cycle_min_mom`.
    pub decay_mom_rate: Option<f64>,
    /// Resume position of the schedule. Default -1 (start).
    pub last_batch_iteration: Option<i64>,
}

/// `zero_optimization`. The legacy boolean form (`"zero_optimization": true`) means stage 1.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ZeroConfig {
    /// 0, 1, 2 or 3 (legacy `true`/`false`: 1/0). Default 0.
    pub stage: Option<Count>,
    /// Stages 2-3: most elements (over all ranks) one gradient reduce-scatter carries; a
    /// unit larger than this is reduced in several buckets, and no gradient buffer is
    /// larger. Default 5e8.
    pub reduce_bucket_size: Option<AutoOr<Count>>,
    /// Stage 1-2: reduce gradients with reduce-scatter (true, default) or all-reduce (false).
    pub reduce_scatter: Option<bool>,
    /// Reduce a unit's gradients on the rank's communication thread while the next unit's
    /// backward computes (and, at stages 2-3, leave them in flight into the next
    /// micro-step). Default: true at stage 3, false otherwise (DeepSpeed's defaults).
    pub overlap_comm: Option<bool>,
    /// Stage 3: parameters with at most this many elements stay resident between steps
    /// instead of being released. Default 1e5 (`"auto"` too).
    pub stage3_param_persistence_threshold: Option<AutoOr<Count>>,
    /// Stage 3: the next unit is gathered ahead, while the current one computes, if it has
    /// at most this many elements; 0 turns prefetching off. Default 5e7.
    pub stage3_prefetch_bucket_size: Option<AutoOr<Count>>,
    /// Stage 3: most gathered parameter elements alive besides the unit in use (a prefetch
    /// that would exceed it waits). Default 1e9.
    pub stage3_max_live_parameters: Option<AutoOr<Count>>,
    /// Where the fp32 master weights and optimizer state of the rank's shards live and are
    /// stepped (ZeRO-Offload, ZeRO-Infinity). Default: where the rank computes.
    pub offload_optimizer: Option<OffloadOptimizerConfig>,
    /// Stage 3: where each unit's parameter shard lives between uses. Default: where the
    /// rank computes.
    pub offload_param: Option<OffloadParamConfig>,
    /// Elements per optimizer tile: an offloaded optimizer reads, steps and writes back
    /// each unit's range in tiles of at most this many elements. Default 1e9 (`"auto"` too).
    pub sub_group_size: Option<AutoOr<Count>>,
}

/// `zero_optimization.offload_optimizer` (DeepSpeed's keys and meanings).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct OffloadOptimizerConfig {
    /// `none` (default), `cpu` (host memory) or `nvme` (files under `nvme_path`).
    pub device: Option<String>,
    /// `nvme`: the folder the swap files go in (a per-run, per-rank folder is made inside).
    pub nvme_path: Option<String>,
    /// Page-locked host buffers for device transfers. Accepted; CPU ranks have no
    /// transfers to speed up, and the GPU paths copy through Burn.
    pub pin_memory: Option<bool>,
    /// `nvme`: tile buffers in memory at once, one per tensor of a tile (master weights and
    /// each optimizer moment; Adam needs 3 per tile). Default 4.
    pub buffer_count: Option<Count>,
    /// `nvme`: read the next tile while the current one steps. Default false.
    pub pipeline_read: Option<bool>,
    /// `nvme`: write the previous tile back while the current one steps. Default false.
    pub pipeline_write: Option<bool>,
    /// DeepSpeed's older name for turning on both `pipeline_read` and `pipeline_write`.
    pub pipeline: Option<bool>,
    /// DeepSpeed's faster swap-file creation. Accepted; swap files are written as they are
    /// first filled.
    pub fast_init: Option<bool>,
    /// Partial offload: the fraction of the optimizer stepped off the device. Only 1
    /// (the default, everything) is supported.
    pub ratio: Option<f64>,
}

/// `zero_optimization.offload_param` (DeepSpeed's keys and meanings; stage 3 only).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct OffloadParamConfig {
    /// `none` (default), `cpu` (host memory) or `nvme` (files under `nvme_path`).
    pub device: Option<String>,
    /// `nvme`: the folder the swap files go in.
    pub nvme_path: Option<String>,
    /// See [`OffloadOptimizerConfig::pin_memory`].
    pub pin_memory: Option<bool>,
    /// `nvme`: unit shards read ahead at most (the prefetch bound applies too). Default 5.
    pub buffer_count: Option<Count>,
    /// `nvme`: DeepSpeed's size of each parameter buffer in elements. Accepted; a buffer
    /// here is one unit's shard, whatever its size. Default 1e8.
    pub buffer_size: Option<AutoOr<Count>>,
    /// `nvme`: elements of unit shards kept cached in host memory (the most recently used
    /// units). Default 1e9.
    pub max_in_cpu: Option<AutoOr<Count>>,
}

/// `aio`: DeepSpeed's asynchronous I/O settings, used by the NVMe tiers.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct AioConfig {
    /// Bytes per read or write request. Default 1048576.
    pub block_size: Option<Count>,
    /// Requests in flight per I/O thread. Default 8.
    pub queue_depth: Option<Count>,
    /// I/O threads. Default 1 (DeepSpeed's newer name `intra_op_parallelism` too).
    #[serde(alias = "intra_op_parallelism")]
    pub thread_count: Option<Count>,
    /// Submit requests one at a time instead of in batches. Default false.
    pub single_submit: Option<bool>,
    /// Overlap submitting and completing requests. Default true.
    pub overlap_events: Option<bool>,
    /// GPUDirect Storage. Only `false` (the default) is supported.
    pub use_gds: Option<bool>,
}

/// `fp16`: DeepSpeed's loss-scaling keys.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Fp16Config {
    /// Train in fp16. Default false (`"auto"`: false).
    pub enabled: Option<AutoOr<bool>>,
    /// DeepSpeed's input autocast. Accepted with a warning: build inputs in the compute dtype.
    pub auto_cast: Option<AutoOr<bool>>,
    /// 0 (default): dynamic scaling; otherwise a fixed scale.
    pub loss_scale: Option<AutoOr<f64>>,
    /// Dynamic scaling starts at 2^this. Default 16.
    pub initial_scale_power: Option<AutoOr<Count>>,
    /// Overflow-free steps before the scale doubles. Default 1000.
    pub loss_scale_window: Option<AutoOr<Count>>,
    /// Overflows tolerated before the scale halves. Default 2.
    pub hysteresis: Option<AutoOr<Count>>,
    /// Refill the hysteresis after every overflow-free step. Default false.
    pub consecutive_hysteresis: Option<bool>,
    /// Smallest scale. Default 1.
    pub min_loss_scale: Option<AutoOr<f64>>,
    /// DeepSpeed's fp16 master weights and gradients; `true` is refused (masters are fp32).
    pub fp16_master_weights_and_grads: Option<bool>,
}

/// `activation_checkpointing`: DeepSpeed's keys. Recomputation is at unit boundaries; the
/// keys below tune DeepSpeed's own implementation and have no effect here (one warning
/// lists those set).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ActivationCheckpointingConfig {
    /// Partition checkpoints across model-parallel ranks. No model parallelism here.
    pub partition_activations: Option<bool>,
    /// Move checkpoints to CPU memory. CPU ranks keep them in host memory anyway.
    pub cpu_checkpointing: Option<bool>,
    /// Copy checkpoints into one contiguous buffer.
    pub contiguous_memory_optimization: Option<bool>,
    /// Size of that buffer in checkpoints.
    pub number_checkpoints: Option<Count>,
    /// Synchronise the device at every checkpoint boundary.
    pub synchronize_checkpoint_boundary: Option<bool>,
    /// Time the checkpointed forward and backward passes.
    pub profile: Option<bool>,
}

/// `data_types`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct DataTypesConfig {
    /// dtype gradients accumulate in between optimizer steps: `fp32`, `fp16` or `bf16`.
    /// Default: the compute dtype (the ZeRO paper's 2 bytes per gradient); `fp32` costs 2
    /// more bytes per accumulated element and avoids half-precision rounding per micro-step.
    pub grad_accum_dtype: Option<String>,
}

/// `bf16` (alias `bfloat16`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Bf16Config {
    /// Train in bf16. Default false (`"auto"`: false).
    pub enabled: Option<AutoOr<bool>>,
}

/// `zerotrain`: settings DeepSpeed gets from its launcher.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ZerotrainConfig {
    /// Number of ranks. Default 1; the CLI's `--world-size` overrides it.
    pub world_size: Option<Count>,
    /// How ranks talk: `auto` (default: MPI when the caller says this process runs under
    /// `mpirun`, the launcher backend when a launcher started it, else threads), `threads`
    /// (one thread per rank in this process), `mpi` or `launcher` (processes started by
    /// `zerotrain launch` or torchrun, joined over TCP, collectives over NCCL).
    pub backend: Option<String>,
    /// Where each rank computes: `cpu` (default; Burn's Flex backend), `wgpu` (the `wgpu`
    /// feature: a GPU through Vulkan, Metal or DX12) or `cuda` (the `cuda` feature). The
    /// CLI's `--device` overrides it.
    pub device: Option<String>,
    /// Which library runs the reductions and gathers: `auto` (default: NCCL when the ranks
    /// compute on `cuda` and NCCL can run: libnccl loads and no two ranks of a machine share
    /// a GPU; else the host backend, with one notice), `nccl` (an error where it cannot run)
    /// or `host` (threads or MPI, over host memory).
    pub collectives: Option<String>,
    /// Seconds a rank waits at a collective for the others before the job fails. Default 300.
    pub comm_timeout_s: Option<f64>,
    /// Skip and count steps whose gradients contain NaN or inf (fp32 and bf16 runs, which
    /// have no loss scaler to do it). Default true.
    pub check_grad_overflow: Option<bool>,
    /// Keep only the newest this many checkpoints in a save directory (never the one
    /// `latest` names). Default: keep all.
    pub keep_last_n_checkpoints: Option<Count>,
    /// fp16: what an overflow at `min_loss_scale` does: `error` (default; DeepSpeed stops the
    /// run) or `stay` (skip the step, keep the minimum scale, warn).
    pub loss_scale_at_minimum: Option<String>,
    /// The pipeline schedule: `1f1b` (default: one forward, one backward, at most as many
    /// micro-batches in flight as stages) or `gpipe` (all forwards, then all backwards).
    pub schedule: Option<String>,
    /// With activation checkpointing: recompute at most this many units, the first ones
    /// (per pipeline stage), and keep the activations of the rest, trading memory for the
    /// forward that recomputation repeats (Megatron's `block` recompute method with
    /// `recompute_num_layers`). 0 recomputes none. Default: every unit.
    pub recompute_units: Option<Count>,
    /// Parameter groups with their own lr and weight decay, by module-path pattern (the
    /// first matching group wins; the rest is `optimizer.params`). Default: none.
    #[serde(default)]
    pub param_groups: Vec<ParamGroupConfig>,
    /// The device mesh's tensor- and sequence-parallel sizes. Default: none (1 and 1).
    pub mesh: Option<MeshConfig>,
    /// Fine-tune low-rank adapters on a frozen model: PEFT's `LoraConfig` keys (`r`,
    /// `lora_alpha`, `target_modules`, ...). Default: none (every parameter trains).
    pub lora: Option<serde_json::Value>,
}

/// One of `zerotrain.param_groups`: PyTorch's parameter group, its parameters named by
/// module-path pattern.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ParamGroupConfig {
    /// Module-path patterns; `*` matches any run of characters (`*.bias`, `blocks.*.norm.*`).
    pub params: Vec<String>,
    /// The group's base lr (the schedule scales it as it scales `optimizer.params.lr`).
    /// Default: the optimizer's.
    pub lr: Option<f64>,
    /// The group's weight decay. Default: the optimizer's.
    pub weight_decay: Option<f64>,
}

/// `pipeline`: DeepSpeed's pipeline keys. Micro-batches per step are
/// `gradient_accumulation_steps`, as in DeepSpeed's pipeline engine.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct PipelineConfig {
    /// Pipeline stages `K` (dividing the world size; the rest is data parallelism).
    /// Default 1 (`"auto"` too): no pipeline.
    pub stages: Option<AutoOr<Count>>,
    /// How units are divided: `parameters` (default; balance parameter counts; DeepSpeed's
    /// `best` means the same) or `uniform` (balance unit counts).
    #[serde(alias = "partition_method")]
    pub partition: Option<String>,
    /// Recompute every this many units in backward (0: keep activations). Default: 1 with
    /// an `activation_checkpointing` section, else 0.
    pub activation_checkpoint_interval: Option<Count>,
    /// DeepSpeed seeds each layer's RNG by its index; `true` is accepted with a warning.
    pub seed_layers: Option<bool>,
}
