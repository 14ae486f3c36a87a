//! Where a unit's states live between uses: its fp32 master weights and optimizer state
//! ([`Home`]) and, at stage 3, its parameter shard ([`ParamShard`]). The offload tiers are
//! variants here; the unit lifecycle (`unit/`) asks them for values and hands them new
//! ones, and never branches on the config.
//!
//! # Note: lost master weights
//! A resident step moves the only fp32 copy of a range into the optimizer; if the step
//! fails, nothing puts it back. The unit then holds no master tensor, and every later use
//! is [`lost`], never a panic or a checkpoint of empty values. Loading a checkpoint puts
//! new values in and heals it. (A swapped step reads from and writes to its files, so a
//! failure leaves the last written values there.)

pub(crate) mod nvme;

use zerotrain_precision::{BufMut, BufRef, FlatBuf};

pub(crate) use self::nvme::{FirstMasters, NvmeOptimizer, NvmeOptimizerSetup};
use super::master::Values;
use super::optimizer::{ExportedState, StateLayout, UnitOptimizer};
use super::shared::Shared;
use crate::swap::{SwapFile, pack, pack_f32, unpack, wait, words};
use crate::{Error, Result};

/// The error of every use of lost master weights (module note).
pub(crate) fn lost() -> Error {
    Error::Usage(
        "this rank's master weights are gone (an optimizer step failed part-way); load a checkpoint to go on".into(),
    )
}

/// Where a unit's fp32 master weights are, when they are not swapped.
#[expect(clippy::large_enum_variant, reason = "one per unit, never moved in a hot loop")]
pub(crate) enum Master {
    /// fp32 training, stages 0-2: the model's parameters are the master weights; the
    /// optimizer steps a transient copy of the range.
    InModel,
    /// The fp32 values of the optimizer range, where the rank keeps states (`None`: lost):
    /// mixed precision at stages 0-2 (the model holds compute-dtype copies), and stage 3,
    /// where they are the only persistent copy.
    Held(Option<Values>),
}

/// Where a unit's optimizer state (and master weights) live.
#[expect(clippy::large_enum_variant, reason = "one per unit, never moved in a hot loop")]
pub(crate) enum Home {
    /// In memory: on the rank's device, or in host memory (`offload_optimizer: cpu`).
    Resident {
        /// The master weights.
        master: Master,
        /// The optimizer, holding its state.
        optimizer: UnitOptimizer,
    },
    /// In swap files, stepped tile by tile (`offload_optimizer: nvme`).
    Nvme(Box<NvmeOptimizer>),
}

impl Home {
    /// The optimizer state over the unit's range (checkpoints).
    pub fn export(&self) -> Result<ExportedState> {
        match self {
            Self::Resident { optimizer, .. } => optimizer.export(),
            Self::Nvme(swapped) => swapped.export(),
        }
    }

    /// The names of the optimizer state's tensors and its scalars (without reading a
    /// swapped state's values).
    pub fn state_layout(&self) -> Result<StateLayout> {
        match self {
            Self::Resident { optimizer, .. } => {
                let (tensors, scalars) = optimizer.export()?;
                Ok((tensors.into_iter().map(|(n, _)| n).collect(), scalars))
            }
            Self::Nvme(swapped) => Ok((swapped.state_names(), swapped.scalars().to_vec())),
        }
    }

    /// One optimizer state tensor over the unit's range (checkpoints stream them one at a
    /// time): a swapped state reads that tensor's file alone.
    pub fn state_tensor(&self, name: &str) -> Result<Option<Vec<f32>>> {
        match self {
            Self::Resident { optimizer, .. } => {
                Ok(optimizer.export()?.0.into_iter().find(|(n, _)| n == name).map(|(_, v)| v))
            }
            Self::Nvme(swapped) => swapped.state_tensor(name),
        }
    }

    /// Replaces the optimizer state (a checkpoint load).
    pub fn import(&mut self, state: ExportedState, device: &burn::tensor::Device) -> Result<()> {
        match self {
            Self::Resident { optimizer, .. } => optimizer.import(state, device),
            Self::Nvme(swapped) => swapped.import(state),
        }
    }

    /// Bytes of optimizer state in memory.
    pub fn state_bytes(&self) -> u64 {
        match self {
            Self::Resident { optimizer, .. } => optimizer.state_bytes(),
            Self::Nvme(_) => 0,
        }
    }

    /// Bytes of separately held master weights in memory.
    pub fn master_bytes(&self) -> u64 {
        match self {
            Self::Resident { master: Master::Held(Some(v)), .. } => (v.len() * size_of::<f32>()) as u64,
            _ => 0,
        }
    }

    /// Bytes in swap files.
    pub fn swapped_bytes(&self) -> u64 {
        match self {
            Self::Resident { .. } => 0,
            Self::Nvme(swapped) => swapped.swapped_bytes(),
        }
    }
}

/// Stage 3: where a unit's parameter shard (what its all-gather sends) lives.
pub(crate) enum ParamShard {
    /// Cast from the held master weights at each gather (no offload; below stage 3 the
    /// model holds the parameters and this is unused).
    FromMaster,
    /// A compute-dtype copy in memory: the masters are swapped, or the unit is among the
    /// first `max_in_cpu` elements of an NVMe parameter tier.
    Memory(FlatBuf),
    /// In a swap file (`offload_param: nvme`), read at each gather, in the compute dtype's
    /// own bytes (half types two to a word: `swap::pack`).
    Nvme(SwapFile),
}

impl ParamShard {
    /// Stage 3: where unit `id`'s parameter shard (`values`, in f32 or the compute dtype)
    /// lives: in a swap file with
    /// `offload_param: nvme` (unless the unit is among the first `max_in_cpu` elements), in
    /// memory when the masters are swapped, and cast from the masters otherwise.
    pub fn for_unit(id: usize, values: BufRef<'_>, home: &Home, shared: &Shared) -> Result<Self> {
        let compute = || converted_on_every_core(shared.dtype(), values);
        let cached_before: u64 = (0..id).map(|u| shared.layout(u).shard_len() as u64).sum();
        let in_cpu = cached_before + values.len() as u64 <= shared.plan.zero.offload.max_in_cpu;
        match (&shared.swaps.param, home) {
            (Some(dir), _) if !in_cpu => {
                let file = dir.file(&format!("u{id}.param"), words(shared.dtype(), values.len()))?;
                let packed = match values {
                    BufRef::F32(values) => pack_f32(shared.dtype(), values),
                    compute => pack(compute),
                };
                wait(file.write(0, packed)?)?;
                Ok(ParamShard::Nvme(file))
            }
            (Some(_), _) | (None, Home::Nvme(_)) => Ok(ParamShard::Memory(compute())),
            (None, Home::Resident { .. }) => Ok(ParamShard::FromMaster),
        }
    }

    /// The shard's values in the compute dtype of `dtype`'s kind; `master` gives them
    /// for [`FromMaster`](Self::FromMaster).
    pub fn values(
        &self,
        len: usize,
        dtype: zerotrain_precision::Precision,
        master: impl FnOnce() -> Result<FlatBuf>,
    ) -> Result<FlatBuf> {
        match self {
            Self::FromMaster => master(),
            Self::Memory(values) => Ok(values.clone()),
            Self::Nvme(file) => Ok(unpack(wait(file.read(0..words(dtype, len))?)?.as_slice(), dtype, len)),
        }
    }

    /// Whether the shard is a copy of its own, apart from the master weights (which a step
    /// must then [`store`](Self::store) its new values into).
    pub fn is_kept_apart(&self) -> bool {
        !matches!(self, Self::FromMaster)
    }

    /// Replaces the shard's values (after a step or a load). `FromMaster` keeps nothing.
    pub fn store(&mut self, values: FlatBuf) -> Result<()> {
        match self {
            Self::FromMaster => Ok(()),
            Self::Memory(held) => {
                *held = values;
                Ok(())
            }
            Self::Nvme(file) => wait(file.write(0, pack(values.as_ref()))?).map(drop),
        }
    }

    /// Bytes in memory.
    pub fn memory_bytes(&self) -> u64 {
        match self {
            Self::Memory(values) => values.bytes(),
            _ => 0,
        }
    }

    /// Bytes in the swap file.
    pub fn swapped_bytes(&self, len: usize, dtype: zerotrain_precision::Precision) -> u64 {
        match self {
            Self::Nvme(_) => (words(dtype, len) * size_of::<f32>()) as u64,
            _ => 0,
        }
    }
}

/// `values` in `dtype` (what `BufMut::copy_from` gives), on every core of rayon's pool: a
/// unit's shard kept in memory is hundreds of megabytes of fresh pages, and touching them
/// first costs more than converting (two thirds of an import's time per unit, measured, on
/// one thread). The buffer comes from the system untouched, and each page is written once,
/// by the conversion. (Not huge pages: measured, they halve the time when the kernel has
/// free 2 MiB blocks at hand and multiply it by 2-3 when it must compact memory to find
/// them, as after another process's run; 4 KiB pages cost the same every time.)
fn converted_on_every_core(dtype: zerotrain_precision::Precision, values: BufRef<'_>) -> FlatBuf {
    use rayon::prelude::*;
    use zerotrain_precision::FlatElem;
    /// Elements one task converts.
    const CHUNK: usize = 1 << 16;
    fn convert<E: FlatElem + Send>(values: BufRef<'_>, out: &mut [E])
    where
        for<'a> BufMut<'a>: From<&'a mut [E]>,
    {
        out.par_chunks_mut(CHUNK).enumerate().for_each(|(i, out)| {
            let at = i * CHUNK..i * CHUNK + out.len();
            BufMut::from(out).copy_from(values.slice(at), false);
        });
    }
    let mut buf = FlatBuf::zeros(dtype, values.len());
    match &mut buf {
        FlatBuf::F32(out) => convert(values, out),
        FlatBuf::F16(out) => convert(values, out),
        FlatBuf::Bf16(out) => convert(values, out),
    }
    buf
}
