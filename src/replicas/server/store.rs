//! A server's checkpoints: its places' global weights and outer state, saved atomically
//! with the checkpoint crate (each place a shard file, laid out one after another as
//! `place{p}`), and loaded back when a server restarts.
//!
//! Tensors: `master` (the global weights), `optim.momentum` (the outer momentum; zeros
//! before its first step, flagged in the manifest) and `optim.pending` (async: the pushes'
//! mean since the last momentum step). The manifest's `engine` holds each place's round,
//! whether its momentum exists, how many pushes are pending, and the server's groups and
//! mode, which a restart must match.

use std::path::Path;

use serde::{Deserialize, Serialize};
use zerotrain_checkpoint::{Checkpoint, FORMAT_VERSION, LATEST, LayoutEntry, Manifest, commit, prepare, write_shard};

use super::ServerConfig;
use super::place::{Outer, Place};
use crate::replicas::outer::{Delayed, OuterState};
use crate::{Error, Result};

/// Checkpoints a server keeps.
const KEEP_LAST: usize = 2;

/// What the manifest records of one place.
#[derive(Debug, Serialize, Deserialize)]
struct SavedPlace {
    len: u64,
    round: u64,
    momentum: bool,
    pending_pushes: usize,
    /// Which part of the ranks' shards the place holds (absent in older checkpoints).
    #[serde(default)]
    part: Option<super::Part>,
}

/// What the manifest records of the server.
#[derive(Debug, Serialize, Deserialize)]
struct SavedServer {
    groups: usize,
    mode: crate::config::ReplicaMode,
    places: Vec<Option<SavedPlace>>,
}

fn failed(dir: &Path, e: impl std::fmt::Display) -> Error {
    Error::Launch(format!("parameter server checkpoint in {}: {e}", dir.display()))
}

/// Saves `places` (a consistent copy) into `dir` as `global_step{round}`, `round` being the
/// rounds every place has reached. Returns the checkpoint's directory.
pub(super) fn save(
    dir: &Path,
    config: &ServerConfig,
    places: &[Option<Place>],
    round: u64,
) -> Result<std::path::PathBuf> {
    let tag = zerotrain_checkpoint::default_tag(round);
    let partial = prepare(dir, &tag).map_err(|e| failed(dir, e))?;
    let (mut layout, mut saved, mut offset) = (Vec::new(), Vec::new(), 0u64);
    for (p, place) in places.iter().enumerate() {
        let Some(place) = place else {
            saved.push(None);
            continue;
        };
        let len = place.global.len() as u64;
        let (momentum, pending, pushes) = match &place.outer {
            Outer::Sync(state) => (state.momentum(), &[][..], 0),
            Outer::Async(delayed) => delayed.parts(),
        };
        if len > 0 {
            let zeros = vec![0.0f32; len as usize];
            let momentum_values = momentum.unwrap_or(&zeros);
            let pending_values = if pending.is_empty() { &zeros[..] } else { pending };
            let tensors =
                [("master", &place.global[..]), ("optim.momentum", momentum_values), ("optim.pending", pending_values)];
            let range = offset..offset + len;
            write_shard(&partial, p, std::slice::from_ref(&range), &tensors).map_err(|e| failed(dir, e))?;
        }
        layout.push(LayoutEntry { path: format!("place{p}"), shape: vec![len], offset });
        saved.push(Some(SavedPlace {
            len,
            round: place.round,
            momentum: momentum.is_some(),
            pending_pushes: pushes,
            part: place.part,
        }));
        offset += len;
    }
    let server = SavedServer { groups: config.groups, mode: config.mode, places: saved };
    let manifest = Manifest {
        format_version: FORMAT_VERSION,
        tag,
        global_step: round,
        world_size: places.len().max(1),
        stage: 0,
        precision: "fp32".into(),
        layout,
        tensors: vec!["master".into(), "optim.momentum".into(), "optim.pending".into()],
        files: vec![],
        buffers: None,
        engine: serde_json::json!({ "parameter_server": server }),
        config: serde_json::to_value(config.outer).unwrap_or_default(),
        client_state: serde_json::Value::Null,
    };
    commit(dir, manifest, Some(KEEP_LAST)).map_err(|e| failed(dir, e))
}

/// The places of the latest checkpoint in `dir`, or `None` where nothing was saved there.
/// A checkpoint of other groups or another mode is an error naming both.
pub(super) fn load(dir: &Path, config: &ServerConfig) -> Result<Option<(Vec<Option<Place>>, u64)>> {
    if !dir.join(LATEST).exists() {
        return Ok(None);
    }
    let ckpt = Checkpoint::open(dir, None).map_err(|e| failed(dir, e))?;
    ckpt.verify().map_err(|e| failed(dir, e))?;
    let manifest = ckpt.manifest();
    let server: SavedServer = serde_json::from_value(manifest.engine["parameter_server"].clone())
        .map_err(|e| failed(dir, format!("not a parameter server's checkpoint ({e})")))?;
    if (server.groups, server.mode) != (config.groups, config.mode) {
        return Err(failed(
            dir,
            format!(
                "saved by a server of {} groups in {:?} mode; this one has {} groups in {:?} mode",
                server.groups, server.mode, config.groups, config.mode
            ),
        ));
    }
    let mut places = Vec::with_capacity(server.places.len());
    let mut offset = 0u64;
    for saved in server.places {
        let Some(saved) = saved else {
            places.push(None);
            continue;
        };
        let range = offset..offset + saved.len;
        let read = |tensor: &str| -> Result<Vec<f32>> {
            let mut out = vec![0.0f32; saved.len as usize];
            if saved.len > 0 {
                ckpt.read_range(tensor, range.clone(), &mut out).map_err(|e| failed(dir, e))?;
            }
            Ok(out)
        };
        let global = read("master")?;
        let momentum = saved.momentum.then(|| read("optim.momentum")).transpose()?;
        let outer = match config.mode {
            crate::config::ReplicaMode::Sync => Outer::Sync(OuterState::from_momentum(momentum)),
            crate::config::ReplicaMode::Async { .. } => {
                let pending = if saved.pending_pushes > 0 { read("optim.pending")? } else { Vec::new() };
                Outer::Async(Delayed::from_parts(momentum, pending, saved.pending_pushes))
            }
        };
        let mut place = Place::new(config.mode, global, outer, saved.round, config.groups, config.comm_dtype);
        place.part = saved.part;
        places.push(Some(place));
        offset += saved.len;
    }
    Ok(Some((places, manifest.global_step)))
}
