//! Collectives over Burn tensors on the rank's device. Where the communicator's collectives
//! read device memory (NCCL: [`Collective::reads_device_memory`]) and the tensor is on a CUDA
//! device, they run there and nothing crosses to the host; otherwise the values are staged
//! through host memory and back (as PyTorch's `gloo` backend does for CUDA tensors), with
//! the host collective's results. Each call reads a 1-D tensor and returns a new one, as
//! Burn's operations do.
//!
//! # Note: handing Burn's memory to NCCL
//! A tensor on a CUDA device is, under Burn's dispatch and fusion layers, a cubecl buffer
//! in the CUDA primary context, the context NCCL's communicator runs in too. A call
//! resolves its input and a fresh output to those buffers (running whatever fused work is
//! pending on them), waits for the device, so every write to them has finished, asks cubecl
//! for their addresses, and hands them to the communicator as
//! [`DeviceBuf`](zerotrain_zero::DeviceBuf)s, holding cubecl's resources (and so the memory)
//! until the collective has finished on the GPU. The input is only read; the output was
//! made for the call and nothing else holds it. Waiting for the device before each call
//! gives up overlapping the collective with compute; it is what makes the contract of
//! `DeviceBuf` hold with no event shared between Burn's stream and NCCL's.

use burn::tensor::{DType, Device, Tensor};
use zerotrain_precision::{FlatBuf, Precision};
use zerotrain_zero::{Collective, DeviceOp, ReduceOp};

use super::flat::tensor;
use super::readout::into_flat;
use crate::{Error, Result};

/// [`Collective::all_reduce`] of `tensor` over the ranks of `comm`.
pub fn all_reduce(comm: &dyn Collective, tensor: &Tensor<1>, op: ReduceOp) -> Result<Tensor<1>> {
    run(comm, DeviceOp::AllReduce(op), tensor)
}

/// [`Collective::reduce_scatter`] of `tensor` (`world_size` chunks) over the ranks of
/// `comm`: this rank's reduced chunk.
pub fn reduce_scatter(comm: &dyn Collective, tensor: &Tensor<1>, op: ReduceOp) -> Result<Tensor<1>> {
    run(comm, DeviceOp::ReduceScatter(op), tensor)
}

/// [`Collective::all_gather`] of every rank's `tensor` over the ranks of `comm`, in rank
/// order.
pub fn all_gather(comm: &dyn Collective, tensor: &Tensor<1>) -> Result<Tensor<1>> {
    run(comm, DeviceOp::AllGather, tensor)
}

/// Whether a collective of `comm` on tensors on `device` stays in the device's memory
/// (module docs); where it does not, its input crosses to the host and its output back.
pub fn stays_on_device(comm: &dyn Collective, device: &Device) -> bool {
    comm.reads_device_memory() && device::is_cuda(device)
}

/// `op` of `input` over the ranks of `comm` into a new tensor (module docs).
pub fn run(comm: &dyn Collective, op: DeviceOp, input: &Tensor<1>) -> Result<Tensor<1>> {
    let (len, n) = (input.dims()[0], comm.world_size());
    let out_len = match op {
        DeviceOp::AllReduce(_) => len,
        DeviceOp::ReduceScatter(_) if len % n != 0 => {
            let detail = format!("reduce_scatter of {len} elements over {n} ranks: not {n} equal chunks");
            return Err(Error::Usage(detail));
        }
        DeviceOp::ReduceScatter(_) => len / n,
        DeviceOp::AllGather => len * n,
    };
    let dtype = precision(input.dtype())?;
    let device = input.device();
    if !stays_on_device(comm, &device) {
        return staged(comm, op, input, out_len);
    }
    // Zeros, not `empty`: a buffer some kernel has written, so cubecl hands out its address
    // like any other.
    let output = Tensor::<1>::zeros([out_len], (&device, input.dtype()));
    device::run(comm, op, dtype, input, &output)?;
    Ok(output)
}

/// `op` through host memory: the input's values to the host, the host collective, the
/// result back to the input's device in its dtype.
fn staged(comm: &dyn Collective, op: DeviceOp, input: &Tensor<1>, out_len: usize) -> Result<Tensor<1>> {
    let what = "a collective's input";
    let mut values = into_flat(super::readout::read(input.clone(), what)?, what, input.dims()[0])?;
    let output = match op {
        DeviceOp::AllReduce(op) => {
            comm.all_reduce(values.as_mut(), op)?;
            values
        }
        DeviceOp::ReduceScatter(op) => {
            let mut output = FlatBuf::zeros(values.dtype(), out_len);
            comm.reduce_scatter(values.as_ref(), output.as_mut(), op)?;
            output
        }
        DeviceOp::AllGather => {
            let mut output = FlatBuf::zeros(values.dtype(), out_len);
            comm.all_gather(values.as_ref(), output.as_mut())?;
            output
        }
    };
    Ok(tensor(output, &input.device()))
}

/// The engine's precision of a float dtype.
fn precision(dtype: DType) -> Result<Precision> {
    match dtype {
        DType::F32 => Ok(Precision::Fp32),
        DType::F16 => Ok(Precision::Fp16),
        DType::BF16 => Ok(Precision::Bf16),
        other => Err(Error::Usage(format!("collectives on device tensors take f32, f16 or bf16, not {other:?}"))),
    }
}

#[cfg(feature = "cuda")]
mod device {
    use burn::tensor::Tensor;
    use burn_cubecl::CubeBackend;
    use burn_cubecl::cubecl::cuda::CudaRuntime;
    use burn_cubecl::tensor::CubeTensor;
    use cubecl_runtime::runtime::Runtime;
    use zerotrain_precision::Precision;
    use zerotrain_zero::{Collective, DeviceBuf, DeviceCall, DeviceOp};

    use crate::{Error, Result};

    type CudaServer = <CudaRuntime as Runtime>::Server;

    /// Whether tensors on `device` are CUDA memory.
    pub(super) fn is_cuda(device: &burn::tensor::Device) -> bool {
        use burn::backend::DispatchDevice;
        let device = device.clone().without_autodiff();
        matches!(device.as_dispatch(), DispatchDevice::Cube(burn_cubecl::CubeDevice::Cuda(_)))
    }

    /// The call on the two tensors' buffers, holding them until it returns.
    pub(super) fn run(
        comm: &dyn Collective,
        op: DeviceOp,
        dtype: Precision,
        input: &Tensor<1>,
        output: &Tensor<1>,
    ) -> Result<()> {
        let (in_len, out_len) = (input.dims()[0], output.dims()[0]);
        let (input, output) = (resolve(input)?, resolve(output)?);
        burn_cubecl::cubecl::future::block_on(input.client.sync_buffers([&input.handle, &output.handle]))
            .map_err(|e| Error::Model(format!("the device failed before a collective: {e}")))?;
        let input_resource = input.client.get_resource::<CudaServer>(input.handle.clone()).map_err(address)?;
        let output_resource = output.client.get_resource::<CudaServer>(output.handle.clone()).map_err(address)?;
        let buf = |len: usize, (ptr, size): (u64, u64)| {
            if size < (len * dtype.bytes_per_elem()) as u64 {
                return Err(Error::Model(format!("cubecl's buffer holds {size} bytes for {len} elements")));
            }
            // SAFETY: the resource is held (so the memory is live) until `on_device` has
            // returned, and the device was synchronised above; the input is only read and
            // the output is a tensor made for this call (module note).
            Ok(unsafe { DeviceBuf::new(ptr, len, dtype) })
        };
        let (at_in, at_out) = (input_resource.resource(), output_resource.resource());
        let call = DeviceCall {
            op,
            input: buf(in_len, (at_in.ptr, at_in.size))?,
            output: buf(out_len, (at_out.ptr, at_out.size))?,
        };
        comm.on_device(&call)?;
        drop((input_resource, output_resource, input, output));
        Ok(())
    }

    /// The cubecl tensor under a CUDA tensor, its pending work run; refused when the tensor
    /// is on another backend or not contiguous.
    fn resolve(tensor: &Tensor<1>) -> Result<CubeTensor> {
        let fused = tensor.clone().try_into_primitive::<burn::backend::Cuda>().map_err(|e| {
            Error::Usage(format!("collectives on device tensors need a CUDA tensor (zerotrain.device \"cuda\"): {e:?}"))
        })?;
        let client = fused.client.clone();
        let cube = client.resolve_tensor_float::<CubeBackend>(fused);
        if !cube.is_contiguous() {
            return Err(Error::Usage("collectives on device tensors need contiguous tensors".into()));
        }
        Ok(cube)
    }

    fn address(e: impl std::fmt::Display) -> Error {
        Error::Model(format!("cubecl gave no address for a device buffer: {e}"))
    }
}

#[cfg(not(feature = "cuda"))]
mod device {
    use burn::tensor::Tensor;
    use zerotrain_precision::Precision;
    use zerotrain_zero::{Collective, DeviceOp};

    use crate::{Error, Result};

    /// Without the `cuda` feature no tensor is CUDA memory.
    pub(super) fn is_cuda(_: &burn::tensor::Device) -> bool {
        false
    }

    /// Never called: without CUDA every call is staged.
    pub(super) fn run(_: &dyn Collective, op: DeviceOp, _: Precision, _: &Tensor<1>, _: &Tensor<1>) -> Result<()> {
        Err(Error::Usage(format!("{} on device memory needs a build with the `cuda` feature", op.kind().name())))
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use burn::tensor::Device;
    use zerotrain_zero::ThreadWorld;

    use super::*;

    /// Rank `r`'s values: eighths, exact in every dtype, so each result is one rounding of
    /// sums computed here.
    fn values(r: usize, n: usize) -> Vec<f32> {
        (0..n).map(|i| ((i * 37 + r * 101) % 97) as f32 / 8.0 - 6.0).collect()
    }

    /// Where the communicator's collectives read host memory, tensors are staged through it:
    /// two thread ranks get, in every dtype, the sums (one rounding), chunks and
    /// concatenations computed here, as tensors of the input's dtype on its device, and
    /// their inputs are left as they were. A length the ranks cannot split is refused.
    #[test]
    fn host_collectives_stage_tensors_and_give_their_results() {
        let n = 12;
        let world = ThreadWorld::new(2, Duration::from_secs(20));
        std::thread::scope(|s| {
            for r in 0..2 {
                let comm = world.communicator(r);
                s.spawn(move || {
                    let device = Device::flex();
                    assert!(!stays_on_device(&comm, &device));
                    for dtype in [Precision::Fp32, Precision::Fp16, Precision::Bf16] {
                        let input = tensor(FlatBuf::from_f32(dtype, &values(r, n)), &device);
                        let read = |t: Tensor<1>| {
                            let len = t.dims()[0];
                            let got = into_flat(t.into_data(), "a result", len).unwrap();
                            assert_eq!(got.dtype(), dtype);
                            got.into_f32()
                        };
                        let sums: Vec<f32> = values(0, n).iter().zip(values(1, n)).map(|(a, b)| a + b).collect();
                        let rounded = |v: &[f32]| FlatBuf::from_f32(dtype, v).into_f32();
                        let reduced = all_reduce(&comm, &input, ReduceOp::Sum).unwrap();
                        assert_eq!(read(reduced), rounded(&sums), "{dtype:?}");
                        let chunk = reduce_scatter(&comm, &input, ReduceOp::Sum).unwrap();
                        assert_eq!(read(chunk), rounded(&sums[r * n / 2..(r + 1) * n / 2]), "{dtype:?}");
                        let both: Vec<f32> = [values(0, n), values(1, n)].concat();
                        assert_eq!(read(all_gather(&comm, &input).unwrap()), rounded(&both), "{dtype:?}");
                        assert_eq!(read(input), rounded(&values(r, n)), "the input changed");
                    }
                    let odd = tensor(FlatBuf::F32(values(r, 7)), &device);
                    let err = reduce_scatter(&comm, &odd, ReduceOp::Sum).unwrap_err().to_string();
                    assert!(err.contains("7 elements over 2 ranks"), "{err}");
                });
            }
        });
    }
}
