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
use super::service::{MAX_PLACE_ELEMS, MAX_PLACES};
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

/// The furthest round a checkpoint may record (2^48: far beyond any run, and far enough
/// below 2^64 that counting on from it cannot overflow).
const MAX_ROUND: u64 = 1 << 48;

/// Refuses what a damaged or hostile manifest says of place `p` (which starts at `offset`
/// of the layout): a length other than its layout entry's (the files were checked against
/// the layout, not against this record) or past what a place may hold, a round past
/// [`MAX_ROUND`], more pending pushes than groups.
fn check_saved(
    saved: &SavedPlace,
    p: usize,
    offset: u64,
    manifest: &Manifest,
    config: &ServerConfig,
) -> std::result::Result<(), String> {
    let name = format!("place{p}");
    let entry = manifest.layout.iter().find(|e| e.path == name);
    if entry.is_none_or(|e| e.shape != [saved.len] || e.offset != offset) {
        return Err(format!(
            "place {p} records {} values at offset {offset}, which its layout does not hold",
            saved.len
        ));
    }
    if saved.len > MAX_PLACE_ELEMS as u64 {
        return Err(format!("place {p} records {} values, more than a place holds ({MAX_PLACE_ELEMS})", saved.len));
    }
    if saved.round > MAX_ROUND || manifest.global_step > MAX_ROUND {
        return Err(format!("place {p} records round {}, past {MAX_ROUND}: the manifest is damaged", saved.round));
    }
    if saved.pending_pushes > config.groups {
        return Err(format!("place {p} records {} pending pushes from {} groups", saved.pending_pushes, config.groups));
    }
    Ok(())
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
    if server.places.len() > MAX_PLACES as usize {
        return Err(failed(dir, format!("{} places, more than a server holds ({MAX_PLACES})", server.places.len())));
    }
    let mut places = Vec::with_capacity(server.places.len());
    let mut offset = 0u64;
    for (p, saved) in server.places.into_iter().enumerate() {
        let Some(saved) = saved else {
            places.push(None);
            continue;
        };
        check_saved(&saved, p, offset, manifest, config).map_err(|e| failed(dir, e))?;
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
        offset = offset.saturating_add(saved.len);
    }
    Ok(Some((places, manifest.global_step)))
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use zerotrain_precision::Precision;

    use super::*;
    use crate::config::{OuterOptimizer, ReplicaMode};

    fn config() -> ServerConfig {
        ServerConfig {
            groups: 2,
            outer: OuterOptimizer { lr: 1.0, momentum: 0.0, nesterov: false },
            mode: ReplicaMode::Sync,
            group_timeout: Duration::from_secs(30),
            checkpoint: None,
            checkpoint_every: 1,
            comm_dtype: Precision::Fp32,
            token: None,
            tls: None,
            limits: super::super::incoming::Limits::for_this_process(),
        }
    }

    /// A server's checkpoint whose manifest was edited is refused naming what it records,
    /// before anything is allocated for it: a place longer than its layout (2^40 values once
    /// aborted the allocation, 2^64 - 1 overflowed), a round of 2^64 - 1 (it once killed the
    /// keeper, counting on from it), more pending pushes than groups. Unedited, it loads.
    #[test]
    fn an_edited_server_checkpoint_is_refused_for_what_it_records() {
        let dir = std::env::temp_dir().join(format!("zerotrain-store-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let config = config();
        let place = Place::new(
            config.mode,
            vec![1.0, 2.0, 3.0],
            Outer::Sync(OuterState::from_momentum(None)),
            4,
            2,
            Precision::Fp32,
        );
        let path = save(&dir, &config, &[Some(place)], 4).unwrap();
        let (places, round) = load(&dir, &config).unwrap().unwrap();
        assert_eq!((places[0].as_ref().unwrap().global.to_vec(), round), (vec![1.0, 2.0, 3.0], 4));
        let manifest = path.join("manifest.json");
        let bytes = std::fs::read(&manifest).unwrap();
        let original: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
        // As an attacker would: the manifest's own checksum recomputed over the edit.
        let edit = |key: &str, value: serde_json::Value| {
            let mut edited = original["manifest"].clone();
            edited["engine"]["parameter_server"]["places"][0][key] = value;
            let raw = edited.to_string();
            let envelope = format!(r#"{{"manifest":{raw},"crc32":{}}}"#, crc32fast::hash(raw.as_bytes()));
            std::fs::write(&manifest, envelope).unwrap();
            let Err(e) = load(&dir, &config) else { panic!("an edited {key} was accepted") };
            e.to_string()
        };
        let err = edit("len", serde_json::json!(1u64 << 40));
        assert!(
            err.contains("place 0 records 1099511627776 values at offset 0, which its layout does not hold"),
            "{err}"
        );
        assert!(edit("len", serde_json::json!(u64::MAX)).contains("which its layout does not hold"));
        let err = edit("round", serde_json::json!(u64::MAX));
        assert!(err.contains("place 0 records round 18446744073709551615, past 281474976710656"), "{err}");
        assert!(edit("pending_pushes", serde_json::json!(3)).contains("3 pending pushes from 2 groups"));
        std::fs::write(&manifest, bytes).unwrap();
        assert!(load(&dir, &config).unwrap().is_some());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
