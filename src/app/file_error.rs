//! [`FileError`]: a file the application cannot use, and why; and the reading of files a
//! folder may or may not have ([`read_optional`], [`read_optional_json`]).

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

/// The bytes of `path`; `None` where there is no such file.
pub fn read_optional(path: &Path) -> Result<Option<Vec<u8>>, FileError> {
    match std::fs::read(path) {
        Ok(bytes) => Ok(Some(bytes)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(FileError::new(path, format!("cannot read it: {e}"))),
    }
}

/// The JSON of `path`; `None` where there is no such file.
pub fn read_optional_json(path: &Path) -> Result<Option<serde_json::Value>, FileError> {
    let Some(bytes) = read_optional(path)? else { return Ok(None) };
    serde_json::from_slice(&bytes).map(Some).map_err(|e| FileError::new(path, format!("not JSON: {e}")))
}
