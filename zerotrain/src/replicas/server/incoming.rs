//! The connections a parameter server accepts: at most [`Limits::max_connections`] at a
//! time, each closed once its client has sent nothing for [`Limits::idle_timeout`].
//!
//! # Note: why the server limits connections itself
//! tonic accepts every connection it can and keeps each until its client hangs up. A
//! client that opens connections and sends nothing holds a descriptor each: at the
//! process's descriptor limit `accept` fails at once, again and again, and the server spins
//! on it while real callers wait (measured: about 250 idle connections at a limit of 128
//! delayed a real call 2.9 s). So the server accepts through its own loop: beyond the cap it
//! closes a new connection at once (its descriptor comes back), an `accept` that fails backs
//! off instead of spinning, and a connection whose client has sent nothing for the idle
//! timeout is closed. Real clients are never idle that long: HTTP/2 keep-alive pings from
//! the server (every [`KEEPALIVE`]) are answered by the client's HTTP/2 stack, also while
//! it waits in a long pull.

use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::time::{Instant, Sleep};
use tokio_stream::Stream;

/// How often the server pings each connection (HTTP/2 keep-alive).
pub const KEEPALIVE: Duration = Duration::from_secs(20);

/// How long `accept` waits after failing (the descriptor limit reached, say) before trying
/// again.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(50);

/// What a server accepts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Connections open at a time.
    pub max_connections: usize,
    /// A connection whose client has sent nothing for this long is closed.
    pub idle_timeout: Duration,
}

impl Limits {
    /// A quarter of the process's descriptor limit (at most 4,096, at least 16), and an idle
    /// timeout of four keep-alive intervals.
    pub fn for_this_process() -> Self {
        let mut limit = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
        // SAFETY: getrlimit writes the struct it is given and reads nothing else.
        let known = unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } == 0;
        let descriptors = if known { limit.rlim_cur } else { 1024 };
        let max_connections = usize::try_from(descriptors / 4).unwrap_or(4096).clamp(16, 4096);
        Self { max_connections, idle_timeout: KEEPALIVE * 4 }
    }
}

/// The accepted connections of `listener`, as tonic's `serve_with_incoming` takes them: a
/// task of the runtime accepts them, and ends when the stream is dropped.
pub fn accept(listener: TcpListener, limits: Limits) -> impl Stream<Item = io::Result<Connection>> {
    let (sender, receiver) = tokio::sync::mpsc::channel(1);
    let live = Arc::new(AtomicUsize::new(0));
    tokio::spawn(async move {
        loop {
            let stream = match listener.accept().await {
                Ok((stream, _)) => stream,
                Err(_) => {
                    tokio::time::sleep(ACCEPT_BACKOFF).await;
                    continue;
                }
            };
            if live.load(Ordering::Relaxed) >= limits.max_connections {
                drop(stream); // closed at once: its descriptor comes back
                continue;
            }
            // Without TCP_NODELAY a round's small messages wait out delayed ACKs (~40 ms).
            let _ = stream.set_nodelay(true);
            live.fetch_add(1, Ordering::Relaxed);
            let idle = limits.idle_timeout;
            let deadline = Box::pin(tokio::time::sleep(idle));
            let connection = Connection { stream, live: Arc::clone(&live), idle, deadline };
            if sender.send(Ok(connection)).await.is_err() {
                return; // the server is gone
            }
        }
    });
    tokio_stream::wrappers::ReceiverStream::new(receiver)
}

/// An accepted connection: counted while open, and failing its reads (which closes it)
/// once its client has sent nothing for the idle timeout.
pub struct Connection {
    stream: TcpStream,
    live: Arc<AtomicUsize>,
    idle: Duration,
    deadline: Pin<Box<Sleep>>,
}

impl Drop for Connection {
    fn drop(&mut self) {
        self.live.fetch_sub(1, Ordering::Relaxed);
    }
}

impl tonic::transport::server::Connected for Connection {
    type ConnectInfo = tonic::transport::server::TcpConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.stream.connect_info()
    }
}

impl AsyncRead for Connection {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        match Pin::new(&mut self.stream).poll_read(cx, buf) {
            Poll::Ready(Ok(())) if buf.filled().len() > before => {
                let next = Instant::now() + self.idle;
                self.deadline.as_mut().reset(next);
                Poll::Ready(Ok(()))
            }
            Poll::Pending => match self.deadline.as_mut().poll(cx) {
                Poll::Ready(()) => Poll::Ready(Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "the client sent nothing for the idle timeout",
                ))),
                Poll::Pending => Poll::Pending,
            },
            other => other,
        }
    }
}

impl AsyncWrite for Connection {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }
}
