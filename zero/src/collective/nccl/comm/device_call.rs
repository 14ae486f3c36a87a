//! [`NcclComm`]'s collectives on device buffers: NCCL on the caller's memory, on the
//! communicator's stream, waited for as its other calls are; nothing crosses to the host
//! (the note "device buffers" in `comm.rs`).

use std::ffi::c_void;

use cudarc::nccl::result;

use super::NcclComm;
use crate::ZeroError;
use crate::collective::nccl::call::NcclCall;
use crate::collective::nccl::wire::{nccl_op, nccl_type};
use crate::collective::{DeviceCall, DeviceOp};

impl NcclComm {
    /// [`Collective::on_device`](crate::Collective::on_device) (the module notes).
    pub(super) fn run_on_device(&self, call: &DeviceCall) -> Result<(), ZeroError> {
        if let DeviceOp::Send(_) | DeviceOp::Recv(_) = call.op {
            return self.p2p_on_device(call);
        }
        call.check(self.rank)?;
        if call.op == DeviceOp::AllToAll {
            return self.all_to_all_on_device(call);
        }
        let (kind, input, output) = (call.op.kind(), call.input, call.output);
        let nccl = NcclCall::new(kind, input.dtype(), input.len(), output.len(), self.world_size, self.rank)?;
        if self.skip(nccl)? {
            return Ok(());
        }
        self.stream.context().bind_to_thread().map_err(|e| self.fail(kind, format!("CUDA: {e}")))?;
        let (src, dst) = (input.ptr() as *const c_void, output.ptr() as *mut c_void);
        let (count, dtype, stream) = (nccl.count, nccl_type(nccl.dtype), self.stream.cu_stream() as _);
        // SAFETY: by `DeviceBuf`'s contract both are live, finished memory on this
        // communicator's GPU that nothing else touches during the call; `NcclCall` checked
        // their lengths against `count` and the world size, `check` that they are two
        // buffers of one dtype; `comm` is live on its own thread (`skip`), `stream` is its.
        let launched = unsafe {
            match call.op {
                DeviceOp::AllReduce(op) => result::all_reduce(src, dst, count, dtype, nccl_op(op), self.comm, stream),
                DeviceOp::ReduceScatter(op) => {
                    result::reduce_scatter(src, dst, count, dtype, nccl_op(op), self.comm, stream)
                }
                DeviceOp::AllGather => result::all_gather(src, dst, count, dtype, self.comm, stream),
                DeviceOp::AllToAll | DeviceOp::Send(_) | DeviceOp::Recv(_) => unreachable!("run above"),
            }
        };
        launched.map_err(|e| self.fail(kind, format!("{e:?}")))?;
        self.wait(kind)?;
        // The counters' convention takes the whole (unscattered) buffer's length.
        self.record(kind, input.len().max(output.len()), nccl.dtype, 0);
        Ok(())
    }
}
