//! Text for the Hugging Face families: a `tokenizer.json` through Hugging Face's own
//! `tokenizers` crate ([`Tokenizer`]), corpora tokenized once into memory-mapped token
//! files ([`tokens`]), and the order a run reads their windows in ([`sampler`]).

pub mod sampler;
pub mod tokens;

use std::path::{Path, PathBuf};

/// A problem with a tokenizer or a text file, naming the file.
#[derive(Debug, thiserror::Error)]
#[error("{file}: {message}")]
pub struct TextError {
    /// The file.
    pub file: PathBuf,
    /// What is wrong.
    pub message: String,
}

/// A `tokenizer.json`: text to token ids and back, exactly as Hugging Face's tokenizers do
/// (same crate), special tokens not added.
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    file: PathBuf,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Tokenizer({}, {} tokens)", self.file.display(), self.vocab_size())
    }
}

impl Tokenizer {
    /// Reads `path`.
    pub fn from_file(path: &Path) -> Result<Self, TextError> {
        let inner = tokenizers::Tokenizer::from_file(path).map_err(|e| TextError {
            file: path.to_path_buf(),
            message: format!("not a usable tokenizer.json: {e}"),
        })?;
        Ok(Self { inner, file: path.to_path_buf() })
    }

    /// The file it was read from.
    pub fn file(&self) -> &Path {
        &self.file
    }

    /// Token ids of `text`.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, TextError> {
        let encoding = self.inner.encode(text, false).map_err(|e| self.error(format!("cannot encode: {e}")))?;
        Ok(encoding.get_ids().to_vec())
    }

    /// The text of `ids`.
    pub fn decode(&self, ids: &[u32]) -> Result<String, TextError> {
        self.inner.decode(ids, false).map_err(|e| self.error(format!("cannot decode: {e}")))
    }

    /// Its vocabulary, added tokens included.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// The id of `token` (an end-of-text token such as `<|endoftext|>`), if it has one.
    pub fn token_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    fn error(&self, message: String) -> TextError {
        TextError { file: self.file.clone(), message }
    }
}
