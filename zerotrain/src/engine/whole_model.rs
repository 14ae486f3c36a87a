//! The model as a whole: [`Engine::forward`] and [`Engine::backward`] with the caller's
//! closures, and [`Engine::eval`]. Every unit is gathered for the call at stage 3; Burn
//! produces every gradient at once, and each unit's are reduced in reverse order.

use std::time::Instant;

use burn::module::Module;
use burn::optim::GradientsParams;
use burn::tensor::{FloatDType, Tensor};

use super::Engine;
use super::accumulation::ReduceOptions;
use super::params::UnitGrads;
use super::report::{LossValues, Peaks};
use crate::random::Draw;
use crate::{Error, Result};

impl<M: Module> Engine<M> {
    /// Runs `f` on the model with every parameter present (at stage 3 every unit is
    /// gathered first) and returns its result, typically the loss for
    /// [`backward`](Self::backward). Every rank must call it the same number of times at
    /// stage 3. A model built with [`with_units`](Self::with_units) trains with less
    /// memory through [`forward_backward`](Self::forward_backward).
    ///
    /// What `f` draws at random (dropout) comes from this rank's stream for the call (the
    /// micro-step's first, second... call of `forward`), not from whatever the process's
    /// generator holds: see [`crate::random`]. `f` must not take [`crate::random::lock`].
    pub fn forward<R>(&mut self, f: impl FnOnce(&M) -> R) -> Result<R> {
        self.whole()?;
        self.gather_all()?;
        let start = Instant::now();
        let draw = self.draw(self.window.micro_steps, self.window.forward_calls);
        self.window.forward_calls += 1;
        let out = self.shared.streams.run(&self.shared.device, draw, || f(&self.model));
        self.window.times.forward += self.shared.phase_seconds(start);
        Ok(out)
    }

    /// Stream `index` of micro-batch `micro` of the step in progress (see [`crate::random`]).
    pub(super) fn draw(&self, micro: u64, index: u64) -> Draw {
        Draw { step: self.progress.counters.global_steps, micro, index }
    }

    /// Back-propagates `loss` (a one-element tensor from [`forward`](Self::forward)),
    /// divided by the accumulation steps, and reduces every unit's gradients as the stage
    /// prescribes. Returns the loss value.
    pub fn backward(&mut self, loss: Tensor<1>) -> Result<f32> {
        let (value, scaled) = self.scale_loss(loss)?;
        let value = LossValues::of(value);
        let start = Instant::now();
        let mut grads = GradientsParams::from_grads(scaled.backward(), &self.model);
        self.window.times.backward += self.shared.phase_seconds(start);
        let reduce_start = Instant::now();
        let all = vec![true; self.units.len()];
        let taken = self.shared.take_grads(&self.model, &mut grads, &all)?;
        drop(grads);
        for (id, grads) in taken.into_iter().enumerate().rev() {
            let grads = grads.unwrap_or_else(|| UnitGrads::empty(self.shared.layout(id).entries().len()));
            let previous = (id + 1 < self.units.len()).then_some(id + 1);
            self.reduce_unit(id, grads, previous)?;
        }
        self.window.times.reduce += self.shared.phase_seconds(reduce_start);
        for id in 0..self.units.len() {
            self.release(id);
        }
        let value = self.read_micro_step(value, LossValues::default())?;
        Ok(self.end_micro_step(value))
    }

    /// Checks the loss, and returns its value (f32, on the device: [`LossValues`]) and the
    /// tensor to back-propagate: cast to f32, times the loss scale, divided by the
    /// accumulation steps.
    pub(super) fn scale_loss(&self, loss: Tensor<1>) -> Result<(Tensor<1>, Tensor<1>)> {
        if loss.dims() != [1] {
            return Err(Error::Usage(format!("backward needs a one-element loss, got shape {:?}", loss.dims())));
        }
        let loss = loss.cast(FloatDType::F32);
        Ok((loss.clone(), self.scaled(loss)))
    }

    /// `loss` (f32) times the loss scale, divided by the accumulation steps.
    pub(super) fn scaled(&self, loss: Tensor<1>) -> Tensor<1> {
        let gas = self.shared.plan.batch.gradient_accumulation_steps as f32;
        match &self.progress.scaler {
            Some(scaler) => loss.mul_scalar(scaler.scale() as f32).div_scalar(gas),
            None => loss.div_scalar(gas),
        }
    }

    /// Starts reducing unit `id`'s gradients of this backward pass, after settling the
    /// reductions still in flight of the unit reduced before it, `previous` (so at most one
    /// unit's reductions overlap the next unit's backward).
    pub(super) fn reduce_unit(&mut self, id: usize, grads: UnitGrads, previous: Option<usize>) -> Result<()> {
        if let Some(previous) = previous {
            self.units[previous].settle(&mut self.window.times)?;
        }
        let plan = &self.shared.plan;
        let options = ReduceOptions {
            reduce_scatter: plan.zero.reduce_scatter,
            comm_dtype: plan.precision.comm,
            bucket_elems: plan.zero.reduce_bucket_size,
            first: self.window.micro_steps == 0,
            boundary: self.next_micro_step_is_boundary(),
            overlap: plan.zero.overlap_comm,
        };
        let bytes = self.units[id].reduce(grads, &self.shared, options, &mut self.window.times)?;
        self.peaks.transient = self.peaks.transient.max(bytes);
        Ok(())
    }

    /// Counts a finished micro-step whose losses (the model's and its units' terms) sum to
    /// `value`; returns it.
    pub(super) fn end_micro_step(&mut self, value: f32) -> f32 {
        self.progress.counters.micro_steps += 1;
        self.window.micro_steps += 1;
        self.window.forward_calls = 0;
        self.window.loss_sum += f64::from(value);
        value
    }

    /// Runs `f` on the model in evaluation mode (no autodiff graph, buffers read, not
    /// updated: Burn's inference path), with every parameter present: at stage 3 the model
    /// is gathered for the call and released after it. The buffers are first averaged over
    /// the data-parallel ranks. Neither its time nor its traffic counts in the next step's
    /// report, nor what it gathers in training's memory peaks
    /// ([`MemoryReport::peak_eval_gathered`](super::MemoryReport::peak_eval_gathered) has it). Every rank must call it.
    pub fn eval<R>(&mut self, f: impl FnOnce(&M) -> R) -> Result<R> {
        self.off_the_clock(|engine| engine.eval_gathered(f))
    }

    fn eval_gathered<R>(&mut self, f: impl FnOnce(&M) -> R) -> Result<R> {
        self.agree(self.whole(), "checking its states")?;
        self.sync_buffers()?;
        let was_released: Vec<bool> = self.units.iter().map(|u| !u.is_gathered()).collect();
        // What evaluation gathers is reported apart from training's peaks.
        let training = self.peaks;
        self.peaks.gathered = 0;
        let gathered = self.gather_all();
        self.peaks = Peaks { eval_gathered: self.peaks.eval_gathered.max(self.peaks.gathered), ..training };
        gathered?;
        let result = f(&self.model.valid());
        for (id, released) in was_released.into_iter().enumerate() {
            if released {
                self.release(id);
            }
        }
        Ok(result)
    }

    /// Averages the model's buffers (BatchNorm's running statistics, frozen parameters)
    /// over the data-parallel ranks, so that every rank holds the same values (see the note
    /// in `engine/buffers.rs`); evaluation, checkpoints and exports do it themselves. Every
    /// rank must call it.
    pub fn sync_buffers(&mut self) -> Result<()> {
        let model = self.model.clone();
        self.model = self.buffers.average(model, self.shared.comm.as_ref())?;
        Ok(())
    }

    /// A copy of the model with every parameter present and current (gathered at stage 3)
    /// and the buffers averaged, on every rank: for evaluation or export. Every rank must
    /// call it. [`gather_model`](Self::gather_model) makes it on one rank only.
    pub fn full_model(&mut self) -> Result<M> {
        self.eval(|model| model.clone().train())
    }
}
