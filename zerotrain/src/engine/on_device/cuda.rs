//! Handing Burn's CUDA buffers to the communicator (the note in `on_device`): a tensor's
//! cubecl buffer resolved, the device synchronised, its address held as a `DeviceBuf` for
//! the call. Without the `cuda` feature no tensor is CUDA memory and nothing here runs.

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
    let (in_buf, input_resource) = address(&input, in_len, dtype)?;
    let (out_buf, output_resource) = address(&output, out_len, dtype)?;
    let call = DeviceCall { op, input: in_buf, output: out_buf };
    comm.on_device(&call)?;
    drop((input_resource, output_resource, input, output));
    Ok(())
}

/// The device address of `cube`'s `len` elements of `dtype`, with cubecl's hold on the
/// memory (the memory stays live while it is held), after the device has finished
/// writing it.
fn address(cube: &CubeTensor, len: usize, dtype: Precision) -> Result<(DeviceBuf, impl Send + 'static)> {
    burn_cubecl::cubecl::future::block_on(cube.client.sync_buffers([&cube.handle]))
        .map_err(|e| Error::Model(format!("the device failed before a collective: {e}")))?;
    let resource = cube.client.get_resource::<CudaServer>(cube.handle.clone()).map_err(no_address)?;
    let (ptr, size) = (resource.resource().ptr, resource.resource().size);
    if size < (len * dtype.bytes_per_elem()) as u64 {
        return Err(Error::Model(format!("cubecl's buffer holds {size} bytes for {len} elements")));
    }
    // SAFETY: the resource is held as long as the call uses the memory (each caller keeps
    // it until its call has finished), and the device was synchronised above; inputs
    // are only read, outputs are tensors made for the call (module note).
    Ok((unsafe { DeviceBuf::new(ptr, len, dtype) }, resource))
}

/// `tensor` sent to `to`, started; the returned message holds the tensor and its memory.
pub(super) fn start_send(
    comm: &dyn Collective,
    dtype: Precision,
    tensor: Tensor<1>,
    to: usize,
) -> Result<super::Sending> {
    let len = tensor.dims()[0];
    let cube = resolve(&tensor)?;
    let (input, resource) = address(&cube, len, dtype)?;
    let call = DeviceCall { op: DeviceOp::Send(to), input, output: DeviceBuf::empty(dtype) };
    let pending = comm.start_on_device(&call)?;
    Ok(super::Sending { pending, _held: Some(Box::new((resource, cube, tensor))) })
}

/// The message from `from` received into `output`, a tensor made for it.
pub(super) fn recv_into(comm: &dyn Collective, dtype: Precision, output: &Tensor<1>, from: usize) -> Result<()> {
    let cube = resolve(output)?;
    let (buf, resource) = address(&cube, output.dims()[0], dtype)?;
    comm.on_device(&DeviceCall { op: DeviceOp::Recv(from), input: DeviceBuf::empty(dtype), output: buf })?;
    drop((resource, cube));
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

fn no_address(e: impl std::fmt::Display) -> Error {
    Error::Model(format!("cubecl gave no address for a device buffer: {e}"))
}
