//! A rank's communication thread: every collective of the rank runs on it, in the order
//! the rank issued them, so that [`Collective::start`] returns at once and the rank computes
//! while the collective runs (gradient reduction overlapping backward, parameter prefetch).
//!
//! # Note: one thread, one order
//! Collectives must be issued in the same order on every rank. Running *all* of a rank's
//! collectives on one thread, blocking ones included, keeps that order whatever mix of
//! asynchronous and blocking calls the rank makes. It also satisfies MPI's
//! `MPI_THREAD_FUNNELED`: [`CommThread::spawn`] creates the collective on the thread
//! itself, so MPI is initialised, used and finalised on that one thread.
//!
//! # Note: borrowed buffers
//! The blocking methods take borrowed buffers and hand them to the thread. They block until
//! the thread has finished with them (or dropped the job unrun), so the borrow outlives
//! every use, as with a scoped thread. Their jobs never outlive the call.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;
use std::sync::mpsc::{self, Sender};
use std::thread::JoinHandle;

use zerotrain_precision::{BufMut, BufRef};

use super::{Collective, CommStats, Pending, ReduceOp, Request};
use crate::ZeroError;

type Job = Box<dyn FnOnce(&dyn Collective) + Send + 'static>;

/// A collective run on a thread of its own (see the module notes).
pub struct CommThread {
    rank: usize,
    world_size: usize,
    /// For the calls that need no ordering (`abort`, `stats`); `None` only while dropping.
    shared: Option<Arc<dyn Collective>>,
    jobs: Option<Sender<Job>>,
    worker: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for CommThread {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CommThread").field("rank", &self.rank).field("world_size", &self.world_size).finish()
    }
}

impl CommThread {
    /// Moves `comm` onto a new communication thread.
    pub fn new<C: Collective + 'static>(comm: C) -> Result<Self, ZeroError> {
        let name = format!("zerotrain-comm-{}", comm.rank());
        Self::spawn(name, move || Ok(comm))
    }

    /// Starts a communication thread named `name` and creates its collective there with
    /// `make` (MPI must be initialised on the thread that uses it).
    pub fn spawn<C, F>(name: String, make: F) -> Result<Self, ZeroError>
    where
        C: Collective + 'static,
        F: FnOnce() -> Result<C, ZeroError> + Send + 'static,
    {
        let (ready_tx, ready_rx) = mpsc::channel::<Result<Arc<dyn Collective>, ZeroError>>();
        let (jobs_tx, jobs_rx) = mpsc::channel::<Job>();
        let worker = std::thread::Builder::new()
            .name(name)
            .spawn(move || {
                let comm: Arc<dyn Collective> = match make() {
                    Ok(comm) => Arc::new(comm),
                    Err(e) => {
                        let _ = ready_tx.send(Err(e));
                        return;
                    }
                };
                let _ = ready_tx.send(Ok(Arc::clone(&comm)));
                for job in jobs_rx {
                    // A panicking job has dropped its reply channel while unwinding, so its
                    // caller gets an error; the thread stops, and so do later callers.
                    if catch_unwind(AssertUnwindSafe(|| job(comm.as_ref()))).is_err() {
                        break;
                    }
                }
                // `comm` is dropped here, on its own thread, after the caller's handle.
            })
            .map_err(|e| ZeroError::CommThread(format!("cannot start it: {e}")))?;
        let shared = ready_rx
            .recv()
            .unwrap_or_else(|_| Err(ZeroError::CommThread("it stopped while creating its collective".into())))?;
        Ok(Self {
            rank: shared.rank(),
            world_size: shared.world_size(),
            shared: Some(shared),
            jobs: Some(jobs_tx),
            worker: Some(worker),
        })
    }

    fn send(&self, job: Job) -> Result<(), ZeroError> {
        let jobs = self.jobs.as_ref().ok_or_else(stopped)?;
        // A failed send hands the job back inside the error, and it is dropped unrun here.
        jobs.send(job).map_err(|_| stopped())
    }

    /// Runs `f` on the thread and waits for its result (see the note on borrowed buffers).
    fn call<'a, R: Send + 'a>(
        &self,
        f: impl FnOnce(&dyn Collective) -> Result<R, ZeroError> + Send + 'a,
    ) -> Result<R, ZeroError> {
        let (tx, rx) = mpsc::sync_channel(1);
        let job: Box<dyn FnOnce(&dyn Collective) + Send + 'a> = Box::new(move |comm| {
            let _ = tx.send(f(comm));
        });
        // SAFETY: only the lifetime changes. The job may borrow data of lifetime 'a; this
        // function does not return before the job has run (its result arrived) or has been
        // dropped unrun (its sender dropped, so `recv` fails), and neither the thread nor
        // anything else keeps the job or its captures after that.
        let job: Job = unsafe { std::mem::transmute::<Box<dyn FnOnce(&dyn Collective) + Send + 'a>, Job>(job) };
        self.send(job)?;
        rx.recv().unwrap_or_else(|_| Err(stopped()))
    }

    fn shared(&self) -> &dyn Collective {
        self.shared.as_deref().expect("only None while dropping")
    }
}

fn stopped() -> ZeroError {
    ZeroError::CommThread("it has stopped (an earlier collective panicked)".into())
}

impl Collective for CommThread {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world_size
    }

    fn all_reduce(&self, buf: BufMut<'_>, op: ReduceOp) -> Result<(), ZeroError> {
        self.call(move |comm| comm.all_reduce(buf, op))
    }

    fn reduce_scatter(&self, input: BufRef<'_>, output: BufMut<'_>, op: ReduceOp) -> Result<(), ZeroError> {
        self.call(move |comm| comm.reduce_scatter(input, output, op))
    }

    fn all_gather(&self, input: BufRef<'_>, output: BufMut<'_>) -> Result<(), ZeroError> {
        self.call(move |comm| comm.all_gather(input, output))
    }

    fn broadcast(&self, buf: BufMut<'_>, root: usize) -> Result<(), ZeroError> {
        self.call(move |comm| comm.broadcast(buf, root))
    }

    fn barrier(&self) -> Result<(), ZeroError> {
        self.call(|comm| comm.barrier())
    }

    fn start(&self, request: Request) -> Pending {
        let (tx, rx) = mpsc::sync_channel(1);
        let job: Job = Box::new(move |comm| {
            let _ = tx.send(request.run(comm));
        });
        match self.send(job) {
            Ok(()) => Pending::running(rx),
            Err(e) => Pending::ready(Err(e)),
        }
    }

    /// Aborts at once, from the calling thread: the communication thread may be waiting
    /// inside a collective that only the abort can end.
    fn abort(&self, reason: &str) {
        self.shared().abort(reason);
    }

    fn stats(&self) -> CommStats {
        self.shared().stats()
    }
}

impl Drop for CommThread {
    fn drop(&mut self) {
        // The thread must hold the last handle, so that it drops (for MPI: finalises) the
        // collective itself; then closing the queue ends it.
        drop(self.shared.take());
        drop(self.jobs.take());
        if let Some(worker) = self.worker.take() {
            let _ = worker.join();
        }
    }
}
