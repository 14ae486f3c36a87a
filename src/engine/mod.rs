//! The training engine: a Burn model, a [`Plan`] and a rank's collective, driven with
//! [`Engine::forward`], [`Engine::backward`] and [`Engine::step`].
//!
//! Each rank owns an `Engine`. Between steps it holds what its ZeRO stage keeps (see
//! [`ZeroStage`]): parameters in the model (stages 0-2) or as a flat shard (stage 3), a
//! gradient accumulator (`engine/grads.rs`), and a Burn optimizer stepping its flat range
//! (`engine/optimizer.rs`). fp32 parameters are their own master weights: the optimizer steps a
//! transient copy of the rank's range, and the result is written back (stages 0-2) or kept
//! as the shard (stage 3).

mod grads;
mod optimizer;
mod params;
mod stage3;

use std::sync::Arc;

use burn::module::{Module, ModuleVisitor, Param};
use burn::optim::GradientsParams;
use burn::tensor::{Device, Tensor};
use zerotrain_zero::{Collective, CommStats, FlatLayout, ReduceOp, ZeroStage};

use self::grads::GradAccumulator;
use self::optimizer::FlatOptimizer;
use self::params::{Fill, ParamIndex, read_params, write_params};
use self::stage3::Partition;
use crate::config::Plan;
use crate::launch::RankContext;
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
    /// Bytes this rank moved in collectives during the step's window.
    pub comm_bytes: u64,
}

/// Model-state bytes one rank holds, by kind (see [`Engine::memory_report`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MemoryReport {
    /// Trainable parameters in the model plus, at stage 3, the parameter shard.
    pub params: u64,
    /// Gradient accumulator.
    pub grads: u64,
    /// Separate fp32 master weights (0 in fp32 training: the parameters are the master).
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
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counters {
    /// Optimizer steps taken (skipped ones included).
    pub global_steps: u64,
    /// Backward passes.
    pub micro_steps: u64,
    /// Steps skipped (overflow).
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
    partition: Option<Partition>,
    grads: GradAccumulator,
    optimizer: Box<dyn FlatOptimizer>,
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
        read_params(&model, &index, &layout, 0..layout.num_elems(), &mut full)?;
        comm.broadcast(&mut full, 0)?;
        let stage = plan.zero.stage;
        let (model, partition) = if stage.shards_parameters() {
            let mut partition = Partition::new(&layout, comm.rank(), &full, plan.zero.param_persistence_threshold);
            (partition.release(model, &index, &layout, &device), Some(partition))
        } else {
            (write_params(model, &index, &layout, Fill::From(&full), &device), None)
        };
        let engine = Self {
            grads: GradAccumulator::new(stage, plan.zero.reduce_scatter, &layout),
            optimizer: optimizer::build(&plan.optimizer),
            window: Window { comm_at_start: comm.stats(), ..Window::default() },
            peak_transient: (full.len() * size_of::<f32>()) as u64,
            model,
            plan: plan.clone(),
            comm,
            device,
            layout,
            index,
            partition,
            counters: Counters::default(),
            lr_iteration: -1,
            last_step: None,
        };
        Ok(engine)
    }

    /// Runs `f` on the model (gathering stage-3 parameters first) and returns its result,
    /// typically the loss. Every rank must call it the same number of times at stage 3.
    pub fn forward<R>(&mut self, f: impl FnOnce(&M) -> R) -> Result<R> {
        if let Some(partition) = &mut self.partition {
            let model = self.model.clone();
            let (model, bytes) =
                partition.gather(model, &self.index, &self.layout, self.comm.as_ref(), &self.device)?;
            self.model = model;
            self.peak_transient = self.peak_transient.max(bytes);
        }
        Ok(f(&self.model))
    }

    /// Back-propagates `loss` (a one-element tensor from [`forward`](Self::forward)),
    /// divided by the accumulation steps, and accumulates the gradients as the stage
    /// prescribes. Returns the loss value.
    pub fn backward(&mut self, loss: Tensor<1>) -> Result<f32> {
        if loss.dims() != [1] {
            return Err(Error::Usage(format!("backward needs a one-element loss, got shape {:?}", loss.dims())));
        }
        let value = loss.clone().into_scalar::<f32>();
        let gas = self.plan.batch.gradient_accumulation_steps;
        let mut grads = GradientsParams::from_grads(loss.div_scalar(gas as f32).backward(), &self.model);
        let bytes = self.grads.accumulate(&self.model, &mut grads, &self.index, &self.layout, self.comm.as_ref())?;
        drop(grads);
        if let Some(partition) = &mut self.partition {
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

    /// At an accumulation boundary: reduces the gradients, clips them to the global norm,
    /// steps the optimizer and the lr schedule, and restores the parameters the stage keeps.
    /// If the gradients are not finite (and the plan checks), it skips all of that instead
    /// and counts a skipped step. Elsewhere it does nothing and returns `None`. Every rank
    /// must call it.
    pub fn step(&mut self) -> Result<Option<StepReport>> {
        if self.window.micro_steps == 0 {
            return Err(Error::Usage("step() called without a backward() since the last step".into()));
        }
        if !self.is_gradient_accumulation_boundary() {
            return Ok(None);
        }
        let comm = Arc::clone(&self.comm);
        let (rank, n) = (comm.rank(), comm.world_size());
        let mut grads = self.grads.reduce(&self.layout, comm.as_ref())?;

        // One all-reduce carries each rank's squared-norm partial and its loss.
        let mut metrics = vec![0.0f32; n + 1];
        if self.plan.zero.stage.shards_optimizer_states() {
            metrics[rank] = squared_norm(&grads) as f32;
        }
        metrics[n] = (self.window.loss_sum / self.window.micro_steps as f64) as f32;
        comm.all_reduce(&mut metrics, ReduceOp::Sum)?;
        if !self.plan.zero.stage.shards_optimizer_states() {
            for (r, partial) in metrics[..n].iter_mut().enumerate() {
                let shard = self.layout.shard_real_range(r);
                *partial = squared_norm(&grads[shard]) as f32;
            }
        }
        let sum_squares: f64 = metrics[..n].iter().map(|&p| f64::from(p)).sum();
        let grad_norm = sum_squares.sqrt() / n as f64;
        // Every rank sums the same partials, so every rank takes the same branch.
        let skip = self.plan.check_grad_overflow && !grad_norm.is_finite();
        let lr = self.plan.schedule.lr(self.lr_iteration);
        if skip {
            self.counters.skipped_steps += 1;
        } else {
            let clip = self.plan.gradient_clipping;
            let clip_coef = if clip > 0.0 { (clip / (grad_norm + 1e-6)).min(1.0) } else { 1.0 };
            let factor = (clip_coef / n as f64) as f32;
            grads.iter_mut().for_each(|g| *g *= factor);
            let transient = self.apply(lr, grads)?;
            self.peak_transient = self.peak_transient.max(transient);
            self.lr_iteration += 1;
        }
        self.counters.global_steps += 1;
        self.counters.global_samples += self.plan.batch.train_batch_size;
        let stats = comm.stats();
        let report = StepReport {
            global_step: self.counters.global_steps,
            loss: metrics[n] / n as f32,
            lr,
            grad_norm: grad_norm as f32,
            skipped: skip,
            comm_bytes: stats.since(&self.window.comm_at_start).total_bytes(),
        };
        self.window = Window { comm_at_start: stats, ..Window::default() };
        self.last_step = Some(report);
        Ok(Some(report))
    }

    /// Steps the optimizer over the rank's range with the final gradients and puts the new
    /// values where the stage keeps parameters. Returns the transient bytes it used.
    fn apply(&mut self, lr: f64, grads: Vec<f32>) -> Result<u64> {
        let stage = self.plan.zero.stage;
        let range = match stage {
            ZeroStage::Disabled => 0..self.layout.num_elems(),
            _ => self.layout.shard_range(self.comm.rank()),
        };
        let params = match &mut self.partition {
            Some(partition) => partition.take_shard(),
            None => {
                let mut params = vec![0.0; range.len()];
                read_params(&self.model, &self.index, &self.layout, range.clone(), &mut params)?;
                params
            }
        };
        let mut transient = 2 * range.len();
        let updated = self.optimizer.step(lr, params, grads, &self.device.clone().without_autodiff())?;
        let model = self.model.clone();
        self.model = match (stage, &mut self.partition) {
            (ZeroStage::Disabled, _) => {
                write_params(model, &self.index, &self.layout, Fill::From(&updated), &self.device)
            }
            (_, Some(partition)) => {
                partition.put_shard(updated);
                model
            }
            (_, None) => {
                let mut full = vec![0.0; self.layout.padded_elems()];
                self.comm.all_gather(&updated, &mut full)?;
                transient += full.len();
                write_params(model, &self.index, &self.layout, Fill::From(&full), &self.device)
            }
        };
        Ok((transient * size_of::<f32>()) as u64)
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
        let shard = self.partition.as_ref().map_or(0, Partition::shard_bytes);
        MemoryReport {
            params: trainable_bytes(&self.model, &self.index) + shard,
            grads: self.grads.bytes(),
            master: 0,
            optimizer: self.optimizer.state_bytes(),
            peak_transient: self.peak_transient,
        }
    }

    /// Runs `f` on the model in evaluation mode (no autodiff graph), with every parameter
    /// present: at stage 3 the model is gathered for the call and released after it. Every
    /// rank must call it at stage 3.
    pub fn eval<R>(&mut self, f: impl FnOnce(&M) -> R) -> Result<R> {
        let was_released = self.partition.as_ref().is_some_and(Partition::is_released);
        let result = self.forward(|model| f(&model.valid()))?;
        if was_released && let Some(partition) = &mut self.partition {
            let model = self.model.clone();
            self.model = partition.release(model, &self.index, &self.layout, &self.device);
        }
        Ok(result)
    }

    /// A copy of the model with every parameter present and current (gathered at stage 3),
    /// for evaluation or export. Every rank must call it at stage 3.
    pub fn full_model(&mut self) -> Result<M> {
        self.eval(|model| model.clone())
    }
}

fn squared_norm(values: &[f32]) -> f64 {
    values.iter().map(|&g| f64::from(g) * f64::from(g)).sum()
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
