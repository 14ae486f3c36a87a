//! Reading a checkpoint: find it, validate it, read flat ranges from whichever shards hold
//! them.

use std::collections::VecDeque;
use std::fs;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use crate::bounded::read_bounded;
use crate::commit::LATEST;
use crate::manifest::MAX_MANIFEST_BYTES;

/// The largest `latest` file read: a tag and a newline (tags are far shorter).
const MAX_LATEST_BYTES: u64 = 4096;
use crate::shard::ShardReader;
use crate::{CheckpointError, LayoutEntry, Manifest, Result, validate_tag};

/// A checkpoint's buffers as [`Checkpoint::read_buffers`] returns them: each buffer's
/// place (module path, shape) and its values.
pub type SavedBuffers = Vec<(LayoutEntry, Vec<f32>)>;

/// An opened, validated checkpoint.
#[derive(Debug, Clone)]
pub struct Checkpoint {
    dir: PathBuf,
    manifest: Manifest,
    /// Every range of every shard file, sorted by start (they tile the flat order).
    index: Vec<Piece>,
    /// Shard files opened by reads so far (shared by clones).
    readers: Arc<Mutex<Readers>>,
}

/// Shard files kept open between reads, by file index, least recently used first: a
/// tensor-parallel rank's slice is many short ranges that alternate between files, and each
/// file is opened (its header read and checked) once, and each of its blocks read once for
/// each tensor read through it in order, rather than once per range.
#[derive(Default)]
struct Readers {
    open: VecDeque<(usize, ShardReader)>,
    /// Bytes read by readers no longer open.
    closed_bytes: u64,
}

impl std::fmt::Debug for Readers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Readers").field("open", &self.open.len()).finish()
    }
}

/// The most shard files kept open at once.
const OPEN_FILES: usize = 16;

impl Readers {
    /// The reader of file `file`, opening it (and closing the least recently used past
    /// [`OPEN_FILES`]) where it is not open.
    fn get(&mut self, file: usize, open: impl FnOnce() -> Result<ShardReader>) -> Result<&mut ShardReader> {
        match self.open.iter().position(|(f, _)| *f == file) {
            Some(at) => {
                let hit = self.open.remove(at).expect("found above");
                self.open.push_back(hit);
            }
            None => {
                if self.open.len() >= OPEN_FILES {
                    let (_, closed) = self.open.pop_front().expect("full");
                    self.closed_bytes += closed.bytes_read();
                }
                self.open.push_back((file, open()?));
            }
        }
        Ok(&mut self.open.back_mut().expect("pushed above").1)
    }

    fn bytes_read(&self) -> u64 {
        self.closed_bytes + self.open.iter().map(|(_, r)| r.bytes_read()).sum::<u64>()
    }
}

/// Where one range of the flat order is stored.
#[derive(Debug, Clone, Copy)]
struct Piece {
    /// The range in the flat order.
    start: u64,
    end: u64,
    /// The file (index into the manifest's files) and the range's first position in its
    /// tensors.
    file: usize,
    at: u64,
}

/// The sorted index of `manifest`'s ranges (validated: they tile the flat order).
fn index(manifest: &Manifest) -> Vec<Piece> {
    let mut index = Vec::new();
    for (file, f) in manifest.files.iter().enumerate() {
        let mut at = 0;
        for &[start, end] in &f.ranges {
            index.push(Piece { start, end, file, at });
            at += end - start;
        }
    }
    index.sort_unstable_by_key(|p| p.start);
    index
}

/// The 64-bit FNV-1a hash (for [`Checkpoint::identity`]; fields are written with their
/// lengths, so that no two sequences of fields write the same bytes).
struct Fnv1a(u64);

impl Default for Fnv1a {
    fn default() -> Self {
        Self(0xcbf2_9ce4_8422_2325)
    }
}

impl Fnv1a {
    fn write(&mut self, bytes: &[u8]) {
        for &b in (bytes.len() as u64).to_le_bytes().iter().chain(bytes) {
            self.0 = (self.0 ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
        }
    }
}

impl Checkpoint {
    /// Opens `<root>/<tag>`, or the checkpoint `<root>/latest` names when `tag` is `None`,
    /// and validates its manifest.
    pub fn open(root: &Path, tag: Option<&str>) -> Result<Self> {
        let tag = match tag {
            Some(tag) => tag.to_string(),
            None => {
                let latest = root.join(LATEST);
                let bytes = read_bounded(&latest, MAX_LATEST_BYTES).map_err(|e| match e.kind() {
                    std::io::ErrorKind::NotFound => CheckpointError::NotFound {
                        path: latest.clone(),
                        reason: "no `latest` file: nothing was saved here".into(),
                    },
                    _ => CheckpointError::io(&latest)(e),
                })?;
                let text = String::from_utf8(bytes).map_err(|_| CheckpointError::Corrupted {
                    path: latest.clone(),
                    reason: "not UTF-8 text naming a tag".into(),
                })?;
                text.trim().to_string()
            }
        };
        validate_tag(&tag)?;
        let dir = root.join(&tag);
        let path = dir.join("manifest.json");
        let bytes = read_bounded(&path, MAX_MANIFEST_BYTES).map_err(|e| match e.kind() {
            std::io::ErrorKind::NotFound => {
                CheckpointError::NotFound { path: path.clone(), reason: "no manifest".into() }
            }
            std::io::ErrorKind::InvalidData | std::io::ErrorKind::FileTooLarge => {
                CheckpointError::Corrupted { path: path.clone(), reason: e.to_string() }
            }
            _ => CheckpointError::io(&path)(e),
        })?;
        let manifest = Manifest::from_bytes(&bytes, &path)?;
        if manifest.tag != tag {
            return Err(CheckpointError::InvalidManifest {
                path,
                reason: format!("it describes tag {:?}, not {tag:?}", manifest.tag),
            });
        }
        Ok(Self { dir, index: index(&manifest), manifest, readers: Arc::default() })
    }

    /// The checkpoint's directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The validated manifest.
    pub fn manifest(&self) -> &Manifest {
        &self.manifest
    }

    /// What tells this checkpoint from another: a 64-bit FNV-1a hash of its tag, its step and
    /// every shard file's name, size and block checksums, so two checkpoints that differ in
    /// any byte of their shards (or in tag or step) differ here but for a 2^-64 chance. Ranks
    /// compare it to know they opened the same one.
    pub fn identity(&self) -> u64 {
        let mut hash = Fnv1a::default();
        hash.write(self.manifest.tag.as_bytes());
        hash.write(&self.manifest.global_step.to_le_bytes());
        for file in &self.manifest.files {
            hash.write(file.name.as_bytes());
            hash.write(&file.size.to_le_bytes());
            file.block_crc32.iter().for_each(|crc| hash.write(&crc.to_le_bytes()));
        }
        hash.0
    }

    /// Reads elements `range` of the flat tensor `tensor` (`master` or an `optim.*` name)
    /// into `out`, from whichever shard files hold them, verifying every block read.
    pub fn read_range(&self, tensor: &str, range: Range<u64>, out: &mut [f32]) -> Result<()> {
        if out.len() as u64 != range.end.saturating_sub(range.start) || range.end > self.manifest.num_elems() {
            return Err(CheckpointError::Mismatch(format!(
                "range {range:?} of `{tensor}` does not fit a checkpoint of {} elements",
                self.manifest.num_elems()
            )));
        }
        if !self.manifest.tensors.iter().any(|t| t == tensor) {
            return Err(CheckpointError::Mismatch(format!("the checkpoint holds no tensor `{tensor}`")));
        }
        let first = self.index.partition_point(|p| p.end <= range.start);
        let mut readers = self.readers.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        for piece in self.index[first..].iter().take_while(|p| p.start < range.end) {
            let (lo, hi) = (range.start.max(piece.start), range.end.min(piece.end));
            let info = &self.manifest.files[piece.file];
            let reader = readers.get(piece.file, || ShardReader::open(&self.dir, info, &self.manifest.tensors))?;
            let dst = &mut out[(lo - range.start) as usize..(hi - range.start) as usize];
            let at = piece.at + (lo - piece.start);
            reader.read_f32(tensor, at..at + (hi - lo), dst)?;
        }
        Ok(())
    }

    /// Bytes read from the shard files by [`read_range`](Self::read_range) so far (this
    /// checkpoint's and its clones'): each file's header once, each block it needed once,
    /// however many ranges came from it.
    pub fn bytes_read(&self) -> u64 {
        self.readers.lock().unwrap_or_else(std::sync::PoisonError::into_inner).bytes_read()
    }

    /// Reads every block of every shard file (and the buffers' file) and checks its
    /// checksum.
    pub fn verify(&self) -> Result<()> {
        for file in &self.manifest.files {
            ShardReader::open(&self.dir, file, &self.manifest.tensors)?.verify()?;
        }
        if let Some(buffers) = &self.manifest.buffers {
            ShardReader::open(&self.dir, &buffers.file, &["buffers".to_string()])?.verify()?;
        }
        Ok(())
    }

    /// The model's buffers, by module path, verified as they are read; `None` for a
    /// checkpoint that holds none (a model without buffers, or format 1-2).
    pub fn read_buffers(&self) -> Result<Option<SavedBuffers>> {
        let Some(buffers) = &self.manifest.buffers else { return Ok(None) };
        let mut reader = ShardReader::open(&self.dir, &buffers.file, &["buffers".to_string()])?;
        let mut out = Vec::with_capacity(buffers.layout.len());
        for entry in &buffers.layout {
            let elems = entry.shape.iter().product::<u64>();
            // The reader checked the file holds the layout's elements: this is bounded.
            let mut values = vec![0.0f32; elems as usize];
            reader.read_f32("buffers", entry.offset..entry.offset + elems, &mut values)?;
            out.push((entry.clone(), values));
        }
        Ok(Some(out))
    }
}

/// The complete checkpoints in `root` (those whose manifest opens), as (global step, tag).
pub fn list(root: &Path) -> Result<Vec<(u64, String)>> {
    let mut found = Vec::new();
    let entries = match fs::read_dir(root) {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(found),
        Err(e) => return Err(CheckpointError::io(root)(e)),
    };
    for entry in entries {
        let entry = entry.map_err(CheckpointError::io(root))?;
        let Some(tag) = entry.file_name().to_str().map(str::to_string) else { continue };
        if validate_tag(&tag).is_err() || !entry.path().join("manifest.json").is_file() {
            continue;
        }
        if let Ok(ckpt) = Checkpoint::open(root, Some(&tag)) {
            found.push((ckpt.manifest.global_step, tag));
        }
    }
    Ok(found)
}
