//! Collectives over buffers in the memory of the rank's GPU: [`DeviceCall`] names the call
//! and its two buffers, [`Collective::on_device`](super::Collective::on_device) runs it.
//! Only a backend whose collectives read device memory (NCCL) runs one; the host backends
//! refuse it by name, and the caller stages its values through host memory instead.
//!
//! # Note: who keeps the buffers valid
//! A [`DeviceBuf`] is an address, not a borrow: the collective cannot see the allocator
//! that owns the memory (Burn's, through cubecl). Making one is `unsafe`, and its maker
//! promises what the call needs: the memory is live for the whole call, on the GPU the
//! communicator runs on, every write to it has finished (the device is synchronised), and
//! nothing else reads or writes it until the call returns. The call returns only after its
//! work on the GPU has finished, so the caller's next kernels see the result.

use zerotrain_precision::Precision;

use super::{OpKind, ReduceOp};
use crate::ZeroError;

/// `len` elements of `dtype` at address `ptr` in the memory of the rank's GPU (module note).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceBuf {
    ptr: u64,
    len: usize,
    dtype: Precision,
}

impl DeviceBuf {
    /// The buffer of `len` elements of `dtype` at device address `ptr`.
    ///
    /// # Safety
    /// Until the call it is passed to returns, `ptr` addresses at least `len` elements of
    /// `dtype` of live memory on the communicator's GPU whose writes have all finished, and
    /// nothing else reads or writes that memory (module note).
    pub unsafe fn new(ptr: u64, len: usize, dtype: Precision) -> Self {
        Self { ptr, len, dtype }
    }

    /// The device address.
    pub fn ptr(&self) -> u64 {
        self.ptr
    }

    /// Elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it holds no element.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The element type.
    pub fn dtype(&self) -> Precision {
        self.dtype
    }

    /// No memory: the side of a [`DeviceOp::Send`] or [`DeviceOp::Recv`] that has none.
    pub fn empty(dtype: Precision) -> Self {
        Self { ptr: 0, len: 0, dtype }
    }
}

/// A collective the [`DeviceCall`] runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceOp {
    /// [`Collective::all_reduce`](super::Collective::all_reduce), out of place: the
    /// output has the input's length.
    AllReduce(ReduceOp),
    /// [`Collective::reduce_scatter`](super::Collective::reduce_scatter): the input is
    /// `world_size` times the output.
    ReduceScatter(ReduceOp),
    /// [`Collective::all_gather`](super::Collective::all_gather): the output is
    /// `world_size` times the input.
    AllGather,
    /// [`Collective::all_to_all`](super::Collective::all_to_all) of equal parts: the input
    /// is `world_size` parts of one length, part `j` for rank `j`; the output (the input's
    /// length) holds the part each rank sent this one, in rank order.
    AllToAll,
    /// [`Collective::send`](super::Collective::send) of the input to this rank (the output
    /// empty); a rank's messages to one peer arrive in the order they were sent.
    Send(usize),
    /// [`Collective::recv`](super::Collective::recv) from this rank into the output (the
    /// input empty), whose length must be the message's.
    Recv(usize),
}

impl DeviceOp {
    /// The collective's kind, as errors and counters name it.
    pub fn kind(self) -> OpKind {
        match self {
            Self::AllReduce(_) => OpKind::AllReduce,
            Self::ReduceScatter(_) => OpKind::ReduceScatter,
            Self::AllGather => OpKind::AllGather,
            Self::AllToAll => OpKind::AllToAll,
            Self::Send(_) => OpKind::Send,
            Self::Recv(_) => OpKind::Recv,
        }
    }
}

/// One collective over device buffers: it reads `input` and writes `output`, two
/// distinct buffers of one dtype (lengths as [`DeviceOp`] says).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceCall {
    /// The collective.
    pub op: DeviceOp,
    /// Read, never written.
    pub input: DeviceBuf,
    /// Receives the result.
    pub output: DeviceBuf,
}

impl DeviceCall {
    /// What a backend whose collectives read host memory answers.
    pub(crate) fn refused(&self, rank: usize) -> ZeroError {
        let detail = "this backend's collectives read host memory, not a GPU's (NCCL's do)".into();
        ZeroError::BadBuffer { rank, op: self.op.kind().name(), detail }
    }

    /// Checks the two buffers share a dtype and do not overlap (their lengths are
    /// checked against the world size by the backend).
    pub fn check(&self, rank: usize) -> Result<(), ZeroError> {
        let bad = |detail: String| ZeroError::BadBuffer { rank, op: self.op.kind().name(), detail };
        let (input, output) = (&self.input, &self.output);
        if input.dtype != output.dtype {
            return Err(bad(format!("input is {:?}, output {:?}", input.dtype, output.dtype)));
        }
        let span = |b: &DeviceBuf| (b.ptr, b.ptr.saturating_add((b.len * b.dtype.bytes_per_elem()) as u64));
        let ((a0, a1), (b0, b1)) = (span(input), span(output));
        if a0 < b1 && b0 < a1 {
            return Err(bad("input and output overlap: the call reads one buffer and writes another".into()));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn buf(ptr: u64, len: usize, dtype: Precision) -> DeviceBuf {
        // SAFETY: never handed to a collective that runs; only checked.
        unsafe { DeviceBuf::new(ptr, len, dtype) }
    }

    #[test]
    fn a_call_needs_one_dtype_and_two_separate_buffers() {
        let call = |input, output| DeviceCall { op: DeviceOp::AllGather, input, output };
        assert!(call(buf(0, 4, Precision::Fp32), buf(16, 8, Precision::Fp32)).check(0).is_ok());
        // Adjacent is not overlapping; one byte in is.
        assert!(call(buf(16, 8, Precision::Bf16), buf(0, 8, Precision::Bf16)).check(0).is_ok());
        let err = call(buf(0, 4, Precision::Fp32), buf(15, 8, Precision::Fp32)).check(2).unwrap_err();
        assert!(matches!(err, ZeroError::BadBuffer { rank: 2, op: "all_gather", .. }), "{err}");
        assert!(err.to_string().contains("overlap"), "{err}");
        let err = call(buf(0, 4, Precision::Fp32), buf(64, 4, Precision::Fp16)).check(0).unwrap_err();
        assert!(err.to_string().contains("Fp32") && err.to_string().contains("Fp16"), "{err}");
    }
}
