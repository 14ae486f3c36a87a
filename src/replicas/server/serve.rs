//! The server side: [`serve`] runs a parameter server on a thread of its own until its
//! [`ServerHandle`] is dropped.

use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::{Arc, Mutex};

use tokio::sync::{oneshot, watch};
use tokio_stream::Stream;
use tonic::{Request, Response, Status, Streaming};

use super::proto::parameter_server_server::{ParameterServer, ParameterServerServer};
use super::proto::{Ack, Chunk, PullRequest};
use super::{chunks, place_chunk};
use crate::config::OuterOptimizer;
use crate::replicas::outer::OuterState;
use crate::{Error, Result};

/// A running server; dropping it (or [`stop`](Self::stop)) shuts it down.
pub struct ServerHandle {
    addr: SocketAddr,
    shutdown: Option<oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl ServerHandle {
    /// The address it listens on (the port chosen, where `listen` asked for port 0).
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Shuts the server down and waits for it.
    pub fn stop(mut self) {
        self.shut();
    }

    fn shut(&mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

impl Drop for ServerHandle {
    fn drop(&mut self) {
        self.shut();
    }
}

/// Starts a parameter server on `listen` for `groups` replica groups stepping the global
/// weights with `outer`. Returns once it listens.
pub fn serve(listen: SocketAddr, groups: usize, outer: OuterOptimizer) -> Result<ServerHandle> {
    let (ready_tx, ready_rx) = std::sync::mpsc::channel::<std::io::Result<SocketAddr>>();
    let (shutdown_tx, shutdown_rx) = oneshot::channel::<()>();
    let service = Service { groups, outer, places: Arc::new(Mutex::new(Vec::new())), version: watch::channel(0).0 };
    let thread = std::thread::Builder::new()
        .name("zerotrain-server".into())
        .spawn(move || {
            let runtime = match tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build() {
                Ok(runtime) => runtime,
                Err(e) => return drop(ready_tx.send(Err(e))),
            };
            runtime.block_on(async move {
                let listener = match tokio::net::TcpListener::bind(listen).await {
                    Ok(listener) => listener,
                    Err(e) => return drop(ready_tx.send(Err(e))),
                };
                let _ = ready_tx.send(listener.local_addr());
                let incoming = tokio_stream::wrappers::TcpListenerStream::new(listener);
                let service = ParameterServerServer::new(service).max_decoding_message_size(16 << 20);
                let server = tonic::transport::Server::builder().add_service(service).serve_with_incoming(incoming);
                // Stopping drops the server at once, open connections included: a worker that
                // never hangs up must not keep it alive.
                tokio::select! {
                    _ = server => {}
                    _ = shutdown_rx => {}
                }
            });
            runtime.shutdown_timeout(std::time::Duration::from_secs(1));
        })
        .map_err(|e| Error::Launch(format!("cannot start the parameter server's thread: {e}")))?;
    let addr = ready_rx
        .recv()
        .map_err(|_| Error::Launch("the parameter server stopped while starting".into()))?
        .map_err(|e| Error::Launch(format!("the parameter server cannot listen on {listen}: {e}")))?;
    Ok(ServerHandle { addr, shutdown: Some(shutdown_tx), thread: Some(thread) })
}

/// One place's global weights, outer state, round and the pushes of that round.
struct Place {
    global: Vec<f32>,
    outer: OuterState,
    round: u64,
    pushes: Vec<Option<Vec<f32>>>,
}

struct Service {
    groups: usize,
    outer: OuterOptimizer,
    places: Arc<Mutex<Vec<Option<Place>>>>,
    /// Bumped at every change of a place, so that waiting pulls look again.
    version: watch::Sender<u64>,
}

/// The values of a streamed vector, and its chunks' common header.
async fn collect(mut stream: Streaming<Chunk>) -> std::result::Result<(Chunk, Vec<f32>), Status> {
    let first = stream.message().await?.ok_or_else(|| Status::invalid_argument("an empty stream"))?;
    let len = usize::try_from(first.len).map_err(|_| Status::invalid_argument("a vector too long"))?;
    let mut values = vec![0.0f32; len];
    place_chunk(&first, &mut values).map_err(Status::invalid_argument)?;
    while let Some(chunk) = stream.message().await? {
        if (chunk.place, chunk.group, chunk.round, chunk.len) != (first.place, first.group, first.round, first.len) {
            return Err(Status::invalid_argument("chunks of one stream disagree on place, group, round or length"));
        }
        place_chunk(&chunk, &mut values).map_err(Status::invalid_argument)?;
    }
    Ok((first, values))
}

impl Service {
    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Option<Place>>> {
        self.places.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn check_group(&self, head: &Chunk) -> std::result::Result<(), Status> {
        match (head.group as usize) < self.groups {
            true => Ok(()),
            false => Err(Status::invalid_argument(format!(
                "group {} is not one of this server's {} groups (0..{})",
                head.group, self.groups, self.groups
            ))),
        }
    }
}

type ChunkStream = Pin<Box<dyn Stream<Item = std::result::Result<Chunk, Status>> + Send>>;

#[tonic::async_trait]
impl ParameterServer for Service {
    async fn join(&self, request: Request<Streaming<Chunk>>) -> std::result::Result<Response<Ack>, Status> {
        let (head, values) = collect(request.into_inner()).await?;
        self.check_group(&head)?;
        let mut places = self.lock();
        let p = head.place as usize;
        if places.len() <= p {
            places.resize_with(p + 1, || None);
        }
        let place = places[p].get_or_insert_with(|| Place {
            global: values.clone(),
            outer: OuterState::default(),
            round: 0,
            pushes: vec![None; self.groups],
        });
        if place.global.len() != values.len() {
            return Err(Status::failed_precondition(format!(
                "place {p} holds {} values, group {} joined with {}: another model or layout",
                place.global.len(),
                head.group,
                values.len()
            )));
        }
        let round = place.round;
        drop(places);
        self.version.send_modify(|v| *v += 1);
        Ok(Response::new(Ack { round }))
    }

    async fn push(&self, request: Request<Streaming<Chunk>>) -> std::result::Result<Response<Ack>, Status> {
        let (head, delta) = collect(request.into_inner()).await?;
        self.check_group(&head)?;
        let mut places = self.lock();
        let (p, g) = (head.place as usize, head.group as usize);
        let place = places
            .get_mut(p)
            .and_then(Option::as_mut)
            .ok_or_else(|| Status::failed_precondition(format!("push to place {p}, which no group joined")))?;
        if head.round != place.round {
            return Err(Status::failed_precondition(format!(
                "push from group {g} for round {} of place {p}, which is at round {}: stale or unknown",
                head.round, place.round
            )));
        }
        if delta.len() != place.global.len() || place.pushes[g].is_some() {
            return Err(Status::failed_precondition(format!(
                "group {g} pushed {} values to place {p} of {} for round {} (twice, or another layout)",
                delta.len(),
                place.global.len(),
                place.round
            )));
        }
        place.pushes[g] = Some(delta);
        if place.pushes.iter().all(Option::is_some) {
            // In group order, as the in-job all-reduce sums.
            let mut sum = vec![0.0f32; place.global.len()];
            for push in place.pushes.iter_mut().map(|p| p.take().expect("all present")) {
                sum.iter_mut().zip(push).for_each(|(s, d)| *s += d);
            }
            place.outer.step_mean(&self.outer, &mut place.global, &mut sum, self.groups);
            place.round += 1;
        }
        let round = place.round;
        drop(places);
        self.version.send_modify(|v| *v += 1);
        Ok(Response::new(Ack { round }))
    }

    type PullStream = ChunkStream;

    async fn pull(&self, request: Request<PullRequest>) -> std::result::Result<Response<ChunkStream>, Status> {
        let PullRequest { place: p, round } = request.into_inner();
        let mut changes = self.version.subscribe();
        loop {
            {
                let places = self.lock();
                if let Some(place) = places.get(p as usize).and_then(Option::as_ref) {
                    if place.round == round {
                        let out = chunks(p, 0, round, &place.global);
                        return Ok(Response::new(Box::pin(tokio_stream::iter(out.into_iter().map(Ok)))));
                    }
                    if place.round > round {
                        return Err(Status::failed_precondition(format!(
                            "pull of round {round} of place {p}, which is at round {} already",
                            place.round
                        )));
                    }
                }
            }
            changes.changed().await.map_err(|_| Status::unavailable("the server is stopping"))?;
        }
    }
}

#[cfg(test)]
mod tests {
    use tokio_stream::iter;

    use super::super::proto::parameter_server_client::ParameterServerClient;
    use super::*;

    /// A round on the wire: two groups push, the place moves to round 1 with the mean
    /// pseudo-gradient applied (plain SGD, lr 1: the groups' mean); pushes for another round,
    /// from an unknown group, twice, or of another length, and pulls of a past round, are
    /// refused with messages naming what was wrong.
    #[test]
    fn a_round_applies_the_mean_and_bad_calls_are_refused_by_name() {
        let averaging = OuterOptimizer { lr: 1.0, momentum: 0.0, nesterov: false };
        let server = serve("127.0.0.1:0".parse().unwrap(), 2, averaging).unwrap();
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        runtime.block_on(async {
            let mut c = ParameterServerClient::connect(format!("http://{}", server.addr())).await.unwrap();
            let ack = c.join(iter(chunks(0, 0, 0, &[1.0, 2.0]))).await.unwrap().into_inner();
            assert_eq!(ack.round, 0);
            let err = c.join(iter(chunks(0, 1, 0, &[1.0, 2.0, 3.0]))).await.unwrap_err();
            assert!(err.message().contains("place 0 holds 2 values, group 1 joined with 3"), "{}", err.message());
            let ack = c.push(iter(chunks(0, 0, 0, &[0.5, 0.5]))).await.unwrap().into_inner();
            assert_eq!(ack.round, 0, "waiting for group 1");
            let err = c.push(iter(chunks(0, 0, 0, &[0.5, 0.5]))).await.unwrap_err();
            assert!(err.message().contains("twice"), "{}", err.message());
            let err = c.push(iter(chunks(0, 1, 3, &[0.5, 0.5]))).await.unwrap_err();
            assert!(err.message().contains("round 3 of place 0, which is at round 0: stale"), "{}", err.message());
            let err = c.push(iter(chunks(0, 5, 0, &[0.5, 0.5]))).await.unwrap_err();
            assert!(err.message().contains("group 5 is not one of this server's 2 groups"), "{}", err.message());
            let ack = c.push(iter(chunks(0, 1, 0, &[1.5, -0.5]))).await.unwrap().into_inner();
            assert_eq!(ack.round, 1);
            let mut stream = c.pull(PullRequest { place: 0, round: 1 }).await.unwrap().into_inner();
            let chunk = stream.message().await.unwrap().unwrap();
            let mut got = vec![0.0f32; 2];
            place_chunk(&chunk, &mut got).unwrap();
            // [1, 2] - mean([0.5, 0.5], [1.5, -0.5]) = [1 - 1, 2 - 0].
            assert_eq!(got, [0.0, 2.0]);
            let err = c.pull(PullRequest { place: 0, round: 0 }).await.unwrap_err();
            assert!(err.message().contains("at round 1 already"), "{}", err.message());
        });
        server.stop();
    }
}
