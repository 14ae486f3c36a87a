//! Reductions of 16-bit buffers over MPI.
//!
//! # Note: half precision over MPI
//! MPI has no 16-bit float sum. Reductions of f16/bf16 buffers still travel as 16 bits:
//! each rank sends every peer the peer's chunk as raw 16-bit patterns, and sums the chunks
//! it receives widened to f32, in rank order 0, 1, ..., N-1, rounding once, exactly as the
//! threads backend combines them: the same bits on either backend, and half the bytes of
//! f32. Reduce-scatter is that exchange; all-reduce is that exchange over `N` near-equal
//! chunks, then every rank sends its reduced chunk to every peer. Each rank moves
//! `(N-1)/N` (reduce-scatter) or `2(N-1)/N` (all-reduce) of the buffer's 16-bit bytes, the
//! ring algorithms' volume, and holds the received chunks at once (a bucket's worth).
//!
//! The messages carry [`COLLECTIVE_TAG`], so that they never match the program's own
//! point-to-point messages on the same communicator (the ring reduce-scatter's carry it too).

use std::ops::Range;

use mpi::request::scope;
use mpi::traits::*;
use zerotrain_precision::half::{bf16, f16};
use zerotrain_precision::{BufMut, BufRef, Precision};

use super::MpiComm;
use crate::ZeroError;
use crate::collective::{OpKind, ReduceOp, chunk_range};

/// The tag of the point-to-point messages collectives exchange (the program's own
/// messages use `p2p::POINT_TO_POINT_TAG`).
pub(super) const COLLECTIVE_TAG: i32 = 0x7a74;

/// A 16-bit dtype's widening and rounding.
#[derive(Clone, Copy)]
struct Half(Precision);

impl Half {
    fn widen(self, bits: u16) -> f32 {
        match self.0 {
            Precision::Fp16 => f16::from_bits(bits).to_f32(),
            _ => bf16::from_bits(bits).to_f32(),
        }
    }

    fn round(self, value: f32) -> u16 {
        match self.0 {
            Precision::Fp16 => f16::from_f32(value).to_bits(),
            _ => bf16::from_f32(value).to_bits(),
        }
    }
}

impl MpiComm {
    /// Reduce-scatter of a 16-bit `input` (`N` chunks of `output.len()`) into `output`
    /// (module note).
    pub(super) fn reduce_scatter_half(
        &self,
        input: BufRef<'_>,
        mut output: BufMut<'_>,
        op: ReduceOp,
    ) -> Result<(), ZeroError> {
        let c = output.len();
        let half = Half(input.dtype());
        let ranges: Vec<Range<usize>> = (0..self.size).map(|k| k * c..(k + 1) * c).collect();
        let reduced = self.exchange_and_reduce(&super::bits(input), &ranges, half, op)?;
        super::from_bits(&reduced, output.reborrow());
        self.record(OpKind::ReduceScatter, c * self.size, 2, 0);
        Ok(())
    }

    /// All-reduce of a 16-bit `buf` in place (module note).
    pub(super) fn all_reduce_half(&self, mut buf: BufMut<'_>, op: ReduceOp) -> Result<(), ZeroError> {
        let len = buf.len();
        let half = Half(buf.dtype());
        let ranges: Vec<Range<usize>> = (0..self.size).map(|k| chunk_range(len, self.size, k)).collect();
        let mut all = super::bits(super::as_ref(&buf));
        let mine = self.exchange_and_reduce(&all, &ranges, half, op)?;
        all[ranges[self.rank].clone()].copy_from_slice(&mine);
        self.exchange_chunks(&mut all, &ranges)?;
        super::from_bits(&all, buf.reborrow());
        self.record(OpKind::AllReduce, len, 2, 0);
        Ok(())
    }

    /// Sends chunk `ranges[k]` of `bits` to every peer `k`, receives chunk `ranges[rank]` of
    /// every peer's, and returns their `op`-combination in rank order, widened and rounded
    /// once.
    fn exchange_and_reduce(
        &self,
        bits: &[u16],
        ranges: &[Range<usize>],
        half: Half,
        op: ReduceOp,
    ) -> Result<Vec<u16>, ZeroError> {
        let (n, mine) = (self.size, ranges[self.rank].clone());
        let mut received = vec![0u16; mine.len() * n];
        received[self.rank * mine.len()..(self.rank + 1) * mine.len()].copy_from_slice(&bits[mine.clone()]);
        let outgoing: Vec<&[u16]> = ranges.iter().map(|r| &bits[r.clone()]).collect();
        self.exchange(&outgoing, tile(&mut received, &vec![mine.len(); n]), OpKind::ReduceScatter);
        let chunk = |k: usize| &received[k * mine.len()..(k + 1) * mine.len()];
        let mut acc: Vec<f32> = chunk(0).iter().map(|&b| half.widen(b)).collect();
        for k in 1..n {
            acc.iter_mut().zip(chunk(k)).for_each(|(a, &b)| *a = op.apply(*a, half.widen(b)));
        }
        Ok(acc.into_iter().map(|a| half.round(a)).collect())
    }

    /// Sends this rank's chunk of `bits` to every peer and receives every peer's chunk in
    /// place (an all-gather of near-equal chunks).
    fn exchange_chunks(&self, bits: &mut [u16], ranges: &[Range<usize>]) -> Result<(), ZeroError> {
        let mine: Vec<u16> = bits[ranges[self.rank].clone()].to_vec();
        let lens: Vec<usize> = ranges.iter().map(Range::len).collect();
        self.exchange(&vec![&mine[..]; self.size], tile(bits, &lens), OpKind::AllReduce);
        Ok(())
    }

    /// Sends `outgoing[k]` to every peer `k` and receives peer `k`'s message into
    /// `incoming[k]`, all at once (this rank's own slots, and empty ones, are skipped).
    fn exchange(&self, outgoing: &[&[u16]], incoming: Vec<&mut [u16]>, kind: OpKind) {
        let r = self.rank;
        scope(|s| {
            let mut requests = Vec::with_capacity(2 * self.size);
            for (k, slot) in incoming.into_iter().enumerate().filter(|(k, slot)| *k != r && !slot.is_empty()) {
                let from = self.world.process_at_rank(k as i32);
                requests.push(from.immediate_receive_into_with_tag(s, slot, COLLECTIVE_TAG));
            }
            for (k, message) in outgoing.iter().enumerate().filter(|(k, m)| *k != r && !m.is_empty()) {
                let to = self.world.process_at_rank(k as i32);
                requests.push(to.immediate_send_with_tag(s, *message, COLLECTIVE_TAG));
            }
            requests.into_iter().for_each(|request| self.complete(kind, request));
        });
    }
}

/// `bits` cut into consecutive slices of `lens` (which sum to at most its length).
fn tile<'a>(mut bits: &'a mut [u16], lens: &[usize]) -> Vec<&'a mut [u16]> {
    lens.iter()
        .map(|&len| {
            let (slot, rest) = std::mem::take(&mut bits).split_at_mut(len);
            bits = rest;
            slot
        })
        .collect()
}
