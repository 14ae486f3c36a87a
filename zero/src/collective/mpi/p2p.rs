//! Point-to-point messages over MPI.
//!
//! # Note: point-to-point
//! A send copies its buffer and starts an `MPI_Isend` of the copy, which stays in flight
//! until MPI has delivered it: a send never waits for its receive (the buffered semantics
//! the trait promises, which pipeline schedules rely on). MPI progresses a send only inside
//! MPI calls, so the rank's communication thread drives the sends in flight between jobs
//! and while it polls any other request; finished sends free their copies. A receive
//! polls an `MPI_Irecv` against the timeout like a collective.
//!
//! Sends and receives carry [`POINT_TO_POINT_TAG`], and collectives their own tag, so a
//! send still in flight is never taken by a peer's collective and a receive never takes a
//! collective's message.

use mpi::datatype::Equivalence;
use mpi::request::{Request, StaticScope, scope};
use mpi::traits::*;
use zerotrain_precision::{BufMut, BufRef};

use super::{MpiComm, bits, from_bits};
use crate::ZeroError;
use crate::collective::OpKind;

/// The tag of [`Collective::send`](crate::Collective::send) messages (collectives use
/// another, `half::COLLECTIVE_TAG`).
pub(super) const POINT_TO_POINT_TAG: i32 = 0;

/// A send in flight and the buffer it reads, freed once it completes (module note on
/// point-to-point).
pub(super) enum Outgoing {
    F32(Request<'static, [f32], StaticScope>, *mut [f32]),
    Bits(Request<'static, [u16], StaticScope>, *mut [u16]),
}

impl Outgoing {
    /// Tests the send: `None` (and the buffer freed) if it completed.
    fn test(self) -> Option<Self> {
        match self {
            Self::F32(request, buffer) => match request.test() {
                // SAFETY: the buffer came from `Box::into_raw` when the send started, and the
                // send, its only reader, has completed.
                Ok(_) => drop(unsafe { Box::from_raw(buffer) }),
                Err(request) => return Some(Self::F32(request, buffer)),
            },
            Self::Bits(request, buffer) => match request.test() {
                // SAFETY: as above.
                Ok(_) => drop(unsafe { Box::from_raw(buffer) }),
                Err(request) => return Some(Self::Bits(request, buffer)),
            },
        }
        None
    }
}

impl MpiComm {
    /// Tests every send in flight, freeing the finished ones; whether any remain.
    pub(super) fn drive_sends(&self) -> bool {
        let mut outgoing = self.outgoing.lock().unwrap_or_else(|e| e.into_inner());
        let pending = std::mem::take(&mut *outgoing);
        outgoing.extend(pending.into_iter().filter_map(Outgoing::test));
        !outgoing.is_empty()
    }

    /// Starts a nonblocking send of a copy of `buf` and returns (module note on
    /// point-to-point).
    pub(super) fn send_buffered(&self, buf: BufRef<'_>, to: usize) -> Result<(), ZeroError> {
        self.check(OpKind::Send)?;
        self.check_rank(OpKind::Send, to)?;
        let process = self.world.process_at_rank(to as i32);
        let outgoing = match buf {
            BufRef::F32(v) => {
                let buffer = Box::into_raw(v.to_vec().into_boxed_slice());
                // SAFETY: the buffer lives until the send completes (`Outgoing::test` frees it
                // then, and Drop leaks it if it never does), so 'static is never violated.
                let request = process.immediate_send_with_tag(StaticScope, unsafe { &*buffer }, POINT_TO_POINT_TAG);
                Outgoing::F32(request, buffer)
            }
            other => {
                let buffer = Box::into_raw(bits(other).into_boxed_slice());
                // SAFETY: as above.
                let request = process.immediate_send_with_tag(StaticScope, unsafe { &*buffer }, POINT_TO_POINT_TAG);
                Outgoing::Bits(request, buffer)
            }
        };
        self.outgoing.lock().unwrap_or_else(|e| e.into_inner()).push(outgoing);
        self.drive_sends();
        self.counters.record(OpKind::Send, (buf.len() * buf.dtype().bytes_per_elem()) as u64);
        Ok(())
    }

    /// Receives into `buf`, polling an `MPI_Irecv` against the timeout.
    pub(super) fn recv_polled(&self, mut buf: BufMut<'_>, from: usize) -> Result<(), ZeroError> {
        self.check(OpKind::Recv)?;
        self.check_rank(OpKind::Recv, from)?;
        let process = self.world.process_at_rank(from as i32);
        let len = buf.len();
        let count = match &mut buf {
            BufMut::F32(v) => scope(|s| {
                let request = process.immediate_receive_into_with_tag(s, &mut v[..], POINT_TO_POINT_TAG);
                self.complete_with_status(OpKind::Recv, request).count(f32::equivalent_datatype())
            }),
            other => {
                let mut bits = vec![0u16; len];
                let count = scope(|s| {
                    let request = process.immediate_receive_into_with_tag(s, &mut bits[..], POINT_TO_POINT_TAG);
                    self.complete_with_status(OpKind::Recv, request).count(u16::equivalent_datatype())
                });
                from_bits(&bits, other.reborrow());
                count
            }
        };
        if count as usize != len {
            let detail = format!("the message from rank {from} has {count} elements, the buffer {len}");
            return Err(ZeroError::BadBuffer { rank: self.rank, op: OpKind::Recv.name(), detail });
        }
        self.counters.record(OpKind::Recv, (len * buf.dtype().bytes_per_elem()) as u64);
        Ok(())
    }
}
