//! A tensor-parallel rank's slice of a parameter, from a checkpoint's file or drawn fresh:
//! where its elements lie in the whole tensor, and fresh values that every rank draws alike.

use std::ops::Range;

use zerotrain::nn::parallel::Split;

/// The runs of the whole tensor `whole` (row-major) that make up rank `rank`'s slice under
/// `split`, in the slice's own row-major order: `(start in the whole, length)`.
pub fn runs(whole: &[usize], split: Split, rank: usize, n: usize, what: &str) -> Result<Vec<(usize, usize)>, String> {
    let Some(dim) = split.dim() else { return Ok(vec![(0, whole.iter().product())]) };
    let ranges = split.ranges(whole[dim], rank, n, what).map_err(|e| e.to_string())?;
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

/// The parts of `runs` that elements `elems` of the slice fall in: `(whole range, slice
/// range)` pairs, in order.
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

/// `n` values of N(0, `std`) drawn from a generator seeded by `seed` and the parameter's
/// `name` alone: every rank draws the same whole tensor, whichever of its parameters it
/// initialises first, so slices of it and parameters every rank holds agree.
pub fn drawn(seed: u64, name: &str, n: usize, std: f64) -> Vec<f32> {
    // FNV-1a of the name, then SplitMix64 and Box-Muller.
    let mut state =
        name.bytes().fold(0xcbf2_9ce4_8422_2325u64 ^ seed, |h, b| (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3));
    let mut next = || {
        state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        ((z ^ (z >> 31)) >> 11) as f64 / (1u64 << 53) as f64
    };
    let mut values = Vec::with_capacity(n + 1);
    while values.len() < n {
        let (u, v) = (1.0 - next(), next());
        let r = (-2.0 * u.ln()).sqrt() * std;
        let angle = 2.0 * std::f64::consts::PI * v;
        values.push((r * angle.cos()) as f32);
        values.push((r * angle.sin()) as f32);
    }
    values.truncate(n);
    values
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A `[2, 6]` tensor split by columns in 3 blocks over 2 ranks: rank 1 holds columns 1,
    /// 3, 5 of each row; asking for its elements 2..5 reads across a row's end.
    #[test]
    fn runs_follow_the_slice_row_by_row() {
        let split = Split::Even { dim: 1, blocks: 3 };
        let r = runs(&[2, 6], split, 1, 2, "w").unwrap();
        assert_eq!(r, [(1, 1), (3, 1), (5, 1), (7, 1), (9, 1), (11, 1)]);
        assert_eq!(within(&r, 2..5), [(5..6, 2..3), (7..8, 3..4), (9..10, 4..5)]);
        let rows = runs(&[5, 3], Split::Uneven { dim: 0 }, 1, 2, "wte").unwrap();
        assert_eq!(rows, [(6, 9)]);
        assert_eq!(runs(&[4, 3], Split::Whole, 0, 2, "ln").unwrap(), [(0, 12)]);
    }

    /// The draws depend on the seed and the name only, and have the asked spread.
    #[test]
    fn draws_are_the_names_and_have_the_asked_spread() {
        let a = drawn(7, "model.layers.0.mlp.up_proj.weight", 20_000, 0.02);
        assert_eq!(a, drawn(7, "model.layers.0.mlp.up_proj.weight", 20_000, 0.02));
        assert_ne!(a[..8], drawn(7, "model.layers.1.mlp.up_proj.weight", 8, 0.02)[..]);
        assert_ne!(a[..8], drawn(8, "model.layers.0.mlp.up_proj.weight", 8, 0.02)[..]);
        let mean = a.iter().map(|&x| f64::from(x)).sum::<f64>() / a.len() as f64;
        let std = (a.iter().map(|&x| (f64::from(x) - mean).powi(2)).sum::<f64>() / a.len() as f64).sqrt();
        // 20,000 draws: the sample mean is within 4 standard errors (0.02 / sqrt(20000)).
        assert!(mean.abs() < 4.0 * 0.02 / (20_000f64).sqrt() && (std / 0.02 - 1.0).abs() < 0.03, "{mean} {std}");
    }
}
