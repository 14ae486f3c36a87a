//! [`Flat`]: a flat buffer of a unit (a gradient, a gradient accumulator) where the step
//! keeps it: in host memory, or on the rank's device.
//!
//! # Note: the device-resident step
//! A rank that computes on a GPU keeps its gradients and model states on the device unless
//! something on the host needs them: a host collective (the threads or MPI backend, with
//! more than one rank in the group) or an offload tier. Where nothing does (one rank per
//! group, or a group whose collectives read device memory (NCCL); states on the device; no
//! pipeline to sum the root over), the step stays on the device
//! ([`Shared::device_step`](super::shared::Shared)): backward's gradients are flattened
//! there into the unit's accumulator and reduced there
//! ([`Shared::on_device`](super::shared::Shared::on_device)), the norm is summed there (one
//! number per unit comes back), the optimizer steps the device masters, and the new values
//! are all-gathered there and written into the model, cast to the compute dtype. Elsewhere a
//! flat buffer lives on the host, as the collectives and tiers want it.

use burn::tensor::{DType, Device, FloatDType, Tensor};
use zerotrain_precision::{FlatBuf, Precision};

use super::params::into_flat;
use crate::Result;

/// A unit's flat buffer, on the host or on the rank's device (module note).
#[derive(Debug)]
#[allow(
    clippy::large_enum_variant,
    reason = "one per unit gradient, moved a few times per step; the sizes differ by backend"
)]
pub(crate) enum Flat {
    /// In host memory.
    Host(FlatBuf),
    /// A 1-D tensor on the rank's device, without autodiff.
    Device(Tensor<1>),
}

impl Flat {
    /// Bytes held.
    pub fn bytes(&self) -> u64 {
        match self {
            Self::Host(values) => values.bytes(),
            Self::Device(t) => tensor_bytes(t),
        }
    }

    /// The values on the host, in the dtype they are in (`what` names them in errors).
    pub fn into_host(self, what: &str) -> Result<FlatBuf> {
        match self {
            Self::Host(values) => Ok(values),
            Self::Device(t) => {
                let n = t.dims()[0];
                into_flat(t.into_data(), what, n)
            }
        }
    }

    /// Adds `other` (of the same length, where this buffer is) to these values.
    pub fn add(&mut self, other: Flat) -> Result<()> {
        match (self, other) {
            (Self::Host(mine), other) => mine.as_mut().copy_from(other.into_host("a gradient")?.as_ref(), true),
            (Self::Device(mine), Self::Device(theirs)) => {
                *mine = mine.clone() + theirs.cast(mine.dtype());
            }
            (Self::Device(mine), Self::Host(theirs)) => {
                let device = mine.device();
                *mine = mine.clone() + tensor(theirs, &device).cast(mine.dtype());
            }
        }
        Ok(())
    }
}

/// `values` as a 1-D tensor on `device`, in their dtype.
pub(crate) fn tensor(values: FlatBuf, device: &Device) -> Tensor<1> {
    let n = values.len();
    let data = zerotrain_precision::with_elem!(FlatBuf, values, v, _E => burn::tensor::TensorData::new(v, [n]));
    let dtype = data.dtype();
    Tensor::from_data(data, (device, dtype))
}

/// Bytes a 1-D device tensor holds.
pub(crate) fn tensor_bytes(t: &Tensor<1>) -> u64 {
    (t.dims()[0] * t.dtype().size()) as u64
}

/// Burn's float dtype for `precision`.
pub(crate) fn float_dtype(precision: Precision) -> FloatDType {
    match precision {
        Precision::Fp32 => FloatDType::F32,
        Precision::Fp16 => FloatDType::F16,
        Precision::Bf16 => FloatDType::BF16,
    }
}

/// A 1-D tensor of `len` zeros in `precision` on `device`.
pub(crate) fn zeros(precision: Precision, len: usize, device: &Device) -> Tensor<1> {
    let dtype = match precision {
        Precision::Fp32 => DType::F32,
        Precision::Fp16 => DType::F16,
        Precision::Bf16 => DType::BF16,
    };
    Tensor::zeros([len], (device, dtype))
}

/// `pieces` (1-D, one dtype, on one device) one after another, as `Tensor::cat` along
/// dimension 0, joined in pairs, level by level, the last few at once.
///
/// Burn 0.22's `cat` writes each input into the output through a `slice_assign`, which on
/// cubecl's backends copies the whole output first unless it holds the only reference to
/// it (with Burn's fusion on, as the GPU features build it, measured to copy each time):
/// joining n pieces moves n times the output's bytes. A unit's gradient joins one piece
/// per parameter (150 for GPT-2 small as one unit), so that cost grows with the square of
/// the unit. Joined in pairs, each level moves the output's bytes twice; pairs pay off
/// above 4 pieces (150 pieces: 15 times the output's bytes instead of 150; 12, a block of
/// GPT-2: 7 instead of 12). On lavapipe, 150 pieces of 100,000 f32: 846-921 ms at once,
/// 11-25 ms in pairs. The values are copies either way: the same bits.
pub(crate) fn cat_in_pairs(mut pieces: Vec<Tensor<1>>) -> Tensor<1> {
    const AT_ONCE: usize = 4;
    while pieces.len() > AT_ONCE {
        let mut joined = Vec::with_capacity(pieces.len().div_ceil(2));
        let mut it = pieces.into_iter();
        while let Some(first) = it.next() {
            joined.push(match it.next() {
                Some(second) => Tensor::cat(vec![first, second], 0),
                None => first,
            });
        }
        pieces = joined;
    }
    Tensor::cat(pieces, 0)
}

#[cfg(test)]
mod tests {
    use burn::tensor::{Device, Tensor, TensorData};

    /// Joined in pairs, any number of pieces of different lengths read as the values laid
    /// end to end.
    #[test]
    fn pieces_joined_in_pairs_lie_end_to_end() {
        let device = Device::flex();
        for n in [1usize, 2, 3, 4, 5, 8, 13] {
            let values: Vec<Vec<f32>> =
                (0..n).map(|i| (0..(i * 7) % 5 + 1).map(|j| (i * 100 + j) as f32).collect()).collect();
            let pieces =
                values.iter().map(|v| Tensor::<1>::from_data(TensorData::new(v.clone(), [v.len()]), &device)).collect();
            let got = super::cat_in_pairs(pieces).into_data().try_to_vec::<f32>().unwrap();
            assert_eq!(got, values.concat(), "{n} pieces");
        }
    }
}
