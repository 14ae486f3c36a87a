//! The worker side: [`ServerRound`], one rank's rounds through a parameter server.

use std::time::{Duration, Instant};

use tonic::transport::{Channel, Endpoint};

use super::proto::PullRequest;
use super::proto::parameter_server_client::ParameterServerClient;
use super::{chunks, place_chunk};
use crate::replicas::round::{pseudo_gradient, scatter};
use crate::{Error, Result};

/// One rank's connection to the server of its place: its copy of the place's global
/// weights and the round they belong to. Every call is bounded by `timeout`.
pub struct ServerRound {
    runtime: tokio::runtime::Runtime,
    client: ParameterServerClient<Channel>,
    addr: String,
    place: u32,
    group: u32,
    round: u64,
    global: Vec<Vec<f32>>,
    timeout: Duration,
}

impl ServerRound {
    /// Connects to `addr` (retrying with backoff for up to `timeout`), joins `place` as
    /// `group` with this rank's `start` weights (the place's first joiner sets the global
    /// weights), and pulls the place's current global weights.
    pub fn start(addr: &str, place: usize, group: usize, start: Vec<Vec<f32>>, timeout: Duration) -> Result<Self> {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| Error::Launch(format!("local_sgd.servers: no runtime for the client: {e}")))?;
        let endpoint = Endpoint::from_shared(format!("http://{addr}"))
            .map_err(|e| Error::Launch(format!("local_sgd.servers: `{addr}` is not an address: {e}")))?
            .connect_timeout(timeout.min(Duration::from_secs(10)))
            .timeout(timeout);
        let client = runtime.block_on(connect(endpoint, addr, timeout))?;
        let (place, group) = (place as u32, group as u32);
        let mut round = Self { runtime, client, addr: addr.to_owned(), place, group, round: 0, global: start, timeout };
        let flat = round.global.concat();
        let message = chunks(place, group, 0, &flat);
        let ack = round.call("join", |mut c| async move { c.join(tokio_stream::iter(message)).await })?;
        round.round = ack.round;
        round.pull()?;
        Ok(round)
    }

    /// The place's global weights, per unit.
    pub fn global(&self) -> &[Vec<f32>] {
        &self.global
    }

    /// A round: pushes `global - local` for the current round, pulls the next round's global
    /// weights (waiting for the other groups' pushes). Also the bytes sent and received.
    pub fn run(&mut self, local: &[Vec<f32>]) -> Result<(&[Vec<f32>], u64)> {
        let delta = pseudo_gradient(&self.global, local);
        let bytes = 4 * delta.len() as u64;
        let message = chunks(self.place, self.group, self.round, &delta);
        let ack = self.call("push", |mut c| async move { c.push(tokio_stream::iter(message)).await })?;
        // The place moves to the next round once every group has pushed this one (`ack`
        // says it already has, or not yet: the pull waits for it).
        debug_assert!(ack.round == self.round || ack.round == self.round + 1);
        self.round += 1;
        self.pull()?;
        Ok((&self.global, 2 * bytes))
    }

    /// Pulls the global weights of the current round.
    fn pull(&mut self) -> Result<()> {
        let request = PullRequest { place: self.place, round: self.round };
        let total: usize = self.global.iter().map(Vec::len).sum();
        let mut flat = vec![0.0f32; total];
        let started = Instant::now();
        let client = self.client.clone();
        let timeout = self.timeout;
        let read = self.runtime.block_on(async move {
            let mut client = client;
            let mut stream = tokio::time::timeout(timeout, client.pull(request)).await??.into_inner();
            while let Some(chunk) = tokio::time::timeout(timeout, stream.message()).await?? {
                place_chunk(&chunk, &mut flat).map_err(tonic::Status::data_loss)?;
            }
            Ok::<_, PullError>(flat)
        });
        let flat = read.map_err(|e| self.failed("pull", e.to_string(), started))?;
        scatter(&flat, &mut self.global);
        Ok(())
    }

    /// Runs one unary-reply call on the client within the timeout.
    fn call<F, Fut>(&mut self, what: &'static str, f: F) -> Result<super::proto::Ack>
    where
        F: FnOnce(ParameterServerClient<Channel>) -> Fut,
        Fut: std::future::Future<Output = std::result::Result<tonic::Response<super::proto::Ack>, tonic::Status>>,
    {
        let started = Instant::now();
        let future = f(self.client.clone());
        let out = self.runtime.block_on(async { tokio::time::timeout(self.timeout, future).await });
        match out {
            Ok(Ok(reply)) => Ok(reply.into_inner()),
            Ok(Err(status)) => Err(self.failed(what, status.message().to_owned(), started)),
            Err(_) => Err(self.failed(what, "no answer".into(), started)),
        }
    }

    fn failed(&self, what: &str, detail: String, started: Instant) -> Error {
        Error::Launch(format!(
            "local_sgd.servers: {what} of place {} round {} at {} failed after {:.1} s: {detail}",
            self.place,
            self.round,
            self.addr,
            started.elapsed().as_secs_f64()
        ))
    }
}

/// A pull's failure: the server's status, or the timeout.
#[derive(Debug)]
enum PullError {
    Status(tonic::Status),
    Timeout,
}

impl std::fmt::Display for PullError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Status(s) => f.write_str(s.message()),
            Self::Timeout => f.write_str("no answer within the timeout"),
        }
    }
}

impl From<tonic::Status> for PullError {
    fn from(s: tonic::Status) -> Self {
        Self::Status(s)
    }
}

impl From<tokio::time::error::Elapsed> for PullError {
    fn from(_: tokio::time::error::Elapsed) -> Self {
        Self::Timeout
    }
}

/// Connects, retrying with exponential backoff (50 ms doubling to 2 s) until `timeout`.
async fn connect(endpoint: Endpoint, addr: &str, timeout: Duration) -> Result<ParameterServerClient<Channel>> {
    let started = Instant::now();
    let mut wait = Duration::from_millis(50);
    loop {
        match endpoint.connect().await {
            Ok(channel) => return Ok(ParameterServerClient::new(channel).max_decoding_message_size(16 << 20)),
            Err(e) if started.elapsed() + wait >= timeout => {
                return Err(Error::Launch(format!(
                    "local_sgd.servers: the server at {addr} does not answer ({e}) after {:.1} s",
                    started.elapsed().as_secs_f64()
                )));
            }
            Err(_) => {
                tokio::time::sleep(wait).await;
                wait = (wait * 2).min(Duration::from_secs(2));
            }
        }
    }
}
