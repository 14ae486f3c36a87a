//! The manifest: everything a checkpoint is, except the tensor bytes.
//!
//! # Note: the manifest's checksum
//! `manifest.json` is `{"manifest": {...}, "crc32": N}` where `N` is the CRC32 of the exact
//! bytes of the `manifest` value as written (compact JSON). A reader takes those bytes
//! verbatim (serde_json's `RawValue`), so any flipped byte inside the manifest changes the
//! checksum and any flipped byte around it breaks the JSON: no corruption goes unseen.

use std::path::Path;

use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;

use crate::{CheckpointError, Result, validate_tag};

/// The manifest format this crate writes. Version 2 lets a shard file hold several flat
/// ranges (a rank's shards of several units); version 3 adds the model's buffers
/// ([`BufferSet`]). This crate reads versions 1 to 3.
pub const FORMAT_VERSION: u32 = 3;
/// The name of the buffers' file.
pub const BUFFERS_FILE: &str = "buffers.safetensors";
/// The largest manifest file read (bounded memory on hostile input).
pub const MAX_MANIFEST_BYTES: u64 = 256 << 20;
/// Bounds that keep a hostile manifest from asking for unbounded memory or arithmetic.
const MAX_WORLD_SIZE: usize = 1 << 20;
const MAX_ELEMS: u64 = 1 << 42;
const MAX_PARAMS: usize = 1 << 24;
/// Most flat ranges all shard files may list together (each rank lists at most a few per
/// parameter or unit).
const MAX_RANGES: usize = 1 << 24;

/// One trainable parameter's place in the flat buffer, keyed by module path.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LayoutEntry {
    /// Module path, e.g. `blocks.0.attn.query.weight`.
    pub path: String,
    /// Shape.
    pub shape: Vec<u64>,
    /// First element in the (unpadded) flat buffer.
    pub offset: u64,
}

/// One shard file: the flat ranges `ranges` of every tensor in [`Manifest::tensors`], each
/// tensor holding those ranges back to back, in the order listed.
///
/// A file written by format version 1 held one range and recorded it as `start` and `end`;
/// it reads as a file of that one range.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "ShardFileFields")]
pub struct ShardFile {
    /// File name inside the checkpoint directory: `rank{rank}.safetensors`.
    pub name: String,
    /// The rank that wrote it.
    pub rank: usize,
    /// The global flat ranges `[start, end)` it holds, in the order its tensors hold them.
    pub ranges: Vec<[u64; 2]>,
    /// Size in bytes.
    pub size: u64,
    /// Bytes per checksummed block (the last block may be shorter).
    pub block_bytes: u64,
    /// CRC32 of each block of the file, in order.
    pub block_crc32: Vec<u32>,
}

impl ShardFile {
    /// Elements each of its tensors holds: the ranges' total length (saturating: a hostile
    /// manifest's sum cannot overflow, and [`Manifest::validate`] rejects it).
    pub fn num_elems(&self) -> u64 {
        self.ranges.iter().fold(0u64, |n, [a, b]| n.saturating_add(b.saturating_sub(*a)))
    }
}

/// [`ShardFile`] as written by either format version.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ShardFileFields {
    name: String,
    rank: usize,
    #[serde(default)]
    ranges: Option<Vec<[u64; 2]>>,
    #[serde(default)]
    start: Option<u64>,
    #[serde(default)]
    end: Option<u64>,
    size: u64,
    block_bytes: u64,
    block_crc32: Vec<u32>,
}

impl TryFrom<ShardFileFields> for ShardFile {
    type Error = String;

    fn try_from(f: ShardFileFields) -> std::result::Result<Self, String> {
        let ranges = match (f.ranges, f.start, f.end) {
            (Some(ranges), None, None) => ranges,
            (None, Some(start), Some(end)) => vec![[start, end]],
            _ => return Err(format!("shard {} must have either `ranges` or `start` and `end`", f.name)),
        };
        Ok(Self {
            name: f.name,
            rank: f.rank,
            ranges,
            size: f.size,
            block_bytes: f.block_bytes,
            block_crc32: f.block_crc32,
        })
    }
}

/// The model's buffers (non-trainable tensors such as running statistics): one file,
/// [`BUFFERS_FILE`], whose one f32 tensor `buffers` holds them back to back.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BufferSet {
    /// Each buffer by module path, its offset in the `buffers` tensor.
    pub layout: Vec<LayoutEntry>,
    /// The file (rank 0's, holding the one range `[0, total)`).
    pub file: ShardFile,
}

/// A checkpoint's description, as stored in `<dir>/<tag>/manifest.json`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Manifest {
    /// [`FORMAT_VERSION`].
    pub format_version: u32,
    /// The tag (the directory's name).
    pub tag: String,
    /// Optimizer steps taken when it was written (orders checkpoints for retention).
    pub global_step: u64,
    /// World size of the job that wrote it.
    pub world_size: usize,
    /// ZeRO stage of the job that wrote it.
    pub stage: u8,
    /// Compute dtype of the job that wrote it (`fp32`, `fp16`, `bf16`); tensors are fp32.
    pub precision: String,
    /// Trainable parameters in flat order.
    pub layout: Vec<LayoutEntry>,
    /// Tensor names every shard file holds, each over the file's flat range: `master` (fp32
    /// master weights) and `optim.*` (optimizer state leaves).
    pub tensors: Vec<String>,
    /// The shard files, by rank; their ranges together cover every element exactly once.
    pub files: Vec<ShardFile>,
    /// The model's buffers, if it has any (format 3; earlier checkpoints hold none).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub buffers: Option<BufferSet>,
    /// Engine state (counters, schedule, loss scaler, optimizer scalars), written by the engine.
    pub engine: serde_json::Value,
    /// The resolved configuration of the job that wrote it.
    pub config: serde_json::Value,
    /// The user's own state (data position, anything).
    pub client_state: serde_json::Value,
}

#[derive(Serialize)]
struct EnvelopeOut<'a> {
    manifest: &'a RawValue,
    crc32: u32,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct EnvelopeIn<'a> {
    #[serde(borrow)]
    manifest: &'a RawValue,
    crc32: u32,
}

impl Manifest {
    /// Number of parameter elements (sum of the layout).
    pub fn num_elems(&self) -> u64 {
        self.layout.last().map_or(0, |e| e.offset + e.shape.iter().product::<u64>())
    }

    /// The manifest file's bytes, checksummed (see the module note).
    pub fn to_bytes(&self) -> Result<Vec<u8>> {
        let body = serde_json::to_string(self)
            .map_err(|e| CheckpointError::Mismatch(format!("cannot serialise manifest: {e}")))?;
        let raw = RawValue::from_string(body).map_err(|e| CheckpointError::Mismatch(format!("manifest JSON: {e}")))?;
        let envelope = EnvelopeOut { manifest: &raw, crc32: crc32fast::hash(raw.get().as_bytes()) };
        serde_json::to_vec(&envelope).map_err(|e| CheckpointError::Mismatch(format!("manifest JSON: {e}")))
    }

    /// Parses and validates manifest bytes read from `path`.
    pub fn from_bytes(bytes: &[u8], path: &Path) -> Result<Self> {
        let corrupted = |reason: String| CheckpointError::Corrupted { path: path.to_path_buf(), reason };
        let envelope: EnvelopeIn<'_> =
            serde_json::from_slice(bytes).map_err(|e| corrupted(format!("not a manifest: {e}")))?;
        let crc = crc32fast::hash(envelope.manifest.get().as_bytes());
        if crc != envelope.crc32 {
            return Err(corrupted(format!(
                "checksum {crc:#010x} does not match the recorded {:#010x}",
                envelope.crc32
            )));
        }
        let manifest: Manifest =
            serde_json::from_str(envelope.manifest.get()).map_err(|e| corrupted(format!("manifest fields: {e}")))?;
        manifest.validate().map_err(|reason| CheckpointError::InvalidManifest { path: path.to_path_buf(), reason })?;
        Ok(manifest)
    }

    /// Checks every invariant a reader relies on, with bounded arithmetic.
    pub fn validate(&self) -> std::result::Result<(), String> {
        if !(1..=FORMAT_VERSION).contains(&self.format_version) {
            return Err(format!("format version {} is not 1 to {FORMAT_VERSION}", self.format_version));
        }
        validate_tag(&self.tag).map_err(|e| e.to_string())?;
        if !(1..=MAX_WORLD_SIZE).contains(&self.world_size) {
            return Err(format!("world size {} out of range", self.world_size));
        }
        if self.stage > 3 {
            return Err(format!("stage {} is not 0-3", self.stage));
        }
        let next = validate_layout(&self.layout, "parameter")?;
        if self.tensors.is_empty() || self.tensors[0] != "master" {
            return Err("the first tensor must be `master`".into());
        }
        for t in &self.tensors[1..] {
            if !t.starts_with("optim.")
                || t.len() > 200
                || !t.bytes().all(|b| b.is_ascii_alphanumeric() || b"._".contains(&b))
            {
                return Err(format!("tensor name {t:?} is not `master` or `optim.*`"));
            }
        }
        let mut ranges: Vec<(u64, u64, &str)> = Vec::new();
        for f in &self.files {
            if f.name != format!("rank{}.safetensors", f.rank) || f.rank >= self.world_size {
                return Err(format!("shard file {:?} of rank {} is not a valid shard name", f.name, f.rank));
            }
            if f.ranges.is_empty() || ranges.len() + f.ranges.len() > MAX_RANGES {
                return Err(format!("shard {} lists {} ranges (1 to {MAX_RANGES} in all)", f.name, f.ranges.len()));
            }
            for &[start, end] in &f.ranges {
                if end <= start || end > next {
                    return Err(format!("shard {} has range [{start}, {end}), not inside [0, {next})", f.name));
                }
                ranges.push((start, end, &f.name));
            }
            validate_blocks(f)?;
        }
        ranges.sort_unstable();
        let mut covered = 0u64;
        for (start, end, name) in ranges {
            if start != covered {
                return Err(format!(
                    "shard {name} covers [{start}, {end}), expected a range to start at {covered} within {next}"
                ));
            }
            covered = end;
        }
        if covered != next {
            return Err(format!("the shard files cover {covered} of {next} elements"));
        }
        if let Some(buffers) = &self.buffers {
            let total = validate_layout(&buffers.layout, "buffer")?;
            let f = &buffers.file;
            if f.name != BUFFERS_FILE || f.rank != 0 || f.ranges != [[0, total]] || total == 0 {
                return Err(format!("the buffers' file {:?} does not hold exactly [0, {total})", f.name));
            }
            validate_blocks(f)?;
        }
        Ok(())
    }
}

/// Checks that `layout` tiles `[0, total)` in order with unique paths and possible shapes;
/// returns `total`. `what` names an entry in errors.
fn validate_layout(layout: &[LayoutEntry], what: &str) -> std::result::Result<u64, String> {
    if layout.len() > MAX_PARAMS {
        return Err(format!("{} {what}s is more than {MAX_PARAMS}", layout.len()));
    }
    let mut next = 0u64;
    let mut paths = std::collections::HashSet::new();
    for e in layout {
        if e.path.is_empty() || !paths.insert(e.path.as_str()) {
            return Err(format!("{what} path {:?} is empty or repeated", e.path));
        }
        let elems = e.shape.iter().try_fold(1u64, |a, &d| a.checked_mul(d)).filter(|&n| n <= MAX_ELEMS);
        let elems = elems.ok_or_else(|| format!("{what} `{}` has an impossible shape {:?}", e.path, e.shape))?;
        if e.offset != next {
            return Err(format!("{what} `{}` starts at {}, expected {next}", e.path, e.offset));
        }
        next = next.checked_add(elems).filter(|&n| n <= MAX_ELEMS).ok_or("the layout is too large")?;
    }
    Ok(next)
}

/// Checks a file's block size, size and checksum count.
fn validate_blocks(f: &ShardFile) -> std::result::Result<(), String> {
    if !(4096..=1 << 30).contains(&f.block_bytes) || f.size > MAX_ELEMS * 64 {
        return Err(format!("file {} has block size {} or size {} out of range", f.name, f.block_bytes, f.size));
    }
    if f.block_crc32.len() as u64 != f.size.div_ceil(f.block_bytes) {
        return Err(format!("file {} lists {} block checksums for {} bytes", f.name, f.block_crc32.len(), f.size));
    }
    Ok(())
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    pub(crate) fn sample() -> Manifest {
        Manifest {
            format_version: FORMAT_VERSION,
            tag: "global_step3".into(),
            global_step: 3,
            world_size: 2,
            stage: 2,
            precision: "fp32".into(),
            layout: vec![
                LayoutEntry { path: "w".into(), shape: vec![3, 4], offset: 0 },
                LayoutEntry { path: "b".into(), shape: vec![4], offset: 12 },
            ],
            tensors: vec!["master".into(), "optim.momentum.moment_1".into()],
            files: vec![
                ShardFile {
                    name: "rank0.safetensors".into(),
                    rank: 0,
                    ranges: vec![[0, 8]],
                    size: 10,
                    block_bytes: 4096,
                    block_crc32: vec![1],
                },
                ShardFile {
                    name: "rank1.safetensors".into(),
                    rank: 1,
                    ranges: vec![[8, 12], [12, 16]],
                    size: 10,
                    block_bytes: 4096,
                    block_crc32: vec![2],
                },
            ],
            buffers: None,
            engine: serde_json::json!({"global_steps": 3}),
            config: serde_json::json!({}),
            client_state: serde_json::json!({"epoch": 1}),
        }
    }

    #[test]
    fn round_trips_and_every_single_byte_flip_is_detected() {
        let m = sample();
        let bytes = m.to_bytes().unwrap();
        assert_eq!(Manifest::from_bytes(&bytes, Path::new("m.json")).unwrap(), m);
        for i in 0..bytes.len() {
            for flip in [0x01u8, 0x20, 0x80] {
                let mut bad = bytes.clone();
                bad[i] ^= flip;
                assert!(
                    Manifest::from_bytes(&bad, Path::new("m.json")).is_err(),
                    "flip {flip:#x} at byte {i} not detected"
                );
            }
        }
        for len in 0..bytes.len() {
            assert!(Manifest::from_bytes(&bytes[..len], Path::new("m.json")).is_err(), "truncation to {len}");
        }
    }

    #[test]
    fn impossible_manifests_are_rejected_with_a_reason() {
        type Corruption = (fn(&mut Manifest), &'static str);
        let cases: Vec<Corruption> = vec![
            (|m| m.format_version = 9, "format version"),
            (|m| m.tag = "../x".into(), "invalid checkpoint tag"),
            (|m| m.world_size = 0, "world size"),
            (|m| m.layout[1].offset = 13, "starts at 13"),
            (|m| m.layout[0].shape = vec![u64::MAX, 2], "impossible shape"),
            (|m| m.files[1].name = "../../etc/passwd".into(), "not a valid shard name"),
            (|m| m.files[1].ranges[0][0] = 7, "expected a range to start at 8"),
            (|m| m.files[1].ranges[1][1] = 15, "cover 15 of 16"),
            (|m| m.files[1].ranges[1] = [12, 12], "has range [12, 12)"),
            (|m| m.files[0].ranges[0] = [0, 17], "not inside [0, 16)"),
            (|m| m.files[1].ranges = vec![], "lists 0 ranges"),
            (|m| m.files[0].block_crc32 = vec![], "block checksums"),
            (|m| m.tensors[1] = "optim/../x".into(), "tensor name"),
            (|m| m.buffers.as_mut().unwrap().file.name = "../x".into(), "does not hold exactly [0, 5)"),
            (|m| m.buffers.as_mut().unwrap().file.ranges = vec![[0, 4]], "does not hold exactly [0, 5)"),
            (|m| m.buffers.as_mut().unwrap().layout[1].offset = 2, "buffer `bn.running_var` starts at 2"),
            (|m| m.buffers.as_mut().unwrap().layout[1].path = "bn.running_mean".into(), "repeated"),
            (|m| m.buffers.as_mut().unwrap().file.block_crc32 = vec![], "block checksums"),
        ];
        for (corrupt, needle) in cases {
            let mut m = sample();
            m.buffers = Some(BufferSet {
                layout: vec![
                    LayoutEntry { path: "bn.running_mean".into(), shape: vec![3], offset: 0 },
                    LayoutEntry { path: "bn.running_var".into(), shape: vec![2], offset: 3 },
                ],
                file: ShardFile {
                    name: BUFFERS_FILE.into(),
                    rank: 0,
                    ranges: vec![[0, 5]],
                    size: 100,
                    block_bytes: 4096,
                    block_crc32: vec![7],
                },
            });
            assert!(m.validate().is_ok(), "{:?}", m.validate());
            corrupt(&mut m);
            let err = Manifest::from_bytes(&m.to_bytes().unwrap(), Path::new("m.json")).unwrap_err().to_string();
            assert!(err.contains(needle), "{needle}: {err}");
        }
    }
}
