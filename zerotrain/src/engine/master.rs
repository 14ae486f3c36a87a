//! [`Values`]: a range of fp32 master weights, kept where the rank computes.
//!
//! On a GPU they are a 1-D tensor on the device: the optimizer steps them there, and only
//! what a host collective needs leaves (cast on the device to the compute dtype). On the
//! CPU (Flex) they are a host vector: a vector *is* device memory there, and reading one
//! costs nothing, while reading a Flex tensor that is still referenced elsewhere copies it
//! element by element (4 ms for 3.2 MB, measured); a tensor that is referenced once moves
//! in and out of a vector without a copy, so the optimizer steps the same values either way.

use burn::tensor::{DType, Device, Tensor, TensorData};
use zerotrain_precision::{FlatBuf, Precision};

use super::flat::float_dtype;
use super::readout::{f32s, into_flat};
use crate::Result;

/// fp32 values of one flat range; see the module docs.
#[expect(clippy::large_enum_variant, reason = "one per unit, moved once per step")]
pub(crate) enum Values {
    /// On the host (the rank computes on the CPU).
    Host(Vec<f32>),
    /// On the rank's device, without autodiff.
    Device(Tensor<1>),
}

impl Values {
    /// `values`, kept as a vector on the CPU and as a tensor on `device` otherwise.
    pub fn new(values: Vec<f32>, on_cpu: bool, device: &Device) -> Self {
        if on_cpu { Self::Host(values) } else { Self::Device(tensor(values, device)) }
    }

    /// Whether the values are a tensor on a device (reading them copies them to the host).
    pub fn on_device(&self) -> bool {
        matches!(self, Self::Device(_))
    }

    /// Elements.
    pub fn len(&self) -> usize {
        match self {
            Self::Host(values) => values.len(),
            Self::Device(t) => t.dims()[0],
        }
    }

    /// The values as a tensor on `device`, for the optimizer (no copy).
    pub fn into_tensor(self, device: &Device) -> Tensor<1> {
        match self {
            Self::Host(values) => tensor(values, device),
            Self::Device(t) => t,
        }
    }

    /// The optimizer's output kept as [`new`](Self::new) keeps values.
    pub fn from_tensor(t: Tensor<1>, on_cpu: bool) -> Result<Self> {
        if on_cpu { f32s(t, "master weights").map(Self::Host) } else { Ok(Self::Device(t)) }
    }

    /// The values in `dtype` on the host: a collective's input (on a device, a half dtype
    /// is cast there, so only its bytes cross).
    pub fn to_host(&self, dtype: Precision) -> Result<FlatBuf> {
        match self {
            Self::Host(values) => Ok(FlatBuf::from_f32(dtype, values)),
            Self::Device(t) => {
                let what = "master weights";
                into_flat(super::readout::read(t.clone().cast(float_dtype(dtype)), what)?, what, self.len())
            }
        }
    }

    /// [`to_host`](Self::to_host), consuming the values: a host vector asked for in f32
    /// is moved, not copied.
    pub fn into_host(self, dtype: Precision) -> Result<FlatBuf> {
        match (self, dtype) {
            (Self::Host(values), Precision::Fp32) => Ok(FlatBuf::F32(values)),
            (values, dtype) => values.to_host(dtype),
        }
    }

    /// The values in fp32 on the host (checkpoints).
    pub fn to_vec(&self) -> Result<Vec<f32>> {
        match self {
            Self::Host(values) => Ok(values.clone()),
            Self::Device(t) => f32s(t.clone(), "master weights"),
        }
    }
}

/// `values` as a 1-D f32 tensor on `device`.
fn tensor(values: Vec<f32>, device: &Device) -> Tensor<1> {
    let n = values.len();
    Tensor::from_data(TensorData::new(values, [n]), (device, DType::F32))
}
