//! The engine's error type.

use zerotrain_zero::ZeroError;

use crate::config::ConfigError;

/// Errors from the engine and the launcher.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The config is invalid.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// A collective failed (another rank failed, a timeout, mismatched calls).
    #[error(transparent)]
    Comm(#[from] ZeroError),
    /// fp16 gradients overflowed with the loss scale at its minimum.
    #[error(transparent)]
    LossScale(zerotrain_precision::ScaleError),
    /// The model cannot be trained as given.
    #[error("model: {0}")]
    Model(String),
    /// The engine was driven out of order (e.g. `backward` twice without `forward`).
    #[error("engine used out of order: {0}")]
    Usage(String),
    /// A rank's closure returned an error.
    #[error("rank {rank} failed: {message}")]
    Rank {
        /// The rank.
        rank: usize,
        /// Its error, displayed with its causes.
        message: String,
    },
    /// A rank panicked.
    #[error("rank {rank} panicked: {message}")]
    RankPanicked {
        /// The rank.
        rank: usize,
        /// The panic message.
        message: String,
    },
}

/// Shorthand for results with [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;
