//! Writing a checkpoint atomically.
//!
//! # Note: the commit protocol
//! 1. Rank 0 [`prepare`]s `<root>/<tag>.partial/` (refusing a tag that already exists).
//! 2. Every rank with data [`write_shard`]s its file there, fsyncs it, and records its size
//!    and checksums in a small `rank{r}.json` beside it; rank 0 also writes the model's
//!    buffers ([`write_buffers`]) when it has any.
//! 3. After a barrier, rank 0 [`commit`]s: it builds the manifest from the records, writes
//!    and fsyncs `manifest.json` and the directory, renames `<tag>.partial` to `<tag>`,
//!    fsyncs the root, then replaces `<root>/latest` by writing `latest.partial` and renaming
//!    it over. Each rename is atomic, so a crash at any instant leaves `latest` naming a
//!    complete checkpoint: the old one until the last rename, the new one after it.
//! 4. Retention removes the oldest complete checkpoints beyond `keep_last_n`, never the one
//!    `latest` names, by renaming each to `<tag>.deleting` before deleting it.
//!
//! Leftovers of a killed or failed save (`*.partial` directories, `*.deleting` directories
//! of a killed retention, `latest.partial`) are never read, and the next [`prepare`] removes
//! them: the run folder belongs to one job at a time (the `zerotrain` command locks it).
//! A complete tag that `latest` does not name (killed between the two renames) is kept as
//! `<tag>.orphaned-<unix seconds>[-n]`, a name no other save uses.

use std::fs;
use std::ops::Range;
use std::path::{Path, PathBuf};

use crate::manifest::BUFFERS_FILE;
use crate::shard::{BLOCK_BYTES, SafetensorsWriter, TensorSpec};
use crate::{BufferSet, CheckpointError, LayoutEntry, Manifest, Result, ShardFile, validate_tag};

/// The name of the file naming the newest checkpoint (DeepSpeed's convention).
pub const LATEST: &str = "latest";

/// Testing hook, compiled only with the `crash-points` feature (the test builds turn it
/// on; release behaviour never has it): with `ZEROTRAIN_CRASH_AT=k` in the environment, the
/// `k`-th crash point reached by this process announces itself on stderr and blocks
/// forever, so that a test can SIGKILL the process at exactly that point of a save.
#[cfg(feature = "crash-points")]
pub fn crash_point(name: &str) {
    use std::sync::OnceLock;
    use std::sync::atomic::{AtomicU64, Ordering};
    static TARGET: OnceLock<Option<u64>> = OnceLock::new();
    static REACHED: AtomicU64 = AtomicU64::new(0);
    let Some(target) = *TARGET.get_or_init(|| std::env::var("ZEROTRAIN_CRASH_AT").ok().and_then(|v| v.parse().ok()))
    else {
        return;
    };
    let n = REACHED.fetch_add(1, Ordering::SeqCst) + 1;
    if n == target {
        eprintln!("zerotrain: crash point {n} ({name}) reached; waiting to be killed");
        loop {
            std::thread::sleep(std::time::Duration::from_secs(3600));
        }
    }
}

/// Without the `crash-points` feature, crash points do nothing.
#[cfg(not(feature = "crash-points"))]
#[inline(always)]
pub fn crash_point(_name: &str) {}

/// Suffix of a checkpoint being deleted by retention.
const DELETING: &str = ".deleting";

/// `<root>/<tag>.partial`: where a checkpoint is written before it is committed.
pub fn partial_dir(root: &Path, tag: &str) -> PathBuf {
    root.join(format!("{tag}.partial"))
}

fn sync_dir(dir: &Path) -> Result<()> {
    fs::File::open(dir).and_then(|d| d.sync_all()).map_err(CheckpointError::io(dir))
}

/// Rank 0, before any rank writes: checks the tag, removes the leftovers of killed or
/// failed saves (module note), and creates an empty `<tag>.partial` directory.
///
/// A tag that `latest` names is never replaced ([`CheckpointError::Exists`]). A tag that
/// exists but `latest` does not name is an orphan of a save killed between its rename and
/// the `latest` update (a rerun resumes from the previous checkpoint and reaches the same
/// step again): it is moved aside to a new `<tag>.orphaned-<unix seconds>[-n]`, kept, and
/// reported on stderr.
pub fn prepare(root: &Path, tag: &str) -> Result<PathBuf> {
    validate_tag(tag)?;
    remove_leftovers(root)?;
    let target = root.join(tag);
    if target.exists() {
        let latest =
            crate::bounded::read_bounded(&root.join(LATEST), 4096).ok().and_then(|b| String::from_utf8(b).ok());
        if latest.as_deref().map(str::trim) == Some(tag) {
            return Err(CheckpointError::Exists { path: target });
        }
        let secs = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
        let base = format!("{tag}.orphaned-{secs}");
        let aside = (0..)
            .map(|n| root.join(if n == 0 { base.clone() } else { format!("{base}-{n}") }))
            .find(|p| fs::symlink_metadata(p).is_err())
            .expect("some name is free");
        fs::rename(&target, &aside).map_err(CheckpointError::io(&target))?;
        eprintln!(
            "zerotrain: {} was not the latest checkpoint (left by an interrupted save); moved it to {}",
            target.display(),
            aside.display()
        );
    }
    fs::create_dir_all(root).map_err(CheckpointError::io(root))?;
    let partial = partial_dir(root, tag);
    crash_point("stale partial removed");
    fs::create_dir(&partial).map_err(CheckpointError::io(&partial))?;
    crash_point("partial directory created");
    Ok(partial)
}

/// Removes what killed or failed saves left in `root`: `*.partial` and `*.deleting`
/// entries (directories or files). Complete checkpoints and orphans are never touched.
fn remove_leftovers(root: &Path) -> Result<()> {
    let entries = match fs::read_dir(root) {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(CheckpointError::io(root)(e)),
    };
    for entry in entries {
        let entry = entry.map_err(CheckpointError::io(root))?;
        let name = entry.file_name();
        let Some(name) = name.to_str() else { continue };
        if !(name.ends_with(".partial") || name.ends_with(DELETING)) {
            continue;
        }
        let path = entry.path();
        let removed = match entry.file_type() {
            Ok(t) if t.is_dir() => fs::remove_dir_all(&path),
            _ => fs::remove_file(&path),
        };
        removed.map_err(CheckpointError::io(&path))?;
    }
    Ok(())
}

/// Writes rank `rank`'s shard: `tensors` (name, values over the global flat `ranges`, back
/// to back in that order) into `<partial>/rank{rank}.safetensors`, fsynced, and its record
/// beside it.
pub fn write_shard(
    partial: &Path,
    rank: usize,
    ranges: &[Range<u64>],
    tensors: &[(&str, &[f32])],
) -> Result<ShardFile> {
    let len = ranges.iter().map(|r| (r.end - r.start) as usize).sum::<usize>();
    for (n, v) in tensors {
        assert_eq!(v.len(), len, "tensor `{n}` must cover the shard's ranges");
    }
    let names: Vec<&str> = tensors.iter().map(|(n, _)| *n).collect();
    write_shard_streamed(partial, rank, ranges, &names, |t, out| out.write_f32(tensors[t].1))
}

/// [`write_shard`] with each tensor's values given by `fill(index, writer)` in pieces, in
/// the order of `ranges`: a writer whose states live elsewhere (swap files) streams them
/// without holding a whole tensor. The file's size check catches a `fill` that writes too
/// little or too much.
pub fn write_shard_streamed(
    partial: &Path,
    rank: usize,
    ranges: &[Range<u64>],
    names: &[&str],
    mut fill: impl FnMut(usize, &mut SafetensorsWriter) -> Result<()>,
) -> Result<ShardFile> {
    let name = format!("rank{rank}.safetensors");
    let path = partial.join(&name);
    let len = ranges.iter().map(|r| (r.end - r.start) as usize).sum::<usize>();
    let specs: Vec<TensorSpec> = names
        .iter()
        .map(|n| TensorSpec { name: n.to_string(), dtype: safetensors::Dtype::F32, shape: vec![len] })
        .collect();
    let listed: Vec<String> = ranges.iter().map(|r| format!("{}..{}", r.start, r.end)).collect();
    let meta = [("zerotrain_ranges", listed.join(","))];
    let mut writer = SafetensorsWriter::create(&path, &specs, &meta)?;
    for t in 0..names.len() {
        fill(t, &mut writer)?;
    }
    crash_point("shard written");
    let summary = writer.finish()?;
    crash_point("shard synced");
    let info = ShardFile {
        name,
        rank,
        ranges: ranges.iter().map(|r| [r.start, r.end]).collect(),
        size: summary.size,
        block_bytes: BLOCK_BYTES,
        block_crc32: summary.block_crc32,
    };
    let record = partial.join(format!("rank{rank}.json"));
    let json = serde_json::to_vec(&info).map_err(|e| CheckpointError::Mismatch(format!("shard record: {e}")))?;
    fs::write(&record, json).map_err(CheckpointError::io(&record))?;
    crash_point("shard recorded");
    Ok(info)
}

/// Rank 0: writes the model's buffers (`layout` by module path, `values` back to back) into
/// `<partial>/buffers.safetensors`, fsynced, and returns their record for
/// [`Manifest::buffers`].
pub fn write_buffers(partial: &Path, layout: Vec<LayoutEntry>, values: &[f32]) -> Result<BufferSet> {
    let path = partial.join(BUFFERS_FILE);
    let spec = TensorSpec { name: "buffers".into(), dtype: safetensors::Dtype::F32, shape: vec![values.len()] };
    let paths: Vec<&str> = layout.iter().map(|e| e.path.as_str()).collect();
    let mut writer = SafetensorsWriter::create(&path, &[spec], &[("zerotrain_buffers", paths.join(","))])?;
    writer.write_f32(values)?;
    let summary = writer.finish()?;
    crash_point("buffers written");
    let file = ShardFile {
        name: BUFFERS_FILE.into(),
        rank: 0,
        ranges: vec![[0, values.len() as u64]],
        size: summary.size,
        block_bytes: BLOCK_BYTES,
        block_crc32: summary.block_crc32,
    };
    Ok(BufferSet { layout, file })
}

/// Rank 0, after every rank has written: completes `manifest` with the shard records found
/// in `<tag>.partial`, makes the checkpoint visible and `latest`, and applies retention.
/// Returns the checkpoint's directory.
pub fn commit(root: &Path, mut manifest: Manifest, keep_last_n: Option<usize>) -> Result<PathBuf> {
    let tag = manifest.tag.clone();
    let partial = partial_dir(root, &tag);
    let mut files = Vec::new();
    for entry in fs::read_dir(&partial).map_err(CheckpointError::io(&partial))? {
        let path = entry.map_err(CheckpointError::io(&partial))?.path();
        if path.extension().is_some_and(|e| e == "json") {
            let bytes = crate::bounded::read_bounded(&path, crate::manifest::MAX_MANIFEST_BYTES)
                .map_err(CheckpointError::io(&path))?;
            let info: ShardFile = serde_json::from_slice(&bytes)
                .map_err(|e| CheckpointError::Corrupted { path: path.clone(), reason: e.to_string() })?;
            files.push(info);
            fs::remove_file(&path).map_err(CheckpointError::io(&path))?;
        }
    }
    files.sort_by_key(|f| f.rank);
    manifest.files = files;
    let manifest_path = partial.join("manifest.json");
    manifest.validate().map_err(|reason| CheckpointError::InvalidManifest { path: manifest_path.clone(), reason })?;
    let bytes = manifest.to_bytes()?;
    let file = fs::File::create(&manifest_path).map_err(CheckpointError::io(&manifest_path))?;
    std::io::Write::write_all(&mut &file, &bytes).map_err(CheckpointError::io(&manifest_path))?;
    crash_point("manifest written");
    file.sync_all().map_err(CheckpointError::io(&manifest_path))?;
    sync_dir(&partial)?;
    crash_point("manifest synced");
    let target = root.join(&tag);
    fs::rename(&partial, &target).map_err(CheckpointError::io(&target))?;
    crash_point("checkpoint renamed");
    sync_dir(root)?;
    let latest_tmp = root.join(format!("{LATEST}.partial"));
    fs::write(&latest_tmp, tag.as_bytes()).map_err(CheckpointError::io(&latest_tmp))?;
    fs::File::open(&latest_tmp).and_then(|f| f.sync_all()).map_err(CheckpointError::io(&latest_tmp))?;
    crash_point("latest written");
    fs::rename(&latest_tmp, root.join(LATEST)).map_err(CheckpointError::io(root.join(LATEST)))?;
    sync_dir(root)?;
    crash_point("latest replaced");
    if let Some(keep) = keep_last_n {
        retain(root, keep, &tag)?;
    }
    Ok(target)
}

/// Removes the oldest complete checkpoints in `root` beyond the newest `keep` (by global
/// step), never `latest`'s.
fn retain(root: &Path, keep: usize, latest: &str) -> Result<()> {
    let mut found = crate::list(root)?;
    found.sort_by_key(|(step, tag)| std::cmp::Reverse((*step, tag.clone())));
    for (_, tag) in found.into_iter().skip(keep.max(1)).filter(|(_, t)| t != latest) {
        let doomed = root.join(format!("{tag}{DELETING}"));
        fs::rename(root.join(&tag), &doomed).map_err(CheckpointError::io(root.join(&tag)))?;
        crash_point("old checkpoint hidden");
        fs::remove_dir_all(&doomed).map_err(CheckpointError::io(&doomed))?;
    }
    Ok(())
}
