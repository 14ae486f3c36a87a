//! Stage 3's parameter partition: between steps a rank keeps only its flat shard of the
//! parameters (plus small "persistent" ones); the whole model is gathered for the forward
//! and backward passes and released after backward.
//!
//! # Note: persistence
//! Parameters with at most `stage3_param_persistence_threshold` elements stay resident in
//! the model when the others are released (DeepSpeed's rule; they cost little memory). The
//! model is refreshed from all shards at each gather, so resident values are current from
//! the forward pass on; between `step()` and the next `forward()` they still hold the
//! previous step's values. [`super::Engine::full_model`] always returns current values.

use burn::module::Module;
use burn::tensor::Device;
use zerotrain_precision::Precision;
use zerotrain_zero::{Collective, FlatLayout};

use super::params::{Fill, ParamIndex, gather_params, write_params};
use crate::Result;

/// Where the model's parameters are.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Only the shard (and resident parameters) exist.
    Released,
    /// The model holds every parameter.
    Gathered,
}

/// A rank's parameter shard and the model's state.
pub(crate) struct Partition {
    shard: Vec<f32>,
    resident: Vec<bool>,
    state: State,
}

impl Partition {
    /// Takes this rank's shard of the full flat parameters `full`.
    pub fn new(layout: &FlatLayout, rank: usize, full: &[f32], persistence_threshold: u64) -> Self {
        let resident = layout.entries().iter().map(|e| e.num_elems as u64 <= persistence_threshold).collect();
        Self { shard: full[layout.shard_range(rank)].to_vec(), resident, state: State::Gathered }
    }

    /// Gathers every shard into the model in the compute dtype `dtype` (no-op if already
    /// gathered). Returns the model and the transient bytes used.
    pub fn gather<M: Module>(
        &mut self,
        model: M,
        index: &ParamIndex,
        layout: &FlatLayout,
        comm: &dyn Collective,
        target: (&Device, Precision),
    ) -> Result<(M, u64)> {
        if self.state == State::Gathered {
            return Ok((model, 0));
        }
        if self.shard.len() != layout.shard_len() {
            return Err(crate::Error::Usage(
                "this rank's parameter shard is gone (an optimizer step failed part-way); load a checkpoint to go on"
                    .into(),
            ));
        }
        let gathered = gather_params(model, index, layout, comm, &self.shard, target)?;
        self.state = State::Gathered;
        Ok(gathered)
    }

    /// Replaces every non-resident parameter of the model with an empty tensor.
    pub fn release<M: Module>(&mut self, model: M, index: &ParamIndex, layout: &FlatLayout, device: &Device) -> M {
        self.state = State::Released;
        write_params(model, index, layout, Fill::Release(&self.resident), device)
    }

    /// Whether only the shard (and resident parameters) exist now.
    pub fn is_released(&self) -> bool {
        self.state == State::Released
    }

    /// Moves the shard out for the optimizer; [`put_shard`](Self::put_shard) returns it.
    pub fn take_shard(&mut self) -> Vec<f32> {
        std::mem::take(&mut self.shard)
    }

    /// Stores the updated shard.
    pub fn put_shard(&mut self, shard: Vec<f32>) {
        self.shard = shard;
    }

    /// The fp32 shard.
    pub fn shard(&self) -> &[f32] {
        &self.shard
    }

    /// Bytes of the shard.
    pub fn shard_bytes(&self) -> u64 {
        (self.shard.len() * size_of::<f32>()) as u64
    }
}
