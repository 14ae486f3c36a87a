//! The threads backend: ranks are threads of one process, and a collective reads the other
//! ranks' buffers directly.
//!
//! # Note: the three-barrier protocol
//! Every collective runs as: (1) *rendezvous* — each rank publishes pointers to its buffers
//! and waits for all; (2) *exchange* — each rank reads peers' buffers and writes only its own;
//! (3) an *exit* barrier, after which no rank reads any peer's buffer again. All-reduce
//! splits (2) into reduce (rank r sums chunk r of every buffer, in rank order, into chunk r of
//! its own buffer) and gather (rank r copies chunk k from rank k), with a barrier between.
//! Within a phase, no element is written by one rank while another reads it.
//!
//! Only the rendezvous can fail: it returns an error when the world has been aborted, or
//! aborts it after the timeout. The later barriers wait unconditionally, because by then
//! every rank is inside the same call doing bounded memory work, and a rank that left early
//! would free a buffer that a peer is still reading.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use zerotrain_precision::{BufMut, BufRef, FlatBuf, FlatElem, with_elem};

use super::rendezvous::{Hub, Slot};
use super::{Collective, CommCounters, CommStats, OpKind, ReduceOp, chunk_range, convention_bytes};
use crate::ZeroError;

/// Elements reduced per inner block (fits in L1 with a few peers).
const BLOCK_ELEMS: usize = 2048;

/// A group of `world_size` thread ranks. Create one per job and hand each rank thread its
/// [`ThreadComm`].
#[derive(Clone, Debug)]
pub struct ThreadWorld {
    hub: Arc<Hub>,
}

impl ThreadWorld {
    /// A world of `world_size` ranks whose rendezvous gives up after `timeout`.
    ///
    /// # Panics
    /// If `world_size` is 0.
    pub fn new(world_size: usize, timeout: Duration) -> Self {
        assert!(world_size > 0, "a world needs at least one rank");
        Self { hub: Hub::new(world_size, timeout) }
    }

    /// The communicator for `rank`.
    ///
    /// # Panics
    /// If `rank >= world_size`.
    pub fn communicator(&self, rank: usize) -> ThreadComm {
        assert!(rank < self.hub.world_size, "rank {rank} out of range");
        ThreadComm { rank, hub: Arc::clone(&self.hub), counters: CommCounters::default(), splits: AtomicU64::new(0) }
    }

    /// Aborts the world on behalf of `rank` (see [`Collective::abort`]).
    pub fn abort(&self, rank: usize, reason: &str) {
        self.hub.abort(rank, reason);
    }

    /// The first abort, if any: the failing rank and its reason.
    pub fn aborted(&self) -> Option<(usize, String)> {
        self.hub.aborted()
    }
}

/// One rank's handle on a [`ThreadWorld`] (or on a group split from it).
#[derive(Debug)]
pub struct ThreadComm {
    rank: usize,
    hub: Arc<Hub>,
    counters: CommCounters,
    /// Splits made on this handle so far: the same on every rank, so it names the split.
    splits: AtomicU64,
}

impl ThreadComm {
    /// A local usage error: the peers are (or will be) waiting in the rendezvous, so the
    /// world is aborted to release them at once rather than after the timeout.
    fn bad_buffer(&self, op: OpKind, detail: String) -> ZeroError {
        let error = ZeroError::BadBuffer { rank: self.rank, op: op.name(), detail };
        self.hub.abort(self.rank, &error.to_string());
        error
    }
}

impl ThreadComm {
    /// The next message `from` sent this rank, as it was sent (its length and dtype the
    /// sender's): [`Collective::recv`] without a buffer of the receiver's, for a receiver
    /// that checks the message against what it expects before it allocates anything.
    pub fn recv_message(&self, from: usize) -> Result<FlatBuf, ZeroError> {
        let n = self.hub.world_size;
        if from >= n {
            return Err(self.bad_buffer(OpKind::Recv, format!("rank {from} is not a rank of {n}")));
        }
        let message = self.hub.take(from, self.rank)?;
        self.counters.record(OpKind::Recv, message.bytes());
        Ok(message)
    }

    /// [`Collective::split`], as the threads backend's own communicator.
    pub fn split_threads(&self, color: usize, key: usize) -> Result<ThreadComm, ZeroError> {
        let slot = Slot::new::<f32>(OpKind::Split, None, color, (std::ptr::null(), key), (std::ptr::null_mut(), 0));
        let slots = self.hub.rendezvous(self.rank, slot)?;
        let mut members: Vec<usize> = (0..slots.len()).filter(|&r| slots[r].root == color).collect();
        members.sort_by_key(|&r| (slots[r].src_len, r));
        let rank = members.iter().position(|&r| r == self.rank).expect("a rank is in its own color");
        let split = self.splits.fetch_add(1, Ordering::Relaxed);
        let hub = self.hub.group(split, color, &members);
        Ok(ThreadComm { rank, hub, counters: CommCounters::default(), splits: AtomicU64::new(0) })
    }

    fn all_reduce_typed<E: FlatElem>(&self, buf: &mut [E], op: ReduceOp) -> Result<(), ZeroError> {
        let n = self.hub.world_size;
        let len = buf.len();
        let ptr = buf.as_mut_ptr();
        let slots = self
            .hub
            .rendezvous(self.rank, Slot::new(OpKind::AllReduce, Some(op), 0, (ptr.cast_const(), len), (ptr, len)))?;
        let own = chunk_range(len, n, self.rank);
        let peers: Vec<*const E> = slots.iter().map(|s| s.dst.cast_const().cast::<E>()).collect();
        // SAFETY: every buffer has `len` elements of E (checked at the rendezvous). In this
        // phase rank r writes only chunk r of its own buffer and reads only chunk r of the others.
        unsafe { reduce_block(ptr.add(own.start), &peers, own.start, own.len(), op) };
        self.hub.exit_barrier(self.rank);
        for (k, peer) in peers.iter().enumerate().filter(|&(k, _)| k != self.rank) {
            let chunk = chunk_range(len, n, k);
            // SAFETY: rank k finished chunk k before the barrier above and only writes other
            // chunks of its own buffer now; we write chunk k of ours, which nobody reads.
            unsafe { std::ptr::copy_nonoverlapping(peer.add(chunk.start), ptr.add(chunk.start), chunk.len()) };
        }
        self.hub.exit_barrier(self.rank);
        self.record::<E>(OpKind::AllReduce, len, 0);
        Ok(())
    }

    fn reduce_scatter_typed<E: FlatElem>(&self, input: &[E], output: &mut [E], op: ReduceOp) -> Result<(), ZeroError> {
        let n = self.hub.world_size;
        let chunk = output.len();
        if input.len() != chunk * n {
            let detail = format!("input has {} elements, expected world_size ({n}) x output ({chunk})", input.len());
            return Err(self.bad_buffer(OpKind::ReduceScatter, detail));
        }
        let dst = output.as_mut_ptr();
        let slot = Slot::new(OpKind::ReduceScatter, Some(op), 0, (input.as_ptr(), input.len()), (dst, chunk));
        let slots = self.hub.rendezvous(self.rank, slot)?;
        let peers: Vec<*const E> = slots.iter().map(|s| s.src.cast::<E>()).collect();
        // SAFETY: inputs are only read during this call, and `output` is ours alone.
        unsafe { reduce_block(dst, &peers, self.rank * chunk, chunk, op) };
        self.hub.exit_barrier(self.rank);
        self.record::<E>(OpKind::ReduceScatter, input.len(), 0);
        Ok(())
    }

    fn all_gather_typed<E: FlatElem>(&self, input: &[E], output: &mut [E]) -> Result<(), ZeroError> {
        let n = self.hub.world_size;
        let chunk = input.len();
        if output.len() != chunk * n {
            let detail = format!("output has {} elements, expected world_size ({n}) x input ({chunk})", output.len());
            return Err(self.bad_buffer(OpKind::AllGather, detail));
        }
        let dst = output.as_mut_ptr();
        let slots = self.hub.rendezvous(
            self.rank,
            Slot::new(OpKind::AllGather, None, 0, (input.as_ptr(), chunk), (dst, output.len())),
        )?;
        for (k, slot) in slots.iter().enumerate() {
            // SAFETY: inputs are only read during this call, and `output` is ours alone.
            unsafe { std::ptr::copy_nonoverlapping(slot.src.cast::<E>(), dst.add(k * chunk), chunk) };
        }
        self.hub.exit_barrier(self.rank);
        self.record::<E>(OpKind::AllGather, output.len(), 0);
        Ok(())
    }

    fn broadcast_typed<E: FlatElem>(&self, buf: &mut [E], root: usize) -> Result<(), ZeroError> {
        let n = self.hub.world_size;
        if root >= n {
            return Err(self.bad_buffer(OpKind::Broadcast, format!("root {root} is not a rank of {n}")));
        }
        let len = buf.len();
        let ptr = buf.as_mut_ptr();
        let slots = self
            .hub
            .rendezvous(self.rank, Slot::new(OpKind::Broadcast, None, root, (ptr.cast_const(), len), (ptr, len)))?;
        if self.rank != root {
            // SAFETY: the root does not write its buffer during the call; ours is ours alone.
            unsafe { std::ptr::copy_nonoverlapping(slots[root].src.cast::<E>(), ptr, len) };
        }
        self.hub.exit_barrier(self.rank);
        self.record::<E>(OpKind::Broadcast, len, root);
        Ok(())
    }

    fn record<E: FlatElem>(&self, kind: OpKind, buffer_elems: usize, root: usize) {
        let elem_bytes = std::mem::size_of::<E>();
        let bytes = convention_bytes(kind, buffer_elems, elem_bytes, self.hub.world_size, self.rank, root);
        self.counters.record(kind, bytes);
    }
}

impl Collective for ThreadComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.hub.world_size
    }

    fn all_reduce(&self, buf: BufMut<'_>, op: ReduceOp) -> Result<(), ZeroError> {
        with_elem!(BufMut, buf, v, E => self.all_reduce_typed::<E>(v, op))
    }

    fn reduce_scatter(&self, input: BufRef<'_>, output: BufMut<'_>, op: ReduceOp) -> Result<(), ZeroError> {
        match (input, output) {
            (BufRef::F32(i), BufMut::F32(o)) => self.reduce_scatter_typed(i, o, op),
            (BufRef::F16(i), BufMut::F16(o)) => self.reduce_scatter_typed(i, o, op),
            (BufRef::Bf16(i), BufMut::Bf16(o)) => self.reduce_scatter_typed(i, o, op),
            (i, o) => {
                let detail = format!("input is {}, output is {}", i.dtype(), o.dtype());
                Err(self.bad_buffer(OpKind::ReduceScatter, detail))
            }
        }
    }

    fn all_gather(&self, input: BufRef<'_>, output: BufMut<'_>) -> Result<(), ZeroError> {
        match (input, output) {
            (BufRef::F32(i), BufMut::F32(o)) => self.all_gather_typed(i, o),
            (BufRef::F16(i), BufMut::F16(o)) => self.all_gather_typed(i, o),
            (BufRef::Bf16(i), BufMut::Bf16(o)) => self.all_gather_typed(i, o),
            (i, o) => {
                Err(self.bad_buffer(OpKind::AllGather, format!("input is {}, output is {}", i.dtype(), o.dtype())))
            }
        }
    }

    fn broadcast(&self, buf: BufMut<'_>, root: usize) -> Result<(), ZeroError> {
        with_elem!(BufMut, buf, v, E => self.broadcast_typed::<E>(v, root))
    }

    fn barrier(&self) -> Result<(), ZeroError> {
        let slot = Slot::new::<f32>(OpKind::Barrier, None, 0, (std::ptr::null(), 0), (std::ptr::null_mut(), 0));
        self.hub.rendezvous(self.rank, slot)?;
        self.counters.record(OpKind::Barrier, 0);
        Ok(())
    }

    /// Posts a copy of `buf` to `to`'s mailbox: the send is done when this returns.
    fn send(&self, buf: BufRef<'_>, to: usize) -> Result<(), ZeroError> {
        let n = self.hub.world_size;
        if to >= n {
            return Err(self.bad_buffer(OpKind::Send, format!("rank {to} is not a rank of {n}")));
        }
        let message = with_elem!(BufRef, buf, v, _E => FlatBuf::from(v.to_vec()));
        self.hub.post(self.rank, to, message);
        self.counters.record(OpKind::Send, (buf.len() * buf.dtype().bytes_per_elem()) as u64);
        Ok(())
    }

    fn recv(&self, mut buf: BufMut<'_>, from: usize) -> Result<(), ZeroError> {
        let message = self.recv_message(from)?;
        if message.len() != buf.len() || message.dtype() != buf.dtype() {
            let detail = format!(
                "the message from rank {from} has {} {} elements, the buffer {} {}",
                message.len(),
                message.dtype(),
                buf.len(),
                buf.dtype()
            );
            return Err(self.bad_buffer(OpKind::Recv, detail));
        }
        buf.copy_from(message.as_ref(), false);
        Ok(())
    }

    fn split(&self, color: usize, key: usize) -> Result<Arc<dyn Collective>, ZeroError> {
        Ok(Arc::new(self.split_threads(color, key)?))
    }

    fn abort(&self, reason: &str) {
        self.hub.abort(self.rank, reason);
    }

    fn aborted(&self) -> Option<String> {
        self.hub.aborted().map(|(rank, reason)| format!("rank {rank}: {reason}"))
    }

    fn stats(&self) -> CommStats {
        self.counters.snapshot()
    }
}

/// Writes the `op`-reduction of `peers[k][offset..offset + len]` to `dst`: widened to f32,
/// combined in rank order, rounded once to `E` (for f32 this is a plain f32 reduction).
///
/// # Safety
/// Every peer pointer must be valid for reads of `offset + len` elements, `dst` for writes of
/// `len`, and no other thread may write the read range or touch `dst` during the call.
/// `dst` may be one of the read ranges: each block is read in full before it is written.
unsafe fn reduce_block<E: FlatElem>(dst: *mut E, peers: &[*const E], offset: usize, len: usize, op: ReduceOp) {
    let mut acc = [0f32; BLOCK_ELEMS];
    let mut done = 0;
    while done < len {
        let n = BLOCK_ELEMS.min(len - done);
        let acc = &mut acc[..n];
        // SAFETY: within the ranges the caller guarantees.
        unsafe {
            let first = std::slice::from_raw_parts(peers[0].add(offset + done), n);
            acc.iter_mut().zip(first).for_each(|(a, x)| *a = x.to_f32());
            for peer in &peers[1..] {
                let x = std::slice::from_raw_parts(peer.add(offset + done), n);
                match op {
                    ReduceOp::Sum => acc.iter_mut().zip(x).for_each(|(a, b)| *a += b.to_f32()),
                    ReduceOp::Max => acc.iter_mut().zip(x).for_each(|(a, b)| *a = a.max(b.to_f32())),
                    ReduceOp::Min => acc.iter_mut().zip(x).for_each(|(a, b)| *a = a.min(b.to_f32())),
                }
            }
            let out = std::slice::from_raw_parts_mut(dst.add(done), n);
            out.iter_mut().zip(acc.iter()).for_each(|(o, a)| *o = E::from_f32(*a));
        }
        done += n;
    }
}
