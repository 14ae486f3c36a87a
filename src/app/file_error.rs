//! [`FileError`]: a file the application cannot use, and why.

use std::path::{Path, PathBuf};

/// A problem with one file (a config, a checkpoint's safetensors, a tokenizer, a token
/// file), printed as `FILE: what is wrong`.
#[derive(Debug, thiserror::Error)]
#[error("{file}: {message}")]
pub struct FileError {
    /// The file (or folder).
    pub file: PathBuf,
    /// What is wrong.
    pub message: String,
}

impl FileError {
    /// `message` about `file`.
    pub fn new(file: &Path, message: impl Into<String>) -> Self {
        Self { file: file.to_path_buf(), message: message.into() }
    }
}
