//! How an [`NcclComm`] call waits and fails.
//!
//! # Note: timeouts
//! A call waits for its work on the stream by polling an event and
//! `ncclCommGetAsyncError`; past `timeout` (or once the job is aborted) it aborts the NCCL
//! communicator (`ncclCommAbort`, as NCCL's own watchdog does), aborts the host
//! communicator so that every rank learns of it, and returns an error. It sleeps between
//! looks (`poll`), so a rank waiting on a slow peer does not spin a core. `ncclCommInitRank`,
//! which cannot be interrupted (a peer that fails after the id exchange leaves it waiting
//! for ever), runs on a thread of its own that the rank waits for the same way, and is left
//! there past the timeout or an abort. (NCCL's non-blocking mode, `blocking = 0`, would make
//! every later call return `ncclInProgress` too; the helper thread bounds the one call that
//! needs it and leaves the calls measured on GPUs as they are.)

use std::sync::Mutex;
use std::time::Duration;

use cudarc::nccl::{result, sys};

use super::NcclComm;
use crate::ZeroError;
use crate::collective::nccl::call::NcclCall;
use crate::collective::nccl::poll::{self, Stopped};
use crate::collective::{Collective, OpKind};

/// Why the job was aborted: the reason this communicator recorded (`failed`), else its
/// host communicator's.
pub(super) fn aborted(failed: &Mutex<Option<String>>, host: &dyn Collective) -> Option<String> {
    failed.lock().unwrap_or_else(|e| e.into_inner()).clone().or_else(|| host.aborted())
}

/// The error of a `kind` call on rank `rank` that waited `timeout` for `missing`.
pub(super) fn timed_out(rank: usize, kind: OpKind, timeout: Duration, missing: Vec<usize>) -> ZeroError {
    ZeroError::Timeout { rank, op: kind.name(), timeout_ms: timeout.as_millis() as u64, missing }
}

impl NcclComm {
    /// Waits for this stream's work, bounded by the timeout and the job's abort (module
    /// note), sleeping between looks.
    pub(super) fn wait(&self, kind: OpKind) -> Result<(), ZeroError> {
        let event = self.stream.record_event(None).map_err(|e| self.fail(kind, format!("CUDA: {e}")))?;
        let look = || {
            if event.try_is_complete().map_err(|e| self.fail(kind, format!("CUDA: {e}")))? {
                return Ok(true);
            }
            let mut state = sys::ncclResult_t::ncclSuccess;
            // SAFETY: `comm` is live (checked by `usable` on this, its own thread) and `state`
            // is a valid place for the result.
            let queried = unsafe { sys::ncclCommGetAsyncError(self.comm, &mut state) };
            if queried != sys::ncclResult_t::ncclSuccess
                || !matches!(state, sys::ncclResult_t::ncclSuccess | sys::ncclResult_t::ncclInProgress)
            {
                return Err(self.fail(kind, format!("asynchronous error {state:?}")));
            }
            Ok(false)
        };
        match poll::poll(self.timeout, look, || self.aborted()) {
            Ok(()) => Ok(()),
            Err(Stopped::Failed(e)) => Err(e),
            Err(Stopped::Aborted(reason)) => {
                self.abort_comm();
                Err(ZeroError::Aborted { rank: self.rank, reason })
            }
            Err(Stopped::TimedOut) => Err(self.fail_with(timed_out(self.rank, kind, self.timeout, Vec::new()))),
        }
    }

    /// Checks the call runs on the owning thread and the communicator is live.
    pub(super) fn usable(&self, kind: OpKind) -> Result<(), ZeroError> {
        if std::thread::current().id() != self.thread {
            let detail = "called off the communication thread that created the communicator".into();
            return Err(ZeroError::Nccl { rank: self.rank, op: kind.name(), detail });
        }
        match self.failed_reason() {
            Some(reason) => {
                self.abort_comm();
                Err(ZeroError::Aborted { rank: self.rank, reason })
            }
            None => Ok(()),
        }
    }

    /// Checks the call may run; true when it has nothing to move (every rank agrees on
    /// that, the lengths being checked equal).
    pub(super) fn skip(&self, call: NcclCall) -> Result<bool, ZeroError> {
        self.usable(call.kind)?;
        Ok(call.count == 0)
    }

    pub(super) fn fail(&self, kind: OpKind, detail: String) -> ZeroError {
        self.fail_with(ZeroError::Nccl { rank: self.rank, op: kind.name(), detail })
    }

    /// Records `error` as the job's failure, aborts the NCCL and host communicators.
    pub(super) fn fail_with(&self, error: ZeroError) -> ZeroError {
        self.abort(&error.to_string());
        self.abort_comm();
        error
    }

    pub(super) fn failed_reason(&self) -> Option<String> {
        self.failed.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// `ncclCommAbort`, once; only on the owning thread (callers checked it).
    pub(super) fn abort_comm(&self) {
        let mut aborted = self.comm_aborted.lock().unwrap_or_else(|e| e.into_inner());
        if !*aborted {
            *aborted = true;
            // SAFETY: `comm` is live and used by no other thread (module note "one thread");
            // after this it is never used again (`comm_aborted`).
            let _ = unsafe { result::comm_abort(self.comm) };
        }
    }
}
