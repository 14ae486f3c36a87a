//! Token files: a corpus tokenized once (`zerotrain tokenize`) and read through a memory
//! map while training, so the corpus is never loaded into memory.
//!
//! # Format (little-endian)
//! | bytes | field |
//! |---|---|
//! | 0..8 | magic `ZTTOKENS` |
//! | 8..12 | version (2; version 1 files, which record no tokenizer, are read too) |
//! | 12..16 | bytes per token: 2 (`u16`, ids below 65,536) or 4 (`u32`) |
//! | 16..24 | tokens |
//! | 24..32 | training tokens (the held-out split is the rest) |
//! | 32..40 | documents |
//! | 40..48 | one past the largest id of the tokenizer that wrote it (its id bound) |
//! | 48..52 | CRC-32 of everything after the header |
//! | 52..56 | zero |
//! | 56..64 | the fingerprint of the tokenizer that wrote it (its ids and their tokens; version 2) |
//! | 64.. | the tokens: documents back to back, each followed by the end-of-text token |
//! | then | each document's end (one past its end-of-text token), `u64` each |

use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use memmap2::Mmap;

use crate::file_error::FileError;

const MAGIC: &[u8; 8] = b"ZTTOKENS";
const VERSION: u32 = 2;
/// Files of this version record no tokenizer fingerprint; they are read as they are.
const VERSION_WITHOUT_FINGERPRINT: u32 = 1;
const HEADER: usize = 64;

/// Writes a token file document by document, through `<path>.partial` and a rename.
pub struct TokenFileWriter {
    path: PathBuf,
    partial: PathBuf,
    out: BufWriter<std::fs::File>,
    crc: crc32fast::Hasher,
    width: usize,
    vocab_size: u64,
    fingerprint: u64,
    eos: u32,
    ends: Vec<u64>,
    tokens: u64,
}

impl TokenFileWriter {
    /// A writer of ids below `vocab_size` (the tokenizer's id bound: one past its largest
    /// id, which decides the width), each document closed by `eos`, recording the
    /// tokenizer's `fingerprint`.
    pub fn create(path: &Path, vocab_size: usize, eos: u32, fingerprint: u64) -> Result<Self, FileError> {
        if eos as usize >= vocab_size {
            return Err(FileError::new(path, format!("the end token {eos} is not below the id bound {vocab_size}")));
        }
        let mut partial = path.as_os_str().to_owned();
        partial.push(".partial");
        let partial = PathBuf::from(partial);
        let file =
            std::fs::File::create(&partial).map_err(|e| FileError::new(&partial, format!("cannot create it: {e}")))?;
        let mut out = BufWriter::with_capacity(1 << 20, file);
        out.write_all(&[0u8; HEADER]).map_err(|e| FileError::new(&partial, format!("cannot write it: {e}")))?;
        let width = if vocab_size <= 1 << 16 { 2 } else { 4 };
        let (crc, ends) = (crc32fast::Hasher::new(), Vec::new());
        Ok(Self {
            path: path.to_path_buf(),
            partial,
            out,
            crc,
            width,
            vocab_size: vocab_size as u64,
            fingerprint,
            eos,
            ends,
            tokens: 0,
        })
    }

    /// Appends one document and its end-of-text token (unless its ids end with it: a
    /// tokenizer that adds it to every text).
    pub fn document(&mut self, ids: &[u32]) -> Result<(), FileError> {
        let end = Some(self.eos).filter(|&eos| ids.last() != Some(&eos));
        if let Some(&id) = ids.iter().find(|&&id| u64::from(id) >= self.vocab_size) {
            return Err(FileError::new(
                &self.partial,
                format!("id {id} is not below the tokenizer's id bound {}: nothing is written for it", self.vocab_size),
            ));
        }
        let mut bytes = Vec::with_capacity((ids.len() + 1) * self.width);
        for &id in ids.iter().chain(end.iter()) {
            if self.width == 2 {
                bytes.extend_from_slice(&(id as u16).to_le_bytes());
            } else {
                bytes.extend_from_slice(&id.to_le_bytes());
            }
        }
        self.write(&bytes)?;
        self.tokens += (ids.len() + end.iter().len()) as u64;
        self.ends.push(self.tokens);
        Ok(())
    }

    /// Gives up the file: what was written is removed, nothing appears at the path.
    pub fn abandon(self) {
        let partial = self.partial.clone();
        drop(self);
        let _ = std::fs::remove_file(partial);
    }

    fn write(&mut self, bytes: &[u8]) -> Result<(), FileError> {
        self.crc.update(bytes);
        self.out.write_all(bytes).map_err(|e| FileError::new(&self.partial, format!("cannot write it: {e}")))
    }

    /// Writes the document table and the header, holding out the last `valid_fraction` of
    /// the tokens (at least one when positive), and renames the file into place. Returns
    /// it, opened.
    pub fn finish(mut self, valid_fraction: f64) -> Result<TokenFile, FileError> {
        let documents = self.ends.len();
        let held = if valid_fraction > 0.0 { ((self.tokens as f64 * valid_fraction).round() as u64).max(1) } else { 0 };
        let train_tokens = self.tokens.saturating_sub(held);
        let table: Vec<u8> = self.ends.iter().flat_map(|e| e.to_le_bytes()).collect();
        self.write(&table)?;
        let mut header = [0u8; HEADER];
        header[..8].copy_from_slice(MAGIC);
        header[8..12].copy_from_slice(&VERSION.to_le_bytes());
        header[12..16].copy_from_slice(&(self.width as u32).to_le_bytes());
        header[16..24].copy_from_slice(&self.tokens.to_le_bytes());
        header[24..32].copy_from_slice(&train_tokens.to_le_bytes());
        header[32..40].copy_from_slice(&(documents as u64).to_le_bytes());
        header[40..48].copy_from_slice(&self.vocab_size.to_le_bytes());
        header[48..52].copy_from_slice(&self.crc.clone().finalize().to_le_bytes());
        header[56..64].copy_from_slice(&self.fingerprint.to_le_bytes());
        let partial = self.partial.clone();
        let io = |e: std::io::Error| FileError::new(&partial, format!("cannot write it: {e}"));
        let mut file = self.out.into_inner().map_err(|e| io(e.into_error()))?;
        use std::io::Seek;
        file.seek(std::io::SeekFrom::Start(0)).map_err(io)?;
        file.write_all(&header).map_err(io)?;
        file.sync_all().map_err(io)?;
        std::fs::rename(&self.partial, &self.path)
            .map_err(|e| FileError::new(&self.path, format!("cannot rename into it: {e}")))?;
        TokenFile::open(&self.path)
    }
}

/// A token file, memory-mapped.
#[derive(Debug)]
pub struct TokenFile {
    path: PathBuf,
    map: Mmap,
    width: usize,
    tokens: usize,
    train_tokens: usize,
    documents: usize,
    vocab_size: usize,
    fingerprint: Option<u64>,
    crc: u32,
}

impl TokenFile {
    /// Opens `path` and checks its header and size (not its checksum: [`verify`](Self::verify)).
    pub fn open(path: &Path) -> Result<Self, FileError> {
        let file = zerotrain_checkpoint::open_regular(path)
            .map_err(|e| FileError::new(path, format!("cannot open it: {e}")))?;
        // SAFETY: read-only and private; a token file rewritten while a job maps it is not
        // supported (tokenize writes a new file and renames it into place instead).
        let map = unsafe { Mmap::map(&file) }.map_err(|e| FileError::new(path, format!("cannot map it: {e}")))?;
        if map.len() < HEADER || &map[..8] != MAGIC {
            return Err(FileError::new(path, "not a zerotrain token file (zerotrain tokenize writes them)"));
        }
        let u32_at = |at: usize| u32::from_le_bytes(map[at..at + 4].try_into().expect("4 bytes"));
        let u64_at = |at: usize| u64::from_le_bytes(map[at..at + 8].try_into().expect("8 bytes"));
        let version = u32_at(8);
        if version != VERSION && version != VERSION_WITHOUT_FINGERPRINT {
            return Err(FileError::new(
                path,
                format!("token file version {version} is not {VERSION_WITHOUT_FINGERPRINT} or {VERSION}"),
            ));
        }
        let width = u32_at(12) as usize;
        let (tokens, train_tokens, documents) = (u64_at(16), u64_at(24), u64_at(32));
        let expected = (tokens.checked_mul(width as u64))
            .and_then(|t| t.checked_add(documents.checked_mul(8)?)?.checked_add(HEADER as u64));
        if !matches!(width, 2 | 4) || train_tokens > tokens || expected != Some(map.len() as u64) {
            return Err(FileError::new(
                path,
                "its header does not match its size: truncated or not written by zerotrain tokenize",
            ));
        }
        Ok(Self {
            path: path.to_path_buf(),
            width,
            tokens: tokens as usize,
            train_tokens: train_tokens as usize,
            documents: documents as usize,
            vocab_size: usize::try_from(u64_at(40)).unwrap_or(usize::MAX),
            fingerprint: (version == VERSION).then(|| u64_at(56)),
            crc: u32_at(48),
            map,
        })
    }

    /// Reads every byte: checks the checksum, that every token is below the vocabulary
    /// size, and that the document ends rise to the token count (a model indexing its
    /// embedding with a larger id would fail inside the backend instead).
    pub fn verify(&self) -> Result<(), FileError> {
        if crc32fast::hash(&self.map[HEADER..]) != self.crc {
            return Err(FileError::new(&self.path, "checksum mismatch: the file is damaged"));
        }
        if let Some(i) = (0..self.tokens).find(|&i| self.token(i) as usize >= self.vocab_size) {
            return Err(FileError::new(
                &self.path,
                format!("token {i} is id {}, not below its vocabulary size {}", self.token(i), self.vocab_size),
            ));
        }
        let table = &self.map[HEADER + self.tokens * self.width..];
        let ends: Vec<u64> =
            table.chunks_exact(8).map(|b| u64::from_le_bytes(b.try_into().expect("8 bytes"))).collect();
        if ends.windows(2).any(|w| w[0] > w[1]) || ends.last().is_some_and(|&e| e != self.tokens as u64) {
            return Err(FileError::new(&self.path, "its document table does not end at its token count"));
        }
        Ok(())
    }

    /// Refuses the file unless `tokenizer` wrote it: the fingerprint it records must be
    /// `tokenizer`'s. A version 1 file records none: then its ids need only be below
    /// `tokenizer`'s id bound, and a warning says that it cannot be told apart from another
    /// tokenizer's.
    pub fn check_written_by(&self, tokenizer: &super::Tokenizer) -> Result<(), FileError> {
        match self.fingerprint {
            // The bound is the tokenizer's own, whatever the header says: one raised (and
            // the checksum recomputed) would let ids past the model's embedding through.
            Some(f) if f == tokenizer.fingerprint() && self.vocab_size > tokenizer.id_bound() => Err(FileError::new(
                &self.path,
                format!(
                    "its header says ids below {}, but the tokenizer that wrote it ({}) has ids below {}: the file \
                     was altered; tokenize the text again",
                    self.vocab_size,
                    tokenizer.file().display(),
                    tokenizer.id_bound()
                ),
            )),
            Some(f) if f == tokenizer.fingerprint() => Ok(()),
            Some(f) => Err(FileError::new(
                &self.path,
                format!(
                    "it was written by another tokenizer than {} (tokenizer fingerprint {f:016x}, not {:016x}): \
                     its ids would mean other tokens; tokenize the text again with this tokenizer",
                    tokenizer.file().display(),
                    tokenizer.fingerprint()
                ),
            )),
            None if self.vocab_size > tokenizer.id_bound() => Err(FileError::new(
                &self.path,
                format!(
                    "it was written by a tokenizer of ids below {}; {} has ids below {}",
                    self.vocab_size,
                    tokenizer.file().display(),
                    tokenizer.id_bound()
                ),
            )),
            None => {
                eprintln!(
                    "warning: {} records no tokenizer (a version 1 token file): it cannot be checked against {}; \
                     tokenize it again to record it",
                    self.path.display(),
                    tokenizer.file().display()
                );
                Ok(())
            }
        }
    }

    /// The file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Tokens in the file.
    pub fn len(&self) -> usize {
        self.tokens
    }

    /// Whether it holds no tokens.
    pub fn is_empty(&self) -> bool {
        self.tokens == 0
    }

    /// Tokens before the held-out split.
    pub fn train_tokens(&self) -> usize {
        self.train_tokens
    }

    /// Documents.
    pub fn documents(&self) -> usize {
        self.documents
    }

    /// The id bound of the tokenizer that wrote it: one past its largest id (every token of
    /// a verified file is below it).
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// The fingerprint of the tokenizer that wrote it ([`Tokenizer::fingerprint`](super::Tokenizer::fingerprint));
    /// `None` for a file of version 1, which records none.
    pub fn fingerprint(&self) -> Option<u64> {
        self.fingerprint
    }

    /// The checksum recorded in its header (identifies the corpus in checkpoints).
    pub fn checksum(&self) -> u32 {
        self.crc
    }

    /// Token `i`.
    pub fn token(&self, i: usize) -> u32 {
        let at = HEADER + i * self.width;
        match self.width {
            2 => u32::from(u16::from_le_bytes([self.map[at], self.map[at + 1]])),
            _ => u32::from_le_bytes(self.map[at..at + 4].try_into().expect("4 bytes")),
        }
    }

    /// Tokens `range` appended to `out` as `i64`.
    pub fn extend(&self, range: std::ops::Range<usize>, out: &mut Vec<i64>) {
        out.extend(range.map(|i| i64::from(self.token(i))));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dir(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("zerotrain-tokens-{}-{name}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    /// A file reads back as written; a damaged one, a truncated one or one whose ids
    /// exceed its vocabulary (checksum recomputed, as a buggy writer would) is refused.
    #[test]
    fn token_files_read_back_and_damage_is_refused_by_name() {
        let path = dir("roundtrip").join("t.tokens");
        let mut w = TokenFileWriter::create(&path, 300, 299, 7).unwrap();
        w.document(&[1, 2, 3]).unwrap();
        w.document(&[250, 7]).unwrap();
        w.document(&[8, 299]).unwrap(); // closed already, by a tokenizer that ends every text
        let file = w.finish(0.3).unwrap();
        file.verify().unwrap();
        let tokens = [1, 2, 3, 299, 250, 7, 299, 8, 299];
        assert_eq!((0..file.len()).map(|i| file.token(i)).collect::<Vec<_>>(), tokens);
        assert_eq!((file.documents(), file.train_tokens(), file.vocab_size()), (3, 6, 300));

        let bytes = std::fs::read(&path).unwrap();
        let write = |name: &str, bytes: &[u8]| {
            let p = path.with_file_name(name);
            std::fs::write(&p, bytes).unwrap();
            p
        };
        let mut flipped = bytes.clone();
        flipped[HEADER] ^= 1;
        let err = TokenFile::open(&write("flipped", &flipped)).unwrap().verify().unwrap_err().to_string();
        assert!(err.contains("flipped: checksum mismatch"), "{err}");
        let err = TokenFile::open(&write("short", &bytes[..bytes.len() - 3])).unwrap_err().to_string();
        assert!(err.contains("short: its header does not match its size"), "{err}");
        let mut big = bytes.clone();
        big[HEADER..HEADER + 2].copy_from_slice(&400u16.to_le_bytes());
        let crc = crc32fast::hash(&big[HEADER..]);
        big[48..52].copy_from_slice(&crc.to_le_bytes());
        let err = TokenFile::open(&write("big", &big)).unwrap().verify().unwrap_err().to_string();
        assert!(err.contains("token 0 is id 400, not below its vocabulary size 300"), "{err}");
        let err = TokenFile::open(&write("text", b"hello")).unwrap_err().to_string();
        assert!(err.contains("not a zerotrain token file"), "{err}");
        std::fs::remove_dir_all(path.parent().unwrap()).unwrap();
    }

    /// An id at or beyond the id bound is refused, never wrapped into the width; a file of
    /// version 1 (before files recorded their tokenizer) still reads, with no fingerprint.
    #[test]
    fn ids_beyond_the_bound_are_refused_and_version_1_files_still_read() {
        let path = dir("bound").join("t.tokens");
        let mut w = TokenFileWriter::create(&path, 300, 299, 7).unwrap();
        let err = w.document(&[1, 300]).unwrap_err().to_string();
        assert!(err.contains("id 300 is not below the tokenizer's id bound 300"), "{err}");
        w.document(&[1, 2]).unwrap();
        let file = w.finish(0.0).unwrap();
        assert_eq!(file.fingerprint(), Some(7));
        let mut bytes = std::fs::read(&path).unwrap();
        bytes[8..12].copy_from_slice(&1u32.to_le_bytes());
        bytes[56..64].fill(0);
        let old = path.with_file_name("old");
        std::fs::write(&old, &bytes).unwrap();
        let file = TokenFile::open(&old).unwrap();
        file.verify().unwrap();
        assert_eq!((file.fingerprint(), file.token(1)), (None, 2));
        let err = TokenFileWriter::create(&path, 300, 300, 7).err().unwrap().to_string();
        assert!(err.contains("the end token 300 is not below the id bound 300"), "{err}");
        std::fs::remove_dir_all(path.parent().unwrap()).unwrap();
    }
}
