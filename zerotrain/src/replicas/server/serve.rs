//! The server side: [`serve`] runs a parameter server on a thread of its own until its
//! [`ServerHandle`] is dropped.

use std::net::SocketAddr;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::{oneshot, watch};

use super::proto::parameter_server_server::ParameterServerServer;
use super::service::{Service, State};
use super::{ServerConfig, store};
use crate::{Error, Result};

/// A running server; dropping it (or [`stop`](Self::stop)) shuts it down, saving what its
/// last checkpoint lacks (with a checkpoint folder).
pub struct ServerHandle {
    addr: SocketAddr,
    resumed: Option<u64>,
    state: Arc<Mutex<State>>,
    shutdown: Option<oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<std::result::Result<(), String>>>,
}

impl ServerHandle {
    /// The address it listens on (the port chosen, where `listen` asked for port 0).
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The round of the checkpoint it started from, if it did.
    pub fn resumed(&self) -> Option<u64> {
        self.resumed
    }

    /// How its checkpoints go: the round of the last one written (or resumed from), and the
    /// last save's error while it has not succeeded since.
    pub fn checkpoints(&self) -> Checkpoints {
        let state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        Checkpoints { saved: state.saved, failed: state.failed.as_ref().map(|(e, _)| e.clone()) }
    }

    /// Shuts the server down and waits for it, its save in flight and its last one. An
    /// error: the last rounds are not on disk (the save's error says why).
    pub fn stop(mut self) -> Result<()> {
        self.shut()
    }

    fn shut(&mut self) -> Result<()> {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        match self.thread.take().map(std::thread::JoinHandle::join) {
            None | Some(Ok(Ok(()))) => Ok(()),
            Some(Ok(Err(e))) => Err(Error::Launch(format!("parameter server at {}: {e}", self.addr))),
            Some(Err(_)) => Err(Error::Launch(format!("parameter server at {}: its thread panicked", self.addr))),
        }
    }
}

impl Drop for ServerHandle {
    /// Stops the server; a failed last save was printed by the server ([`stop`](Self::stop)
    /// returns it).
    fn drop(&mut self) {
        let _ = self.shut();
    }
}

/// How a server's checkpoints go ([`ServerHandle::checkpoints`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Checkpoints {
    /// The round of the last checkpoint written or resumed from (0: none).
    pub saved: u64,
    /// The last save's error, until a save succeeds (the keeper tries again every few seconds).
    pub failed: Option<String>,
}

/// HTTP/2 flow-control window of every stream and connection, both ways (bytes).
pub(super) const WINDOW: u32 = 32 << 20;
/// HTTP/2's largest frame (its maximum, 16 MiB less one byte).
pub(super) const MAX_FRAME: u32 = (1 << 24) - 1;

/// Starts a parameter server on `listen` (from `config.checkpoint`'s latest checkpoint if
/// there is one). Returns once it listens.
pub fn serve(listen: SocketAddr, config: ServerConfig) -> Result<ServerHandle> {
    let (places, resumed) = match &config.checkpoint {
        Some(dir) => match store::load(dir, &config)? {
            Some((places, round)) => (places, Some(round)),
            None => (Vec::new(), None),
        },
        None => (Vec::new(), None),
    };
    let sessions =
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(1, |d| d.as_nanos() as u64);
    let state = State { places, saved: resumed.unwrap_or(0), failed: None };
    let check = super::auth::Check::new(config.token.as_ref());
    let limits = config.limits;
    // HTTP/2's default 64 KiB windows would hold a stream of large tensors to a trickle.
    let builder = tonic::transport::Server::builder()
        .initial_stream_window_size(WINDOW)
        .initial_connection_window_size(WINDOW)
        .max_frame_size(MAX_FRAME)
        // Answered by every client's HTTP/2 stack, also while it waits in a pull: a
        // connection that answers nothing is idle (`incoming.rs`).
        .http2_keepalive_interval(Some(super::incoming::KEEPALIVE))
        .http2_keepalive_timeout(Some(super::incoming::KEEPALIVE))
        // A caller's streams at a time (a rank sends to a place one vector at a time).
        .concurrency_limit_per_connection(8);
    let mut builder = match config.tls.clone() {
        Some(tls) => builder.tls_config(tls).map_err(|e| Error::Launch(format!("local_sgd.tls: {e}")))?,
        None => builder,
    };
    let state = Arc::new(Mutex::new(state));
    let service = Service {
        config: Arc::new(config),
        state: Arc::clone(&state),
        version: Arc::new(watch::channel(0).0),
        sessions: Arc::new(AtomicU64::new(sessions)),
        writing: Arc::new(Mutex::new(None)),
        budget: Arc::new(super::budget::Budget::default()),
    };
    let (ready_tx, ready_rx) = std::sync::mpsc::channel::<std::io::Result<SocketAddr>>();
    let (shutdown_tx, shutdown_rx) = oneshot::channel::<()>();
    let thread = std::thread::Builder::new()
        .name("zerotrain-server".into())
        .spawn(move || {
            let runtime = match tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build() {
                Ok(runtime) => runtime,
                Err(e) => {
                    let _ = ready_tx.send(Err(e));
                    return Ok(());
                }
            };
            let saved = runtime.block_on(async move {
                let listener = match tokio::net::TcpListener::bind(listen).await {
                    Ok(listener) => listener,
                    Err(e) => {
                        let _ = ready_tx.send(Err(e));
                        return Ok(());
                    }
                };
                let _ = ready_tx.send(listener.local_addr());
                let incoming = super::incoming::accept(listener, limits);
                let keeper = service.clone().keep();
                let last = service.clone();
                let service = ParameterServerServer::new(service).max_decoding_message_size(16 << 20);
                let service = tonic::service::interceptor::InterceptedService::new(service, check);
                let server = builder.add_service(service).serve_with_incoming(incoming);
                // Stopping drops the server at once, open connections included: a worker that
                // never hangs up must not keep it alive.
                tokio::select! {
                    _ = server => {}
                    _ = keeper => {}
                    _ = shutdown_rx => {}
                }
                last.save_last().await
            });
            runtime.shutdown_timeout(Duration::from_secs(1));
            saved
        })
        .map_err(|e| Error::Launch(format!("cannot start the parameter server's thread: {e}")))?;
    let addr = ready_rx
        .recv()
        .map_err(|_| Error::Launch("the parameter server stopped while starting".into()))?
        .map_err(|e| Error::Launch(format!("the parameter server cannot listen on {listen}: {e}")))?;
    Ok(ServerHandle { addr, resumed, state, shutdown: Some(shutdown_tx), thread: Some(thread) })
}

#[cfg(test)]
mod tests {
    use tokio_stream::{StreamExt, iter};

    use super::super::proto::PullRequest;
    use super::super::proto::parameter_server_client::ParameterServerClient;
    use super::super::{Dtype, Header, chunks, place_chunk};
    use std::path::PathBuf;

    use zerotrain_precision::Precision;

    use super::*;
    use crate::config::{OuterOptimizer, ReplicaMode};

    fn head(group: u32, round: u64, session: u64) -> Header {
        Header { place: 0, group, round, session, dtype: Dtype::Fp32 }
    }

    /// A join's chunks: `values` as the whole shard of a rank, on one server.
    fn joining(head: Header, values: &[f32]) -> Vec<super::super::proto::Chunk> {
        let mut message = chunks(head, values);
        let part = super::super::Part { index: 0, count: 1, offset: 0, shard_len: values.len() as u64, layout: 1 };
        message[0].part = Some(part);
        message
    }

    fn config(groups: usize, checkpoint: Option<PathBuf>) -> ServerConfig {
        ServerConfig {
            groups,
            outer: OuterOptimizer { lr: 1.0, momentum: 0.0, nesterov: false },
            mode: ReplicaMode::Sync,
            group_timeout: Duration::from_secs(30),
            checkpoint,
            checkpoint_every: 100,
            comm_dtype: Precision::Fp32,
            token: None,
            tls: None,
            limits: super::super::incoming::Limits::for_this_process(),
        }
    }

    async fn pull(c: &mut ParameterServerClient<tonic::transport::Channel>, group: u32, session: u64) -> Vec<f32> {
        let mut stream = c.pull(PullRequest { place: 0, group, session }).await.unwrap().into_inner();
        let chunk = stream.message().await.unwrap().unwrap();
        let mut got = vec![0.0f32; chunk.len as usize];
        place_chunk(&chunk, &mut got).unwrap();
        got
    }

    /// A round on the wire: two groups join and push (one in bf16), the place moves to
    /// round 1 with the mean pseudo-gradient applied (plain SGD, lr 1: the mean); pushes for
    /// another round, from an unknown group, under an old session, or of another
    /// length are refused with messages naming what was wrong; and a server stopped between
    /// checkpoints saves one, from which it restarts with the same weights and round, sending
    /// the old sessions to join again.
    #[test]
    fn a_round_applies_the_mean_bad_calls_are_refused_and_a_restart_resumes_it() {
        let dir = std::env::temp_dir().join(format!("zt-ps-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let server = serve("127.0.0.1:0".parse().unwrap(), config(2, Some(dir.clone()))).unwrap();
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let addr = server.addr();
        let (s0, s1) = runtime.block_on(async {
            let mut c = ParameterServerClient::connect(format!("http://{addr}")).await.unwrap();
            let a0 = c.join(iter(joining(head(0, 0, 0), &[1.0, 2.0]))).await.unwrap().into_inner();
            assert_eq!((a0.round, a0.live), (0, 1));
            let err = c.join(iter(joining(head(1, 0, 0), &[1.0, 2.0, 3.0]))).await.unwrap_err();
            assert!(err.message().contains("place 0 holds 2 values, group 1 sent 3"), "{}", err.message());
            let far = Header { place: 1 << 20, ..head(1, 0, 0) };
            let err = c.join(iter(joining(far, &[1.0]))).await.unwrap_err();
            assert!(err.message().contains("place 1048576 is over the limit"), "{}", err.message());
            let a1 = c.join(iter(joining(head(1, 0, 0), &[5.0, 5.0]))).await.unwrap().into_inner();
            assert_ne!(a0.session, a1.session);
            let ack = c.push(iter(chunks(head(0, 0, a0.session), &[0.5, 0.5]))).await.unwrap().into_inner();
            assert_eq!((ack.round, ack.applied, ack.live), (1, 0, 2), "waiting for group 1");
            let retried = c.push(iter(chunks(head(0, 0, a0.session), &[0.5, 0.5]))).await.unwrap().into_inner();
            assert_eq!((retried.round, retried.applied), (1, 0), "a retry is acknowledged");
            let err = c.push(iter(chunks(head(1, 3, a1.session), &[0.5, 0.5]))).await.unwrap_err();
            assert!(err.message().contains("round 3") && err.message().contains("stale"), "{}", err.message());
            let err = c.push(iter(chunks(head(5, 0, a1.session), &[0.5, 0.5]))).await.unwrap_err();
            assert!(err.message().contains("group 5 is not one of this server's 2 groups"), "{}", err.message());
            let err = c.push(iter(chunks(head(1, 0, a1.session + 100), &[0.5, 0.5]))).await.unwrap_err();
            assert_eq!(err.code(), tonic::Code::Aborted, "{}", err.message());
            // A stream must cover its vector, in order: a cut or shuffled one is refused.
            let mut cut = chunks(head(1, 0, a1.session), &[0.5, 0.5]);
            cut[0].data.truncate(4);
            let err = c.push(iter(cut.clone())).await.unwrap_err();
            assert!(err.message().contains("ended after 1 of its 2 values"), "{}", err.message());
            cut[0].offset = 1;
            let err = c.push(iter(cut)).await.unwrap_err();
            assert!(err.message().contains("a chunk at 1 where 0 was next"), "{}", err.message());
            let bf16 = Header { dtype: Dtype::Bf16, ..head(1, 0, a1.session) };
            let ack = c.push(iter(chunks(bf16, &[1.5, -0.5]))).await.unwrap().into_inner();
            assert_eq!(ack.applied, 1);
            // [1, 2] - mean([0.5, 0.5], [1.5, -0.5]) = [0, 2]: the first joiner's weights.
            assert_eq!(pull(&mut c, 0, a0.session).await, [0.0, 2.0]);
            (a0.session, a1.session)
        });
        // Not due (every 100 rounds): the stop saves it.
        assert!(zerotrain_checkpoint::list(&dir).map_or(0, |l| l.len()) == 0);
        server.stop().unwrap();
        let server = serve("127.0.0.1:0".parse().unwrap(), config(2, Some(dir.clone()))).unwrap();
        assert_eq!(server.resumed(), Some(1));
        let addr = server.addr();
        runtime.block_on(async {
            let mut c = ParameterServerClient::connect(format!("http://{addr}")).await.unwrap();
            let err = c.push(iter(chunks(head(0, 1, s0), &[0.0, 0.0]))).await.unwrap_err();
            assert_eq!(err.code(), tonic::Code::Aborted, "{}", err.message());
            assert!(err.message().contains("join again"), "{}", err.message());
            // The place's part survived the restart.
            let mut other = joining(head(1, 0, s1), &[7.0, 7.0]);
            other[0].part.as_mut().unwrap().layout = 2;
            let err = c.join(iter(other)).await.unwrap_err();
            assert!(err.message().contains("layout 0x0000000000000001)"), "{}", err.message());
            let err = c.join(iter(chunks(head(1, 0, s1), &[7.0, 7.0]))).await.unwrap_err();
            assert!(err.message().contains("without saying which part"), "{}", err.message());
            let again = c.join(iter(joining(head(1, 0, s1), &[7.0, 7.0]))).await.unwrap().into_inner();
            assert_eq!(again.round, 1, "the saved round");
            assert_eq!(pull(&mut c, 1, again.session).await, [0.0, 2.0], "the saved weights, not the joiner's");
        });
        let err = serve("127.0.0.1:0".parse().unwrap(), config(3, Some(dir.clone()))).err().unwrap().to_string();
        assert!(err.contains("2 groups") && err.contains("3 groups"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// Waits (up to 20 s) until `done` holds of the server's checkpoints.
    fn wait_for(server: &ServerHandle, what: &str, done: impl Fn(&Checkpoints) -> bool) -> Checkpoints {
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        loop {
            let now = server.checkpoints();
            if done(&now) {
                return now;
            }
            assert!(std::time::Instant::now() < deadline, "{what}: still {now:?}");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// A round due for a checkpoint whose save fails (a file where its folder should be)
    /// counts as unsaved: the keeper says why and tries again, and saves it once it can; a
    /// server that stops while its last rounds cannot be written fails its stop, naming the
    /// round and the folder.
    #[test]
    fn a_failed_save_is_tried_again_and_a_stop_that_cannot_save_fails() {
        let dir = std::env::temp_dir().join(format!("zt-ps-fail-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let round_of_two = |addr: SocketAddr| {
            runtime.block_on(async {
                let mut c = ParameterServerClient::connect(format!("http://{addr}")).await.unwrap();
                let a0 = c.join(iter(joining(head(0, 0, 0), &[1.0, 2.0]))).await.unwrap().into_inner();
                let a1 = c.join(iter(joining(head(1, 0, 0), &[1.0, 2.0]))).await.unwrap().into_inner();
                c.push(iter(chunks(head(0, 0, a0.session), &[0.5, 0.5]))).await.unwrap();
                c.push(iter(chunks(head(1, 0, a1.session), &[0.5, 0.5]))).await.unwrap();
            })
        };
        for every in [1, 100] {
            std::fs::write(&dir, b"not a folder").unwrap();
            let server = serve(
                "127.0.0.1:0".parse().unwrap(),
                ServerConfig { checkpoint_every: every, ..config(2, Some(dir.clone())) },
            )
            .unwrap();
            round_of_two(server.addr());
            if every == 1 {
                // Due at once: the keeper's save fails, is remembered, and succeeds once the
                // folder can be made.
                let failed = wait_for(&server, "the keeper's failed save", |c| c.failed.is_some());
                assert_eq!(failed.saved, 0);
                assert!(failed.failed.as_deref().unwrap().contains("the checkpoint of round 1 failed"), "{failed:?}");
                std::fs::remove_file(&dir).unwrap();
                let saved = wait_for(&server, "the keeper's retry", |c| c.saved == 1);
                assert_eq!(saved.failed, None);
                assert_eq!(zerotrain_checkpoint::list(&dir).unwrap().len(), 1);
                server.stop().unwrap();
                std::fs::remove_dir_all(&dir).unwrap();
            } else {
                // Not due: the stop's save fails, and so does the stop.
                let e = server.stop().unwrap_err().to_string();
                assert!(e.contains("the checkpoint of round 1 failed") && e.contains(&*dir.to_string_lossy()), "{e}");
                std::fs::remove_file(&dir).unwrap();
            }
        }
    }

    /// A crowd of connections that send nothing cannot hold a server: past its connection
    /// cap a new one is closed at once, a silent one is closed after the idle timeout, and
    /// a real caller that comes while the crowd holds every slot gets its answer once the
    /// silent ones have been dropped. (tonic alone kept every connection: about 250 of them
    /// at a limit of 128 descriptors made the server spin on `accept`.)
    #[test]
    fn silent_connections_are_capped_and_closed_and_a_real_caller_gets_through() {
        use std::io::Read;
        let idle = Duration::from_millis(400);
        let limits = super::super::incoming::Limits { max_connections: 4, idle_timeout: idle };
        let server = serve("127.0.0.1:0".parse().unwrap(), ServerConfig { limits, ..config(1, None) }).unwrap();
        let addr = server.addr();
        let crowd: Vec<std::net::TcpStream> = (0..4).map(|_| std::net::TcpStream::connect(addr).unwrap()).collect();
        // The server has taken the four (each is answered by its HTTP/2 preface) ...
        for mut c in &crowd {
            c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
            let mut preface = [0u8; 9];
            c.read_exact(&mut preface).unwrap();
        }
        // ... so a fifth is closed at once, with nothing said.
        let mut fifth = std::net::TcpStream::connect(addr).unwrap();
        fifth.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let mut rest = Vec::new();
        assert_eq!(fifth.read_to_end(&mut rest).map(|_| rest.len()).unwrap_or(0), 0, "closed without a word");
        // A real caller, while the silent four still hold every slot.
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let ack = runtime.block_on(async {
            let mut last = None;
            for _ in 0..50 {
                match ParameterServerClient::connect(format!("http://{addr}")).await {
                    Ok(mut c) => match c.join(iter(joining(head(0, 0, 0), &[1.0, 2.0]))).await {
                        Ok(ack) => return ack.into_inner(),
                        Err(e) => last = Some(e.to_string()),
                    },
                    Err(e) => last = Some(e.to_string()),
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            panic!("no answer: {last:?}");
        });
        assert_eq!(ack.live, 1);
        // The silent ones were closed for their silence.
        for mut c in crowd {
            let mut rest = Vec::new();
            let _ = c.read_to_end(&mut rest);
            let mut one = [0u8; 1];
            assert_eq!(c.read(&mut one).unwrap_or(0), 0, "closed");
        }
    }

    /// A stream that stops making progress gives its reservation back: two pushes that
    /// send the first of their two values and then nothing fill the budget (two vectors of
    /// the one place), and a real push still goes through once they have stalled for the
    /// group timeout (it waited for ever before).
    #[test]
    fn a_stalled_stream_gives_its_room_back() {
        let group_timeout = Duration::from_millis(300);
        let server = serve("127.0.0.1:0".parse().unwrap(), ServerConfig { group_timeout, ..config(1, None) }).unwrap();
        let addr = server.addr();
        let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
        runtime.block_on(async {
            let mut c = ParameterServerClient::connect(format!("http://{addr}")).await.unwrap();
            let ack = c.join(iter(joining(head(0, 0, 0), &[1.0, 2.0]))).await.unwrap().into_inner();
            let stalled: Vec<_> = (0..2)
                .map(|_| {
                    let mut first = chunks(head(0, 0, ack.session), &[0.5, 0.5]);
                    first[0].data.truncate(4);
                    let stream = iter(first).chain(tokio_stream::pending());
                    let mut c = c.clone();
                    tokio::spawn(async move { c.push(stream).await })
                })
                .collect();
            let real = c.push(iter(chunks(head(0, 0, ack.session), &[0.5, 0.5])));
            let pushed = tokio::time::timeout(Duration::from_secs(30), real).await.expect("the real push waited");
            assert_eq!(pushed.unwrap().into_inner().round, 1);
            for stalled in stalled {
                let err = stalled.await.unwrap().unwrap_err();
                assert_eq!(err.code(), tonic::Code::DeadlineExceeded, "{}", err.message());
            }
        });
        server.stop().unwrap();
    }
}
