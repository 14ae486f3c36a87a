//! The optimizer step: reduce, check for overflow, unscale and clip in one multiply, step
//! the optimizer on the rank's range, and put the new values where the stage keeps them.

use std::time::Instant;

use burn::module::Module;
use zerotrain_precision::{BufRef, FlatBuf};
use zerotrain_zero::{ReduceOp, ZeroStage};

use super::params::{Fill, convert, gather_params, write_params};
use super::{Engine, StepReport, Window};
use crate::{Error, Result};

impl<M: Module> Engine<M> {
    /// At an accumulation boundary: reduces the gradients, unscales and clips them to the
    /// global norm, steps the optimizer and the lr schedule, and restores the parameters
    /// the stage keeps. If the gradients are not finite, the step is skipped instead (fp16
    /// always, as its loss scaler decides; fp32 and bf16 when `check_grad_overflow` is on):
    /// nothing is updated and `skipped_steps` counts it. Elsewhere it does nothing and
    /// returns `None`. Every rank must call it.
    pub fn step(&mut self) -> Result<Option<StepReport>> {
        if self.window.micro_steps == 0 {
            return Err(Error::Usage("step() called without a backward() since the last step".into()));
        }
        if !self.is_gradient_accumulation_boundary() {
            return Ok(None);
        }
        let n = self.comm.world_size();
        let start = Instant::now();
        let mut grads = self.grads.reduce(&self.layout, self.comm.as_ref())?;
        let (sum_squares, loss) = self.global_metrics(&grads)?;
        self.window.times.reduce += start.elapsed().as_secs_f64();
        let scale = self.loss_scale();
        // Every rank sums the same partials, so every rank reaches the same decision.
        let grad_norm = sum_squares.sqrt() / (n as f64 * scale);
        let overflow = !grad_norm.is_finite();
        let skip = match &mut self.scaler {
            Some(scaler) => scaler.update(overflow)?.skip_step,
            None => overflow && self.plan.check_grad_overflow,
        };
        let lr = self.plan.schedule.lr(self.lr_iteration);
        if skip {
            self.counters.skipped_steps += 1;
            if self.comm.rank() == 0 {
                // The one log line per overflow, as DeepSpeed prints it.
                eprintln!(
                    "[Rank 0] OVERFLOW! Skipping step {}. Attempted loss scale: {scale}, reducing to {}",
                    self.counters.global_steps + 1,
                    self.loss_scale()
                );
            }
        } else {
            let clip = self.plan.gradient_clipping;
            let clip_coef = if clip > 0.0 { (clip / (grad_norm + 1e-6)).min(1.0) } else { 1.0 };
            let factor = (clip_coef / (n as f64 * scale)) as f32;
            grads.iter_mut().for_each(|g| *g *= factor);
            let transient = self.apply(lr, grads)?;
            self.peak_transient = self.peak_transient.max(transient);
            self.lr_iteration += 1;
        }
        self.counters.global_steps += 1;
        self.counters.global_samples += self.plan.batch.train_batch_size;
        let stats = self.comm.stats();
        let report = StepReport {
            global_step: self.counters.global_steps,
            loss,
            lr,
            grad_norm: grad_norm as f32,
            skipped: skip,
            loss_scale: scale,
            next_loss_scale: self.loss_scale(),
            comm_bytes: stats.since(&self.window.comm_at_start).total_bytes(),
            times: self.window.times,
        };
        self.window = Window { comm_at_start: stats, ..Window::default() };
        self.last_step = Some(report);
        Ok(Some(report))
    }

    /// One all-reduce of each rank's squared-norm partial of its (still scaled) gradient
    /// range and of its mean loss: (sum of squares over all ranks, mean loss). At stage 0
    /// every rank holds the full gradient and computes every shard's partial itself, so the
    /// sum is the same as the sharded stages' to the last bit.
    fn global_metrics(&self, grads: &[f32]) -> Result<(f64, f32)> {
        let (rank, n) = (self.comm.rank(), self.comm.world_size());
        let sharded = self.plan.zero.stage.shards_optimizer_states();
        let mut metrics = vec![0.0f32; n + 1];
        if sharded {
            metrics[rank] = squared_norm(grads) as f32;
        }
        metrics[n] = (self.window.loss_sum / self.window.micro_steps as f64) as f32;
        self.comm.all_reduce((&mut metrics).into(), ReduceOp::Sum)?;
        if !sharded {
            for (r, partial) in metrics[..n].iter_mut().enumerate() {
                *partial = squared_norm(&grads[self.layout.shard_real_range(r)]) as f32;
            }
        }
        Ok((metrics[..n].iter().map(|&p| f64::from(p)).sum(), metrics[n] / n as f32))
    }

    /// Steps the optimizer over the rank's range with the final gradients and puts the new
    /// values where the stage keeps parameters. Returns the transient bytes it used.
    fn apply(&mut self, lr: f64, grads: Vec<f32>) -> Result<u64> {
        let range = self.optimizer_range();
        let start = Instant::now();
        let master = self.store.take(&self.model, &self.index, &self.layout, range.clone())?;
        let mut transient = (2 * range.len() * size_of::<f32>()) as u64;
        let updated = self.optimizer.step(lr, master, grads, &self.device.clone().without_autodiff())?;
        let gather_start = Instant::now();
        self.window.times.optimizer += (gather_start - start).as_secs_f64();
        transient += self.publish(&updated)?;
        self.window.times.gather += gather_start.elapsed().as_secs_f64();
        self.store.put(updated);
        Ok(transient)
    }

    /// The flat range this rank's optimizer steps: everything at stage 0, its shard (with
    /// padding) otherwise.
    pub(super) fn optimizer_range(&self) -> std::ops::Range<usize> {
        match self.plan.zero.stage {
            ZeroStage::Disabled => 0..self.layout.num_elems(),
            _ => self.layout.shard_range(self.comm.rank()),
        }
    }

    /// Puts new fp32 master values of the rank's optimizer range into the model, as the
    /// stage keeps parameters: all of them at stage 0, all-gathered in the compute dtype at
    /// stages 1-2, nowhere at stage 3 (gathered at the next forward). Returns the transient
    /// bytes it used.
    pub(super) fn publish(&mut self, values: &[f32]) -> Result<u64> {
        let stage = self.plan.zero.stage;
        if stage == ZeroStage::Parameters {
            // A forward between the last backward and this step gathered the pre-step
            // weights; release them, or the next forward would silently train on them.
            if let Some(partition) = self.store.partition()
                && !partition.is_released()
            {
                let model = self.model.clone();
                self.model = partition.release(model, &self.index, &self.layout, &self.device);
            }
            return Ok(0);
        }
        let (model, dtype) = (self.model.clone(), self.plan.precision);
        if stage == ZeroStage::Disabled {
            let converted = convert(values, dtype);
            let all = converted.as_ref().map_or(BufRef::F32(values), FlatBuf::as_ref);
            self.model = write_params(model, &self.index, &self.layout, Fill::From(all), &self.device);
            return Ok(converted.as_ref().map_or(0, FlatBuf::bytes));
        }
        let comm = self.comm.as_ref();
        let (model, transient) = gather_params(model, &self.index, &self.layout, comm, values, (&self.device, dtype))?;
        self.model = model;
        Ok(transient)
    }
}

fn squared_norm(values: &[f32]) -> f64 {
    values.iter().map(|&g| f64::from(g) * f64::from(g)).sum()
}

impl From<zerotrain_precision::ScaleError> for Error {
    fn from(e: zerotrain_precision::ScaleError) -> Self {
        Error::LossScale(e)
    }
}
