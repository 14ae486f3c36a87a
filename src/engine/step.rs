//! The optimizer step: settle every unit's reductions, check for overflow, unscale and clip
//! in one multiply, step each unit's optimizer on the rank's range, and put the new values
//! where the stage keeps them.

use std::time::Instant;

use burn::module::Module;
use zerotrain_zero::ReduceOp;

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
        let n = self.shared.comm.world_size();
        let start = Instant::now();
        let mut grads = Vec::with_capacity(self.units.len());
        for unit in &mut self.units {
            grads.push(unit.take_reduced(&mut self.window.times)?);
        }
        if let Some(root) = self.root() {
            self.sum_root_over_stages(&mut grads[root])?;
        }
        let (sum_squares, loss) = self.global_metrics(&grads)?;
        self.window.times.reduce += start.elapsed().as_secs_f64();
        let scale = self.loss_scale();
        // Every rank sums the same partials, so every rank reaches the same decision.
        let grad_norm = sum_squares.sqrt() / (n as f64 * scale);
        let overflow = !grad_norm.is_finite();
        let skip = match &mut self.scaler {
            Some(scaler) => scaler.update(overflow)?.skip_step,
            None => overflow && self.shared.plan.check_grad_overflow,
        };
        let lr = self.shared.plan.schedule.lr(self.lr_iteration);
        if skip {
            self.counters.skipped_steps += 1;
            if self.shared.comm.rank() == 0 {
                // The one log line per overflow, as DeepSpeed prints it.
                eprintln!(
                    "[Rank 0] OVERFLOW! Skipping step {}. Attempted loss scale: {scale}, reducing to {}",
                    self.counters.global_steps + 1,
                    self.loss_scale()
                );
            }
            // Stage 3: a gather since the last backward holds parameters that stay valid,
            // but nothing may stay gathered across the step.
            for id in 0..self.units.len() {
                self.release(id);
            }
        } else {
            let clip = self.shared.plan.gradient_clipping;
            let clip_coef = if clip > 0.0 { (clip / (grad_norm + 1e-6)).min(1.0) } else { 1.0 };
            let factor = (clip_coef / (n as f64 * scale)) as f32;
            for (id, mut grads) in grads.into_iter().enumerate() {
                grads.iter_mut().for_each(|g| *g *= factor);
                let model = self.model.clone();
                let (model, transient) = self.units[id].step(model, lr, grads, &self.shared, &mut self.window.times)?;
                self.model = model;
                self.peaks.transient = self.peaks.transient.max(transient);
            }
            self.lr_iteration += 1;
        }
        self.counters.global_steps += 1;
        self.counters.global_samples += self.shared.plan.batch.train_batch_size;
        let stats = self.comm_stats();
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

    /// One all-reduce over the world of each rank's squared-norm partial of its (still
    /// scaled) gradient and of its mean loss: (sum of squares over all ranks, mean loss). A
    /// rank's partial runs over its shards of every unit in unit order, in one f64 sum, the
    /// slots summed in world rank order. At stage 0 every rank holds the full gradients of
    /// its units, and its group's first rank computes every rank's partial the same way, so
    /// the total is the sharded stages' to the last bit. In a pipeline, the root (the same
    /// on every stage) counts on the first stage only and the loss comes from the last.
    fn global_metrics(&mut self, grads: &[Vec<f32>]) -> Result<(f64, f32)> {
        let (world, group) = (&self.shared.world, &self.shared.comm);
        let n = world.world_size();
        let sharded = self.shared.plan.zero.stage.shards_optimizer_states();
        let counts_root = self.stage.as_ref().is_none_or(|s| s.index == 0);
        let partial = |r: usize| -> f32 {
            let mut sum = 0.0f64;
            for (id, values) in grads.iter().enumerate() {
                let layout = self.shared.layout(id);
                let real = layout.shard_real_range(r);
                if real.is_empty() || (self.root() == Some(id) && !counts_root) {
                    continue; // an all-padding shard, or the root counted by another stage
                }
                let offset = if sharded { layout.shard_range(r).start } else { 0 };
                for &g in &values[real.start - offset..real.end - offset] {
                    sum += f64::from(g) * f64::from(g);
                }
            }
            sum as f32
        };
        // The world rank of this group's rank `r`.
        let slot = |r: usize| match &self.stage {
            Some(stage) => stage.topology.rank(stage.index, r),
            None => r,
        };
        let mut metrics = vec![0.0f32; n + 1];
        if sharded {
            metrics[slot(group.rank())] = partial(group.rank());
        } else if group.rank() == 0 {
            for r in 0..group.world_size() {
                metrics[slot(r)] = partial(r);
            }
        }
        let loss_ranks = match &self.stage {
            Some(stage) if stage.index + 1 < stage.topology.stages => 0,
            Some(stage) => stage.topology.data_parallel,
            None => n,
        };
        if loss_ranks > 0 {
            metrics[n] = (self.window.loss_sum / self.window.micro_steps as f64) as f32;
        }
        let wait = Instant::now();
        world.all_reduce((&mut metrics).into(), ReduceOp::Sum)?;
        if self.stage.is_some() {
            // At the flush the stages that finish first wait here for the last: the
            // pipeline's bubble, as waiting for a neighbour's activations is.
            self.window.times.pipe_wait += wait.elapsed().as_secs_f64();
        }
        let contributors = self.stage.as_ref().map_or(n, |s| s.topology.data_parallel);
        Ok((metrics[..n].iter().map(|&p| f64::from(p)).sum(), metrics[n] / contributors as f32))
    }
}

impl From<zerotrain_precision::ScaleError> for Error {
    fn from(e: zerotrain_precision::ScaleError) -> Self {
        Error::LossScale(e)
    }
}
