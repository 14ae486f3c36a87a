//! Swap files: where the NVMe offload tiers keep a rank's states between uses.
//!
//! A [`SwapDir`] is one rank's folder for one tier, `<nvme_path>/zerotrain-<tier>.rank<r>`,
//! locked for as long as the engine lives (a second job pointed at the same `nvme_path`
//! fails at once, naming the lock) and emptied when it is dropped. Swap files are scratch:
//! they are never checkpoints (those are written by `save_checkpoint` elsewhere), and the
//! ones a killed run left behind are removed when the next run takes the lock. A
//! [`SwapFile`] holds one flat f32 range (a unit's master weights, one optimizer moment,
//! a parameter shard); requests read or write whole tiles through the folder's I/O threads
//! (see `io.rs` for why threads and direct I/O).

mod io;

use std::fs::{File, OpenOptions};
use std::ops::Range;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;

pub use io::{ALIGN, AlignedBuf, IoPool, Ticket};

use zerotrain_precision::{BufRef, FlatBuf, Precision};

use crate::config::AioPlan;
use crate::{Error, Result};

/// Elements per [`ALIGN`] bytes: tiles start at multiples of it.
pub const ALIGN_ELEMS: usize = ALIGN / size_of::<f32>();

/// Name of the lock file in a swap folder.
const LOCK: &str = ".lock";
/// Suffix of swap files.
const SUFFIX: &str = ".swap";

/// One rank's swap folder for one tier (module docs).
pub struct SwapDir {
    dir: PathBuf,
    /// Held for the folder's life (the OS releases it if the process dies).
    _lock: File,
    io: Arc<IoPool>,
    /// Whether files are opened with `O_DIRECT` (false on filesystems without it).
    direct: bool,
}

impl SwapDir {
    /// Creates (or takes over from a killed run) `<root>/zerotrain-<tier>.<owner>`, `owner`
    /// naming the rank (`rank3`, `group1.rank0`).
    pub fn open(root: &Path, tier: &str, owner: &str, aio: AioPlan) -> Result<Self> {
        let io_err = |path: &Path| {
            let path = path.to_path_buf();
            move |cause| Error::Io { path, cause }
        };
        std::fs::create_dir_all(root).map_err(io_err(root))?;
        let dir = root.join(format!("zerotrain-{tier}.{owner}"));
        std::fs::create_dir_all(&dir).map_err(io_err(&dir))?;
        let lock_path = dir.join(LOCK);
        let lock =
            OpenOptions::new().create(true).truncate(false).write(true).open(&lock_path).map_err(io_err(&lock_path))?;
        match lock.try_lock() {
            Ok(()) => {}
            Err(std::fs::TryLockError::WouldBlock) => {
                return Err(Error::Io {
                    path: dir,
                    cause: std::io::Error::new(
                        std::io::ErrorKind::ResourceBusy,
                        format!(
                            "in use by another zerotrain run (its lock {} is held): give each job its own nvme_path",
                            lock_path.display()
                        ),
                    ),
                });
            }
            Err(std::fs::TryLockError::Error(cause)) => return Err(Error::Io { path: lock_path, cause }),
        }
        // Whatever is here belongs to a run that is gone: scratch, never a checkpoint.
        remove_swap_files(&dir)?;
        let direct = supports_direct_io(&dir);
        let io = IoPool::new(aio.requests_in_flight, aio.block_size as usize)
            .map_err(|cause| Error::Io { path: dir.clone(), cause })?;
        let io = Arc::new(io);
        Ok(Self { dir, _lock: lock, io, direct })
    }

    /// The folder.
    pub fn path(&self) -> &Path {
        &self.dir
    }

    /// Bytes read from and written to this folder's files so far.
    pub fn moved(&self) -> (u64, u64) {
        self.io.moved()
    }

    /// Whether the files bypass the page cache.
    pub fn is_direct(&self) -> bool {
        self.direct
    }

    /// A new swap file `name` for `elems` values (created empty; sparse until written).
    pub fn file(&self, name: &str, elems: usize) -> Result<SwapFile> {
        let path = self.dir.join(format!("{name}{SUFFIX}"));
        let mut options = OpenOptions::new();
        options.read(true).write(true).create(true).truncate(true);
        if self.direct {
            options.custom_flags(libc::O_DIRECT);
        }
        let file = options.open(&path).map_err(|cause| Error::Io { path: path.clone(), cause })?;
        // At least one page: a request is whole pages (an empty one too: a unit whose range
        // on this rank holds nothing, such as a tied embedding's, still reads and writes).
        let bytes = (elems.max(1).next_multiple_of(ALIGN_ELEMS) * size_of::<f32>()) as u64;
        file.set_len(bytes).map_err(|cause| Error::Io { path: path.clone(), cause })?;
        let inode = file.metadata().map_err(|cause| Error::Io { path: path.clone(), cause })?.ino();
        Ok(SwapFile { path: Arc::new(path), file: Arc::new(file), bytes, inode, io: Arc::clone(&self.io) })
    }
}

impl Drop for SwapDir {
    fn drop(&mut self) {
        // Scratch: nothing here outlives the engine. Failing to clean up leaves files the
        // next run removes.
        let _ = remove_swap_files(&self.dir);
    }
}

/// Removes the `*.swap` files of `dir` (nothing else: a user's file there stays).
fn remove_swap_files(dir: &Path) -> Result<()> {
    let entries = std::fs::read_dir(dir).map_err(|cause| Error::Io { path: dir.to_path_buf(), cause })?;
    for entry in entries.flatten() {
        let path = entry.path();
        if path.extension().is_some_and(|e| format!(".{}", e.to_string_lossy()) == SUFFIX) {
            std::fs::remove_file(&path).map_err(|cause| Error::Io { path, cause })?;
        }
    }
    Ok(())
}

/// Whether files in `dir` open with `O_DIRECT` (tmpfs before Linux 6.6 refuses it).
fn supports_direct_io(dir: &Path) -> bool {
    let probe = dir.join(format!("probe{SUFFIX}"));
    let ok =
        OpenOptions::new().write(true).create(true).truncate(true).custom_flags(libc::O_DIRECT).open(&probe).is_ok();
    let _ = std::fs::remove_file(&probe);
    ok
}

/// One flat f32 range in a file (module docs).
pub struct SwapFile {
    path: Arc<PathBuf>,
    file: Arc<File>,
    /// The file's size as created.
    bytes: u64,
    inode: u64,
    io: Arc<IoPool>,
}

impl SwapFile {
    /// The file.
    #[cfg(test)]
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Starts reading elements `range` (its start a multiple of [`ALIGN_ELEMS`]).
    pub fn read(&self, range: Range<usize>) -> Result<Ticket> {
        self.check_intact()?;
        let buf = AlignedBuf::zeroed(range.len());
        self.check_span(range.start, &buf);
        Ok(self.io.submit(&self.file, &self.path, (range.start * size_of::<f32>()) as u64, buf, false))
    }

    /// Starts writing `buf` at element `start` (a multiple of [`ALIGN_ELEMS`]).
    pub fn write(&self, start: usize, buf: AlignedBuf) -> Result<Ticket> {
        self.check_span(start, &buf);
        Ok(self.io.submit(&self.file, &self.path, (start * size_of::<f32>()) as u64, buf, true))
    }

    /// Reads elements `range` into a vector (waiting).
    pub fn read_vec(&self, range: Range<usize>) -> Result<Vec<f32>> {
        Ok(wait(self.read(range)?)?.as_slice().to_vec())
    }

    /// Writes `values` at element `start` (waiting).
    pub fn write_slice(&self, start: usize, values: &[f32]) -> Result<()> {
        wait(self.write(start, AlignedBuf::from_slice(values))?).map(drop)
    }

    /// The callers' invariant: requests start on a page boundary and end inside the file.
    fn check_span(&self, start: usize, buf: &AlignedBuf) {
        let offset = (start * size_of::<f32>()) as u64;
        assert!(start.is_multiple_of(ALIGN_ELEMS), "swap requests start on a {ALIGN}-byte boundary");
        assert!(offset + buf.capacity_bytes() <= self.bytes, "swap request inside the file");
    }

    /// A swap file truncated, deleted or replaced under a running job is an error naming
    /// it, not zeros read from a hole or values from another file.
    fn check_intact(&self) -> Result<()> {
        let damaged = |why: String| Error::Io {
            path: self.path.as_ref().clone(),
            cause: std::io::Error::new(std::io::ErrorKind::InvalidData, why),
        };
        let meta = std::fs::metadata(self.path.as_ref())
            .map_err(|e| damaged(format!("the swap file is gone ({e}): it was deleted while the job ran")))?;
        if meta.ino() != self.inode {
            return Err(damaged("the swap file was replaced while the job ran".into()));
        }
        if meta.len() < self.bytes {
            return Err(damaged(format!(
                "the swap file was truncated while the job ran ({} bytes, {} expected)",
                meta.len(),
                self.bytes
            )));
        }
        Ok(())
    }
}

/// f32 words that `len` elements of `dtype` take in a swap file: half types are packed two
/// to a word, so a shard is stored in its own dtype's bytes.
pub fn words(dtype: Precision, len: usize) -> usize {
    match dtype {
        Precision::Fp32 => len,
        Precision::Fp16 | Precision::Bf16 => len.div_ceil(2),
    }
}

/// `values`' bytes as the words of an aligned buffer ([`words`] of them).
pub fn pack(values: BufRef<'_>) -> AlignedBuf {
    let len = words(values.dtype(), values.len());
    match values {
        BufRef::F32(v) => AlignedBuf::from_slice(v),
        // A word's bytes are its two halves' little-endian bytes, the first in the low half.
        _ if cfg!(target_endian = "little") => {
            let mut buf = AlignedBuf::zeroed(len);
            values.write_le_bytes(&mut buf.bytes_mut()[..values.len() * values.dtype().bytes_per_elem()]);
            buf
        }
        BufRef::F16(v) => AlignedBuf::from_values(len, pairs(v.iter().map(|h| h.to_bits()))),
        BufRef::Bf16(v) => AlignedBuf::from_values(len, pairs(v.iter().map(|h| h.to_bits()))),
    }
}

/// Consecutive pairs of 16-bit values as the words that hold them (the first in the low
/// half; a last odd one with a zero).
fn pairs<'a>(mut bits: impl Iterator<Item = u16> + 'a) -> impl Iterator<Item = f32> + 'a {
    std::iter::from_fn(move || {
        let a = bits.next()?;
        let b = bits.next().unwrap_or(0);
        Some(f32::from_bits(u32::from(a) | (u32::from(b) << 16)))
    })
}

/// What `pack(&FlatBuf::from_f32(dtype, values))` gives, narrowed straight into the
/// buffer: no whole-size buffer of `dtype` between.
pub fn pack_f32(dtype: Precision, values: &[f32]) -> AlignedBuf {
    if dtype == Precision::Fp32 {
        return AlignedBuf::from_slice(values);
    }
    if cfg!(target_endian = "big") {
        return pack(FlatBuf::from_f32(dtype, values).as_ref());
    }
    let mut buf = AlignedBuf::zeroed(words(dtype, values.len()));
    dtype.narrow_to_le_bytes(values, &mut buf.bytes_mut()[..values.len() * dtype.bytes_per_elem()]);
    buf
}

/// The `len` elements of `dtype` that [`pack`] stored in `words`.
pub fn unpack(words: &[f32], dtype: Precision, len: usize) -> FlatBuf {
    let halves = || words.iter().flat_map(|w| [w.to_bits() as u16, (w.to_bits() >> 16) as u16]).take(len);
    match dtype {
        Precision::Fp32 => FlatBuf::F32(words[..len].to_vec()),
        Precision::Fp16 => FlatBuf::F16(halves().map(half::f16::from_bits).collect()),
        Precision::Bf16 => FlatBuf::Bf16(halves().map(half::bf16::from_bits).collect()),
    }
}

/// Waits for `ticket`, turning a failure into an error naming the file.
pub fn wait(ticket: Ticket) -> Result<AlignedBuf> {
    ticket.wait().map_err(|(path, cause)| Error::Io { path, cause })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn aio() -> AioPlan {
        AioPlan { block_size: 8192, requests_in_flight: 3 }
    }

    fn scratch(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("zerotrain-swap-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        dir
    }

    /// Packing f32 values straight into a swap buffer gives the bits packing their flat
    /// buffer does (an odd length, so the last word holds one half), and unpacks to it.
    #[test]
    fn packing_from_f32_is_packing_the_flat_buffer() {
        let values: Vec<f32> = (0..3001).map(|i| ((i as f32) * 0.37).sin() * 300.0).collect();
        for dtype in [Precision::Fp32, Precision::Fp16, Precision::Bf16] {
            let flat = FlatBuf::from_f32(dtype, &values);
            let (direct, packed) = (pack_f32(dtype, &values), pack(flat.as_ref()));
            let bits = |b: &AlignedBuf| b.as_slice().iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&direct), bits(&packed), "{dtype:?}");
            assert_eq!(unpack(direct.as_slice(), dtype, values.len()), flat, "{dtype:?}");
        }
    }

    /// A file for an empty range (a unit holding nothing on this rank) takes an empty
    /// write and read, as a range of any length does: it was a panic (the request is a
    /// whole page, the file was none).
    #[test]
    fn an_empty_range_reads_and_writes_nothing_without_failing() {
        let root = scratch("empty");
        let dir = SwapDir::open(&root, "optimizer", "rank0", aio()).unwrap();
        let file = dir.file("u0.master", 0).unwrap();
        file.write_slice(0, &[]).unwrap();
        assert_eq!(file.read_vec(0..0).unwrap(), Vec::<f32>::new());
        drop(file);
        drop(dir);
        let _ = std::fs::remove_dir_all(&root);
    }

    /// Values written in tiles through several threads come back bit for bit, from any
    /// aligned offset, and the folder is emptied when dropped.
    #[test]
    fn tiles_round_trip_and_the_folder_is_scratch() {
        let root = scratch("roundtrip");
        let dir = SwapDir::open(&root, "optimizer", "rank0", aio()).unwrap();
        // The engine's fallback where the filesystem refuses O_DIRECT (tmpfs before Linux
        // 6.6), checked against the kernel asked directly; the round trip holds either way.
        let probe = std::ffi::CString::new(root.join("probe").to_string_lossy().as_bytes()).unwrap();
        // SAFETY: open(2) of a valid C string; the descriptor is closed at once.
        let fd = unsafe { libc::open(probe.as_ptr(), libc::O_CREAT | libc::O_WRONLY | libc::O_DIRECT, 0o600) };
        if fd >= 0 {
            // SAFETY: a descriptor this test opened.
            unsafe { libc::close(fd) };
        }
        assert_eq!(dir.is_direct(), fd >= 0, "O_DIRECT in {}", root.display());
        let n = 3 * ALIGN_ELEMS + 17;
        let values: Vec<f32> = (0..n).map(|i| (i as f32).sin()).collect();
        let file = dir.file("u0.master", n).unwrap();
        file.write_slice(0, &values[..2 * ALIGN_ELEMS]).unwrap();
        file.write_slice(2 * ALIGN_ELEMS, &values[2 * ALIGN_ELEMS..]).unwrap();
        assert_eq!(file.read_vec(0..n).unwrap(), values);
        assert_eq!(file.read_vec(ALIGN_ELEMS..n).unwrap(), values[ALIGN_ELEMS..]);
        let path = dir.path().join("u0.master.swap");
        assert!(path.exists());
        drop(file);
        drop(dir);
        assert!(!path.exists(), "swap files are removed with their folder");
        let _ = std::fs::remove_dir_all(&root);
    }

    /// A second job on the same folder is refused, naming the lock; a killed job's files
    /// (its lock died with it) are removed by the next one, and a user's other files stay.
    #[test]
    fn the_folder_is_locked_and_stale_files_are_removed() {
        let root = scratch("lock");
        let first = SwapDir::open(&root, "optimizer", "rank1", aio()).unwrap();
        let err = SwapDir::open(&root, "optimizer", "rank1", aio()).err().unwrap().to_string();
        assert!(err.contains("zerotrain-optimizer.rank1") && err.contains("in use by another zerotrain run"), "{err}");
        assert!(SwapDir::open(&root, "optimizer", "rank2", aio()).is_ok(), "another rank's folder is its own");
        drop(first);
        // What a SIGKILLed run leaves: swap files and a lock file nobody holds.
        let dir = root.join("zerotrain-optimizer.rank0");
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join(LOCK), b"").unwrap();
        std::fs::write(dir.join("u0.master.swap"), b"old").unwrap();
        std::fs::write(dir.join("notes.txt"), b"mine").unwrap();
        let taken = SwapDir::open(&root, "optimizer", "rank0", aio()).unwrap();
        assert!(!dir.join("u0.master.swap").exists(), "a killed run's swap file is removed");
        assert!(dir.join("notes.txt").exists(), "a file that is not a swap file stays");
        drop(taken);
        let _ = std::fs::remove_dir_all(&root);
    }

    /// Half-precision values are stored in their own bytes and come back bit for bit, odd
    /// lengths included; f32 values are themselves.
    #[test]
    fn half_values_pack_two_to_a_word() {
        let values: Vec<f32> = (0..7).map(|i| i as f32 * 1.5 - 2.0).collect();
        for dtype in [Precision::Bf16, Precision::Fp16, Precision::Fp32] {
            let buf = FlatBuf::from_f32(dtype, &values);
            let packed = pack(buf.as_ref());
            assert_eq!(packed.as_slice().len(), words(dtype, 7));
            assert_eq!(unpack(packed.as_slice(), dtype, 7), buf, "{dtype:?}");
        }
        assert_eq!(words(Precision::Bf16, 7), 4);
    }

    /// A swap file truncated or deleted under the job is an error naming it.
    #[test]
    fn damaged_swap_files_are_errors_naming_them() {
        let root = scratch("damaged");
        let dir = SwapDir::open(&root, "param", "rank0", aio()).unwrap();
        let n = 2 * ALIGN_ELEMS;
        let file = dir.file("u1.param", n).unwrap();
        file.write_slice(0, &vec![1.0; n]).unwrap();
        std::fs::OpenOptions::new().write(true).open(file.path()).unwrap().set_len(100).unwrap();
        let err = file.read_vec(0..n).unwrap_err().to_string();
        assert!(err.contains("u1.param.swap") && err.contains("truncated"), "{err}");
        std::fs::remove_file(file.path()).unwrap();
        let err = file.read_vec(0..n).unwrap_err().to_string();
        assert!(err.contains("u1.param.swap") && err.contains("deleted"), "{err}");
        drop(dir);
        let _ = std::fs::remove_dir_all(&root);
    }

    /// A write dropped unwaited (an error path) is finished before the drop returns: a file
    /// opened again under its name (truncated to a new length) never gets its old blocks.
    #[test]
    fn a_dropped_write_lands_before_its_file_is_opened_again() {
        let root = scratch("dropped");
        let dir = SwapDir::open(&root, "optimizer", "rank0", aio()).unwrap();
        let big = 4096 * ALIGN_ELEMS;
        let file = dir.file("u0.exp_avg", big).unwrap();
        drop(file.write(0, AlignedBuf::from_slice(&vec![7.0; big])).unwrap());
        drop(file);
        let small = ALIGN_ELEMS;
        let again = dir.file("u0.exp_avg", small).unwrap();
        again.write_slice(0, &vec![1.0; small]).unwrap();
        let bytes = std::fs::metadata(again.path()).unwrap().len();
        assert_eq!(bytes, (small * size_of::<f32>()) as u64, "the dropped write landed after the reopening");
        assert_eq!(again.read_vec(0..small).unwrap(), vec![1.0; small]);
        drop((again, dir));
        let _ = std::fs::remove_dir_all(&root);
    }
}
