//! The crate's error type.

/// Errors from layout math and collectives.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ZeroError {
    /// A layout could not be built (zero world size, duplicate path, overflow).
    #[error("invalid flat layout: {0}")]
    InvalidLayout(String),
    /// MPI could not be initialised (already initialised in this process, or without the
    /// thread support zerotrain needs).
    #[error("MPI initialisation failed: {0}")]
    MpiInit(String),
    /// Another rank failed, so this collective (and every later one) cannot complete.
    #[error("rank {rank} aborted the job: {reason}")]
    Aborted {
        /// The rank that failed first.
        rank: usize,
        /// Why it failed.
        reason: String,
    },
    /// Not every rank reached the collective within the timeout.
    #[error("rank {rank}: {op} timed out after {timeout_ms} ms waiting for {}", waiting_for(missing))]
    Timeout {
        /// The rank that gave up waiting.
        rank: usize,
        /// The collective it was in.
        op: &'static str,
        /// The configured timeout.
        timeout_ms: u64,
        /// The ranks that had not arrived, where the backend can tell (empty: unknown).
        missing: Vec<usize>,
    },
    /// Ranks called different collectives, or with different sizes or roots.
    #[error("rank {rank}: collective mismatch: {detail}")]
    Mismatch {
        /// The rank reporting.
        rank: usize,
        /// What differed.
        detail: String,
    },
    /// A rank's communication thread could not start, or stopped.
    #[error("communication thread: {0}")]
    CommThread(String),
    /// NCCL, or the CUDA driver under it, failed (or is missing).
    #[error("rank {rank}: NCCL {op}: {detail}")]
    Nccl {
        /// The rank reporting.
        rank: usize,
        /// What it was doing: `load`, `device`, `init`, or the collective's name.
        op: &'static str,
        /// NCCL's or the driver's error, or what is missing.
        detail: String,
    },
    /// Ranks started as processes could not join one world over TCP (a rank missing, a
    /// fingerprint that differs, the relay gone).
    #[error("rendezvous: {0}")]
    Rendezvous(String),
    /// A buffer has the wrong length for the call.
    #[error("rank {rank}: {op}: {detail}")]
    BadBuffer {
        /// The rank reporting.
        rank: usize,
        /// The collective.
        op: &'static str,
        /// Expected versus actual lengths.
        detail: String,
    },
}

fn waiting_for(missing: &[usize]) -> String {
    match missing {
        [] => "the other ranks".into(),
        [one] => format!("rank {one}, which stalled or left"),
        many => format!("ranks {many:?}, which stalled or left"),
    }
}
