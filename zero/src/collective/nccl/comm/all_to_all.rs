//! [`NcclComm`]'s uneven all-to-all: one group of `ncclSend`/`ncclRecv`, a pair per peer
//! with anything to move (this rank included, as NCCL allows), on the communicator's
//! stream. Host buffers are copied to the device and the result back, as the other
//! collectives' are (the note "host buffers" in `comm.rs`).

use std::ffi::c_void;

use cudarc::driver::{CudaSlice, DevicePtrMut};
use cudarc::nccl::{result, sys};
use zerotrain_precision::{BufMut, BufRef};

use super::NcclComm;
use crate::ZeroError;
use crate::collective::DeviceCall;
use crate::collective::OpKind;
use crate::collective::all_to_all::{check, equal_counts, part_ranges};
use crate::collective::nccl::call::NcclDtype;
use crate::collective::nccl::wire::{bytes, bytes_mut, nccl_type};

impl NcclComm {
    /// [`Collective::all_to_all`](crate::Collective::all_to_all) on host buffers.
    pub(super) fn all_to_all_host(
        &self,
        input: BufRef<'_>,
        send_counts: &[usize],
        output: BufMut<'_>,
        recv_counts: &[usize],
    ) -> Result<(), ZeroError> {
        let kind = OpKind::AllToAll;
        check(self.rank, self.world_size, &input, send_counts, &output, recv_counts)?;
        self.usable(kind)?;
        if input.is_empty() && output.is_empty() {
            return Ok(());
        }
        let dtype = NcclDtype::of(input.dtype());
        let device = |e: cudarc::driver::DriverError| self.fail(kind, format!("CUDA: {e}"));
        // One byte at least: an empty side still needs an address to pass.
        let mut src: CudaSlice<u8> = match input.is_empty() {
            true => self.stream.alloc_zeros::<u8>(1).map_err(device)?,
            false => self.stream.clone_htod(bytes(input)).map_err(device)?,
        };
        let out_bytes = output.len() * dtype.size();
        let mut dst = self.stream.alloc_zeros::<u8>(out_bytes.max(1)).map_err(device)?;
        {
            let (src_ptr, _src_done) = src.device_ptr_mut(&self.stream);
            let (dst_ptr, _dst_done) = dst.device_ptr_mut(&self.stream);
            // SAFETY: both are this communicator's device buffers, live for the call, holding
            // the counts' totals (checked above).
            unsafe { self.launch_all_to_all(src_ptr, dst_ptr, dtype, send_counts, recv_counts) }?;
        }
        self.wait(kind)?;
        if out_bytes > 0 {
            let recv = bytes_mut(output);
            self.stream.memcpy_dtoh(&dst.slice(..out_bytes), recv).map_err(device)?;
            self.stream.synchronize().map_err(device)?;
        }
        self.record_all_to_all(dtype, send_counts, recv_counts);
        Ok(())
    }

    /// [`DeviceOp::AllToAll`](crate::DeviceOp::AllToAll) on the caller's device buffers
    /// (checked by the caller as two buffers of one dtype).
    pub(super) fn all_to_all_on_device(&self, call: &DeviceCall) -> Result<(), ZeroError> {
        let (input, output) = (call.input, call.output);
        let counts = equal_counts(self.rank, self.world_size, input.len(), output.len())?;
        self.usable(OpKind::AllToAll)?;
        if input.is_empty() {
            return Ok(());
        }
        let dtype = NcclDtype::of(input.dtype());
        let context = self.stream.context().bind_to_thread();
        context.map_err(|e| self.fail(OpKind::AllToAll, format!("CUDA: {e}")))?;
        // SAFETY: by `DeviceBuf`'s contract both are live, finished memory on this
        // communicator's GPU that nothing else touches during the call; `equal_counts`
        // checked that the parts fill both.
        unsafe { self.launch_all_to_all(input.ptr(), output.ptr(), dtype, &counts, &counts) }?;
        self.wait(OpKind::AllToAll)?;
        self.record_all_to_all(dtype, &counts, &counts);
        Ok(())
    }

    /// Enqueues the group of sends and receives between device addresses `src` and `dst`.
    ///
    /// # Safety
    /// `src` and `dst` address live memory on this communicator's GPU holding the send and
    /// receive counts' totals of `dtype`, untouched by anything else until the stream's work
    /// has finished; the caller checked the counts (`check`) and that `comm` is usable here.
    pub(super) unsafe fn launch_all_to_all(
        &self,
        src: u64,
        dst: u64,
        dtype: NcclDtype,
        send_counts: &[usize],
        recv_counts: &[usize],
    ) -> Result<(), ZeroError> {
        let kind = OpKind::AllToAll;
        let (ty, stream) = (nccl_type(dtype), self.stream.cu_stream() as sys::cudaStream_t);
        let (sends, recvs) = (part_ranges(send_counts), part_ranges(recv_counts));
        let at = |base: u64, start: usize| base + (start * dtype.size()) as u64;
        result::group_start().map_err(|e| self.fail(kind, format!("ncclGroupStart: {e:?}")))?;
        let mut launched = Ok(());
        for peer in 0..self.world_size {
            let p = peer as i32;
            if launched.is_ok() && send_counts[peer] > 0 {
                let ptr = at(src, sends[peer].start) as *const c_void;
                // SAFETY: within `src` (the caller's contract); `comm` is live on this thread.
                launched = unsafe { result::send(ptr, send_counts[peer], ty, p, self.comm, stream) }.map(drop);
            }
            if launched.is_ok() && recv_counts[peer] > 0 {
                let ptr = at(dst, recvs[peer].start) as *mut c_void;
                // SAFETY: within `dst`, as above.
                launched = unsafe { result::recv(ptr, recv_counts[peer], ty, p, self.comm, stream) }.map(drop);
            }
        }
        // The group is closed whatever failed inside it.
        let ended = result::group_end();
        launched.map_err(|e| self.fail(kind, format!("ncclSend/ncclRecv: {e:?}")))?;
        ended.map(drop).map_err(|e| self.fail(kind, format!("ncclGroupEnd: {e:?}")))
    }

    /// Counts an all-to-all as its messages to and from other ranks (the trait's convention).
    pub(super) fn record_all_to_all(&self, dtype: NcclDtype, send_counts: &[usize], recv_counts: &[usize]) {
        for (kind, counts) in [(OpKind::Send, send_counts), (OpKind::Recv, recv_counts)] {
            for (_, &c) in counts.iter().enumerate().filter(|&(j, &c)| j != self.rank && c > 0) {
                self.counters.record(kind, (c * dtype.size()) as u64);
            }
        }
    }
}
