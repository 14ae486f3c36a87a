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

use super::readout::{into_flat, read};
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
                into_flat(read(t, what)?, what, n)
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
    Tensor::zeros([len], (device, DType::from(float_dtype(precision))))
}

/// `pieces` (1-D, one dtype, on one device, at least one) one after another, as
/// `Tensor::cat` along dimension 0 gives them ([`lay_out`] at consecutive offsets).
pub(crate) fn join(pieces: Vec<Tensor<1>>) -> Tensor<1> {
    let first = pieces.first().expect("join: no pieces");
    let (dtype, device) = (first.dtype(), first.device());
    let mut len = 0;
    let placed: Vec<(usize, Tensor<1>)> = pieces
        .into_iter()
        .map(|t| {
            let start = len;
            len += t.dims()[0];
            (start, t)
        })
        .collect();
    lay_out(len, dtype, &device, placed)
}

/// A 1-D tensor of `len` elements in `dtype` on `device`: each of `pieces` (in that dtype,
/// none overlapping another) at its offset, zeros elsewhere, each piece written once (into
/// a buffer left unfilled where the pieces cover it all).
///
/// Not `Tensor::cat`: Burn's fusion (on in the GPU builds) compiles a `cat` of up to its
/// binding limit into one kernel in which every output element tests each input's range in
/// turn (`burn-cubecl-fusion`'s `concat`), so joining n pieces costs n times the output. On
/// lavapipe, 12 pieces of 10^6 f32 took 343-497 ms as one `cat` and 80-111 ms here (4
/// rounds each); CUDA's limit (1,024 bindings) fuses GPT-2 small's 150 gradients as one
/// `cat` when the model is one unit, whose reduce phase (this flatten and the norm) took
/// 27 ms of the step on an H200. `slice_assign` is not fused, and writes into a buffer
/// nothing else holds in place: one kernel per piece, of the piece's size (profiled on
/// lavapipe with `CUBECL_DEBUG_OPTION=profile`).
pub(crate) fn lay_out(len: usize, dtype: DType, device: &Device, pieces: Vec<(usize, Tensor<1>)>) -> Tensor<1> {
    if let [(0, piece)] = pieces.as_slice()
        && piece.dims()[0] == len
    {
        return pieces.into_iter().next().expect("one piece").1;
    }
    // Pieces never overlap: where they cover every element, nothing needs the zeros.
    let covered: usize = pieces.iter().map(|(_, t)| t.dims()[0]).sum();
    let mut out = match covered == len {
        true => Tensor::<1>::empty([len], (device, dtype)),
        false => Tensor::<1>::zeros([len], (device, dtype)),
    };
    for (at, piece) in pieces {
        let n = piece.dims()[0];
        if n > 0 {
            out = out.slice_assign(at..at + n, piece);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use burn::tensor::{Device, Tensor, TensorData};

    /// Joined, any number of pieces of different lengths read as the values laid end to
    /// end.
    #[test]
    fn joined_pieces_lie_end_to_end() {
        let device = Device::flex();
        for n in [1usize, 2, 3, 4, 5, 8, 13] {
            let values: Vec<Vec<f32>> =
                (0..n).map(|i| (0..(i * 7) % 5 + 1).map(|j| (i * 100 + j) as f32).collect()).collect();
            let pieces =
                values.iter().map(|v| Tensor::<1>::from_data(TensorData::new(v.clone(), [v.len()]), &device)).collect();
            let got = super::join(pieces).into_data().try_to_vec::<f32>().unwrap();
            assert_eq!(got, values.concat(), "{n} pieces");
        }
    }

    /// Laid out, pieces land at their offsets in any order, an empty one is nothing, and
    /// what no piece covers is zero; one piece covering the whole is itself.
    #[test]
    fn laid_out_pieces_land_at_their_offsets_over_zeros() {
        let device = Device::flex();
        let t = |v: &[f32]| Tensor::<1>::from_data(TensorData::new(v.to_vec(), [v.len()]), &device);
        let pieces = vec![(6, t(&[7.0, 8.0])), (1, t(&[1.0, 2.0])), (4, t(&[])), (9, t(&[9.0]))];
        let got =
            super::lay_out(11, burn::tensor::DType::F32, &device, pieces).into_data().try_to_vec::<f32>().unwrap();
        assert_eq!(got, [0.0, 1.0, 2.0, 0.0, 0.0, 0.0, 7.0, 8.0, 0.0, 9.0, 0.0]);
        let whole = super::lay_out(2, burn::tensor::DType::F32, &device, vec![(0, t(&[3.0, 4.0]))]);
        assert_eq!(whole.into_data().try_to_vec::<f32>().unwrap(), [3.0, 4.0]);
    }
}
