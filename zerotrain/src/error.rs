//! The engine's error type.

use std::path::PathBuf;

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
    /// A checkpoint could not be written or read.
    #[error(transparent)]
    Checkpoint(#[from] zerotrain_checkpoint::CheckpointError),
    /// fp16 gradients overflowed with the loss scale at its minimum.
    #[error(transparent)]
    LossScale(zerotrain_precision::ScaleError),
    /// The model cannot be trained as given.
    #[error("model: {0}")]
    Model(String),
    /// The rank's device failed to run what reading `what` waited for (an allocation past
    /// the largest buffer the device makes, a lost device): Burn's reason, on one line.
    #[error("the device failed while reading {what}: {cause}")]
    Device {
        /// What was being read (the loss, a parameter, master weights).
        what: String,
        /// The device's reason, and what to do where that is known.
        cause: String,
    },
    /// A file or folder could not be read or written. (Errors here display their cause in
    /// their own message and do not also return it as `source()`, so that an error chain
    /// prints it once.)
    #[error("{}: {cause}", path.display())]
    Io {
        /// The file or folder.
        path: PathBuf,
        /// Why.
        cause: std::io::Error,
    },
    /// The ranks could not be started as the plan says (e.g. `mpirun` started another
    /// number of processes, or this build has no MPI support).
    #[error("cannot launch: {0}")]
    Launch(String),
    /// A checkpoint cannot be continued from as asked: what it records of the run (its
    /// data position, say) does not fit this run's.
    #[error("cannot resume: {0}")]
    Resume(String),
    /// The engine was driven out of order (e.g. `backward` twice without `forward`).
    #[error("engine used out of order: {0}")]
    Usage(String),
    /// Another rank failed during a phase that all ranks run together (this rank's part
    /// succeeded).
    #[error("rank(s) {ranks:?} failed while {phase}")]
    PeerFailed {
        /// The ranks that failed.
        ranks: Vec<usize>,
        /// What they were doing.
        phase: String,
    },
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

impl Error {
    /// Whether this error only reports another rank's failure (so that [`launch`] can
    /// report the root cause instead).
    ///
    /// [`launch`]: crate::launch
    pub fn is_consequence(&self) -> bool {
        matches!(self, Self::PeerFailed { .. } | Self::Comm(ZeroError::Aborted { .. }))
    }
}

/// Shorthand for results with [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// `e` and the errors beneath it, as "outer: inner: ...".
pub(crate) fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut message = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        message.push_str(": ");
        message.push_str(&s.to_string());
        source = s.source();
    }
    message
}

/// The message of a caught panic's payload (`&str` or `String`, the two `panic!` makes).
pub(crate) fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic without a message".into())
}
