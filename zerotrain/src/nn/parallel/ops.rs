//! The group operations as one Burn backend extension: a reduction over the group's ranks
//! and the identity that sums its gradient, each with the backward of its own.
//!
//! *Note: why a backend extension.* The copy's backward must call the collective on the
//! gradient, in the middle of Burn's backward pass; only an autodiff step of our own runs
//! code there.
//!
//! *Note: where the values go.* Where the group's collective reads device memory (NCCL's)
//! and the tensor is cubecl's (a CUDA or wgpu tensor under Burn's fusion backend), the
//! operation hands the tensor to `engine::on_device`: on a CUDA device the collective runs
//! on Burn's own buffers and no byte crosses to the host; an all-to-all's parts are cut and
//! joined by tensor operations on the device around one all-to-all of equal parts.
//! Everywhere else (host collectives, CPU tensors) the tensor is read into a host buffer of
//! its dtype and the collective's result written back, which is what a host collective
//! needs. Each group counts the bytes it sent either way ([`ParallelGroup::traffic`]), so
//! that a mesh whose activations should stay on the device can be checked to.
//! Half-precision sums differ between the two: the host collectives sum in f32 and round
//! once, NCCL sums in the dtype.
//!
//! The reduction's step is compute-bound and keeps no state: Burn never recomputes it in
//! backward (that would call the collective out of turn), it keeps its output.

use burn::backend::autodiff::Autodiff;
use burn::backend::autodiff::checkpoint::{base::Checkpointer, strategy::CheckpointStrategy};
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, unary};
use burn::backend::tensor::FloatTensor;
use burn::backend::{AutodiffBackend, Backend, Dispatch, Flex, TensorMetadata, backend_extension};
use burn::tensor::{DType, Shape, Slice, TensorData, try_read_sync};
use zerotrain_precision::BufMut;
use zerotrain_zero::{DeviceOp, ReduceOp};

use super::ParallelGroup;
use crate::engine::on_device;

/// The backend operations behind [`ParallelGroup::reduce_from`], [`ParallelGroup::copy_to`]
/// and [`ParallelGroup::max`]. Their default bodies are every backend's (module docs);
/// autodiff's gives them their backward.
#[backend_extension(
    Autodiff,
    Flex,
    Cube: cfg(any(feature = "wgpu", feature = "cuda")),
    Fusion: cfg(any(feature = "wgpu", feature = "cuda")),
)]
pub trait GroupOps: Backend {
    /// `x` reduced by `op` over the group's ranks, every rank receiving the result.
    #[fusion(default)]
    fn group_reduce(x: FloatTensor<Self>, group: ParallelGroup, op: ReduceOp) -> FloatTensor<Self> {
        match on_the_device::<Self>(&group) {
            true => reduced_on_device::<Self>(x, &group, op),
            false => through_host::<Self>(x, &group, op),
        }
    }

    /// `x` itself (the group's copy: its gradient is summed over the group).
    #[fusion(default)]
    fn group_copy(x: FloatTensor<Self>, group: ParallelGroup) -> FloatTensor<Self> {
        let _ = group;
        x
    }

    /// `x` cut along `dims[0]` into a part per rank, part `j` to rank `j`, the parts
    /// received side by side along `dims[1]` in rank order.
    #[fusion(default)]
    fn group_all_to_all(x: FloatTensor<Self>, group: ParallelGroup, dims: [usize; 2]) -> FloatTensor<Self> {
        match on_the_device::<Self>(&group) {
            true => exchanged_on_device::<Self>(x, &group, dims),
            false => exchanged::<Self>(x, &group, dims),
        }
    }
}

impl GroupOps for Flex {}

#[cfg(any(feature = "wgpu", feature = "cuda"))]
impl GroupOps for burn_cubecl::CubeBackend {}

/// Whether `group`'s operations on `B`'s tensors go through `engine::on_device` (module
/// note: where the values go).
fn on_the_device<B: Backend>(group: &ParallelGroup) -> bool {
    group.collective().reads_device_memory() && on_device::is_cube::<B>()
}

/// The bytes of `x`.
fn bytes<B: Backend>(x: &FloatTensor<B>) -> u64 {
    (x.shape().num_elements() * x.dtype().size()) as u64
}

/// `op` of `x` over `group` on the device (module note); a failure aborts and panics as
/// [`through_host`]'s does.
fn reduced_on_device<B: Backend>(x: FloatTensor<B>, group: &ParallelGroup, op: ReduceOp) -> FloatTensor<B> {
    let shape = x.shape();
    group.counted(true, bytes::<B>(&x));
    let reduced = on_device::run_primitive::<B>(group.collective().as_ref(), DeviceOp::AllReduce(op), x);
    let reduced = reduced.unwrap_or_else(|e| failed(group, "a tensor-parallel reduction", e.to_string()));
    B::float_reshape(reduced, shape)
}

/// [`GroupOps::group_all_to_all`] on the device: the parts cut by slicing and laid end to
/// end, one all-to-all of equal parts, the parts received joined along `gather`; a
/// failure aborts and panics as [`through_host`]'s does.
fn exchanged_on_device<B: Backend>(
    x: FloatTensor<B>,
    group: &ParallelGroup,
    [scatter, gather]: [usize; 2],
) -> FloatTensor<B> {
    let fail = |cause: String| -> ! { failed(group, "a sequence-parallel all-to-all", cause) };
    let (dims, n) = (x.shape().as_slice().to_vec(), group.size());
    if !dims[scatter].is_multiple_of(n) {
        fail(format!("all-to-all over {n} ranks: dimension {scatter} of {dims:?} does not divide into {n} parts"));
    }
    let (part, part_len) = (dims[scatter] / n, dims.iter().product::<usize>() / n);
    let range = |start: usize, len: usize| Slice::new(start as isize, Some((start + len) as isize), 1);
    let cut = |j: usize| -> Vec<Slice> {
        dims.iter()
            .enumerate()
            .map(|(d, &len)| if d == scatter { range(j * part, part) } else { range(0, len) })
            .collect()
    };
    let parts = (0..n).map(|j| B::float_reshape(B::float_slice(x.clone(), &cut(j)), Shape::new([part_len])));
    let send = B::float_cat(parts.collect(), 0);
    group.counted(true, bytes::<B>(&send));
    let received = on_device::run_primitive::<B>(group.collective().as_ref(), DeviceOp::AllToAll, send);
    let received = received.unwrap_or_else(|e| fail(e.to_string()));
    let mut part_dims = dims.clone();
    part_dims[scatter] = part;
    let parts = (0..n).map(|i| {
        let flat = B::float_slice(received.clone(), &[range(i * part_len, part_len)]);
        B::float_reshape(flat, Shape::from(part_dims.clone()))
    });
    B::float_cat(parts.collect(), gather)
}

/// `op` of `x` over `group`: its values read into a host buffer of their dtype, reduced by
/// the group's collective in place, written back on `x`'s device. A failed collective
/// aborts the group's job (every rank's next collective fails, naming this rank) and
/// panics with the cause: the engine reports a panic in a model's forward or backward as
/// the model's error.
fn through_host<B: Backend>(x: FloatTensor<B>, group: &ParallelGroup, op: ReduceOp) -> FloatTensor<B> {
    let device = x.device();
    let comm = group.collective();
    let fail = |cause: String| -> ! { failed(group, "a tensor-parallel reduction", cause) };
    group.counted(false, bytes::<B>(&x));
    let mut data = read::<B>(x).unwrap_or_else(|e| fail(e));
    let dtype = data.dtype();
    let reduced = match dtype {
        DType::F32 => data.as_mut_slice::<f32>().map(|s| comm.all_reduce(BufMut::F32(s), op)),
        DType::F16 => data.as_mut_slice().map(|s| comm.all_reduce(BufMut::F16(s), op)),
        DType::BF16 => data.as_mut_slice().map(|s| comm.all_reduce(BufMut::Bf16(s), op)),
        other => fail(format!("a tensor of {other:?}: only f32, f16 and bf16 are reduced")),
    };
    match reduced {
        Ok(Ok(())) => B::float_from_data(data, &device),
        Ok(Err(e)) => fail(e.to_string()),
        Err(e) => fail(format!("the tensor's data: {e:?}")),
    }
}

/// [`GroupOps::group_all_to_all`] through host memory (in f32, exactly; the result in
/// `x`'s dtype); a failure aborts and panics as [`through_host`]'s does.
fn exchanged<B: Backend>(x: FloatTensor<B>, group: &ParallelGroup, dims: [usize; 2]) -> FloatTensor<B> {
    let (device, shape, dtype) = (x.device(), x.shape(), x.dtype());
    let fail = |cause: String| -> ! { failed(group, "a sequence-parallel all-to-all", cause) };
    group.counted(false, bytes::<B>(&x));
    let values = read::<B>(x)
        .unwrap_or_else(|e| fail(e))
        .convert::<f32>()
        .try_into_vec::<f32>()
        .unwrap_or_else(|e| fail(format!("{e:?}")));
    let (out, out_dims) =
        super::exchange::all_to_all(group, &values, shape.as_slice(), dims).unwrap_or_else(|e| fail(e.to_string()));
    let t = B::float_from_data(TensorData::new(out, out_dims), &device);
    match dtype {
        DType::F32 => t,
        other => B::float_cast(t, other.into()),
    }
}

/// `x`'s values on the host, or why not.
fn read<B: Backend>(x: FloatTensor<B>) -> Result<TensorData, String> {
    match try_read_sync(B::float_into_data(x)) {
        Some(Ok(data)) => Ok(data),
        Some(Err(e)) => Err(format!("reading the tensor: {e:?}")),
        None => Err("reading the tensor: the device did not answer".into()),
    }
}

/// Aborts `group`'s job (every rank's next collective fails, naming this rank) and panics
/// with `what` failed and why.
fn failed(group: &ParallelGroup, what: &str, cause: String) -> ! {
    let reason = format!("{what} failed: {cause}");
    group.collective().abort(&reason);
    panic!("{reason}");
}

/// The all-to-all's backward: the inverse exchange (the dimensions swapped).
#[derive(Debug)]
struct ExchangeBackward(ParallelGroup, [usize; 2]);

impl<B: GroupOps> Backward<B, 1> for ExchangeBackward {
    type State = ();

    fn backward(self, ops: Ops<(), 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let (group, [scatter, gather]) = (self.0, self.1);
        unary::<B, _>(ops.parents, ops.node, grads, |grad| B::group_all_to_all(grad, group, [gather, scatter]));
    }
}

/// The reduction's backward: the sum's gradient is the output's, on every rank (each
/// rank's loss depends on the sum alike).
#[derive(Debug)]
struct SumBackward;

impl<B: Backend> Backward<B, 1> for SumBackward {
    type State = ();

    fn backward(self, ops: Ops<(), 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        unary::<B, _>(ops.parents, ops.node, grads, |grad| grad);
    }
}

/// The copy's backward: the input's gradient is the sum over the group of each rank's
/// output gradient (each rank's branch of the layer contributes its part).
#[derive(Debug)]
struct CopyBackward(ParallelGroup);

impl<B: GroupOps> Backward<B, 1> for CopyBackward {
    type State = ();

    fn backward(self, ops: Ops<(), 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let group = self.0;
        unary::<B, _>(ops.parents, ops.node, grads, |grad| B::group_reduce(grad, group, ReduceOp::Sum));
    }
}

impl<B: GroupOps, C: CheckpointStrategy> GroupOps for Autodiff<B, C> {
    fn group_reduce(x: FloatTensor<Self>, group: ParallelGroup, op: ReduceOp) -> FloatTensor<Self> {
        if op != ReduceOp::Sum {
            // A maximum or minimum passes no gradient: a constant of the graph.
            return <Self as AutodiffBackend>::from_inner(B::group_reduce(Self::inner(x), group, op));
        }
        let prep = SumBackward.prepare::<C>([x.node()]).compute_bound();
        prep.stateless(B::group_reduce(x.into_primitive(), group, op))
    }

    fn group_copy(x: FloatTensor<Self>, group: ParallelGroup) -> FloatTensor<Self> {
        let prep = CopyBackward(group).prepare::<C>([x.node()]).compute_bound();
        prep.stateless(x.into_primitive())
    }

    fn group_all_to_all(x: FloatTensor<Self>, group: ParallelGroup, dims: [usize; 2]) -> FloatTensor<Self> {
        let prep = ExchangeBackward(group.clone(), dims).prepare::<C>([x.node()]).compute_bound();
        prep.stateless(B::group_all_to_all(x.into_primitive(), group, dims))
    }
}

/// Runs `op` of [`GroupOps`] through Burn's dispatch.
pub(super) fn reduce(x: FloatTensor<Dispatch>, group: ParallelGroup, op: ReduceOp) -> FloatTensor<Dispatch> {
    <Dispatch as GroupOps>::group_reduce(x, group, op)
}

/// The group's all-to-all through Burn's dispatch.
pub(super) fn all_to_all(x: FloatTensor<Dispatch>, group: ParallelGroup, dims: [usize; 2]) -> FloatTensor<Dispatch> {
    <Dispatch as GroupOps>::group_all_to_all(x, group, dims)
}

/// The group's copy through Burn's dispatch.
pub(super) fn copy(x: FloatTensor<Dispatch>, group: ParallelGroup) -> FloatTensor<Dispatch> {
    <Dispatch as GroupOps>::group_copy(x, group)
}
