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
use zerotrain_precision::{BufMut, BufRef, FlatElem, with_elem};

use super::MpiComm;
use crate::ZeroError;
use crate::collective::{OpKind, ReduceOp};

impl MpiComm {
    /// A ring (see the module note on reduce-scatter): `N - 1` steps, each sending one
    /// chunk to the next rank and adding the chunk received from the previous one.
    pub(super) fn reduce_scatter_ring(
        &self,
        input: BufRef<'_>,
        mut output: BufMut<'_>,
        op: ReduceOp,
    ) -> Result<(), ZeroError> {
        self.check(OpKind::ReduceScatter)?;
        self.check_shapes(OpKind::ReduceScatter, output.len(), input.len(), input.dtype() == output.dtype())?;
        let (n, r, c) = (self.size, self.rank, output.len());
        let chunk = |k: usize| input.slice(k * c..(k + 1) * c);
        // The partial sum this rank passes on, in f32 (the output itself when it is f32):
        // first its own part of chunk r - 1.
        let mut widened = Vec::new();
        let acc: &mut [f32] = match &mut output {
            BufMut::F32(out) => out,
            _ => {
                widened.resize(c, 0.0);
                &mut widened
            }
        };
        BufMut::F32(acc).copy_from(chunk((r + n - 1) % n), false);
        let mut received = vec![0.0f32; c];
        let next = self.world.process_at_rank(((r + 1) % n) as i32);
        let previous = self.world.process_at_rank(((r + n - 1) % n) as i32);
        for step in 0..n - 1 {
            scope(|s| {
                let receive = previous.immediate_receive_into(s, &mut received[..]);
                let send = next.immediate_send(s, &acc[..]);
                self.complete(OpKind::ReduceScatter, receive);
                self.complete(OpKind::ReduceScatter, send);
            });
            // The received partial is of chunk r - 2 - step; add this rank's part of it.
            let mine = chunk((r + 2 * n - 2 - step) % n);
            with_elem!(BufRef, mine, m, _E => {
                for ((a, &theirs), x) in acc.iter_mut().zip(&received).zip(m) {
                    *a = op.apply(theirs, x.to_f32());
                }
            });
        }
        // After N - 1 steps the partial is chunk r, summed over every rank.
        if !widened.is_empty() {
            output.copy_from(BufRef::F32(&widened), false);
        }
        // Half buffers travel widened, as f32 (module note on half precision).
        self.record(OpKind::ReduceScatter, input.len(), 4, 0);
        Ok(())
    }
}
