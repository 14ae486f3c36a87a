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
use burn::tensor::Tensor;
use zerotrain_precision::FlatBuf;

use super::Engine;
use super::flat::Flat;
use super::norm::{Queued, measure, queue_partials, sum_partials, world_metrics};
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
    /// This rank's norm partials, still on the device with the window's losses where
    /// `train_batch` reads them after queueing the optimizer: `sum_squares` and `loss` are
    /// known once [`Engine::settle`] has read them.
    pub unread: Option<Vec<Queued>>,
    /// Each unit's sum of squares on the device, where they are the whole norm (one rank,
    /// every gradient on the device): the clip factor is then computed there.
    pub on_device: Vec<Tensor<1>>,
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

    /// The one factor the step multiplies the gradients by (module note): unscaling,
    /// averaging and, with `clip` > 0, clipping to the global norm as
    /// `torch.nn.utils.clip_grad_norm_` does (`clip / (norm + 1e-6)`, at most 1). Where
    /// the norm's sums are on the device the factor is computed there, in f32, so that the
    /// step never waits for the norm; elsewhere on the host, in f64 (see
    /// [`Engine::read_micro_step`]).
    pub fn factor(&self, clip: f64) -> Factor {
        let ratio = self.numerator / self.denominator;
        match self.on_device.iter().cloned().reduce(|sum, s| sum + s) {
            Some(sum_squares) if clip > 0.0 => {
                let norm = sum_squares.sqrt().mul_scalar(ratio as f32);
                let coef = norm.add_scalar(1e-6).recip().mul_scalar(clip as f32).clamp_max(1.0);
                Factor::Device(coef.mul_scalar(ratio as f32))
            }
            _ => {
                let coef = if clip > 0.0 { (clip / (self.norm() + 1e-6)).min(1.0) } else { 1.0 };
                Factor::Host((coef * ratio) as f32)
            }
        }
    }
}

/// The factor of [`Prepared::factor`].
#[allow(clippy::large_enum_variant, reason = "one per step: boxing the tensor would allocate per step")]
pub(crate) enum Factor {
    Host(f32),
    /// A one-element f32 tensor on the device.
    Device(Tensor<1>),
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
        // Queued (and maybe read) with the last micro-step's loss (`read_micro_step`).
        let now = self.progress.counters.micro_steps;
        let measured = self.progress.measured.take().filter(|m| m.after_micro_steps == now);
        let measured_at_boundary = measured.is_some();
        let (queued, sums) = match measured {
            Some(measured) => (measured.queued, measured.sums),
            None => (queue_partials(&self.shared, &self.span, self.root_counted_elsewhere(), &grads), None),
        };
        let alone = self.shared.world.world_size() == 1 && queued.len() == 1;
        let on_device = match alone && grads.iter().all(|g| matches!(g, Flat::Device(_))) {
            true => queued[0].on_device().to_vec(),
            false => Vec::new(),
        };
        let denominator = self.shared.comm.world_size() as f64 * self.loss_scale();
        let mut prepared = Prepared {
            grads,
            sum_squares: 0.0,
            loss: 0.0,
            unread: None,
            on_device,
            numerator: 1.0,
            denominator,
            stale_norm: false,
        };
        match (measured_at_boundary, sums) {
            // Read with the last loss: only the world's sums are left.
            (true, Some(sums)) => {
                let loss = self.window_loss();
                (prepared.sum_squares, prepared.loss) = self.global_metrics(sum_partials(queued, &sums), Some(loss))?;
            }
            // Left on the device for `step`, which queues the optimizer first.
            (true, None) => prepared.unread = Some(queued),
            // Nothing measured yet: read now.
            (false, _) => (prepared.sum_squares, prepared.loss) = self.settle(queued)?,
        }
        self.window.times.reduce += self.shared.phase_seconds(start);
        self.progress.prepared = Some(prepared);
        Ok(())
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
        if let Some(queued) = self.progress.prepared.as_mut().and_then(|p| p.unread.take()) {
            let metrics = self.settle(queued)?;
            let prepared = self.progress.prepared.as_mut().expect("prepared above");
            (prepared.sum_squares, prepared.loss) = metrics;
        }
        let skip = self.root_counted_elsewhere();
        let prepared = self.progress.prepared.as_mut().expect("prepared above");
        Ok(Gradients { prepared, shared: &self.shared, span: &self.span, skip })
    }
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
