//! The optimizer step: settle every unit's reductions, check for overflow, unscale and clip
//! in one multiply, step each unit's optimizer on the rank's range, and put the new values
//! where the stage keeps them.
//!
//! # Note: a step that fails part-way
//! Units step one after another, each in place (on the device or in host memory): a step
//! that fails at unit k (an optimizer's error, a device's) leaves units before k with the
//! new values and the rest with the old, whatever tier holds them. Such a rank is torn:
//! every later forward, step, save, export or evaluation is an error saying so, never a
//! model or a checkpoint of two steps mixed, until a checkpoint load writes every unit
//! again (a load that fails part-way tears the rank the same way). (A
//! unit in the NVMe tier keeps its own mark for its tiles, `tier/nvme.rs`; lost masters are `tier/mod.rs`'s
//! note.) Keeping the old values to roll back instead would double the optimizer's memory.

use std::time::Instant;

use burn::module::Module;
use burn::tensor::FloatDType;

use super::flat::Flat;
use super::master::Values;
use super::report::Window;
use super::{Engine, StepReport};
use crate::{Error, Result};

impl<M: Module> Engine<M> {
    /// At an accumulation boundary: reduces the gradients, unscales and clips them to the
    /// global norm, steps the optimizer and the lr schedule, and restores the parameters
    /// the stage keeps. If the gradients are not finite, the step is skipped instead (fp16
    /// always, as its loss scaler decides; fp32 and bf16 when `check_grad_overflow` is on):
    /// nothing is updated and `skipped_steps` counts it. Elsewhere it does nothing and
    /// returns `None`. Every rank must call it.
    pub fn step(&mut self) -> Result<Option<StepReport>> {
        self.whole()?;
        if self.window.micro_steps == 0 {
            return Err(Error::Usage("step() called without a backward() since the last step".into()));
        }
        if !self.is_gradient_accumulation_boundary() {
            return Ok(None);
        }
        self.prepare_step()?;
        let mut prepared = self.progress.prepared.take().expect("prepared above");
        if prepared.stale_norm {
            let start = Instant::now();
            let partials = self.measure(&prepared.grads)?;
            prepared.sum_squares = self.global_metrics(partials, None)?.0;
            self.window.times.reduce += self.shared.phase_seconds(start);
        }
        let scale = self.loss_scale();
        // Every rank sums the same partials, so every rank reaches the same decision.
        let grad_norm = prepared.norm();
        let overflow = !grad_norm.is_finite();
        let skip = match &mut self.progress.scaler {
            Some(scaler) => scaler.update(overflow)?.skip_step,
            None => overflow && self.shared.plan.precision.check_grad_overflow,
        };
        let lr = self.get_lr();
        if skip {
            self.skip_step(scale);
        } else {
            let clip = self.shared.plan.optim.gradient_clipping;
            let clip_coef = if clip > 0.0 { (clip / (grad_norm + 1e-6)).min(1.0) } else { 1.0 };
            let factor = (clip_coef * prepared.numerator / prepared.denominator) as f32;
            for (id, grads) in prepared.grads.into_iter().enumerate() {
                // One unit's gradient in f32 at a time, where it is. A factor of 1 (one
                // rank, no loss scale, no clip) changes no bit: no pass over the values.
                let grads = match grads {
                    Flat::Host(grads) => {
                        let mut grads = grads.into_f32();
                        if factor != 1.0 {
                            grads.iter_mut().for_each(|g| *g *= factor);
                        }
                        Values::Host(grads)
                    }
                    Flat::Device(grads) if factor == 1.0 => Values::Device(grads.cast(FloatDType::F32)),
                    Flat::Device(grads) => Values::Device(grads.cast(FloatDType::F32).mul_scalar(factor)),
                };
                let model = self.model.clone();
                let stepped = self.units[id].step(model, lr, grads, &self.shared, &mut self.window.times);
                let (model, transient) = match stepped {
                    Ok(stepped) => stepped,
                    Err(e) => {
                        // The window's gradients are spent: close it, so that the caller
                        // can load a checkpoint (module note).
                        self.window = Window { at_start: self.traffic(), ..Window::default() };
                        self.progress.torn = true;
                        return Err(e);
                    }
                };
                self.model = model;
                self.peaks.transient = self.peaks.transient.max(transient);
            }
            self.progress.lr_iteration += 1;
        }
        Ok(Some(self.end_step(lr, grad_norm, skip, scale, prepared.loss)))
    }

    /// An error if a step or a load failed part-way on this rank (module note).
    pub(super) fn whole(&self) -> Result<()> {
        match self.progress.torn {
            true => Err(Error::Usage(
                "an optimizer step or a checkpoint load failed part-way on this rank, so some units hold new values \
                 and some old ones; load a checkpoint to go on"
                    .into(),
            )),
            false => Ok(()),
        }
    }

    /// A skipped step: counted and announced; stage 3 releases whatever a gather since the
    /// last backward left in the model (nothing may stay gathered across the step).
    fn skip_step(&mut self, scale: f64) {
        self.progress.counters.skipped_steps += 1;
        if self.shared.ranks.rank() == 0 {
            // The one log line per overflow, as DeepSpeed prints it.
            eprintln!(
                "[Rank 0] OVERFLOW! Skipping step {}. Attempted loss scale: {scale}, reducing to {}",
                self.progress.counters.global_steps + 1,
                self.loss_scale()
            );
        }
        for id in 0..self.units.len() {
            self.release(id);
        }
    }

    /// Counts the step, closes the window and returns the step's report.
    fn end_step(&mut self, lr: f64, grad_norm: f64, skipped: bool, loss_scale: f64, loss: f32) -> StepReport {
        let dp = self.span.topology.data_parallel as u64;
        let samples = self.window.micro_steps * self.shared.plan.batch.micro_batch_per_rank * dp;
        let counters = &mut self.progress.counters;
        counters.global_steps += 1;
        counters.global_samples += samples;
        let global_step = counters.global_steps;
        let now = self.traffic();
        let report = StepReport {
            global_step,
            loss,
            lr,
            grad_norm: grad_norm as f32,
            skipped,
            loss_scale,
            next_loss_scale: self.loss_scale(),
            comm_bytes: now.comm.since(&self.window.at_start.comm).total_bytes(),
            host_device: now.crossed.since(&self.window.at_start.crossed),
            device_reads: now.reads - self.window.at_start.reads,
            times: self.window.times,
        };
        self.window = Window { at_start: now, ..Window::default() };
        self.progress.last_step = Some(report);
        report
    }
}

impl From<zerotrain_precision::ScaleError> for Error {
    fn from(e: zerotrain_precision::ScaleError) -> Self {
        Error::LossScale(e)
    }
}
