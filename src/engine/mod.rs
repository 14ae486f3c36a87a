//! The training engine: a Burn model, a [`Plan`] and a rank's collective, driven with
//! [`Engine::forward`], [`Engine::backward`] and [`Engine::step`] (the model as one unit),
//! or [`Engine::forward_backward`] and [`Engine::step`] (a [`UnitModel`], one unit at a
//! time).
//!
//! Each rank owns an `Engine`, and the engine a list of units (`engine/unit.rs`), each
//! with its own flat layout sharded over every rank ([`Sharding`]). Between steps a unit
//! holds what its ZeRO stage keeps (see [`ZeroStage`](zerotrain_zero::ZeroStage)): its
//! parameters in the model in the compute dtype (stages 0-2; gathered on demand at stage
//! 3), fp32 master weights for its optimizer range (in fp32 training at stages 0-2 the
//! model's parameters are the masters), a gradient accumulator (`engine/grads.rs`) and a
//! Burn optimizer stepping its flat range (`engine/optimizer.rs`). The engine adds the loss
//! scaler, counters and the lr schedule; `engine/exec.rs` walks the units,
//! `engine/step.rs` has the optimizer step, `engine/checkpoint.rs` saving and loading.
//!
//! # Note: mixed precision
//! With fp16 or bf16 the model computes in that dtype (the engine casts its parameters;
//! inputs must be in the same dtype). `backward` casts the loss to f32 and multiplies it by
//! the loss scale; gradients accumulate in `grad_accum_dtype` and are reduced in
//! `communication_data_type`; at the step they widen to f32, the global norm decides
//! overflow, and one multiply unscales, averages and clips them. The optimizer steps the
//! fp32 master, and the new values are cast to the compute dtype and all-gathered in it.

mod checkpoint;
mod exec;
mod grads;
mod master;
pub mod model;
mod optimizer;
mod params;
mod pipeline;
mod step;
#[cfg(test)]
mod tests;
mod unit;

use std::sync::Arc;
use std::time::Instant;

use burn::module::Module;
use burn::optim::GradientsParams;
use burn::tensor::{DType, Device, FloatDType, Tensor};
use zerotrain_precision::{BufMut, LossScaler, Precision};
use zerotrain_zero::{Collective, CommStats, ReduceOp, Sharding};

pub use self::checkpoint::LoadOptions;
use self::grads::ReduceOptions;
pub use self::model::{Activation, UnitModel, UnitSpec};
use self::params::{ParamIndex, ParamShapes, read_params, take_grads, trainable_bytes};
use self::unit::{Shared, Unit};
use crate::config::{ComputeDevice, ConfigError, Plan};
use crate::context::RankContext;
use crate::{Error, Result};

/// Shard alignment in elements (one 64-byte cache line of f32).
const ALIGN_ELEMS: usize = 16;

/// What one optimizer step did.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepReport {
    /// `global_steps` after this step.
    pub global_step: u64,
    /// Mean loss over every rank and micro-step of the step.
    pub loss: f32,
    /// The learning rate the step used.
    pub lr: f64,
    /// Global L2 norm of the averaged gradient, before clipping (inf or NaN on overflow).
    pub grad_norm: f32,
    /// The gradients were not finite and the step was skipped: parameters, optimizer state
    /// and the lr schedule are unchanged (see [`Plan::check_grad_overflow`]).
    pub skipped: bool,
    /// The loss scale the step's gradients carried (1 without fp16 scaling).
    pub loss_scale: f64,
    /// The loss scale for the next step (differs after an fp16 overflow or growth).
    pub next_loss_scale: f64,
    /// Bytes this rank moved in collectives during the step's window.
    pub comm_bytes: u64,
    /// Where the step's time went (its micro-steps included).
    pub times: PhaseTimes,
}

/// Where one optimizer step's wall time went (DeepSpeed's `wall_clock_breakdown`), seconds.
/// The first five phases partition the compute thread's time; `comm_wait` is the part of
/// `reduce` and `gather` spent blocked on collectives, `comm_busy` the time collectives ran
/// (on the communication thread, overlapping compute when they can).
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize)]
pub struct PhaseTimes {
    /// Forward passes (the closures, or the units and the loss).
    pub forward: f64,
    /// Back-propagation, recomputation of checkpointed units included.
    pub backward: f64,
    /// Collecting and reducing gradients (buckets, reduce-scatter / all-reduce, norm,
    /// overflow check).
    pub reduce: f64,
    /// The optimizer on the rank's range.
    pub optimizer: f64,
    /// Putting parameters in place: all-gathers and writing them into the model.
    pub gather: f64,
    /// Time the compute thread waited for collectives to finish.
    pub comm_wait: f64,
    /// Time the collectives themselves took.
    pub comm_busy: f64,
    /// Pipeline stages: time waiting for activations and gradients from the neighbouring
    /// stages, and at the flush for the last stage to finish (the bubble, and any
    /// imbalance); outside the other phases but for the flush, which is part of `reduce`.
    pub pipe_wait: f64,
}

impl PhaseTimes {
    /// The compute thread's phases together.
    pub fn total(&self) -> f64 {
        self.forward + self.backward + self.reduce + self.optimizer + self.gather
    }
}

/// Model-state bytes one rank holds, by kind (see [`Engine::memory_report`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MemoryReport {
    /// Trainable parameters in the model (compute dtype) plus, in fp32 training at stage 3,
    /// the parameter shards.
    pub params: u64,
    /// Gradient accumulators.
    pub grads: u64,
    /// Separate fp32 master weights (mixed precision; in fp32 training the parameters are
    /// their own master).
    pub master: u64,
    /// Optimizer state.
    pub optimizer: u64,
    /// Largest total of transient buffers alive at once inside a micro-step or step so far.
    pub peak_transient: u64,
    /// Stage 3: most bytes of gathered parameters alive at once so far (units in the
    /// model or being fetched), in the compute dtype; resident parameters not included.
    pub peak_gathered: u64,
    /// Stage 3: bytes of parameters that stay resident in the model (persistence).
    pub persistent: u64,
    /// A pipeline stage: most bytes of activations kept at once for pending backwards
    /// (unit boundaries, and inputs and outputs of units that keep their graphs; the
    /// graphs' insides are not counted).
    pub peak_activations: u64,
}

impl MemoryReport {
    /// Model states held between steps (everything but the transient peaks).
    pub fn model_states(&self) -> u64 {
        self.params + self.grads + self.master + self.optimizer
    }
}

/// Step counters, as DeepSpeed names them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Counters {
    /// Optimizer steps taken (skipped ones included).
    pub global_steps: u64,
    /// Backward passes.
    pub micro_steps: u64,
    /// Steps skipped because the gradients overflowed (every overflow skips a step).
    pub skipped_steps: u64,
    /// Samples consumed by all ranks.
    pub global_samples: u64,
}

/// A rank's training engine. See the module docs.
pub struct Engine<M: Module> {
    model: M,
    shared: Shared,
    units: Vec<Unit>,
    /// How many of `units` the model declared (0 for [`Engine::new`]); a unit after them
    /// is the root.
    num_declared: usize,
    scaler: Option<LossScaler>,
    counters: Counters,
    /// DeepSpeed's `last_batch_iteration` of the lr schedule (starts at -1).
    lr_iteration: i64,
    window: Window,
    last_step: Option<StepReport>,
    peaks: Peaks,
    /// Where this rank sits in a pipeline, if the plan has one.
    stage: Option<pipeline::Stage>,
}

/// The accumulation window in progress.
#[derive(Debug, Clone, Copy, Default)]
struct Window {
    micro_steps: u64,
    loss_sum: f64,
    comm_at_start: CommStats,
    times: PhaseTimes,
}

/// Which units a rank holds and where they are sharded: what [`Engine::build`] needs
/// beside the model, the plan and the rank.
struct Placement {
    /// The group the units are sharded over.
    comm: Arc<dyn Collective>,
    sharding: Sharding,
    index: ParamIndex,
    /// How many of the sharding's units are declared ones (0: the model as one unit).
    num_declared: usize,
    stage: Option<pipeline::Stage>,
}

/// Transient memory high-water marks, in bytes.
#[derive(Debug, Clone, Copy, Default)]
struct Peaks {
    transient: u64,
    gathered: u64,
    activations: u64,
}

/// An error naming the config key if `device` (the plan's `kind`) cannot compute in
/// `precision` (wgpu has no bf16, and f16 only where the adapter offers it).
fn check_dtype(precision: Precision, kind: ComputeDevice, device: &Device) -> Result<()> {
    let (dtype, key) = match precision {
        Precision::Fp32 => return Ok(()),
        Precision::Fp16 => (DType::F16, "fp16.enabled"),
        Precision::Bf16 => (DType::BF16, "bf16.enabled"),
    };
    if device.supports_dtype(dtype) {
        return Ok(());
    }
    Err(Error::Config(ConfigError::Unsupported {
        key: key.into(),
        message: format!(
            "this rank's {} device cannot compute in {precision}: train in a dtype it has (fp32 always works)",
            kind.name()
        ),
    }))
}

impl<M: Module> Engine<M> {
    /// Wraps `model` for training under `plan` on `ctx`'s rank, as one unit: at stage 3 the
    /// whole model is gathered for [`forward`](Self::forward) and released after
    /// [`backward`](Self::backward). Every rank must call it; rank 0's parameters are
    /// broadcast so that all ranks start identical.
    pub fn new(model: M, plan: &Plan, ctx: &RankContext) -> Result<Self> {
        if plan.pipeline.is_some() {
            return Err(Error::Usage(
                "the plan has pipeline stages: build the engine with Engine::with_units (a pipeline runs a model's \
                 units)"
                    .into(),
            ));
        }
        let (model, params, index) = Self::scan(model, ctx)?;
        let sharding = Sharding::single(params, plan.world_size, ALIGN_ELEMS)?;
        let placement = Placement { comm: ctx.collective(), sharding, index, num_declared: 0, stage: None };
        Self::build(model, plan, ctx, placement)
    }

    /// The model forked onto the rank's device, its trainable parameters (path, shape) and
    /// their index; an error if it has none.
    fn scan(model: M, ctx: &RankContext) -> Result<(M, ParamShapes, ParamIndex)> {
        let model = model.fork(ctx.device());
        let (params, index) = ParamIndex::scan(&model);
        if params.is_empty() {
            return Err(Error::Model("the model has no trainable parameters".into()));
        }
        Ok((model, params, index))
    }

    /// Every unit's state from the model's values: broadcast from the sharding group's
    /// rank 0 one unit at a time (so no full-size buffer exists), written in the compute
    /// dtype, and kept as the stage says.
    fn build(model: M, plan: &Plan, ctx: &RankContext, placement: Placement) -> Result<Self> {
        let world = ctx.collective();
        if world.world_size() != plan.world_size {
            return Err(Error::Usage(format!(
                "plan is for {} ranks, the communicator has {}",
                plan.world_size,
                world.world_size()
            )));
        }
        check_dtype(plan.precision, plan.device, ctx.device())?;
        let Placement { comm, sharding, index, num_declared, stage } = placement;
        let shared = Shared { comm, world, device: ctx.device().clone(), plan: plan.clone(), sharding, index };
        let (mut model, mut units, mut transient) = (model, Vec::new(), 0);
        for id in 0..shared.sharding.units().len() {
            let layout = shared.layout(id);
            let mut values = vec![0.0f32; layout.padded_elems()];
            let real = BufMut::F32(&mut values[..layout.num_elems()]);
            read_params(&model, &shared.index, &shared.sharding, id, 0..layout.num_elems(), real)?;
            shared.comm.broadcast((&mut values).into(), 0)?;
            transient = transient.max((values.len() * (4 + plan.precision.bytes_per_elem())) as u64);
            let (next, unit) = Unit::new(id, &values, model, &shared, optimizer::build(&plan.optimizer));
            model = next;
            units.push(unit);
        }
        Ok(Self {
            scaler: plan.loss_scale.map(|s| s.scaler()),
            window: Window::default(),
            peaks: Peaks { transient, gathered: 0, activations: 0 },
            model,
            shared,
            units,
            num_declared,
            counters: Counters::default(),
            lr_iteration: -1,
            last_step: None,
            stage,
        })
        .map(|mut engine| {
            engine.window.comm_at_start = engine.comm_stats();
            engine
        })
    }

    /// Runs `f` on the model with every parameter present (at stage 3 every unit is
    /// gathered first) and returns its result, typically the loss for
    /// [`backward`](Self::backward). Every rank must call it the same number of times at
    /// stage 3. A model built with [`with_units`](Self::with_units) trains with less
    /// memory through [`forward_backward`](Self::forward_backward).
    pub fn forward<R>(&mut self, f: impl FnOnce(&M) -> R) -> Result<R> {
        if self.stage.is_some() {
            return Err(Error::Usage("a pipeline stage holds only its own units: train it with train_batch".into()));
        }
        self.gather_all()?;
        let start = Instant::now();
        let out = f(&self.model);
        self.window.times.forward += start.elapsed().as_secs_f64();
        Ok(out)
    }

    /// Back-propagates `loss` (a one-element tensor from [`forward`](Self::forward)),
    /// divided by the accumulation steps, and reduces every unit's gradients as the stage
    /// prescribes. Returns the loss value.
    pub fn backward(&mut self, loss: Tensor<1>) -> Result<f32> {
        let (value, scaled) = self.scale_loss(loss)?;
        let start = Instant::now();
        let mut grads = GradientsParams::from_grads(scaled.backward(), &self.model);
        let reduce_start = Instant::now();
        self.window.times.backward += (reduce_start - start).as_secs_f64();
        let all = vec![true; self.units.len()];
        let taken = take_grads(&self.model, &mut grads, &self.shared.index, &self.shared.sharding, &all)?;
        drop(grads);
        for (id, grads) in taken.into_iter().enumerate().rev() {
            let grads = grads.expect("every unit was asked for");
            let previous = (id + 1 < self.units.len()).then_some(id + 1);
            self.reduce_unit(id, grads, previous)?;
        }
        self.window.times.reduce += reduce_start.elapsed().as_secs_f64();
        for id in 0..self.units.len() {
            self.release(id);
        }
        Ok(self.end_micro_step(value))
    }

    /// Checks the loss, and returns its value and the tensor to back-propagate: cast to
    /// f32, times the loss scale, divided by the accumulation steps.
    fn scale_loss(&self, loss: Tensor<1>) -> Result<(f32, Tensor<1>)> {
        if loss.dims() != [1] {
            return Err(Error::Usage(format!("backward needs a one-element loss, got shape {:?}", loss.dims())));
        }
        let loss = loss.cast(FloatDType::F32);
        let value = loss.clone().into_scalar::<f32>();
        let gas = self.shared.plan.batch.gradient_accumulation_steps as f32;
        let scaled = match &self.scaler {
            Some(scaler) => loss.mul_scalar(scaler.scale() as f32).div_scalar(gas),
            None => loss.div_scalar(gas),
        };
        Ok((value, scaled))
    }

    /// Starts reducing unit `id`'s gradients of this backward pass, after settling the
    /// reductions still in flight of the unit reduced before it, `previous` (so at most one
    /// unit's reductions overlap the next unit's backward).
    fn reduce_unit(&mut self, id: usize, grads: params::UnitGrads, previous: Option<usize>) -> Result<()> {
        let times = &mut self.window.times;
        if let Some(previous) = previous {
            self.units[previous].settle(times)?;
        }
        let plan = &self.shared.plan;
        let options = ReduceOptions {
            reduce_scatter: plan.zero.reduce_scatter,
            comm_dtype: plan.comm_dtype,
            bucket_elems: plan.zero.reduce_bucket_size,
            first: self.window.micro_steps == 0,
            boundary: self.window.micro_steps + 1 == plan.batch.gradient_accumulation_steps,
            overlap: plan.zero.overlap_comm,
        };
        let bytes = self.units[id].reduce(grads, &self.shared, options, times)?;
        self.peaks.transient = self.peaks.transient.max(bytes);
        Ok(())
    }

    /// The root unit, if the model left parameters to it.
    fn root(&self) -> Option<usize> {
        (self.num_declared > 0 && self.num_declared < self.units.len()).then_some(self.num_declared)
    }

    /// Counts a finished micro-step; returns the loss value.
    fn end_micro_step(&mut self, value: f32) -> f32 {
        self.counters.micro_steps += 1;
        self.window.micro_steps += 1;
        self.window.loss_sum += f64::from(value);
        value
    }

    /// Stage 3: gathers every unit into the model (each fetch started before the previous
    /// unit is written, so transfers overlap writes). Nothing to do at stages 0-2.
    fn gather_all(&mut self) -> Result<()> {
        if !self.shared.plan.zero.stage.shards_parameters() {
            return Ok(());
        }
        for id in 0..self.units.len() {
            if let Some(next) = self.units.get_mut(id + 1) {
                next.fetch(&self.shared)?;
            }
            self.gather(id)?;
        }
        Ok(())
    }

    /// Makes unit `id` present in the model (stage 3) and records the gathered peak and
    /// the time.
    fn gather(&mut self, id: usize) -> Result<()> {
        let start = Instant::now();
        let model = self.model.clone();
        let (model, bytes) = self.units[id].gather(model, &self.shared, &mut self.window.times)?;
        self.model = model;
        self.note_gathered(bytes);
        self.window.times.gather += start.elapsed().as_secs_f64();
        Ok(())
    }

    /// Stage 3: releases unit `id` from the model.
    fn release(&mut self, id: usize) {
        if self.shared.plan.zero.stage.shards_parameters()
            && (self.units[id].is_gathered() || self.units[id].is_fetching())
        {
            let model = self.model.clone();
            self.model = self.units[id].release(model, &self.shared);
        }
    }

    /// Updates the peaks after a gather whose buffer held `buffer_bytes`: the gathered
    /// units and fetches in flight now.
    fn note_gathered(&mut self, buffer_bytes: u64) {
        let elem_bytes = self.shared.plan.precision.bytes_per_elem() as u64;
        let live: u64 = self
            .units
            .iter()
            .filter(|u| u.is_gathered() || u.is_fetching())
            .map(|u| u.gathered_elems(&self.shared))
            .sum();
        self.peaks.gathered = self.peaks.gathered.max(live * elem_bytes);
        self.peaks.transient = self.peaks.transient.max(buffer_bytes);
    }

    /// Whether the next [`step`](Self::step) will update the parameters.
    pub fn is_gradient_accumulation_boundary(&self) -> bool {
        self.window.micro_steps == self.shared.plan.batch.gradient_accumulation_steps
    }

    /// The loss scale the next backward pass multiplies the loss by (1 without fp16
    /// scaling).
    pub fn loss_scale(&self) -> f64 {
        self.scaler.as_ref().map_or(1.0, LossScaler::scale)
    }

    /// The learning rate the next step will use.
    pub fn get_lr(&self) -> f64 {
        self.shared.plan.schedule.lr(self.lr_iteration)
    }

    /// The global gradient norm of the last step, before clipping (DeepSpeed's
    /// `get_global_grad_norm`); `None` before the first step.
    pub fn get_global_grad_norm(&self) -> Option<f32> {
        self.last_step.map(|r| r.grad_norm)
    }

    /// The report of the last optimizer step.
    pub fn last_step(&self) -> Option<StepReport> {
        self.last_step
    }

    /// Step counters.
    pub fn counters(&self) -> Counters {
        self.counters
    }

    /// The units and their flat layouts over the ranks; its global order is the one
    /// checkpoints and [`master_params`](Self::master_params) use.
    pub fn sharding(&self) -> &Sharding {
        &self.shared.sharding
    }

    /// Number of trainable parameter elements (the model's Ψ).
    pub fn num_params(&self) -> usize {
        self.shared.sharding.global().num_elems()
    }

    /// The plan the engine runs.
    pub fn plan(&self) -> &Plan {
        &self.shared.plan
    }

    /// This rank's traffic so far, every communicator it uses together.
    pub fn comm_stats(&self) -> CommStats {
        let world = self.shared.world.stats();
        match &self.stage {
            // A stage talks over the world, its data-parallel group and its pipeline.
            Some(stage) => world.plus(&self.shared.comm.stats()).plus(&stage.pipe.stats()),
            None => world,
        }
    }

    /// Model-state bytes this rank holds now, measured from its buffers and tensors.
    pub fn memory_report(&self) -> MemoryReport {
        let held: u64 = self.units.iter().map(Unit::master_bytes).sum();
        let fp32 = self.shared.plan.precision == Precision::Fp32;
        let stage3 = self.shared.plan.zero.stage.shards_parameters();
        let elem_bytes = self.shared.plan.precision.bytes_per_elem() as u64;
        MemoryReport {
            params: trainable_bytes(&self.model, &self.shared.index) + if fp32 { held } else { 0 },
            grads: self.units.iter().map(Unit::grad_bytes).sum(),
            master: if fp32 { 0 } else { held },
            optimizer: self.units.iter().map(|u| u.optimizer().state_bytes()).sum(),
            peak_transient: self.peaks.transient,
            peak_gathered: self.peaks.gathered,
            peak_activations: self.peaks.activations,
            persistent: if stage3 {
                self.units.iter().map(|u| u.resident_elems(&self.shared) * elem_bytes).sum()
            } else {
                0
            },
        }
    }

    /// Runs `f` on the model in evaluation mode (no autodiff graph), with every parameter
    /// present: at stage 3 the model is gathered for the call and released after it. Every
    /// rank must call it at stage 3.
    pub fn eval<R>(&mut self, f: impl FnOnce(&M) -> R) -> Result<R> {
        if self.stage.is_some() {
            return Ok(f(&self.full_model()?.valid()));
        }
        let was_released: Vec<bool> = self.units.iter().map(|u| !u.is_gathered()).collect();
        let result = self.forward(|model| f(&model.valid()))?;
        for (id, released) in was_released.into_iter().enumerate() {
            if released {
                self.release(id);
            }
        }
        Ok(result)
    }

    /// The fp32 master weights of every trainable parameter in the global order
    /// (`num_params()` values; [`sharding`](Self::sharding)'s global layout says where each
    /// parameter is). In fp32 training these are the parameters themselves. Every rank must
    /// call it.
    pub fn master_params(&self) -> Result<Vec<f32>> {
        let sharding = &self.shared.sharding;
        let mut out = vec![0.0f32; sharding.global().num_elems()];
        for (id, unit) in self.units.iter().enumerate() {
            if self.root() == Some(id) && self.stage.as_ref().is_some_and(|s| s.index > 0) {
                continue; // the first stage reports the root (summed over the stages below)
            }
            let layout = self.shared.layout(id);
            let values = unit.values(&self.model, &self.shared)?;
            let full = if self.shared.plan.zero.stage.shards_optimizer_states() {
                let mut full = vec![0.0; layout.padded_elems()];
                self.shared.comm.all_gather((&values).into(), (&mut full).into())?;
                full
            } else {
                values
            };
            for (unit_range, global) in sharding.global_segments(id, 0..layout.num_elems()) {
                out[global].copy_from_slice(&full[unit_range]);
            }
        }
        if let Some(stage) = &self.stage {
            // Each element comes from exactly one stage.
            stage.pipe.all_reduce((&mut out).into(), ReduceOp::Sum)?;
        }
        Ok(out)
    }

    /// A copy of the model with every parameter present and current (gathered at stage 3),
    /// for evaluation or export. Every rank must call it at stage 3.
    pub fn full_model(&mut self) -> Result<M> {
        if self.stage.is_some() {
            let values = self.master_params()?;
            let (index, sharding) = (&self.shared.index, &self.shared.sharding);
            let dtype = self.shared.plan.precision;
            return Ok(params::write_global(self.model.clone(), index, sharding, &values, dtype, &self.shared.device));
        }
        self.eval(|model| model.clone())
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
