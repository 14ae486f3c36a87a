//! Causal attention as one Burn operation with a backward of its own.
//!
//! *Note: why an operation of our own.* Under autodiff, Burn 0.22's `attention` runs its
//! unfused fallback (scores, mask, softmax, matmul) and keeps the `[batch, heads, time,
//! time]` probabilities of every layer until backward: at GPT-2 small's context 1024 and
//! batch 8 that is 400 MB a layer in f32. [`causal_attention`] is a backend extension
//! (Burn's `#[backend_extension]`): its forward returns the output and each row's
//! log-sum-exp, autodiff keeps those and the inputs, and its backward forms the
//! probabilities again from them one block of rows at a time (`blocked.rs`), as flash
//! attention does. The GPU builds run it as cubecl kernels (`kernels.rs`, launched from
//! `launch.rs`), registered in the fusion stream as one operation each way; the CPU
//! backend runs the blocked version in its own operations (`blocked.rs`), as do the shapes
//! the kernels refuse.

mod blocked;
#[cfg(any(feature = "wgpu", feature = "cuda"))]
mod kernels;
#[cfg(any(feature = "wgpu", feature = "cuda"))]
mod launch;

#[cfg(any(feature = "wgpu", feature = "cuda"))]
use burn::backend::TensorMetadata;

use burn::backend::autodiff::checkpoint::{base::Checkpointer, strategy::CheckpointStrategy};
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::autodiff::{Autodiff, NodeId};
use burn::backend::tensor::{FloatTensor, IntTensor};
use burn::backend::{AutodiffBackend, Backend, Dispatch, Flex, backend_extension};
use burn::tensor::{Int, Tensor};
use std::sync::atomic::{AtomicBool, Ordering};

/// Causal attention of `q` `[batch, heads, time, head_dim]` over `k` `[batch, kv_heads,
/// keys, head_dim]` and `v` `[batch, kv_heads, keys, value_dim]`, scaled by `scale`:
/// `[batch, heads, time, value_dim]`.
///
/// The queries are the last `time` of the `keys` positions (`keys > time`: a block of
/// queries after cached keys), and each sees the keys up to its own position. Each kv head
/// serves `heads / kv_heads` consecutive query heads (grouped-query attention) without its
/// keys and values being repeated. On the CPU the matmuls run in the inputs' dtype and
/// the softmax in f32; on CUDA and wgpu kernels of its own read and write the tensors in
/// their dtype and compute every product and sum in f32. Under autodiff it keeps the inputs, the output and
/// one f32 value per query row, never the `[time, keys]` probabilities (the module's note).
///
/// # Panics
/// On shapes that do not fit together (naming them), or heads that are not a multiple of
/// the kv heads.
pub fn causal_attention(q: Tensor<4>, k: Tensor<4>, v: Tensor<4>, scale: f32) -> Tensor<4> {
    if let Err(e) = blocked::Dims::of(&q.shape(), &k.shape(), &v.shape()) {
        panic!("causal_attention: {e}");
    }
    let (out, _lse) = <Dispatch as CausalAttentionOps>::causal_attention(
        q.into_dispatch(),
        k.into_dispatch(),
        v.into_dispatch(),
        scale,
    );
    Tensor::from_dispatch(out)
}

/// [`causal_attention`] over rows that pack several sequences (padding-free packing, as
/// flash attention's varlen form runs it): query `t` of row `b` sees the keys from
/// `starts[b, t]`, the first position of its sequence, up to its own, so no sequence
/// attends to another. `starts` `[batch, time]` holds key positions (a query at position
/// `p` has `starts <= p`). Its gradients, like [`causal_attention`]'s, are formed a block
/// of rows at a time; the CUDA and wgpu kernels do not take boundaries yet, so those
/// backends run the blocked version for it.
///
/// # Panics
/// As [`causal_attention`], and where `starts` is not `[batch, time]`.
pub fn packed_causal_attention(
    q: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<4>,
    starts: Tensor<2, Int>,
    scale: f32,
) -> Tensor<4> {
    let dims =
        blocked::Dims::of(&q.shape(), &k.shape(), &v.shape()).unwrap_or_else(|e| panic!("causal_attention: {e}"));
    assert_eq!(starts.dims(), [dims.batch, dims.time], "packed_causal_attention: sequence starts for [batch, time]");
    let (out, _lse) = <Dispatch as CausalAttentionOps>::packed_attention(
        q.into_dispatch(),
        k.into_dispatch(),
        v.into_dispatch(),
        starts.into_dispatch(),
        scale,
    );
    Tensor::from_dispatch(out)
}

/// The backend operations behind [`causal_attention`]: the forward pass with each query
/// row's log-sum-exp, and the backward pass from it. Both default to the blocked version
/// in the backend's own operations.
#[backend_extension(
    Autodiff,
    Flex,
    Cube: cfg(any(feature = "wgpu", feature = "cuda")),
    Fusion: cfg(any(feature = "wgpu", feature = "cuda")),
)]
pub trait CausalAttentionOps: Backend {
    /// The output `[batch, heads, time, value_dim]` and each row's log-sum-exp of its
    /// scaled scores `[batch, heads, time]` (f32).
    #[fusion(meta = fused::forward)]
    fn causal_attention(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        scale: f32,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        blocked::forward::<Self>(q, k, v, None, scale)
    }

    /// The gradients of `q`, `k` and `v` from the output's gradient `grad`, given the
    /// output `out` and log-sum-exp `lse` of [`causal_attention`](Self::causal_attention).
    #[fusion(meta = fused::backward)]
    #[allow(clippy::too_many_arguments)]
    fn causal_attention_backward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        out: FloatTensor<Self>,
        lse: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        scale: f32,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        blocked::backward::<Self>(q, k, v, None, out, lse, grad, scale)
    }

    /// [`causal_attention`](Self::causal_attention) over rows that pack sequences: each
    /// query sees the keys from `starts` `[batch, time]` (its sequence's first key) to its
    /// own position.
    #[fusion(meta = fused::packed_forward)]
    fn packed_attention(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        starts: IntTensor<Self>,
        scale: f32,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        blocked::forward::<Self>(q, k, v, Some(starts), scale)
    }

    /// The gradients of [`packed_attention`](Self::packed_attention), as
    /// [`causal_attention_backward`](Self::causal_attention_backward)'s.
    #[fusion(meta = fused::packed_backward)]
    #[allow(clippy::too_many_arguments)]
    fn packed_attention_backward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        starts: IntTensor<Self>,
        out: FloatTensor<Self>,
        lse: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        scale: f32,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        blocked::backward::<Self>(q, k, v, Some(starts), out, lse, grad, scale)
    }
}

impl CausalAttentionOps for Flex {}

/// Whether [`causal_attention`] runs its own kernels where it has them (CUDA and wgpu).
static KERNELS: AtomicBool = AtomicBool::new(true);

/// Turns [`causal_attention`]'s own kernels on CUDA and wgpu on (the default) or off, for
/// the whole process from its next call, as `torch.backends.cuda.enable_flash_sdp` does
/// for PyTorch's: off, those backends run the blocked version in Burn's own operations (the
/// same results within rounding, and nothing `[time, keys]` kept for backward either), to
/// compare the two or to step around a kernel a device's compiler gets wrong. The CPU
/// always runs the blocked version.
pub fn set_attention_kernels(enabled: bool) {
    KERNELS.store(enabled, Ordering::Relaxed);
}

/// Whether [`causal_attention`]'s own kernels are on ([`set_attention_kernels`]).
pub fn attention_kernels() -> bool {
    KERNELS.load(Ordering::Relaxed)
}

/// The shapes of a call the kernels take (switched on, and shapes they take on the
/// tensors' device: `launch.rs`); `None` for the blocked version.
#[cfg(any(feature = "wgpu", feature = "cuda"))]
fn kernel_dims(
    q: &burn_cubecl::tensor::CubeTensor,
    k: &burn_cubecl::tensor::CubeTensor,
    v: &burn_cubecl::tensor::CubeTensor,
) -> Option<blocked::Dims> {
    let dims = blocked::Dims::of(&q.shape(), &k.shape(), &v.shape()).ok()?;
    (attention_kernels() && launch::takes(q, &dims)).then_some(dims)
}

/// The cubecl kernels, for the shapes they take; the blocked version for the rest.
#[cfg(any(feature = "wgpu", feature = "cuda"))]
impl CausalAttentionOps for burn_cubecl::CubeBackend {
    fn causal_attention(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        scale: f32,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        match kernel_dims(&q, &k, &v) {
            Some(dims) => launch::forward(q, k, v, scale, dims),
            None => blocked::forward::<Self>(q, k, v, None, scale),
        }
    }

    fn causal_attention_backward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        out: FloatTensor<Self>,
        lse: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        scale: f32,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        match kernel_dims(&q, &k, &v) {
            Some(dims) => launch::backward(q, k, v, out, lse, grad, scale, dims),
            None => blocked::backward::<Self>(q, k, v, None, out, lse, grad, scale),
        }
    }
}

/// What the fusion stream registers for each call before the backend runs it: the outputs'
/// shapes and dtypes.
#[cfg(any(feature = "wgpu", feature = "cuda"))]
mod fused {
    use burn::backend::fusion::custom::TensorSpec;
    use burn::tensor::{DType, Shape};

    /// The output (`q`'s dtype, `v`'s last dimension) and the f32 log-sum-exp.
    pub(super) fn forward(q: &TensorSpec, _k: &TensorSpec, v: &TensorSpec, _scale: &f32) -> (TensorSpec, TensorSpec) {
        let (mut out, mut lse) = (q.shape.clone(), q.shape.clone());
        out[3] = v.shape[3];
        lse = Shape::from(lse.as_slice()[..3].to_vec());
        (TensorSpec::new(out, q.dtype), TensorSpec::new(lse, DType::F32))
    }

    /// Each input's gradient, shaped and typed as the input.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn backward(
        q: &TensorSpec,
        k: &TensorSpec,
        v: &TensorSpec,
        _out: &TensorSpec,
        _lse: &TensorSpec,
        _grad: &TensorSpec,
        _scale: &f32,
    ) -> (TensorSpec, TensorSpec, TensorSpec) {
        (q.clone(), k.clone(), v.clone())
    }

    /// As [`forward`]'s.
    pub(super) fn packed_forward(
        q: &TensorSpec,
        k: &TensorSpec,
        v: &TensorSpec,
        _starts: &TensorSpec,
        scale: &f32,
    ) -> (TensorSpec, TensorSpec) {
        forward(q, k, v, scale)
    }

    /// As [`backward`]'s.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn packed_backward(
        q: &TensorSpec,
        k: &TensorSpec,
        v: &TensorSpec,
        _starts: &TensorSpec,
        _out: &TensorSpec,
        _lse: &TensorSpec,
        _grad: &TensorSpec,
        _scale: &f32,
    ) -> (TensorSpec, TensorSpec, TensorSpec) {
        (q.clone(), k.clone(), v.clone())
    }
}

/// The backward step: the inputs (by their checkpointed nodes), the output, the log-sum-exp
/// and the scale.
#[derive(Debug)]
struct AttentionBackward;

impl<B: CausalAttentionOps> Backward<B, 3> for AttentionBackward {
    /// The inputs' nodes, packed rows' sequence starts (`None`: plain causal), the output,
    /// the log-sum-exp and the scale.
    type State = (NodeId, NodeId, NodeId, Option<IntTensor<B>>, FloatTensor<B>, FloatTensor<B>, f32);

    fn backward(self, ops: Ops<Self::State, 3>, grads: &mut Gradients, checkpointer: &mut Checkpointer) {
        let [node_q, node_k, node_v] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        let (q, k, v, starts, out, lse, scale) = ops.state;
        let q = checkpointer.retrieve_node_output::<FloatTensor<B>>(q);
        let k = checkpointer.retrieve_node_output::<FloatTensor<B>>(k);
        let v = checkpointer.retrieve_node_output::<FloatTensor<B>>(v);
        let (dq, dk, dv) = match starts {
            Some(starts) => B::packed_attention_backward(q, k, v, starts, out, lse, grad, scale),
            None => B::causal_attention_backward(q, k, v, out, lse, grad, scale),
        };
        for (node, grad) in [(node_q, dq), (node_k, dk), (node_v, dv)] {
            if let Some(node) = node {
                grads.register::<B>(node.id, grad);
            }
        }
    }
}

/// A float tensor of the autodiff backend over `B`.
type Tracked<B, C> = FloatTensor<Autodiff<B, C>>;

/// The attention of `q`, `k`, `v` under autodiff, bounded by `starts` where rows pack
/// sequences: the inner backend's forward, and where tracked, [`AttentionBackward`] with
/// what it keeps.
fn tracked<B: CausalAttentionOps, C: CheckpointStrategy>(
    (q, k, v): (Tracked<B, C>, Tracked<B, C>, Tracked<B, C>),
    starts: Option<IntTensor<B>>,
    scale: f32,
) -> (Tracked<B, C>, Tracked<B, C>) {
    let forward = |q, k, v, starts: Option<IntTensor<B>>| match starts {
        Some(starts) => B::packed_attention(q, k, v, starts, scale),
        None => B::causal_attention(q, k, v, scale),
    };
    let prepared = AttentionBackward.prepare::<C>([q.node(), k.node(), v.node()]).compute_bound().stateful();
    match prepared {
        OpsKind::Tracked(mut prep) => {
            let (q_id, k_id, v_id) = (prep.checkpoint(&q), prep.checkpoint(&k), prep.checkpoint(&v));
            let (out, lse) = forward(q.into_primitive(), k.into_primitive(), v.into_primitive(), starts.clone());
            let state = (q_id, k_id, v_id, starts, out.clone(), lse.clone(), scale);
            (prep.finish(state, out), <Autodiff<B, C> as AutodiffBackend>::from_inner(lse))
        }
        OpsKind::UnTracked(prep) => {
            let (out, lse) = forward(q.into_primitive(), k.into_primitive(), v.into_primitive(), starts);
            (prep.finish(out), <Autodiff<B, C> as AutodiffBackend>::from_inner(lse))
        }
    }
}

impl<B: CausalAttentionOps, C: CheckpointStrategy> CausalAttentionOps for Autodiff<B, C> {
    fn causal_attention(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        scale: f32,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        tracked::<B, C>((q, k, v), None, scale)
    }

    fn packed_attention(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        starts: IntTensor<Self>,
        scale: f32,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        tracked::<B, C>((q, k, v), Some(starts), scale)
    }
}

#[cfg(test)]
mod tests;
