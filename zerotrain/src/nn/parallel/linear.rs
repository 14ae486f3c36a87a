//! The layers a tensor-parallel model is made of, each holding its rank's slice of the
//! unsplit layer's parameters. Weights are stored as Burn's `Linear` stores them, `[d_in,
//! d_out]`; each layer is made from the whole layer's values (every rank slicing the same
//! tensor) or from this rank's slice.

use burn::module::{Module, Param};
use burn::tensor::module::{embedding, linear};
use burn::tensor::{Int, Tensor};

use super::ParallelGroup;
use crate::{Error, Result};

/// A linear layer whose output columns are split over the group: rank `r` holds columns
/// `r * d_out / size ..` of the weight and bias, and its output is that slice of the
/// unsplit layer's output. Its input enters through [`ParallelGroup::copy_to`], so the
/// input's gradient is the unsplit layer's. Follow it by element-wise work and a
/// [`RowParallelLinear`], as an MLP's up projection or attention's q, k and v.
#[derive(Module, Debug)]
pub struct ColumnParallelLinear {
    weight: Param<Tensor<2>>,
    bias: Option<Param<Tensor<1>>>,
    #[module(skip)]
    group: ParallelGroup,
}

impl ColumnParallelLinear {
    /// This rank's columns of the unsplit layer `weight` `[d_in, d_out]` and `bias`
    /// `[d_out]`; an error where `d_out` does not divide over the group.
    pub fn from_whole(weight: Tensor<2>, bias: Option<Tensor<1>>, group: &ParallelGroup) -> Result<Self> {
        let [_, d_out] = weight.dims();
        let part = group.part(d_out, "ColumnParallelLinear: the output width")?;
        let weight = weight.narrow(1, part.start, part.len());
        let bias = bias.map(|b| b.narrow(0, part.start, part.len()));
        Ok(Self::from_slice(weight, bias, group))
    }

    /// A layer from this rank's slice: `weight` `[d_in, d_out / size]`, `bias` `[d_out / size]`.
    pub fn from_slice(weight: Tensor<2>, bias: Option<Tensor<1>>, group: &ParallelGroup) -> Self {
        Self { weight: Param::from_tensor(weight), bias: bias.map(Param::from_tensor), group: group.clone() }
    }

    /// This rank's weight slice and bias (as the layer holds them, tracked for gradients).
    pub fn weight_and_bias(&self) -> (Tensor<2>, Option<Tensor<1>>) {
        (self.weight.val(), self.bias.as_ref().map(Param::val))
    }

    /// `x W_r + b_r` over `x`'s last dimension: this rank's columns of the output.
    pub fn forward<const D: usize>(&self, x: Tensor<D>) -> Tensor<D> {
        linear(self.group.copy_to(x), self.weight.val(), self.bias.as_ref().map(Param::val))
    }
}

/// A linear layer whose input rows are split over the group: rank `r` holds rows `r * d_in
/// / size ..` of the weight and takes that slice of the input (a [`ColumnParallelLinear`]'s
/// output), and the ranks' products are summed by [`ParallelGroup::reduce_from`] into the
/// unsplit layer's output on every rank. The bias, whole on every rank, is added once,
/// after the sum.
#[derive(Module, Debug)]
pub struct RowParallelLinear {
    weight: Param<Tensor<2>>,
    bias: Option<Param<Tensor<1>>>,
    #[module(skip)]
    group: ParallelGroup,
}

impl RowParallelLinear {
    /// This rank's rows of the unsplit layer `weight` `[d_in, d_out]`, and the whole
    /// `bias` `[d_out]`; an error where `d_in` does not divide over the group.
    pub fn from_whole(weight: Tensor<2>, bias: Option<Tensor<1>>, group: &ParallelGroup) -> Result<Self> {
        let [d_in, _] = weight.dims();
        let part = group.part(d_in, "RowParallelLinear: the input width")?;
        Ok(Self::from_slice(weight.narrow(0, part.start, part.len()), bias, group))
    }

    /// A layer from this rank's rows `weight` `[d_in / size, d_out]` and the whole `bias`.
    pub fn from_slice(weight: Tensor<2>, bias: Option<Tensor<1>>, group: &ParallelGroup) -> Self {
        Self { weight: Param::from_tensor(weight), bias: bias.map(Param::from_tensor), group: group.clone() }
    }

    /// This rank's weight slice and bias (as the layer holds them, tracked for gradients).
    pub fn weight_and_bias(&self) -> (Tensor<2>, Option<Tensor<1>>) {
        (self.weight.val(), self.bias.as_ref().map(Param::val))
    }

    /// `sum_r x_r W_r + b`: the unsplit layer's output, on every rank.
    pub fn forward<const D: usize>(&self, x: Tensor<D>) -> Tensor<D> {
        let sum = self.group.reduce_from(linear(x, self.weight.val(), None));
        match &self.bias {
            Some(bias) => sum + bias.val().unsqueeze(),
            None => sum,
        }
    }
}

/// An embedding table whose rows (the vocabulary) are split over the group: rank `r`
/// holds rows [`ParallelGroup::share`] of the vocabulary (parts that differ by at most one
/// where it does not divide), looks up the ids in its range, and the ranks' lookups (zeros
/// for ids outside each rank's range) are summed into the unsplit table's.
#[derive(Module, Debug)]
pub struct VocabParallelEmbedding {
    weight: Param<Tensor<2>>,
    #[module(skip)]
    first: usize,
    #[module(skip)]
    group: ParallelGroup,
}

impl VocabParallelEmbedding {
    /// This rank's rows of the unsplit table `weight` `[vocab, d]`; an error where the
    /// vocabulary has fewer ids than the group has ranks.
    pub fn from_whole(weight: Tensor<2>, group: &ParallelGroup) -> Result<Self> {
        let [vocab, _] = weight.dims();
        if vocab < group.size() {
            return Err(Error::Usage(format!(
                "VocabParallelEmbedding: the vocabulary ({vocab}) has fewer ids than the tensor-parallel size {}",
                group.size()
            )));
        }
        let part = group.share(vocab);
        Ok(Self {
            weight: Param::from_tensor(weight.narrow(0, part.start, part.len())),
            first: part.start,
            group: group.clone(),
        })
    }

    /// This rank's rows of the table.
    pub fn weight(&self) -> Tensor<2> {
        self.weight.val()
    }

    /// The rows `[first, first + rows)` this rank holds.
    pub fn rows(&self) -> std::ops::Range<usize> {
        self.first..self.first + self.weight.dims()[0]
    }

    /// The embeddings of `ids` `[batch, time]`: `[batch, time, d]`, equal on every rank.
    pub fn forward(&self, ids: Tensor<2, Int>) -> Tensor<3> {
        vocab_parallel_lookup(self.weight.val(), self.first, ids, &self.group)
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
