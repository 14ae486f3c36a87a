//! Precision policy for zerotrain: which float type the model computes in and how flat
//! buffers convert between fp32 and the half types.
//!
//! The engine keeps fp32 master weights and optimizer state; [`Precision`] names the
//! compute dtype and tells how many bytes each element costs; [`to_half`] and [`from_half`]
//! convert flat buffers with the CPU's conversion instructions where the `half` crate finds
//! them. [`LossScaler`] is DeepSpeed's static or dynamic loss scaler as a pure state
//! machine: the engine feeds it each step's agreed overflow flag and acts on the returned
//! [`ScaleDecision`] (skip the step or not, the next scale).
//!
//! ```
//! use zerotrain_precision::{from_half, to_half, Precision};
//! let src = [1.0f32, 0.5, -2.0];
//! let mut half = vec![half::f16::ZERO; 3];
//! to_half(&src, &mut half);
//! let mut back = [0.0f32; 3];
//! from_half(&half, &mut back);
//! assert_eq!(back, src);
//! assert_eq!(Precision::Bf16.bytes_per_elem(), 2);
//!
//! // DeepSpeed's dynamic scaling: an overflow skips the step; hysteresis 2 halves the
//! // scale only on the second overflow.
//! let mut scaler = zerotrain_precision::LossScaler::dynamic(Default::default());
//! assert!(scaler.update(true)?.skip_step);
//! assert_eq!(scaler.scale(), 65536.0);
//! assert_eq!(scaler.update(true)?.new_scale, 32768.0);
//! # Ok::<(), zerotrain_precision::ScaleError>(())
//! ```
//!
//! # Design notes
//! - *Note: DeepSpeed's dynamic rule* — see [`LossScaler`]'s module.
#![deny(missing_docs)]

mod flat;
mod scaler;

pub use flat::{BufMut, BufRef, FlatBuf, FlatElem};
/// The `half` crate, whose `f16` and `bf16` the flat buffers hold.
pub use half;
pub use scaler::{AtMinimum, DynamicScaleConfig, LossScaler, ScaleDecision, ScaleError, ScalerState};

/// The float type the model computes in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Precision {
    /// IEEE single precision everywhere; the parameters are their own master weights.
    Fp32,
    /// IEEE half precision compute with fp32 master weights and loss scaling.
    Fp16,
    /// bfloat16 compute with fp32 master weights.
    Bf16,
}

impl Precision {
    /// Bytes per element in this type.
    pub fn bytes_per_elem(self) -> usize {
        match self {
            Self::Fp32 => 4,
            Self::Fp16 | Self::Bf16 => 2,
        }
    }

    /// Whether every one of `values` is a value of this type (none a NaN), so that
    /// narrowing and widening give it back bit for bit.
    pub fn holds_exactly(self, values: &[f32]) -> bool {
        match self {
            Self::Fp32 => true,
            Self::Fp16 => {
                values.iter().all(|&v| !v.is_nan() && half::f16::from_f32(v).to_f32().to_bits() == v.to_bits())
            }
            // bf16 is an f32's upper half: the lower one must be zero. No early exit, so the
            // loop vectorises (values that fit are the case worth being fast for).
            Self::Bf16 => {
                let (low, nan) =
                    values.iter().fold((0u32, false), |(low, nan), v| (low | v.to_bits(), nan | v.is_nan()));
                low & 0xFFFF == 0 && !nan
            }
        }
    }

    /// Narrows `src` into `dst` as little-endian elements of this type (rounding as
    /// [`FlatBuf::from_f32`] does, which gives the same bits).
    ///
    /// # Panics
    /// If `dst` is not `src.len()` elements long.
    pub fn narrow_to_le_bytes(self, src: &[f32], dst: &mut [u8]) {
        assert_eq!(dst.len(), src.len() * self.bytes_per_elem(), "byte and element counts differ");
        const CHUNK: usize = 1024;
        fn halves<E: FlatElem + Copy>(src: &[f32], dst: &mut [u8], zero: E, bytes: fn(E) -> [u8; 2]) {
            let mut tmp = [zero; CHUNK];
            for (s, d) in src.chunks(CHUNK).zip(dst.chunks_mut(2 * CHUNK)) {
                E::slice_from_f32(s, &mut tmp[..s.len()]);
                d.chunks_exact_mut(2).zip(&tmp).for_each(|(d, &h)| d.copy_from_slice(&bytes(h)));
            }
        }
        match self {
            Self::Fp32 => dst.chunks_exact_mut(4).zip(src).for_each(|(d, s)| d.copy_from_slice(&s.to_le_bytes())),
            Self::Fp16 => halves(src, dst, half::f16::ZERO, half::f16::to_le_bytes),
            Self::Bf16 => halves(src, dst, half::bf16::ZERO, half::bf16::to_le_bytes),
        }
    }

    /// Converts `bytes`, little-endian elements of this type (a file's, say), into `dst` of
    /// any type: their bits when the types match, widened exactly into f32, else widened
    /// and rounded as [`BufMut::copy_from`] does.
    ///
    /// # Panics
    /// If `bytes` is not `dst.len()` elements long.
    pub fn read_le_bytes(self, bytes: &[u8], dst: BufMut<'_>) {
        assert_eq!(bytes.len(), dst.len() * self.bytes_per_elem(), "byte and element counts differ");
        let bits = |dst: &mut [u16]| {
            dst.iter_mut().zip(bytes.chunks_exact(2)).for_each(|(d, b)| *d = u16::from_le_bytes([b[0], b[1]]));
        };
        match (self, dst) {
            (_, BufMut::F32(dst)) => self.widen_le_bytes(bytes, dst),
            (Self::Fp16, BufMut::F16(dst)) => bits(half::slice::HalfFloatSliceExt::reinterpret_cast_mut(dst)),
            (Self::Bf16, BufMut::Bf16(dst)) => bits(half::slice::HalfFloatSliceExt::reinterpret_cast_mut(dst)),
            (_, mut dst) => {
                const CHUNK: usize = 1024;
                let mut wide = [0.0f32; CHUNK];
                let width = self.bytes_per_elem();
                for (at, bytes) in (0..dst.len()).step_by(CHUNK).zip(bytes.chunks(CHUNK * width)) {
                    let wide = &mut wide[..bytes.len() / width];
                    self.widen_le_bytes(bytes, wide);
                    dst.reborrow().slice(at..at + wide.len()).copy_from(BufRef::F32(wide), false);
                }
            }
        }
    }

    /// Widens `bytes`, little-endian elements of this type (a file's, say), into `dst`
    /// (exact: every f16 and bf16 value is an f32).
    ///
    /// # Panics
    /// If `bytes` is not `dst.len()` elements long.
    pub fn widen_le_bytes(self, bytes: &[u8], dst: &mut [f32]) {
        assert_eq!(bytes.len(), dst.len() * self.bytes_per_elem(), "byte and element counts differ");
        let pairs = || bytes.chunks_exact(2).map(|b| u16::from_le_bytes([b[0], b[1]]));
        match self {
            Self::Fp32 => {
                let words = bytes.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]));
                dst.iter_mut().zip(words).for_each(|(d, w)| *d = w);
            }
            Self::Fp16 => dst.iter_mut().zip(pairs()).for_each(|(d, h)| *d = half::f16::from_bits(h).to_f32()),
            Self::Bf16 => dst.iter_mut().zip(pairs()).for_each(|(d, h)| *d = f32::from_bits(u32::from(h) << 16)),
        }
    }
}

impl std::fmt::Display for Precision {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Fp32 => "fp32",
            Self::Fp16 => "fp16",
            Self::Bf16 => "bf16",
        })
    }
}

/// Converts `src` into `dst` (same length), rounding to nearest even: the bulk path
/// ([`FlatElem::slice_from_f32`]: F16C instructions for f16, a vectorised bit operation for
/// bf16).
///
/// # Panics
/// If the lengths differ (a programmer error: both buffers come from one layout).
pub fn to_half<H: FlatElem>(src: &[f32], dst: &mut [H]) {
    H::slice_from_f32(src, dst);
}

/// Rounds f32 `values` in place to the nearest `dtype` value (nearest even), as converting
/// them to `dtype` and back would, without a buffer of `dtype`: a sum that travels in
/// `dtype` rounded where it stays in f32. Fp32 leaves them as they are.
pub fn round_to(dtype: Precision, values: &mut [f32]) {
    match dtype {
        Precision::Fp32 => {}
        Precision::Fp16 => values.iter_mut().for_each(|v| *v = half::f16::from_f32(*v).to_f32()),
        Precision::Bf16 => values.iter_mut().for_each(|v| *v = half::bf16::from_f32(*v).to_f32()),
    }
}

/// Converts `src` into `dst` (same length), exactly.
///
/// # Panics
/// If the lengths differ.
pub fn from_half<H: FlatElem>(src: &[H], dst: &mut [f32]) {
    H::slice_to_f32(src, dst);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Rounding in place gives what a round trip through the dtype's buffer gives.
    #[test]
    fn rounding_in_place_equals_the_round_trip() {
        let values: Vec<f32> = (0..1000).map(|i| (i as f32 * 0.37).sin() * 1e3 + 1.0 / 3.0).collect();
        for dtype in [Precision::Fp32, Precision::Fp16, Precision::Bf16] {
            let mut rounded = values.clone();
            round_to(dtype, &mut rounded);
            assert_eq!(rounded, FlatBuf::from_f32(dtype, &values).into_f32(), "{dtype:?}");
        }
    }

    /// Bytes narrowed from f32 are the little-endian bits of the flat buffer's rounding,
    /// across chunk edges, ties, NaN and infinities; widened back they are its values.
    #[test]
    fn byte_conversions_agree_with_the_flat_buffers() {
        let mut values: Vec<f32> = (0..2500).map(|i| (i as f32 * 0.731).tan() * 1e-3 * i as f32).collect();
        values.extend([1.0 + 1.0 / 256.0, 1.0 + 3.0 / 256.0, f32::NAN, f32::INFINITY, -0.0, 1e-40, 70000.0]);
        for dtype in [Precision::Fp32, Precision::Fp16, Precision::Bf16] {
            let flat = FlatBuf::from_f32(dtype, &values);
            let expected: Vec<u8> = match &flat {
                FlatBuf::F32(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
                FlatBuf::F16(v) => v.iter().flat_map(|x| x.to_bits().to_le_bytes()).collect(),
                FlatBuf::Bf16(v) => v.iter().flat_map(|x| x.to_bits().to_le_bytes()).collect(),
            };
            let mut bytes = vec![0u8; values.len() * dtype.bytes_per_elem()];
            dtype.narrow_to_le_bytes(&values, &mut bytes);
            assert_eq!(bytes, expected, "{dtype:?}");
            let mut back = vec![0.0f32; values.len()];
            dtype.widen_le_bytes(&bytes, &mut back);
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&back), bits(&flat.clone().into_f32()), "{dtype:?}");
            let mut written = vec![0u8; bytes.len()];
            flat.as_ref().write_le_bytes(&mut written);
            assert_eq!(written, expected, "{dtype:?}: written back");
            // Into a buffer of every type: what converting the flat buffer gives, the
            // same type's bits (a NaN's payload too) when the types match.
            for into in [Precision::Fp32, Precision::Fp16, Precision::Bf16] {
                let mut read = FlatBuf::zeros(into, values.len());
                dtype.read_le_bytes(&bytes, read.as_mut());
                let mut converted = FlatBuf::zeros(into, values.len());
                converted.as_mut().copy_from(flat.as_ref(), false);
                let mut read_bytes = vec![0u8; values.len() * into.bytes_per_elem()];
                let mut converted_bytes = read_bytes.clone();
                read.as_ref().write_le_bytes(&mut read_bytes);
                converted.as_ref().write_le_bytes(&mut converted_bytes);
                assert_eq!(read_bytes, converted_bytes, "{dtype:?} into {into:?}");
                if into == dtype {
                    assert_eq!(read_bytes, bytes, "{dtype:?}: its own bits");
                }
            }
        }
        // A NaN with a payload keeps it through a same-type copy (a round trip through f32
        // would quiet or lose it).
        let nan = half::bf16::from_bits(0x7F81);
        let mut copy = FlatBuf::zeros(Precision::Bf16, 1);
        copy.as_mut().copy_from(BufRef::Bf16(&[nan]), false);
        assert!(matches!(copy, FlatBuf::Bf16(v) if v[0].to_bits() == 0x7F81));
    }

    /// A type holds exactly the values it narrows and widens back bit for bit, never NaN.
    #[test]
    fn holding_exactly_is_surviving_the_round_trip() {
        let cases = [1.0f32, 0.5, -3.0, f32::INFINITY, 0.0, 1.0 + 1.0 / 128.0, 1.0 + 1.0 / 1024.0, 1e-8, 70000.0];
        for dtype in [Precision::Fp32, Precision::Fp16, Precision::Bf16] {
            for v in cases {
                let back = FlatBuf::from_f32(dtype, &[v]).into_f32()[0];
                assert_eq!(dtype.holds_exactly(&[v]), back.to_bits() == v.to_bits(), "{dtype:?} {v}");
            }
            assert!(!dtype.holds_exactly(&[1.0, f32::NAN]) || dtype == Precision::Fp32, "{dtype:?}: NaN");
        }
        assert!(Precision::Bf16.holds_exactly(&[1.0 + 1.0 / 128.0, -2.0]));
        assert!(!Precision::Bf16.holds_exactly(&[1.0, 1.0 + 1.0 / 1024.0]));
    }

    #[test]
    fn conversions_round_to_nearest_and_saturate_to_infinity() {
        let src = [1.0f32 + 1.0 / 4096.0, 70000.0, 3.0e-8, -0.0];
        let mut h = [half::f16::ZERO; 4];
        to_half(&src, &mut h);
        assert_eq!(h[0], half::f16::ONE, "1 + 2^-12 rounds to 1 in f16");
        assert!(h[1].is_infinite(), "70000 overflows f16");
        let mut b = [half::bf16::ZERO; 4];
        to_half(&src, &mut b);
        assert_eq!(b[1].to_f32(), 70144.0, "bf16 keeps the range");
        let mut back = [0.0f32; 4];
        from_half(&b, &mut back);
        assert!(back[3].is_sign_negative());
    }
}
