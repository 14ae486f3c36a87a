//! The relay's proxies: for each rank that joined (and each split communicator it attached),
//! a thread on rank 0 that reads its calls, runs them on its handle of the world held there,
//! and writes the replies. Every length a call asks for is checked against the call's other
//! buffers and the group before anything of it is allocated. The proxies are counted, so that
//! rank 0's end can wait for the last replies and the ranks' goodbyes.

use std::collections::HashMap;
use std::net::TcpStream;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use zerotrain_precision::FlatBuf;

use super::wire::{Call, MAX_CALL, Reply, read_frame, write_frame};
use crate::ZeroError;
use crate::collective::{Collective, OpKind, ThreadComm, ThreadWorld};

/// The proxy threads of a relay, and the split communicators' handles waiting for theirs.
#[derive(Default)]
pub(super) struct Proxies {
    counts: Mutex<Counts>,
    changed: Condvar,
    /// Split communicators' handles not yet attached, by id.
    splits: Mutex<HashMap<u64, ThreadComm>>,
    next_id: AtomicU64,
}

/// Proxy threads running, and how many of them are inside a call.
#[derive(Default)]
struct Counts {
    live: usize,
    busy: usize,
}

impl Proxies {
    /// Runs `rank`'s calls from `stream` on its handle of `world` in a thread of its own; a
    /// thread that cannot start aborts the world, naming the rank.
    pub(super) fn spawn(self: &Arc<Self>, stream: TcpStream, world: &ThreadWorld, rank: usize) {
        let (shared, comm) = (Arc::clone(self), world.communicator(rank));
        self.count(|p| p.live += 1);
        let spawned = std::thread::Builder::new()
            .name(format!("zerotrain-relay-{rank}"))
            .spawn(move || shared.proxy(stream, comm, rank));
        if let Err(e) = spawned {
            self.count(|p| p.live -= 1);
            world.abort(rank, &format!("could not start the relay thread of rank {rank}: {e}"));
        }
    }

    /// Runs the calls of a split communicator's handle from `stream` on this thread.
    pub(super) fn run_here(&self, stream: TcpStream, comm: ThreadComm) {
        let rank = comm.rank();
        self.count(|p| p.live += 1);
        self.proxy(stream, comm, rank);
    }

    /// The handle of the split communicator `id`, for the connection that attaches it.
    pub(super) fn attach(&self, id: u64) -> Option<ThreadComm> {
        self.splits.lock().expect("splits lock").remove(&id)
    }

    /// Marks a proxy as running (`live`) or inside a call (`busy`), or neither any more.
    fn count(&self, change: impl FnOnce(&mut Counts)) {
        change(&mut self.counts.lock().expect("proxies lock"));
        self.changed.notify_all();
    }

    /// Waits, at most `timeout`, until every proxy has ended (each rank said goodbye or its
    /// connection closed); once `aborted`, only until none is inside a call (its reply, the
    /// abort, is written).
    pub(super) fn wait(&self, timeout: Duration, aborted: impl Fn() -> bool) {
        let deadline = Instant::now() + timeout;
        let mut counts = self.counts.lock().expect("proxies lock");
        loop {
            let done = counts.live == 0 || (aborted() && counts.busy == 0);
            let left = deadline.saturating_duration_since(Instant::now());
            if done || left.is_zero() {
                return;
            }
            // Woken by every change; the abort is seen at the latest within a second.
            let wait = left.min(Duration::from_secs(1));
            counts = self.changed.wait_timeout(counts, wait).expect("proxies lock").0;
        }
    }

    /// Runs one rank's calls on `comm` until it says goodbye; a connection that ends otherwise
    /// aborts the job, naming the rank. Counted as live from before it starts until it ends.
    fn proxy(&self, mut stream: TcpStream, comm: ThreadComm, rank: usize) {
        struct Ended<'a>(&'a Proxies);
        impl Drop for Ended<'_> {
            fn drop(&mut self) {
                self.0.count(|p| p.live -= 1);
            }
        }
        let _ended = Ended(self);
        loop {
            let call = match read_frame(&mut stream, MAX_CALL) {
                Ok(frame) => Call::decode(&frame),
                Err(e) => {
                    let reason = format!(
                        "its connection to the rendezvous on rank 0 ended ({e}): its process exited or lost the network"
                    );
                    comm.abort(&reason);
                    return;
                }
            };
            self.count(|p| p.busy += 1);
            let answer = match call {
                Ok(Call::Goodbye) => {
                    self.count(|p| p.busy -= 1);
                    return;
                }
                Ok(call) => self.run(&comm, call),
                Err(e) => {
                    comm.abort(&format!("it sent a malformed call ({e})"));
                    self.count(|p| p.busy -= 1);
                    return;
                }
            };
            let written = write_frame(&mut stream, &answer.encode());
            self.count(|p| p.busy -= 1);
            if written.is_err() {
                comm.abort(&format!("rank {rank}'s connection closed while it waited for a reply"));
                return;
            }
        }
    }

    /// Runs `call` on `comm`, as the rank that asked would have.
    fn run(&self, comm: &ThreadComm, call: Call) -> Reply {
        let done = |result: Result<(), ZeroError>, buf: Option<FlatBuf>| match result {
            Ok(()) => Reply::Done(buf),
            Err(e) => Reply::Failed(e),
        };
        let n = comm.world_size();
        // A reply must fit in a frame the rank reads.
        let fits = |len: usize, width: usize| len.checked_mul(width).filter(|b| *b as u64 <= MAX_CALL - 64);
        match call {
            Call::AllReduce { op, mut buf } => done(comm.all_reduce(buf.as_mut(), op), Some(buf)),
            Call::ReduceScatter { op, input, out_len } => {
                let expected = input.len().is_multiple_of(n).then(|| input.len() / n);
                if let Err(reply) = expect_len(comm, OpKind::ReduceScatter, out_len, expected, "the input and group") {
                    return reply;
                }
                let mut out = FlatBuf::zeros(input.dtype(), out_len);
                done(comm.reduce_scatter(input.as_ref(), out.as_mut(), op), Some(out))
            }
            Call::AllGather { input, out_len } => {
                let width = input.dtype().bytes_per_elem();
                let expected = input.len().checked_mul(n).filter(|len| fits(*len, width).is_some());
                if let Err(reply) = expect_len(comm, OpKind::AllGather, out_len, expected, "the input and group") {
                    return reply;
                }
                let mut out = FlatBuf::zeros(input.dtype(), out_len);
                done(comm.all_gather(input.as_ref(), out.as_mut()), Some(out))
            }
            Call::Broadcast { root, mut buf } => done(comm.broadcast(buf.as_mut(), root), Some(buf)),
            Call::Barrier => done(comm.barrier(), None),
            Call::Send { to, buf } => done(comm.send(buf.as_ref(), to), None),
            // The message is the sender's buffer, as sent: compared, never allocated for.
            Call::Recv { from, dtype, len } => match comm.recv_message(from) {
                Ok(message) if message.len() == len && message.dtype() == dtype => Reply::Done(Some(message)),
                Ok(message) => {
                    let what = format!("the {} message from rank {from}", message.dtype());
                    let got = if message.dtype() == dtype { Some(message.len()) } else { None };
                    expect_len(comm, OpKind::Recv, len, got, &what).err().unwrap_or(Reply::Done(Some(message)))
                }
                Err(e) => Reply::Failed(e),
            },
            Call::Split { color, key } => match comm.split_threads(color, key) {
                Ok(sub) => {
                    let id = self.next_id.fetch_add(1, Ordering::Relaxed);
                    let (rank, size) = (sub.rank(), sub.world_size());
                    self.splits.lock().expect("splits lock").insert(id, sub);
                    Reply::Split { id, rank, size }
                }
                Err(e) => Reply::Failed(e),
            },
            Call::Goodbye => Reply::Done(None),
        }
    }
}

/// Checks a length a rank asked for against what the call's other buffers and the group's
/// size make it, before anything of that length is allocated; a mismatch aborts the group
/// (as the threads backend does for a wrong buffer) and is the rank's reply.
fn expect_len(comm: &ThreadComm, op: OpKind, asked: usize, expected: Option<usize>, what: &str) -> Result<(), Reply> {
    if expected == Some(asked) {
        return Ok(());
    }
    let detail = format!("asked for {asked} elements of output, but {what} make {expected:?}");
    let error = ZeroError::BadBuffer { rank: comm.rank(), op: op.name(), detail };
    comm.abort(&error.to_string());
    Err(Reply::Failed(error))
}
