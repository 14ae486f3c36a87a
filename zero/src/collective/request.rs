//! Collectives that own their buffers, so that they can run while the caller computes:
//! [`Request`] goes in through [`Collective::start`], a [`Pending`] comes out, and
//! [`Pending::wait`] gives the buffers back with the result ([`Completed`]).
//!
//! A backend without a thread of its own runs the request at once inside `start` (the
//! trait's default), so every caller can use the same code whether or not the collective
//! overlaps with anything: [`CommThread`](super::CommThread) is what makes it asynchronous.

use std::sync::mpsc::{Receiver, TryRecvError};
use std::time::{Duration, Instant};

use zerotrain_precision::{FlatBuf, Precision};

use super::{Collective, ReduceOp};
use crate::ZeroError;

/// A collective call with the buffers it reads and writes.
#[derive(Debug)]
pub enum Request {
    /// [`Collective::all_reduce`] of `buf`, in place.
    AllReduce {
        /// Reduced in place.
        buf: FlatBuf,
        /// How values combine.
        op: ReduceOp,
    },
    /// [`Collective::reduce_scatter`] of `input` into `output` (`input.len() / N` long).
    ReduceScatter {
        /// This rank's contribution, `world_size` chunks.
        input: FlatBuf,
        /// Receives this rank's reduced chunk.
        output: FlatBuf,
        /// How values combine.
        op: ReduceOp,
    },
    /// [`Collective::all_gather`] of every rank's `input` into `output`.
    AllGather {
        /// This rank's chunk.
        input: FlatBuf,
        /// Receives every rank's chunk, in rank order.
        output: FlatBuf,
    },
    /// [`Collective::send`] of `buf` to rank `to`.
    Send {
        /// The message.
        buf: FlatBuf,
        /// The receiving rank.
        to: usize,
    },
    /// [`Collective::recv`] into `buf` from rank `from`.
    Recv {
        /// Receives the message (its length and dtype).
        buf: FlatBuf,
        /// The sending rank.
        from: usize,
    },
}

impl Request {
    /// Runs the request on `comm`, blocking, and returns its result. The input buffer is
    /// dropped as soon as the collective is done, on the thread that ran it, so a finished
    /// request nobody has waited for yet holds only its output.
    pub fn run<C: Collective + ?Sized>(self, comm: &C) -> Result<Completed, ZeroError> {
        let start = Instant::now();
        let output = match self {
            Self::AllReduce { mut buf, op } => {
                comm.all_reduce(buf.as_mut(), op)?;
                buf
            }
            Self::ReduceScatter { input, mut output, op } => {
                comm.reduce_scatter(input.as_ref(), output.as_mut(), op)?;
                output
            }
            Self::AllGather { input, mut output } => {
                comm.all_gather(input.as_ref(), output.as_mut())?;
                output
            }
            Self::Send { buf, to } => {
                comm.send(buf.as_ref(), to)?;
                FlatBuf::zeros(buf.dtype(), 0)
            }
            Self::Recv { mut buf, from } => {
                comm.recv(buf.as_mut(), from)?;
                buf
            }
        };
        Ok(Completed { output, busy: start.elapsed() })
    }

    /// Bytes of every buffer the request holds.
    pub fn bytes(&self) -> u64 {
        match self {
            Self::AllReduce { buf, .. } | Self::Send { buf, .. } | Self::Recv { buf, .. } => buf.bytes(),
            Self::ReduceScatter { input, output, .. } | Self::AllGather { input, output } => {
                input.bytes() + output.bytes()
            }
        }
    }
}

/// A finished request.
#[derive(Debug)]
pub struct Completed {
    /// The result: the all-reduced buffer, the output of a reduce-scatter or all-gather,
    /// the received message (empty for a send).
    pub output: FlatBuf,
    /// How long the collective itself ran (on whichever thread ran it).
    pub busy: Duration,
}

impl Completed {
    /// A request that gave nothing back (a send; a call on device buffers), its time not
    /// measured.
    pub fn empty(dtype: Precision) -> Self {
        Self { output: FlatBuf::zeros(dtype, 0), busy: Duration::ZERO }
    }
}

/// A request in flight. Dropping it without [`wait`](Self::wait) lets it finish unobserved.
#[derive(Debug)]
pub struct Pending {
    state: State,
}

#[derive(Debug)]
enum State {
    Done(Result<Completed, ZeroError>),
    Running(Receiver<Result<Completed, ZeroError>>),
}

impl Pending {
    /// A request that has already run.
    pub fn ready(result: Result<Completed, ZeroError>) -> Self {
        Self { state: State::Done(result) }
    }

    /// A request whose result arrives on `receiver` (dropping its sender without sending
    /// means the thread running it died).
    pub fn running(receiver: Receiver<Result<Completed, ZeroError>>) -> Self {
        Self { state: State::Running(receiver) }
    }

    /// Whether [`wait`](Self::wait) would return without blocking.
    pub fn is_done(&mut self) -> bool {
        let State::Running(receiver) = &self.state else { return true };
        match receiver.try_recv() {
            Ok(result) => {
                self.state = State::Done(result);
                true
            }
            Err(TryRecvError::Empty) => false,
            Err(TryRecvError::Disconnected) => {
                self.state = State::Done(Err(thread_died()));
                true
            }
        }
    }

    /// Blocks until the request has run; returns it, or its error.
    pub fn wait(self) -> Result<Completed, ZeroError> {
        match self.state {
            State::Done(result) => result,
            State::Running(receiver) => receiver.recv().unwrap_or_else(|_| Err(thread_died())),
        }
    }
}

fn thread_died() -> ZeroError {
    ZeroError::CommThread(
        "it stopped before finishing a request (it panicked, or its collective failed to start)".into(),
    )
}
