//! One unit's frozen parameters at stage 3: this rank's shard where `offload_param` puts
//! it, gathered into the model with the unit and released with it. A quantised unit's
//! shard is of its stored words (`quantized.rs`), decoded after the gather.

use std::time::Instant;

use burn::module::Module;
use burn::tensor::Tensor;
use zerotrain_precision::{FlatBuf, Precision};
use zerotrain_zero::{DeviceOp, Pending, Request};

use super::FrozenLayout;
use super::quantized::QuantizedUnit;
use crate::Result;
use crate::engine::flat::{tensor, tensor_bytes};
use crate::engine::model::InitialValues;
use crate::engine::params::{Fill, Lazy, read_params, write_params, write_unit};
use crate::engine::report::PhaseTimes;
use crate::engine::shared::Shared;
use crate::swap::{SwapFile, Ticket, pack, unpack, wait, words};

/// Where this rank's shard of a unit's frozen parameters lives (in the compute dtype, or
/// the words of a quantised unit, which live in host memory or a swap file).
enum Home {
    /// In host memory (a CPU rank's, or a GPU rank's whose collective reads host memory).
    Memory(FlatBuf),
    /// On the device, all-gathered there (the step stays on the device: `Shared::device_step`).
    Device(Box<Tensor<1>>),
    /// In a swap file (`offload_param: nvme`, beyond `max_in_cpu`), read at each gather.
    Nvme(SwapFile),
}

/// Where the unit's frozen parameters are now.
enum Flight {
    /// Only the shard (and the resident tensors) exist.
    Released,
    /// The shard is being read from its swap file.
    Reading(Ticket),
    /// The all-gather is in flight.
    Fetching(Pending),
    /// In the model.
    Gathered,
}

/// One unit's frozen parameters (module docs).
pub(crate) struct FrozenPart {
    unit: usize,
    home: Home,
    flight: Flight,
}

impl FrozenPart {
    /// Unit `id`'s frozen parameters from the model's values (still-lazy ones from
    /// `initial`): read by the group's first rank, broadcast, the resident ones written into
    /// the model (the others released), this rank's shard kept where the plan's tiers say.
    /// `None` for a unit without frozen parameters.
    pub fn new<M: Module>(
        id: usize,
        model: M,
        shared: &Shared,
        initial: Option<&dyn InitialValues>,
    ) -> Result<(M, Option<Self>)> {
        let Some(frozen) = shared.frozen.as_ref().filter(|f| f.layout(id).num_elems() > 0) else {
            return Ok((model, None));
        };
        let (layout, dtype) = (frozen.layout(id), shared.dtype());
        let real = layout.num_elems();
        let mut values = FlatBuf::zeros(dtype, layout.padded_elems());
        if shared.comm.rank() == 0 {
            if let Some(initial) = initial {
                // The next unit's tensors are asked for ahead (the first unit's own too).
                let units = frozen.sharding.units();
                let ahead = &units[if id == 0 { 0 } else { id + 1 }.min(units.len())..(id + 2).min(units.len())];
                ahead.iter().flat_map(|u| u.layout.entries()).for_each(|e| initial.prefetch(&e.path));
            }
            let lazy = Lazy { values: initial, seed: shared.plan.runtime.seed };
            let dst = values.as_mut().slice(0..real);
            read_params(&model, &frozen.index, &frozen.sharding, id, 0..real, dst, Some(lazy))?;
        }
        shared.comm.broadcast(values.as_mut(), 0)?;
        let fill = Fill::Resident { values: values.as_ref(), keep: &frozen.resident[id], dtype };
        let model = write_params(model, &frozen.index, &frozen.sharding, id, fill, &shared.device);
        let rank = shared.comm.rank();
        // Every rank encodes the same values alike, so each keeps its slice of the same words.
        let shard = match &frozen.quantized[id] {
            Some(unit) => {
                FlatBuf::from_buf(Precision::Fp32, unit.encode(values.as_ref()).as_ref().slice(unit.shard_range(rank)))
            }
            None => FlatBuf::from_buf(dtype, values.as_ref().slice(layout.shard_range(rank))),
        };
        let home = home(id, shard, frozen, shared)?;
        Ok((model, Some(Self { unit: id, home, flight: Flight::Released })))
    }

    /// Starts fetching the frozen parameters (a prefetch): the shard's read from its swap
    /// file, or its all-gather. Nothing to do when gathered or in flight, or for a shard on
    /// the device, which [`gather`](Self::gather) all-gathers there.
    pub fn fetch(&mut self, shared: &Shared) -> Result<()> {
        if !matches!(self.flight, Flight::Released) {
            return Ok(());
        }
        match &self.home {
            Home::Nvme(file) => {
                self.flight = Flight::Reading(file.read(0..words(self.stored_dtype(shared), self.shard_len(shared)))?)
            }
            Home::Memory(values) => self.start(values.clone(), shared),
            Home::Device(_) => {}
        }
        Ok(())
    }

    fn start(&mut self, input: FlatBuf, shared: &Shared) {
        let padded = match self.quantized(shared) {
            Some(unit) => unit.padded_words(),
            None => self.layout(shared).0.padded_elems(),
        };
        let output = FlatBuf::zeros(self.stored_dtype(shared), padded);
        self.flight = Flight::Fetching(shared.comm.start(Request::AllGather { input, output }));
    }

    fn quantized<'a>(&self, shared: &'a Shared) -> Option<&'a QuantizedUnit> {
        self.layout(shared).1.quantized[self.unit].as_ref()
    }

    /// The element type of the shard: the compute dtype's, or words (f32 bits) quantised.
    fn stored_dtype(&self, shared: &Shared) -> Precision {
        if self.quantized(shared).is_some() { Precision::Fp32 } else { shared.dtype() }
    }

    fn layout<'a>(&self, shared: &'a Shared) -> (&'a zerotrain_zero::FlatLayout, &'a FrozenLayout) {
        let frozen = shared.frozen.as_ref().expect("a frozen part exists only with a frozen layout");
        (frozen.layout(self.unit), frozen)
    }

    /// Elements of the shard (words, quantised).
    fn shard_len(&self, shared: &Shared) -> usize {
        match self.quantized(shared) {
            Some(unit) => unit.shard_words(),
            None => self.layout(shared).0.shard_len(),
        }
    }

    /// Makes the frozen parameters present in the model (fetching them unless a prefetch
    /// did). Returns the model and the bytes of the gathered buffer; `times` gets the waits.
    pub fn gather<M: Module>(&mut self, model: M, shared: &Shared, times: &mut PhaseTimes) -> Result<(M, u64)> {
        let (_, frozen) = self.layout(shared);
        if let Home::Device(shard) = &self.home {
            if matches!(self.flight, Flight::Gathered) {
                return Ok((model, 0));
            }
            let whole = match shared.comm.world_size() > 1 {
                true => shared.on_device(DeviceOp::AllGather, shard)?,
                false => (**shard).clone(),
            };
            let bytes = tensor_bytes(&whole);
            self.flight = Flight::Gathered;
            return Ok((write_unit(model, &frozen.index, &frozen.sharding, self.unit, whole), bytes));
        }
        self.fetch(shared)?;
        if let Flight::Reading(_) = &self.flight {
            let Flight::Reading(ticket) = std::mem::replace(&mut self.flight, Flight::Released) else {
                unreachable!("matched above")
            };
            let start = Instant::now();
            let read = wait(ticket);
            times.comm_wait += start.elapsed().as_secs_f64();
            self.start(unpack(read?.as_slice(), self.stored_dtype(shared), self.shard_len(shared)), shared);
        }
        let Flight::Fetching(pending) = std::mem::replace(&mut self.flight, Flight::Gathered) else {
            return Ok((model, 0));
        };
        let mut gathered = times.wait_for(pending)?.output;
        let mut bytes = gathered.bytes();
        shared.crossed(true, bytes);
        if let (Some(unit), FlatBuf::F32(words)) = (self.quantized(shared), &gathered) {
            gathered = unit.decode(words, self.layout(shared).0.padded_elems());
            bytes += gathered.bytes();
        }
        let model =
            write_params(model, &frozen.index, &frozen.sharding, self.unit, Fill::Take(gathered), &shared.device);
        Ok((model, bytes))
    }

    /// Replaces the non-resident frozen parameters in the model with empty tensors, first
    /// completing a fetch in flight (its values dropped), so no collective is left behind.
    pub fn release<M: Module>(&mut self, model: M, shared: &Shared) -> M {
        match std::mem::replace(&mut self.flight, Flight::Released) {
            // An error here resurfaces at the next collective, or the next read of the file.
            Flight::Fetching(pending) => drop(pending.wait()),
            Flight::Reading(ticket) => drop(ticket.wait()),
            Flight::Released | Flight::Gathered => {}
        }
        let (_, frozen) = self.layout(shared);
        let fill = Fill::Release(&frozen.resident[self.unit]);
        write_params(model, &frozen.index, &frozen.sharding, self.unit, fill, &shared.device)
    }

    /// `into` with the unit's frozen parameters as `from` holds them (gathered): the
    /// whole model an export gathers.
    pub fn copy_gathered<M: Module>(&self, from: &M, into: M, shared: &Shared) -> Result<M> {
        let (layout, frozen) = self.layout(shared);
        let n = layout.num_elems();
        let mut values = FlatBuf::zeros(shared.dtype(), n);
        read_params(from, &frozen.index, &frozen.sharding, self.unit, 0..n, values.as_mut(), None)?;
        Ok(write_params(into, &frozen.index, &frozen.sharding, self.unit, Fill::Take(values), &shared.device))
    }

    /// Elements of the gathered buffer (padded).
    pub fn padded_elems(&self, shared: &Shared) -> u64 {
        self.layout(shared).0.padded_elems() as u64
    }

    /// Bytes of the shard in memory (the host's or the device's).
    pub fn memory_bytes(&self) -> u64 {
        match &self.home {
            Home::Memory(values) => values.bytes(),
            Home::Device(shard) => tensor_bytes(shard),
            Home::Nvme(_) => 0,
        }
    }

    /// Bytes in the swap file.
    pub fn swapped_bytes(&self, shared: &Shared) -> u64 {
        match &self.home {
            Home::Nvme(_) => (words(self.stored_dtype(shared), self.shard_len(shared)) * size_of::<f32>()) as u64,
            _ => 0,
        }
    }
}

/// Where unit `id`'s frozen `shard` lives: in a swap file with `offload_param: nvme`
/// unless `max_in_cpu` still has room for it (after every trained shard and the frozen
/// shards of the units before), on the device where the step stays there, else in host
/// memory.
fn home(id: usize, shard: FlatBuf, frozen: &FrozenLayout, shared: &Shared) -> Result<Home> {
    let units = shared.sharding.units().len();
    let trained: u64 = (0..units).map(|u| shared.layout(u).shard_len() as u64).sum();
    let before: u64 = (0..id).map(|u| frozen.layout(u).shard_len() as u64).sum();
    let own = frozen.layout(id).shard_len() as u64;
    let in_cpu = trained + before + own <= shared.plan.zero.offload.max_in_cpu;
    Ok(match &shared.swaps.param {
        Some(dir) if !in_cpu => {
            let file = dir.file(&format!("u{id}.frozen"), words(shard.dtype(), shard.len()))?;
            wait(file.write(0, pack(shard.as_ref()))?)?;
            Home::Nvme(file)
        }
        // Words are decoded on the host after their gather.
        _ if shared.device_step && frozen.quantized[id].is_none() => {
            Home::Device(Box::new(tensor(shard, &shared.state_device())))
        }
        _ => Home::Memory(shard),
    })
}
