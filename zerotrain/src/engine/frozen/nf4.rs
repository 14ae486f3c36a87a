//! QLoRA's NormalFloat4 (bitsandbytes' `nf4`): a tensor in blocks of [`BLOCK`] values
//! along its flat order, each value the index of the nearest of 16 levels of
//! `value / absmax`, one f32 absmax per block; a partial last block has its own absmax.
//! Two codes to a byte, eight to a word, the first in the low nibble (an internal layout:
//! only the dequantised values are compared with other libraries').

/// Values per absmax.
pub(crate) const BLOCK: usize = 64;

/// The 16 levels (bitsandbytes' `get_4bit_type("nf4")`), ascending.
pub(crate) const LEVELS: [f32; 16] = [
    -1.0,
    -0.696_192_8,
    -0.525_073_05,
    -0.394_917_5,
    -0.284_441_38,
    -0.184_773_43,
    -0.091_050_036,
    0.0,
    0.079_580_3,
    0.160_930_2,
    0.246_112_3,
    0.337_915_24,
    0.440_709_83,
    0.562_617,
    0.722_956_84,
    1.0,
];

/// Words of codes for `n` values.
pub(crate) fn code_words(n: usize) -> usize {
    n.div_ceil(8)
}

/// Absmaxes (blocks) for `n` values.
pub(crate) fn blocks(n: usize) -> usize {
    n.div_ceil(BLOCK)
}

/// The code of `x` (a value over its block's absmax, in [-1, 1]): the levels' midpoints
/// it lies above, as bitsandbytes' decision tree counts them (a value on a midpoint takes
/// the lower level).
fn code(x: f32) -> u32 {
    let mut code = 0;
    for pair in LEVELS.windows(2) {
        let midpoint = ((pair[0] as f64 + pair[1] as f64) / 2.0) as f32;
        code += u32::from(x > midpoint);
    }
    code
}

/// Quantises `values` into `codes` ([`code_words`] of them) and `absmax` ([`blocks`] of
/// them). A block of zeros has absmax 0 and dequantises to zeros.
pub(crate) fn quantize(values: &[f32], codes: &mut [u32], absmax: &mut [f32]) {
    codes.fill(0);
    for (b, block) in values.chunks(BLOCK).enumerate() {
        let max = block.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        absmax[b] = max;
        let scale = if max > 0.0 { 1.0 / max } else { 0.0 };
        for (j, v) in block.iter().enumerate() {
            let i = b * BLOCK + j;
            codes[i / 8] |= code(v * scale) << (4 * (i % 8));
        }
    }
}

/// Value `i` of those `codes` and `absmax` ([`quantize`]'s) stand for; `code` reads a
/// word of codes (codes kept as words of f32 bits are read in place).
pub(crate) fn value(code: impl Fn(usize) -> u32, absmax: &[f32], i: usize) -> f32 {
    let c = (code(i / 8) >> (4 * (i % 8))) & 0xF;
    LEVELS[c as usize] * absmax[i / BLOCK]
}

/// The values `codes` and `absmax` ([`quantize`]'s) stand for, into `out` (its length
/// is the count of values).
#[cfg(test)]
pub(crate) fn dequantize(codes: &[u32], absmax: &[f32], out: &mut [f32]) {
    for (i, o) in out.iter_mut().enumerate() {
        *o = value(|w| codes[w], absmax, i);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// bitsandbytes' codebook dequantised by numpy (`bench/reference/nf4.py`): the inputs
    /// (normal values, a zero block, a partial last block, ties at midpoints), their
    /// absmaxes, codes and dequantised values.
    #[test]
    fn dequantised_values_are_numpys_codebook_reference() {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../bench/reference/nf4.json");
        let fixture: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
        let floats = |key: &str| -> Vec<f32> {
            fixture[key].as_array().unwrap().iter().map(|v| v.as_f64().unwrap() as f32).collect()
        };
        let levels = floats("levels");
        assert_eq!(levels, LEVELS, "the codebook");
        let (values, expected, absmax_ref) = (floats("values"), floats("dequantized"), floats("absmax"));
        let codes_ref: Vec<u32> =
            fixture["codes"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect();
        let n = values.len();
        assert!(n % BLOCK != 0, "the fixture ends in a partial block");
        let (mut codes, mut absmax) = (vec![0; code_words(n)], vec![0.0; blocks(n)]);
        quantize(&values, &mut codes, &mut absmax);
        assert_eq!(absmax, absmax_ref);
        let unpacked: Vec<u32> = (0..n).map(|i| (codes[i / 8] >> (4 * (i % 8))) & 0xF).collect();
        assert_eq!(unpacked, codes_ref, "codes");
        let mut out = vec![f32::NAN; n];
        dequantize(&codes, &absmax, &mut out);
        assert_eq!(out, expected);
    }
}
