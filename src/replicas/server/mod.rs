//! Parameter servers for replica groups in separate jobs (the `servers` feature).
//!
//! A server ([`serve`]) holds, for every *place* (a rank's position inside its group, whose
//! shard of the global weights it is), the global weights and their outer optimizer. Each
//! job is one replica group (`local_sgd.group` of `local_sgd.groups`); each of its ranks
//! pushes its pseudo-gradient for a round and pulls the next round's global weights
//! ([`ServerRound`], the across-jobs form of the in-job peer round). Transport: gRPC through
//! tonic (`proto/parameter_server.proto`), tensors streamed in chunks of
//! [`CHUNK_ELEMS`] f32 values, so no message approaches gRPC's size limits.
//!
//! # Note: sync rounds, deterministic sums
//! A place moves to round `k + 1` once every group has pushed round `k`; the server then
//! sums the pushes in group order (not arrival order) and divides by the groups, exactly as
//! the in-job all-reduce does, so a job split across servers trains bit for bit as the same
//! groups in one job. A push for any round but the place's current one, or from a group
//! outside `0..groups`, is refused with a message naming both.

mod client;
mod serve;

pub use client::ServerRound;
pub use serve::{ServerHandle, serve};

/// The generated gRPC code.
#[allow(missing_docs, clippy::all, clippy::pedantic)]
mod proto {
    tonic::include_proto!("zerotrain.ps");
}

/// f32 values per streamed chunk (1 MiB).
pub const CHUNK_ELEMS: usize = 1 << 18;

/// `values` as chunks of `place`, `group`, `round`.
fn chunks(place: u32, group: u32, round: u64, values: &[f32]) -> Vec<proto::Chunk> {
    let len = values.len() as u64;
    let piece = |offset: usize, part: &[f32]| proto::Chunk {
        place,
        group,
        round,
        len,
        offset: offset as u64,
        data: part.iter().flat_map(|v| v.to_le_bytes()).collect(),
    };
    if values.is_empty() {
        return vec![piece(0, &[])];
    }
    values.chunks(CHUNK_ELEMS).enumerate().map(|(i, part)| piece(i * CHUNK_ELEMS, part)).collect()
}

/// Writes a chunk's values into `out` (of the chunk's `len`), checking its bounds.
fn place_chunk(chunk: &proto::Chunk, out: &mut [f32]) -> Result<(), String> {
    if chunk.len != out.len() as u64 || !chunk.data.len().is_multiple_of(4) {
        return Err(format!("a chunk of {} elements for a vector of {}", chunk.len, out.len()));
    }
    let start = usize::try_from(chunk.offset).map_err(|_| "chunk offset too large".to_string())?;
    let n = chunk.data.len() / 4;
    let end = start.checked_add(n).filter(|&e| e <= out.len()).ok_or("a chunk past the vector's end")?;
    for (v, b) in out[start..end].iter_mut().zip(chunk.data.chunks_exact(4)) {
        *v = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
    }
    Ok(())
}
