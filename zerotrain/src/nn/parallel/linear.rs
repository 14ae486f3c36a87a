//! The two rules a tensor-parallel model's layers are made of, written once: a
//! row-parallel linear layer (each rank's product of its input features, summed over the
//! group, the bias added once after the sum) and a lookup in a vocabulary split over the
//! group. A column-parallel layer is Burn's own `linear` on the input entered through
//! [`ParallelGroup::copy_to`] (once for every layer that reads it: q, k and v share one
//! copy). Weights are as Burn's `Linear` stores them, `[d_in, d_out]`, each rank's slice
//! cut by a [`Split`](super::Split).

use burn::tensor::module::{embedding, linear};
use burn::tensor::{Int, Tensor};

use super::ParallelGroup;

/// A linear layer whose input features are split over `group`: this rank's `x` `[..,
/// d_in / size]` times its rows `weight` `[d_in / size, d_out]`, the ranks' products summed
/// by [`ParallelGroup::reduce_from`] into the unsplit layer's output on every rank, and the
/// `bias` `[d_out]` (whole on every rank) added once, after the sum. Precede it by a
/// column-parallel layer (an MLP's up projection, attention's q, k and v), whose output is
/// the split input it takes.
pub fn row_parallel_linear<const D: usize>(
    x: Tensor<D>,
    weight: Tensor<2>,
    bias: Option<Tensor<1>>,
    group: &ParallelGroup,
) -> Tensor<D> {
    let sum = group.reduce_from(linear(x, weight, None));
    match bias {
        Some(bias) => sum + bias.unsqueeze(),
        None => sum,
    }
}

/// The embeddings of `ids` `[batch, time]` in a table whose rows are split over `group`:
/// this rank holds rows `first..first + table.dims()[0]` as `table`, looks up the ids among
/// them (zeros for the others), and the group's sum is the whole table's lookup `[batch,
/// time, d]` on every rank.
pub fn vocab_parallel_lookup(table: Tensor<2>, first: usize, ids: Tensor<2, Int>, group: &ParallelGroup) -> Tensor<3> {
    let rows = first..first + table.dims()[0];
    let (local, inside) = local_ids(ids, &rows);
    let mask = inside.float().cast(table.dtype()).unsqueeze_dim::<3>(2);
    group.reduce_from(embedding(table, local) * mask)
}

/// `ids` as rows of a slice `rows` of the vocabulary: ids inside it less its first row,
/// ids outside it as row 0 (to be masked), and the mask (1 inside) as ints.
pub(crate) fn local_ids<const D: usize>(
    ids: Tensor<D, Int>,
    rows: &std::ops::Range<usize>,
) -> (Tensor<D, Int>, Tensor<D, Int>) {
    let inside = ids.clone().greater_equal_elem(rows.start as i64).bool_and(ids.clone().lower_elem(rows.end as i64));
    let inside = inside.int();
    let local = (ids - rows.start as i64) * inside.clone();
    (local, inside)
}
