//! [`NcclComm`]'s point-to-point messages on device buffers: `ncclSend`/`ncclRecv` on the
//! communicator's stream. A receive is waited for as the collectives are; a send started
//! with [`Collective::start_on_device`](crate::Collective::start_on_device) is not: its
//! completion is an event on the stream, which a thread of its own polls until the send
//! has finished, the timeout passes or the job is aborted, so that the rank goes on to its
//! next work while the receiver has not yet asked (the note in `Collective`: a pipeline's
//! two stages sending to each other). The stream runs its work in order, so a receive on
//! the same communicator waits on the GPU for the sends before it: the pipeline sends each
//! direction on a communicator of its own.

use std::ffi::c_void;
use std::sync::{Arc, mpsc};

use cudarc::nccl::{result, sys};

use super::{NcclComm, failure};
use crate::ZeroError;
use crate::collective::nccl::call::{NcclDtype, message_buffer};
use crate::collective::nccl::poll::{self, Stopped};
use crate::collective::nccl::wire::nccl_type;
use crate::collective::{Completed, DeviceBuf, DeviceCall, DeviceOp, OpKind, Pending};

impl NcclComm {
    /// A checked message's peer and buffer (`message_buffer`); no buffer when it moves
    /// nothing.
    fn p2p(&self, call: &DeviceCall) -> Result<(usize, Option<DeviceBuf>), ZeroError> {
        let moved = message_buffer(call, self.rank, self.world_size)?;
        self.usable(call.op.kind())?;
        let peer = match call.op {
            DeviceOp::Send(peer) | DeviceOp::Recv(peer) => peer,
            _ => unreachable!("message_buffer takes messages only"),
        };
        Ok((peer, moved))
    }

    /// Enqueues the send or receive of `buf` with `peer` on the stream.
    fn launch_p2p(&self, kind: OpKind, buf: DeviceBuf, peer: usize) -> Result<(), ZeroError> {
        self.stream.context().bind_to_thread().map_err(|e| self.fail(kind, format!("CUDA: {e}")))?;
        let (ty, stream) = (nccl_type(NcclDtype::of(buf.dtype())), self.stream.cu_stream() as sys::cudaStream_t);
        let (ptr, len, p) = (buf.ptr() as *mut c_void, buf.len(), peer as i32);
        // SAFETY: by `DeviceBuf`'s contract the buffer is live, finished memory on this
        // communicator's GPU that nothing else touches until the call has finished (for a
        // started send: until its `Pending` has been waited for); `comm` is live on its own
        // thread (`usable`), `stream` is its.
        let launched = unsafe {
            match kind {
                OpKind::Send => result::send(ptr, len, ty, p, self.comm, stream),
                _ => result::recv(ptr, len, ty, p, self.comm, stream),
            }
        };
        launched.map(drop).map_err(|e| self.fail(kind, format!("{e:?}")))?;
        self.counters.record(kind, (len * buf.dtype().bytes_per_elem()) as u64);
        Ok(())
    }

    /// [`DeviceOp::Send`] or [`DeviceOp::Recv`] run to the end.
    pub(super) fn p2p_on_device(&self, call: &DeviceCall) -> Result<(), ZeroError> {
        let kind = call.op.kind();
        if let (peer, Some(buf)) = self.p2p(call)? {
            self.launch_p2p(kind, buf, peer)?;
            self.wait(kind)?;
        }
        Ok(())
    }

    /// A [`DeviceOp::Send`] started: its `Pending` finishes when the stream has sent it
    /// (module docs), fails when the timeout passes or the job is aborted first.
    pub(super) fn start_send(&self, call: &DeviceCall) -> Result<Pending, ZeroError> {
        let kind = OpKind::Send;
        let (to, Some(buf)) = self.p2p(call)? else {
            return Ok(Pending::ready(Ok(Completed::empty(call.input.dtype()))));
        };
        self.launch_p2p(kind, buf, to)?;
        let event = self.stream.record_event(None).map_err(|e| self.fail(kind, format!("CUDA: {e}")))?;
        let (failed, host, timeout, rank) = (Arc::clone(&self.failed), Arc::clone(&self.host), self.timeout, self.rank);
        let (tx, rx) = mpsc::sync_channel(1);
        let waiter = move || {
            let look = || event.try_is_complete().map_err(|e| format!("CUDA: {e}"));
            let result = match poll::poll(timeout, look, || failure::aborted(&failed, host.as_ref())) {
                Ok(()) => Ok(Completed::empty(buf.dtype())),
                Err(Stopped::Failed(detail)) => Err(ZeroError::Nccl { rank, op: kind.name(), detail }),
                Err(Stopped::Aborted(reason)) => Err(ZeroError::Aborted { rank, reason }),
                Err(Stopped::TimedOut) => Err(failure::timed_out(rank, kind, timeout, vec![to])),
            };
            let _ = tx.send(result);
        };
        let spawned = std::thread::Builder::new().name(format!("nccl-send-{rank}-to-{to}")).spawn(waiter);
        spawned.map_err(|e| self.fail(kind, format!("a thread to wait for the send: {e}")))?;
        Ok(Pending::running(rx))
    }
}
