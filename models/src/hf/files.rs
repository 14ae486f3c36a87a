//! A checkpoint's safetensors files, memory-mapped: `model.safetensors`, or the shards a
//! `model.safetensors.index.json` names. Only headers are read when they open; a tensor's
//! bytes are touched when it is read ([`TensorFiles::read_f32`]), so a rank that builds
//! one unit at a time pages in one unit's bytes at a time.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use memmap2::Mmap;
use safetensors::{Dtype, SafeTensors};

use crate::file_error::FileError;
use zerotrain::Precision;
use zerotrain_precision::{BufMut, with_elem};

/// The single-file checkpoint's name.
pub const SINGLE_FILE: &str = "model.safetensors";
/// The sharded checkpoint's index.
pub const INDEX_FILE: &str = "model.safetensors.index.json";

/// One tensor of the files: where it is and what it holds.
#[derive(Debug, Clone)]
pub struct TensorEntry {
    /// Which file (index into the files).
    file: usize,
    /// Its dtype in the file.
    pub dtype: Dtype,
    /// Its shape.
    pub shape: Vec<usize>,
    /// Byte range within the file.
    range: std::ops::Range<usize>,
}

impl TensorEntry {
    /// The type its values are stored in (checked by [`check_float`]).
    pub fn precision(&self) -> Precision {
        match self.dtype {
            Dtype::F32 => Precision::Fp32,
            Dtype::F16 => Precision::Fp16,
            Dtype::BF16 => Precision::Bf16,
            other => unreachable!("check_float refuses {other:?}"),
        }
    }
}

/// A checkpoint's tensors by name, over its memory-mapped files.
#[derive(Debug)]
pub struct TensorFiles {
    files: Vec<(PathBuf, Mmap)>,
    tensors: BTreeMap<String, TensorEntry>,
}

impl TensorFiles {
    /// The tensors of `dir`: its index's shards, or its single file.
    pub fn open(dir: &Path) -> Result<Arc<Self>, FileError> {
        let index = dir.join(INDEX_FILE);
        let single = dir.join(SINGLE_FILE);
        let names: Vec<(PathBuf, Option<Vec<String>>)> = if index.exists() {
            shards_of_index(&index)?.into_iter().map(|(file, names)| (dir.join(file), Some(names))).collect()
        } else if single.exists() {
            vec![(single, None)]
        } else {
            let pickled =
                ["pytorch_model.bin", "pytorch_model.bin.index.json"].into_iter().find(|f| dir.join(f).exists());
            let hint = match pickled {
                Some(file) => format!(
                    ", only {file}: PyTorch's pickle format, which zerotrain does not read (it can run code); save \
                     the model as safetensors (transformers' save_pretrained does by default)"
                ),
                None => String::new(),
            };
            return Err(FileError::new(dir, format!("has neither {SINGLE_FILE} nor {INDEX_FILE}{hint}")));
        };
        let mut out = Self { files: Vec::new(), tensors: BTreeMap::new() };
        for (path, listed) in names {
            out.add(&path, listed.as_deref())?;
        }
        Ok(Arc::new(out))
    }

    /// The tensors of the one safetensors file `path` (an adapter's).
    pub fn open_file(path: &Path) -> Result<Arc<Self>, FileError> {
        let mut out = Self { files: Vec::new(), tensors: BTreeMap::new() };
        out.add(path, None)?;
        Ok(Arc::new(out))
    }

    /// Maps one file and reads its header; `listed`: the names the index gives it.
    fn add(&mut self, path: &Path, listed: Option<&[String]>) -> Result<(), FileError> {
        let file = zerotrain_checkpoint::open_regular(path)
            .map_err(|e| FileError::new(path, format!("cannot open it: {e}")))?;
        // SAFETY: the map is read-only and private to this process; a checkpoint changed
        // by another program while it is mapped is outside what zerotrain supports (the
        // same contract as Hugging Face's and safetensors' own loaders).
        let map = unsafe { Mmap::map(&file) }.map_err(|e| FileError::new(path, format!("cannot map it: {e}")))?;
        let (header, metadata) = SafeTensors::read_metadata(&map)
            .map_err(|e| FileError::new(path, format!("not a safetensors file: {e}")))?;
        let start = 8 + header;
        let id = self.files.len();
        for (name, info) in metadata.tensors() {
            if name.chars().any(char::is_control) {
                // Printed raw in a message, escapes in a name could forge terminal lines.
                return Err(FileError::new(path, format!("a tensor name holds control characters: {name:?}")));
            }
            let (a, b) = info.data_offsets;
            let entry =
                TensorEntry { file: id, dtype: info.dtype, shape: info.shape.clone(), range: start + a..start + b };
            if let Some(other) = self.tensors.insert(name.clone(), entry) {
                let first = &self.files[other.file].0;
                return Err(FileError::new(path, format!("tensor `{name}` is also in {}", first.display())));
            }
        }
        if let Some(listed) = listed
            && let Some(missing) = listed.iter().find(|n| self.tensors.get(*n).is_none_or(|e| e.file != id))
        {
            return Err(FileError::new(
                path,
                format!("the index puts tensor `{missing}` in this file, which does not hold it"),
            ));
        }
        self.files.push((path.to_path_buf(), map));
        Ok(())
    }

    /// The tensor `name`, if the files hold it.
    pub fn get(&self, name: &str) -> Option<&TensorEntry> {
        self.tensors.get(name)
    }

    /// Every tensor name, sorted.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.tensors.keys().map(String::as_str)
    }

    /// The file that holds `entry`.
    pub fn file_of(&self, entry: &TensorEntry) -> &Path {
        &self.files[entry.file].0
    }

    /// The tensor's raw bytes (little-endian, in its dtype).
    pub fn bytes(&self, entry: &TensorEntry) -> &[u8] {
        &self.files[entry.file].1[entry.range.clone()]
    }

    /// The tensor's values as f32 (exact from f16 and bf16), as [`read_into`](Self::read_into).
    pub fn read_f32(&self, entry: &TensorEntry) -> Vec<f32> {
        let mut values = vec![0.0; entry.shape.iter().product()];
        self.read_into(entry, 0..values.len(), BufMut::F32(&mut values));
        values
    }

    /// The CRC-32 of `entry`'s bytes, read a piece at a time and each piece's pages
    /// dropped from the map after (as [`read_into`](Self::read_into) does), so
    /// fingerprinting a checkpoint does not leave it resident.
    pub fn crc32(&self, entry: &TensorEntry) -> u32 {
        let map = &self.files[entry.file].1;
        let mut hasher = crc32fast::Hasher::new();
        for at in entry.range.clone().step_by(8 << 20) {
            let piece = at..(at + (8 << 20)).min(entry.range.end);
            hasher.update(&map[piece.clone()]);
            #[cfg(unix)]
            // SAFETY: as in `read_into`: a read-only private file mapping, no slice held.
            unsafe {
                let _ = map.unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, piece.start, piece.len());
            }
        }
        hasher.finalize()
    }

    /// Asks the kernel to read `entry`'s bytes into the page cache, in order, without
    /// waiting for them (a thread reading ahead of [`read_into`](Self::read_into)).
    pub fn will_need(&self, entry: &TensorEntry) {
        let map = &self.files[entry.file].1;
        // Pieces of a few megabytes, so the reading starts with the tensor's first bytes.
        for at in entry.range.clone().step_by(8 << 20) {
            let _ = map.advise_range(memmap2::Advice::WillNeed, at, (entry.range.end - at).min(8 << 20));
        }
    }

    /// Elements `elems` (row-major) of the tensor into `dst`, in `dst`'s dtype
    /// ([`Precision::read_le_bytes`]: exact into f32 or the tensor's own dtype). The pages
    /// read are then dropped from the map (they are the file's and are read again if needed): otherwise every
    /// page an import touches stays resident, and by its end the process would hold the
    /// whole checkpoint.
    ///
    /// # Panics
    /// If `elems` runs past the tensor or `dst` is not `elems.len()` long.
    pub fn read_into(&self, entry: &TensorEntry, elems: std::ops::Range<usize>, dst: BufMut<'_>) {
        let dtype = entry.precision();
        let width = dtype.bytes_per_elem();
        let at = entry.range.start + elems.start * width..entry.range.start + elems.end * width;
        assert!(at.end <= entry.range.end, "elements {elems:?} run past the tensor");
        let map = &self.files[entry.file].1;
        // On every core: a unit's tensors are hundreds of megabytes.
        const CHUNK: usize = 1 << 16;
        use rayon::prelude::*;
        let bytes = map[at.clone()].par_chunks(CHUNK * width);
        with_elem!(BufMut, dst, dst, _E => {
            dst.par_chunks_mut(CHUNK).zip(bytes).for_each(|(dst, bytes)| dtype.read_le_bytes(bytes, dst.into()))
        });
        #[cfg(unix)]
        // SAFETY: the map is a read-only private file mapping and no slice of it is held
        // any more; dropped pages of such a mapping read back from the file unchanged.
        unsafe {
            let _ = map.unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, at.start, at.len());
        }
    }
}

/// An error unless `entry` is an f32, f16 or bf16 tensor.
pub fn check_float(entry: &TensorEntry) -> Result<(), String> {
    match entry.dtype {
        Dtype::F32 | Dtype::F16 | Dtype::BF16 => Ok(()),
        other => Err(format!("is {other:?}; zerotrain reads F32, F16 and BF16 weights")),
    }
}

/// The shard files of an index and the tensor names each holds, in the index's order.
fn shards_of_index(index: &Path) -> Result<Vec<(String, Vec<String>)>, FileError> {
    #[derive(serde::Deserialize)]
    struct Index {
        weight_map: BTreeMap<String, String>,
    }
    let text = crate::file_error::read_text(index)?;
    let parsed: Index = serde_json::from_str(&text).map_err(|e| FileError::new(index, format!("not an index: {e}")))?;
    let mut shards: Vec<(String, Vec<String>)> = Vec::new();
    for (name, file) in parsed.weight_map {
        if name.chars().chain(file.chars()).any(char::is_control) {
            return Err(FileError::new(
                index,
                format!("its weight_map holds control characters: {name:?} in {file:?}"),
            ));
        }
        if file.is_empty() || file.contains('/') || file.contains('\\') || file.starts_with('.') {
            return Err(FileError::new(
                index,
                format!("tensor `{name}` is in `{file}`, which is not a file name in its folder"),
            ));
        }
        match shards.iter_mut().find(|(f, _)| *f == file) {
            Some((_, names)) => names.push(name),
            None => shards.push((file, vec![name])),
        }
    }
    if shards.is_empty() {
        return Err(FileError::new(index, "its weight_map is empty"));
    }
    Ok(shards)
}
