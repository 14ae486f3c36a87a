//! [`NcclComm`]: a [`Collective`] whose reductions and gathers run through NCCL on the
//! rank's GPU.
//!
//! # Note: one thread
//! An NCCL communicator must not be used by two threads at once, and cudarc binds the CUDA
//! context per thread. An `NcclComm` is created on its rank's communication thread
//! ([`CommThread::spawn`](crate::CommThread::spawn)) and every method that touches NCCL
//! checks it runs there. [`Collective::abort`], which any thread may call, only records the
//! reason; the owning thread aborts the NCCL communicator the next time it looks.
//!
//! # Note: host buffers
//! The [`Collective`] trait hands over host slices, so a call copies its input to the
//! device, runs the NCCL collective on this communicator's own stream, and copies the result
//! back. No buffer of Burn's is touched, so no ordering with Burn's CUDA stream is needed.
//! Half-precision buffers travel as 16 bits and NCCL reduces them in their own type (its
//! sums round at each step and in NCCL's order, unlike the host backends' one rounding in
//! rank order): equal bit for bit to the host backends at world size 1 and for f32 copies,
//! not for half sums across ranks.
//!
//! # Note: device buffers
//! [`Collective::on_device`] runs the collective on the caller's GPU memory directly, on
//! the same stream, waited for the same way: nothing crosses to the host. The caller has
//! synchronised its own stream before (the contract of
//! [`DeviceBuf`](crate::collective::DeviceBuf)), so no event orders the two streams.
//!
//! # Note: timeouts
//! A call waits, bounded, for its work on the stream and fails the job past its timeout or
//! an abort (`comm/failure.rs`).
//!
//! # Note: what stays on the host
//! Barriers, point-to-point messages on host buffers (whose buffered-send contract NCCL's
//! rendezvous sends do not keep) and the id exchange of [`Collective::split`] use the host
//! communicator. The all-to-all's parts travel through NCCL (one group of sends and
//! receives, `all_to_all.rs`), its counts by NCCL's all-gather; messages on device buffers
//! are NCCL's sends and receives (`p2p.rs`).

use std::ffi::c_void;
use std::sync::{Arc, Mutex};
use std::thread::ThreadId;
use std::time::Duration;

use cudarc::driver::{CudaSlice, CudaStream, DevicePtrMut};
use cudarc::nccl::{result, sys};
use zerotrain_precision::{BufMut, BufRef};

use super::call::{NcclCall, NcclDtype};
use super::init;
use super::wire::{bytes, bytes_mut, bytes_of, nccl_op, nccl_type};
use crate::ZeroError;
use crate::collective::{
    Collective, CommCounters, CommStats, Completed, DeviceCall, DeviceOp, OpKind, Pending, ReduceOp, convention_bytes,
};

mod all_to_all;
mod device_call;
mod failure;
mod p2p;

/// One rank's NCCL communicator (see the module notes).
pub struct NcclComm {
    host: Arc<dyn Collective>,
    comm: sys::ncclComm_t,
    stream: Arc<CudaStream>,
    ordinal: usize,
    rank: usize,
    world_size: usize,
    thread: ThreadId,
    timeout: Duration,
    counters: CommCounters,
    /// Why the job failed, once it has; the NCCL communicator is aborted and never used again.
    failed: Arc<Mutex<Option<String>>>,
    /// Whether `comm` has been aborted (done once, on the owning thread).
    comm_aborted: Mutex<bool>,
}

// SAFETY: `comm` is only used by methods that first check they run on `thread`, the thread
// that created it (see the module note "one thread"); Drop on another thread leaks it.
// cudarc's stream and context handles are Send + Sync themselves.
unsafe impl Send for NcclComm {}
// SAFETY: as above.
unsafe impl Sync for NcclComm {}

impl std::fmt::Debug for NcclComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclComm").field("rank", &self.rank).field("ordinal", &self.ordinal).finish()
    }
}

impl NcclComm {
    /// Creates this rank's NCCL communicator on CUDA device `ordinal`, with the id made by
    /// `host`'s rank 0 and shared over `host`. Every rank of `host` calls it at once. A rank
    /// whose driver, NCCL or device is missing aborts `host`, so no rank waits for it.
    pub fn new(host: Arc<dyn Collective>, ordinal: usize, timeout: Duration) -> Result<Self, ZeroError> {
        let (rank, world_size) = (host.rank(), host.world_size());
        let (comm, stream) = init::create(host.as_ref(), ordinal, timeout)?;
        Ok(Self {
            host,
            comm,
            stream,
            ordinal,
            rank,
            world_size,
            thread: std::thread::current().id(),
            timeout,
            counters: CommCounters::default(),
            failed: Arc::default(),
            comm_aborted: Mutex::new(false),
        })
    }

    /// Runs `call`: copies `send` to the device, launches the collective with `launch`
    /// (input and output device pointers, the same for in-place calls, and the stream),
    /// waits for it and returns the device buffer holding the result.
    fn run(
        &self,
        call: NcclCall,
        send: &[u8],
        launch: impl FnOnce(*const c_void, *mut c_void, sys::cudaStream_t) -> Result<(), result::NcclError>,
    ) -> Result<CudaSlice<u8>, ZeroError> {
        let device = |e: cudarc::driver::DriverError| self.fail(call.kind, format!("CUDA: {e}"));
        let mut input: CudaSlice<u8> = self.stream.clone_htod(send).map_err(device)?;
        let mut output = match call.in_place() {
            true => None,
            false => Some(self.stream.alloc_zeros::<u8>(call.recv_bytes).map_err(device)?),
        };
        {
            let (input_ptr, _input_done) = input.device_ptr_mut(&self.stream);
            let (output_ptr, _output_done) = match output.as_mut() {
                Some(output) => {
                    let (ptr, done) = output.device_ptr_mut(&self.stream);
                    (ptr, Some(done))
                }
                None => (input_ptr, None),
            };
            launch(input_ptr as *const c_void, output_ptr as *mut c_void, self.stream.cu_stream() as _)
                .map_err(|e| self.fail(call.kind, format!("{e:?}")))?;
        }
        self.wait(call.kind)?;
        Ok(output.unwrap_or(input))
    }

    /// Copies a finished result back to the host.
    fn copy_back(&self, kind: OpKind, result: &CudaSlice<u8>, recv: &mut [u8]) -> Result<(), ZeroError> {
        let device = |e: cudarc::driver::DriverError| self.fail(kind, format!("CUDA: {e}"));
        self.stream.memcpy_dtoh(result, recv).map_err(device)?;
        self.stream.synchronize().map_err(device)
    }

    /// A two-buffer collective's input and output must share a dtype.
    fn same_dtype(&self, kind: OpKind, input: &BufRef<'_>, output: &BufMut<'_>) -> Result<(), ZeroError> {
        match input.dtype() == output.dtype() {
            true => Ok(()),
            false => {
                let detail = "input and output dtypes differ".to_owned();
                Err(ZeroError::BadBuffer { rank: self.rank, op: kind.name(), detail })
            }
        }
    }

    fn record(&self, kind: OpKind, elems: usize, dtype: NcclDtype, root: usize) {
        let bytes = convention_bytes(kind, elems, dtype.size(), self.world_size, self.rank, root);
        self.counters.record(kind, bytes);
    }
}

impl Collective for NcclComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world_size
    }

    fn all_reduce(&self, buf: BufMut<'_>, op: ReduceOp) -> Result<(), ZeroError> {
        let (len, dtype) = (buf.len(), buf.dtype());
        let call = NcclCall::new(OpKind::AllReduce, dtype, len, len, self.world_size, self.rank)?;
        if self.skip(call)? {
            return Ok(());
        }
        let result = self.run(call, bytes_of(&buf), |src, dst, stream| {
            // SAFETY: `src` and `dst` are device buffers of `count` elements of the dtype, on
            // this communicator's device; `stream` is its stream.
            unsafe { result::all_reduce(src, dst, call.count, nccl_type(call.dtype), nccl_op(op), self.comm, stream) }
                .map(drop)
        })?;
        self.copy_back(call.kind, &result, bytes_mut(buf))?;
        self.record(OpKind::AllReduce, len, call.dtype, 0);
        Ok(())
    }

    fn reduce_scatter(&self, input: BufRef<'_>, output: BufMut<'_>, op: ReduceOp) -> Result<(), ZeroError> {
        self.same_dtype(OpKind::ReduceScatter, &input, &output)?;
        let (n_in, n_out) = (input.len(), output.len());
        let call = NcclCall::new(OpKind::ReduceScatter, input.dtype(), n_in, n_out, self.world_size, self.rank)?;
        if self.skip(call)? {
            return Ok(());
        }
        let result = self.run(call, bytes(input), |src, dst, stream| {
            // SAFETY: `src` holds world_size x count elements, `dst` count, on this device.
            unsafe {
                result::reduce_scatter(src, dst, call.count, nccl_type(call.dtype), nccl_op(op), self.comm, stream)
            }
            .map(drop)
        })?;
        self.copy_back(call.kind, &result, bytes_mut(output))?;
        self.record(OpKind::ReduceScatter, n_in, call.dtype, 0);
        Ok(())
    }

    fn all_gather(&self, input: BufRef<'_>, output: BufMut<'_>) -> Result<(), ZeroError> {
        self.same_dtype(OpKind::AllGather, &input, &output)?;
        let (n_in, n_out) = (input.len(), output.len());
        let call = NcclCall::new(OpKind::AllGather, input.dtype(), n_in, n_out, self.world_size, self.rank)?;
        if self.skip(call)? {
            return Ok(());
        }
        let result = self.run(call, bytes(input), |src, dst, stream| {
            // SAFETY: `src` holds count elements, `dst` world_size x count, on this device.
            unsafe { result::all_gather(src, dst, call.count, nccl_type(call.dtype), self.comm, stream) }.map(drop)
        })?;
        self.copy_back(call.kind, &result, bytes_mut(output))?;
        self.record(OpKind::AllGather, n_out, call.dtype, 0);
        Ok(())
    }

    fn broadcast(&self, buf: BufMut<'_>, root: usize) -> Result<(), ZeroError> {
        let (len, dtype) = (buf.len(), buf.dtype());
        let call = NcclCall::new(OpKind::Broadcast, dtype, len, len, self.world_size, self.rank)?;
        if root >= self.world_size {
            let detail = format!("root {root} is not a rank of {}", self.world_size);
            return Err(ZeroError::BadBuffer { rank: self.rank, op: OpKind::Broadcast.name(), detail });
        }
        if self.skip(call)? {
            return Ok(());
        }
        let result = self.run(call, bytes_of(&buf), |src, dst, stream| {
            // SAFETY: in place: `src` == `dst`, `count` elements on this device.
            unsafe { result::broadcast(src, dst, call.count, nccl_type(call.dtype), root as i32, self.comm, stream) }
                .map(drop)
        })?;
        self.copy_back(call.kind, &result, bytes_mut(buf))?;
        self.record(OpKind::Broadcast, len, call.dtype, root);
        Ok(())
    }

    fn all_to_all(
        &self,
        input: BufRef<'_>,
        send_counts: &[usize],
        output: BufMut<'_>,
        recv_counts: &[usize],
    ) -> Result<(), ZeroError> {
        self.all_to_all_host(input, send_counts, output, recv_counts)
    }

    fn reads_device_memory(&self) -> bool {
        true
    }

    fn on_device(&self, call: &DeviceCall) -> Result<(), ZeroError> {
        self.run_on_device(call)
    }

    fn start_on_device(&self, call: &DeviceCall) -> Result<Pending, ZeroError> {
        match call.op {
            DeviceOp::Send(_) => self.start_send(call),
            _ => self.run_on_device(call).map(|()| Pending::ready(Ok(Completed::empty(call.input.dtype())))),
        }
    }

    fn barrier(&self) -> Result<(), ZeroError> {
        self.host.barrier()
    }

    fn send(&self, buf: BufRef<'_>, to: usize) -> Result<(), ZeroError> {
        self.host.send(buf, to)
    }

    fn recv(&self, buf: BufMut<'_>, from: usize) -> Result<(), ZeroError> {
        self.host.recv(buf, from)
    }

    fn split(&self, color: usize, key: usize) -> Result<Arc<dyn Collective>, ZeroError> {
        self.usable(OpKind::Split)?;
        let group = self.host.split(color, key)?;
        Ok(Arc::new(NcclComm::new(group, self.ordinal, self.timeout)?))
    }

    fn abort(&self, reason: &str) {
        {
            let mut failed = self.failed.lock().unwrap_or_else(|e| e.into_inner());
            if failed.is_none() {
                *failed = Some(reason.to_owned());
            }
        }
        self.host.abort(reason);
    }

    fn aborted(&self) -> Option<String> {
        failure::aborted(&self.failed, self.host.as_ref())
    }

    fn stats(&self) -> CommStats {
        self.counters.snapshot().plus(&self.host.stats())
    }
}

impl Drop for NcclComm {
    fn drop(&mut self) {
        // Off the owning thread the communicator is leaked rather than touched (module note).
        if std::thread::current().id() == self.thread {
            let _ = self.stream.synchronize();
            self.abort_comm();
        }
    }
}
