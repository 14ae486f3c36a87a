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
use zerotrain_zero::{Collective, DeviceOp, Pending, ReduceOp, Request};

use super::flat::{Flat, tensor};
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

/// [`DeviceOp::AllToAll`] of `tensor` (`world_size` equal parts, part `j` for rank `j`)
/// over the ranks of `comm`: the part each rank sent this one, in rank order.
pub fn all_to_all(comm: &dyn Collective, tensor: &Tensor<1>) -> Result<Tensor<1>> {
    run(comm, DeviceOp::AllToAll, tensor)
}

/// A message [`send`] started: it holds the tensor's memory until [`wait`](Self::wait) has
/// seen it sent.
pub struct Sending {
    pending: Pending,
    /// The tensor (and on a GPU, cubecl's hold on its memory) while NCCL reads it.
    _held: Option<Box<dyn std::any::Any + Send>>,
}

impl Sending {
    /// Waits until the message has left (over NCCL: the GPU has sent it); a failure is the
    /// collective's, a timeout naming the receiver among them.
    pub fn wait(self) -> Result<()> {
        self.pending.wait()?;
        Ok(())
    }
}

/// Sends `tensor` (f32, f16 or bf16) to rank `to` of `comm` and returns without waiting for
/// the receiver ([`DeviceOp::Send`] started with [`Collective::start_on_device`] where it
/// stays on the device; else its values read to host memory and sent as
/// [`Collective::send`] sends). Messages to one rank arrive in the order they were sent.
pub fn send(comm: &dyn Collective, tensor: &Tensor<1>, to: usize) -> Result<Sending> {
    let tensor = tensor.clone().without_autodiff();
    let dtype = precision(tensor.dtype())?;
    if !stays_on_device(comm, &tensor.device()) {
        let values = Flat::Device(tensor).into_host("a message")?;
        return Ok(Sending { pending: comm.start(Request::Send { buf: values, to }), _held: None });
    }
    device::start_send(comm, dtype, tensor, to)
}

/// Receives `len` elements of `dtype` from rank `from` of `comm` (what it sent with
/// [`send`]) as a tensor on `device` without autodiff: in place on the device where the
/// call stays there, else through host memory.
pub fn recv(comm: &dyn Collective, from: usize, len: usize, dtype: Precision, device: &Device) -> Result<Tensor<1>> {
    let device = device.clone().without_autodiff();
    if !stays_on_device(comm, &device) {
        let mut values = FlatBuf::zeros(dtype, len);
        comm.recv(values.as_mut(), from)?;
        return Ok(tensor(values, &device));
    }
    // Zeros, not `empty`: a buffer some kernel has written (as in `run`).
    let output = super::flat::zeros(dtype, len, &device);
    device::recv_into(comm, dtype, &output, from)?;
    Ok(output)
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
        DeviceOp::Send(_) | DeviceOp::Recv(_) => {
            return Err(Error::Usage(format!("{}: a message is sent with on_device::send", op.kind().name())));
        }
        DeviceOp::AllReduce(_) => len,
        DeviceOp::ReduceScatter(_) if len % n != 0 => {
            let detail = format!("reduce_scatter of {len} elements over {n} ranks: not {n} equal chunks");
            return Err(Error::Usage(detail));
        }
        DeviceOp::ReduceScatter(_) => len / n,
        DeviceOp::AllGather => len * n,
        DeviceOp::AllToAll => {
            zerotrain_zero::equal_counts(comm.rank(), n, len, len)?;
            len
        }
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
    let mut values = Flat::Device(input.clone()).into_host("a collective's input")?;
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
        DeviceOp::AllToAll => {
            let counts = zerotrain_zero::equal_counts(comm.rank(), comm.world_size(), out_len, out_len)?;
            let mut output = FlatBuf::zeros(values.dtype(), out_len);
            comm.all_to_all(values.as_ref(), &counts, output.as_mut(), &counts)?;
            output
        }
        DeviceOp::Send(_) | DeviceOp::Recv(_) => unreachable!("refused by `run`"),
    };
    Ok(tensor(output, &input.device()))
}

/// Whether `B`'s float tensors are those of Burn's cubecl backend with fusion (wgpu's and
/// CUDA's: one type), which [`run_primitive`] hands to [`run`].
// Without a GPU feature no backend is cubecl's, whatever `B` is.
#[cfg_attr(not(any(feature = "wgpu", feature = "cuda")), allow(clippy::extra_unused_type_parameters))]
pub(crate) fn is_cube<B: burn::backend::Backend>() -> bool {
    #[cfg(any(feature = "wgpu", feature = "cuda"))]
    return cube::is_cube::<B>();
    #[cfg(not(any(feature = "wgpu", feature = "cuda")))]
    false
}

/// [`run`] on a backend's float primitive, flattened (the caller gives the result its
/// shape): for the backend operations of the model's groups (`nn::parallel`), whose
/// default bodies see the fusion backend's tensors. Only where [`is_cube`] says `B`'s
/// tensors are cubecl's; a panic otherwise.
pub(crate) fn run_primitive<B: burn::backend::Backend>(
    comm: &dyn Collective,
    op: DeviceOp,
    x: burn::backend::tensor::FloatTensor<B>,
) -> Result<burn::backend::tensor::FloatTensor<B>> {
    #[cfg(any(feature = "wgpu", feature = "cuda"))]
    return cube::run_primitive::<B>(comm, op, x);
    #[cfg(not(any(feature = "wgpu", feature = "cuda")))]
    {
        let _ = (comm, x);
        Err(Error::Usage(format!("{} of a device tensor needs a build with a GPU feature", op.kind().name())))
    }
}

/// The engine's precision of a float dtype.
pub(crate) fn precision(dtype: DType) -> Result<Precision> {
    match dtype {
        DType::F32 => Ok(Precision::Fp32),
        DType::F16 => Ok(Precision::Fp16),
        DType::BF16 => Ok(Precision::Bf16),
        other => Err(Error::Usage(format!("collectives on device tensors take f32, f16 or bf16, not {other:?}"))),
    }
}

#[cfg(any(feature = "wgpu", feature = "cuda"))]
mod cube;
#[cfg(feature = "cuda")]
mod cuda;
#[cfg(feature = "cuda")]
use cuda as device;
#[cfg(not(feature = "cuda"))]
mod no_cuda;
#[cfg(not(feature = "cuda"))]
use no_cuda as device;

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use burn::tensor::Device;
    use zerotrain_zero::{ThreadComm, ThreadWorld};

    use super::*;
    use crate::engine::readout::into_flat;

    /// Rank `r`'s values: eighths, exact in every dtype, so each result is one rounding of
    /// sums computed here.
    fn values(r: usize, n: usize) -> Vec<f32> {
        (0..n).map(|i| ((i * 37 + r * 101) % 97) as f32 / 8.0 - 6.0).collect()
    }

    /// Where the communicator's collectives read host memory, tensors are staged through it:
    /// two thread ranks get, in every dtype, the sums (one rounding), chunks and
    /// concatenations computed here, as tensors of the input's dtype on its device, and
    /// their inputs are left as they were. A length the ranks cannot split is refused.
    /// Runs `rank` on two thread ranks, each with its communicator, its index and the CPU.
    fn two_ranks(rank: impl Fn(ThreadComm, usize, Device) + Sync) {
        let world = ThreadWorld::new(2, Duration::from_secs(20));
        std::thread::scope(|s| {
            for r in 0..2 {
                let (comm, rank) = (world.communicator(r), &rank);
                s.spawn(move || rank(comm, r, Device::flex()));
            }
        });
    }

    #[test]
    fn host_collectives_stage_tensors_and_give_their_results() {
        let n = 12;
        two_ranks(|comm, r, device| {
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

    /// Messages between two thread ranks (host collectives: staged): rank 0 sends an f32 and
    /// a bf16 tensor without waiting for rank 1, which first sends its own and then receives
    /// both in order, each the values sent, on the device asked for, without autodiff; a
    /// message is not a collective `run` takes.
    #[test]
    fn messages_pass_in_order_without_their_sender_waiting() {
        two_ranks(|comm, r, device| {
            let parts = [(Precision::Fp32, values(r, 5)), (Precision::Bf16, values(r + 2, 3))];
            let sent: Vec<Sending> = parts
                .iter()
                .map(|(dtype, v)| send(&comm, &tensor(FlatBuf::from_f32(*dtype, v), &device).autodiff(), 1 - r))
                .collect::<Result<_>>()
                .unwrap();
            for (dtype, v) in [(Precision::Fp32, values(1 - r, 5)), (Precision::Bf16, values(3 - r, 3))] {
                let got = recv(&comm, 1 - r, v.len(), dtype, &device.clone().autodiff()).unwrap();
                assert!(!got.is_autodiff());
                let got = into_flat(got.into_data(), "a message", v.len()).unwrap();
                assert_eq!(got.dtype(), dtype);
                assert_eq!(got.into_f32(), FlatBuf::from_f32(dtype, &v).into_f32(), "rank {r}");
            }
            sent.into_iter().for_each(|s| s.wait().unwrap());
            let one = tensor(FlatBuf::F32(values(r, 4)), &device);
            let err = run(&comm, DeviceOp::Send(1 - r), &one).unwrap_err().to_string();
            assert!(err.contains("on_device::send"), "{err}");
        });
    }
}
