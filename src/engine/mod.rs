//! The training engine: a Burn model, a [`Plan`] and a rank's collective, driven with
//! [`Engine::forward`], [`Engine::backward`] and [`Engine::step`].
//!
//! Each rank owns an `Engine`. Between steps it holds what its ZeRO stage keeps (see
//! [`ZeroStage`](zerotrain_zero::ZeroStage)): the model's parameters in the compute dtype (stages 0-2; gathered on
//! demand at stage 3), fp32 master weights for its optimizer range (`engine/store.rs`; in
//! fp32 training the model's parameters are the masters), a gradient accumulator
//! (`engine/grads.rs`), a Burn optimizer stepping its flat range (`engine/optimizer.rs`) and,
//! for fp16, a loss scaler. `engine/step.rs` has the optimizer step.
//!
//! # Note: mixed precision
//! With fp16 or bf16 the model computes in that dtype (the engine casts its parameters;
//! inputs must be in the same dtype). `backward` casts the loss to f32 and multiplies it by
//! the loss scale; gradients accumulate in `grad_accum_dtype` and are reduced in
//! `communication_data_type`; at the step they widen to f32, the global norm decides
//! overflow, and one multiply unscales, averages and clips them. The optimizer steps the
//! fp32 master, and the new values are cast to the compute dtype and all-gathered in it.

mod checkpoint;
mod grads;
mod optimizer;
mod params;
mod stage3;
mod step;
mod store;
#[cfg(test)]
mod tests;

use std::sync::Arc;
use std::time::Instant;

use burn::module::{Module, ModuleVisitor, Param};
use burn::optim::GradientsParams;
use burn::tensor::{Device, FloatDType, Tensor};
use zerotrain_precision::{BufMut, FlatBuf, LossScaler, Precision};
use zerotrain_zero::{Collective, CommStats, FlatLayout};

pub use self::checkpoint::LoadOptions;
use self::grads::GradAccumulator;
use self::optimizer::FlatOptimizer;
use self::params::{Fill, ParamIndex, read_params, write_params};
use self::store::ParamStore;
use crate::config::Plan;
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
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize)]
pub struct PhaseTimes {
    /// The forward closures.
    pub forward: f64,
    /// Back-propagation (Burn's `backward` and collecting the gradients).
    pub backward: f64,
    /// Gradient flattening and reduction (reduce-scatter / all-reduce, norm, overflow check).
    pub reduce: f64,
    /// The optimizer on the rank's range.
    pub optimizer: f64,
    /// Putting parameters back: all-gathers and writing them into the model.
    pub gather: f64,
}

impl PhaseTimes {
    /// All phases together.
    pub fn total(&self) -> f64 {
        self.forward + self.backward + self.reduce + self.optimizer + self.gather
    }
}

/// Model-state bytes one rank holds, by kind (see [`Engine::memory_report`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MemoryReport {
    /// Trainable parameters in the model (compute dtype) plus, in fp32 training at stage 3,
    /// the parameter shard.
    pub params: u64,
    /// Gradient accumulator.
    pub grads: u64,
    /// Separate fp32 master weights (mixed precision; in fp32 training the parameters are
    /// their own master).
    pub master: u64,
    /// Optimizer state.
    pub optimizer: u64,
    /// Largest total of transient buffers alive at once inside a micro-step or step so far.
    pub peak_transient: u64,
}

impl MemoryReport {
    /// Model states held between steps (everything but the transient peak).
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
    plan: Plan,
    comm: Arc<dyn Collective>,
    device: Device,
    layout: FlatLayout,
    index: ParamIndex,
    store: ParamStore,
    grads: GradAccumulator,
    optimizer: Box<dyn FlatOptimizer>,
    scaler: Option<LossScaler>,
    counters: Counters,
    /// DeepSpeed's `last_batch_iteration` of the lr schedule (starts at -1).
    lr_iteration: i64,
    window: Window,
    last_step: Option<StepReport>,
    peak_transient: u64,
}

/// The accumulation window in progress.
#[derive(Debug, Clone, Copy, Default)]
struct Window {
    micro_steps: u64,
    loss_sum: f64,
    comm_at_start: CommStats,
    times: PhaseTimes,
}

impl<M: Module> Engine<M> {
    /// Wraps `model` for training under `plan` on `ctx`'s rank. Every rank must call it;
    /// rank 0's parameters are broadcast so that all ranks start identical.
    pub fn new(model: M, plan: &Plan, ctx: &RankContext) -> Result<Self> {
        let comm = ctx.collective();
        if comm.world_size() != plan.world_size {
            return Err(Error::Usage(format!(
                "plan is for {} ranks, the communicator has {}",
                plan.world_size,
                comm.world_size()
            )));
        }
        let device = ctx.device().clone();
        let model = model.fork(&device);
        let (entries, index) = ParamIndex::scan(&model);
        if entries.is_empty() {
            return Err(Error::Model("the model has no trainable parameters".into()));
        }
        let layout = FlatLayout::new(entries, plan.world_size, ALIGN_ELEMS)?;
        let mut full = vec![0.0; layout.padded_elems()];
        read_params(&model, &index, &layout, 0..layout.num_elems(), BufMut::F32(&mut full[..layout.num_elems()]))?;
        comm.broadcast((&mut full).into(), 0)?;
        let stage = plan.zero.stage;
        let compute = FlatBuf::from_f32(plan.precision, &full);
        let model = write_params(model, &index, &layout, Fill::From(compute.as_ref()), &device);
        let mut store =
            ParamStore::new(stage, plan.precision, &layout, comm.rank(), &full, plan.zero.param_persistence_threshold);
        let model = match store.partition() {
            Some(partition) => partition.release(model, &index, &layout, &device),
            None => model,
        };
        let engine = Self {
            grads: GradAccumulator::new(
                stage,
                plan.zero.reduce_scatter,
                &layout,
                plan.grad_accum_dtype,
                plan.comm_dtype,
            ),
            optimizer: optimizer::build(&plan.optimizer),
            scaler: plan.loss_scale.map(|s| s.scaler()),
            window: Window { comm_at_start: comm.stats(), ..Window::default() },
            peak_transient: (full.len() * size_of::<f32>()) as u64 + compute.bytes(),
            model,
            plan: plan.clone(),
            comm,
            device,
            layout,
            index,
            store,
            counters: Counters::default(),
            lr_iteration: -1,
            last_step: None,
        };
        Ok(engine)
    }

    /// Runs `f` on the model (gathering stage-3 parameters first) and returns its result,
    /// typically the loss. Every rank must call it the same number of times at stage 3.
    pub fn forward<R>(&mut self, f: impl FnOnce(&M) -> R) -> Result<R> {
        if let Some(partition) = self.store.partition() {
            let start = Instant::now();
            let model = self.model.clone();
            let target = (&self.device, self.plan.precision);
            let (model, bytes) = partition.gather(model, &self.index, &self.layout, self.comm.as_ref(), target)?;
            self.model = model;
            self.peak_transient = self.peak_transient.max(bytes);
            self.window.times.gather += start.elapsed().as_secs_f64();
        }
        let start = Instant::now();
        let out = f(&self.model);
        self.window.times.forward += start.elapsed().as_secs_f64();
        Ok(out)
    }

    /// Back-propagates `loss` (a one-element tensor from [`forward`](Self::forward)),
    /// divided by the accumulation steps, and accumulates the gradients as the stage
    /// prescribes. Returns the loss value.
    pub fn backward(&mut self, loss: Tensor<1>) -> Result<f32> {
        if loss.dims() != [1] {
            return Err(Error::Usage(format!("backward needs a one-element loss, got shape {:?}", loss.dims())));
        }
        let loss = loss.cast(FloatDType::F32);
        let value = loss.clone().into_scalar::<f32>();
        let gas = self.plan.batch.gradient_accumulation_steps as f32;
        let scaled = match &self.scaler {
            Some(scaler) => loss.mul_scalar(scaler.scale() as f32).div_scalar(gas),
            None => loss.div_scalar(gas),
        };
        let start = Instant::now();
        let mut grads = GradientsParams::from_grads(scaled.backward(), &self.model);
        let reduce_start = Instant::now();
        self.window.times.backward += (reduce_start - start).as_secs_f64();
        let bytes = self.grads.accumulate(&self.model, &mut grads, &self.index, &self.layout, self.comm.as_ref())?;
        self.window.times.reduce += reduce_start.elapsed().as_secs_f64();
        drop(grads);
        if let Some(partition) = self.store.partition() {
            let model = self.model.clone();
            self.model = partition.release(model, &self.index, &self.layout, &self.device);
        }
        self.peak_transient = self.peak_transient.max(bytes);
        self.counters.micro_steps += 1;
        self.window.micro_steps += 1;
        self.window.loss_sum += f64::from(value);
        Ok(value)
    }

    /// Whether the next [`step`](Self::step) will update the parameters.
    pub fn is_gradient_accumulation_boundary(&self) -> bool {
        self.window.micro_steps == self.plan.batch.gradient_accumulation_steps
    }

    /// The loss scale the next backward pass multiplies the loss by (1 without fp16
    /// scaling).
    pub fn loss_scale(&self) -> f64 {
        self.scaler.as_ref().map_or(1.0, LossScaler::scale)
    }

    /// The learning rate the next step will use.
    pub fn get_lr(&self) -> f64 {
        self.plan.schedule.lr(self.lr_iteration)
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

    /// The flat layout of the trainable parameters.
    pub fn layout(&self) -> &FlatLayout {
        &self.layout
    }

    /// The plan the engine runs.
    pub fn plan(&self) -> &Plan {
        &self.plan
    }

    /// This rank's collective traffic so far.
    pub fn comm_stats(&self) -> CommStats {
        self.comm.stats()
    }

    /// Model-state bytes this rank holds now, measured from its buffers and tensors.
    pub fn memory_report(&self) -> MemoryReport {
        let held = self.store.bytes();
        let fp32 = self.plan.precision == Precision::Fp32;
        MemoryReport {
            params: trainable_bytes(&self.model, &self.index) + if fp32 { held } else { 0 },
            grads: self.grads.bytes(),
            master: if fp32 { 0 } else { held },
            optimizer: self.optimizer.state_bytes(),
            peak_transient: self.peak_transient,
        }
    }

    /// Runs `f` on the model in evaluation mode (no autodiff graph), with every parameter
    /// present: at stage 3 the model is gathered for the call and released after it. Every
    /// rank must call it at stage 3.
    pub fn eval<R>(&mut self, f: impl FnOnce(&M) -> R) -> Result<R> {
        let was_released = self.store.partition().is_some_and(|p| p.is_released());
        let result = self.forward(|model| f(&model.valid()))?;
        if was_released && let Some(partition) = self.store.partition() {
            let model = self.model.clone();
            self.model = partition.release(model, &self.index, &self.layout, &self.device);
        }
        Ok(result)
    }

    /// The fp32 master weights of every trainable parameter, concatenated in layout order
    /// (`layout().num_elems()` values; [`layout`](Self::layout) says where each parameter
    /// is). In fp32 training these are the parameters themselves. Every rank must call it.
    pub fn master_params(&self) -> Result<Vec<f32>> {
        self.store.gather(&self.model, &self.index, &self.layout, self.comm.as_ref())
    }

    /// A copy of the model with every parameter present and current (gathered at stage 3),
    /// for evaluation or export. Every rank must call it at stage 3.
    pub fn full_model(&mut self) -> Result<M> {
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

/// Bytes of the trainable parameters the model holds now (released ones are empty).
fn trainable_bytes<M: Module>(model: &M, index: &ParamIndex) -> u64 {
    struct Count<'a> {
        index: &'a ParamIndex,
        position: usize,
        bytes: u64,
    }
    impl ModuleVisitor for Count<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            if self.index.is_trainable(self.position) {
                let tensor = param.val();
                self.bytes += (tensor.shape().num_elements() * tensor.dtype().size()) as u64;
            }
            self.position += 1;
        }
    }
    let mut count = Count { index, position: 0, bytes: 0 };
    model.visit(&mut count);
    count.bytes
}
