//! Stage 3's frozen parameters (a LoRA run's base): sharded over the ranks unit by unit
//! like the trained ones, gathered with their unit and released after it, and nothing
//! else: no gradient is computed for them, none is reduced, no optimizer state or master
//! weights exist, no checkpoint holds them.
//!
//! # Note: a second layout over the same units
//! The trained parameters' [`Sharding`] is what gradients, optimizer states and
//! checkpoints are laid out by; putting frozen tensors in it would give them all of that.
//! They get a sharding of their own instead ([`FrozenLayout`]): the same units, each with a
//! flat layout of its frozen tensors alone, padded and cut into one shard per rank, walked
//! through an index of frozen positions ([`ParamIndex::frozen`]) by the same `params`
//! walks, which write them back untracked. Each unit's [`FrozenPart`] keeps this rank's
//! shard where `offload_param` says (the device, host memory, or an NVMe swap file) and
//! follows the unit's gather and release. The persistence threshold applies as it does to
//! trained parameters: a frozen norm's weight stays in the model.
//!
//! Below stage 3 frozen parameters stay whole on every rank (DeepSpeed does the same),
//! as buffers that nothing changes (`engine/buffers.rs`).
//!
//! With `zerotrain.lora.quantize: "nf4"` (QLoRA) the linear layers' matrices
//! ([`UnitModel::quantizable_parameters`]) are stored in NF4 in the shards and tiers
//! ([`QuantizedUnit`]), dequantised to the compute dtype after each gather; embeddings, the
//! head, vectors (norms, biases) and resident tensors stay in the compute dtype, as QLoRA
//! keeps all but the linear layers. On a tensor-parallel mesh each rank quantises its part
//! of a matrix, which gives the whole matrix's NF4 values only where the cut falls on
//! block boundaries (`quantized::check_cut`); a cut that does not is refused.
//!
//! [`UnitModel::quantizable_parameters`]: crate::UnitModel::quantizable_parameters

mod nf4;
mod part;
mod quantized;

use zerotrain_zero::{FlatLayout, Sharding};

pub(crate) use self::part::FrozenPart;
use self::quantized::QuantizedUnit;
use super::buffers::Buffers;
use super::model::under;
use super::params::ParamIndex;
use super::parts::ALIGN_ELEMS;
use crate::config::Quantization;
use crate::nn::parallel::{ModelSplit, Split};
use crate::{Error, Result};

/// The units' frozen tensors, sharded (module note).
#[derive(Debug, Clone)]
pub(crate) struct FrozenLayout {
    /// The frozen tensors' visit positions.
    pub index: ParamIndex,
    /// Each unit's frozen tensors, sharded over the ranks the trained ones are.
    pub sharding: Sharding,
    /// For each unit, which of its frozen tensors stay in the model when it is released.
    pub resident: Vec<Vec<bool>>,
    /// For each unit, its storage where some of its tensors are quantised.
    pub quantized: Vec<Option<QuantizedUnit>>,
}

/// How the frozen tensors are held: the quantisation asked for, what it applies to (the
/// model's quantizable paths, else the matrices of the units of layers: those before the
/// root), the compute dtype, and the model's tensor-parallel split, if any.
pub(crate) struct Storage {
    pub quantize: Option<Quantization>,
    pub quantizable: Option<Vec<String>>,
    pub layer_units: usize,
    pub dtype: zerotrain_precision::Precision,
    pub split: Option<ModelSplit>,
}

impl Storage {
    /// Whether the frozen tensor `path` of shape `shape` in unit `unit`, not resident, is
    /// quantised; an error naming the key and the tensor where its tensor-parallel cut
    /// does not fall on the quantisation's blocks.
    fn quantizes(&self, unit: usize, path: &str, shape: &[usize]) -> Result<bool> {
        let Some(q) = self.quantize else { return Ok(false) };
        let named = match &self.quantizable {
            Some(paths) => paths.iter().any(|p| under(p, path)),
            None => unit < self.layer_units,
        };
        let (true, &[rows, cols]) = (named, shape) else { return Ok(false) };
        let (cut, tp) = match &self.split {
            Some(s) => (s.splits.get(path).copied().unwrap_or(Split::Whole), s.tensor.size()),
            None => (Split::Whole, 1),
        };
        quantized::check_cut(path, [rows, cols], cut, tp).map_err(|why| {
            Error::Usage(format!("zerotrain.lora.quantize \"{}\" on this tensor-parallel mesh: {why}", q.key()))
        })?;
        Ok(true)
    }
}

impl FrozenLayout {
    /// The layout of the frozen parameters `buffers` lists that one of the units `names`
    /// holds (marking them sharded there), over `world_size` ranks, tensors of at most
    /// `threshold` elements resident, stored as `storage` says; `floats` is the model's
    /// count of float tensors. `None` when no unit holds a frozen parameter.
    pub fn new(
        buffers: &mut Buffers,
        floats: usize,
        names: &[String],
        world_size: usize,
        threshold: u64,
        storage: Storage,
    ) -> Result<Option<Self>> {
        let entries = buffers.shard_frozen(names.len());
        if entries.is_empty() {
            return Ok(None);
        }
        let index = ParamIndex::frozen(floats, entries.iter().map(|e| e.position()));
        let unit_of: Vec<Option<usize>> = entries.iter().map(|e| e.unit).collect();
        let params = entries.into_iter().map(|e| (e.path, e.shape)).collect();
        let sharding = Sharding::new(params, &unit_of, names.to_vec(), world_size, ALIGN_ELEMS)?;
        let resident: Vec<Vec<bool>> = (sharding.units().iter())
            .map(|u| u.layout.entries().iter().map(|e| e.num_elems as u64 <= threshold).collect())
            .collect();
        let mut quantized = Vec::with_capacity(sharding.units().len());
        for (id, (unit, resident)) in sharding.units().iter().zip(&resident).enumerate() {
            let entries = unit.layout.entries().iter().zip(resident);
            let nf4 = entries
                .map(|(e, resident)| Ok(!resident && storage.quantizes(id, &e.path, &e.shape)?))
                .collect::<Result<Vec<bool>>>()?;
            quantized.push(QuantizedUnit::new(&unit.layout, &nf4, world_size, storage.dtype));
        }
        Ok(Some(Self { index, sharding, resident, quantized }))
    }

    /// Unit `unit`'s frozen layout.
    pub fn layout(&self, unit: usize) -> &FlatLayout {
        &self.sharding.units()[unit].layout
    }

    /// Elements of the frozen tensors of unit `unit` that stay resident.
    pub fn resident_elems(&self, unit: usize) -> u64 {
        let entries = self.layout(unit).entries().iter();
        entries.zip(&self.resident[unit]).filter(|(_, r)| **r).map(|(e, _)| e.num_elems as u64).sum()
    }
}
