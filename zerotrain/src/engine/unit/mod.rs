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

use std::time::Instant;

use burn::module::Module;
use burn::tensor::Tensor;
use zerotrain_precision::{BufMut, BufRef, FlatBuf, Precision};
use zerotrain_zero::{DeviceOp, Pending, Request, ZeroStage};

use super::accumulation::{ReduceOptions, UnitGrad};
use super::flat::{Flat, float_dtype};
use super::frozen::FrozenPart;
use super::master::Values;
use super::model::InitialValues;
use super::optimizer::{OptimizerFactory, UnitOptimizer};
use super::params::{Fill, UnitGrads, read_params, write_params, write_unit};
use super::report::PhaseTimes;
use super::shared::Shared;
use super::tier::{FirstMasters, Home, Master, NvmeOptimizer, NvmeOptimizerSetup, ParamShard, lost};
use crate::swap::{Ticket, unpack, wait, words};

mod state;
mod step;
use crate::Result;

/// Where a unit's parameters are at stage 3 (at stages 0-2 they are always present).
#[derive(Debug)]
enum Presence {
    /// In the model.
    Gathered,
    /// Only the shard (and resident parameters) exist.
    Released,
    /// The shard is being read from its swap file (`offload_param: nvme`; a prefetch
    /// overlaps the read with the unit before); the all-gather starts when it has arrived.
    Reading(Ticket),
    /// An all-gather is in flight (a prefetch).
    Fetching(Pending),
}

/// One unit. See the module docs.
pub(crate) struct Unit {
    id: usize,
    home: Home,
    /// Stage 3: where the parameter shard lives (`FromMaster` below stage 3).
    shard: ParamShard,
    grad: UnitGrad,
    presence: Presence,
    /// Stage 3: which of the unit's parameters stay resident when it is released.
    resident: Vec<bool>,
    /// Stage 3: the unit's frozen parameters, which follow its gathers and releases.
    frozen: Option<FrozenPart>,
}

impl Unit {
    /// Unit `id`, starting from `values` (its whole flat buffer, identical on every rank, in
    /// fp32 or in the compute dtype): writes them into `model` in the compute dtype, keeps
    /// the masters and optimizer state where the plan's tiers say, and at stage 3 releases
    /// the unit, its frozen parameters sharded too (still-lazy ones read from `initial`).
    /// Returns the model.
    pub fn new<M: Module>(
        id: usize,
        values: BufRef<'_>,
        model: M,
        shared: &Shared,
        factory: &OptimizerFactory,
        initial: Option<&dyn InitialValues>,
    ) -> Result<(M, Self)> {
        let (plan, layout) = (&shared.plan, shared.layout(id));
        let stage = plan.zero.stage;
        let threshold = plan.zero.param_persistence_threshold;
        let resident: Vec<bool> = layout.entries().iter().map(|e| e.num_elems as u64 <= threshold).collect();
        // At stage 3 the unit starts released: only its resident parameters get values.
        let (fill, presence) = match stage.shards_parameters() {
            true => (Fill::Resident { values, keep: &resident, dtype: shared.dtype() }, Presence::Released),
            false => {
                let flat = FlatBuf::from_buf(shared.dtype(), values.slice(0..layout.num_elems()));
                (Fill::Take(flat), Presence::Gathered)
            }
        };
        let model = write_params(model, &shared.index, &shared.sharding, id, fill, &shared.device);
        let range = shared.optimizer_range(id);
        let segments = shared.optimizer_segments(id);
        let fp32 = shared.dtype() == Precision::Fp32;
        let home = match &shared.swaps.optimizer {
            Some(dir) => {
                let first = match values {
                    _ if fp32 => FirstMasters::Parameters,
                    BufRef::F32(values) if !holds_exactly(shared.dtype(), &values[range.clone()]) => {
                        FirstMasters::Values(&values[range.clone()])
                    }
                    // Values in the compute dtype are exact in it.
                    _ => FirstMasters::ParametersUntilStepped,
                };
                let with = NvmeOptimizerSetup { optim: &plan.optim, factory, offload: &plan.zero.offload, dir };
                let swapped = NvmeOptimizer::new(id, range.len(), &segments, first, &with)?;
                Home::Nvme(Box::new(swapped))
            }
            None => {
                let master = match (stage.shards_parameters(), fp32) {
                    (false, true) => Master::InModel,
                    _ => Master::Held(Some(Values::new(
                        values.slice(range.clone()).to_f32(),
                        shared.states_on_host(),
                        &shared.state_device(),
                    ))),
                };
                Home::Resident {
                    master,
                    optimizer: UnitOptimizer::new(
                        range.len(),
                        &segments,
                        &plan.optim,
                        factory,
                        shared.states_on_host(),
                    ),
                }
            }
        };
        let shard = if stage.shards_parameters() {
            ParamShard::for_unit(id, values.slice(range), &home, shared)?
        } else {
            ParamShard::FromMaster
        };
        let device = shared.device_step.then(|| shared.state_device());
        let grad = UnitGrad::new(stage, layout, plan.precision.grad_accum, shared.comm.rank(), device);
        let (model, frozen) = FrozenPart::new(id, model, shared, initial)?;
        Ok((model, Self { id, home, shard, grad, presence, resident, frozen }))
    }

    /// Elements the unit's gathered flat buffers hold (their padded sizes, the frozen
    /// parameters' too).
    pub fn gathered_elems(&self, shared: &Shared) -> u64 {
        let frozen = self.frozen.as_ref().map_or(0, |f| f.padded_elems(shared));
        shared.layout(self.id).padded_elems() as u64 + frozen
    }

    /// Whether the unit's parameters are in the model.
    pub fn is_gathered(&self) -> bool {
        matches!(self.presence, Presence::Gathered)
    }

    /// Whether a read or an all-gather of the unit is in flight.
    pub fn is_fetching(&self) -> bool {
        matches!(self.presence, Presence::Fetching(_) | Presence::Reading(_))
    }

    /// Stage 3: starts fetching the unit's parameters in the compute dtype (a prefetch,
    /// when the unit is not needed yet): the all-gather of its shard, or first the shard's
    /// read from its swap file. Nothing to do if it is gathered or already being fetched.
    pub fn fetch(&mut self, shared: &Shared) -> Result<()> {
        if let Some(frozen) = &mut self.frozen {
            frozen.fetch(shared)?;
        }
        // A device-resident step has nothing to fetch: the gather casts the masters there.
        if !matches!(self.presence, Presence::Released) || shared.device_step {
            return Ok(());
        }
        let len = shared.layout(self.id).shard_len();
        if let ParamShard::Nvme(file) = &self.shard {
            self.presence = Presence::Reading(file.read(0..words(shared.dtype(), len))?);
            return Ok(());
        }
        let input = self.shard.values(len, shared.dtype(), || read(self.held(len)?, shared.dtype(), shared))?;
        self.start_gather(input, shared);
        Ok(())
    }

    fn start_gather(&mut self, input: FlatBuf, shared: &Shared) {
        let output = FlatBuf::zeros(shared.dtype(), shared.layout(self.id).padded_elems());
        self.presence = Presence::Fetching(shared.comm.start(Request::AllGather { input, output }));
    }

    /// Makes the unit's parameters present in the model (stage 3: fetching them unless a
    /// prefetch already did, and writing them in). Returns the model and the transient
    /// bytes of the gathered buffer. `times` gets the wait; the caller times the whole.
    pub fn gather<M: Module>(&mut self, model: M, shared: &Shared, times: &mut PhaseTimes) -> Result<(M, u64)> {
        let (model, frozen) = match &mut self.frozen {
            Some(part) => part.gather(model, shared, times)?,
            None => (model, 0),
        };
        let (model, trained) = self.gather_trained(model, shared, times)?;
        Ok((model, trained + frozen))
    }

    fn gather_trained<M: Module>(&mut self, model: M, shared: &Shared, times: &mut PhaseTimes) -> Result<(M, u64)> {
        if shared.device_step && matches!(self.presence, Presence::Released) {
            let Values::Device(masters) = self.held(shared.optimizer_range(self.id).len())? else {
                unreachable!("a device-resident step holds its masters on the device")
            };
            let model = self.write_on_device(model, masters, shared)?;
            self.presence = Presence::Gathered;
            return Ok((model, shared.layout(self.id).padded_elems() as u64 * shared.dtype().bytes_per_elem() as u64));
        }
        self.fetch(shared)?;
        if let Presence::Reading(_) = &self.presence {
            let Presence::Reading(ticket) = std::mem::replace(&mut self.presence, Presence::Released) else {
                unreachable!("matched above")
            };
            let start = Instant::now();
            let read = wait(ticket);
            times.comm_wait += start.elapsed().as_secs_f64();
            let len = shared.layout(self.id).shard_len();
            self.start_gather(unpack(read?.as_slice(), shared.dtype(), len), shared);
        }
        let Presence::Fetching(pending) = std::mem::replace(&mut self.presence, Presence::Gathered) else {
            return Ok((model, 0));
        };
        let gathered = times.wait_for(pending)?.output;
        let bytes = gathered.bytes();
        shared.crossed(true, bytes);
        let model = write_params(model, &shared.index, &shared.sharding, self.id, Fill::Take(gathered), &shared.device);
        Ok((model, bytes))
    }

    /// Stage 3: replaces the unit's non-resident parameters in the model with empty
    /// tensors. A fetch in flight is completed first (and its values dropped), so no
    /// collective is left behind.
    pub fn release<M: Module>(&mut self, model: M, shared: &Shared) -> M {
        let model = match &mut self.frozen {
            Some(frozen) => frozen.release(model, shared),
            None => model,
        };
        match std::mem::replace(&mut self.presence, Presence::Released) {
            // The result is not needed; an error here resurfaces at the next collective.
            Presence::Fetching(pending) => drop(pending.wait()),
            // Likewise at the next read of the file.
            Presence::Reading(ticket) => drop(ticket.wait()),
            _ => {}
        }
        write_params(model, &shared.index, &shared.sharding, self.id, Fill::Release(&self.resident), &shared.device)
    }

    /// Puts new values of the unit's optimizer range, fp32 `values` on the device, where a
    /// device-resident step keeps parameters: into the model, cast to the compute dtype, at
    /// stages 0-2 (one rank: the range is the whole unit); nowhere at stage 3, where the
    /// next gather casts them from the masters (a gather since the last backward is
    /// released, as [`publish`](Self::publish) does).
    pub fn publish_on_device<M: Module>(&mut self, model: M, values: &Tensor<1>, shared: &Shared) -> Result<M> {
        if !shared.stage().shards_parameters() {
            return self.write_on_device(model, values, shared);
        }
        Ok(if self.is_gathered() || self.is_fetching() { self.release(model, shared) } else { model })
    }

    /// Writes fp32 `values` of the optimizer range (on the device) into the model's
    /// parameters of the unit, cast to the compute dtype: all of them at stage 0 or with
    /// one rank, else every rank's shard, all-gathered on the device in the compute dtype.
    fn write_on_device<M: Module>(&self, model: M, values: &Tensor<1>, shared: &Shared) -> Result<M> {
        let compute = values.clone().cast(float_dtype(shared.dtype()));
        let whole = match shared.comm.world_size() > 1 && shared.stage() != ZeroStage::Disabled {
            true => shared.on_device(DeviceOp::AllGather, &compute)?,
            false => compute,
        };
        Ok(write_unit(model, &shared.index, &shared.sharding, self.id, whole))
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
        self.grad.reduce(grads, shared.layout(self.id), shared, options, times)
    }

    /// Waits for every reduction of the unit still in flight.
    pub fn settle(&mut self, times: &mut PhaseTimes) -> Result<()> {
        self.grad.settle(times)
    }

    /// At the step: the unit's reduced gradient over its optimizer range (unscaled, not
    /// averaged), in its accumulation or communication dtype. Resets the accumulator.
    pub fn take_reduced(&mut self, times: &mut PhaseTimes) -> Result<Flat> {
        self.grad.take_reduced(times)
    }

    /// What [`take_reduced`](Self::take_reduced) would return now, where that is a tensor
    /// on the device already reduced: read without being taken.
    pub fn reduced_on_device(&self) -> Option<Tensor<1>> {
        self.grad.reduced_on_device()
    }

    /// Puts new values of the unit's optimizer range where the stage keeps parameters: all
    /// of them into the model at stage 0, all-gathered in the compute dtype at stages 1-2;
    /// at stage 3 into the parameter shard where it is kept apart from the masters (an
    /// offload tier), to be gathered at the next use. `values` gives them in the compute
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
            if self.shard.is_kept_apart() {
                self.shard.store(values()?)?;
            }
            return Ok((model, 0));
        }
        let (dtype, layout) = (shared.dtype(), shared.layout(self.id));
        let converted = values()?;
        let full = if stage == ZeroStage::Disabled {
            converted
        } else {
            let request = Request::AllGather { input: converted, output: FlatBuf::zeros(dtype, layout.padded_elems()) };
            times.wait_for(shared.comm.start(request))?.output
        };
        let bytes = full.bytes();
        shared.crossed(true, bytes);
        let model = write_params(model, &shared.index, &shared.sharding, self.id, Fill::Take(full), &shared.device);
        Ok((model, bytes))
    }

    /// The master values of the optimizer range, leaving them in place.
    pub fn values<M: Module>(&self, model: &M, shared: &Shared) -> Result<Vec<f32>> {
        let len = shared.optimizer_range(self.id).len();
        match &self.home {
            Home::Resident { master: Master::InModel, .. } => in_model(model, shared, self.id),
            Home::Resident { .. } => self.held(len)?.to_vec(),
            Home::Nvme(swapped) => match swapped.masters()? {
                Some(masters) => Ok(masters),
                None => Ok(self.given_masters(model, shared)?.expect("masters the swap does not hold")),
            },
        }
    }

    /// With swapped optimizer state, the masters when the swap does not hold them (fp32,
    /// or mixed precision before the first step: the note in `tier/nvme.rs`): the parameters,
    /// widened, from the model at stages 1-2, the shard at stage 3. `None` otherwise.
    fn given_masters<M: Module>(&self, model: &M, shared: &Shared) -> Result<Option<Vec<f32>>> {
        match &self.home {
            Home::Nvme(swapped) if !swapped.holds_masters() => {}
            _ => return Ok(None),
        }
        if !shared.stage().shards_parameters() {
            return in_model(model, shared, self.id).map(Some);
        }
        let len = shared.optimizer_range(self.id).len();
        let shard = self.shard.values(len, shared.dtype(), || unreachable!("a swapped home keeps its shard"))?;
        Ok(Some(shard.into_f32()))
    }

    /// Replaces the master values of the optimizer range (a checkpoint load) and puts them
    /// where the stage keeps parameters.
    pub fn load<M: Module>(&mut self, model: M, values: Vec<f32>, shared: &Shared) -> Result<M> {
        let dtype = shared.dtype();
        if let Home::Nvme(swapped) = &mut self.home {
            swapped.load_masters(&values)?;
        }
        let values = Values::new(values, shared.states_on_host(), &shared.state_device());
        let (model, _) = self.publish(model, || values.to_host(dtype), shared, &mut PhaseTimes::default())?;
        if let Home::Resident { master: master @ Master::Held(_), .. } = &mut self.home {
            *master = Master::Held(Some(values));
        }
        Ok(model)
    }

    /// The held fp32 values, checked to have `len` elements (see [`lost`]).
    fn held(&self, len: usize) -> Result<&Values> {
        match &self.home {
            Home::Resident { master: Master::Held(Some(held)), .. } if held.len() == len => Ok(held),
            Home::Resident { master: Master::Held(_), .. } => Err(lost()),
            _ => unreachable!("only a held master is read as held"),
        }
    }
}

/// The model's fp32 values of unit `id`'s optimizer range (fp32 stages 0-2, where the
/// parameters are the masters).
fn in_model<M: Module>(model: &M, shared: &Shared, id: usize) -> Result<Vec<f32>> {
    let range = shared.optimizer_range(id);
    let mut values = vec![0.0; range.len()];
    read_params(model, &shared.index, &shared.sharding, id, range, BufMut::F32(&mut values), None)?;
    shared.crossed(false, (values.len() * size_of::<f32>()) as u64);
    Ok(values)
}

/// `values` on the host in `dtype` (a collective's input), counting what leaves the device.
fn read(values: &Values, dtype: Precision, shared: &Shared) -> Result<FlatBuf> {
    let buf = values.to_host(dtype)?;
    if values.on_device() {
        shared.crossed(false, buf.bytes());
    }
    Ok(buf)
}

/// Whether `dtype` holds every one of `values` exactly, asked on every core of rayon's pool (a
/// unit's values at import are hundreds of megabytes).
fn holds_exactly(dtype: Precision, values: &[f32]) -> bool {
    use rayon::prelude::*;
    values.par_chunks(1 << 16).all(|chunk| dtype.holds_exactly(chunk))
}
