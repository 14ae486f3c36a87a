//! One unit's state and lifecycle: where its parameters are (gathered in the model,
//! released, or being fetched), its fp32 master weights, its gradient accumulator and its
//! optimizer. The engine walks the units and calls their phase methods: [`Unit::gather`]
//! before a unit runs, [`Unit::release`] after, [`Unit::reduce`] when backward has produced
//! its gradients, [`Unit::step`] at the optimizer step.
//!
//! # Note: persistence
//! At stage 3, parameters with at most `stage3_param_persistence_threshold` elements stay
//! resident in the model when their unit is released (DeepSpeed's rule; they cost little
//! memory). A unit's gather rewrites them too, so they are current from the unit's first
//! use after a step on; between `step()` and that use they still hold the previous step's
//! values. [`crate::Engine::full_model`] always returns current values.

use std::ops::Range;
use std::sync::Arc;
use std::time::Instant;

use burn::module::Module;
use burn::tensor::Device;
use zerotrain_precision::{BufMut, FlatBuf, Precision};
use zerotrain_zero::{Collective, Completed, FlatLayout, Pending, Request, Sharding, ZeroStage};

use super::PhaseTimes;
use super::grads::{ReduceOptions, UnitGrad};
use super::master::Values;
use super::optimizer::{ShardSegment, UnitOptimizer};
use super::params::{Fill, ParamIndex, UnitGrads, read_params, write_params};
use crate::config::{ComputeDevice, Plan};
use crate::{Error, Result};

/// What every unit works with: the rank's collectives and device, the plan, the units'
/// layouts and the index of the model's parameters.
pub(crate) struct Shared {
    /// The ranks the units are sharded over: the world, or a pipeline stage's
    /// data-parallel group.
    pub comm: Arc<dyn Collective>,
    /// Every rank of the job (the gradient norm, the loss, checkpoints agree over it).
    pub world: Arc<dyn Collective>,
    pub device: Device,
    pub plan: Plan,
    pub sharding: Sharding,
    pub index: ParamIndex,
}

impl Shared {
    /// Unit `unit`'s flat layout.
    pub fn layout(&self, unit: usize) -> &FlatLayout {
        &self.sharding.units()[unit].layout
    }

    fn stage(&self) -> ZeroStage {
        self.plan.zero.stage
    }

    /// The rank's device without autodiff: where master weights and optimizer state live.
    pub fn state_device(&self) -> Device {
        self.device.clone().without_autodiff()
    }

    /// Whether the rank computes on the CPU (see [`Values`]).
    pub fn on_cpu(&self) -> bool {
        self.plan.runtime.device == ComputeDevice::Cpu
    }

    /// The compute dtype.
    pub fn dtype(&self) -> Precision {
        self.plan.precision.compute
    }

    /// The pieces of parameters in unit `unit`'s optimizer range, placed relative to it.
    pub fn optimizer_segments(&self, unit: usize) -> Vec<ShardSegment> {
        let range = self.optimizer_range(unit);
        let entries = self.layout(unit).entries().iter();
        entries
            .filter_map(|e| {
                let s = e.segment(range.clone())?;
                let at = s.flat_range.start - range.start..s.flat_range.end - range.start;
                Some(ShardSegment {
                    path: e.path.clone(),
                    shape: e.shape.clone(),
                    param_range: s.param_range,
                    range: at,
                })
            })
            .collect()
    }

    /// The range of unit `unit`'s flat buffer this rank's optimizer steps: all of its
    /// parameters at stage 0, its shard (padding included) otherwise.
    pub fn optimizer_range(&self, unit: usize) -> Range<usize> {
        let layout = self.layout(unit);
        match self.stage() {
            ZeroStage::Disabled => 0..layout.num_elems(),
            _ => layout.shard_range(self.comm.rank()),
        }
    }

    /// The part of [`optimizer_range`](Self::optimizer_range) that holds parameters.
    pub fn optimizer_real_range(&self, unit: usize) -> Range<usize> {
        match self.stage() {
            ZeroStage::Disabled => self.optimizer_range(unit),
            _ => self.layout(unit).shard_real_range(self.comm.rank()),
        }
    }
}

/// Waits for `pending`, counting the wait and the collective's own time in `times`.
pub(crate) fn finish(pending: Pending, times: &mut PhaseTimes) -> Result<Completed> {
    let start = Instant::now();
    let done = pending.wait();
    times.comm_wait += start.elapsed().as_secs_f64();
    let done = done?;
    times.comm_busy += done.busy.as_secs_f64();
    Ok(done)
}

/// Note: lost master weights. [`Unit::step`] moves the only fp32 copy of a range into the
/// optimizer; if the step fails, nothing puts it back. The unit then holds no master
/// tensor, and every later use is this error, never a panic or a checkpoint of empty
/// values. Loading a checkpoint puts new values in and heals it.
fn lost() -> Error {
    Error::Usage(
        "this rank's master weights are gone (an optimizer step failed part-way); load a checkpoint to go on".into(),
    )
}

/// Where a unit's fp32 master weights are.
#[expect(clippy::large_enum_variant, reason = "one per unit, never moved in a hot loop")]
enum Master {
    /// fp32 training, stages 0-2: the model's parameters are the master weights; the
    /// optimizer steps a transient copy of the range.
    InModel,
    /// The fp32 values of the optimizer range, where the rank computes (`None`: lost, see
    /// [`lost`]): mixed precision at stages 0-2 (the model holds compute-dtype copies), and
    /// stage 3, where they are the only persistent copy.
    Held(Option<Values>),
}

/// Where a unit's parameters are at stage 3 (at stages 0-2 they are always present).
#[derive(Debug)]
enum Presence {
    /// In the model.
    Gathered,
    /// Only the shard (and resident parameters) exist.
    Released,
    /// An all-gather is in flight (a prefetch).
    Fetching(Pending),
}

/// One unit. See the module docs.
pub(crate) struct Unit {
    id: usize,
    master: Master,
    grad: UnitGrad,
    optimizer: UnitOptimizer,
    presence: Presence,
    /// Stage 3: which of the unit's parameters stay resident when it is released.
    resident: Vec<bool>,
}

impl Unit {
    /// Unit `id`, starting from `values` (its whole flat buffer in fp32, identical on every
    /// rank): writes them into `model` in the compute dtype, keeps the masters the stage
    /// keeps, and at stage 3 releases the unit. Returns the model.
    pub fn new<M: Module>(id: usize, values: &[f32], model: M, shared: &Shared, optimizer: UnitOptimizer) -> (M, Self) {
        let (plan, layout) = (&shared.plan, shared.layout(id));
        let compute = FlatBuf::from_f32(shared.dtype(), &values[..layout.num_elems()]);
        let model = write_params(model, &shared.index, &shared.sharding, id, Fill::Take(compute), &shared.device);
        let stage = plan.zero.stage;
        let master = match (stage.shards_parameters(), shared.dtype()) {
            (false, Precision::Fp32) => Master::InModel,
            _ => {
                let range = values[shared.optimizer_range(id)].to_vec();
                Master::Held(Some(Values::new(range, shared.on_cpu(), &shared.state_device())))
            }
        };
        let threshold = plan.zero.param_persistence_threshold;
        let resident = layout.entries().iter().map(|e| e.num_elems as u64 <= threshold).collect();
        let grad = UnitGrad::new(stage, layout, plan.precision.grad_accum, shared.comm.rank());
        let mut unit = Self { id, master, grad, optimizer, presence: Presence::Gathered, resident };
        let model = if stage.shards_parameters() { unit.release(model, shared) } else { model };
        (model, unit)
    }

    /// Elements the unit's gathered flat buffer holds (its padded size).
    pub fn gathered_elems(&self, shared: &Shared) -> u64 {
        shared.layout(self.id).padded_elems() as u64
    }

    /// Whether the unit's parameters are in the model.
    pub fn is_gathered(&self) -> bool {
        matches!(self.presence, Presence::Gathered)
    }

    /// Whether an all-gather of the unit is in flight.
    pub fn is_fetching(&self) -> bool {
        matches!(self.presence, Presence::Fetching(_))
    }

    /// Stage 3: starts the all-gather of the unit's parameters in the compute dtype (a
    /// prefetch, when the unit is not needed yet). Nothing to do if it is gathered or
    /// already being fetched.
    pub fn fetch(&mut self, shared: &Shared) -> Result<()> {
        if !matches!(self.presence, Presence::Released) {
            return Ok(());
        }
        let layout = shared.layout(self.id);
        let request = Request::AllGather {
            input: self.held(layout.shard_len())?.to_host(shared.dtype())?,
            output: FlatBuf::zeros(shared.dtype(), layout.padded_elems()),
        };
        self.presence = Presence::Fetching(shared.comm.start(request));
        Ok(())
    }

    /// Makes the unit's parameters present in the model (stage 3: fetching them unless a
    /// prefetch already did, and writing them in). Returns the model and the transient
    /// bytes of the gathered buffer. `times` gets the wait; the caller times the whole.
    pub fn gather<M: Module>(&mut self, model: M, shared: &Shared, times: &mut PhaseTimes) -> Result<(M, u64)> {
        self.fetch(shared)?;
        let Presence::Fetching(pending) = std::mem::replace(&mut self.presence, Presence::Gathered) else {
            return Ok((model, 0));
        };
        let gathered = finish(pending, times)?.output;
        let bytes = gathered.bytes();
        let model = write_params(model, &shared.index, &shared.sharding, self.id, Fill::Take(gathered), &shared.device);
        Ok((model, bytes))
    }

    /// Stage 3: replaces the unit's non-resident parameters in the model with empty
    /// tensors. A fetch in flight is completed first (and its values dropped), so no
    /// collective is left behind.
    pub fn release<M: Module>(&mut self, model: M, shared: &Shared) -> M {
        if let Presence::Fetching(pending) = std::mem::replace(&mut self.presence, Presence::Released) {
            // The result is not needed; an error here resurfaces at the next collective.
            let _ = pending.wait();
        }
        write_params(model, &shared.index, &shared.sharding, self.id, Fill::Release(&self.resident), &shared.device)
    }

    /// Starts (or, as `options` say, accumulates) the reduction of the unit's gradients of
    /// one backward pass. Returns the transient bytes it used.
    pub fn reduce(
        &mut self,
        grads: UnitGrads,
        shared: &Shared,
        options: ReduceOptions,
        times: &mut PhaseTimes,
    ) -> Result<u64> {
        self.grad.reduce(grads, shared.layout(self.id), shared.comm.as_ref(), options, times)
    }

    /// Waits for every reduction of the unit still in flight.
    pub fn settle(&mut self, times: &mut PhaseTimes) -> Result<()> {
        self.grad.settle(times)
    }

    /// At the step: the unit's reduced gradient over its optimizer range, in f32 (unscaled,
    /// not averaged). Resets the accumulator.
    pub fn take_reduced(&mut self, times: &mut PhaseTimes) -> Result<Vec<f32>> {
        self.grad.take_reduced(times)
    }

    /// Steps the optimizer over the unit's range with the final gradients `grads` at `lr`
    /// and puts the new values where the stage keeps parameters (stage 1-2: all-gathered
    /// into the model). Returns the transient bytes it used.
    pub fn step<M: Module>(
        &mut self,
        model: M,
        lr: f64,
        grads: Vec<f32>,
        shared: &Shared,
        times: &mut PhaseTimes,
    ) -> Result<(M, u64)> {
        let range = shared.optimizer_range(self.id);
        let start = Instant::now();
        let values = match &mut self.master {
            Master::InModel => Values::Host(self.values(&model, shared)?),
            Master::Held(held) => held.take().filter(|v| v.len() == range.len()).ok_or_else(lost)?,
        };
        let values = values.into_tensor(&shared.state_device());
        let mut transient = (2 * range.len() * size_of::<f32>()) as u64;
        let updated = Values::from_tensor(self.optimizer.step(lr, values, grads)?, shared.on_cpu())?;
        times.optimizer += start.elapsed().as_secs_f64();
        let start = Instant::now();
        let (model, published) = if matches!(self.master, Master::InModel) {
            // The model's parameters are the masters: the new values go there, moved, not
            // copied (f32 in, f32 out).
            self.publish(model, || updated.into_host(Precision::Fp32), shared, times)?
        } else {
            let dtype = shared.dtype();
            let published = self.publish(model, || updated.to_host(dtype), shared, times)?;
            self.master = Master::Held(Some(updated));
            published
        };
        transient += published;
        times.gather += start.elapsed().as_secs_f64();
        Ok((model, transient))
    }

    /// Puts new values of the unit's optimizer range into the model, as the stage keeps
    /// parameters: all of them at stage 0, all-gathered in the compute dtype at stages 1-2,
    /// nowhere at stage 3 (gathered at the next use). `values` gives them in the compute
    /// dtype, on the host. Returns the transient bytes it used.
    pub fn publish<M: Module>(
        &mut self,
        model: M,
        values: impl FnOnce() -> Result<FlatBuf>,
        shared: &Shared,
        times: &mut PhaseTimes,
    ) -> Result<(M, u64)> {
        let stage = shared.stage();
        if stage.shards_parameters() {
            // A gather between the last backward and this step holds the pre-step
            // weights; release them, or the next forward would silently use them.
            let model = if self.is_gathered() || self.is_fetching() { self.release(model, shared) } else { model };
            return Ok((model, 0));
        }
        let (dtype, layout) = (shared.dtype(), shared.layout(self.id));
        let converted = values()?;
        let full = if stage == ZeroStage::Disabled {
            converted
        } else {
            let request = Request::AllGather { input: converted, output: FlatBuf::zeros(dtype, layout.padded_elems()) };
            finish(shared.comm.start(request), times)?.output
        };
        let bytes = full.bytes();
        let model = write_params(model, &shared.index, &shared.sharding, self.id, Fill::Take(full), &shared.device);
        Ok((model, bytes))
    }

    /// The master values of the optimizer range, leaving them in place.
    pub fn values<M: Module>(&self, model: &M, shared: &Shared) -> Result<Vec<f32>> {
        let range = shared.optimizer_range(self.id);
        match &self.master {
            Master::InModel => {
                let mut values = vec![0.0; range.len()];
                let (index, sharding) = (&shared.index, &shared.sharding);
                read_params(model, index, sharding, self.id, range, BufMut::F32(&mut values))?;
                Ok(values)
            }
            Master::Held(_) => self.held(range.len())?.to_vec(),
        }
    }

    /// Replaces the master values of the optimizer range (a checkpoint load) and puts them
    /// where the stage keeps parameters.
    pub fn load<M: Module>(&mut self, model: M, values: Vec<f32>, shared: &Shared) -> Result<M> {
        let values = Values::new(values, shared.on_cpu(), &shared.state_device());
        let (model, _) = self.publish(model, || values.to_host(shared.dtype()), shared, &mut PhaseTimes::default())?;
        if let Master::Held(held) = &mut self.master {
            *held = Some(values);
        }
        Ok(model)
    }

    /// The held fp32 values, checked to have `len` elements (see [`lost`]).
    fn held(&self, len: usize) -> Result<&Values> {
        match &self.master {
            Master::Held(Some(held)) if held.len() == len => Ok(held),
            Master::Held(_) => Err(lost()),
            Master::InModel => unreachable!("stage 3 and mixed precision hold their masters"),
        }
    }

    /// The unit's optimizers.
    pub fn optimizer(&self) -> &UnitOptimizer {
        &self.optimizer
    }

    /// The unit's optimizers, to import state into (or, in tests, to replace).
    pub fn optimizer_mut(&mut self) -> &mut UnitOptimizer {
        &mut self.optimizer
    }

    /// Bytes of fp32 master values held (not counting parameters in the model).
    pub fn master_bytes(&self) -> u64 {
        match &self.master {
            Master::InModel => 0,
            Master::Held(held) => held.as_ref().map_or(0, |v| (v.len() * size_of::<f32>()) as u64),
        }
    }

    /// Bytes of the gradient accumulator.
    pub fn grad_bytes(&self) -> u64 {
        self.grad.bytes()
    }

    /// Elements of the unit's resident (persistent) parameters at stage 3.
    pub fn resident_elems(&self, shared: &Shared) -> u64 {
        let entries = shared.layout(self.id).entries();
        entries.iter().zip(&self.resident).filter(|(_, r)| **r).map(|(e, _)| e.num_elems as u64).sum()
    }
}
