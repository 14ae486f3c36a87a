//! The step's gradients before the optimizer sees them: reduced, measured (the global norm
//! and the loss, agreed over the world), and open to the caller through [`Gradients`] for
//! logging and custom clipping.
//!
//! # Note: one multiply
//! The reduced gradients are sums over the ranks of loss-scaled gradients. The step scales
//! them once, by `clip / (N * loss_scale)`, so that unscaling, averaging and clipping round
//! once. A caller's [`Gradients::scale`] joins that multiply; only
//! [`Gradients::for_each_mut`] applies the pending factor to the values first (one more
//! rounding, the price of editing them).

use std::ops::Range;
use std::time::Instant;

use burn::module::Module;
use burn::tensor::{FloatDType, Tensor};
use zerotrain_precision::{BufRef, FlatBuf};
use zerotrain_zero::ReduceOp;

use super::Engine;
use super::flat::Flat;
use super::report::LossValues;
use super::shared::Shared;
use super::span::Span;
use crate::{Error, Result};

/// The step's gradients, reduced and measured (module note).
pub(crate) struct Prepared {
    /// Each unit's reduced gradient over its optimizer range, in the dtype it was reduced
    /// in (f32 on the host once edited through [`Gradients::for_each_mut`]), on the device
    /// in a device-resident step; the step converts a unit's to f32 as it steps it.
    pub grads: Vec<Flat>,
    /// Sum over the world of the squares of `grads`' elements (each counted once).
    pub sum_squares: f64,
    /// Mean loss over every rank and micro-step.
    pub loss: f32,
    /// The factor still to apply, as `numerator / denominator`: 1 / (N * loss scale) times
    /// the caller's scales (kept apart so that without them the bits are one division's).
    pub numerator: f64,
    pub denominator: f64,
    /// The values were edited since `sum_squares` was computed.
    pub stale_norm: bool,
}

impl Prepared {
    /// The global norm of the averaged, unscaled gradient the optimizer would see now.
    pub fn norm(&self) -> f64 {
        self.sum_squares.sqrt() * self.numerator / self.denominator
    }
}

impl<M: Module> Engine<M> {
    /// Reduces and measures the step's gradients, once per step (at the boundary).
    pub(super) fn prepare_step(&mut self) -> Result<()> {
        if self.progress.prepared.is_some() {
            return Ok(());
        }
        let start = Instant::now();
        let mut grads = Vec::with_capacity(self.units.len());
        for unit in &mut self.units {
            grads.push(unit.take_reduced(&mut self.window.times)?);
        }
        if let Some(root) = self.granularity.root().filter(|_| self.span.is_pipelined()) {
            // Summed over the stages in f32, as the step will use it.
            let taken = std::mem::replace(&mut grads[root], Flat::Host(FlatBuf::F32(Vec::new())));
            let mut values = taken.into_host("the root's gradient")?.into_f32();
            self.span.sum_over_stages((&mut values).into())?;
            grads[root] = Flat::Host(FlatBuf::F32(values));
        }
        let loss = (self.window.loss_sum / self.window.micro_steps as f64) as f32;
        // Measured with the last micro-step's loss where that read them (`read_micro_step`).
        let now = self.progress.counters.micro_steps;
        let partials = match self.progress.measured.take().filter(|m| m.after_micro_steps == now) {
            Some(measured) => measured.partials,
            None => self.measure(&grads)?,
        };
        let (sum_squares, loss) = self.global_metrics(partials, Some(loss))?;
        self.window.times.reduce += self.shared.phase_seconds(start);
        let denominator = self.shared.comm.world_size() as f64 * self.loss_scale();
        let (numerator, stale_norm) = (1.0, false);
        self.progress.prepared = Some(Prepared { grads, sum_squares, loss, numerator, denominator, stale_norm });
        Ok(())
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

    /// Reads the micro-step's loss `values` (and the units' loss `terms`) from the device.
    /// Where the micro-step ends the window and every unit's reduced gradient is on the
    /// device already, the norm's partials are queued first and come back in the same
    /// read, kept for the step: the host then waits for the device once per micro-step, not
    /// once more at the step, and the device computes the norm while the host still waits
    /// for the backward (see [`StepReport::device_reads`](super::StepReport::device_reads)).
    pub(super) fn read_micro_step(&mut self, values: LossValues, terms: LossValues) -> Result<f32> {
        let at_boundary = self.next_micro_step_is_boundary() && !self.span.is_pipelined();
        let grads: Option<Vec<Flat>> = match at_boundary {
            true => self.units.iter().map(|u| u.reduced_on_device().map(Flat::Device)).collect(),
            false => None,
        };
        self.progress.measured = None;
        let read = |tensors| self.shared.read_values(tensors, "the loss");
        let Some(grads) = grads else { return values.read_with(terms, read) };
        let queued = queue_partials(&self.shared, &self.span, self.root_counted_elsewhere(), &grads);
        let (value, sums) = values.read_beside(terms, device_sums(&queued), read)?;
        let partials = sum_partials(queued, &sums);
        self.progress.measured = Some(Measured { after_micro_steps: self.progress.counters.micro_steps + 1, partials });
        Ok(value)
    }

    /// The step's gradients, before [`step`](Self::step): for logging them, clipping them
    /// another way, or editing them. Available once the last micro-step of the window has
    /// run (at [`is_gradient_accumulation_boundary`](Self::is_gradient_accumulation_boundary));
    /// it reduces them, which `step` would do, and `step` then uses what the caller left.
    /// Every rank must call it.
    pub fn gradients(&mut self) -> Result<Gradients<'_>> {
        if !self.is_gradient_accumulation_boundary() {
            return Err(Error::Usage(
                "gradients() before the accumulation boundary: run the window's last micro-step first".into(),
            ));
        }
        self.prepare_step()?;
        let skip = self.root_counted_elsewhere();
        let prepared = self.progress.prepared.as_mut().expect("prepared above");
        Ok(Gradients { prepared, shared: &self.shared, span: &self.span, skip })
    }
}

/// The gradient norm's partials measured with a window's last loss, for its step.
pub(super) struct Measured {
    /// The engine's `micro_steps` count they belong to (a later micro-step voids them).
    pub after_micro_steps: u64,
    /// Slot in the world's metrics and partial sum of squares ([`Engine::global_metrics`]).
    pub partials: Vec<(usize, f32)>,
}

/// [`Engine::global_metrics`] of this rank's `partials`, and the seconds spent in the
/// all-reduce.
fn world_metrics(
    shared: &Shared,
    span: &Span,
    partials: Vec<(usize, f32)>,
    loss: Option<f32>,
) -> Result<(f64, f32, f64)> {
    let world = &shared.ranks;
    let n = world.world_size();
    // A tensor group's ranks fill slots of their own (tensor rank t: t * n ..), and only
    // the first of them the loss, which every one computes alike (`tensor.rs`).
    let (t, tp) = shared.tensor.as_ref().map_or((0, 1), |share| share.place());
    let mut metrics = vec![0.0f32; n * tp + 1];
    for (slot, partial) in partials {
        metrics[t * n + slot] = partial;
    }
    metrics[n * tp] = if t == 0 { loss.unwrap_or(0.0) } else { 0.0 };
    let wait = Instant::now();
    world.all_reduce((&mut metrics).into(), ReduceOp::Sum)?;
    if let Some(share) = &shared.tensor {
        share.comm.all_reduce((&mut metrics).into(), ReduceOp::Sum)?;
    }
    let wait = wait.elapsed().as_secs_f64();
    let contributors = span.topology.data_parallel;
    Ok((metrics[..n * tp].iter().map(|&p| f64::from(p)).sum(), metrics[n * tp] / contributors as f32, wait))
}

/// A squared-norm partial as queued: its slot in the world's metrics, the part summed on
/// the host, and each unit's sum on the device, still to be read.
struct Queued {
    slot: usize,
    host: f64,
    device: Vec<Tensor<1>>,
}

/// The partials of `grads` this rank fills in the world's metrics (`skip`: a root another
/// stage counts), read from the device now where some are there.
fn measure(shared: &Shared, span: &Span, skip: Option<usize>, grads: &[Flat]) -> Result<Vec<(usize, f32)>> {
    let queued = queue_partials(shared, span, skip, grads);
    let sums = shared.read_values(device_sums(&queued), "the gradients' norm")?;
    Ok(sum_partials(queued, &sums))
}

/// The device sums of every partial in `queued`, in order: what [`sum_partials`] reads.
fn device_sums(queued: &[Queued]) -> Vec<Tensor<1>> {
    queued.iter().flat_map(|q| q.device.iter().cloned()).collect()
}

/// The partials this rank fills (see [`Engine::global_metrics`]): its own where the
/// optimizer states are sharded, every group rank's on the group's first rank at stage 0.
fn queue_partials(shared: &Shared, span: &Span, skip: Option<usize>, grads: &[Flat]) -> Vec<Queued> {
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
fn sum_partials(queued: Vec<Queued>, sums: &[f32]) -> Vec<(usize, f32)> {
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
        // A tensor rank other than the first leaves out what every tensor rank holds.
        let counted = match &shared.tensor {
            Some(tensor) => tensor.counted(id, real),
            None => vec![real],
        };
        for part in counted {
            let at = part.start - offset..part.end - offset;
            // Each element as the f32 the step will see (a half value converts exactly).
            let mut add = |g: f32| sum += f64::from(g) * f64::from(g);
            match values {
                Flat::Host(values) => match values.as_ref().slice(at) {
                    BufRef::F32(v) => v.iter().copied().for_each(&mut add),
                    BufRef::F16(v) => v.iter().map(|g| g.to_f32()).for_each(&mut add),
                    BufRef::Bf16(v) => v.iter().map(|g| g.to_f32()).for_each(&mut add),
                },
                Flat::Device(t) => {
                    on_device.push(crate::reduce::sum(t.clone().slice(at).cast(FloatDType::F32).square()))
                }
            }
        }
    }
    Queued { slot, host: sum, device: on_device }
}

/// The step's gradients on this rank, averaged over the ranks and unscaled, as the
/// optimizer will see them before clipping ([`Engine::gradients`]).
pub struct Gradients<'a> {
    prepared: &'a mut Prepared,
    shared: &'a Shared,
    span: &'a Span,
    /// The root, where another pipeline stage counts it.
    skip: Option<usize>,
}

impl Gradients<'_> {
    /// The global L2 norm (over every rank), exactly the one `gradient_clipping` clips to
    /// (in f64, as the step computes it). After [`for_each_mut`](Self::for_each_mut) it is
    /// measured again: every rank must then call it (or leave it to `step`).
    pub fn global_norm(&mut self) -> Result<f64> {
        if self.prepared.stale_norm {
            self.remeasure()?;
        }
        Ok(self.prepared.norm())
    }

    /// Multiplies the gradients by `factor` (custom clipping: `max / norm`), exactly: the
    /// factor joins the step's one multiply, so scaling to a norm by hand gives the bits
    /// `gradient_clipping` gives.
    pub fn scale(&mut self, factor: f64) {
        self.prepared.numerator *= factor;
    }

    /// Calls `f` with each piece of a parameter this rank holds a gradient for: its module
    /// path, which of its elements (row-major) the piece is, and their values. At stages
    /// 1-3 a rank holds its shard only; the pieces of every rank make the whole gradient.
    /// Gradients on a device are read to the host for it (an error if the device fails).
    pub fn for_each(&self, mut f: impl FnMut(&str, Range<usize>, &[f32])) -> Result<()> {
        let factor = (self.prepared.numerator / self.prepared.denominator) as f32;
        let mut scratch = Vec::new();
        self.pieces(|path, param_range, values: &[f32]| {
            scratch.clear();
            scratch.extend(values.iter().map(|g| g * factor));
            f(path, param_range, &scratch);
        })
    }

    /// Like [`for_each`](Self::for_each), with the values to edit (the pending factor is
    /// applied to them first; the step measures the norm again).
    pub fn for_each_mut(&mut self, mut f: impl FnMut(&str, Range<usize>, &mut [f32])) -> Result<()> {
        let factor = (self.prepared.numerator / self.prepared.denominator) as f32;
        for grads in &mut self.prepared.grads {
            let mut values = self.shared.to_host(std::mem::replace(grads, Flat::Host(FlatBuf::F32(Vec::new()))))?;
            values.iter_mut().for_each(|g| *g *= factor);
            *grads = Flat::Host(FlatBuf::F32(values));
        }
        (self.prepared.numerator, self.prepared.denominator, self.prepared.stale_norm) = (1.0, 1.0, true);
        let shared = self.shared;
        for (id, grads) in self.prepared.grads.iter_mut().enumerate() {
            let Flat::Host(FlatBuf::F32(values)) = grads else { unreachable!("converted to f32 above") };
            if self.skip == Some(id) {
                continue;
            }
            for segment in shared.optimizer_segments(id) {
                f(&segment.path, segment.param_range, &mut values[segment.range]);
            }
        }
        Ok(())
    }

    /// Each piece of a parameter this rank holds (the root only where it counts).
    fn pieces(&self, mut f: impl FnMut(&str, Range<usize>, &[f32])) -> Result<()> {
        for (id, grads) in self.prepared.grads.iter().enumerate() {
            if self.skip == Some(id) {
                continue;
            }
            let read = match grads {
                Flat::Host(_) => None,
                Flat::Device(t) => Some(self.shared.to_host(Flat::Device(t.clone()))?),
            };
            for segment in self.shared.optimizer_segments(id) {
                let values = match (&read, grads) {
                    (Some(read), _) => read[segment.range].to_vec(),
                    (None, Flat::Host(host)) => host.as_ref().slice(segment.range).to_f32(),
                    (None, Flat::Device(_)) => unreachable!("read above"),
                };
                f(&segment.path, segment.param_range, &values);
            }
        }
        Ok(())
    }

    fn remeasure(&mut self) -> Result<()> {
        let partials = measure(self.shared, self.span, self.skip, &self.prepared.grads)?;
        let (sum_squares, _, _) = world_metrics(self.shared, self.span, partials, None)?;
        self.prepared.sum_squares = sum_squares;
        self.prepared.stale_norm = false;
        Ok(())
    }
}
