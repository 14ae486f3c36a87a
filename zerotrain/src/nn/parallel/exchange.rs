//! The all-to-all of a tensor over a group, on the host: the tensor cut along one
//! dimension into one part per rank, part `j` sent to rank `j`, and the parts received put
//! side by side along another dimension in rank order (DeepSpeed-Ulysses' exchange of
//! sequence parts for head parts).

use zerotrain_precision::{BufMut, BufRef};

use super::ParallelGroup;
use crate::{Error, Result};

/// `values` (row-major, of shape `dims`) cut along `scatter` into `n` equal parts, part
/// `j` to rank `j`, the parts from every rank concatenated along `gather` in rank order:
/// the result and its shape: one [`Collective::all_to_all`](zerotrain_zero::Collective::all_to_all)
/// of equal parts (NCCL's runs as one group of sends and receives).
pub(super) fn all_to_all(
    group: &ParallelGroup,
    values: &[f32],
    dims: &[usize],
    [scatter, gather]: [usize; 2],
) -> Result<(Vec<f32>, Vec<usize>)> {
    let n = group.size();
    if !dims[scatter].is_multiple_of(n) {
        return Err(Error::Usage(format!(
            "all-to-all over {n} ranks: dimension {scatter} of {dims:?} does not divide into {n} parts"
        )));
    }
    let mut part_dims = dims.to_vec();
    part_dims[scatter] /= n;
    let input: Vec<f32> = (0..n).flat_map(|j| cut(values, dims, scatter, j, n)).collect();
    let part = input.len() / n;
    let mut output = vec![0f32; input.len()];
    let counts = vec![part; n];
    group.collective().all_to_all(BufRef::F32(&input), &counts, BufMut::F32(&mut output), &counts)?;
    let received: Vec<&[f32]> = (0..n).map(|i| &output[i * part..(i + 1) * part]).collect();
    let mut out_dims = part_dims.clone();
    out_dims[gather] *= n;
    Ok((join(&received, &part_dims, gather), out_dims))
}

/// Part `j` of `n` of `values` along dimension `dim`.
fn cut(values: &[f32], dims: &[usize], dim: usize, j: usize, n: usize) -> Vec<f32> {
    let outer: usize = dims[..dim].iter().product();
    let block = dims[dim + 1..].iter().product::<usize>() * dims[dim];
    let part = block / n;
    (0..outer).flat_map(|o| &values[o * block + j * part..o * block + (j + 1) * part]).copied().collect()
}

/// `parts` (each of shape `dims`) side by side along dimension `dim`.
fn join(parts: &[impl AsRef<[f32]>], dims: &[usize], dim: usize) -> Vec<f32> {
    let outer: usize = dims[..dim].iter().product();
    let block: usize = dims[dim..].iter().product();
    let mut out = Vec::with_capacity(block * outer * parts.len());
    for o in 0..outer {
        for part in parts {
            out.extend_from_slice(&part.as_ref()[o * block..(o + 1) * block]);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Cutting along a dimension and joining the parts back gives the tensor; a `[2, 3, 4]`
    /// cut in two along dimension 2 takes columns 0-1 and 2-3 of every row.
    #[test]
    fn cut_and_join_are_inverse() {
        let values: Vec<f32> = (0..24).map(|i| i as f32).collect();
        let first = cut(&values, &[2, 3, 4], 2, 0, 2);
        assert_eq!(first[..4], [0.0, 1.0, 4.0, 5.0]);
        for dim in 0..3 {
            let n = [2, 3, 2][dim];
            let parts: Vec<Vec<f32>> = (0..n).map(|j| cut(&values, &[2, 3, 4], dim, j, n)).collect();
            let mut part_dims = vec![2, 3, 4];
            part_dims[dim] /= n;
            assert_eq!(join(&parts, &part_dims, dim), values, "dimension {dim}");
        }
    }
}
