//! Sharded, atomic, checksummed checkpoints that load at any world size.
//!
//! A checkpoint is `<root>/<tag>/`: a [`Manifest`] (`manifest.json`: layout by module path,
//! which flat ranges each shard file holds, per-block checksums, engine and client state)
//! and one safetensors file per rank that owns data, holding its fp32 master weights and
//! optimizer-state leaves over its flat ranges, plus the model's buffers (running
//! statistics) in one file of their own ([`write_buffers`], [`Checkpoint::read_buffers`]). Writers call [`prepare`], [`write_shard`]
//! on every rank and [`commit`] (see its protocol note); readers [`Checkpoint::open`] one
//! and [`read_range`](Checkpoint::read_range) exactly the flat ranges they own, whatever
//! world size wrote it. [`consolidate`] streams the masters and buffers into one
//! safetensors file keyed by module path.
//!
//! ```
//! use zerotrain_checkpoint::{commit, prepare, write_shard, Checkpoint, LayoutEntry, Manifest};
//! let root = std::env::temp_dir().join(format!("zt-doc-{}", std::process::id()));
//! let _ = std::fs::remove_dir_all(&root);
//! let partial = prepare(&root, "global_step1")?;
//! // Two ranks, each owning half of a 6-element model.
//! write_shard(&partial, 0, &[0..3], &[("master", &[1.0, 2.0, 3.0][..])])?;
//! write_shard(&partial, 1, &[3..6], &[("master", &[4.0, 5.0, 6.0][..])])?;
//! let manifest = Manifest {
//!     format_version: zerotrain_checkpoint::FORMAT_VERSION,
//!     tag: "global_step1".into(), global_step: 1, world_size: 2, stage: 2, precision: "fp32".into(),
//!     layout: vec![LayoutEntry { path: "w".into(), shape: vec![2, 3], offset: 0 }],
//!     tensors: vec!["master".into()], files: vec![], buffers: None,
//!     engine: serde_json::json!({}), config: serde_json::json!({}), client_state: serde_json::json!(null),
//! };
//! commit(&root, manifest, None)?;
//! // Read it back as if by one of three ranks: elements 2..4 straddle both files.
//! let ckpt = Checkpoint::open(&root, None)?;
//! let mut mine = [0.0; 2];
//! ckpt.read_range("master", 2..4, &mut mine)?;
//! assert_eq!(mine, [3.0, 4.0]);
//! # std::fs::remove_dir_all(&root).unwrap();
//! # Ok::<(), zerotrain_checkpoint::CheckpointError>(())
//! ```
//!
//! # Design notes
//! - *Note: the commit protocol* — [`commit`]'s module.
//! - *Note: block checksums* — the shard module.
//! - *Note: the manifest's checksum* — [`Manifest`]'s module.
#![deny(missing_docs)]

mod bounded;
mod checkpoint;
mod commit;
mod consolidate;
mod error;
mod manifest;
mod shard;
mod tag;

pub use bounded::{MAX_TEXT_FILE_BYTES, open_regular, read_bounded};
pub use checkpoint::{Checkpoint, SavedBuffers, list};
pub use commit::{LATEST, commit, crash_point, partial_dir, prepare, write_buffers, write_shard, write_shard_streamed};
pub use consolidate::{consolidate, write_computed, write_parameters, write_parameters_as};
pub use error::{CheckpointError, Result};
pub use manifest::{BUFFERS_FILE, BufferSet, FORMAT_VERSION, LayoutEntry, Manifest, ShardFile};
pub use shard::{BLOCK_BYTES, FileSummary, SafetensorsWriter, ShardReader, TensorSpec};
pub use tag::{default_tag, validate_tag};

#[cfg(test)]
mod tests;
