//! Where a rank keeps the fp32 values the optimizer steps (the master weights), by what
//! the stage shards and whether the model computes in fp32.

use burn::module::Module;
use zerotrain_precision::{BufMut, Precision};
use zerotrain_zero::{Collective, FlatLayout, ZeroStage};

use super::params::{ParamIndex, read_params};
use super::stage3::Partition;
use crate::{Error, Result};

/// Note: lost master weights. [`take`](ParamStore::take) moves the only fp32 copy
/// (mixed precision, stage 3) into the optimizer; if the step fails, nothing puts it back.
/// The store then holds an empty vector where its range has elements, and every later read
/// is this error, never a panic or a checkpoint of empty values. Loading a checkpoint puts
/// new values in and heals it.
fn lost() -> Error {
    Error::Usage(
        "this rank's master weights are gone (an optimizer step failed part-way); load a checkpoint to go on".into(),
    )
}

/// The master weights of a rank's optimizer range.
pub(crate) enum ParamStore {
    /// fp32 training, stages 0-2: the model's parameters are the master weights; the
    /// optimizer steps a transient copy of the range.
    InModel,
    /// Mixed precision, stages 0-2: fp32 master weights of the range; the model holds
    /// compute-dtype copies.
    Master(Vec<f32>),
    /// Stage 3: the fp32 shard, the only persistent copy; the model is gathered on demand.
    Partitioned(Partition),
}

impl ParamStore {
    /// The store for `stage` and `precision`, from the full flat fp32 parameters `full`.
    pub fn new(
        stage: ZeroStage,
        precision: Precision,
        layout: &FlatLayout,
        rank: usize,
        full: &[f32],
        persistence_threshold: u64,
    ) -> Self {
        match (stage, precision) {
            (ZeroStage::Parameters, _) => Self::Partitioned(Partition::new(layout, rank, full, persistence_threshold)),
            (_, Precision::Fp32) => Self::InModel,
            (ZeroStage::Disabled, _) => Self::Master(full[..layout.num_elems()].to_vec()),
            _ => Self::Master(full[layout.shard_range(rank)].to_vec()),
        }
    }

    /// Moves the master values of `range` out for the optimizer ([`put`](Self::put) returns
    /// them); for [`ParamStore::InModel`] they are read from the model.
    pub fn take<M: Module>(
        &mut self,
        model: &M,
        index: &ParamIndex,
        layout: &FlatLayout,
        range: std::ops::Range<usize>,
    ) -> Result<Vec<f32>> {
        self.check(range.len())?;
        match self {
            Self::InModel => self.values(model, index, layout, range),
            Self::Master(master) => Ok(std::mem::take(master)),
            Self::Partitioned(partition) => Ok(partition.take_shard()),
        }
    }

    /// Whether the values of a range of `len` elements are here (see [`lost`]).
    fn check(&self, len: usize) -> Result<()> {
        let held = match self {
            Self::InModel => return Ok(()),
            Self::Master(master) => master.len(),
            Self::Partitioned(partition) => partition.shard().len(),
        };
        if held == len { Ok(()) } else { Err(lost()) }
    }

    /// A copy of the master values of `range` (the optimizer's range), leaving them in place.
    pub fn values<M: Module>(
        &self,
        model: &M,
        index: &ParamIndex,
        layout: &FlatLayout,
        range: std::ops::Range<usize>,
    ) -> Result<Vec<f32>> {
        self.check(range.len())?;
        match self {
            Self::InModel => {
                let mut values = vec![0.0; range.len()];
                read_params(model, index, layout, range, BufMut::F32(&mut values))?;
                Ok(values)
            }
            Self::Master(master) => Ok(master.clone()),
            Self::Partitioned(partition) => Ok(partition.shard().to_vec()),
        }
    }

    /// Stores the updated master values (dropped for [`ParamStore::InModel`], whose model
    /// receives them instead).
    pub fn put(&mut self, values: Vec<f32>) {
        match self {
            Self::InModel => {}
            Self::Master(master) => *master = values,
            Self::Partitioned(partition) => partition.put_shard(values),
        }
    }

    /// The full flat fp32 master (`num_elems` long), gathered from every rank where it is
    /// sharded. Every rank must call it.
    pub fn gather<M: Module>(
        &self,
        model: &M,
        index: &ParamIndex,
        layout: &FlatLayout,
        comm: &dyn Collective,
    ) -> Result<Vec<f32>> {
        let shard = match self {
            Self::InModel => return self.values(model, index, layout, 0..layout.num_elems()),
            Self::Master(master) if master.len() == layout.num_elems() => return Ok(master.clone()),
            Self::Master(master) => master.as_slice(),
            Self::Partitioned(partition) => partition.shard(),
        };
        if shard.len() != layout.shard_len() {
            return Err(lost());
        }
        let mut full = vec![0.0; layout.padded_elems()];
        comm.all_gather(shard.into(), (&mut full).into())?;
        full.truncate(layout.num_elems());
        Ok(full)
    }

    /// The stage-3 partition, if any.
    pub fn partition(&mut self) -> Option<&mut Partition> {
        match self {
            Self::Partitioned(partition) => Some(partition),
            _ => None,
        }
    }

    /// Bytes of fp32 values held here.
    pub fn bytes(&self) -> u64 {
        match self {
            Self::InModel => 0,
            Self::Master(master) => (master.len() * size_of::<f32>()) as u64,
            Self::Partitioned(partition) => partition.shard_bytes(),
        }
    }
}
