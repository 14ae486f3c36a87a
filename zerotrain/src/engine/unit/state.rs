//! A unit's state seen from outside its lifecycle: the optimizer state for checkpoints, and
//! the bytes each kind of state holds for memory reports.

use super::Unit;
use crate::Result;
use crate::engine::optimizer::ExportedState;
use crate::engine::shared::Shared;

impl Unit {
    /// The optimizer state over the unit's range (checkpoints).
    pub fn export_state(&self) -> Result<ExportedState> {
        self.home.export()
    }

    /// The names of the optimizer state's tensors and its scalars.
    pub fn state_layout(&self) -> Result<crate::engine::optimizer::StateLayout> {
        self.home.state_layout()
    }

    /// One optimizer state tensor over the unit's range.
    pub fn state_tensor(&self, name: &str) -> Result<Option<Vec<f32>>> {
        self.home.state_tensor(name)
    }

    /// Replaces the optimizer state (a checkpoint load).
    pub fn import_state(&mut self, state: ExportedState, shared: &Shared) -> Result<()> {
        self.home.import(state, &shared.state_device())
    }

    /// Replaces every optimizer (tests inject failures).
    #[cfg(test)]
    pub fn replace_optimizers(&mut self, make: impl Fn() -> Box<dyn crate::engine::optimizer::ShardOptimizer>) {
        if let crate::engine::tier::Home::Resident { optimizer, .. } = &mut self.home {
            optimizer.replace(make);
        }
    }

    /// Bytes of optimizer state in memory.
    pub fn state_bytes(&self) -> u64 {
        self.home.state_bytes()
    }

    /// Bytes of fp32 master values held (not counting parameters in the model).
    pub fn master_bytes(&self) -> u64 {
        self.home.master_bytes()
    }

    /// Bytes of the stage-3 parameter shard kept in memory apart from the masters.
    pub fn shard_bytes(&self) -> u64 {
        self.shard.memory_bytes()
    }

    /// Bytes in swap files (masters, optimizer state, parameter shard).
    pub fn swapped_bytes(&self, shared: &Shared) -> u64 {
        let frozen = self.frozen.as_ref().map_or(0, |f| f.swapped_bytes(shared));
        self.home.swapped_bytes()
            + self.shard.swapped_bytes(shared.layout(self.id).shard_len(), shared.dtype())
            + frozen
    }

    /// Bytes of the stage-3 shard of the unit's frozen parameters in memory.
    pub fn frozen_shard_bytes(&self) -> u64 {
        self.frozen.as_ref().map_or(0, super::FrozenPart::memory_bytes)
    }

    /// `into` with the unit's frozen parameters as `from` holds them, gathered (stage 3;
    /// below it, or without frozen parameters, `into` as it is).
    pub fn copy_frozen<M: burn::module::Module>(&self, from: &M, into: M, shared: &Shared) -> Result<M> {
        match &self.frozen {
            Some(frozen) => frozen.copy_gathered(from, into, shared),
            None => Ok(into),
        }
    }

    /// Bytes of the gradient accumulator.
    pub fn grad_bytes(&self) -> u64 {
        self.grad.bytes()
    }

    /// Elements of the unit's resident (persistent) parameters at stage 3.
    pub fn resident_elems(&self, shared: &Shared) -> u64 {
        let entries = shared.layout(self.id).entries();
        let trained: u64 =
            entries.iter().zip(&self.resident).filter(|(_, r)| **r).map(|(e, _)| e.num_elems as u64).sum();
        let frozen = match (&self.frozen, &shared.frozen) {
            (Some(_), Some(layout)) => layout.resident_elems(self.id),
            _ => 0,
        };
        trained + frozen
    }
}
