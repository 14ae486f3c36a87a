//! Writing a token file: documents or fine-tuning sequences, in order, through
//! `<path>.partial` and a rename (the format: the parent module).

use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use super::{HEADER, MAGIC, SEQUENCES, TokenFile, VERSION, VERSION_SEQUENCES};
use crate::file_error::FileError;

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
    /// A bit a token, set where the loss is on it (`mask` of [`sequence`](Self::sequence)),
    /// from the first sequence on.
    mask: Vec<u8>,
    /// Whether a sequence was written: the file is one of sequences (version 3).
    sequences: bool,
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
            mask: Vec::new(),
            sequences: false,
        })
    }

    /// Appends one document and its end-of-text token (unless its ids end with it: a
    /// tokenizer that adds it to every text).
    pub fn document(&mut self, ids: &[u32]) -> Result<(), FileError> {
        let end = Some(self.eos).filter(|&eos| ids.last() != Some(&eos));
        self.append(ids, end, |_| true)
    }

    /// Appends one fine-tuning sequence (a row's tokens, no end token added: a chat
    /// template closes its own) with its loss `mask`, a flag a token. The file becomes one
    /// of sequences (version 3), in which every document is kept apart.
    pub fn sequence(&mut self, ids: &[u32], mask: &[bool]) -> Result<(), FileError> {
        if ids.len() != mask.len() {
            return Err(FileError::new(&self.partial, format!("{} tokens with {} mask flags", ids.len(), mask.len())));
        }
        if !self.sequences {
            // The documents before the first sequence count every token.
            self.sequences = true;
            let tokens = self.tokens as usize;
            self.mask = vec![0xFF; tokens / 8];
            if !tokens.is_multiple_of(8) {
                self.mask.push((1u8 << (tokens % 8)) - 1);
            }
        }
        self.append(ids, None, |i| mask[i])
    }

    /// Writes `ids` then `end` as one document, `counted(i)` saying whether the loss is on
    /// the `i`th; an id past the bound is refused before anything is written.
    fn append(&mut self, ids: &[u32], end: Option<u32>, counted: impl Fn(usize) -> bool) -> Result<(), FileError> {
        if let Some(&id) = ids.iter().find(|&&id| u64::from(id) >= self.vocab_size) {
            return Err(FileError::new(
                &self.partial,
                format!("id {id} is not below the tokenizer's id bound {}: nothing is written for it", self.vocab_size),
            ));
        }
        let mut bytes = Vec::with_capacity((ids.len() + 1) * self.width);
        for &id in ids.iter().chain(end.iter()) {
            match self.width {
                2 => bytes.extend_from_slice(&(id as u16).to_le_bytes()),
                _ => bytes.extend_from_slice(&id.to_le_bytes()),
            }
        }
        self.write(&bytes)?;
        self.count(ids.len() + end.iter().len(), counted);
        self.ends.push(self.tokens);
        Ok(())
    }

    /// Counts `n` tokens written, `counted(i)` saying whether the loss is on the `i`th
    /// (kept once the file holds sequences: a corpus of documents needs no mask).
    fn count(&mut self, n: usize, counted: impl Fn(usize) -> bool) {
        if !self.sequences {
            self.tokens += n as u64;
            return;
        }
        for i in 0..n {
            let t = self.tokens as usize + i;
            if t / 8 == self.mask.len() {
                self.mask.push(0);
            }
            if counted(i) {
                self.mask[t / 8] |= 1 << (t % 8);
            }
        }
        self.tokens += n as u64;
    }

    /// The end-of-text token that closes each document.
    pub fn eos(&self) -> u32 {
        self.eos
    }

    /// Documents (and sequences) written so far.
    pub fn documents(&self) -> usize {
        self.ends.len()
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
        let mut train_tokens = self.tokens.saturating_sub(held);
        if self.sequences && held > 0 {
            // Whole sequences held out: the split moves back to a sequence's start, holding
            // the last sequence at least; a single sequence is all training.
            let mut starts = std::iter::once(0).chain(self.ends.iter().copied());
            let fits = starts.rfind(|&s| s <= train_tokens).unwrap_or(0);
            let last_start = self.ends.len().checked_sub(2).map_or(0, |i| self.ends[i]);
            train_tokens = match documents {
                0 | 1 => self.tokens,
                _ if fits == 0 => last_start,
                _ => fits,
            };
        }
        let table: Vec<u8> = self.ends.iter().flat_map(|e| e.to_le_bytes()).collect();
        self.write(&table)?;
        if self.sequences {
            let mask = std::mem::take(&mut self.mask);
            self.write(&mask)?;
        }
        let mut header = [0u8; HEADER];
        header[..8].copy_from_slice(MAGIC);
        let version = if self.sequences { VERSION_SEQUENCES } else { VERSION };
        header[8..12].copy_from_slice(&version.to_le_bytes());
        if self.sequences {
            header[52..56].copy_from_slice(&SEQUENCES.to_le_bytes());
        }
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
