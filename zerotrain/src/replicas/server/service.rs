//! The gRPC service of a parameter server: joins, pushes and pulls on the places (the
//! place module's state machine). The keeper that drops groups and saves checkpoints:
//! `keeper.rs`.

use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::watch;
use tokio_stream::{Stream, StreamExt};
use tonic::{Request, Response, Status, Streaming};

use super::ServerConfig;
use super::budget::{Budget, Reserved};
use super::place::{self, Place, Pulled, Refusal};
use super::proto::parameter_server_server::ParameterServer;
use super::proto::{Ack, Chunk, PullRequest};
use super::{Dtype, Header, Part, chunk_stream, place_in_order};

/// The places, and how their checkpoints went.
pub(super) struct State {
    pub places: Vec<Option<Place>>,
    /// The round of the last checkpoint written.
    pub saved: u64,
    /// The last save failed: its error, and when the keeper tries again.
    pub failed: Option<(String, Instant)>,
}

#[derive(Clone)]
pub(super) struct Service {
    pub config: Arc<ServerConfig>,
    pub state: Arc<Mutex<State>>,
    /// Bumped at every change of a place, so that waiting pulls look again.
    pub version: Arc<watch::Sender<u64>>,
    /// The next session number (from the clock at the start, so that a restarted server
    /// never hands out a session of its previous life).
    pub sessions: Arc<AtomicU64>,
    /// The keeper's save in progress, if any (one at a time; the stop waits for it).
    pub writing: Arc<Mutex<Option<tokio::task::JoinHandle<()>>>>,
    /// The memory given to vectors being received.
    pub budget: Arc<Budget>,
}

/// The values of a streamed vector, and its chunks' common header. `check` sees the header
/// before anything is allocated for the values, and may give a buffer to fill (a spare of
/// the place's, already of the length: its pages are mapped). The vector's bytes are
/// reserved from the server's [`Budget`] first (held until the returned reservation drops,
/// at the end of the call). The chunks must come in order and cover the vector exactly, so
/// nothing of a reused buffer's old values survives.
async fn collect<'s>(
    service: &'s Service,
    mut stream: Streaming<Chunk>,
    check: impl FnOnce(&Chunk) -> std::result::Result<Option<Vec<f32>>, Status>,
) -> std::result::Result<(Chunk, Vec<f32>, Reserved<'s>), Status> {
    let first = stream.message().await?.ok_or_else(|| Status::invalid_argument("an empty stream"))?;
    let len = usize::try_from(first.len).map_err(|_| Status::invalid_argument("a vector too long"))?;
    if len > MAX_PLACE_ELEMS {
        return Err(Status::invalid_argument(format!(
            "a vector of {len} values is over the limit of {MAX_PLACE_ELEMS}"
        )));
    }
    let spare = check(&first)?;
    let reserved = service.budget.reserve(4 * len as u64, || service.budget_limit()).await;
    let mut values = match spare {
        Some(buffer) if buffer.len() == len => buffer,
        _ => vec![0.0f32; len],
    };
    let mut next = place_in_order(&first, &mut values, 0)?;
    while let Some(chunk) = next_chunk(&mut stream, service.config.group_timeout).await? {
        let key = |c: &Chunk| (c.place, c.group, c.round, c.len, c.session, c.dtype);
        if key(&chunk) != key(&first) {
            return Err(Status::invalid_argument("chunks of one stream disagree on their header"));
        }
        next = place_in_order(&chunk, &mut values, next)?;
    }
    if next != len {
        return Err(Status::invalid_argument(format!("the stream ended after {next} of its {len} values")));
    }
    Ok((first, values, reserved))
}

/// The next chunk of `stream`, or an error once none has come within `stall`: a stream
/// holds its reservation of the budget while it is read, so one that stops making progress
/// (a client trickling bytes that never complete a chunk) gives it back rather than keep
/// every real push waiting for ever.
async fn next_chunk(stream: &mut Streaming<Chunk>, stall: Duration) -> std::result::Result<Option<Chunk>, Status> {
    match tokio::time::timeout(stall, stream.message()).await {
        Ok(next) => next,
        Err(_) => Err(Status::deadline_exceeded(format!(
            "no chunk of the stream came within {} s (local_sgd.group_timeout_s): its room in the server's memory \
             is given to others",
            stall.as_secs_f64()
        ))),
    }
}

/// The most values one place may hold (16 GiB of f32): a bound on what a call allocates.
pub(super) const MAX_PLACE_ELEMS: usize = 1 << 32;

/// The most places (ranks of a group) a server holds.
pub(super) const MAX_PLACES: u32 = 1 << 16;

impl Service {
    pub(super) fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The bytes of vectors that may be in flight at once: `groups + 1` times the places'
    /// (the note in `budget.rs`).
    fn budget_limit(&self) -> u64 {
        let held: u64 = self.lock().places.iter().flatten().map(|p| 4 * p.global.len() as u64).sum();
        held.saturating_mul(self.config.groups as u64 + 1)
    }

    fn check_group(&self, group: u32) -> std::result::Result<usize, Status> {
        match (group as usize) < self.config.groups {
            true => Ok(group as usize),
            false => Err(Status::invalid_argument(format!(
                "group {group} is not one of this server's {} groups (0..{})",
                self.config.groups, self.config.groups
            ))),
        }
    }

    /// Refuses a vector whose length is not its place's (once a group joined it), or, for a
    /// new place, not the other places' (every rank's part on one server is as long: ranks'
    /// shards are), so that nothing but the first join of all fixes what a call allocates.
    fn check_len(&self, head: &Chunk) -> std::result::Result<(), Status> {
        let state = self.lock();
        let place = state.places.get(head.place as usize).and_then(Option::as_ref);
        if place.is_none()
            && let Some(other) = state.places.iter().flatten().next()
            && other.global.len() as u64 != head.len
        {
            return Err(Status::failed_precondition(format!(
                "group {} joined place {} with {} values; this server's places hold {}: another model or layout",
                head.group,
                head.place,
                head.len,
                other.global.len()
            )));
        }
        match place {
            Some(place) if place.global.len() as u64 != head.len => Err(Status::failed_precondition(format!(
                "place {} holds {} values, group {} sent {}: another model or layout",
                head.place,
                place.global.len(),
                head.group,
                head.len
            ))),
            _ => Ok(()),
        }
    }

    /// Refuses a join for another part of the ranks' shards than the place holds (another
    /// order of `local_sgd.servers`, one server listed twice, another model or layout).
    fn check_part(&self, head: &Chunk) -> std::result::Result<Part, Status> {
        let part = head.part.ok_or_else(|| {
            Status::invalid_argument(format!(
                "group {} joined place {} without saying which part of its shard it sends (another version?)",
                head.group, head.place
            ))
        })?;
        let state = self.lock();
        let held = state.places.get(head.place as usize).and_then(Option::as_ref).and_then(|place| place.part);
        match held {
            Some(held) if held != part => Err(part_mismatch(head.place, &held, head.group, &part, head.len)),
            _ => Ok(part),
        }
    }

    pub(super) fn changed(&self) {
        self.version.send_modify(|v| *v += 1);
    }

    /// Runs `f` on place `p` under the lock, or refuses: no group joined it (a restarted
    /// server's callers join again).
    fn on_place<T>(
        &self,
        p: u32,
        f: impl FnOnce(&mut Place) -> std::result::Result<T, Status>,
    ) -> std::result::Result<T, Status> {
        let mut state = self.lock();
        let place = state.places.get_mut(p as usize).and_then(Option::as_mut).ok_or_else(|| {
            Status::aborted(format!("place {p}: no group joined it (the server restarted?): join again"))
        })?;
        f(place)
    }
}

/// A pull in progress; see [`Service::pull`].
struct Waiting<'a> {
    service: &'a Service,
    place: usize,
    group: usize,
    session: u64,
    answered: bool,
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        if !self.answered {
            let mut state = self.service.lock();
            if let Some(Some(place)) = state.places.get_mut(self.place) {
                place.stop_waiting(self.group, self.session);
            }
        }
    }
}

type ChunkStream = Pin<Box<dyn Stream<Item = std::result::Result<Chunk, Status>> + Send>>;

fn refused(place: u32, refusal: Refusal) -> Status {
    match refusal {
        Refusal::NotMember(why) => Status::aborted(format!("place {place}: {why}: join again")),
        Refusal::Invalid(why) => Status::failed_precondition(format!("place {place}: {why}")),
    }
}

fn part_mismatch(place: u32, held: &Part, group: u32, joined: &Part, len: u64) -> Status {
    Status::failed_precondition(format!(
        "place {place} holds {}; group {group} joined with {}: the groups must list local_sgd.servers in one \
         order, each server once, and train one model on groups of one size",
        held.describe(len),
        joined.describe(len)
    ))
}

fn ack(round: u64, session: u64, status: place::Status) -> Response<Ack> {
    let (live, staleness, applied) = (status.live as u32, status.staleness, status.round);
    Response::new(Ack { round, session, live, staleness, applied, settings: None })
}

#[tonic::async_trait]
impl ParameterServer for Service {
    async fn join(&self, request: Request<Streaming<Chunk>>) -> std::result::Result<Response<Ack>, Status> {
        let (head, values, _reserved) = collect(self, request.into_inner(), |head| {
            self.check_group(head.group)?;
            if head.place >= MAX_PLACES {
                return Err(Status::invalid_argument(format!(
                    "place {} is over the limit of {MAX_PLACES}",
                    head.place
                )));
            }
            self.check_len(head)?;
            self.check_part(head).map(|_| None)
        })
        .await?;
        let g = head.group as usize;
        let part = head.part.unwrap_or_default();
        let mut state = self.lock();
        let p = head.place as usize;
        if state.places.len() <= p {
            state.places.resize_with(p + 1, || None);
        }
        let config = &self.config;
        let place = match &mut state.places[p] {
            // Another joiner may have made it since `check_len` looked.
            Some(place) if place.global.len() != values.len() => {
                return Err(Status::failed_precondition(format!(
                    "place {p} holds {} values, group {g} joined with {}: another model or layout",
                    place.global.len(),
                    values.len()
                )));
            }
            // Or joined with another part since `check_part` looked.
            Some(place) if place.part.is_some_and(|held| held != part) => {
                let held = place.part.unwrap_or_default();
                return Err(part_mismatch(head.place, &held, head.group, &part, head.len));
            }
            Some(place) => place,
            slot @ None => {
                let outer = config.mode.fresh_outer();
                slot.insert(Place::new(config.mode, values, outer, 0, config.groups, config.comm_dtype))
            }
        };
        place.part = Some(part);
        let session = self.sessions.fetch_add(1, Ordering::Relaxed);
        let (round, status) = place.join(g, session, Instant::now(), head.at_least, &config.outer);
        drop(state);
        self.changed();
        let mut answer = ack(round, session, status);
        answer.get_mut().settings = Some(self.config.settings());
        Ok(answer)
    }

    async fn push(&self, request: Request<Streaming<Chunk>>) -> std::result::Result<Response<Ack>, Status> {
        let (head, delta, _reserved) = collect(self, request.into_inner(), |head| {
            self.check_group(head.group)?;
            self.check_len(head)?;
            let mut state = self.lock();
            Ok(state.places.get_mut(head.place as usize).and_then(Option::as_mut).and_then(Place::take_spare))
        })
        .await?;
        let (g, p) = (head.group as usize, head.place);
        let status = self.on_place(p, |place| {
            place.push(g, head.session, head.round, delta, &self.config.outer).map_err(|r| refused(p, r))
        })?;
        self.changed();
        Ok(ack(head.round + 1, head.session, status))
    }

    async fn leave(&self, request: Request<PullRequest>) -> std::result::Result<Response<Ack>, Status> {
        let PullRequest { place: p, group, session } = request.into_inner();
        let g = self.check_group(group)?;
        let status =
            self.on_place(p, |place| place.leave(g, session, &self.config.outer).map_err(|r| refused(p, r)))?;
        self.changed();
        Ok(ack(0, session, status))
    }

    type PullStream = ChunkStream;

    async fn pull(&self, request: Request<PullRequest>) -> std::result::Result<Response<ChunkStream>, Status> {
        let PullRequest { place: p, group, session } = request.into_inner();
        let g = self.check_group(group)?;
        let mut changes = self.version.subscribe();
        // Until it is answered the group waits; a pull dropped unanswered (its caller gone)
        // stops waiting, so that it never makes the place drop others on its behalf.
        let mut waiting = Waiting { service: self, place: p as usize, group: g, session, answered: false };
        loop {
            let pulled = self.on_place(p, |place| {
                let pulled = place.pull(g, session, Instant::now()).map_err(|r| refused(p, r))?;
                Ok((place.round, pulled))
            })?;
            if let (round, Pulled::Ready(global)) = pulled {
                waiting.answered = true;
                let head = Header { place: p, group, round, session, dtype: Dtype::Fp32 };
                return Ok(Response::new(Box::pin(chunk_stream(head, global).map(Ok))));
            }
            changes.changed().await.map_err(|_| Status::unavailable("the server is stopping"))?;
        }
    }
}
