//! Activations and their gradients between pipeline stages: one header message, then each
//! part's values in its own dtype.
//!
//! # Note: the header
//! A header is integers: a magic word, then per part the dtype code, the rank and each
//! dimension as two 32-bit words (low, high), `MAX_DIMS` dimensions reserved. The
//! collectives move f32 buffers, so each word travels as the f32 with its bit pattern
//! (`f32::from_bits`); nothing on the way does arithmetic on them, so every bit arrives.
//! The receiver knows how many parts its activation type has, so the header's length is
//! known before it arrives.

use zerotrain_precision::{FlatBuf, Precision};
use zerotrain_zero::{Collective, Pending, Request};

use crate::{Error, Result};

/// Dimensions a part may have.
const MAX_DIMS: usize = 8;
/// Header words per part: dtype, rank, and two words per dimension.
const PART_WORDS: usize = 2 + 2 * MAX_DIMS;
/// The first header word.
const MAGIC: u32 = 0x7A70_6970; // "zpip"
/// Most elements one part may claim (a garbled header must not allocate without bound).
const MAX_PART_ELEMS: u64 = 1 << 40;

/// The parts of an activation as they travel: each part's dtype and shape.
pub(super) type Shapes = Vec<(Precision, Vec<usize>)>;

/// Header words for `parts` parts.
pub(super) fn header_len(parts: usize) -> usize {
    1 + parts * PART_WORDS
}

fn code(dtype: Precision) -> u32 {
    match dtype {
        Precision::Fp32 => 0,
        Precision::Fp16 => 1,
        Precision::Bf16 => 2,
    }
}

/// The header describing `parts`.
fn encode(parts: &[(FlatBuf, Vec<usize>)]) -> Result<Vec<f32>> {
    let mut words = vec![MAGIC];
    for (values, shape) in parts {
        if shape.len() > MAX_DIMS {
            return Err(Error::Model(format!("activations of rank {} cannot pass between stages", shape.len())));
        }
        let mut part = vec![0u32; PART_WORDS];
        part[0] = code(values.dtype());
        part[1] = shape.len() as u32;
        for (d, &dim) in shape.iter().enumerate() {
            let dim = dim as u64;
            (part[2 + 2 * d], part[3 + 2 * d]) = (dim as u32, (dim >> 32) as u32);
        }
        words.extend(part);
    }
    Ok(words.into_iter().map(f32::from_bits).collect())
}

/// Each part's (dtype, shape) from a header, checked.
fn decode(header: &[f32], from: usize) -> Result<Shapes> {
    let words: Vec<u32> = header.iter().map(|w| w.to_bits()).collect();
    let garbled = |what: String| Error::Model(format!("a garbled activation header from stage {from}: {what}"));
    if words.first() != Some(&MAGIC) {
        return Err(garbled("no magic word".into()));
    }
    words[1..]
        .chunks_exact(PART_WORDS)
        .map(|part| {
            let dtype = match part[0] {
                0 => Precision::Fp32,
                1 => Precision::Fp16,
                2 => Precision::Bf16,
                other => return Err(garbled(format!("dtype code {other}"))),
            };
            let rank = part[1] as usize;
            if rank > MAX_DIMS {
                return Err(garbled(format!("rank {rank}")));
            }
            let dims: Vec<u64> =
                (0..rank).map(|d| u64::from(part[2 + 2 * d]) | u64::from(part[3 + 2 * d]) << 32).collect();
            let elems = dims.iter().try_fold(1u64, |n, &d| n.checked_mul(d)).filter(|&n| n <= MAX_PART_ELEMS);
            elems.ok_or_else(|| garbled(format!("shape {dims:?}")))?;
            Ok((dtype, dims.into_iter().map(|d| d as usize).collect()))
        })
        .collect()
}

/// Sends `parts` to rank `to` of `pipe`; returns the sends in flight.
pub(super) fn send(pipe: &dyn Collective, parts: Vec<(FlatBuf, Vec<usize>)>, to: usize) -> Result<Vec<Pending>> {
    let mut sends = vec![pipe.start(Request::Send { buf: FlatBuf::F32(encode(&parts)?), to })];
    sends.extend(parts.into_iter().map(|(buf, _)| pipe.start(Request::Send { buf, to })));
    Ok(sends)
}

/// Receives `num_parts` parts from rank `from` of `pipe`.
pub(super) fn recv(pipe: &dyn Collective, num_parts: usize, from: usize) -> Result<Vec<(FlatBuf, Vec<usize>)>> {
    let mut header = vec![0.0f32; header_len(num_parts)];
    pipe.recv((&mut header).into(), from)?;
    let mut parts = Vec::with_capacity(num_parts);
    for (dtype, shape) in decode(&header, from)? {
        let mut values = FlatBuf::zeros(dtype, shape.iter().product());
        pipe.recv(values.as_mut(), from)?;
        parts.push((values, shape));
    }
    Ok(parts)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_carry_shapes_beyond_f32s_exact_integers_and_refuse_garbage() {
        let big = (1usize << 24) + 1; // not an f32 integer
        let parts =
            vec![(FlatBuf::zeros(Precision::Bf16, 0), vec![3, big, 0]), (FlatBuf::zeros(Precision::Fp32, 0), vec![])];
        let header = encode(&parts).unwrap();
        assert_eq!(header.len(), header_len(2));
        let decoded = decode(&header, 1).unwrap();
        assert_eq!(decoded, vec![(Precision::Bf16, vec![3, big, 0]), (Precision::Fp32, vec![])]);
        let mut bad = header.clone();
        bad[0] = 1.0;
        assert!(decode(&bad, 1).unwrap_err().to_string().contains("from stage 1: no magic word"));
        let mut huge = header;
        huge[1 + 2] = f32::from_bits(u32::MAX);
        huge[1 + 3] = f32::from_bits(u32::MAX);
        assert!(decode(&huge, 2).unwrap_err().to_string().contains("shape"));
        let deep = vec![(FlatBuf::zeros(Precision::Fp32, 0), vec![1; MAX_DIMS + 1])];
        assert!(encode(&deep).is_err());
    }
}
