//! What one NCCL call is, from the [`Collective`](crate::Collective) arguments: its
//! datatype, its `count` (which NCCL defines differently per collective) and the bytes each
//! side holds. Pure, so that it is tested on machines without a GPU.

use zerotrain_precision::Precision;

use crate::ZeroError;
use crate::collective::{DeviceBuf, DeviceCall, DeviceOp, OpKind};

/// NCCL's datatypes zerotrain sends: the engine's three float dtypes travel as themselves
/// (half types as 16 bits, never widened).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NcclDtype {
    /// `ncclFloat32`.
    Float32,
    /// `ncclFloat16`.
    Float16,
    /// `ncclBfloat16`.
    Bfloat16,
}

impl NcclDtype {
    /// The NCCL datatype a buffer of `dtype` travels as.
    pub fn of(dtype: Precision) -> Self {
        match dtype {
            Precision::Fp32 => Self::Float32,
            Precision::Fp16 => Self::Float16,
            Precision::Bf16 => Self::Bfloat16,
        }
    }

    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            Self::Float32 => 4,
            Self::Float16 | Self::Bfloat16 => 2,
        }
    }
}

/// One NCCL collective, checked: the `count` argument NCCL takes and the byte sizes of the
/// device buffers it reads and writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NcclCall {
    /// The collective.
    pub kind: OpKind,
    /// The datatype of both buffers.
    pub dtype: NcclDtype,
    /// NCCL's `count`: the whole buffer for all-reduce and broadcast, the *receive* length
    /// for reduce-scatter (`recvcount`), the *send* length for all-gather (`sendcount`).
    pub count: usize,
    /// Bytes of the send buffer.
    pub send_bytes: usize,
    /// Bytes of the receive buffer.
    pub recv_bytes: usize,
}

impl NcclCall {
    /// Checks the lengths of a `kind` call over `world_size` ranks (`send_len` and
    /// `recv_len` in elements; in-place calls pass the same length twice) and derives its
    /// NCCL arguments. A mismatch is the same [`ZeroError::BadBuffer`] the host backends give.
    pub fn new(
        kind: OpKind,
        dtype: Precision,
        send_len: usize,
        recv_len: usize,
        world_size: usize,
        rank: usize,
    ) -> Result<Self, ZeroError> {
        let bad = |detail: String| ZeroError::BadBuffer { rank, op: kind.name(), detail };
        let count = match kind {
            OpKind::AllReduce | OpKind::Broadcast => {
                if send_len != recv_len {
                    return Err(bad(format!("in-place buffer of {send_len} elements read as {recv_len}")));
                }
                send_len
            }
            OpKind::ReduceScatter => {
                if Some(send_len) != recv_len.checked_mul(world_size) {
                    return Err(bad(format!(
                        "input has {send_len} elements, expected {world_size} x {recv_len} (world size x output)"
                    )));
                }
                recv_len
            }
            OpKind::AllGather => {
                if Some(recv_len) != send_len.checked_mul(world_size) {
                    return Err(bad(format!(
                        "output has {recv_len} elements, expected {world_size} x {send_len} (world size x input)"
                    )));
                }
                send_len
            }
            OpKind::Barrier | OpKind::Send | OpKind::Recv | OpKind::Split => {
                return Err(bad("runs on the host communicator, not through NCCL".into()));
            }
            OpKind::AllToAll => return Err(bad("takes a count per rank, not one count".into())),
        };
        let dtype = NcclDtype::of(dtype);
        Ok(Self { kind, dtype, count, send_bytes: send_len * dtype.size(), recv_bytes: recv_len * dtype.size() })
    }

    /// Whether the call writes its result over its input (one device buffer, not two).
    pub fn in_place(&self) -> bool {
        matches!(self.kind, OpKind::AllReduce | OpKind::Broadcast)
    }
}

/// The buffer a [`DeviceOp::Send`] or [`DeviceOp::Recv`] moves on rank `rank` of
/// `world_size`, checked: another rank as the peer, the other side empty, the call's own
/// checks; `None` when it moves nothing (a message of no elements).
pub fn message_buffer(call: &DeviceCall, rank: usize, world_size: usize) -> Result<Option<DeviceBuf>, ZeroError> {
    let kind = call.op.kind();
    let bad = |detail: String| ZeroError::BadBuffer { rank, op: kind.name(), detail };
    let (peer, moved, other) = match call.op {
        DeviceOp::Send(peer) => (peer, call.input, call.output),
        DeviceOp::Recv(peer) => (peer, call.output, call.input),
        _ => return Err(bad("not a message".into())),
    };
    call.check(rank)?;
    if peer >= world_size || peer == rank {
        return Err(bad(format!("peer {peer} of {world_size} ranks (this is rank {rank})")));
    }
    if !other.is_empty() {
        return Err(bad(format!("a {} has one buffer; the other holds {} elements", kind.name(), other.len())));
    }
    Ok((!moved.is_empty()).then_some(moved))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_follow_nccls_definitions() {
        // NCCL's API: ncclAllReduce(count = buffer), ncclReduceScatter(recvcount),
        // ncclAllGather(sendcount), ncclBroadcast(count = buffer).
        let call = NcclCall::new(OpKind::AllReduce, Precision::Fp32, 10, 10, 4, 0).unwrap();
        assert_eq!((call.count, call.send_bytes, call.recv_bytes), (10, 40, 40));
        let call = NcclCall::new(OpKind::ReduceScatter, Precision::Bf16, 12, 3, 4, 1).unwrap();
        assert_eq!((call.count, call.send_bytes, call.recv_bytes, call.dtype), (3, 24, 6, NcclDtype::Bfloat16));
        let call = NcclCall::new(OpKind::AllGather, Precision::Fp16, 3, 12, 4, 2).unwrap();
        assert_eq!((call.count, call.send_bytes, call.recv_bytes, call.dtype), (3, 6, 24, NcclDtype::Float16));
        let call = NcclCall::new(OpKind::Broadcast, Precision::Fp32, 7, 7, 2, 1).unwrap();
        assert_eq!(call.count, 7);
        assert!(call.in_place() && !NcclCall::new(OpKind::AllGather, Precision::Fp32, 1, 2, 2, 0).unwrap().in_place());
    }

    #[test]
    fn mismatched_lengths_are_bad_buffers_naming_the_rank_and_call() {
        let err = NcclCall::new(OpKind::ReduceScatter, Precision::Fp32, 10, 3, 4, 3).unwrap_err();
        assert!(matches!(err, ZeroError::BadBuffer { rank: 3, op: "reduce_scatter", .. }), "{err}");
        assert!(err.to_string().contains("expected 4 x 3"), "{err}");
        let err = NcclCall::new(OpKind::AllGather, Precision::Fp32, 3, 10, 4, 0).unwrap_err();
        assert!(err.to_string().contains("all_gather") && err.to_string().contains("4 x 3"), "{err}");
        // A length whose product overflows is a mismatch, not a wrap-around.
        assert!(NcclCall::new(OpKind::ReduceScatter, Precision::Fp32, 0, usize::MAX, 2, 0).is_err());
        assert!(NcclCall::new(OpKind::Send, Precision::Fp32, 1, 1, 2, 0).is_err());
    }

    fn buf(ptr: u64, len: usize) -> DeviceBuf {
        // SAFETY: never handed to a collective that runs; only checked.
        unsafe { DeviceBuf::new(ptr, len, Precision::Fp32) }
    }

    /// A message moves its one buffer to or from another rank; a peer that is this rank or
    /// past the world, a second buffer, or a collective is refused naming the call; an
    /// empty message moves nothing.
    #[test]
    fn messages_take_one_buffer_and_another_rank() {
        let empty = DeviceBuf::empty(Precision::Fp32);
        let send = |to, output| DeviceCall { op: DeviceOp::Send(to), input: buf(64, 8), output };
        assert_eq!(message_buffer(&send(1, empty), 0, 2).unwrap(), Some(buf(64, 8)));
        let recv = DeviceCall { op: DeviceOp::Recv(0), input: empty, output: buf(128, 4) };
        assert_eq!(message_buffer(&recv, 1, 2).unwrap(), Some(buf(128, 4)));
        for (call, rank, said) in [
            (send(0, empty), 0, "peer 0 of 2 ranks (this is rank 0)"),
            (send(2, empty), 0, "peer 2 of 2 ranks"),
            (send(1, buf(256, 2)), 0, "the other holds 2 elements"),
        ] {
            let err = message_buffer(&call, rank, 2).unwrap_err();
            assert!(matches!(err, ZeroError::BadBuffer { op: "send", .. }), "{err}");
            assert!(err.to_string().contains(said), "{err}");
        }
        let gather = DeviceCall { op: DeviceOp::AllGather, input: buf(0, 1), output: buf(64, 2) };
        assert!(message_buffer(&gather, 0, 2).unwrap_err().to_string().contains("not a message"));
        let nothing = DeviceCall { op: DeviceOp::Send(1), input: empty, output: empty };
        assert_eq!(message_buffer(&nothing, 0, 2).unwrap(), None);
    }
}
