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
//!
//! # Note: groups
//! A group split from a rank's collective ([`Collective::split`]) is created on the
//! communication thread and its calls run there too, in the same one order: the handle
//! [`CommThread::split`] returns shares the thread, and its collective is dropped there
//! when the handle is. The handle that started the thread stops it when dropped (after the
//! jobs already queued); a group handle used after that gets an error.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;
use std::sync::mpsc::{self, RecvTimeoutError, Sender};
use std::thread::JoinHandle;
use std::time::Duration;

use zerotrain_precision::{BufMut, BufRef};

use super::{Collective, CommStats, DeviceCall, Pending, ReduceOp, Request};
use crate::ZeroError;

type Job = Box<dyn FnOnce() + Send + 'static>;

/// What the communication thread is asked.
enum Message {
    Run(Job),
    Stop,
}

/// How often an idle thread drives its collective's outstanding work (MPI's sends).
const PROGRESS_INTERVAL: Duration = Duration::from_millis(1);

/// A collective run on a thread of its own (see the module notes).
pub struct CommThread {
    rank: usize,
    world_size: usize,
    /// The collective this handle's jobs run on (the thread's own, or a group's); `None`
    /// only while dropping.
    target: Option<Arc<dyn Collective>>,
    jobs: Option<Sender<Message>>,
    /// The thread, held by the handle that started it.
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
        let (jobs_tx, jobs_rx) = mpsc::channel::<Message>();
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
                loop {
                    let message = if comm.progress() {
                        match jobs_rx.recv_timeout(PROGRESS_INTERVAL) {
                            Ok(message) => message,
                            Err(RecvTimeoutError::Timeout) => continue,
                            Err(RecvTimeoutError::Disconnected) => break,
                        }
                    } else {
                        match jobs_rx.recv() {
                            Ok(message) => message,
                            Err(_) => break,
                        }
                    };
                    let Message::Run(job) = message else { break };
                    // A panicking job has dropped its reply channel while unwinding, so its
                    // caller gets an error; the thread stops, and so do later callers.
                    if catch_unwind(AssertUnwindSafe(job)).is_err() {
                        break;
                    }
                }
                // `comm` is dropped here, on its own thread, after the caller's handle.
            })
            .map_err(|e| ZeroError::CommThread(format!("cannot start it: {e}")))?;
        let target = ready_rx
            .recv()
            .unwrap_or_else(|_| Err(ZeroError::CommThread("it stopped while creating its collective".into())))?;
        Ok(Self {
            rank: target.rank(),
            world_size: target.world_size(),
            target: Some(target),
            jobs: Some(jobs_tx),
            worker: Some(worker),
        })
    }

    fn submit(&self, job: Job) -> Result<(), ZeroError> {
        let jobs = self.jobs.as_ref().ok_or_else(stopped)?;
        // A failed send hands the job back inside the error, and it is dropped unrun here.
        jobs.send(Message::Run(job)).map_err(|_| stopped())
    }

    /// Runs `f` on the thread, on this handle's collective, and waits for its result (see
    /// the note on borrowed buffers).
    fn call<'a, R: Send + 'a>(
        &self,
        f: impl FnOnce(&dyn Collective) -> Result<R, ZeroError> + Send + 'a,
    ) -> Result<R, ZeroError> {
        let (tx, rx) = mpsc::sync_channel(1);
        let target = Arc::clone(self.target());
        let job: Box<dyn FnOnce() + Send + 'a> = Box::new(move || {
            let _ = tx.send(f(target.as_ref()));
        });
        // SAFETY: only the lifetime changes. The job may borrow data of lifetime 'a; this
        // function does not return before the job has run (its result arrived) or has been
        // dropped unrun (its sender dropped, so `recv` fails), and neither the thread nor
        // anything else keeps the job or its captures after that.
        let job: Job = unsafe { std::mem::transmute::<Box<dyn FnOnce() + Send + 'a>, Job>(job) };
        self.submit(job)?;
        rx.recv().unwrap_or_else(|_| Err(stopped()))
    }

    fn target(&self) -> &Arc<dyn Collective> {
        self.target.as_ref().expect("only None while dropping")
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

    fn send(&self, buf: BufRef<'_>, to: usize) -> Result<(), ZeroError> {
        self.call(move |comm| comm.send(buf, to))
    }

    fn recv(&self, buf: BufMut<'_>, from: usize) -> Result<(), ZeroError> {
        self.call(move |comm| comm.recv(buf, from))
    }

    fn all_to_all(
        &self,
        input: BufRef<'_>,
        send_counts: &[usize],
        output: BufMut<'_>,
        recv_counts: &[usize],
    ) -> Result<(), ZeroError> {
        self.call(move |comm| comm.all_to_all(input, send_counts, output, recv_counts))
    }

    fn all_to_all_counts(&self, send_counts: &[usize]) -> Result<Vec<usize>, ZeroError> {
        self.call(move |comm| comm.all_to_all_counts(send_counts))
    }

    /// Splits on the thread; the group's handle shares the thread (module note on groups).
    fn split(&self, color: usize, key: usize) -> Result<Arc<dyn Collective>, ZeroError> {
        let group = self.call(move |comm| comm.split(color, key))?;
        Ok(Arc::new(Self {
            rank: group.rank(),
            world_size: group.world_size(),
            target: Some(group),
            jobs: self.jobs.clone(),
            worker: None,
        }))
    }

    fn start(&self, request: Request) -> Pending {
        let (tx, rx) = mpsc::sync_channel(1);
        let target = Arc::clone(self.target());
        let job: Job = Box::new(move || {
            let _ = tx.send(request.run(target.as_ref()));
        });
        match self.submit(job) {
            Ok(()) => Pending::running(rx),
            Err(e) => Pending::ready(Err(e)),
        }
    }

    fn reads_device_memory(&self) -> bool {
        self.target().reads_device_memory()
    }

    /// Runs on the thread, which the NCCL communicator belongs to.
    fn on_device(&self, call: &DeviceCall) -> Result<(), ZeroError> {
        self.call(move |comm| comm.on_device(call))
    }

    /// Started on the thread; the call's own [`Pending`] comes back.
    fn start_on_device(&self, call: &DeviceCall) -> Result<Pending, ZeroError> {
        self.call(move |comm| comm.start_on_device(call))
    }

    /// Aborts at once, from the calling thread: the communication thread may be waiting
    /// inside a collective that only the abort can end.
    fn abort(&self, reason: &str) {
        self.target().abort(reason);
    }

    fn aborted(&self) -> Option<String> {
        self.target().aborted()
    }

    fn stats(&self) -> CommStats {
        self.target().stats()
    }
}

impl Drop for CommThread {
    fn drop(&mut self) {
        // The thread must hold the last handle to its collective, so that it drops (for
        // MPI: finalises) it itself: this handle's goes first, then the thread is stopped
        // after the jobs already queued. A group's handle sends its collective to the
        // thread to be dropped there (an NCCL communicator is destroyed on the thread
        // that made it); a thread already stopped drops the job, and it, here.
        let target = self.target.take();
        match (target, &self.jobs) {
            (Some(target), Some(jobs)) if self.worker.is_none() => {
                let _ = jobs.send(Message::Run(Box::new(move || drop(target))));
            }
            (target, _) => drop(target),
        }
        if let Some(worker) = self.worker.take() {
            if let Some(jobs) = self.jobs.take() {
                let _ = jobs.send(Message::Stop);
            }
            let _ = worker.join();
        }
    }
}
