//! [`Trainer`]: one interface over the ways a [`UnitModel`] trains, an [`Engine`] over its
//! declared units (data parallelism with ZeRO 0-3), a [`Pipeline`] stage, and replica
//! groups ([`LocalSgd`](crate::replicas::LocalSgd), which implements it where it is
//! defined), so that a program drives whichever its plan asks for
//! ([`trainer`](crate::trainer())) with the same loop. The trait sits above the engine and
//! below the replica groups; which trainer a plan asks for is `factory.rs`, above both.

use std::path::{Path, PathBuf};

use zerotrain_zero::CommStats;

use crate::Result;
use crate::engine::model::UnitModel;
use crate::engine::{Counters, Engine, LoadOptions, MemoryReport, Pipeline, StepReport};

/// What trains a [`UnitModel`] one optimizer step at a time. Every method that talks to
/// other ranks must be called by every rank.
pub trait Trainer<M: UnitModel> {
    /// One optimizer step over `gradient_accumulation_steps` micro-batches, `batch(i)`
    /// giving this rank's micro-batch `i` ([`Engine::train_batch`], [`Pipeline::train_batch`]).
    fn train_batch(&mut self, batch: &mut dyn FnMut(usize) -> M::Batch) -> Result<StepReport>;
    /// The loss of `batch` in inference mode, without gradients.
    fn evaluate(&mut self, batch: &M::Batch) -> Result<f32>;
    /// The loss of each of `batches`, as [`evaluate`](Self::evaluate) gives it; an engine
    /// runs each unit on all of them in turn ([`Engine::evaluate_many`]: at stage 3 one
    /// gather per unit, not per batch), a pipeline (and the default) takes them one by one.
    fn evaluate_many(&mut self, batches: &[M::Batch]) -> Result<Vec<f32>> {
        batches.iter().map(|batch| self.evaluate(batch)).collect()
    }
    /// Saves a checkpoint.
    fn save_checkpoint(&mut self, dir: &Path, tag: Option<&str>, client_state: serde_json::Value) -> Result<PathBuf>;
    /// Loads a checkpoint saved at any world size, stage or pipeline shape.
    fn load_checkpoint(&mut self, dir: &Path, tag: Option<&str>, options: LoadOptions) -> Result<serde_json::Value>;
    /// The whole model on rank `root` only.
    fn gather_model(&mut self, root: usize) -> Result<Option<M>>;
    /// The whole model's fp32 master weights in the global order, on every rank.
    fn master_params(&self) -> Result<Vec<f32>>;
    /// Step counters.
    fn counters(&self) -> Counters;
    /// This rank's model-state bytes.
    fn memory_report(&self) -> MemoryReport;
    /// This rank's traffic.
    fn comm_stats(&self) -> CommStats;
    /// The model's trainable elements Ψ.
    fn num_params(&self) -> usize;
    /// This rank's index among the ranks that split each batch: micro-batch `i` of a step
    /// is the data-parallel rank's part of it.
    fn data_parallel_rank(&self) -> usize;
    /// How many parts each batch is split into (the ranks that split it, with replica
    /// groups those of every group together).
    fn data_parallel_size(&self) -> usize;
    /// Replica groups' rounds so far; `None` for a trainer without groups.
    fn rounds(&self) -> Option<u64> {
        None
    }
    /// Replica groups' last round (its live groups, staleness, whether the group rejoined);
    /// `None` before the first round and without groups.
    fn last_round(&self) -> Option<crate::replicas::Round> {
        None
    }
}

macro_rules! delegate {
    ($ty:ident) => {
        impl<M: UnitModel> Trainer<M> for $ty<M> {
            fn train_batch(&mut self, batch: &mut dyn FnMut(usize) -> M::Batch) -> Result<StepReport> {
                $ty::train_batch(self, batch)
            }
            fn evaluate(&mut self, batch: &M::Batch) -> Result<f32> {
                $ty::evaluate(self, batch)
            }
            fn evaluate_many(&mut self, batches: &[M::Batch]) -> Result<Vec<f32>> {
                $ty::evaluate_many(self, batches)
            }
            fn save_checkpoint(
                &mut self,
                dir: &Path,
                tag: Option<&str>,
                client_state: serde_json::Value,
            ) -> Result<PathBuf> {
                $ty::save_checkpoint(self, dir, tag, client_state)
            }
            fn load_checkpoint(
                &mut self,
                dir: &Path,
                tag: Option<&str>,
                options: LoadOptions,
            ) -> Result<serde_json::Value> {
                $ty::load_checkpoint(self, dir, tag, options)
            }
            fn gather_model(&mut self, root: usize) -> Result<Option<M>> {
                $ty::gather_model(self, root)
            }
            fn master_params(&self) -> Result<Vec<f32>> {
                $ty::master_params(self)
            }
            fn counters(&self) -> Counters {
                $ty::counters(self)
            }
            fn memory_report(&self) -> MemoryReport {
                $ty::memory_report(self)
            }
            fn comm_stats(&self) -> CommStats {
                $ty::comm_stats(self)
            }
            fn num_params(&self) -> usize {
                $ty::num_params(self)
            }
            fn data_parallel_rank(&self) -> usize {
                $ty::data_parallel_rank(self)
            }
            fn data_parallel_size(&self) -> usize {
                $ty::data_parallel_size(self)
            }
        }
    };
}

delegate!(Engine);
delegate!(Pipeline);
