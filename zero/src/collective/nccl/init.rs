//! Making a rank's NCCL communicator: the CUDA device and stream, the unique id made by
//! the host communicator's rank 0 and shared over it, and `ncclCommInitRank`, which NCCL
//! cannot interrupt, on a thread of its own that the rank waits for within the timeout and
//! the job's abort (`comm.rs`'s note on timeouts). A rank that cannot take part aborts the
//! host communicator, so no rank waits for it.

use std::ffi::c_char;
use std::mem::MaybeUninit;
use std::sync::Arc;
use std::time::Duration;

use cudarc::driver::{CudaContext, CudaStream};
use cudarc::nccl::{result, sys};

use super::id::share_id;
use super::library;
use super::poll::{self, Stopped};
use crate::ZeroError;
use crate::collective::Collective;

/// A communicator's handle on its way from the thread that made it.
struct Handle(sys::ncclComm_t);

// SAFETY: the handle is moved, never shared: NCCL's own rule is one thread at a time, and
// the thread that made it hands it over and forgets it.
unsafe impl Send for Handle {}

/// This rank's new NCCL communicator on CUDA device `ordinal` and the stream it runs on,
/// bound to the calling thread; every rank of `host` calls it at once.
pub(super) fn create(
    host: &dyn Collective,
    ordinal: usize,
    timeout: Duration,
) -> Result<(sys::ncclComm_t, Arc<CudaStream>), ZeroError> {
    let (rank, world_size) = (host.rank(), host.world_size());
    let fail = |op: &'static str, detail: String| ZeroError::Nccl { rank, op, detail };
    let setup = library::check().map_err(|d| fail("load", d)).and_then(|()| {
        let context = CudaContext::new(ordinal)
            .map_err(|e| fail("device", format!("CUDA device {ordinal} does not open: {e}")))?;
        context.new_stream().map_err(|e| fail("device", format!("no stream on CUDA device {ordinal}: {e}")))
    });
    let stream = setup.inspect_err(|e| host.abort(&e.to_string()))?;
    let id = share_id(host, || {
        let id = result::get_uniqueid().map_err(|e| fail("init", format!("ncclGetUniqueId: {e:?}")))?;
        Ok(id.internal.map(|c| c as u8))
    })?;
    let id = sys::ncclUniqueId { internal: id.map(|b| b as c_char) };
    let too_many = || fail("init", format!("{world_size} ranks is more than NCCL takes"));
    let (n, r) = (i32::try_from(world_size).map_err(|_| too_many())?, rank as i32);
    let init_stream = Arc::clone(&stream);
    let init = move || -> Result<Handle, String> {
        init_stream.context().bind_to_thread().map_err(|e| e.to_string())?;
        let mut comm = MaybeUninit::uninit();
        // SAFETY: `comm` is a place NCCL writes the new handle to; `id` is rank 0's id and
        // 0 <= r < n. On success the handle is initialised.
        unsafe {
            result::comm_init_rank(comm.as_mut_ptr(), n, id, r).map_err(|e| format!("ncclCommInitRank: {e:?}"))?;
            Ok(Handle(comm.assume_init()))
        }
    };
    // Bounded: on a thread of its own, waited for like a call.
    let waited = poll::bounded("zerotrain-nccl-init", timeout, init, || host.aborted());
    let comm = match waited {
        Ok(Ok(Handle(comm))) => Ok(comm),
        Ok(Err(detail)) => Err(fail("init", detail)),
        Err(Stopped::Aborted(reason)) => Err(ZeroError::Aborted { rank, reason }),
        Err(Stopped::TimedOut) => {
            Err(ZeroError::Timeout { rank, op: "init", timeout_ms: timeout.as_millis() as u64, missing: Vec::new() })
        }
        Err(Stopped::Failed(e)) => Err(fail("init", e.to_string())),
    };
    let comm = comm.inspect_err(|e| host.abort(&e.to_string()))?;
    stream.context().bind_to_thread().map_err(|e| fail("init", e.to_string()))?;
    Ok((comm, stream))
}
