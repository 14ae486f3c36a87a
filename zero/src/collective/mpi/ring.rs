//! Reduce-scatter over MPI as a ring.
//!
//! # Note: reduce-scatter
//! OpenMPI's nonblocking reduce-scatter (libnbc) reduces towards some ranks through
//! temporary buffers of the whole input: at 4 ranks rank 0 held two extra copies and rank
//! 2 one, a peak the others did not have. Reduce-scatter here is a ring of nonblocking
//! sends and receives instead: every rank holds two chunks besides its buffers, and moves
//! the same `(N-1)/N` of the buffer as any bandwidth-optimal algorithm.

use mpi::request::scope;
use mpi::traits::*;

use super::MpiComm;
use super::half::COLLECTIVE_TAG;
use crate::ZeroError;
use crate::collective::{OpKind, ReduceOp};

impl MpiComm {
    /// A ring of f32 buffers (see the module note on reduce-scatter): `N - 1` steps, each
    /// sending one chunk to the next rank and adding the chunk received from the previous
    /// one. (16-bit buffers go through `half`.)
    pub(super) fn reduce_scatter_ring(&self, input: &[f32], acc: &mut [f32], op: ReduceOp) -> Result<(), ZeroError> {
        let (n, r, c) = (self.size, self.rank, acc.len());
        let chunk = |k: usize| &input[k * c..(k + 1) * c];
        // The partial sum this rank passes on, accumulated in the output: first its own
        // part of chunk r - 1.
        acc.copy_from_slice(chunk((r + n - 1) % n));
        let mut received = vec![0.0f32; c];
        let next = self.world.process_at_rank(((r + 1) % n) as i32);
        let previous = self.world.process_at_rank(((r + n - 1) % n) as i32);
        for step in 0..n - 1 {
            scope(|s| {
                let receive = previous.immediate_receive_into_with_tag(s, &mut received[..], COLLECTIVE_TAG);
                let send = next.immediate_send_with_tag(s, &acc[..], COLLECTIVE_TAG);
                self.complete(OpKind::ReduceScatter, receive);
                self.complete(OpKind::ReduceScatter, send);
            });
            // The received partial is of chunk r - 2 - step; add this rank's part of it.
            let mine = chunk((r + 2 * n - 2 - step) % n);
            for ((a, &theirs), &x) in acc.iter_mut().zip(&received).zip(mine) {
                *a = op.apply(theirs, x);
            }
        }
        // After N - 1 steps the partial is chunk r, summed over every rank.
        self.record(OpKind::ReduceScatter, input.len(), 4, 0);
        Ok(())
    }
}
