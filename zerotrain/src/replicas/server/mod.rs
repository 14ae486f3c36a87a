//! Parameter servers for replica groups in separate jobs (the `servers` feature).
//!
//! A server ([`serve`]) holds, for every *place* (a rank's position inside its group, whose
//! shard of the global weights it is), the global weights and their outer optimizer. Each
//! job is one replica group (`local_sgd.group` of `local_sgd.groups`); each of its ranks
//! pushes its pseudo-gradient for a round and pulls the next round's global weights
//! ([`PlaceClient`], the across-jobs form of the in-job peer round). Transport: gRPC through
//! tonic (`proto/parameter_server.proto`): an established, streaming RPC stack on tokio,
//! whose HTTP/2 flow control and deadlines we need not write, tensors streamed in chunks of
//! [`CHUNK_ELEMS`] values (pseudo-gradients in `communication_data_type`, weights in f32),
//! so no message approaches gRPC's size limits.
//!
//! # Note: sync rounds, deterministic sums
//! A place moves to round `k + 1` once every group of its quorum has pushed round `k`; the
//! server then sums the pushes in group order (not arrival order) and divides by their
//! number, exactly as the in-job all-reduce does, so a job split across servers trains bit
//! for bit as the same groups in one job. Async places apply each push at once (the outer
//! module's Delayed Nesterov). Who is in the quorum, and when a group is dropped: the place
//! module's note. A push for another round than the group's, from a group outside
//! `0..groups`, or under a session that is over, is refused with a message naming them.
//!
//! # Note: failures
//! A worker retries a call the server did not answer (down, restarting) with backoff for up
//! to its timeout, then fails with the address. A server restarted from its checkpoint
//! (`zerotrain serve --checkpoint DIR`) knows no sessions: every worker's next call is
//! refused as not a member, and the worker joins again and continues from the checkpoint's
//! global weights, as a group dropped from the quorum does. Each place is its own quorum:
//! with several servers, or ranks stalled unevenly, the ranks of one group may rejoin at
//! different rounds (each place stays consistent, being one shard of the weights).

pub mod auth;
mod budget;
mod client;
pub mod incoming;
mod keeper;
mod parts;
mod place;
mod serve;
mod service;
mod store;
pub mod tls;

pub use client::PlaceClient;
pub use parts::ServerExchange;
pub use proto::Part;
pub use serve::{Checkpoints, ServerHandle, serve};

use std::path::PathBuf;
use std::time::Duration;

use proto::Dtype;
use zerotrain_precision::Precision;

use crate::config::{OuterOptimizer, ReplicaMode, ReplicaPlan};

/// What a server needs of the replica groups' plan, and where it saves.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// Groups `0..groups` may join.
    pub groups: usize,
    /// The outer optimizer.
    pub outer: OuterOptimizer,
    /// Sync or async rounds.
    pub mode: ReplicaMode,
    /// How long a group may keep the others waiting before it is dropped.
    pub group_timeout: Duration,
    /// Where the server saves (and at its start loads) its checkpoints; none: it does not.
    pub checkpoint: Option<PathBuf>,
    /// Rounds between checkpoints (async: pushes of every group, `groups` per round).
    pub checkpoint_every: u64,
    /// The pseudo-gradients' dtype on the wire (`communication_data_type`): sync rounds
    /// round their sum to it.
    pub comm_dtype: Precision,
    /// The secret every call must carry ([`auth`]); none: anyone may call.
    pub token: Option<auth::Token>,
    /// The identity the server presents over TLS ([`tls::identity`]); none: plain TCP.
    pub tls: Option<tonic::transport::ServerTlsConfig>,
    /// The connections it accepts at a time, and how long one may stay silent.
    pub limits: incoming::Limits,
}

impl ServerConfig {
    /// The server of `plan`'s groups, saving into `checkpoint` if given, without a token
    /// or TLS (see `token` and `tls`).
    pub fn new(plan: &ReplicaPlan, checkpoint: Option<PathBuf>) -> Self {
        Self {
            groups: plan.groups,
            outer: plan.outer,
            mode: plan.mode,
            group_timeout: plan.group_timeout,
            checkpoint,
            checkpoint_every: plan.checkpoint_every,
            comm_dtype: plan.comm_dtype,
            token: None,
            tls: None,
            limits: incoming::Limits::for_this_process(),
        }
    }
}

impl ServerConfig {
    /// The settings a join's answer carries, for the joiner to check against its own.
    pub(super) fn settings(&self) -> proto::Settings {
        let (asynchronous, max_staleness) = match self.mode {
            ReplicaMode::Sync => (false, 0),
            ReplicaMode::Async { max_staleness } => (true, max_staleness),
        };
        proto::Settings {
            groups: self.groups as u32,
            outer_lr: self.outer.lr,
            outer_momentum: self.outer.momentum,
            outer_nesterov: self.outer.nesterov,
            asynchronous,
            max_staleness,
            group_timeout_s: self.group_timeout.as_secs_f64(),
            checkpoint_every: self.checkpoint_every,
            communication_data_type: format!("{:?}", self.comm_dtype).to_lowercase(),
        }
    }
}

/// The generated gRPC code.
#[allow(missing_docs, clippy::all, clippy::pedantic)]
mod proto {
    tonic::include_proto!("zerotrain.ps");
}

impl Part {
    /// How the part of `len` values reads in a message: `part 1 of 2 (values 50..100 of a
    /// shard of 100, layout 0x...)`; parts count from 0, as `local_sgd.servers` lists them.
    fn describe(&self, len: u64) -> String {
        format!(
            "part {} of {} (values {}..{} of a shard of {}, layout {:#018x})",
            self.index,
            self.count,
            self.offset,
            self.offset + len,
            self.shard_len,
            self.layout
        )
    }
}

/// Values per streamed chunk (256 KiB of f32: under the 1 MiB above which the `zerotrain`
/// command has the allocator map fresh pages, so chunks reuse the heap).
pub const CHUNK_ELEMS: usize = 1 << 16;

/// What every chunk of one streamed vector carries besides its values.
#[derive(Debug, Clone, Copy)]
struct Header {
    place: u32,
    group: u32,
    round: u64,
    session: u64,
    dtype: Dtype,
}

/// `values` as chunks under `head`, encoded in its dtype.
fn chunks(head: Header, values: &[f32]) -> Vec<proto::Chunk> {
    (0..chunk_count(values.len())).map(|i| piece(head, values, i)).collect()
}

/// [`chunks`] as a stream that encodes each chunk when it is sent.
fn chunk_stream(
    head: Header,
    values: std::sync::Arc<Vec<f32>>,
) -> impl tokio_stream::Stream<Item = proto::Chunk> + Send + 'static {
    tokio_stream::iter((0..chunk_count(values.len())).map(move |i| piece(head, &values, i)))
}

/// How many chunks a vector of `len` values goes in (an empty one: one empty chunk).
fn chunk_count(len: usize) -> usize {
    len.div_ceil(CHUNK_ELEMS).max(1)
}

/// Chunk `i` of `values`.
fn piece(head: Header, values: &[f32], i: usize) -> proto::Chunk {
    let offset = (i * CHUNK_ELEMS).min(values.len());
    let part = &values[offset..(offset + CHUNK_ELEMS).min(values.len())];
    proto::Chunk {
        place: head.place,
        group: head.group,
        round: head.round,
        session: head.session,
        dtype: head.dtype as i32,
        len: values.len() as u64,
        offset: offset as u64,
        data: encode(head.dtype, part),
        part: None,
        at_least: 0,
    }
}

fn encode(dtype: Dtype, values: &[f32]) -> Vec<u8> {
    match dtype {
        Dtype::Fp32 => values.iter().flat_map(|v| v.to_le_bytes()).collect(),
        Dtype::Bf16 => values.iter().flat_map(|&v| half::bf16::from_f32(v).to_le_bytes()).collect(),
    }
}

/// Places `chunk` of a stream into `values`: it must start at `next`, where the previous
/// one ended (pushes, joins and pulls alike: a stream covers its vector in order, so
/// nothing of a reused buffer's old values survives). Returns where the next one starts.
fn place_in_order(chunk: &proto::Chunk, values: &mut [f32], next: usize) -> Result<usize, tonic::Status> {
    if chunk.offset != next as u64 {
        return Err(tonic::Status::invalid_argument(format!("a chunk at {} where {next} was next", chunk.offset)));
    }
    Ok(next + place_chunk(chunk, values).map_err(tonic::Status::invalid_argument)?)
}

/// Writes a chunk's values into `out` (of the chunk's `len`), checking its bounds; returns
/// how many it wrote.
fn place_chunk(chunk: &proto::Chunk, out: &mut [f32]) -> Result<usize, String> {
    let dtype = Dtype::try_from(chunk.dtype).map_err(|_| format!("unknown dtype {}", chunk.dtype))?;
    let width = match dtype {
        Dtype::Fp32 => 4,
        Dtype::Bf16 => 2,
    };
    if chunk.len != out.len() as u64 || !chunk.data.len().is_multiple_of(width) {
        return Err(format!("a chunk of {} elements for a vector of {}", chunk.len, out.len()));
    }
    let start = usize::try_from(chunk.offset).map_err(|_| "chunk offset too large".to_string())?;
    let n = chunk.data.len() / width;
    let end = start.checked_add(n).filter(|&e| e <= out.len()).ok_or("a chunk past the vector's end")?;
    let out = &mut out[start..end];
    match dtype {
        Dtype::Fp32 => {
            for (v, b) in out.iter_mut().zip(chunk.data.chunks_exact(4)) {
                *v = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            }
        }
        Dtype::Bf16 => {
            for (v, b) in out.iter_mut().zip(chunk.data.chunks_exact(2)) {
                *v = half::bf16::from_le_bytes([b[0], b[1]]).to_f32();
            }
        }
    }
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::{Dtype, Header, chunks, place_in_order};

    /// A stream's chunks go in only in order: each where the last ended, none repeated,
    /// skipped or past the end, and a cut stream ends short of its length.
    #[test]
    fn chunks_go_in_only_in_order() {
        let head = Header { place: 0, group: 0, round: 0, session: 0, dtype: Dtype::Fp32 };
        let values: Vec<f32> = (0..super::CHUNK_ELEMS * 2 + 3).map(|i| i as f32).collect();
        let stream = chunks(head, &values);
        assert_eq!(stream.len(), 3);
        let mut out = vec![0.0; values.len()];
        let mut next = 0;
        for chunk in &stream {
            next = place_in_order(chunk, &mut out, next).unwrap();
        }
        assert_eq!((next, &out), (values.len(), &values));
        for (order, at) in [([0, 0], super::CHUNK_ELEMS), ([1, 0], 0), ([0, 2], super::CHUNK_ELEMS)] {
            let first = place_in_order(&stream[order[0]], &mut out, 0);
            let second = first.and_then(|next| place_in_order(&stream[order[1]], &mut out, next));
            let e = second.unwrap_err();
            assert!(e.message().contains(&format!("where {at} was next")), "{order:?}: {}", e.message());
        }
    }
}
