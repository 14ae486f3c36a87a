//! Token files: a corpus tokenized once (`zerotrain tokenize`) and read through a memory
//! map while training, so the corpus is never loaded into memory.
//!
//! # Format (little-endian)
//! | bytes | field |
//! |---|---|
//! | 0..8 | magic `ZTTOKENS` |
//! | 8..12 | version: 2 for a corpus of documents, 3 for fine-tuning sequences with loss masks (version 1 files, which record no tokenizer, are read too) |
//! | 12..16 | bytes per token: 2 (`u16`, ids below 65,536) or 4 (`u32`) |
//! | 16..24 | tokens |
//! | 24..32 | training tokens (the held-out split is the rest; in version 3, whole sequences) |
//! | 32..40 | documents (in version 3, sequences) |
//! | 40..48 | one past the largest id of the tokenizer that wrote it (its id bound) |
//! | 48..52 | CRC-32 of everything after the header |
//! | 52..56 | flags (version 3; zero before): bit 0, the documents are sequences kept apart, with a loss mask |
//! | 56..64 | the fingerprint of the tokenizer that wrote it (its ids and their tokens; versions 2 and 3) |
//! | 64.. | the tokens: documents back to back, each followed by the end-of-text token (a sequence as its row's tokens give it) |
//! | then | each document's end (one past its last token), `u64` each |
//! | then | (flag bit 0) the loss mask: a bit a token, the first in the low bit of the first byte, set where the loss is on it |

use std::path::{Path, PathBuf};

use memmap2::Mmap;

use crate::file_error::FileError;

mod writer;

pub use writer::TokenFileWriter;

const MAGIC: &[u8; 8] = b"ZTTOKENS";
/// A corpus of documents.
const VERSION: u32 = 2;
/// Fine-tuning sequences with loss masks (flags).
const VERSION_SEQUENCES: u32 = 3;
/// Files of this version record no tokenizer fingerprint; they are read as they are.
const VERSION_WITHOUT_FINGERPRINT: u32 = 1;
const HEADER: usize = 64;
/// Flag: the documents are sequences kept apart, and a loss mask follows the table.
const SEQUENCES: u32 = 1;

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
    /// Whether its documents are fine-tuning sequences with a loss mask.
    sequences: bool,
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
        if ![VERSION_WITHOUT_FINGERPRINT, VERSION, VERSION_SEQUENCES].contains(&version) {
            return Err(FileError::new(
                path,
                format!(
                    "token file version {version} is not one this zerotrain reads ({VERSION_WITHOUT_FINGERPRINT} to \
                     {VERSION_SEQUENCES}): a newer zerotrain wrote it?"
                ),
            ));
        }
        let flags = if version == VERSION_SEQUENCES { u32_at(52) } else { 0 };
        if flags & !SEQUENCES != 0 {
            return Err(FileError::new(path, format!("its header has flags {flags:#x} this zerotrain does not know")));
        }
        let sequences = flags & SEQUENCES != 0;
        let width = u32_at(12) as usize;
        let (tokens, train_tokens, documents) = (u64_at(16), u64_at(24), u64_at(32));
        let mask_bytes = if sequences { tokens.div_ceil(8) } else { 0 };
        let expected = (tokens.checked_mul(width as u64)).and_then(|t| {
            t.checked_add(documents.checked_mul(8)?)?.checked_add(mask_bytes)?.checked_add(HEADER as u64)
        });
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
            fingerprint: (version != VERSION_WITHOUT_FINGERPRINT).then(|| u64_at(56)),
            crc: u32_at(48),
            sequences,
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
        let ends = self.document_ends();
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

    /// Whether its documents are fine-tuning sequences, each with a loss mask: rows of
    /// conversations or prompts and completions (`tokenize` of a `.jsonl` or `.json` file
    /// of them), each to be trained on apart from the others, on its counted tokens only.
    pub fn sequences(&self) -> bool {
        self.sequences
    }

    /// Whether the loss is on token `i`: every token of a corpus of documents; in a file
    /// of sequences, where its mask says.
    pub fn counted(&self, i: usize) -> bool {
        if !self.sequences {
            return true;
        }
        let at = HEADER + self.tokens * self.width + self.documents * 8 + i / 8;
        self.map[at] >> (i % 8) & 1 == 1
    }

    /// Tokens of `range` the loss is on.
    pub fn counted_in(&self, range: std::ops::Range<usize>) -> usize {
        match self.sequences {
            false => range.len(),
            true => range.filter(|&i| self.counted(i)).count(),
        }
    }

    /// Each document's (or sequence's) end: one past its last token.
    pub fn document_ends(&self) -> Vec<u64> {
        let table = &self.map[HEADER + self.tokens * self.width..][..self.documents * 8];
        table.chunks_exact(8).map(|b| u64::from_le_bytes(b.try_into().expect("8 bytes"))).collect()
    }

    /// Each document's (or sequence's) tokens, in order.
    pub fn document_ranges(&self) -> impl Iterator<Item = std::ops::Range<usize>> {
        let ends = self.document_ends();
        let starts = std::iter::once(0).chain(ends.clone());
        starts.zip(ends).map(|(start, end)| start as usize..end as usize)
    }

    /// Tokens `range` appended to `out` as `i64`.
    pub fn extend(&self, range: std::ops::Range<usize>, out: &mut Vec<i64>) {
        out.extend(range.map(|i| i64::from(self.token(i))));
    }
}

#[cfg(test)]
mod tests;
