//! How a parameter of a tensor-parallel model is cut between the ranks of its group: the
//! one description that slicing a whole tensor, reading a slice from a file and putting the
//! whole back together all follow.

use std::ops::Range;

use burn::tensor::Tensor;

use crate::{Error, Result};

/// How one parameter is split over a tensor-parallel group of `n` ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Split {
    /// Whole on every rank (norms, a row-parallel layer's bias, position tables).
    Whole,
    /// Dimension `dim` is `blocks` equal blocks side by side (GPT-2's fused q, k and v: 3;
    /// else 1), each cut into `n` equal consecutive parts: rank `r` holds part `r` of every
    /// block, in block order. Each block's length must divide by `n`.
    Even {
        /// The dimension cut.
        dim: usize,
        /// Blocks side by side along it.
        blocks: usize,
    },
    /// Dimension `dim` cut at `floor(r * len / n)`: parts that differ by at most one, for a
    /// vocabulary that need not divide (GPT-2's 50,257 ids).
    Uneven {
        /// The dimension cut.
        dim: usize,
    },
}

impl Split {
    /// The dimension cut, `None` for [`Split::Whole`].
    pub fn dim(&self) -> Option<usize> {
        match *self {
            Self::Whole => None,
            Self::Even { dim, .. } | Self::Uneven { dim } => Some(dim),
        }
    }

    /// The ranges along the cut dimension of length `len` that rank `rank` of `n` holds, in
    /// order (one, or one per block); an error naming `what` where an even split does not
    /// divide.
    pub fn ranges(&self, len: usize, rank: usize, n: usize, what: &str) -> Result<Vec<Range<usize>>> {
        match *self {
            Self::Whole => Ok(std::iter::once(0..len).collect()),
            Self::Uneven { .. } if len < n => Err(Error::Usage(format!(
                "{what}: its length {len} is less than the tensor-parallel size {n}: a rank would hold none of it"
            ))),
            Self::Uneven { .. } => Ok(std::iter::once(uneven(len, rank, n)).collect()),
            Self::Even { blocks, .. } => {
                let block = len / blocks.max(1);
                if blocks == 0 || !len.is_multiple_of(blocks) || !block.is_multiple_of(n) {
                    let detail = if blocks > 1 { format!(" ({blocks} blocks of {block})") } else { String::new() };
                    return Err(Error::Usage(format!(
                        "{what}: its length {len}{detail} does not divide by the tensor-parallel size {n}"
                    )));
                }
                let part = block / n;
                Ok((0..blocks).map(|b| b * block + rank * part..b * block + (rank + 1) * part).collect())
            }
        }
    }

    /// The shape rank `rank` of `n` holds of a parameter whose whole shape is `whole`.
    pub fn local_shape<const D: usize>(
        &self,
        whole: [usize; D],
        rank: usize,
        n: usize,
        what: &str,
    ) -> Result<[usize; D]> {
        let mut shape = whole;
        if let Some(dim) = self.dim() {
            shape[dim] = self.ranges(whole[dim], rank, n, what)?.iter().map(|r| r.len()).sum();
        }
        Ok(shape)
    }

    /// Rank `rank`'s part of the whole tensor `whole` (its blocks' parts concatenated).
    pub fn slice<const D: usize>(&self, whole: Tensor<D>, rank: usize, n: usize, what: &str) -> Result<Tensor<D>> {
        let Some(dim) = self.dim() else { return Ok(whole) };
        let ranges = self.ranges(whole.dims()[dim], rank, n, what)?;
        let parts: Vec<Tensor<D>> = ranges.into_iter().map(|r| whole.clone().narrow(dim, r.start, r.len())).collect();
        Ok(if parts.len() == 1 { parts.into_iter().next().expect("one part") } else { Tensor::cat(parts, dim) })
    }
}

impl Split {
    /// The runs of the whole tensor of shape `whole` (row-major) that make up rank `rank`'s
    /// slice, in the slice's own row-major order: `(start in the whole, length)`.
    pub fn runs(&self, whole: &[usize], rank: usize, n: usize, what: &str) -> Result<Vec<(usize, usize)>> {
        let Some(dim) = self.dim() else { return Ok(vec![(0, whole.iter().product())]) };
        let ranges = self.ranges(whole[dim], rank, n, what)?;
        let outer: usize = whole[..dim].iter().product();
        let inner: usize = whole[dim + 1..].iter().product();
        let mut runs = Vec::with_capacity(outer * ranges.len());
        for o in 0..outer {
            for r in &ranges {
                runs.push(((o * whole[dim] + r.start) * inner, r.len() * inner));
            }
        }
        Ok(runs)
    }
}

/// The parts of `runs` (a slice's, [`Split::runs`]) that elements `elems` of the slice fall
/// in: `(range in the whole, range in the slice)` pairs, in order.
pub fn within(runs: &[(usize, usize)], elems: Range<usize>) -> Vec<(Range<usize>, Range<usize>)> {
    let mut at = 0;
    let mut parts = Vec::new();
    for &(start, len) in runs {
        let (lo, hi) = (elems.start.max(at), elems.end.min(at + len));
        if lo < hi {
            parts.push((start + lo - at..start + hi - at, lo..hi));
        }
        at += len;
        if at >= elems.end {
            break;
        }
    }
    parts
}

/// Rank `rank`'s part of `len` items cut at `floor(r * len / n)`.
pub(super) fn uneven(len: usize, rank: usize, n: usize) -> Range<usize> {
    rank * len / n..(rank + 1) * len / n
}
