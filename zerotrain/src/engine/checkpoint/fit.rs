//! Whether a checkpoint fits the engine loading it: the same parameters and buffers (by
//! module path and shape) and, when its optimizer state is loaded, the same optimizer.

use burn::module::Module;
use zerotrain_checkpoint::{Checkpoint, CheckpointError, LayoutEntry, SavedBuffers};

use super::LoadOptions;
use crate::engine::Engine;
use crate::{Error, Result};

impl<M: Module> Engine<M> {
    /// The checkpoint's buffer values in this model's buffer order, checked to be this
    /// model's saved buffers (by path and shape: all but its frozen parameters); `None` when
    /// the checkpoint holds none.
    pub(super) fn check_buffers(&self, ckpt: &Checkpoint, saved: Option<SavedBuffers>) -> Result<Option<Vec<f32>>> {
        let Some(saved) = saved else { return Ok(None) };
        let live: Vec<(String, Vec<u64>)> =
            (self.buffers.saved()).map(|e| (e.path.clone(), e.shape.iter().map(|&d| d as u64).collect())).collect();
        let stored: Vec<(String, Vec<u64>)> = saved.iter().map(|(e, _)| (e.path.clone(), e.shape.clone())).collect();
        if live != stored {
            return Err(mismatch(format!("{}'s buffers do not fit this model", ckpt.dir().display()), &live, &stored));
        }
        Ok(Some(saved.into_iter().flat_map(|(_, values)| values).collect()))
    }

    /// Checks that the checkpoint's layout is this model's and its optimizer this plan's.
    pub(super) fn check_fits(&self, ckpt: &Checkpoint, options: LoadOptions) -> Result<()> {
        let m = ckpt.manifest();
        let by_path = |entries: &[LayoutEntry]| -> Vec<(String, Vec<u64>)> {
            entries.iter().map(|e| (e.path.clone(), e.shape.clone())).collect()
        };
        let (live, saved) = (by_path(&self.manifest_layout()), by_path(&m.layout));
        if live != saved {
            return Err(mismatch(format!("{} does not fit this model", ckpt.dir().display()), &live, &saved));
        }
        let kind = m.engine.get("optimizer").and_then(|v| v.as_str()).unwrap_or("?");
        let configured = self.shared.plan.optim.optimizer.kind();
        if options.load_optimizer_states && !options.load_module_only && kind != configured {
            return Err(CheckpointError::Mismatch(format!(
                "{} holds {kind} optimizer state but the config trains with {}: set optimizer.type back to {kind} \
                 to resume, or (from the library) load the weights alone with LoadOptions {{ load_optimizer_states: \
                 false, .. }}",
                ckpt.dir().display(),
                configured
            ))
            .into());
        }
        Ok(())
    }

    /// The global order as a manifest records it (the whole model's, for a tensor rank).
    pub(super) fn manifest_layout(&self) -> Vec<LayoutEntry> {
        if let Some(tensor) = &self.shared.tensor {
            return tensor.manifest_layout(&self.shared.sharding);
        }
        let entries = self.shared.sharding.global().entries().iter();
        entries
            .map(|e| LayoutEntry {
                path: e.path.clone(),
                shape: e.shape.iter().map(|&d| d as u64).collect(),
                offset: e.offset as u64,
            })
            .collect()
    }
}

/// The error for a checkpoint whose tensors (path, shape) differ from the model's: `what`,
/// then up to 8 of each side's tensors the other lacks.
fn mismatch(what: String, live: &[(String, Vec<u64>)], saved: &[(String, Vec<u64>)]) -> Error {
    let only = |a: &[(String, Vec<u64>)], b: &[(String, Vec<u64>)]| {
        let names: Vec<String> =
            a.iter().filter(|p| !b.contains(p)).take(8).map(|(p, s)| format!("{p} {s:?}")).collect();
        names.join(", ")
    };
    CheckpointError::Mismatch(format!(
        "{what}: the model has [{}] that the checkpoint lacks, the checkpoint has [{}] that the model lacks",
        only(live, saved),
        only(saved, live)
    ))
    .into()
}
