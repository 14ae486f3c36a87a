//! The rank's own master weights, unit by unit: read ([`Engine::shard_masters`]) and
//! replaced ([`Engine::load_shard_masters`]). Replica groups average these between groups;
//! the ranks holding the same shard in every group exchange them and nothing else.

use burn::module::Module;

use super::Engine;
use crate::{Error, Result};

impl<M: Module> Engine<M> {
    /// The fp32 master weights this rank's optimizer steps, one vector per unit: the
    /// unit's optimizer range (its whole flat buffer at stage 0, the rank's padded shard at
    /// stages 1-3; `sharding()` says which elements). The same units and lengths on every
    /// rank at the same place in a group of the same size and stage.
    pub fn shard_masters(&self) -> Result<Vec<Vec<f32>>> {
        self.units.iter().map(|unit| unit.values(&self.model, &self.shared)).collect()
    }

    /// Replaces the master weights [`shard_masters`](Self::shard_masters) returned (same
    /// units, same lengths) and puts them where the stage keeps parameters (all-gathering
    /// at stages 1-2), as loading a checkpoint does; the optimizer's state is kept. Every
    /// rank of the engine's group must call it, between optimizer steps.
    pub fn load_shard_masters(&mut self, masters: Vec<Vec<f32>>) -> Result<()> {
        if self.window.micro_steps > 0 {
            return Err(Error::Usage(format!(
                "load_shard_masters inside an accumulation window ({} micro-steps done): call it after step()",
                self.window.micro_steps
            )));
        }
        if masters.len() != self.units.len() {
            let (got, want) = (masters.len(), self.units.len());
            return Err(Error::Usage(format!("load_shard_masters: {got} units given, the engine has {want}")));
        }
        for (id, values) in masters.iter().enumerate() {
            let want = self.shared.optimizer_range(id).len();
            if values.len() != want {
                let got = values.len();
                return Err(Error::Usage(format!("load_shard_masters: unit {id} has {got} values, its range {want}")));
            }
        }
        for (id, values) in masters.into_iter().enumerate() {
            let model = self.model.clone();
            self.model = self.units[id].load(model, values, &self.shared)?;
        }
        Ok(())
    }
}
