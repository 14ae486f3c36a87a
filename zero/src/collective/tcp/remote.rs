//! The side of every rank but 0: a [`Collective`] whose calls travel to the relay on rank 0
//! and run there. One connection per communicator (the world and each split), so calls on
//! different communicators never wait behind each other; an abort takes a connection of its
//! own, so it is heard while a call is in flight.

use std::net::{SocketAddr, TcpStream};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use zerotrain_precision::{BufMut, BufRef, FlatBuf};

use super::Join;
use super::secret::{self, HANDSHAKE_TIME, JOB_SECRET_VARIABLE, JobSecret, Unproved};
use super::wire::{Call, MAX_CALL, Opening, Reply, read_frame, write_frame};
use crate::ZeroError;
use crate::collective::{Collective, CommCounters, CommStats, OpKind, ReduceOp, convention_bytes};

/// How long past the collective timeout a rank waits for the relay's reply before it takes
/// rank 0 for hung: the relay itself answers a stalled collective at the timeout.
const RELAY_GRACE: Duration = Duration::from_secs(60);

/// A rank's communicator through the relay.
pub(super) struct RemoteComm {
    rank: usize,
    world_size: usize,
    /// This rank in the world, which an abort names.
    world_rank: usize,
    addr: SocketAddr,
    timeout: Duration,
    /// Proves each new connection (a split's, an abort's).
    secret: JobSecret,
    conn: Mutex<TcpStream>,
    counters: CommCounters,
    failed: Mutex<Option<String>>,
}

/// Connects to rank 0's rendezvous at `addr` and runs the handshake, retrying (until
/// `deadline`) while rank 0 is not yet listening or sheds the connection; a secret rank 0
/// refuses, or a peer that cannot prove it, fails at once.
fn open(addr: SocketAddr, secret: &JobSecret, deadline: Instant, who: &str) -> Result<TcpStream, ZeroError> {
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let attempt = TcpStream::connect_timeout(&addr, left.clamp(Duration::from_millis(1), Duration::from_secs(5)))
            .map_err(Unproved::Failed)
            .and_then(|mut stream| {
                let _ = stream.set_nodelay(true);
                let by = deadline.min(Instant::now() + HANDSHAKE_TIME);
                secret::connect(&mut stream, secret, by).map(|()| stream)
            });
        let error = match attempt {
            Ok(stream) => return Ok(stream),
            Err(Unproved::Refused) => {
                return Err(ZeroError::Rendezvous(format!(
                    "{who}: rank 0's rendezvous at {addr} refused this process's {JOB_SECRET_VARIABLE}: every rank of \
                     a job needs the same one"
                )));
            }
            Err(Unproved::NotRankZero(why)) => {
                return Err(ZeroError::Rendezvous(format!(
                    "{who}: the process listening at {addr} is not this job's rank 0: {why}"
                )));
            }
            Err(Unproved::Failed(e)) => e,
        };
        if Instant::now() + Duration::from_millis(100) >= deadline {
            return Err(ZeroError::Rendezvous(format!(
                "{who} could not reach rank 0's rendezvous at {addr} by its deadline (comm_timeout_s): {error}"
            )));
        }
        // Rank 0 may start later than this rank, or have shed the connection: again shortly.
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Joins the world as rank `join.rank` (not 0): connects to rank 0's rendezvous (retrying
/// until it listens, up to the timeout), proves the job's secret, says hello and waits
/// until every rank has.
pub(super) fn connect(addr: SocketAddr, join: &Join) -> Result<RemoteComm, ZeroError> {
    let deadline = Instant::now() + join.timeout;
    let who = format!("rank {}", join.rank);
    let mut stream = open(addr, &join.secret, deadline, &who)?;
    let hello = Opening::Hello { rank: join.rank, world_size: join.world_size, fingerprint: join.fingerprint.clone() };
    let lost = |e: std::io::Error| {
        ZeroError::Rendezvous(format!("rank {}: the rendezvous at {addr} closed the connection ({e})", join.rank))
    };
    write_frame(&mut stream, &hello.encode()).map_err(lost)?;
    // The others may take the whole timeout to arrive; rank 0 answers by then.
    stream.set_read_timeout(Some(join.timeout + RELAY_GRACE)).map_err(lost)?;
    match Reply::decode(&read_frame(&mut stream, MAX_CALL).map_err(lost)?) {
        Ok(Reply::Done(None)) => {}
        Ok(Reply::Failed(e)) => return Err(e),
        Ok(other) => return Err(ZeroError::Rendezvous(format!("the rendezvous answered {other:?}"))),
        Err(e) => return Err(ZeroError::Rendezvous(format!("the rendezvous answered garbage: {e}"))),
    }
    Ok(RemoteComm {
        rank: join.rank,
        world_size: join.world_size,
        world_rank: join.rank,
        addr,
        timeout: join.timeout,
        secret: join.secret.clone(),
        conn: Mutex::new(stream),
        counters: CommCounters::default(),
        failed: Mutex::new(None),
    })
}

impl RemoteComm {
    /// Sends `call` and reads the relay's reply.
    fn call(&self, kind: OpKind, call: &Call) -> Result<Reply, ZeroError> {
        if let Some(reason) = self.failed.lock().expect("failed lock").clone() {
            return Err(ZeroError::Aborted { rank: self.world_rank, reason });
        }
        let mut conn = self.conn.lock().expect("connection lock");
        let lost = |e: std::io::Error| {
            let reason = format!(
                "{} on rank {}: the connection to rank 0's relay at {} failed ({e}): rank 0's process ended, hung \
                 past the timeout, or the network failed",
                kind.name(),
                self.world_rank,
                self.addr
            );
            self.failed.lock().expect("failed lock").get_or_insert(reason.clone());
            ZeroError::Rendezvous(reason)
        };
        write_frame(&mut *conn, &call.encode()).map_err(lost)?;
        let frame = read_frame(&mut *conn, MAX_CALL).map_err(lost)?;
        match Reply::decode(&frame) {
            Ok(Reply::Failed(e)) => {
                if let ZeroError::Aborted { reason, .. } = &e {
                    self.failed.lock().expect("failed lock").get_or_insert(reason.clone());
                }
                Err(e)
            }
            Ok(reply) => Ok(reply),
            Err(e) => Err(lost(std::io::Error::new(std::io::ErrorKind::InvalidData, e))),
        }
    }

    /// Runs a call whose reply carries a buffer, copied into `out`.
    fn into(&self, kind: OpKind, call: &Call, mut out: BufMut<'_>) -> Result<(), ZeroError> {
        match self.call(kind, call)? {
            Reply::Done(Some(buf)) if buf.len() == out.len() && buf.dtype() == out.dtype() => {
                out.copy_from(buf.as_ref(), false);
                Ok(())
            }
            other => Err(ZeroError::Rendezvous(format!("{}: the relay answered {other:?}", kind.name()))),
        }
    }

    fn record(&self, kind: OpKind, elems: usize, elem_bytes: usize, root: usize) {
        let bytes = convention_bytes(kind, elems, elem_bytes, self.world_size, self.rank, root);
        self.counters.record(kind, bytes);
    }
}

fn owned(buf: &BufMut<'_>) -> FlatBuf {
    match buf {
        BufMut::F32(v) => FlatBuf::F32(v.to_vec()),
        BufMut::F16(v) => FlatBuf::F16(v.to_vec()),
        BufMut::Bf16(v) => FlatBuf::Bf16(v.to_vec()),
    }
}

impl Collective for RemoteComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world_size
    }

    fn all_reduce(&self, buf: BufMut<'_>, op: ReduceOp) -> Result<(), ZeroError> {
        let (len, width) = (buf.len(), buf.dtype().bytes_per_elem());
        self.into(OpKind::AllReduce, &Call::AllReduce { op, buf: owned(&buf) }, buf)?;
        self.record(OpKind::AllReduce, len, width, 0);
        Ok(())
    }

    fn reduce_scatter(&self, input: BufRef<'_>, output: BufMut<'_>, op: ReduceOp) -> Result<(), ZeroError> {
        let call = Call::ReduceScatter { op, input: FlatBuf::from_buf(input.dtype(), input), out_len: output.len() };
        self.into(OpKind::ReduceScatter, &call, output)?;
        self.record(OpKind::ReduceScatter, input.len(), input.dtype().bytes_per_elem(), 0);
        Ok(())
    }

    fn all_gather(&self, input: BufRef<'_>, output: BufMut<'_>) -> Result<(), ZeroError> {
        let (len, width) = (output.len(), output.dtype().bytes_per_elem());
        let call = Call::AllGather { input: FlatBuf::from_buf(input.dtype(), input), out_len: len };
        self.into(OpKind::AllGather, &call, output)?;
        self.record(OpKind::AllGather, len, width, 0);
        Ok(())
    }

    fn broadcast(&self, buf: BufMut<'_>, root: usize) -> Result<(), ZeroError> {
        let (len, width) = (buf.len(), buf.dtype().bytes_per_elem());
        self.into(OpKind::Broadcast, &Call::Broadcast { root, buf: owned(&buf) }, buf)?;
        self.record(OpKind::Broadcast, len, width, root);
        Ok(())
    }

    fn barrier(&self) -> Result<(), ZeroError> {
        self.call(OpKind::Barrier, &Call::Barrier)?;
        self.record(OpKind::Barrier, 0, 0, 0);
        Ok(())
    }

    fn send(&self, buf: BufRef<'_>, to: usize) -> Result<(), ZeroError> {
        self.call(OpKind::Send, &Call::Send { to, buf: FlatBuf::from_buf(buf.dtype(), buf) })?;
        self.record(OpKind::Send, buf.len(), buf.dtype().bytes_per_elem(), 0);
        Ok(())
    }

    fn recv(&self, buf: BufMut<'_>, from: usize) -> Result<(), ZeroError> {
        let (len, dtype) = (buf.len(), buf.dtype());
        self.into(OpKind::Recv, &Call::Recv { from, dtype, len }, buf)?;
        self.record(OpKind::Recv, len, dtype.bytes_per_elem(), 0);
        Ok(())
    }

    fn split(&self, color: usize, key: usize) -> Result<Arc<dyn Collective>, ZeroError> {
        let Reply::Split { id, rank, size } = self.call(OpKind::Split, &Call::Split { color, key })? else {
            return Err(ZeroError::Rendezvous("split: the relay answered something else".into()));
        };
        let lost = |e: std::io::Error| ZeroError::Rendezvous(format!("split: the relay at {}: {e}", self.addr));
        let who = format!("rank {}'s split", self.world_rank);
        let mut stream = open(self.addr, &self.secret, Instant::now() + Duration::from_secs(30), &who)?;
        stream.set_read_timeout(Some(self.timeout + RELAY_GRACE)).map_err(lost)?;
        write_frame(&mut stream, &Opening::Attach { id }.encode()).map_err(lost)?;
        match Reply::decode(&read_frame(&mut stream, MAX_CALL).map_err(lost)?) {
            Ok(Reply::Done(None)) => {}
            Ok(Reply::Failed(e)) => return Err(e),
            other => return Err(ZeroError::Rendezvous(format!("split: the relay answered {other:?}"))),
        }
        Ok(Arc::new(RemoteComm {
            rank,
            world_size: size,
            world_rank: self.world_rank,
            addr: self.addr,
            timeout: self.timeout,
            secret: self.secret.clone(),
            conn: Mutex::new(stream),
            counters: CommCounters::default(),
            failed: Mutex::new(None),
        }))
    }

    fn abort(&self, reason: &str) {
        self.failed.lock().expect("failed lock").get_or_insert_with(|| reason.to_string());
        // A connection of its own: the world's may be waiting in a collective.
        let who = format!("rank {}'s abort", self.world_rank);
        if let Ok(mut stream) = open(self.addr, &self.secret, Instant::now() + Duration::from_secs(5), &who) {
            let abort = Opening::Abort { rank: self.world_rank, reason: reason.to_string() };
            let _ = write_frame(&mut stream, &abort.encode());
        }
    }

    fn aborted(&self) -> Option<String> {
        self.failed.lock().expect("failed lock").clone()
    }

    fn stats(&self) -> CommStats {
        self.counters.snapshot()
    }
}

impl Drop for RemoteComm {
    /// Says goodbye, so that the relay takes the closing connection for the end of this
    /// rank's use of it, not for a failure.
    fn drop(&mut self) {
        if let Ok(mut conn) = self.conn.lock() {
            let _ = write_frame(&mut *conn, &Call::Goodbye.encode());
        }
    }
}
