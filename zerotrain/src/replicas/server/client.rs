//! The worker side: [`PlaceClient`], one rank's rounds through a parameter server.

use std::future::Future;
use std::time::{Duration, Instant};

use tonic::service::interceptor::InterceptedService;
use tonic::transport::{Channel, Endpoint};
use tonic::{Code, Status};
use zerotrain_precision::Precision;

use super::ServerConfig;
use super::auth::{Attach, Token};
use super::proto::parameter_server_client::ParameterServerClient;
use super::proto::{Ack, PullRequest, Settings};
use super::{Dtype, Header, Part, chunk_stream, chunks, place_in_order};
use crate::config::ReplicaPlan;
use crate::error::error_chain;
use crate::replicas::Round;
use crate::{Error, Result};

/// A connection whose calls carry the server token, if any.
type Client = ParameterServerClient<InterceptedService<Channel, Attach>>;

/// One rank's connection to one server, for its part of the rank's shard (a place): its
/// copy of the place's global weights, its session and the round it pushes next. A call
/// the server does not answer is retried with backoff for up to `timeout`; a pull may wait
/// the group timeout longer (the server drops the groups that keep it waiting).
pub struct PlaceClient {
    runtime: tokio::runtime::Runtime,
    client: Client,
    addr: String,
    place: u32,
    group: u32,
    session: u64,
    round: u64,
    global: Vec<f32>,
    dtype: Dtype,
    /// Which part of the rank's shard this server holds, said at every join.
    part: Part,
    /// The `local_sgd` keys the server must run with too.
    settings: Settings,
    /// Whether the connection is TLS.
    secure: bool,
    timeout: Duration,
    pull_wait: Duration,
    /// The pseudo-gradient and the pulled weights, flat, kept across rounds.
    delta: Vec<f32>,
    pulled: Vec<f32>,
}

/// A failed call: one that joining again mends, or an error.
enum Failure {
    Rejoin(String),
    Fatal(Error),
}

impl PlaceClient {
    /// Connects to `addr` (retrying with backoff for up to `timeout`), joins `place` as
    /// `plan.group` with this rank's `start` weights, `part` of its shard (the place's
    /// first joiner sets the global weights and the part every later joiner must send),
    /// and pulls the weights to start from.
    pub fn start(
        addr: &str,
        place: usize,
        part: Part,
        plan: &ReplicaPlan,
        start: Vec<f32>,
        timeout: Duration,
    ) -> Result<Self> {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| Error::Launch(format!("local_sgd.servers: no runtime for the client: {e}")))?;
        let tls = super::tls::client(plan, addr)?;
        let secure = tls.is_some();
        let scheme = if secure { "https" } else { "http" };
        let endpoint = Endpoint::from_shared(format!("{scheme}://{addr}"))
            .map_err(|e| Error::Launch(format!("local_sgd.servers: `{addr}` is not an address: {e}")))?
            .connect_timeout(timeout.min(Duration::from_secs(10)))
            .initial_stream_window_size(super::serve::WINDOW)
            .initial_connection_window_size(super::serve::WINDOW)
            .max_frame_size(super::serve::MAX_FRAME);
        let endpoint = match tls {
            Some(tls) => endpoint.tls_config(tls).map_err(|e| Error::Launch(format!("local_sgd.tls: {e}")))?,
            None => endpoint,
        };
        let token = Token::load(plan.auth_token_file.as_deref())?;
        let client = runtime.block_on(connect(endpoint, addr, Attach::new(token.as_ref()), timeout, secure))?;
        let dtype = match plan.comm_dtype {
            Precision::Bf16 => Dtype::Bf16,
            _ => Dtype::Fp32,
        };
        let mut round = Self {
            runtime,
            client,
            addr: addr.to_owned(),
            place: place as u32,
            group: plan.group.unwrap_or(0) as u32,
            session: 0,
            round: 0,
            global: Vec::new(),
            dtype,
            part,
            settings: ServerConfig::new(plan, None).settings(),
            secure,
            timeout,
            pull_wait: plan.group_timeout + timeout,
            delta: Vec::new(),
            pulled: Vec::new(),
        };
        // The place's weights to start from come with the first pull (`start` only joins).
        match round.join_and_pull(&start, 0) {
            Ok(_) => Ok(round),
            Err(Failure::Rejoin(why)) => Err(round.error("join", why)),
            Err(Failure::Fatal(e)) => Err(e),
        }
    }

    /// The place's global weights.
    pub fn global(&self) -> &[f32] {
        &self.global
    }

    /// A round: pushes `global - local` for the current round, pulls the weights to go on
    /// from; how it went (its number is [`LocalSgd`](crate::replicas::LocalSgd)'s to fill).
    /// A group dropped from the quorum (or met by a restarted server) joins again and
    /// goes on from the current global weights, its window discarded.
    pub fn run(&mut self, local: &[f32]) -> Result<(&[f32], Round)> {
        let round = self.round;
        let mut delta = std::mem::take(&mut self.delta);
        delta.clear();
        delta.extend(self.global.iter().zip(local).map(|(g, l)| g - l));
        let len = delta.len() as u64;
        let width = if self.dtype == Dtype::Bf16 { 2 } else { 4 };
        let bytes = (width + 4) * len;
        let head = self.header(self.round);
        // Encoded chunk by chunk as the stream is sent, from one shared copy.
        let delta = std::sync::Arc::new(delta);
        let pushed = self.call("push", self.timeout, |mut c| {
            let message = chunk_stream(head, std::sync::Arc::clone(&delta));
            async move { c.push(message).await.map(tonic::Response::into_inner) }
        });
        self.delta = std::sync::Arc::try_unwrap(delta).unwrap_or_default();
        let outcome = pushed.and_then(|ack| {
            self.round = ack.round;
            self.pull(local.len()).map(|()| ack)
        });
        match outcome {
            Ok(ack) => {
                let info = Round {
                    round: 0,
                    bytes,
                    live_groups: ack.live as usize,
                    staleness: ack.staleness,
                    rejoined: false,
                    global_round: Some(self.round),
                };
                Ok((&self.global, info))
            }
            Err(Failure::Fatal(e)) => Err(e),
            Err(Failure::Rejoin(why)) => {
                let (place, group) = (self.place, self.group);
                eprintln!("zerotrain: group {group}, place {place}: {why}; joining again (this window is discarded)");
                // Its other places applied this round's push, or will: here too it starts
                // after it.
                let ack = self.join_and_pull(local, round + 1).map_err(|f| match f {
                    Failure::Fatal(e) => e,
                    Failure::Rejoin(why) => self.error("join", why),
                })?;
                let live_groups = ack.live as usize;
                let global_round = Some(self.round);
                let info = Round { round: 0, bytes: 8 * len, live_groups, staleness: 0, rejoined: true, global_round };
                Ok((&self.global, info))
            }
        }
    }

    fn header(&self, round: u64) -> Header {
        Header { place: self.place, group: self.group, round, session: self.session, dtype: self.dtype }
    }

    /// Joins with `local` (the weights a place that no group joined yet starts from) and
    /// pulls the weights to go on from.
    fn join_and_pull(&mut self, local: &[f32], at_least: u64) -> std::result::Result<Ack, Failure> {
        let head = Header { dtype: Dtype::Fp32, ..self.header(0) };
        let part = self.part;
        let ack: Ack = self.call("join", self.timeout, |mut c| {
            let mut message = chunks(head, local);
            message[0].part = Some(part);
            message[0].at_least = at_least;
            async move { c.join(tokio_stream::iter(message)).await.map(tonic::Response::into_inner) }
        })?;
        if let Some(differing) = ack.settings.as_ref().and_then(|theirs| differing(&self.settings, theirs)) {
            return Err(Failure::Fatal(self.error("join", differing)));
        }
        self.session = ack.session;
        self.round = ack.round;
        self.pull(local.len()).map(|()| ack)
    }

    /// Pulls the `total` values of the weights the group goes on from (waiting for the
    /// other groups).
    fn pull(&mut self, total: usize) -> std::result::Result<(), Failure> {
        let request = PullRequest { place: self.place, group: self.group, session: self.session };
        let buffer = std::sync::Mutex::new(std::mem::take(&mut self.pulled));
        let pulled = self.call("pull", self.pull_wait, |mut c| {
            let buffer = &buffer;
            async move {
                let mut flat = std::mem::take(&mut *buffer.lock().unwrap_or_else(|e| e.into_inner()));
                flat.resize(total, 0.0);
                let read = async {
                    let mut stream = c.pull(request).await?.into_inner();
                    let mut next = 0;
                    while let Some(chunk) = stream.message().await? {
                        next = place_in_order(&chunk, &mut flat, next)?;
                    }
                    match next == total {
                        true => Ok(()),
                        false => Err(Status::data_loss(format!("the pull ended after {next} of its {total} values"))),
                    }
                }
                .await;
                *buffer.lock().unwrap_or_else(|e| e.into_inner()) = flat;
                read
            }
        });
        self.pulled = buffer.into_inner().unwrap_or_else(|e| e.into_inner());
        pulled?;
        std::mem::swap(&mut self.pulled, &mut self.global);
        Ok(())
    }

    /// Runs `f` on the client until it answers, within `limit` per attempt; a server that
    /// cannot be reached is tried again with [`Backoff`] for up to the timeout. `Aborted`
    /// means: join again.
    fn call<T, F, Fut>(&self, what: &'static str, limit: Duration, f: F) -> std::result::Result<T, Failure>
    where
        F: Fn(Client) -> Fut,
        Fut: Future<Output = std::result::Result<T, Status>>,
    {
        let mut backoff = Backoff::new(self.timeout);
        loop {
            let attempt = self.runtime.block_on(async { tokio::time::timeout(limit, f(self.client.clone())).await });
            let status = match attempt {
                Ok(Ok(out)) => return Ok(out),
                Err(_) => {
                    return Err(Failure::Fatal(
                        self.error(what, format!("no answer within {:.1} s", limit.as_secs_f64())),
                    ));
                }
                Ok(Err(status)) => status,
            };
            match status.code() {
                Code::Aborted => return Err(Failure::Rejoin(status.message().to_owned())),
                // The server went away (or restarts): the connection's errors.
                Code::Unavailable | Code::Unknown | Code::Cancelled => {
                    let why = match std::error::Error::source(&status) {
                        Some(source) => format!("{}: {}", status.message(), error_chain(source)),
                        None => status.message().to_owned(),
                    };
                    match backoff.retry(&why, self.secure) {
                        Ok(wait) => std::thread::sleep(wait),
                        Err(why) => {
                            let detail = format!("unreachable for {:.1} s: {why}", backoff.elapsed());
                            return Err(Failure::Fatal(self.error(what, detail)));
                        }
                    }
                }
                _ => return Err(Failure::Fatal(self.error(what, status.message().to_owned()))),
            }
        }
    }

    fn error(&self, what: &str, detail: String) -> Error {
        Error::Launch(format!(
            "local_sgd.servers: {what} of group {} place {} round {} at {}: {detail}",
            self.group, self.place, self.round, self.addr
        ))
    }
}

impl Drop for PlaceClient {
    /// Leaves the place, so that the other groups stop waiting for this one (best effort:
    /// a server that does not answer within a second drops it past its timeout anyway).
    fn drop(&mut self) {
        let request = PullRequest { place: self.place, group: self.group, session: self.session };
        let mut client = self.client.clone();
        let _ = self.runtime.block_on(async {
            tokio::time::timeout(Duration::from_secs(1), async move { client.leave(request).await }).await
        });
    }
}

/// The keys whose values differ between this job's settings and a server's, each named
/// with both values; `None` when they agree.
fn differing(ours: &Settings, theirs: &Settings) -> Option<String> {
    let mode = |s: &Settings| if s.asynchronous { "async" } else { "sync" };
    let outer =
        |s: &Settings| format!("lr {}, momentum {}, nesterov {}", s.outer_lr, s.outer_momentum, s.outer_nesterov);
    let keys = [
        ("local_sgd.groups", ours.groups.to_string(), theirs.groups.to_string()),
        ("local_sgd.outer_optimizer", outer(ours), outer(theirs)),
        ("local_sgd.mode", mode(ours).into(), mode(theirs).into()),
        ("local_sgd.max_staleness", ours.max_staleness.to_string(), theirs.max_staleness.to_string()),
        ("local_sgd.group_timeout_s", ours.group_timeout_s.to_string(), theirs.group_timeout_s.to_string()),
        ("local_sgd.checkpoint_every", ours.checkpoint_every.to_string(), theirs.checkpoint_every.to_string()),
        (
            "local_sgd.communication_data_type",
            ours.communication_data_type.clone(),
            theirs.communication_data_type.clone(),
        ),
    ];
    let differ: Vec<String> = keys
        .into_iter()
        .filter(|(_, a, b)| a != b)
        .map(|(key, a, b)| format!("{key} is {a} in this job's config, {b} in the server's"))
        .collect();
    (!differ.is_empty())
        .then(|| format!("{}: every group and the server must run one local_sgd section", differ.join("; ")))
}

/// Waits between tries of something that did not answer: 50 ms doubling to 2 s, for as
/// long as the next wait still ends within `limit` of the first try.
struct Backoff {
    started: Instant,
    wait: Duration,
    limit: Duration,
    /// Tries that failed so far.
    failed: u32,
}

impl Backoff {
    fn new(limit: Duration) -> Self {
        Self { started: Instant::now(), wait: Duration::from_millis(50), limit, failed: 0 }
    }

    /// "1 try" or "N tries": the tries that failed so far, for a message.
    fn tries(&self) -> String {
        match self.failed {
            1 => "1 try".into(),
            n => format!("{n} tries"),
        }
    }

    /// The wait before the next try, or `None`: give up.
    fn next(&mut self) -> Option<Duration> {
        let wait = self.wait;
        self.wait = (wait * 2).min(Duration::from_secs(2));
        (self.started.elapsed() + wait < self.limit).then_some(wait)
    }

    /// Seconds since the first try.
    fn elapsed(&self) -> f64 {
        self.started.elapsed().as_secs_f64()
    }

    /// After a try that failed with `why` (over TLS where `tls`): the wait before the next,
    /// or, to give up, `why` with what to look at. A certificate the worker does not trust
    /// gives up at once: waiting cannot make it trusted.
    fn retry(&mut self, why: &str, tls: bool) -> std::result::Result<Duration, String> {
        self.failed += 1;
        let untrusted = why.contains("invalid peer certificate");
        match self.next() {
            Some(wait) if !untrusted => Ok(wait),
            _ if untrusted => Err(format!("{why} (local_sgd.tls.ca_file and domain: what this worker trusts)")),
            _ if !tls => Err(format!("{why} (a server with TLS needs local_sgd.tls.ca_file here)")),
            _ => Err(why.to_owned()),
        }
    }
}

/// Connects (over TLS where `tls`), retrying with [`Backoff`] until `timeout`; a server
/// certificate the worker does not trust fails at once.
async fn connect(endpoint: Endpoint, addr: &str, attach: Attach, timeout: Duration, tls: bool) -> Result<Client> {
    let mut backoff = Backoff::new(timeout);
    loop {
        match endpoint.connect().await {
            Ok(channel) => {
                let client = ParameterServerClient::with_interceptor(channel, attach);
                return Ok(client.max_decoding_message_size(16 << 20));
            }
            Err(e) => match backoff.retry(&error_chain(&e), tls) {
                Ok(wait) => tokio::time::sleep(wait).await,
                Err(why) => {
                    return Err(Error::Launch(format!(
                        "local_sgd.servers: the server at {addr} does not answer ({why}) after {} in {:.1} s",
                        backoff.tries(),
                        backoff.elapsed()
                    )));
                }
            },
        }
    }
}
