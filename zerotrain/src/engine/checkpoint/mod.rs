//! Saving and loading the engine through `zerotrain-checkpoint`.
//!
//! # Note: what is saved, and where
//! Each rank saves the fp32 master weights and optimizer-state leaves of the real (unpadded)
//! part of each unit's range its optimizer steps: at stage 0 every rank holds everything,
//! so only rank 0 writes; at stages 1-3 each rank writes its shards. Each piece is recorded
//! at its place in the global order (module paths in visit order, whatever the units), so
//! a rank's file holds a list of global ranges. Parameters in the compute dtype are derived
//! from the masters and are not saved again. Rank 0 writes the manifest with the engine
//! state (counters, lr schedule position, loss scaler, optimizer scalars), the resolved
//! plan and the caller's client state, and the model's buffers (averaged over the ranks
//! first; a pipeline's gathered from the stages that hold them).
//!
//! On load each rank reads exactly the global ranges its units' ranges map to, whatever
//! grouping, world size and stage wrote the checkpoint, then rebuilds its parameters as its
//! own stage keeps them. After every phase that can fail on one rank, all ranks agree on
//! success, so a failure is an error on every rank, never a hang.

use std::ops::Range;
use std::path::{Path, PathBuf};

use burn::module::Module;
use zerotrain_checkpoint::{BufferSet, FORMAT_VERSION, LayoutEntry, Manifest, default_tag};
use zerotrain_precision::LossScaler;

use self::state::EngineState;
pub use self::state::LoadOptions;
use super::Engine;
use super::buffers::BufferEntry;
use crate::{Error, Result};

mod fit;
mod load;
mod state;

impl<M: Module> Engine<M> {
    /// Saves a checkpoint to `<dir>/<tag>` (default tag `global_step{N}`) with the caller's
    /// `client_state`, atomically (see `zerotrain-checkpoint`'s commit protocol). Every rank
    /// must call it; it returns the checkpoint's directory on every rank, or the same
    /// failure on every rank.
    ///
    /// It averages the buffers over the ranks first (see [`sync_buffers`](Self::sync_buffers)).
    pub fn save_checkpoint(
        &mut self,
        dir: impl AsRef<Path>,
        tag: Option<&str>,
        client_state: serde_json::Value,
    ) -> Result<PathBuf> {
        self.off_the_clock(|engine| engine.save(dir.as_ref(), tag, client_state))
    }

    fn save(&mut self, root: &Path, tag: Option<&str>, client_state: serde_json::Value) -> Result<PathBuf> {
        let tag = tag.map_or_else(|| default_tag(self.progress.counters.global_steps), str::to_string);
        self.agree_all(self.whole(), "checking its states")?;
        self.sync_buffers()?;
        let buffers = self.stage_buffers()?;
        let rank = self.shared.checkpoint_ranks().rank();
        let prepared =
            if rank == 0 { zerotrain_checkpoint::prepare(root, &tag).map(|_| ()).map_err(Error::from) } else { Ok(()) };
        self.agree_all(prepared, "preparing the checkpoint")?;
        let written = self.write_my_shard(root, &tag);
        self.agree_all(written, "writing its shard")?;
        let committed = if rank == 0 { self.commit(root, &tag, client_state, buffers).map(|_| ()) } else { Ok(()) };
        self.agree_all(committed, "committing the checkpoint")?;
        Ok(root.join(tag))
    }

    /// Whether this rank's stage holds buffer `e` for the checkpoint (a pipeline's root
    /// buffers count on the first stage).
    pub(super) fn counts_buffer(&self, e: &BufferEntry) -> bool {
        e.unit.is_some_and(|u| self.granularity.root() != Some(u) || self.span.counts_root())
    }

    /// Every saved buffer's values (each from the stage that holds it) and their layout:
    /// all but the frozen parameters, which a resumed run builds again.
    fn stage_buffers(&self) -> Result<(Vec<LayoutEntry>, Vec<f32>)> {
        if self.buffers.saved().next().is_none() {
            return Ok((Vec::new(), Vec::new()));
        }
        let mut values = self.buffers.read_saved(&self.model, |e| self.counts_buffer(e), true)?;
        self.span.sum_over_stages((&mut values).into())?;
        let mut offset = 0;
        let layout = (self.buffers.saved())
            .map(|e| {
                let entry =
                    LayoutEntry { path: e.path.clone(), shape: e.shape.iter().map(|&d| d as u64).collect(), offset };
                offset += e.shape.iter().product::<usize>() as u64;
                entry
            })
            .collect();
        Ok((layout, values))
    }

    /// The pieces this rank saves, per unit: (range of the unit's flat buffer, range in the
    /// global order). Nothing at stage 0 beyond rank 0 (every rank holds everything).
    fn saved_segments(&self) -> Vec<Vec<(Range<usize>, Range<usize>)>> {
        let stage0 = !self.shared.plan.zero.stage.shards_optimizer_states();
        let skip_root = self.root_counted_elsewhere();
        (0..self.units.len())
            .map(|id| {
                // At stage 0 a group's first rank saves for it; the root's replicas on
                // later pipeline stages are the first stage's.
                if (stage0 && self.shared.comm.rank() != 0) || skip_root == Some(id) {
                    return Vec::new();
                }
                self.shared.checkpoint_segments(id, self.shared.optimizer_real_range(id), true)
            })
            .collect()
    }

    /// Writes this rank's shard one tensor at a time and, within it, one unit at a time,
    /// so that no more than one unit's values of one tensor exist at once (offloaded states
    /// are read from their swap files as they are written).
    fn write_my_shard(&self, root: &Path, tag: &str) -> Result<()> {
        let segments = self.saved_segments();
        if segments.iter().all(Vec::is_empty) {
            return Ok(());
        }
        let (optim, _) = self.units[0].state_layout()?;
        for (id, unit) in self.units.iter().enumerate() {
            let (names, _) = unit.state_layout()?;
            if names != optim {
                return Err(Error::Model(format!(
                    "unit {id}'s optimizer state has {} tensors ({names:?}), unit 0's {} ({optim:?})",
                    names.len(),
                    optim.len()
                )));
            }
        }
        let ranges: Vec<Range<u64>> =
            segments.iter().flatten().map(|(_, global)| global.start as u64..global.end as u64).collect();
        let names: Vec<String> =
            std::iter::once("master".to_string()).chain(optim.iter().map(|n| format!("optim.{n}"))).collect();
        let names: Vec<&str> = names.iter().map(String::as_str).collect();
        let mut failure = None;
        let partial = zerotrain_checkpoint::partial_dir(root, tag);
        let written = zerotrain_checkpoint::write_shard_streamed(
            &partial,
            self.shared.checkpoint_ranks().rank(),
            &ranges,
            &names,
            |t, out| {
                for (id, segments) in segments.iter().enumerate().filter(|(_, s)| !s.is_empty()) {
                    let unit = &self.units[id];
                    let values = match t {
                        0 => unit.values(&self.model, &self.shared),
                        _ => unit.state_tensor(&optim[t - 1]).and_then(|v| {
                            v.ok_or_else(|| {
                                Error::Model(format!("unit {id} has no optimizer state `{}`", optim[t - 1]))
                            })
                        }),
                    };
                    let values = match values {
                        Ok(values) => values,
                        Err(e) => {
                            // Surfaced below: the writer's own error type cannot carry it.
                            failure = Some(e);
                            return Err(zerotrain_checkpoint::CheckpointError::Mismatch(format!("unit {id}'s states")));
                        }
                    };
                    let offset = self.shared.optimizer_range(id).start;
                    for (unit_range, _) in segments {
                        out.write_f32(&values[unit_range.start - offset..unit_range.end - offset])?;
                    }
                }
                Ok(())
            },
        );
        match (written, failure) {
            (_, Some(e)) => Err(e),
            (written, None) => written.map(drop).map_err(Error::from),
        }
    }

    fn commit(
        &self,
        root: &Path,
        tag: &str,
        client_state: serde_json::Value,
        (buffer_layout, buffer_values): (Vec<LayoutEntry>, Vec<f32>),
    ) -> Result<PathBuf> {
        let (optim, optimizer_scalars) = self.units[0].export_state()?;
        let progress = &self.progress;
        let state = EngineState {
            counters: progress.counters,
            lr_iteration: progress.lr_iteration,
            loss_scaler: match &progress.scaler {
                Some(LossScaler::Dynamic { state, .. }) => Some(*state),
                _ => None,
            },
            optimizer: self.shared.plan.optim.optimizer.kind().to_string(),
            optimizer_scalars,
            lr_override: progress.lr_override,
        };
        let buffers: Option<BufferSet> = if buffer_values.is_empty() {
            None
        } else {
            let partial = zerotrain_checkpoint::partial_dir(root, tag);
            Some(zerotrain_checkpoint::write_buffers(&partial, buffer_layout, &buffer_values)?)
        };
        let manifest = Manifest {
            format_version: FORMAT_VERSION,
            tag: tag.to_string(),
            global_step: progress.counters.global_steps,
            world_size: self.shared.checkpoint_ranks().world_size(),
            stage: self.shared.plan.zero.stage.index(),
            precision: self.shared.plan.precision.compute.to_string(),
            layout: self.manifest_layout(),
            tensors: std::iter::once("master".to_string())
                .chain(optim.iter().map(|(n, _)| format!("optim.{n}")))
                .collect(),
            files: Vec::new(),
            buffers,
            engine: serde_json::to_value(&state)
                .map_err(|e| Error::Usage(format!("serialising the engine state: {e}")))?,
            config: serde_json::to_value(&self.shared.plan)
                .map_err(|e| Error::Usage(format!("serialising the plan: {e}")))?,
            client_state,
        };
        Ok(zerotrain_checkpoint::commit(root, manifest, self.shared.plan.runtime.keep_last_n_checkpoints)?)
    }

    /// All ranks agree on whether `result` succeeded everywhere: a failing rank returns its
    /// own error, the others [`Error::PeerFailed`] naming the failed ranks. The world stays
    /// usable, so a caller may catch a failed save and go on training.
    pub(super) fn agree<T>(&self, result: Result<T>, phase: &str) -> Result<T> {
        super::shared::agree(self.shared.ranks.as_ref(), result, phase)
    }

    /// [`agree`](Self::agree) over every rank that writes the checkpoint (a mesh's every
    /// rank, not only the data-parallel group's).
    pub(super) fn agree_all<T>(&self, result: Result<T>, phase: &str) -> Result<T> {
        super::shared::agree(self.shared.checkpoint_ranks().as_ref(), result, phase)
    }
}

/// The checkpoint to resume from in `dir`, checked before training, so that a run into a
/// used directory fails at once instead of at its first save: without `resume`, a
/// directory that already holds checkpoints is an error (nothing is changed); with it,
/// `latest`'s tag (`Some(None)`), or with `latest` missing the newest complete checkpoint
/// (`Some(Some(tag))`, with a warning on standard error), and an error if it holds none.
/// `Ok(None)`: start fresh.
pub fn resume_point(dir: &Path, resume: bool) -> Result<Option<Option<String>>> {
    let latest = dir.join(zerotrain_checkpoint::LATEST).is_file();
    let mut complete = zerotrain_checkpoint::list(dir)?;
    complete.sort();
    match (resume, latest, complete.last()) {
        (false, false, None) => Ok(None),
        (false, _, _) => Err(Error::Usage(format!(
            "{} holds checkpoints of an earlier run: resume them, or save to another directory (nothing was changed)",
            dir.display()
        ))),
        (true, true, _) => Ok(Some(None)),
        (true, false, Some((step, tag))) => {
            let tags: Vec<&str> = complete.iter().map(|(_, t)| t.as_str()).collect();
            eprintln!(
                "warning: {} has no `latest`; resuming from the newest complete checkpoint, {tag} (step {step}), of {}",
                dir.display(),
                tags.join(", ")
            );
            Ok(Some(Some(tag.clone())))
        }
        (true, false, None) => {
            Err(Error::Usage(format!("no checkpoint in {} to resume (nothing was saved there yet)", dir.display())))
        }
    }
}
