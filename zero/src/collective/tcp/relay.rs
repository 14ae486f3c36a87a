//! Rank 0's side: the rendezvous, then the relay. Every connection is read by a thread of
//! its own, which first runs the handshake ([`super::secret`]): a connection that does not
//! prove the job's secret is dropped unread. Then a hello goes to the rendezvous, an attach
//! becomes the proxy of a split communicator, an abort aborts the world. Once every rank has
//! said hello, each gets a proxy thread (`proxy.rs`) that runs its calls on its handle of a
//! [`ThreadWorld`] held here, so the threads backend's rendezvous (its checks, its timeouts
//! naming the missing ranks, its aborts reaching every group) is the processes' too.
//!
//! Connections not yet past their handshake and opening are at most [`MAX_PENDING`], each
//! with [`HANDSHAKE_TIME`] in all: a new one past the cap sheds the oldest (a rank's own
//! handshake takes one round trip, so idle strangers cannot keep it out), and running out of
//! file descriptors sheds one too rather than spinning.

use std::collections::{BTreeSet, HashMap, VecDeque};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use zerotrain_precision::{BufMut, BufRef};

use super::Join;
use super::proxy::Proxies;
use super::secret::{self, HANDSHAKE_TIME, JobSecret, Refused};
use super::wire::{MAX_OPENING, Opening, Reply, read_frame_by, write_frame};
use crate::ZeroError;
use crate::collective::{Collective, CommStats, ReduceOp, ThreadComm, ThreadWorld};

/// The most connections at once that have not yet said what they want.
pub(super) const MAX_PENDING: usize = 64;

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
    timeout: Duration,
    secret: JobSecret,
    /// Where hellos go while the world forms; `None` after.
    hellos: Mutex<Option<Sender<Hello>>>,
    /// Why the world did not form, for ranks that arrive after it failed.
    failure: Mutex<Option<String>>,
    /// Set when rank 0 is done: the acceptor stops at the next connection.
    closed: AtomicBool,
    /// Connections not yet past their opening.
    pending: Mutex<Pending>,
    /// Where connections that failed the handshake's secret came from.
    refused: Mutex<Vec<SocketAddr>>,
    /// The joined ranks' proxy threads.
    proxies: Arc<Proxies>,
}

/// Connections not yet past their opening, oldest first, each with its id.
#[derive(Default)]
struct Pending {
    next: u64,
    open: VecDeque<(u64, TcpStream)>,
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
        timeout: join.timeout,
        secret: join.secret.clone(),
        hellos: Mutex::new(Some(tx)),
        failure: Mutex::new(None),
        closed: AtomicBool::new(false),
        pending: Mutex::new(Pending::default()),
        refused: Mutex::new(Vec::new()),
        proxies: Arc::new(Proxies::default()),
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
                    "{} did not arrive at the rendezvous on {} within {} s (comm_timeout_s){}",
                    ranks(&missing),
                    listening(addr),
                    join.timeout.as_secs_f64(),
                    relay.refusals()
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
        relay.proxies.spawn(stream, &relay.world, rank);
    }
    Ok(Arc::new(RelayComm { comm: relay.world.communicator(0), relay, addr }))
}

/// Where the rendezvous listens, in words: "port P of every address of this host" for a
/// listener on every address, else the address.
fn listening(addr: SocketAddr) -> String {
    match addr.ip().is_unspecified() {
        true => format!("port {} of every address of this host", addr.port()),
        false => addr.to_string(),
    }
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
fn wake(addr: SocketAddr) {
    // The listener may be bound to every address: reach it on loopback.
    let addr = match addr.ip().is_unspecified() {
        true if addr.is_ipv4() => SocketAddr::from(([127, 0, 0, 1], addr.port())),
        true => SocketAddr::from((std::net::Ipv6Addr::LOCALHOST, addr.port())),
        false => addr,
    };
    let _ = TcpStream::connect_timeout(&addr, Duration::from_secs(1));
}

impl Relay {
    /// Registers a new connection, shedding the oldest pending one past the cap.
    fn admit(&self, stream: &TcpStream) -> Option<u64> {
        let copy = stream.try_clone().ok()?;
        let mut pending = self.pending.lock().expect("pending lock");
        if pending.open.len() >= MAX_PENDING {
            self.shed_oldest(&mut pending);
        }
        let id = pending.next;
        pending.next += 1;
        pending.open.push_back((id, copy));
        Some(id)
    }

    fn shed_oldest(&self, pending: &mut Pending) {
        if let Some((_, oldest)) = pending.open.pop_front() {
            let _ = oldest.shutdown(Shutdown::Both);
        }
    }

    /// The connection `id` is past its opening (or gone).
    fn settled(&self, id: u64) {
        self.pending.lock().expect("pending lock").open.retain(|(open, _)| *open != id);
    }

    /// ", and N connections ... were refused", for a rendezvous that failed; empty if none.
    fn refusals(&self) -> String {
        let refused = self.refused.lock().expect("refused lock");
        if refused.is_empty() {
            return String::new();
        }
        let from: BTreeSet<String> = refused.iter().map(|a| a.ip().to_canonical().to_string()).collect();
        format!(
            "; {} connection(s) from {} did not prove the job's secret: every rank needs the same {}",
            refused.len(),
            from.into_iter().collect::<Vec<_>>().join(", "),
            secret::JOB_SECRET_VARIABLE
        )
    }
}

/// Reads each connection's handshake and opening on a thread of its own.
fn accept(listener: TcpListener, relay: &Arc<Relay>) {
    for stream in listener.incoming() {
        if relay.closed.load(Ordering::Relaxed) {
            return;
        }
        let stream = match stream {
            Ok(stream) => stream,
            // Out of file descriptors: shed the oldest pending connection and let it close.
            Err(e) if matches!(e.raw_os_error(), Some(code) if code == EMFILE || code == ENFILE) => {
                relay.shed_oldest(&mut relay.pending.lock().expect("pending lock"));
                std::thread::sleep(Duration::from_millis(10));
                continue;
            }
            Err(_) => continue,
        };
        let Some(id) = relay.admit(&stream) else { continue };
        let relay = Arc::clone(relay);
        let spawned = std::thread::Builder::new().name("zerotrain-relay".into()).spawn(move || {
            opening(stream, id, &relay);
        });
        if spawned.is_err() {
            // The closure (and its connection) is dropped: the peer sees it closed.
            continue;
        }
    }
}

/// The system's "too many open files" (per process, and in all).
const EMFILE: i32 = 24;
const ENFILE: i32 = 23;

/// Handles one connection: the handshake, then its first message, all by one deadline.
fn opening(mut stream: TcpStream, id: u64, relay: &Arc<Relay>) {
    let _ = stream.set_nodelay(true);
    let deadline = Instant::now() + HANDSHAKE_TIME;
    let proved = secret::accept(&mut stream, &relay.secret, deadline);
    let frame = match proved {
        Ok(()) => read_frame_by(&mut stream, MAX_OPENING, deadline),
        Err(Refused::WrongSecret) => {
            if let Ok(peer) = stream.peer_addr() {
                relay.refused.lock().expect("refused lock").push(peer);
            }
            relay.settled(id);
            return;
        }
        Err(Refused::Failed(e)) => Err(e),
    };
    relay.settled(id);
    let Ok(frame) = frame else { return };
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
        Ok(Opening::Attach { id }) => match relay.proxies.attach(id) {
            Some(comm) => {
                if write_frame(&mut stream, &Reply::Done(None).encode()).is_ok() {
                    relay.proxies.run_here(stream, comm);
                }
            }
            None => reply(stream, &Reply::Failed(ZeroError::Rendezvous(format!("no communicator {id} to attach")))),
        },
        // Only a connection that proved the secret gets here: a rank of the job's.
        Ok(Opening::Abort { rank, reason }) if rank < relay.world_size => {
            relay.world.abort(rank, &reason);
        }
        Ok(Opening::Abort { .. }) | Err(_) => {}
    }
}

/// Rank 0's communicator: its handle of the world, which keeps the relay alive and, when
/// dropped, stops its acceptor and waits for the proxies to finish: the other ranks' last
/// replies are written and their goodbyes heard before rank 0's process may end (ending
/// first would look to them like rank 0's death).
struct RelayComm {
    comm: ThreadComm,
    relay: Arc<Relay>,
    addr: SocketAddr,
}

impl Drop for RelayComm {
    fn drop(&mut self) {
        self.relay.closed.store(true, Ordering::Relaxed);
        wake(self.addr);
        self.relay.proxies.wait(self.relay.timeout, || self.relay.world.aborted().is_some());
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
