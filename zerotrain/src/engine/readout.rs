//! Tensors read out to the host: their data, an f32 vector, a scalar ([`read`],
//! [`f32s`], [`read_scalar`], public for models that read their own outputs, as
//! `zerotrain-models`' sampling does), a unit's flat buffer. Burn's `into_data` panics when the device could not run what the read waits
//! for (an allocation past the largest buffer it makes, a lost device); every read here
//! goes through `try_into_data`, so such a failure is an [`Error::Device`] naming what was
//! being read.

use burn::tensor::{DType, Tensor, TensorData};
use zerotrain_precision::half::{bf16, f16};
use zerotrain_precision::{BufRef, FlatBuf};

use crate::{Error, Result};

/// `t`'s values on the host, as Burn's `into_data` reads them; a device that failed is an
/// [`Error::Device`] naming `what` (module note).
pub fn read<const D: usize>(t: Tensor<D>, what: &str) -> Result<TensorData> {
    t.try_into_data().map_err(|e| Error::Device { what: what.to_string(), cause: device_cause(&e.to_string()) })
}

/// A one-element tensor's value as an f32 ([`read`], converted as `into_scalar` does).
pub fn read_scalar(t: Tensor<1>, what: &str) -> Result<f32> {
    let data = read(t, what)?;
    data.iter::<f32>().next().ok_or_else(|| Error::Model(format!("{what}: an empty tensor")))
}

/// Burn's multi-line execution error as one line, without its empty backtrace lines, and
/// what to do about a buffer the device cannot allocate.
fn device_cause(reason: &str) -> String {
    let skip = ["Caused by:", "No backtrace available", "Asked at:"];
    let lines: Vec<&str> = reason.lines().map(str::trim).filter(|l| !l.is_empty() && !skip.contains(l)).collect();
    let mut cause = lines.join(": ");
    if reason.contains("can't allocate buffer") {
        cause.push_str(
            " (a tensor is larger than the largest buffer this device allocates: on wgpu the adapter's \
             max_storage_buffer_binding_size and max_buffer_size, 128 MiB on lavapipe; a unit's flat buffers \
             hold its parameters together, so smaller units, smaller tensors or another device)",
        );
    }
    cause
}

/// `t`'s values as f32 on the host ([`read`], converted from a half dtype; moved out without
/// a copy when `t` is f32 and nothing else holds it).
pub fn f32s<const D: usize>(t: Tensor<D>, what: &str) -> Result<Vec<f32>> {
    let data = read(t, what)?.try_cast(DType::F32).map_err(|e| Error::Model(format!("{what}: {e:?}")))?;
    data.try_into_vec::<f32>().map_err(|e| Error::Model(format!("{what}: {e:?}")))
}

/// The tensor data as a flat buffer, checked against the layout.
pub(crate) fn as_flat<'a>(data: &'a TensorData, path: &str, num_elems: usize) -> Result<BufRef<'a>> {
    let values = match data.dtype() {
        DType::F32 => data.as_slice::<f32>().ok().map(BufRef::F32),
        DType::F16 => data.as_slice::<f16>().ok().map(BufRef::F16),
        DType::BF16 => data.as_slice::<bf16>().ok().map(BufRef::Bf16),
        _ => None,
    };
    match values {
        Some(values) if values.len() == num_elems => Ok(values),
        Some(values) => Err(Error::Model(format!(
            "parameter `{path}` has {} elements, the layout expects {num_elems}; was the model changed after \
             Engine::new?",
            values.len()
        ))),
        None => {
            Err(Error::Model(format!("parameter `{path}` is {:?}; zerotrain trains f32, f16 and bf16", data.dtype())))
        }
    }
}

/// Like [`as_flat`], taking the data (`path` names it in errors).
pub(crate) fn into_flat(data: TensorData, path: &str, num_elems: usize) -> Result<FlatBuf> {
    as_flat(&data, path, num_elems)?;
    let buf = match data.dtype() {
        DType::F32 => data.try_into_vec::<f32>().map(FlatBuf::F32),
        DType::F16 => data.try_into_vec::<f16>().map(FlatBuf::F16),
        _ => data.try_into_vec::<bf16>().map(FlatBuf::Bf16),
    };
    buf.map_err(|e| Error::Model(format!("`{path}`: unreadable tensor data: {e:?}")))
}
