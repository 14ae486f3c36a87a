//! The training engine: a Burn model, a [`Plan`] and a rank's collective, driven with
//! [`Engine::forward`], [`Engine::backward`] and [`Engine::step`] (the model as one unit),
//! or [`Engine::forward_backward`] and [`Engine::step`] (a [`UnitModel`], one unit at a
//! time); a [`Pipeline`] stage trains a run of a model's units with
//! [`Pipeline::train_batch`].
//!
//! Each rank owns an `Engine`, and the engine a list of units (`engine/unit/`), each
//! with its own flat layout sharded over the ranks that hold it ([`Sharding`]). Between
//! steps a unit holds what its ZeRO stage keeps (see [`ZeroStage`](zerotrain_zero::ZeroStage)):
//! its parameters in the model in the compute dtype (stages 0-2; gathered on demand at
//! stage 3), fp32 master weights for its optimizer range (in fp32 training at stages 0-2
//! the model's parameters are the masters), a gradient accumulator (`engine/accumulation.rs`)
//! and an optimizer stepping its flat range (`engine/optimizer.rs`). The engine adds the
//! loss scaler, counters and the lr schedule; `engine/build.rs` makes it,
//! `engine/whole_model.rs` runs the model as one unit, `engine/unit_walk.rs` walks declared units,
//! `engine/step.rs` has the optimizer step, `engine/checkpoint/` saving and loading,
//! `engine/buffers.rs` the model's non-trainable tensors, `engine/span.rs` says where
//! the engine's units sit in the job (all of the model, or a pipeline stage's run), and
//! [`on_device`] runs collectives on device tensors (NCCL in the GPU's memory).
//!
//! # Note: mixed precision
//! With fp16 or bf16 the model computes in that dtype (the engine casts its parameters;
//! inputs must be in the same dtype). `backward` casts the loss to f32 and multiplies it by
//! the loss scale; gradients accumulate in `grad_accum_dtype` and are reduced in
//! `communication_data_type`; at the step they widen to f32, the global norm decides
//! overflow, and one multiply unscales, averages and clips them. The optimizer steps the
//! fp32 master, and the new values are cast to the compute dtype and all-gathered in it.

mod accumulation;
mod activation;
mod assemble;
mod buffers;
mod build;
mod builtin;
mod checkpoint;
mod export;
mod first_values;
mod flat;
mod frozen;
mod gathering;
mod gradients;
mod host_adam;
mod tier;
mod unit_walk;
pub(crate) use shared::agree;
mod infer;
mod master;
pub mod model;
mod notices;
pub mod offload_bench;
pub mod on_device;
pub mod optimizer;
mod params;
mod parts;
mod pipeline;
pub mod readout;
mod report;
mod shard_masters;
mod shared;
mod span;
mod step;
mod tensor;
#[cfg(test)]
mod tests;
mod unit;
mod whole_model;

use burn::module::Module;
use zerotrain_precision::LossScaler;
use zerotrain_zero::{CommStats, Sharding};

use self::buffers::Buffers;
pub use self::build::EngineBuilder;
pub use self::checkpoint::{LoadOptions, resume_point};
pub use self::export::consolidate;
pub use self::gradients::Gradients;
pub use self::model::{Activation, InitialValues, UnitModel, UnitSpec};
use self::notices::Notices;
pub use self::optimizer::{ShardOptimizer, ShardSegment};
use self::params::{ParamIndex, trainable_bytes};
pub use self::pipeline::Pipeline;
pub use self::report::{Counters, HostDeviceBytes, MemoryReport, PhaseTimes, StepReport};
use self::report::{Peaks, Window};
use self::shared::Shared;
use self::span::Span;
use self::unit::Unit;
use crate::config::Plan;
use zerotrain_precision::Precision;

/// A rank's training engine. See the module docs.
///
/// # Its whole surface, and where each part lives
/// - Building: [`new`](Self::new), [`with_units`](Self::with_units), [`builder`](Self::builder)
///   (`build.rs`).
/// - Training, one unit: [`forward`](Self::forward), [`backward`](Self::backward)
///   (`whole_model.rs`); declared units: [`forward_backward`](Self::forward_backward),
///   [`train_batch`](Self::train_batch) (`unit_walk.rs`); then [`step`](Self::step) (`step.rs`:
///   settle the reductions, unscale and clip, each unit's `unit/step.rs`). The gradients
///   before the step: [`gradients`](Self::gradients) (`gradients.rs`).
/// - Evaluating: [`evaluate`](Self::evaluate) (`infer.rs`), [`eval`](Self::eval),
///   [`full_model`](Self::full_model), [`sync_buffers`](Self::sync_buffers) (`whole_model.rs`).
/// - Checkpoints: [`save_checkpoint`](Self::save_checkpoint),
///   [`load_checkpoint`](Self::load_checkpoint) (`checkpoint/`); exports:
///   [`master_params`](Self::master_params), [`gather_model`](Self::gather_model),
///   [`save_model`](Self::save_model) (`export.rs`); replica groups' shards:
///   [`shard_masters`](Self::shard_masters), [`load_shard_masters`](Self::load_shard_masters)
///   (`shard_masters.rs`).
/// - State and reports (here): [`counters`](Self::counters), [`last_step`](Self::last_step),
///   [`get_lr`](Self::get_lr), [`set_lr`](Self::set_lr), [`loss_scale`](Self::loss_scale),
///   [`get_global_grad_norm`](Self::get_global_grad_norm),
///   [`is_gradient_accumulation_boundary`](Self::is_gradient_accumulation_boundary),
///   [`set_gradient_accumulation_boundary`](Self::set_gradient_accumulation_boundary),
///   [`memory_report`](Self::memory_report), [`comm_stats`](Self::comm_stats),
///   [`swap_traffic`](Self::swap_traffic), [`notices`](Self::notices), [`plan`](Self::plan),
///   [`sharding`](Self::sharding), [`module`](Self::module), [`num_params`](Self::num_params),
///   [`data_parallel_rank`](Self::data_parallel_rank),
///   [`data_parallel_size`](Self::data_parallel_size).
pub struct Engine<M: Module> {
    model: M,
    shared: Shared,
    units: Vec<Unit>,
    granularity: Granularity,
    span: Span,
    progress: Progress,
    window: Window,
    peaks: Peaks,
    buffers: Buffers,
    notices: Notices,
}

/// What the engine's units are to the model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Granularity {
    /// [`Engine::new`]: the whole model is the one unit, run by the caller's closures.
    WholeModel,
    /// [`UnitModel::units`] (a pipeline stage: a contiguous run of them): `declared` units
    /// walked in order, then, if `root`, the root unit (parameters no unit claims).
    Declared {
        /// How many of the engine's units are declared ones.
        declared: usize,
        /// Whether a root unit follows them.
        root: bool,
        /// Recompute every this many units in backward (0: keep every unit's graph).
        recompute_every: usize,
        /// How many units, the first, are recomputed (0 exactly when `recompute_every` is);
        /// the rest keep their graphs.
        recomputed: usize,
    },
}

impl Granularity {
    /// `declared` units (and a root unit after them if `root`), recomputed in groups of
    /// `every` (0: none) up to the first `units` of them (`None`: all).
    pub fn declared(declared: usize, root: bool, every: usize, units: Option<usize>) -> Self {
        let recomputed = if every == 0 { 0 } else { units.unwrap_or(declared).min(declared) };
        let recompute_every = if recomputed == 0 { 0 } else { every };
        Self::Declared { declared, root, recompute_every, recomputed }
    }

    /// Whether declared unit `i` is recomputed in backward (checkpointed in forward).
    pub fn recomputes(self, i: usize) -> bool {
        matches!(self, Self::Declared { recomputed, .. } if i < recomputed)
    }

    /// The root unit's index, if the model left parameters to it.
    pub fn root(self) -> Option<usize> {
        match self {
            Self::Declared { declared, root: true, .. } => Some(declared),
            _ => None,
        }
    }
}

/// Where training is: the loss scaler, the counters, the lr schedule's position and what
/// the caller set by hand.
struct Progress {
    scaler: Option<LossScaler>,
    counters: Counters,
    /// DeepSpeed's `last_batch_iteration` of the lr schedule (starts at -1).
    lr_iteration: i64,
    /// A learning rate set with [`Engine::set_lr`], used instead of the schedule's.
    lr_override: Option<f64>,
    /// Set with [`Engine::set_gradient_accumulation_boundary`]: whether the current
    /// micro-step ends the window, instead of counting to `gradient_accumulation_steps`.
    boundary_override: Option<bool>,
    last_step: Option<StepReport>,
    /// The step's gradients, reduced and measured ahead of [`Engine::step`] by
    /// [`Engine::gradients`].
    prepared: Option<gradients::Prepared>,
    /// The gradient norm's partials, read with the window's last loss
    /// ([`Engine::read_micro_step`]).
    measured: Option<gradients::Measured>,
    /// An optimizer step (or a checkpoint load) failed part-way on this rank: some units
    /// hold new values and some old ones (`step.rs`'s note).
    torn: bool,
}

impl Progress {
    /// Before the first step: no steps counted, the schedule at DeepSpeed's -1, the loss
    /// scaler (if any) at its initial scale.
    fn new(plan: &crate::Plan) -> Self {
        Progress {
            scaler: plan.precision.loss_scale.map(|s| s.scaler()),
            counters: Counters::default(),
            lr_iteration: -1,
            lr_override: None,
            boundary_override: None,
            last_step: None,
            prepared: None,
            measured: None,
            torn: false,
        }
    }
}

impl<M: Module> Engine<M> {
    /// Runs `f`, work that is not training (evaluation, a save, an export), leaving its time
    /// and traffic out of the step's report.
    pub(super) fn off_the_clock<T>(&mut self, f: impl FnOnce(&mut Self) -> crate::Result<T>) -> crate::Result<T> {
        let paused = self.window.pause(self.traffic());
        let result = f(self);
        self.window.resume(paused, self.traffic());
        result
    }

    /// The root unit where another pipeline stage's replica of it is the one that counts
    /// (in the norm, checkpoints and the model's values): this rank skips it there.
    pub(super) fn root_counted_elsewhere(&self) -> Option<usize> {
        self.granularity.root().filter(|_| !self.span.counts_root())
    }

    /// Whether the next [`step`](Self::step) will update the parameters: the window has
    /// `gradient_accumulation_steps` micro-steps, or the caller said so with
    /// [`set_gradient_accumulation_boundary`](Self::set_gradient_accumulation_boundary).
    pub fn is_gradient_accumulation_boundary(&self) -> bool {
        match self.progress.boundary_override {
            Some(boundary) => boundary && self.window.micro_steps > 0,
            None => self.window.micro_steps == self.shared.plan.batch.gradient_accumulation_steps,
        }
    }

    /// Overrides where accumulation windows end (DeepSpeed's
    /// `set_gradient_accumulation_boundary`; PyTorch DDP's `no_sync` in effect): with
    /// `Some(false)` the next micro-steps accumulate without ending the window, with
    /// `Some(true)` the next micro-step ends it, whatever `gradient_accumulation_steps`
    /// says; `None` returns to counting. Set it before the micro-step's backward. The loss
    /// is still divided by `gradient_accumulation_steps`, and stages 2-3 still
    /// reduce-scatter every micro-step (sharded gradients cannot wait); stages 0-1 reduce
    /// once, at the boundary.
    pub fn set_gradient_accumulation_boundary(&mut self, boundary: Option<bool>) {
        self.progress.boundary_override = boundary;
    }

    /// Whether the micro-step about to run ends the window.
    fn next_micro_step_is_boundary(&self) -> bool {
        match self.progress.boundary_override {
            Some(boundary) => boundary,
            None => self.window.micro_steps + 1 == self.shared.plan.batch.gradient_accumulation_steps,
        }
    }

    /// The loss scale the next backward pass multiplies the loss by (1 without fp16
    /// scaling).
    pub fn loss_scale(&self) -> f64 {
        self.progress.scaler.as_ref().map_or(1.0, LossScaler::scale)
    }

    /// The learning rate the next step will use (the default parameter group's).
    pub fn get_lr(&self) -> f64 {
        self.progress.lr_override.unwrap_or_else(|| self.shared.plan.optim.schedule.lr(self.progress.lr_iteration))
    }

    /// Sets the learning rate of the next steps by hand, instead of the schedule's (`None`:
    /// the schedule again). The schedule keeps counting steps meanwhile, as DeepSpeed's
    /// does when a program writes `param_group["lr"]`; parameter groups keep their scale.
    /// Checkpoints save it.
    pub fn set_lr(&mut self, lr: Option<f64>) {
        self.progress.lr_override = lr;
    }

    /// The global gradient norm of the last step, before clipping (DeepSpeed's
    /// `get_global_grad_norm`); `None` before the first step.
    pub fn get_global_grad_norm(&self) -> Option<f32> {
        self.progress.last_step.map(|r| r.grad_norm)
    }

    /// The report of the last optimizer step.
    pub fn last_step(&self) -> Option<StepReport> {
        self.progress.last_step
    }

    /// Step counters.
    pub fn counters(&self) -> Counters {
        self.progress.counters
    }

    /// The model as this rank holds it (DeepSpeed's `engine.module`): at stage 3 the
    /// parameters of released units are empty tensors, and each rank's buffers are its own
    /// until the next [`sync_buffers`](Self::sync_buffers).
    pub fn module(&self) -> &M {
        &self.model
    }

    /// The units and their flat layouts; its global order is the one checkpoints and
    /// [`master_params`](Self::master_params) use.
    pub fn sharding(&self) -> &Sharding {
        &self.shared.sharding
    }

    /// Number of trainable parameter elements of the model (Ψ; a pipeline stage holds
    /// a part of them).
    pub fn num_params(&self) -> usize {
        self.shared.sharding.global().num_elems()
    }

    /// The plan the engine runs.
    pub fn plan(&self) -> &Plan {
        &self.shared.plan
    }

    /// One-time warnings and notes the engine gave about how it runs this model (each was
    /// also printed once on world rank 0).
    pub fn notices(&self) -> &[String] {
        self.notices.all()
    }

    /// This rank's index among the ranks that split each batch (the world, its pipeline
    /// stage's data-parallel group, or its mesh's data-parallel places: a sequence group's
    /// ranks read the same samples).
    pub fn data_parallel_rank(&self) -> usize {
        self.shared.data_place.map_or_else(|| self.shared.comm.rank(), |(rank, _)| rank)
    }

    /// How many ranks split each batch (see [`data_parallel_rank`](Self::data_parallel_rank)).
    pub fn data_parallel_size(&self) -> usize {
        self.shared.data_place.map_or_else(|| self.shared.comm.world_size(), |(_, size)| size)
    }

    /// Bytes this rank has read from and written to its NVMe swap files so far
    /// (`offload_optimizer` / `offload_param` with device `nvme`): (read, written).
    pub fn swap_traffic(&self) -> (u64, u64) {
        let swaps = &self.shared.swaps;
        [&swaps.optimizer, &swaps.param]
            .into_iter()
            .flatten()
            .map(|d| d.moved())
            .fold((0, 0), |a, b| (a.0 + b.0, a.1 + b.1))
    }

    /// This rank's traffic so far, every communicator it uses together.
    pub fn comm_stats(&self) -> CommStats {
        let engine = self.span.comm_stats(self.shared.ranks.as_ref(), self.shared.comm.as_ref());
        // On a mesh, the tensor and sequence groups' traffic too (the model's, mostly).
        self.shared.mesh_groups.iter().fold(engine, |all, group| all.plus(&group.stats()))
    }

    /// The rank's counters now: collective traffic and host<->device copies.
    fn traffic(&self) -> report::Traffic {
        report::Traffic { comm: self.comm_stats(), crossed: self.shared.crossings(), reads: self.shared.device_reads() }
    }

    /// Model-state bytes this rank holds now, measured from its buffers and tensors.
    pub fn memory_report(&self) -> MemoryReport {
        let held: u64 = self.units.iter().map(Unit::master_bytes).sum();
        let fp32 = self.shared.plan.precision.compute == Precision::Fp32;
        let stage3 = self.shared.plan.zero.stage.shards_parameters();
        let elem_bytes = self.shared.plan.precision.compute.bytes_per_elem() as u64;
        MemoryReport {
            params: trainable_bytes(&self.model, &self.shared.index)
                + if fp32 { held } else { 0 }
                + self.units.iter().map(Unit::shard_bytes).sum::<u64>(),
            grads: self.units.iter().map(Unit::grad_bytes).sum(),
            master: if fp32 { 0 } else { held },
            optimizer: self.units.iter().map(Unit::state_bytes).sum(),
            frozen: self.buffers.frozen_bytes(&self.model)
                + self.units.iter().map(Unit::frozen_shard_bytes).sum::<u64>(),
            swapped: self.units.iter().map(|u| u.swapped_bytes(&self.shared)).sum(),
            peak_transient: self.peaks.transient,
            peak_gathered: self.peaks.gathered,
            peak_eval_gathered: self.peaks.eval_gathered,
            peak_activations: self.peaks.activations,
            persistent: if stage3 {
                self.units.iter().map(|u| u.resident_elems(&self.shared) * elem_bytes).sum()
            } else {
                0
            },
        }
    }
}

/// Counting a module's trainable parameters.
pub struct ParamCount;

impl ParamCount {
    /// Elements of the float parameters that require gradients.
    pub fn trainable<M: Module>(model: &M) -> u64 {
        ParamIndex::scan(model).0.iter().map(|(_, shape)| shape.iter().product::<usize>() as u64).sum()
    }
}
