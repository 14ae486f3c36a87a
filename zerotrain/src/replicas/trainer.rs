//! [`LocalSgd`] as a [`Trainer`], so that a program (the `zerotrain train` job among them)
//! drives replica groups with the loop it drives one engine with.
//!
//! # Note: checkpoints of replica groups
//! With parameter servers each job is one group with its own run folder, and saves its own
//! engine where it is; a resumed job joins the servers again and continues from their
//! current global weights (which the servers checkpoint themselves).
//!
//! In one job, between rounds the groups hold different weights, so a save first runs a round: every
//! group then holds the global weights, and group 0 saves them with its engine (a normal
//! checkpoint, at the group's world size, loadable at any world size, stage, or number of
//! groups) while the other groups wait for it and report its outcome: a save that failed
//! in group 0 fails in every group. The outer optimizer's momentum is not in the
//! checkpoint: a resumed run restarts it from zero. A load puts the same
//! checkpoint into every group and takes its weights as the global ones.

use std::path::{Path, PathBuf};

use zerotrain_zero::CommStats;

use super::LocalSgd;
use crate::Trainer;
use crate::engine::agree;
use crate::engine::model::UnitModel;
use crate::engine::{Counters, LoadOptions, MemoryReport, StepReport};
use crate::{Error, Result};

impl<M: UnitModel> Trainer<M> for LocalSgd<M> {
    fn train_batch(&mut self, batch: &mut dyn FnMut(usize) -> M::Batch) -> Result<StepReport> {
        let mut report = self.engine.train_batch(batch)?;
        if let Some(round) = self.count_step()? {
            report.comm_bytes += round.bytes;
        }
        Ok(report)
    }

    fn evaluate(&mut self, batch: &M::Batch) -> Result<f32> {
        self.engine.evaluate(batch)
    }

    fn evaluate_many(&mut self, batches: &[M::Batch]) -> Result<Vec<f32>> {
        self.engine.evaluate_many(batches)
    }

    fn save_checkpoint(&mut self, dir: &Path, tag: Option<&str>, client_state: serde_json::Value) -> Result<PathBuf> {
        if !self.replicas.plan.servers.is_empty() {
            // Each job is one group with a run folder of its own: it saves where it is, and
            // a resumed job rejoins the servers' current global weights.
            return self.engine.save_checkpoint(dir, tag, client_state);
        }
        if self.steps_since_round > 0 {
            self.sync()?;
        }
        let saved = match self.replicas.group {
            0 => self.engine.save_checkpoint(dir, tag, client_state),
            _ => {
                let step = self.engine.counters().global_steps;
                Ok(dir.join(tag.map_or_else(|| zerotrain_checkpoint::default_tag(step), str::to_string)))
            }
        };
        // Every group reports group 0's outcome (its ranks agreed on it), once it is
        // committed: nobody reads the checkpoint before.
        let (place, own) = (self.replicas.place().0, saved.is_err());
        agree(self.replicas.peers.as_ref(), saved, "saving the replica groups' checkpoint").map_err(|e| match e {
            // The peers are ranked by group: name group 0's rank by its world rank.
            Error::PeerFailed { ranks, phase } if !own => {
                Error::PeerFailed { ranks: ranks.iter().map(|&g| self.replicas.world_rank(g, place)).collect(), phase }
            }
            e => e,
        })
    }

    fn load_checkpoint(&mut self, dir: &Path, tag: Option<&str>, options: LoadOptions) -> Result<serde_json::Value> {
        let client_state = self.engine.load_checkpoint(dir, tag, options)?;
        self.restart_from_engine()?;
        Ok(client_state)
    }

    fn gather_model(&mut self, root: usize) -> Result<Option<M>> {
        // Group 0's rank `root` gets it: the group's ranks are the world's first. On a
        // device mesh every tensor rank of `root`'s data-parallel place gets its part (the
        // engine's ranks are the places of one tensor index).
        let (_, group_size) = self.replicas.place();
        let tensor = group_size / self.engine.plan().world_size();
        let model = self.engine.gather_model((root % group_size) / tensor)?;
        Ok(model.filter(|_| self.replicas.group == root / group_size))
    }

    fn master_params(&self) -> Result<Vec<f32>> {
        self.engine.master_params()
    }

    fn counters(&self) -> Counters {
        self.engine.counters()
    }

    fn memory_report(&self) -> MemoryReport {
        self.engine.memory_report()
    }

    fn comm_stats(&self) -> CommStats {
        // With servers the peers are the engine's own communicator (the rounds' bytes
        // travel over gRPC, counted in the step reports instead).
        match self.replicas.plan.servers.is_empty() {
            true => self.engine.comm_stats().plus(&self.replicas.peers.stats()),
            false => self.engine.comm_stats(),
        }
    }

    fn num_params(&self) -> usize {
        self.engine.num_params()
    }

    fn data_parallel_rank(&self) -> usize {
        self.replicas.data.0
    }

    fn data_parallel_size(&self) -> usize {
        self.replicas.data.1
    }

    fn rounds(&self) -> Option<u64> {
        Some(LocalSgd::rounds(self))
    }

    fn last_round(&self) -> Option<super::Round> {
        self.last
    }
}
