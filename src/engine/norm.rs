//! Reading the loss and the gradient norm off the device: when the host waits.
//!
//! The norm is summed per unit where the gradients are (on the host in f64, on the device
//! in f32, queued), each rank's partial over its shards, then once over the world with the
//! mean loss. Reading a value waits for everything queued before it, so each read is
//! placed where the device has the most work queued: a micro-step's loss after its
//! backward, the norm's sums with the window's last loss, and with `train_batch` the
//! window's losses and the norm after the optimizer step is queued, where nothing before
//! the step needs them ([`Engine::read_micro_step`]).

use std::time::Instant;

use burn::module::Module;
use burn::tensor::{FloatDType, Tensor};
use zerotrain_precision::BufRef;
use zerotrain_zero::ReduceOp;

use super::Engine;
use super::flat::Flat;
use super::report::LossValues;
use super::shared::Shared;
use super::span::Span;
use crate::Result;

impl<M: Module> Engine<M> {
    /// Reads the window's unread losses and the device parts of `queued` (this rank's norm
    /// partials) in one read; returns the world's sum of squares and mean loss.
    pub(super) fn settle(&mut self, queued: Vec<Queued>) -> Result<(f64, f32)> {
        let on_device = queued.iter().flat_map(|q| q.device.iter().cloned()).collect();
        let unread = std::mem::take(&mut self.progress.unread);
        let read = |tensors| self.shared.read_values(tensors, "the loss and the gradients' norm");
        let (losses, sums) = unread.read(on_device, read)?;
        self.count_losses(&losses);
        let loss = self.window_loss();
        self.global_metrics(sum_partials(queued, &sums), Some(loss))
    }

    /// Adds micro-steps' loss values, read in micro-step order, to the window's sum.
    pub(super) fn count_losses(&mut self, losses: &[f32]) {
        losses.iter().for_each(|&loss| self.window.loss_sum += f64::from(loss));
    }

    /// This rank's mean loss over the window's micro-steps.
    pub(super) fn window_loss(&self) -> f32 {
        (self.window.loss_sum / self.window.micro_steps as f64) as f32
    }

    /// One all-reduce over the world of each rank's squared-norm partial of `grads` and of
    /// its mean `loss` (if given): (sum of squares over all ranks, mean loss). A rank's
    /// partial runs over its shards of every unit in unit order, in one f64 sum, the slots
    /// summed in world rank order. At stage 0 every rank holds the full gradients of its
    /// units, and its group's first rank computes every rank's partial the same way, so
    /// the total is the sharded stages' to the last bit. The root (the same on every
    /// pipeline stage) counts on the first stage only; every rank's loss counts (a pipeline
    /// stage's is its units' loss terms, the last stage's also the model's loss).
    pub(super) fn global_metrics(&mut self, partials: Vec<(usize, f32)>, loss: Option<f32>) -> Result<(f64, f32)> {
        let (sum_squares, loss, wait) = world_metrics(&self.shared, &self.span, partials, loss)?;
        if self.span.is_pipelined() {
            // At the flush the stages that finish first wait here for the last: the
            // pipeline's bubble, as waiting for a neighbour's activations is.
            self.window.times.pipe_wait += wait;
        }
        Ok((sum_squares, loss))
    }

    /// This rank's squared-norm partials of `grads` (the slots of
    /// [`global_metrics`](Self::global_metrics)), read from the device now where some are
    /// there.
    pub(super) fn measure(&self, grads: &[Flat]) -> Result<Vec<(usize, f32)>> {
        measure(&self.shared, &self.span, self.root_counted_elsewhere(), grads)
    }

    /// Reads the micro-step's loss `values` (and the units' loss `terms`) from the device,
    /// with those of earlier micro-steps left unread, and returns its value (the losses'
    /// sum; `None` where left unread).
    ///
    /// Where the micro-step ends the window and every unit's reduced gradient is on the
    /// device already, the norm's partials are queued first and come back in the same
    /// read, kept for the step: the host waits for the device once per micro-step, not
    /// once more at the step, and the device computes the norm while the host still waits
    /// for the backward (see [`StepReport::device_reads`](super::StepReport::device_reads)).
    ///
    /// With `defer` (`train_batch`, where the caller reads no micro-step's loss) nothing
    /// is read before the boundary, and at the boundary nothing either where the step does
    /// not need the norm on the host first ([`norm_decides_step`](Self::norm_decides_step)):
    /// the step queues the optimizer, then reads the window's losses and the norm at once.
    /// The host then waits for the device once per step, when the device has the whole
    /// step queued, as a plain training loop does; the same operations in the same order.
    pub(super) fn read_micro_step(
        &mut self,
        values: LossValues,
        terms: LossValues,
        defer: bool,
    ) -> Result<Option<f32>> {
        self.progress.measured = None;
        self.progress.unread.push(values, terms);
        let at_boundary = self.next_micro_step_is_boundary() && !self.span.is_pipelined();
        if defer && !at_boundary {
            return Ok(None);
        }
        let on_device = || self.units.iter().map(|u| u.reduced_on_device().map(Flat::Device)).collect();
        let grads: Option<Vec<Flat>> = if at_boundary { on_device() } else { None };
        let skip = self.root_counted_elsewhere();
        let queued = grads.map(|grads| queue_partials(&self.shared, &self.span, skip, &grads));
        let after_micro_steps = self.progress.counters.micro_steps + 1;
        if defer
            && !self.norm_decides_step()
            && let Some(queued) = queued
        {
            self.progress.measured = Some(Measured { after_micro_steps, queued, sums: None });
            return Ok(None);
        }
        let on_device = queued.iter().flatten().flat_map(|q| q.device.iter().cloned()).collect();
        let unread = std::mem::take(&mut self.progress.unread);
        let (losses, sums) = unread.read(on_device, |tensors| self.shared.read_values(tensors, "the loss"))?;
        self.count_losses(&losses);
        if let Some(queued) = queued {
            self.progress.measured = Some(Measured { after_micro_steps, queued, sums: Some(sums) });
        }
        Ok(losses.last().copied())
    }

    /// Whether the step needs the global gradient norm on the host before its optimizer
    /// runs: to skip a step whose gradients overflowed (fp16's loss scaler,
    /// `check_grad_overflow`), or to clip where the norm is a sum over several ranks (one
    /// rank computes its clip factor on the device: [`Prepared::factor`]).
    fn norm_decides_step(&self) -> bool {
        let plan = &self.shared.plan;
        self.progress.scaler.is_some()
            || plan.precision.check_grad_overflow
            || (plan.optim.gradient_clipping > 0.0 && self.shared.world.world_size() > 1)
    }
}

/// The gradient norm's partials queued with a window's last loss, for its step.
pub(super) struct Measured {
    /// The engine's `micro_steps` count they belong to (a later micro-step voids them).
    pub after_micro_steps: u64,
    pub queued: Vec<Queued>,
    /// The values of `queued`'s device sums, in order, where read with the loss.
    pub sums: Option<Vec<f32>>,
}

/// [`Engine::global_metrics`] of this rank's `partials`, and the seconds spent in the
/// all-reduce.
pub(super) fn world_metrics(
    shared: &Shared,
    span: &Span,
    partials: Vec<(usize, f32)>,
    loss: Option<f32>,
) -> Result<(f64, f32, f64)> {
    let world = &shared.world;
    let n = world.world_size();
    let mut metrics = vec![0.0f32; n + 1];
    for (slot, partial) in partials {
        metrics[slot] = partial;
    }
    metrics[n] = loss.unwrap_or(0.0);
    let wait = Instant::now();
    world.all_reduce((&mut metrics).into(), ReduceOp::Sum)?;
    let wait = wait.elapsed().as_secs_f64();
    let contributors = span.topology.data_parallel;
    Ok((metrics[..n].iter().map(|&p| f64::from(p)).sum(), metrics[n] / contributors as f32, wait))
}

/// A squared-norm partial as queued: its slot in the world's metrics, the part summed on
/// the host, and each unit's sum on the device, still to be read.
pub(super) struct Queued {
    slot: usize,
    host: f64,
    device: Vec<Tensor<1>>,
}

impl Queued {
    /// Each unit's sum of squares on the device (one-element f32 tensors), in unit order.
    pub fn on_device(&self) -> &[Tensor<1>] {
        &self.device
    }
}

/// The partials of `grads` this rank fills in the world's metrics (`skip`: a root another
/// stage counts), read from the device now where some are there.
pub(super) fn measure(shared: &Shared, span: &Span, skip: Option<usize>, grads: &[Flat]) -> Result<Vec<(usize, f32)>> {
    let queued = queue_partials(shared, span, skip, grads);
    let on_device = queued.iter().flat_map(|p| p.device.iter().cloned()).collect();
    let sums = shared.read_values(on_device, "the gradients' norm")?;
    Ok(sum_partials(queued, &sums))
}

/// The partials this rank fills (see [`Engine::global_metrics`]): its own where the
/// optimizer states are sharded, every group rank's on the group's first rank at stage 0.
pub(super) fn queue_partials(shared: &Shared, span: &Span, skip: Option<usize>, grads: &[Flat]) -> Vec<Queued> {
    let group = &shared.comm;
    let sharded = shared.plan.zero.stage.shards_optimizer_states();
    let ranks = match (sharded, group.rank()) {
        (true, mine) => mine..mine + 1,
        (false, 0) => 0..group.world_size(),
        (false, _) => 0..0,
    };
    ranks.map(|r| queue_partial(shared, grads, r, sharded, skip, span.world_rank(r))).collect()
}

/// Each partial's sum: its host part, then its device sums (`sums`, every partial's in
/// order) added in f64, as f32.
pub(super) fn sum_partials(queued: Vec<Queued>, sums: &[f32]) -> Vec<(usize, f32)> {
    let mut at = 0;
    queued
        .into_iter()
        .map(|q| {
            let device = &sums[at..at + q.device.len()];
            at += q.device.len();
            (q.slot, (q.host + device.iter().map(|&s| f64::from(s)).sum::<f64>()) as f32)
        })
        .collect()
}

/// The partial of the squared norm of `grads` as group rank `r` holds them, for `slot`: on
/// the host in f64, element by element; on the device each unit's in f32 there, queued.
fn queue_partial(shared: &Shared, grads: &[Flat], r: usize, sharded: bool, skip: Option<usize>, slot: usize) -> Queued {
    let mut sum = 0.0f64;
    let mut on_device = Vec::new();
    for (id, values) in grads.iter().enumerate() {
        let layout = shared.layout(id);
        let real = layout.shard_real_range(r);
        if real.is_empty() || skip == Some(id) {
            continue; // an all-padding shard, or the root counted by another stage
        }
        let offset = if sharded { layout.shard_range(r).start } else { 0 };
        let at = real.start - offset..real.end - offset;
        // Each element as the f32 the step will see (a half value converts exactly).
        let mut add = |g: f32| sum += f64::from(g) * f64::from(g);
        match values {
            Flat::Host(values) => match values.as_ref().slice(at) {
                BufRef::F32(v) => v.iter().copied().for_each(&mut add),
                BufRef::F16(v) => v.iter().map(|g| g.to_f32()).for_each(&mut add),
                BufRef::Bf16(v) => v.iter().map(|g| g.to_f32()).for_each(&mut add),
            },
            Flat::Device(t) => on_device.push(t.clone().slice(at).cast(FloatDType::F32).square().sum()),
        }
    }
    Queued { slot, host: sum, device: on_device }
}
