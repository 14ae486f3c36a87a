//! The all-to-all of a tensor over a group, on the host: the tensor cut along one
//! dimension into one part per rank, part `j` sent to rank `j`, and the parts received put
//! side by side along another dimension in rank order (DeepSpeed-Ulysses' exchange of
//! sequence parts for head parts).

use zerotrain_precision::{BufMut, BufRef};

use super::ParallelGroup;
use crate::{Error, Result};

/// `values` (row-major, of shape `dims`) cut along `scatter` into `n` equal parts, part
/// `j` to rank `j`, the parts from every rank concatenated along `gather` in rank order:
/// the result and its shape. Sends are buffered, so every rank sends first and then
/// receives.
pub(super) fn all_to_all(
    group: &ParallelGroup,
    values: &[f32],
    dims: &[usize],
    [scatter, gather]: [usize; 2],
) -> Result<(Vec<f32>, Vec<usize>)> {
    let (n, me) = (group.size(), group.rank());
    if !dims[scatter].is_multiple_of(n) {
        return Err(Error::Usage(format!(
            "all-to-all over {n} ranks: dimension {scatter} of {dims:?} does not divide into {n} parts"
        )));
    }
    let mut part_dims = dims.to_vec();
    part_dims[scatter] /= n;
    let parts: Vec<Vec<f32>> = (0..n).map(|j| cut(values, dims, scatter, j, n)).collect();
    let comm = group.collective();
    for (j, part) in parts.iter().enumerate().filter(|(j, _)| *j != me) {
        comm.send(BufRef::F32(part), j)?;
    }
    let mut received = vec![Vec::new(); n];
    for (i, slot) in received.iter_mut().enumerate() {
        *slot = if i == me {
            parts[me].clone()
        } else {
            let mut buf = vec![0f32; parts[me].len()];
            comm.recv(BufMut::F32(&mut buf), i)?;
            buf
        };
    }
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
fn join(parts: &[Vec<f32>], dims: &[usize], dim: usize) -> Vec<f32> {
    let outer: usize = dims[..dim].iter().product();
    let block: usize = dims[dim..].iter().product();
    let mut out = Vec::with_capacity(block * outer * parts.len());
    for o in 0..outer {
        for part in parts {
            out.extend_from_slice(&part[o * block..(o + 1) * block]);
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
