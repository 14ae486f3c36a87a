//! Fresh values of a tensor-parallel rank's slice of a parameter that every rank draws
//! alike (where a slice's elements lie in the whole tensor is `Split::runs`'s).

/// `n` values of N(0, `std`) drawn from a generator seeded by `seed` and the parameter's
/// `name` alone: every rank draws the same whole tensor, whichever of its parameters it
/// initialises first, so slices of it and parameters every rank holds agree.
pub fn drawn(seed: u64, name: &str, n: usize, std: f64) -> Vec<f32> {
    // Box-Muller over the name's stream.
    let mut next = stream(seed, name);
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

/// `n` values uniform in `[-bound, bound)`, drawn as [`drawn`] draws (from `seed` and
/// `name` alone).
pub fn drawn_uniform(seed: u64, name: &str, n: usize, bound: f64) -> Vec<f32> {
    let mut next = stream(seed, name);
    (0..n).map(|_| ((next() * 2.0 - 1.0) * bound) as f32).collect()
}

/// Uniform values in `[0, 1)` from a generator seeded by `seed` and `name`: FNV-1a of the
/// name, then SplitMix64.
fn stream(seed: u64, name: &str) -> impl FnMut() -> f64 {
    let mut state =
        name.bytes().fold(0xcbf2_9ce4_8422_2325u64 ^ seed, |h, b| (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3));
    move || {
        state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        ((z ^ (z >> 31)) >> 11) as f64 / (1u64 << 53) as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
