//! Rank 0's side: the rendezvous, then the relay. Every connection is read by a thread of
//! its own: a hello goes to the rendezvous, an attach becomes the proxy of a split
//! communicator, an abort aborts the world. Once every rank has said hello, each gets a
//! proxy thread that runs its calls on its handle of a [`ThreadWorld`] held here, so the
//! threads backend's rendezvous (its checks, its timeouts naming the missing ranks, its
//! aborts reaching every group) is the processes' too.

use std::collections::{BTreeSet, HashMap};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{self, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use zerotrain_precision::{BufMut, BufRef, FlatBuf};

use super::Join;
use super::wire::{Call, MAX_CALL, MAX_OPENING, Opening, Reply, read_frame, write_frame};
use crate::ZeroError;
use crate::collective::{Collective, CommStats, ReduceOp, ThreadComm, ThreadWorld};

/// A rank that said hello, and its connection.
struct Hello {
    rank: usize,
    world_size: usize,
    fingerprint: Vec<(String, String)>,
    stream: TcpStream,
}

/// What the connection threads share.
struct Relay {
    world: ThreadWorld,
    world_size: usize,
    /// Split communicators' handles not yet attached, by id.
    splits: Mutex<HashMap<u64, Arc<dyn Collective>>>,
    next_id: AtomicU64,
    /// Where hellos go while the world forms; `None` after.
    hellos: Mutex<Option<Sender<Hello>>>,
    /// Why the world did not form, for ranks that arrive after it failed.
    failure: Mutex<Option<String>>,
    /// Set when rank 0 is done: the acceptor stops at the next connection.
    closed: AtomicBool,
}

/// Serves the rendezvous on `listener` as rank 0 and returns rank 0's communicator once
/// every rank has joined with rank 0's world size and fingerprint.
pub(super) fn serve(listener: TcpListener, join: &Join) -> Result<Arc<dyn Collective>, ZeroError> {
    let addr = listener.local_addr().map_err(|e| ZeroError::Rendezvous(format!("the rendezvous socket: {e}")))?;
    let deadline = Instant::now() + join.timeout;
    let (tx, rx) = mpsc::channel();
    let relay = Arc::new(Relay {
        world: ThreadWorld::new(join.world_size, join.timeout),
        world_size: join.world_size,
        splits: Mutex::new(HashMap::new()),
        next_id: AtomicU64::new(0),
        hellos: Mutex::new(Some(tx)),
        failure: Mutex::new(None),
        closed: AtomicBool::new(false),
    });
    let acceptor = Arc::clone(&relay);
    std::thread::Builder::new()
        .name("zerotrain-rendezvous".into())
        .spawn(move || accept(listener, &acceptor))
        .map_err(|e| ZeroError::Rendezvous(format!("could not start the rendezvous thread: {e}")))?;

    let mut joined: Vec<Option<TcpStream>> = (0..join.world_size).map(|_| None).collect();
    // Every rank that arrived, and every rank still on its way in, hears why.
    let refuse_all = |joined: &mut Vec<Option<TcpStream>>, message: &str| {
        *relay.failure.lock().expect("failure lock") = Some(message.to_string());
        relay.hellos.lock().expect("hellos lock").take();
        let late = rx.try_iter().map(|hello| hello.stream);
        for stream in joined.iter_mut().filter_map(Option::take).chain(late) {
            reply(stream, &Reply::Failed(ZeroError::Rendezvous(message.to_string())));
        }
        relay.closed.store(true, Ordering::Relaxed);
        wake(addr);
        ZeroError::Rendezvous(message.to_string())
    };
    while joined.iter().skip(1).any(Option::is_none) {
        let wait = deadline.saturating_duration_since(Instant::now());
        let hello = match rx.recv_timeout(wait) {
            Ok(hello) => hello,
            Err(RecvTimeoutError::Timeout | RecvTimeoutError::Disconnected) => {
                let missing: Vec<usize> = (1..join.world_size).filter(|&r| joined[r].is_none()).collect();
                let message = format!(
                    "{} did not arrive at the rendezvous on {addr} within {} s (comm_timeout_s)",
                    ranks(&missing),
                    join.timeout.as_secs_f64()
                );
                return Err(refuse_all(&mut joined, &message));
            }
        };
        let refusal = if hello.world_size != join.world_size {
            Some(format!(
                "rank {} was started for a world of {} ranks, rank 0 for {}",
                hello.rank, hello.world_size, join.world_size
            ))
        } else if hello.rank == 0 || hello.rank >= join.world_size {
            Some(format!("a process joined as rank {} of a world of {} ranks", hello.rank, join.world_size))
        } else if joined[hello.rank].is_some() {
            Some(format!("two processes joined as rank {}", hello.rank))
        } else {
            first_difference(&join.fingerprint, &hello.fingerprint)
                .map(|d| format!("rank {} does not run rank 0's job: {d}", hello.rank))
        };
        if let Some(message) = refusal {
            reply(hello.stream, &Reply::Failed(ZeroError::Rendezvous(message.clone())));
            return Err(refuse_all(&mut joined, &message));
        }
        joined[hello.rank] = Some(hello.stream);
    }
    relay.hellos.lock().expect("hellos lock").take();
    for (rank, stream) in joined.into_iter().enumerate().skip(1) {
        let mut stream = stream.expect("every rank joined");
        if write_frame(&mut stream, &Reply::Done(None).encode()).is_err() {
            relay.world.abort(rank, &format!("rank {rank}'s connection closed while the world formed"));
        }
        let comm: Arc<dyn Collective> = Arc::new(relay.world.communicator(rank));
        spawn_proxy(stream, comm, rank, &relay);
    }
    Ok(Arc::new(RelayComm { comm: relay.world.communicator(0), relay, addr }))
}

/// "rank 2" or "ranks [1, 3]".
fn ranks(list: &[usize]) -> String {
    match list {
        [one] => format!("rank {one}"),
        many => format!("ranks {many:?}"),
    }
}

/// The first key (in order) whose value differs between rank 0's fingerprint and another
/// rank's, said as a sentence; `None` when they are the same.
pub(super) fn first_difference(ours: &[(String, String)], theirs: &[(String, String)]) -> Option<String> {
    let ours_map: HashMap<&str, &str> = ours.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    let theirs_map: HashMap<&str, &str> = theirs.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    let keys: BTreeSet<&str> = ours_map.keys().chain(theirs_map.keys()).copied().collect();
    keys.into_iter().find_map(|key| {
        let (a, b) = (ours_map.get(key), theirs_map.get(key));
        (a != b).then(|| {
            let said = |v: Option<&&str>| v.map_or("not set".to_string(), |v| v.to_string());
            format!("`{key}` is {} on rank 0 and {} there", said(a), said(b))
        })
    })
}

fn reply(mut stream: TcpStream, reply: &Reply) {
    let _ = write_frame(&mut stream, &reply.encode());
}

/// Wakes the acceptor (blocked in `accept`) so that it sees `closed`.
fn wake(addr: std::net::SocketAddr) {
    let _ = TcpStream::connect_timeout(&addr, Duration::from_secs(1));
}

/// Reads each connection's opening on a thread of its own.
fn accept(listener: TcpListener, relay: &Arc<Relay>) {
    for stream in listener.incoming() {
        if relay.closed.load(Ordering::Relaxed) {
            return;
        }
        let Ok(stream) = stream else { continue };
        let relay = Arc::clone(relay);
        let _ = std::thread::Builder::new().name("zerotrain-relay".into()).spawn(move || opening(stream, &relay));
    }
}

/// Handles one connection's first message.
fn opening(mut stream: TcpStream, relay: &Arc<Relay>) {
    let _ = stream.set_nodelay(true);
    // A connection that never says what it wants is dropped, not waited for.
    let _ = stream.set_read_timeout(Some(Duration::from_secs(30)));
    let Ok(frame) = read_frame(&mut stream, MAX_OPENING) else { return };
    let _ = stream.set_read_timeout(None);
    match Opening::decode(&frame) {
        Ok(Opening::Hello { rank, world_size, fingerprint }) => {
            let hellos = relay.hellos.lock().expect("hellos lock");
            match hellos.as_ref() {
                Some(tx) => {
                    let _ = tx.send(Hello { rank, world_size, fingerprint, stream });
                }
                None => {
                    let failure = relay.failure.lock().expect("failure lock").clone();
                    let message = failure
                        .unwrap_or_else(|| format!("rank {rank} arrived after the world of its ranks had formed"));
                    reply(stream, &Reply::Failed(ZeroError::Rendezvous(message)));
                }
            }
        }
        Ok(Opening::Attach { id }) => {
            let comm = relay.splits.lock().expect("splits lock").remove(&id);
            match comm {
                Some(comm) => {
                    if write_frame(&mut stream, &Reply::Done(None).encode()).is_ok() {
                        let rank = comm.rank();
                        proxy(stream, comm, rank, relay);
                    }
                }
                None => reply(stream, &Reply::Failed(ZeroError::Rendezvous(format!("no communicator {id} to attach")))),
            }
        }
        Ok(Opening::Abort { rank, reason }) if rank < relay.world_size => {
            relay.world.abort(rank, &reason);
        }
        Ok(Opening::Abort { .. }) | Err(_) => {}
    }
}

fn spawn_proxy(stream: TcpStream, comm: Arc<dyn Collective>, rank: usize, relay: &Arc<Relay>) {
    let shared = Arc::clone(relay);
    let spawned = std::thread::Builder::new()
        .name(format!("zerotrain-relay-{rank}"))
        .spawn(move || proxy(stream, comm, rank, &shared));
    if let Err(e) = spawned {
        relay.world.abort(rank, &format!("could not start the relay thread of rank {rank}: {e}"));
    }
}

/// Runs one rank's calls on `comm` until it says goodbye; a connection that ends otherwise
/// aborts the job, naming the rank.
fn proxy(mut stream: TcpStream, comm: Arc<dyn Collective>, rank: usize, relay: &Relay) {
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
        let answer = match call {
            Ok(Call::Goodbye) => return,
            Ok(call) => run(&*comm, call, relay),
            Err(e) => {
                comm.abort(&format!("it sent a malformed call ({e})"));
                return;
            }
        };
        if write_frame(&mut stream, &answer.encode()).is_err() {
            comm.abort(&format!("rank {rank}'s connection closed while it waited for a reply"));
            return;
        }
    }
}

/// Runs `call` on `comm`, as the rank that asked would have.
fn run(comm: &dyn Collective, call: Call, relay: &Relay) -> Reply {
    let done = |result: Result<(), ZeroError>, buf: Option<FlatBuf>| match result {
        Ok(()) => Reply::Done(buf),
        Err(e) => Reply::Failed(e),
    };
    match call {
        Call::AllReduce { op, mut buf } => done(comm.all_reduce(buf.as_mut(), op), Some(buf)),
        Call::ReduceScatter { op, input, out_len } => {
            let mut out = FlatBuf::zeros(input.dtype(), out_len);
            done(comm.reduce_scatter(input.as_ref(), out.as_mut(), op), Some(out))
        }
        Call::AllGather { input, out_len } => {
            let mut out = FlatBuf::zeros(input.dtype(), out_len);
            done(comm.all_gather(input.as_ref(), out.as_mut()), Some(out))
        }
        Call::Broadcast { root, mut buf } => done(comm.broadcast(buf.as_mut(), root), Some(buf)),
        Call::Barrier => done(comm.barrier(), None),
        Call::Send { to, buf } => done(comm.send(buf.as_ref(), to), None),
        Call::Recv { from, dtype, len } => {
            let mut buf = FlatBuf::zeros(dtype, len);
            done(comm.recv(buf.as_mut(), from), Some(buf))
        }
        Call::Split { color, key } => match comm.split(color, key) {
            Ok(sub) => {
                let id = relay.next_id.fetch_add(1, Ordering::Relaxed);
                let (rank, size) = (sub.rank(), sub.world_size());
                relay.splits.lock().expect("splits lock").insert(id, sub);
                Reply::Split { id, rank, size }
            }
            Err(e) => Reply::Failed(e),
        },
        Call::Goodbye => Reply::Done(None),
    }
}

/// Rank 0's communicator: its handle of the world, which keeps the relay alive and stops
/// its acceptor when dropped.
struct RelayComm {
    comm: ThreadComm,
    relay: Arc<Relay>,
    addr: std::net::SocketAddr,
}

impl Drop for RelayComm {
    fn drop(&mut self) {
        self.relay.closed.store(true, Ordering::Relaxed);
        wake(self.addr);
    }
}

impl Collective for RelayComm {
    fn rank(&self) -> usize {
        self.comm.rank()
    }
    fn world_size(&self) -> usize {
        self.comm.world_size()
    }
    fn all_reduce(&self, buf: BufMut<'_>, op: ReduceOp) -> Result<(), ZeroError> {
        self.comm.all_reduce(buf, op)
    }
    fn reduce_scatter(&self, input: BufRef<'_>, output: BufMut<'_>, op: ReduceOp) -> Result<(), ZeroError> {
        self.comm.reduce_scatter(input, output, op)
    }
    fn all_gather(&self, input: BufRef<'_>, output: BufMut<'_>) -> Result<(), ZeroError> {
        self.comm.all_gather(input, output)
    }
    fn broadcast(&self, buf: BufMut<'_>, root: usize) -> Result<(), ZeroError> {
        self.comm.broadcast(buf, root)
    }
    fn barrier(&self) -> Result<(), ZeroError> {
        self.comm.barrier()
    }
    fn send(&self, buf: BufRef<'_>, to: usize) -> Result<(), ZeroError> {
        self.comm.send(buf, to)
    }
    fn recv(&self, buf: BufMut<'_>, from: usize) -> Result<(), ZeroError> {
        self.comm.recv(buf, from)
    }
    fn split(&self, color: usize, key: usize) -> Result<Arc<dyn Collective>, ZeroError> {
        self.comm.split(color, key)
    }
    fn abort(&self, reason: &str) {
        self.comm.abort(reason)
    }
    fn aborted(&self) -> Option<String> {
        self.comm.aborted()
    }
    fn stats(&self) -> CommStats {
        self.comm.stats()
    }
}
