//! The MPI backend: one rank per process, under `mpirun`, on one or many machines.
//!
//! # Note: half precision over MPI
//! MPI has no 16-bit float sum. Reductions of f16/bf16 buffers widen to f32, reduce, and
//! round back once: twice the bytes of the half data on the wire, counted as such, plus
//! one conversion each way. Gathers and broadcasts move the 16-bit patterns as `u16`,
//! exactly half the bytes of f32.
//!
//! # Note: point-to-point
//! A send copies its buffer and starts an `MPI_Isend` of the copy, which stays in flight
//! until MPI has delivered it: a send never waits for its receive (the buffered semantics
//! the trait promises, which pipeline schedules rely on). MPI progresses a send only inside
//! MPI calls, so the rank's communication thread drives the sends in flight between jobs
//! and while it polls any other request; finished sends free their copies. A receive
//! polls an `MPI_Irecv` against the timeout like a collective.
//!
//! # Note: reduce-scatter
//! OpenMPI's nonblocking reduce-scatter (libnbc) reduces towards some ranks through
//! temporary buffers of the whole input: at 4 ranks rank 0 held two extra copies and rank
//! 2 one, a peak the others did not have. Reduce-scatter here is a ring of nonblocking
//! sends and receives instead: every rank holds two chunks besides its buffers, and moves
//! the same `(N-1)/N` of the buffer as any bandwidth-optimal algorithm.
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
//! A rank whose launcher died (`mpirun` SIGKILLed, its node daemon lost) would train on
//! alone and go on writing checkpoints for a job nobody runs. Every collective checks
//! first, and while it waits, that the process that started the rank is still its parent
//! (an orphan is re-parented), so no collective completes after `mpirun` died; a save
//! needs several, so at most a commit already in flight can still land. A watchdog thread
//! also ends an idle rank within 20 ms (a 20 ms window alone let a loaded machine commit
//! two more checkpoints). `PR_SET_PDEATHSIG` is not used: it fires when the *thread* of
//! `mpirun` that forked the rank exits, which OpenMPI's shutdown on SIGINT does before the
//! ranks have saved. Both end the process with `_exit`: `exit` would run MPI's exit handlers, which
//! wait a second for the dead runtime while the rank thread trains on. Ending a rank at
//! any moment, a checkpoint save included, is safe: the commit protocol leaves the
//! previous checkpoint and `latest` intact.
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
use mpi::datatype::Equivalence;
use mpi::environment::{Threading, Universe};
use mpi::point_to_point::Status;
use mpi::request::{Request, Scope, StaticScope, scope};
use mpi::topology::{Color, SimpleCommunicator};
use mpi::traits::*;
use zerotrain_precision::half::{bf16, f16};
use zerotrain_precision::{BufMut, BufRef, FlatElem, with_elem};

use super::{Collective, CommCounters, CommStats, OpKind, ReduceOp, convention_bytes};
use crate::ZeroError;

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

/// A send in flight and the buffer it reads, freed once it completes (module note on
/// point-to-point).
enum Outgoing {
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
            outgoing: Arc::new(Mutex::new(Vec::new())),
        })
    }

    /// Tests every send in flight, freeing the finished ones; whether any remain.
    fn drive_sends(&self) -> bool {
        let mut outgoing = self.outgoing.lock().unwrap_or_else(|e| e.into_inner());
        let pending = std::mem::take(&mut *outgoing);
        outgoing.extend(pending.into_iter().filter_map(Outgoing::test));
        !outgoing.is_empty()
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

/// Ends the process at once if `launcher` is no longer its parent (module note "a dead
/// launcher").
fn exit_if_orphaned(launcher: u32) {
    if std::os::unix::process::parent_id() != launcher {
        // Not eprintln!: stderr was a pipe to the dead launcher, and a failed write must
        // not panic before the process ends.
        let message = format!("zerotrain: this rank's launcher (process {launcher}) is gone; the rank stops\n");
        let _ = std::io::Write::write_all(&mut std::io::stderr(), message.as_bytes());
        // SAFETY: `_exit` takes no pointers and is always sound to call; it ends the
        // process at once without running exit handlers or destructors, as intended.
        unsafe { libc::_exit(1) };
    }
}

/// The watchdog of the module note "a dead launcher", for a rank between collectives.
fn exit_when_the_launcher_dies(launcher: u32) {
    let watch = move || {
        loop {
            std::thread::sleep(Duration::from_millis(20));
            exit_if_orphaned(launcher);
        }
    };
    if let Err(e) = std::thread::Builder::new().name("zerotrain-launcher-watch".into()).spawn(watch) {
        eprintln!("zerotrain: warning: cannot watch the launcher ({e}); if mpirun dies this rank runs on");
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

    fn all_reduce(&self, mut buf: BufMut<'_>, op: ReduceOp) -> Result<(), ZeroError> {
        self.check(OpKind::AllReduce)?;
        let len = buf.len();
        // rsmpi has no MPI_IN_PLACE, so the send side is a copy; half buffers reduce in f32.
        let reduce = |send: &[f32], recv: &mut [f32]| {
            scope(|s| {
                let request = self.world.immediate_all_reduce_into(s, send, recv, system_op(op));
                self.complete(OpKind::AllReduce, request);
            })
        };
        if let BufMut::F32(v) = &mut buf {
            let send = v.to_vec();
            reduce(&send, v);
        } else {
            let send = as_ref(&buf).to_f32();
            let mut recv = vec![0.0f32; len];
            reduce(&send, &mut recv);
            buf.copy_from(BufRef::F32(&recv), false);
        }
        self.record(OpKind::AllReduce, len, 4, 0);
        Ok(())
    }

    /// A ring (see the module note on reduce-scatter): `N - 1` steps, each sending one
    /// chunk to the next rank and adding the chunk received from the previous one.
    fn reduce_scatter(&self, input: BufRef<'_>, mut output: BufMut<'_>, op: ReduceOp) -> Result<(), ZeroError> {
        self.check(OpKind::ReduceScatter)?;
        self.check_shapes(OpKind::ReduceScatter, output.len(), input.len(), input.dtype() == output.dtype())?;
        let (n, r, c) = (self.size, self.rank, output.len());
        let chunk = |k: usize| input.slice(k * c..(k + 1) * c);
        // The partial sum this rank passes on, in f32 (the output itself when it is f32):
        // first its own part of chunk r - 1.
        let mut widened = Vec::new();
        let acc: &mut [f32] = match &mut output {
            BufMut::F32(out) => out,
            _ => {
                widened.resize(c, 0.0);
                &mut widened
            }
        };
        BufMut::F32(acc).copy_from(chunk((r + n - 1) % n), false);
        let mut received = vec![0.0f32; c];
        let next = self.world.process_at_rank(((r + 1) % n) as i32);
        let previous = self.world.process_at_rank(((r + n - 1) % n) as i32);
        for step in 0..n - 1 {
            scope(|s| {
                let receive = previous.immediate_receive_into(s, &mut received[..]);
                let send = next.immediate_send(s, &acc[..]);
                self.complete(OpKind::ReduceScatter, receive);
                self.complete(OpKind::ReduceScatter, send);
            });
            // The received partial is of chunk r - 2 - step; add this rank's part of it.
            let mine = chunk((r + 2 * n - 2 - step) % n);
            with_elem!(BufRef, mine, m, _E => {
                for ((a, &theirs), x) in acc.iter_mut().zip(&received).zip(m) {
                    *a = op.apply(theirs, x.to_f32());
                }
            });
        }
        // After N - 1 steps the partial is chunk r, summed over every rank.
        if !widened.is_empty() {
            output.copy_from(BufRef::F32(&widened), false);
        }
        // Half buffers travel widened, as f32 (module note on half precision).
        self.record(OpKind::ReduceScatter, input.len(), 4, 0);
        Ok(())
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

    /// Starts a nonblocking send of a copy of `buf` and returns (module note on
    /// point-to-point).
    fn send(&self, buf: BufRef<'_>, to: usize) -> Result<(), ZeroError> {
        self.check(OpKind::Send)?;
        self.check_rank(OpKind::Send, to)?;
        let process = self.world.process_at_rank(to as i32);
        let outgoing = match buf {
            BufRef::F32(v) => {
                let buffer = Box::into_raw(v.to_vec().into_boxed_slice());
                // SAFETY: the buffer lives until the send completes (`Outgoing::test` frees it
                // then, and Drop leaks it if it never does), so 'static is never violated.
                let request = process.immediate_send(StaticScope, unsafe { &*buffer });
                Outgoing::F32(request, buffer)
            }
            other => {
                let buffer = Box::into_raw(bits(other).into_boxed_slice());
                // SAFETY: as above.
                let request = process.immediate_send(StaticScope, unsafe { &*buffer });
                Outgoing::Bits(request, buffer)
            }
        };
        self.outgoing.lock().unwrap_or_else(|e| e.into_inner()).push(outgoing);
        self.drive_sends();
        self.counters.record(OpKind::Send, (buf.len() * buf.dtype().bytes_per_elem()) as u64);
        Ok(())
    }

    fn recv(&self, mut buf: BufMut<'_>, from: usize) -> Result<(), ZeroError> {
        self.check(OpKind::Recv)?;
        self.check_rank(OpKind::Recv, from)?;
        let process = self.world.process_at_rank(from as i32);
        let len = buf.len();
        let count = match &mut buf {
            BufMut::F32(v) => scope(|s| {
                let request = process.immediate_receive_into(s, &mut v[..]);
                self.complete_with_status(OpKind::Recv, request).count(f32::equivalent_datatype())
            }),
            other => {
                let mut bits = vec![0u16; len];
                let count = scope(|s| {
                    let request = process.immediate_receive_into(s, &mut bits[..]);
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
