//! Text data for the main job: a character-level corpus (generated arithmetic by default,
//! or any UTF-8 file), split into training and validation text, and a sampler that gives
//! every rank its part of every global batch.
//!
//! # Note: the sampler has no state
//! Sequence `i` of optimizer step `s` starts at an offset that is a hash of `(seed, s, i)`,
//! so a resumed run continues at exactly the right position from the step counter alone,
//! at any world size (the global batch is the same sequences, however it is split).

use std::path::Path;

use burn::tensor::{Device, Int, Tensor, TensorData};

use zerotrain::random::splitmix64;

/// Largest `--data` file read, in bytes (the corpus keeps 4 bytes per character).
pub const MAX_CORPUS_BYTES: u64 = 256 << 20;

/// Errors building a corpus; each names its cause in one line.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DataError {
    /// The data file could not be read.
    #[error("cannot read data file {path}: {cause}")]
    Read {
        /// The file.
        path: String,
        /// Why.
        cause: std::io::Error,
    },
    /// The data file is larger than [`MAX_CORPUS_BYTES`] (or endless, like `/dev/zero`).
    #[error("data file {path} is larger than {limit} bytes, the most the character corpus holds in memory")]
    TooLarge {
        /// The file.
        path: String,
        /// The limit in bytes.
        limit: u64,
    },
    /// The data file is not UTF-8.
    #[error("data file {path} is not UTF-8 text (first invalid byte at offset {offset})")]
    NotUtf8 {
        /// The file.
        path: String,
        /// Where decoding failed.
        offset: usize,
    },
    /// The corpus is too small for the model's context.
    #[error("{what}: {detail}")]
    TooSmall {
        /// Which corpus.
        what: String,
        /// What is missing.
        detail: String,
    },
}

/// A character-level corpus: vocabulary, and the encoded training and validation text.
#[derive(Debug, Clone)]
pub struct Corpus {
    /// Where it came from (for messages).
    pub name: String,
    /// The characters, in token order.
    pub vocab: Vec<char>,
    /// Training tokens (the first 90%).
    pub train: Vec<u32>,
    /// Validation tokens (the last 10%).
    pub valid: Vec<u32>,
}

impl Corpus {
    /// `lines` lines of decimal addition (`37+58=95`), deterministic from `seed`.
    pub fn arithmetic(lines: usize, seed: u64) -> Self {
        let mut state = seed;
        let mut text = String::with_capacity(lines * 10);
        for _ in 0..lines {
            let (a, b) = (splitmix64(&mut state) % 100, splitmix64(&mut state) % 100);
            text.push_str(&format!("{a}+{b}={}\n", a + b));
        }
        Self::from_text("generated arithmetic", &text)
    }

    /// The UTF-8 file at `path`, of at most [`MAX_CORPUS_BYTES`].
    pub fn from_file(path: &Path) -> Result<Self, DataError> {
        let name = path.display().to_string();
        // Only a regular file (a FIFO's open would wait for a writer, a device never end),
        // refused by its size before it is read.
        let regular = zerotrain_checkpoint::open_regular(path)
            .and_then(|f| f.metadata())
            .map_err(|cause| DataError::Read { path: name.clone(), cause })?;
        if regular.len() > MAX_CORPUS_BYTES {
            return Err(DataError::TooLarge { path: name, limit: MAX_CORPUS_BYTES });
        }
        let bytes = zerotrain_checkpoint::read_bounded(path, MAX_CORPUS_BYTES).map_err(|cause| match cause.kind() {
            std::io::ErrorKind::FileTooLarge => DataError::TooLarge { path: name.clone(), limit: MAX_CORPUS_BYTES },
            _ => DataError::Read { path: name.clone(), cause },
        })?;
        let text = String::from_utf8(bytes)
            .map_err(|e| DataError::NotUtf8 { path: name.clone(), offset: e.utf8_error().valid_up_to() })?;
        Ok(Self::from_text(&name, &text))
    }

    /// A corpus of `text`, split 90/10.
    pub fn from_text(name: &str, text: &str) -> Self {
        let mut vocab: Vec<char> = text.chars().collect::<std::collections::BTreeSet<_>>().into_iter().collect();
        vocab.shrink_to_fit();
        let index: std::collections::HashMap<char, u32> =
            vocab.iter().enumerate().map(|(i, &c)| (c, i as u32)).collect();
        let tokens: Vec<u32> = text.chars().map(|c| index[&c]).collect();
        let split = tokens.len() * 9 / 10;
        Self { name: name.to_string(), vocab, train: tokens[..split].to_vec(), valid: tokens[split..].to_vec() }
    }

    /// Checks that both parts hold at least one window of `block_size + 1` tokens.
    pub fn check(&self, block_size: usize) -> Result<(), DataError> {
        let too_small = |detail: String| DataError::TooSmall { what: self.name.clone(), detail };
        if self.train.is_empty() {
            return Err(too_small("the corpus is empty".into()));
        }
        if self.valid.len() <= block_size {
            let need = (block_size + 1) * 10;
            return Err(too_small(format!(
                "context length {block_size} needs at least {need} characters ({} for validation after the 90/10 split); the corpus has {}",
                block_size + 1,
                self.train.len() + self.valid.len()
            )));
        }
        Ok(())
    }

    /// Encodes `text` (characters outside the vocabulary are skipped).
    pub fn encode(&self, text: &str) -> Vec<u32> {
        text.chars().filter_map(|c| self.vocab.iter().position(|&v| v == c).map(|i| i as u32)).collect()
    }

    /// Decodes tokens.
    pub fn decode(&self, tokens: &[u32]) -> String {
        tokens.iter().map(|&t| self.vocab.get(t as usize).copied().unwrap_or('?')).collect()
    }
}

/// Windows of `block_size + 1` tokens for step `step`: `count` sequences starting at global
/// sequence index `first`, from `tokens` (see the module note).
pub fn windows(
    tokens: &[u32],
    block_size: usize,
    seed: u64,
    step: u64,
    first: u64,
    count: u64,
    device: &Device,
) -> Tensor<2, Int> {
    let span = (tokens.len() - block_size - 1) as u64 + 1;
    let mut data = Vec::with_capacity(count as usize * (block_size + 1));
    for i in first..first + count {
        let mut state = seed ^ step.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ i.wrapping_mul(0xC2B2_AE3D_27D4_EB4F);
        let start = (splitmix64(&mut state) % span) as usize;
        data.extend(tokens[start..start + block_size + 1].iter().map(|&t| i64::from(t)));
    }
    Tensor::from_data(TensorData::new(data, [count as usize, block_size + 1]), device)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_arithmetic_corpus_is_deterministic_and_correct() {
        let a = Corpus::arithmetic(50, 7);
        assert_eq!(a.train, Corpus::arithmetic(50, 7).train);
        assert_eq!(a.vocab.iter().collect::<String>(), "\n+0123456789=");
        let whole = a.decode(&[a.train.clone(), a.valid.clone()].concat());
        assert_eq!(whole.lines().count(), 50);
        for line in whole.lines() {
            let (lhs, sum) = line.split_once('=').unwrap();
            let (x, y) = lhs.split_once('+').unwrap();
            assert_eq!(x.parse::<u32>().unwrap() + y.parse::<u32>().unwrap(), sum.parse::<u32>().unwrap(), "{line}");
        }
    }

    #[test]
    fn small_corpora_are_refused_with_the_numbers() {
        assert!(Corpus::from_text("empty", "").check(8).unwrap_err().to_string().contains("the corpus is empty"));
        let err = Corpus::from_text("short", "abcdefghij").check(32).unwrap_err().to_string();
        assert!(err.contains("context length 32 needs at least 330 characters") && err.contains("has 10"), "{err}");
        assert!(Corpus::from_text("ok", &"ab".repeat(200)).check(32).is_ok());
    }

    #[test]
    fn windows_depend_only_on_step_and_index() {
        let c = Corpus::arithmetic(200, 1);
        let device = Device::flex();
        let whole = windows(&c.train, 8, 3, 5, 0, 4, &device).into_data();
        let split = [windows(&c.train, 8, 3, 5, 0, 2, &device), windows(&c.train, 8, 3, 5, 2, 2, &device)];
        let joined = Tensor::cat(split.to_vec(), 0).into_data();
        assert_eq!(whole, joined, "a global batch is the same however ranks split it");
    }
}
