//! The MPI backend: one rank per process, under `mpirun`, on one or many machines.
//!
//! # Note: half precision over MPI
//! See the `half` module: f16/bf16 reductions travel as 16 bits and are summed in f32 in
//! rank order, as the threads backend sums them (the same bits, half the bytes of f32).
//! Gathers and broadcasts move the 16-bit patterns as `u16`.
//!
//! # Note: point-to-point
//! See the `p2p` module: sends are buffered, driven by the communication thread.
//!
//! # Note: reduce-scatter
//! See the `ring` module: a ring of nonblocking sends and receives, not libnbc's.
//!
//! # Note: timeouts
//! Blocking MPI collectives wait forever for a rank that stalled (SIGSTOP, a livelock, a
//! dead node whose process the launcher did not notice). Every collective here is the
//! nonblocking form (`MPI_Iallreduce`, `MPI_Ireduce_scatter_block`, `MPI_Iallgather`,
//! `MPI_Ibcast`, `MPI_Ibarrier`) polled with `MPI_Test` against the job's collective
//! timeout. A pending request cannot be cancelled and still borrows its buffers, so a
//! timeout ends the job: the rank prints what it waited for and calls `MPI_Abort`, which
//! also ends the stalled process. Polling stays on the initialising thread, as
//! `MPI_THREAD_FUNNELED` requires.
//!
//! # Note: a dead launcher
//! See the `launcher` module: no collective completes, and an idle rank ends within 20 ms,
//! once the `mpirun` that started the rank has died.
//!
//! # Note: threads
//! MPI is initialised with `MPI_THREAD_FUNNELED`: only the thread that initialised it may
//! call it. The launcher creates [`MpiComm`] on the rank's communication thread
//! ([`CommThread`](super::CommThread)), which then makes every MPI call. The [`Collective`]
//! trait needs `Send + Sync`, so [`MpiComm`] checks the calling thread in every method and
//! returns an error on any other thread instead of calling MPI.

use std::mem::ManuallyDrop;
use std::sync::{Arc, Mutex};
use std::thread::ThreadId;
use std::time::{Duration, Instant};

use mpi::collective::SystemOperation;
use mpi::environment::{Threading, Universe};
use mpi::point_to_point::Status;
use mpi::request::{Request, Scope, scope};
use mpi::topology::{Color, SimpleCommunicator};
use mpi::traits::*;
use zerotrain_precision::half::{bf16, f16};
use zerotrain_precision::{BufMut, BufRef};

pub use self::launcher::LAUNCHER_GONE_EXIT_CODE;
use self::launcher::{exit_if_orphaned, exit_when_the_launcher_dies};
use self::p2p::Outgoing;
use crate::ZeroError;
use crate::collective::{Collective, CommCounters, CommStats, OpKind, ReduceOp, convention_bytes};

mod half;
mod launcher;
mod p2p;
mod ring;

/// This process's rank in an MPI job (or in a group split from it).
pub struct MpiComm {
    universe: Option<Universe>,
    /// Never dropped: freeing a communicator is an MPI call, and a group's handle may be
    /// dropped on any thread or after MPI is finalised; MPI frees them at finalisation.
    world: ManuallyDrop<SimpleCommunicator>,
    rank: usize,
    size: usize,
    thread: ThreadId,
    timeout: Duration,
    /// The process that started this rank (see the module note "a dead launcher").
    launcher: u32,
    counters: CommCounters,
    /// Sends in flight, of this communicator and every group split from it.
    outgoing: Arc<Mutex<Vec<Outgoing>>>,
}

// SAFETY: every method that touches MPI first checks that it runs on `thread`, the thread
// that initialised MPI with MPI_THREAD_FUNNELED, and returns an error otherwise; Drop leaks
// the universe rather than finalising MPI from another thread. So no MPI call ever happens
// off that thread, however the handle is shared or moved.
unsafe impl Send for MpiComm {}
// SAFETY: as above.
unsafe impl Sync for MpiComm {}

impl std::fmt::Debug for MpiComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MpiComm").field("rank", &self.rank).field("size", &self.size).finish()
    }
}

impl MpiComm {
    /// Initialises MPI on this thread (once per process: MPI cannot start twice). A
    /// collective that has not completed after `timeout` aborts the job (module note).
    pub fn init(timeout: Duration) -> Result<Self, ZeroError> {
        let fail = ZeroError::MpiInit;
        let (universe, level) = mpi::initialize_with_threading(Threading::Funneled).ok_or_else(|| {
            fail("MPI was already initialised in this process (one launch per process under mpirun)".into())
        })?;
        if level < Threading::Funneled {
            return Err(fail(format!("the MPI library gives thread level {level:?}, zerotrain needs Funneled")));
        }
        let world = universe.world();
        let (rank, size) = (world.rank() as usize, world.size() as usize);
        let launcher = std::os::unix::process::parent_id();
        exit_when_the_launcher_dies(launcher);
        Ok(Self {
            universe: Some(universe),
            world: ManuallyDrop::new(world),
            rank,
            size,
            thread: std::thread::current().id(),
            timeout,
            launcher,
            counters: CommCounters::default(),
            #[allow(clippy::arc_with_non_send_sync, reason = "used on MPI's thread only (see the SAFETY note)")]
            outgoing: Arc::new(Mutex::new(Vec::new())),
        })
    }

    fn check(&self, op: OpKind) -> Result<(), ZeroError> {
        exit_if_orphaned(self.launcher);
        if std::thread::current().id() == self.thread {
            Ok(())
        } else {
            let detail = "MPI may only be called from the thread that initialised it".into();
            Err(ZeroError::BadBuffer { rank: self.rank, op: op.name(), detail })
        }
    }

    /// The shard is `shard` elements and the full buffer `full`: `full` must be `world_size`
    /// shards, in one dtype.
    fn check_shapes(&self, op: OpKind, shard: usize, full: usize, same_dtype: bool) -> Result<(), ZeroError> {
        if full == shard * self.size && same_dtype {
            return Ok(());
        }
        let detail = format!("{full} elements are not {} ranks x {shard}, or the dtypes differ", self.size);
        Err(ZeroError::BadBuffer { rank: self.rank, op: op.name(), detail })
    }

    /// Polls `request` until it completes; past the timeout, aborts the job (module note).
    fn complete<'a, D: ?Sized, S: Scope<'a>>(&self, op: OpKind, request: Request<'a, D, S>) {
        self.complete_with_status(op, request);
    }

    /// [`complete`](Self::complete), returning the request's status.
    fn complete_with_status<'a, D: ?Sized, S: Scope<'a>>(&self, op: OpKind, mut request: Request<'a, D, S>) -> Status {
        let start = Instant::now();
        loop {
            match request.test() {
                Ok(status) => return status,
                Err(pending) => request = pending,
            }
            exit_if_orphaned(self.launcher);
            self.drive_sends();
            let waited = start.elapsed();
            if waited >= self.timeout {
                let message = format!(
                    "zerotrain: rank {}: {} timed out after {} ms waiting for the other ranks (one stalled or died); \
                     aborting the MPI job\n",
                    self.rank,
                    op.name(),
                    self.timeout.as_millis()
                );
                let _ = std::io::Write::write_all(&mut std::io::stderr(), message.as_bytes());
                self.world.abort(1);
            }
            // Spin briefly (most collectives finish within microseconds), then yield the
            // core, then sleep: ranks (and their computing threads) may outnumber cores, and
            // a long wait (a pipeline stage waiting for its neighbour) must not take the
            // core from the rank it waits for.
            if waited < Duration::from_micros(200) {
                std::hint::spin_loop();
            } else if waited < Duration::from_millis(2) {
                std::thread::yield_now();
            } else {
                std::thread::sleep(Duration::from_micros(50));
            }
        }
    }

    fn check_rank(&self, op: OpKind, peer: usize) -> Result<(), ZeroError> {
        if peer < self.size {
            return Ok(());
        }
        let detail = format!("rank {peer} is not a rank of {}", self.size);
        Err(ZeroError::BadBuffer { rank: self.rank, op: op.name(), detail })
    }

    fn record(&self, kind: OpKind, elems: usize, elem_bytes: usize, root: usize) {
        self.counters.record(kind, convention_bytes(kind, elems, elem_bytes, self.size, self.rank, root));
    }
}

impl Drop for MpiComm {
    fn drop(&mut self) {
        if std::thread::current().id() != self.thread {
            // Finalising MPI from another thread is not allowed: leak it instead, and the
            // sends in flight with it (a request dropped unfinished would panic).
            std::mem::forget(self.universe.take());
            std::mem::forget(std::mem::take(&mut *self.outgoing.lock().unwrap_or_else(|e| e.into_inner())));
            return;
        }
        if self.universe.is_some() {
            // Finalise only once every send has been received, within the timeout (after
            // it the job is failing anyway).
            let start = Instant::now();
            while self.drive_sends() && start.elapsed() < self.timeout {
                std::thread::yield_now();
            }
            std::mem::forget(std::mem::take(&mut *self.outgoing.lock().unwrap_or_else(|e| e.into_inner())));
        }
    }
}

fn system_op(op: ReduceOp) -> SystemOperation {
    match op {
        ReduceOp::Sum => SystemOperation::sum(),
        ReduceOp::Max => SystemOperation::max(),
        ReduceOp::Min => SystemOperation::min(),
    }
}

/// The 16-bit patterns of a half buffer, and back.
fn bits(buf: BufRef<'_>) -> Vec<u16> {
    match buf {
        BufRef::F16(v) => v.iter().map(|x| x.to_bits()).collect(),
        BufRef::Bf16(v) => v.iter().map(|x| x.to_bits()).collect(),
        BufRef::F32(_) => unreachable!("only half buffers travel as bits"),
    }
}

fn from_bits(bits: &[u16], out: BufMut<'_>) {
    match out {
        BufMut::F16(v) => v.iter_mut().zip(bits).for_each(|(o, &b)| *o = f16::from_bits(b)),
        BufMut::Bf16(v) => v.iter_mut().zip(bits).for_each(|(o, &b)| *o = bf16::from_bits(b)),
        BufMut::F32(_) => unreachable!("only half buffers travel as bits"),
    }
}

impl Collective for MpiComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.size
    }

    fn all_reduce(&self, buf: BufMut<'_>, op: ReduceOp) -> Result<(), ZeroError> {
        self.check(OpKind::AllReduce)?;
        let BufMut::F32(v) = buf else { return self.all_reduce_half(buf, op) };
        // rsmpi has no MPI_IN_PLACE, so the send side is a copy.
        let send = v.to_vec();
        scope(|s| {
            let request = self.world.immediate_all_reduce_into(s, &send[..], &mut v[..], system_op(op));
            self.complete(OpKind::AllReduce, request);
        });
        self.record(OpKind::AllReduce, send.len(), 4, 0);
        Ok(())
    }

    fn reduce_scatter(&self, input: BufRef<'_>, output: BufMut<'_>, op: ReduceOp) -> Result<(), ZeroError> {
        self.check(OpKind::ReduceScatter)?;
        self.check_shapes(OpKind::ReduceScatter, output.len(), input.len(), input.dtype() == output.dtype())?;
        match (input, output) {
            (BufRef::F32(input), BufMut::F32(output)) => self.reduce_scatter_ring(input, output, op),
            (input, output) => self.reduce_scatter_half(input, output, op),
        }
    }

    fn all_gather(&self, input: BufRef<'_>, output: BufMut<'_>) -> Result<(), ZeroError> {
        self.check(OpKind::AllGather)?;
        self.check_shapes(OpKind::AllGather, input.len(), output.len(), input.dtype() == output.dtype())?;
        let total = output.len();
        match (input, output) {
            (BufRef::F32(i), BufMut::F32(o)) => {
                scope(|s| self.complete(OpKind::AllGather, self.world.immediate_all_gather_into(s, i, o)));
                self.record(OpKind::AllGather, total, 4, 0);
            }
            (i, o) => {
                let mut gathered = vec![0u16; total];
                let send = bits(i);
                scope(|s| {
                    let request = self.world.immediate_all_gather_into(s, &send[..], &mut gathered[..]);
                    self.complete(OpKind::AllGather, request);
                });
                from_bits(&gathered, o);
                self.record(OpKind::AllGather, total, 2, 0);
            }
        }
        Ok(())
    }

    fn broadcast(&self, buf: BufMut<'_>, root: usize) -> Result<(), ZeroError> {
        self.check(OpKind::Broadcast)?;
        if root >= self.size {
            let detail = format!("root {root} is not a rank of {}", self.size);
            return Err(ZeroError::BadBuffer { rank: self.rank, op: OpKind::Broadcast.name(), detail });
        }
        let len = buf.len();
        let process = self.world.process_at_rank(root as i32);
        match buf {
            BufMut::F32(v) => {
                scope(|s| self.complete(OpKind::Broadcast, process.immediate_broadcast_into(s, v)));
                self.record(OpKind::Broadcast, len, 4, root);
            }
            other => {
                let mut b = bits(as_ref(&other));
                scope(|s| self.complete(OpKind::Broadcast, process.immediate_broadcast_into(s, &mut b[..])));
                from_bits(&b, other);
                self.record(OpKind::Broadcast, len, 2, root);
            }
        }
        Ok(())
    }

    fn barrier(&self) -> Result<(), ZeroError> {
        self.check(OpKind::Barrier)?;
        self.complete(OpKind::Barrier, self.world.immediate_barrier());
        self.counters.record(OpKind::Barrier, 0);
        Ok(())
    }

    fn send(&self, buf: BufRef<'_>, to: usize) -> Result<(), ZeroError> {
        self.send_buffered(buf, to)
    }

    fn recv(&self, buf: BufMut<'_>, from: usize) -> Result<(), ZeroError> {
        self.recv_polled(buf, from)
    }

    fn split(&self, color: usize, key: usize) -> Result<Arc<dyn Collective>, ZeroError> {
        self.check(OpKind::Split)?;
        let (Ok(color), Ok(key)) = (i32::try_from(color), i32::try_from(key)) else {
            let detail = format!("color {color} or key {key} does not fit MPI's int");
            return Err(ZeroError::BadBuffer { rank: self.rank, op: OpKind::Split.name(), detail });
        };
        let group = self.world.split_by_color_with_key(Color::with_value(color), key).ok_or_else(|| {
            let detail = "MPI gave no communicator for the color".to_string();
            ZeroError::BadBuffer { rank: self.rank, op: OpKind::Split.name(), detail }
        })?;
        let (rank, size) = (group.rank() as usize, group.size() as usize);
        Ok(Arc::new(Self {
            universe: None,
            world: ManuallyDrop::new(group),
            rank,
            size,
            thread: self.thread,
            timeout: self.timeout,
            launcher: self.launcher,
            counters: CommCounters::default(),
            outgoing: Arc::clone(&self.outgoing),
        }))
    }

    fn progress(&self) -> bool {
        std::thread::current().id() == self.thread && self.drive_sends()
    }

    /// Ends the whole job at once: on the MPI thread with `MPI_Abort`; from any other
    /// thread (the rank's own, while the MPI thread may be inside a collective) by ending
    /// the process, which makes `mpirun` end the others. The other processes do not
    /// return.
    fn abort(&self, reason: &str) {
        let message = format!("zerotrain: rank {} aborts the MPI job: {reason}\n", self.rank);
        let _ = std::io::Write::write_all(&mut std::io::stderr(), message.as_bytes());
        if std::thread::current().id() == self.thread {
            self.world.abort(1);
        }
        // SAFETY: `_exit` takes no pointers and is always sound to call. Not `exit`: its
        // handlers would wait on MPI, which the MPI thread may be using right now.
        unsafe { libc::_exit(1) };
    }

    fn stats(&self) -> CommStats {
        self.counters.snapshot()
    }
}

fn as_ref<'a>(buf: &'a BufMut<'_>) -> BufRef<'a> {
    match buf {
        BufMut::F32(v) => BufRef::F32(v),
        BufMut::F16(v) => BufRef::F16(v),
        BufMut::Bf16(v) => BufRef::Bf16(v),
    }
}
