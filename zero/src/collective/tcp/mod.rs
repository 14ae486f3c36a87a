//! Ranks started as processes by a launcher (`zerotrain launch`, torchrun, a cluster's
//! operator), joined into one world over TCP without MPI: [`join`].
//!
//! # Note: a relay through rank 0
//! Rank 0 listens on the address every rank is given (`MASTER_ADDR:MASTER_PORT`). Each
//! other rank connects, says hello with its rank, the world size and a fingerprint of its
//! job (key, value pairs: the config's keys, the resume tag), and waits; rank 0 checks each
//! against its own and, once every rank has arrived, answers them all. A rank missing at
//! the timeout, a second process claiming a rank, another world size or a fingerprint that
//! differs fails every rank that arrived, naming the missing ranks or the first key that
//! differs.
//!
//! After that, rank 0 keeps one thread per connection that runs the rank's collectives on
//! its handle of a [`ThreadWorld`](crate::ThreadWorld) in rank 0's process: the threads
//! backend's rendezvous, with its checks of matching calls, its timeouts naming the ranks
//! that did not arrive, its point-to-point mailboxes and its aborts reaching every group
//! split from the world, serves the processes unchanged. A rank's connection that closes
//! without a goodbye (its process died) aborts the job naming it; rank 0's death closes
//! every other rank's connection, which fails their next call.
//!
//! Every byte goes through rank 0: on GPUs this is a control plane (NCCL's unique id, the
//! ranks' agreements, what NCCL leaves on the host), while the reductions of gradients and
//! the gathers of parameters run over NCCL; on CPUs it carries every collective, as a
//! torchrun job over gloo would (correct, and as fast as one process's sockets).
//!
//! # Note: who may connect
//! Rank 0 listens on every address of its host (as torchrun's store does: a hostname that
//! resolves to loopback on rank 0's own node, as Debian's and Ubuntu's `/etc/hosts` make it,
//! must not hide it from the other nodes). So every connection first proves the job's
//! secret ([`JobSecret`], the [`secret`] module's handshake): one that does not is dropped
//! before anything it sends is read, and is never told anything of the job. A joined rank's
//! lengths are checked against the group's sizes before anything is allocated for them.
//! Traffic after the handshake is neither encrypted nor signed.

mod proxy;
mod relay;
mod remote;
pub mod secret;
mod wire;

pub use secret::{JOB_SECRET_VARIABLE, JobSecret};

use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener, ToSocketAddrs};
use std::sync::Arc;
use std::time::Duration;

use crate::ZeroError;
use crate::collective::Collective;

/// Where and as what a process joins the world.
#[derive(Debug, Clone)]
pub struct Join {
    /// This process's rank (`RANK`).
    pub rank: usize,
    /// The number of ranks (`WORLD_SIZE`).
    pub world_size: usize,
    /// Rank 0's rendezvous, `host:port` (`MASTER_ADDR:MASTER_PORT`).
    pub addr: String,
    /// How long the world may take to form; also every collective's timeout.
    pub timeout: Duration,
    /// What every rank must agree on, as (key, value) pairs; the first key that differs is
    /// named in the error.
    pub fingerprint: Vec<(String, String)>,
    /// The job's secret, which every connection proves.
    pub secret: JobSecret,
}

/// Joins the world: rank 0 listens on `join.addr`'s port on every address of its host and
/// serves the rendezvous and the relay; every other rank connects to `join.addr` (retrying
/// while rank 0 is not yet listening). Returns once every rank has joined with the same
/// world size, fingerprint and secret (module notes).
pub fn join(join: &Join) -> Result<Arc<dyn Collective>, ZeroError> {
    check(join)?;
    let addr = resolve(&join.addr)?;
    if join.rank == 0 {
        let listener = listen_everywhere(addr.port()).map_err(|e| {
            ZeroError::Rendezvous(format!(
                "rank 0 could not listen on port {} (MASTER_PORT) of this host: {e}",
                addr.port()
            ))
        })?;
        relay::serve(listener, join)
    } else {
        Ok(Arc::new(remote::connect(addr, join)?))
    }
}

/// A listener on `port` of every address: IPv6's (which takes IPv4 too where the system
/// maps it), else IPv4's.
fn listen_everywhere(port: u16) -> std::io::Result<TcpListener> {
    TcpListener::bind(SocketAddr::from((Ipv6Addr::UNSPECIFIED, port)))
        .or_else(|_| TcpListener::bind(SocketAddr::from((Ipv4Addr::UNSPECIFIED, port))))
}

/// [`join`] for rank 0 on a socket it already listens on (port 0 in tests: the system's
/// choice, which the other ranks are then given).
pub fn serve(listener: TcpListener, join: &Join) -> Result<Arc<dyn Collective>, ZeroError> {
    check(join)?;
    if join.rank != 0 {
        return Err(ZeroError::Rendezvous(format!("rank {} cannot serve the rendezvous: rank 0 does", join.rank)));
    }
    relay::serve(listener, join)
}

fn check(join: &Join) -> Result<(), ZeroError> {
    if join.world_size == 0 || join.rank >= join.world_size {
        return Err(ZeroError::Rendezvous(format!("rank {} of a world of {} ranks", join.rank, join.world_size)));
    }
    Ok(())
}

fn resolve(addr: &str) -> Result<SocketAddr, ZeroError> {
    let unresolved = |why: String| ZeroError::Rendezvous(format!("the rendezvous address {addr:?}: {why}"));
    addr.to_socket_addrs()
        .map_err(|e| unresolved(e.to_string()))?
        .next()
        .ok_or_else(|| unresolved("resolves to no address".into()))
}

#[cfg(test)]
mod hostile_tests;
#[cfg(test)]
mod tests;
