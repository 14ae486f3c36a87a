//! [`FileError`]: a file the application cannot use, and why; and the reading of files a
//! folder may or may not have ([`read_optional`], [`read_optional_json`]), every one a
//! regular file of bounded size ([`read_file`]).

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

/// The bytes of `path`, a regular file of at most
/// [`MAX_TEXT_FILE_BYTES`](zerotrain_checkpoint::MAX_TEXT_FILE_BYTES) (a FIFO, a device or
/// a larger file is refused by name before it is read).
pub fn read_file(path: &Path) -> Result<Vec<u8>, FileError> {
    read_optional(path)?.ok_or_else(|| FileError::new(path, "cannot read it: no such file"))
}

/// The text of `path`, as [`read_file`] reads it, in UTF-8.
pub fn read_text(path: &Path) -> Result<String, FileError> {
    String::from_utf8(read_file(path)?).map_err(|_| FileError::new(path, "cannot read it: not UTF-8 text"))
}

/// The bytes of `path` as [`read_file`] reads them; `None` where there is no such file.
pub fn read_optional(path: &Path) -> Result<Option<Vec<u8>>, FileError> {
    match zerotrain_checkpoint::read_bounded(path, zerotrain_checkpoint::MAX_TEXT_FILE_BYTES) {
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
