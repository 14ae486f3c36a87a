//! The crate's error type: every variant names the file or checkpoint at fault.

use std::path::PathBuf;

/// Errors from writing, reading and validating checkpoints.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CheckpointError {
    /// A tag that is empty, too long, or could escape the checkpoint directory.
    #[error("invalid checkpoint tag {tag:?}: {reason}")]
    InvalidTag {
        /// The tag as given.
        tag: String,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// A file-system operation failed.
    #[error("{path}: {cause}")]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// The OS error.
        cause: std::io::Error,
    },
    /// A file's contents are not what the manifest recorded (checksum, size, header).
    #[error("{path}: corrupted: {reason}")]
    Corrupted {
        /// The file.
        path: PathBuf,
        /// What did not match.
        reason: String,
    },
    /// The manifest is well-formed JSON but describes an impossible checkpoint.
    #[error("{path}: invalid manifest: {reason}")]
    InvalidManifest {
        /// The manifest.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// No checkpoint where one was asked for.
    #[error("no checkpoint at {path}: {reason}")]
    NotFound {
        /// Where it was looked for.
        path: PathBuf,
        /// Why it is not there.
        reason: String,
    },
    /// The tag already names a checkpoint; zerotrain never overwrites one.
    #[error("{path} already exists; checkpoints are never overwritten (choose another tag or remove it)")]
    Exists {
        /// The existing checkpoint.
        path: PathBuf,
    },
    /// The checkpoint does not fit the model or request it is loaded into.
    #[error("{0}")]
    Mismatch(String),
    /// An output path that cannot be written safely (a directory, or inside the
    /// checkpoint being read).
    #[error("{path}: {reason}")]
    InvalidOutput {
        /// The path given.
        path: PathBuf,
        /// Why it is refused.
        reason: String,
    },
}

impl CheckpointError {
    /// An [`CheckpointError::Io`] for `path`.
    pub fn io(path: impl Into<PathBuf>) -> impl FnOnce(std::io::Error) -> Self {
        let path = path.into();
        move |cause| Self::Io { path, cause }
    }
}

/// Shorthand for results with [`CheckpointError`].
pub type Result<T, E = CheckpointError> = std::result::Result<T, E>;
