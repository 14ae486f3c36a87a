//! safetensors files written tensor by tensor and read range by range, checksummed in blocks.
//!
//! # Note: block checksums
//! Each file is checksummed in blocks of [`BLOCK_BYTES`] (CRC32 per block, recorded in the
//! manifest). A reader that needs only some byte ranges (a rank loading its new shard after
//! resharding) reads and verifies just the blocks covering them, so every byte it uses is
//! checked without reading whole files. CRC32 detects every error of up to 32 bits in a
//! block, so every single-byte flip.
//!
//! # Note: why the header is read here, not by the `safetensors` crate
//! `safetensors::SafeTensors::deserialize` and `read_metadata` take the file as one byte
//! slice: a reader would have to load (or map) a whole shard, possibly gigabytes of a
//! hostile or truncated file, before any check. [`ShardReader::open`] instead reads the
//! 8-byte length and then only the header, both through block-verified reads, refuses a
//! header over the format's 100 MiB limit or past the end of the file, and checks every
//! offset with overflow-free arithmetic. The file format itself is the crate's: tests below
//! read files the `safetensors` crate writes and have it read the files written here.

use std::collections::{HashMap, VecDeque};
use std::fs::File;
use std::io::{BufWriter, Read, Seek, SeekFrom, Write};
use std::ops::Range;
use std::path::{Path, PathBuf};

use safetensors::Dtype;

use crate::{CheckpointError, Result, ShardFile};

/// Bytes per checksummed block.
pub const BLOCK_BYTES: u64 = 1 << 20;
/// The largest safetensors header read (the format's own limit).
const MAX_HEADER_BYTES: u64 = 100 << 20;

/// A tensor to write: name, dtype and shape.
#[derive(Debug, Clone)]
pub struct TensorSpec {
    /// Name in the file.
    pub name: String,
    /// Element type.
    pub dtype: Dtype,
    /// Shape.
    pub shape: Vec<usize>,
}

impl TensorSpec {
    fn bytes(&self) -> u64 {
        self.shape.iter().product::<usize>() as u64 * self.dtype.bitsize() as u64 / 8
    }
}

/// What a finished file looks like: size and block checksums.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FileSummary {
    /// Bytes written.
    pub size: u64,
    /// CRC32 of each [`BLOCK_BYTES`] block.
    pub block_crc32: Vec<u32>,
}

/// Writes a safetensors file sequentially: the header from the specs, then each tensor's
/// bytes in spec order (in as many `write` calls as convenient).
pub struct SafetensorsWriter {
    path: PathBuf,
    file: BufWriter<File>,
    block: crc32fast::Hasher,
    block_fill: u64,
    crcs: Vec<u32>,
    size: u64,
    expected_size: u64,
}

impl SafetensorsWriter {
    /// Creates `path` and writes the header for `specs` (and string `metadata`).
    pub fn create(path: &Path, specs: &[TensorSpec], metadata: &[(&str, String)]) -> Result<Self> {
        let mut header = serde_json::Map::new();
        if !metadata.is_empty() {
            let meta = metadata.iter().map(|(k, v)| (k.to_string(), serde_json::Value::from(v.clone()))).collect();
            header.insert("__metadata__".into(), serde_json::Value::Object(meta));
        }
        let mut offset = 0u64;
        for spec in specs {
            let end = offset + spec.bytes();
            let info = serde_json::json!({ "dtype": spec.dtype.to_string(), "shape": spec.shape, "data_offsets": [offset, end] });
            header.insert(spec.name.clone(), info);
            offset = end;
        }
        let mut header = serde_json::to_vec(&header).map_err(|e| CheckpointError::Mismatch(format!("header: {e}")))?;
        // Pad with spaces so the data starts 8-byte aligned (safetensors' recommendation).
        header.resize(header.len().next_multiple_of(8), b' ');
        let file = File::create(path).map_err(CheckpointError::io(path))?;
        let mut writer = Self {
            path: path.to_path_buf(),
            file: BufWriter::with_capacity(1 << 20, file),
            block: crc32fast::Hasher::new(),
            block_fill: 0,
            crcs: Vec::new(),
            size: 0,
            expected_size: 8 + header.len() as u64 + offset,
        };
        writer.write(&(header.len() as u64).to_le_bytes())?;
        writer.write(&header)?;
        Ok(writer)
    }

    /// Appends raw tensor bytes.
    pub fn write(&mut self, mut bytes: &[u8]) -> Result<()> {
        self.file.write_all(bytes).map_err(CheckpointError::io(&self.path))?;
        self.size += bytes.len() as u64;
        while !bytes.is_empty() {
            let take = ((BLOCK_BYTES - self.block_fill) as usize).min(bytes.len());
            self.block.update(&bytes[..take]);
            self.block_fill += take as u64;
            bytes = &bytes[take..];
            if self.block_fill == BLOCK_BYTES {
                self.crcs.push(std::mem::take(&mut self.block).finalize());
                self.block_fill = 0;
            }
        }
        Ok(())
    }

    /// Appends f32 values.
    pub fn write_f32(&mut self, values: &[f32]) -> Result<()> {
        for chunk in values.chunks(1 << 16) {
            let bytes: Vec<u8> = chunk.iter().flat_map(|v| v.to_le_bytes()).collect();
            self.write(&bytes)?;
        }
        Ok(())
    }

    /// Flushes and fsyncs the file; checks that every tensor byte was written.
    pub fn finish(mut self) -> Result<FileSummary> {
        if self.size != self.expected_size {
            return Err(CheckpointError::Mismatch(format!(
                "{}: wrote {} bytes, the header announces {}",
                self.path.display(),
                self.size,
                self.expected_size
            )));
        }
        if self.block_fill > 0 {
            self.crcs.push(self.block.finalize());
        }
        let file = self.file.into_inner().map_err(|e| CheckpointError::io(&self.path)(e.into_error()))?;
        file.sync_all().map_err(CheckpointError::io(&self.path))?;
        Ok(FileSummary { size: self.size, block_crc32: self.crcs })
    }
}

/// One tensor's entry in a safetensors header.
#[derive(serde::Deserialize)]
struct HeaderEntry {
    dtype: String,
    shape: Vec<u64>,
    data_offsets: (u64, u64),
}

/// Verified blocks a reader keeps: the last one. Readers read a tensor's ranges in order
/// (the engine's load reads a unit's master, then each optimizer tensor, and
/// consolidation the master in the global order), so the next range starts in the block
/// the last one ended in, or later; one block held is the one buffer a read needs anyway.
const CACHED_BLOCKS: usize = 1;

/// A shard file opened for verified range reads. The last block read stays verified in
/// memory, so reads of neighbouring small ranges (a tensor-parallel slice's rows) read and
/// check each block once.
pub struct ShardReader {
    path: PathBuf,
    file: File,
    info: ShardFile,
    /// Byte offset of each tensor's data in the file.
    tensor_start: HashMap<String, u64>,
    /// Verified blocks, by index, least recently used first.
    cached: VecDeque<(u64, Vec<u8>)>,
    /// Bytes read from the file so far.
    bytes_read: u64,
}

impl ShardReader {
    /// Opens the shard `info` in `dir`, checking its size, header and that it holds
    /// `tensors` as f32 vectors over its flat range.
    pub fn open(dir: &Path, info: &ShardFile, tensors: &[String]) -> Result<Self> {
        let path = dir.join(&info.name);
        let file = File::open(&path).map_err(|e| match e.kind() {
            std::io::ErrorKind::NotFound => {
                CheckpointError::Corrupted { path: path.clone(), reason: "the shard file is missing".into() }
            }
            _ => CheckpointError::io(&path)(e),
        })?;
        let size = file.metadata().map_err(CheckpointError::io(&path))?.len();
        let info = info.clone();
        let recorded = info.size;
        let mut reader =
            Self { path, file, info, tensor_start: HashMap::new(), cached: VecDeque::new(), bytes_read: 0 };
        if size != recorded {
            return Err(
                reader.corrupted(format!("{size} bytes, the manifest records {recorded} (truncated or extended)"))
            );
        }
        let mut prefix = Vec::new();
        reader.read_verified(0..8.min(size), |b| prefix.extend_from_slice(b))?;
        let header_len =
            u64::from_le_bytes(prefix.clone().try_into().map_err(|_| reader.corrupted("no header".into()))?);
        if header_len > MAX_HEADER_BYTES || 8 + header_len > size {
            return Err(reader.corrupted(format!("header length {header_len} does not fit the file")));
        }
        reader.read_verified(8..8 + header_len, |b| prefix.extend_from_slice(b))?;
        let header: HashMap<String, serde_json::Value> =
            serde_json::from_slice(&prefix[8..]).map_err(|e| reader.corrupted(format!("header: {e}")))?;
        let elems = reader.info.num_elems();
        let data_start = 8 + header_len;
        let data_len = size - data_start;
        let listed = header.keys().filter(|k| *k != "__metadata__").count();
        if listed != tensors.len() {
            return Err(reader.corrupted(format!("{listed} tensors, the manifest lists {}", tensors.len())));
        }
        let mut spans = Vec::new();
        for name in tensors {
            let entry = header.get(name).ok_or_else(|| reader.corrupted(format!("tensor `{name}` is missing")))?;
            let t: HeaderEntry =
                serde_json::from_value(entry.clone()).map_err(|e| reader.corrupted(format!("tensor `{name}`: {e}")))?;
            let (begin, end) = t.data_offsets;
            if t.dtype != "F32" || t.shape != [elems] || end.checked_sub(begin) != Some(4 * elems) || end > data_len {
                return Err(reader.corrupted(format!(
                    "tensor `{name}` is {}{:?} at bytes {begin}..{end}, expected F32[{elems}] within {data_len}",
                    t.dtype, t.shape
                )));
            }
            spans.push((begin, end));
            reader.tensor_start.insert(name.clone(), data_start + begin);
        }
        spans.sort_unstable();
        let tiled = spans.iter().try_fold(0u64, |at, &(b, e)| (b == at).then_some(e));
        if tiled != Some(data_len) {
            return Err(reader.corrupted("tensor data does not tile the file".into()));
        }
        Ok(reader)
    }

    fn corrupted(&self, reason: String) -> CheckpointError {
        CheckpointError::Corrupted { path: self.path.clone(), reason }
    }

    /// Reads elements `elems` of `tensor` (positions in the file's tensor, which holds the
    /// file's ranges back to back) into `out`.
    pub fn read_f32(&mut self, tensor: &str, elems: Range<u64>, out: &mut [f32]) -> Result<()> {
        let start = *self.tensor_start.get(tensor).ok_or_else(|| self.corrupted(format!("no tensor `{tensor}`")))?;
        assert_eq!(out.len() as u64, elems.end - elems.start, "output length must match the range");
        let mut filled = 0;
        let mut carry: Vec<u8> = Vec::new();
        self.read_verified(start + 4 * elems.start..start + 4 * elems.end, |bytes| {
            carry.extend_from_slice(bytes);
            let whole = carry.len() / 4 * 4;
            for chunk in carry[..whole].chunks_exact(4) {
                out[filled] = f32::from_le_bytes([chunk[0], chunk[1], chunk[2], chunk[3]]);
                filled += 1;
            }
            carry.drain(..whole);
        })
    }

    /// Verifies every block of the file.
    pub fn verify(&mut self) -> Result<()> {
        self.read_verified(0..self.info.size, |_| {})
    }

    /// Bytes read from the file since it was opened (a block kept in memory is read once).
    pub fn bytes_read(&self) -> u64 {
        self.bytes_read
    }

    /// Reads the bytes `range`, block by block, verifying each block's checksum before
    /// handing the overlapping part to `sink`; a block still cached is not read again.
    fn read_verified(&mut self, range: Range<u64>, mut sink: impl FnMut(&[u8])) -> Result<()> {
        if range.start >= range.end {
            return Ok(());
        }
        let b = self.info.block_bytes;
        for block in range.start / b..range.end.div_ceil(b) {
            let block_start = block * b;
            let bytes = self.block(block)?;
            let lo = range.start.max(block_start) - block_start;
            let hi = range.end.min(block_start + bytes.len() as u64) - block_start;
            sink(&bytes[lo as usize..hi as usize]);
        }
        Ok(())
    }

    /// Block `block`, verified: from the cache, or read, checked and cached.
    fn block(&mut self, block: u64) -> Result<&[u8]> {
        if let Some(at) = self.cached.iter().position(|(b, _)| *b == block) {
            let hit = self.cached.remove(at).expect("found above");
            self.cached.push_back(hit);
        } else {
            let b = self.info.block_bytes;
            let block_start = block * b;
            let len = (self.info.size - block_start).min(b) as usize;
            // The least recently used block's buffer is reused once the cache is full.
            let mut buf = match self.cached.len() >= CACHED_BLOCKS {
                true => self.cached.pop_front().expect("full").1,
                false => Vec::new(),
            };
            buf.resize(len, 0);
            self.file.seek(SeekFrom::Start(block_start)).map_err(CheckpointError::io(&self.path))?;
            self.file.read_exact(&mut buf).map_err(CheckpointError::io(&self.path))?;
            self.bytes_read += len as u64;
            let crc = crc32fast::hash(&buf);
            if Some(&crc) != self.info.block_crc32.get(block as usize) {
                return Err(self.corrupted(format!(
                    "block {block} (bytes {block_start}..{}) fails its checksum",
                    block_start + len as u64
                )));
            }
            self.cached.push_back((block, buf));
        }
        Ok(&self.cached.back().expect("cached above").1)
    }
}

#[cfg(test)]
mod tests {
    use safetensors::tensor::TensorView;

    use super::*;

    fn temp_dir(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("zerotrain-shard-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    /// The manifest's record of `path`, with CRC32s computed here, block by block.
    fn shard_info(path: &Path, start: u64, end: u64, block_bytes: u64) -> ShardFile {
        let bytes = std::fs::read(path).unwrap();
        ShardFile {
            name: path.file_name().unwrap().to_string_lossy().into_owned(),
            rank: 0,
            ranges: vec![[start, end]],
            size: bytes.len() as u64,
            block_bytes,
            block_crc32: bytes.chunks(block_bytes as usize).map(crc32fast::hash).collect(),
        }
    }

    fn le_bytes(values: &[f32]) -> Vec<u8> {
        values.iter().flat_map(|v| v.to_le_bytes()).collect()
    }

    #[test]
    fn reads_files_the_safetensors_crate_writes() {
        let dir = temp_dir("crate-written");
        let elems = 1000u64;
        let master: Vec<f32> = (0..elems).map(|i| i as f32 * 0.5 - 3.0).collect();
        let moment: Vec<f32> = (0..elems).map(|i| (i as f32).sin()).collect();
        let (master_bytes, moment_bytes) = (le_bytes(&master), le_bytes(&moment));
        let views = [
            ("master", TensorView::new(Dtype::F32, vec![elems as usize], &master_bytes).unwrap()),
            ("optim.exp_avg", TensorView::new(Dtype::F32, vec![elems as usize], &moment_bytes).unwrap()),
        ];
        let metadata = [("format".to_string(), "zerotrain-test".to_string())].into();
        let path = dir.join("rank0.safetensors");
        safetensors::serialize_to_file(views, Some(metadata), &path).unwrap();
        // Small blocks, so a range read crosses block boundaries.
        let info = shard_info(&path, 500, 500 + elems, 256);
        let tensors = ["master".to_string(), "optim.exp_avg".to_string()];
        let mut reader = ShardReader::open(&dir, &info, &tensors).unwrap();
        reader.verify().unwrap();
        for (name, values) in [("master", &master), ("optim.exp_avg", &moment)] {
            let mut out = vec![0.0f32; 700];
            reader.read_f32(name, 123..823, &mut out).unwrap();
            assert_eq!(out, values[123..823], "{name}");
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn the_safetensors_crate_reads_files_written_here() {
        let dir = temp_dir("written-here");
        let path = dir.join("rank1.safetensors");
        let specs = [
            TensorSpec { name: "master".into(), dtype: Dtype::F32, shape: vec![5] },
            TensorSpec { name: "optim.exp_avg_sq".into(), dtype: Dtype::F32, shape: vec![5] },
        ];
        let mut writer = SafetensorsWriter::create(&path, &specs, &[("step", "7".into())]).unwrap();
        writer.write_f32(&[1.0, 2.0, 3.0, 4.0, 5.0]).unwrap();
        writer.write_f32(&[0.5; 5]).unwrap();
        writer.finish().unwrap();
        let bytes = std::fs::read(&path).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let master = st.tensor("master").unwrap();
        assert_eq!((master.dtype(), master.shape()), (Dtype::F32, &[5usize][..]));
        assert_eq!(master.data(), le_bytes(&[1.0, 2.0, 3.0, 4.0, 5.0]));
        assert_eq!(st.tensor("optim.exp_avg_sq").unwrap().data(), le_bytes(&[0.5; 5]));
        let (_, metadata) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
        assert_eq!(metadata.metadata().as_ref().and_then(|m| m.get("step")).map(String::as_str), Some("7"));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
