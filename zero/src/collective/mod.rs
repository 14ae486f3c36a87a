//! Collectives: the one small trait the engine talks to, in MPI/NCCL vocabulary, and the
//! byte counters every backend keeps.
//!
//! # Note: byte counting
//! Each call adds to the calling rank's counters the bytes that rank *received* under the
//! ring algorithms' bus-bandwidth convention (nccl-tests): for a buffer of `B` bytes over `N`
//! ranks, all-reduce moves `2(N-1)/N * B`, reduce-scatter and all-gather `(N-1)/N * B` (B
//! being the full, unscattered buffer), broadcast `B` on every rank but the root. The threads
//! backend reads exactly those bytes out of other ranks' buffers, so its counters are what it
//! really moved; a backend that moves more must still count the convention, so that stage
//! volumes (2Ψ, 3Ψ) stay comparable across backends. A point-to-point message counts its
//! bytes as sent on the sender and as received on the receiver.

mod all_to_all;
pub mod device;
#[cfg(feature = "mpi")]
mod mpi;
pub mod nccl;
mod rendezvous;
mod request;
pub mod tcp;
mod threads;
mod worker;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

pub use zerotrain_precision::{BufMut, BufRef};

#[cfg(feature = "mpi")]
pub use self::mpi::{LAUNCHER_GONE_EXIT_CODE, MpiComm};
pub use all_to_all::{equal_counts, exchange, part_ranges};
pub use device::{DeviceBuf, DeviceCall, DeviceOp};
pub use request::{Completed, Pending, Request};
pub use threads::{ThreadComm, ThreadWorld};
pub use worker::CommThread;

/// This process's (rank, world size) if `mpirun` (OpenMPI, MPICH or PMIx) started it.
pub fn mpi_environment() -> Option<(usize, usize)> {
    let get = |name: &str| std::env::var(name).ok()?.parse::<usize>().ok();
    [("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"), ("PMI_RANK", "PMI_SIZE"), ("PMIX_RANK", "PMIX_SIZE")]
        .iter()
        .find_map(|(r, s)| Some((get(r)?, get(s)?)))
}

use crate::ZeroError;

/// How values from different ranks combine.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ReduceOp {
    /// Element-wise sum, in rank order 0, 1, ..., N-1 (deterministic).
    Sum,
    /// Element-wise maximum.
    Max,
    /// Element-wise minimum.
    Min,
}

impl ReduceOp {
    /// Combines two values.
    #[inline(always)]
    pub fn apply(self, a: f32, b: f32) -> f32 {
        match self {
            Self::Sum => a + b,
            Self::Max => a.max(b),
            Self::Min => a.min(b),
        }
    }
}

/// Collective operations among the ranks of one job. Every rank must call the same
/// collectives in the same order with matching lengths; a rank that fails calls
/// [`Collective::abort`] so that the others get an error instead of waiting forever.
pub trait Collective: Send + Sync {
    /// This rank, `0..world_size`.
    fn rank(&self) -> usize;
    /// Number of ranks.
    fn world_size(&self) -> usize;
    /// Reduces `buf` across ranks in place; every rank ends with the same result. Half
    /// precision is reduced in f32 and rounded once.
    fn all_reduce(&self, buf: BufMut<'_>, op: ReduceOp) -> Result<(), ZeroError>;
    /// Reduces `input` (length `world_size * output.len()`, same dtype) across ranks; this
    /// rank receives chunk `rank` of the result in `output`.
    fn reduce_scatter(&self, input: BufRef<'_>, output: BufMut<'_>, op: ReduceOp) -> Result<(), ZeroError>;
    /// Concatenates every rank's `input` in rank order into `output`
    /// (length `world_size * input.len()`, same dtype).
    fn all_gather(&self, input: BufRef<'_>, output: BufMut<'_>) -> Result<(), ZeroError>;
    /// Copies `root`'s `buf` into every rank's `buf`.
    fn broadcast(&self, buf: BufMut<'_>, root: usize) -> Result<(), ZeroError>;
    /// Returns once every rank has called it.
    fn barrier(&self) -> Result<(), ZeroError>;
    /// Sends `buf` to rank `to`. Sends are buffered: one returns without waiting for its
    /// receive, so a schedule of sends and receives deadlocks only if its receives alone
    /// do. Messages from one rank to another arrive in the order they were sent.
    fn send(&self, buf: BufRef<'_>, to: usize) -> Result<(), ZeroError>;
    /// Receives the next message from rank `from` into `buf`, whose length and dtype must
    /// be the message's. Fails like a collective when `from` does not send within the
    /// timeout or the job is aborted.
    fn recv(&self, buf: BufMut<'_>, from: usize) -> Result<(), ZeroError>;
    /// Uneven all-to-all (MPI's `MPI_Alltoallv`, parts packed; the notes in
    /// the module `collective::all_to_all`): `input` holds this rank's part for every rank in
    /// rank order, `send_counts[j]` elements for rank `j`; `output` receives every rank's part
    /// for this one in rank order, `recv_counts[i]` elements from rank `i`, which must be the
    /// count rank `i` sends here ([`all_to_all_counts`](Self::all_to_all_counts) gives them,
    /// [`exchange`] does both). The default runs as sends and receives and is counted as
    /// those.
    fn all_to_all(
        &self,
        input: BufRef<'_>,
        send_counts: &[usize],
        output: BufMut<'_>,
        recv_counts: &[usize],
    ) -> Result<(), ZeroError> {
        all_to_all::through_messages(self, input, send_counts, output, recv_counts)
    }
    /// The counts of an [`all_to_all`](Self::all_to_all): given what this rank sends each
    /// rank, what each rank sends this one. Every rank calls it.
    fn all_to_all_counts(&self, send_counts: &[usize]) -> Result<Vec<usize>, ZeroError> {
        all_to_all::counts_by_all_gather(self, send_counts)
    }
    /// Splits the ranks: every rank calls it; those with the same `color` form a new
    /// communicator, ranked by `key` (then by rank here). An abort anywhere in the job
    /// reaches every communicator split from it.
    fn split(&self, color: usize, key: usize) -> Result<Arc<dyn Collective>, ZeroError>;
    /// Drives this rank's outstanding nonblocking work (MPI's buffered sends) and says
    /// whether any remains. Backends with none (the default) return false.
    fn progress(&self) -> bool {
        false
    }
    /// Starts `request` and returns at once where the backend runs collectives on a thread
    /// of their own ([`CommThread`]); otherwise (the default) runs it before returning. Its
    /// place in the order of this rank's collectives is the moment of this call.
    fn start(&self, request: Request) -> Pending {
        Pending::ready(request.run(self))
    }
    /// Whether [`on_device`](Self::on_device) runs collectives on the memory of the rank's
    /// GPU (NCCL's do); the host backends' (the default) do not.
    fn reads_device_memory(&self) -> bool {
        false
    }
    /// Runs `call` on buffers in the memory of the rank's GPU (the notes in [`device`]),
    /// returning once its work there has finished. A backend whose collectives read host
    /// memory (the default) refuses it, naming the call.
    fn on_device(&self, call: &DeviceCall) -> Result<(), ZeroError> {
        Err(call.refused(self.rank()))
    }
    /// Starts `call` as [`on_device`](Self::on_device) runs it and returns while its work
    /// on the GPU may still be running: the buffers' contract (the notes in [`device`])
    /// then holds until the returned [`Pending`] has been waited for. A pipeline's sends
    /// must not wait for their receivers (two stages sending to each other would wait
    /// forever): NCCL's [`DeviceOp::Send`] runs so. The default runs the call and returns
    /// it done.
    fn start_on_device(&self, call: &DeviceCall) -> Result<Pending, ZeroError> {
        self.on_device(call)?;
        Ok(Pending::ready(Ok(Completed::empty(call.input.dtype()))))
    }
    /// Marks the job failed: every rank's pending and future collectives return
    /// [`ZeroError::Aborted`] naming this rank and `reason`.
    fn abort(&self, reason: &str);
    /// Why the job was aborted, if it was and this backend can tell without a collective
    /// (the threads backend can; the default says nothing, and the next collective tells).
    fn aborted(&self) -> Option<String> {
        None
    }
    /// This rank's traffic so far.
    fn stats(&self) -> CommStats;
}

/// Calls and bytes of one kind of collective.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct OpStats {
    /// Number of calls.
    pub calls: u64,
    /// Bytes moved by this rank under the bus-bandwidth convention (module note).
    pub bytes: u64,
}

/// A snapshot of one rank's collective traffic.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CommStats {
    /// All-reduce traffic.
    pub all_reduce: OpStats,
    /// Reduce-scatter traffic.
    pub reduce_scatter: OpStats,
    /// All-gather traffic.
    pub all_gather: OpStats,
    /// Broadcast traffic.
    pub broadcast: OpStats,
    /// Number of barriers.
    pub barrier_calls: u64,
    /// Point-to-point messages sent (bytes sent; not in [`total_bytes`](Self::total_bytes),
    /// which counts what a rank receives).
    pub send: OpStats,
    /// Point-to-point messages received (bytes received).
    pub recv: OpStats,
}

impl CommStats {
    /// Bytes this rank received, every kind of call together.
    pub fn total_bytes(&self) -> u64 {
        self.all_reduce.bytes
            + self.reduce_scatter.bytes
            + self.all_gather.bytes
            + self.broadcast.bytes
            + self.recv.bytes
    }

    /// The traffic between `earlier` and `self`.
    pub fn since(&self, earlier: &CommStats) -> CommStats {
        self.combine(earlier, u64::wrapping_sub)
    }

    /// The traffic of `self` and `other` together (a rank's communicators added up).
    pub fn plus(&self, other: &CommStats) -> CommStats {
        self.combine(other, u64::saturating_add)
    }

    fn combine(&self, other: &CommStats, f: fn(u64, u64) -> u64) -> CommStats {
        let op = |a: OpStats, b: OpStats| OpStats { calls: f(a.calls, b.calls), bytes: f(a.bytes, b.bytes) };
        CommStats {
            all_reduce: op(self.all_reduce, other.all_reduce),
            reduce_scatter: op(self.reduce_scatter, other.reduce_scatter),
            all_gather: op(self.all_gather, other.all_gather),
            broadcast: op(self.broadcast, other.broadcast),
            barrier_calls: f(self.barrier_calls, other.barrier_calls),
            send: op(self.send, other.send),
            recv: op(self.recv, other.recv),
        }
    }
}

/// Thread-safe counters a backend updates and snapshots as [`CommStats`].
#[derive(Debug, Default)]
pub struct CommCounters {
    counters: [AtomicU64; 14],
}

/// Which counter pair a call updates.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OpKind {
    /// [`Collective::all_reduce`].
    AllReduce,
    /// [`Collective::reduce_scatter`].
    ReduceScatter,
    /// [`Collective::all_gather`].
    AllGather,
    /// [`Collective::broadcast`].
    Broadcast,
    /// [`Collective::barrier`].
    Barrier,
    /// [`Collective::send`].
    Send,
    /// [`Collective::recv`].
    Recv,
    /// [`Collective::split`] (no bytes, no counter of its own).
    Split,
    /// [`Collective::all_to_all`] (counted as its sends and receives, no counter of its own).
    AllToAll,
}

impl OpKind {
    /// The collective's name, for errors.
    pub fn name(self) -> &'static str {
        match self {
            Self::AllReduce => "all_reduce",
            Self::ReduceScatter => "reduce_scatter",
            Self::AllGather => "all_gather",
            Self::Broadcast => "broadcast",
            Self::Barrier => "barrier",
            Self::Send => "send",
            Self::Recv => "recv",
            Self::Split => "split",
            Self::AllToAll => "all_to_all",
        }
    }
}

impl CommCounters {
    /// Records one call of `kind` that moved `bytes` (splits and all-to-alls, counted as
    /// their messages, are not).
    pub fn record(&self, kind: OpKind, bytes: u64) {
        if matches!(kind, OpKind::Split | OpKind::AllToAll) {
            return;
        }
        let i = kind as usize * 2;
        self.counters[i].fetch_add(1, Ordering::Relaxed);
        if kind != OpKind::Barrier {
            self.counters[i + 1].fetch_add(bytes, Ordering::Relaxed);
        }
    }

    /// The counters as they are now.
    pub fn snapshot(&self) -> CommStats {
        let g = |i: usize| self.counters[i].load(Ordering::Relaxed);
        let op = |k: OpKind| OpStats { calls: g(k as usize * 2), bytes: g(k as usize * 2 + 1) };
        CommStats {
            all_reduce: op(OpKind::AllReduce),
            reduce_scatter: op(OpKind::ReduceScatter),
            all_gather: op(OpKind::AllGather),
            broadcast: op(OpKind::Broadcast),
            barrier_calls: g(OpKind::Barrier as usize * 2),
            send: op(OpKind::Send),
            recv: op(OpKind::Recv),
        }
    }
}

/// Bytes one rank moves for `kind` on a buffer of `buffer_elems` elements of `elem_bytes`
/// each (the full, unscattered buffer) over `world_size` ranks, under the bus-bandwidth
/// convention, for chunk boundaries at [`chunk_range`]. `rank` matters only for all-reduce
/// with uneven chunks and for broadcast.
pub fn convention_bytes(
    kind: OpKind,
    buffer_elems: usize,
    elem_bytes: usize,
    world_size: usize,
    rank: usize,
    root: usize,
) -> u64 {
    let n = world_size;
    let elems = match kind {
        OpKind::AllReduce => {
            // Reduce own chunk from N-1 peers, then fetch the N-1 other chunks.
            let own = chunk_range(buffer_elems, n, rank).len();
            (n - 1) * own + (buffer_elems - own)
        }
        OpKind::ReduceScatter | OpKind::AllGather => buffer_elems / n * (n - 1),
        OpKind::Broadcast => {
            if rank == root {
                0
            } else {
                buffer_elems
            }
        }
        OpKind::Barrier => 0,
        OpKind::Send | OpKind::Recv => buffer_elems,
        OpKind::Split | OpKind::AllToAll => 0,
    };
    (elems * elem_bytes) as u64
}

/// The chunk of a `len`-element all-reduce buffer that `rank` reduces: `len / n` each, the
/// first `len % n` ranks one more.
pub fn chunk_range(len: usize, n: usize, rank: usize) -> std::ops::Range<usize> {
    let base = len / n;
    let extra = len % n;
    let start = rank * base + rank.min(extra);
    start..start + base + usize::from(rank < extra)
}

#[cfg(test)]
mod tests;
