//! Launching the attention kernels (`kernels.rs`), and the shapes and devices they take.

use burn::backend::cubecl::dtype_to_storage_type;
use burn::backend::ops::FloatTensorOps;
use burn::tensor::{DType, FloatDType, Shape};
use burn_cubecl::cubecl;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::{CubeBackend, CubeDevice};
use cubecl::prelude::*;

use super::blocked::Dims;
use super::kernels::{ROWS, dkv_kernel, dq_kernel, forward_kernel};

/// The widest `head_dim + value_dim` the kernels take (a unit holds four rows of it).
const MAX_WIDTH: usize = 512;

/// f32 values a cube stages in shared memory per tile (16 KiB).
const STAGED: usize = 4096;

/// Rows of the other side staged per tile: the most that fit [`STAGED`], at most [`ROWS`].
fn staged_rows(width: usize) -> usize {
    (STAGED / width).clamp(1, ROWS)
}

/// The loop iterations a software adapter's compiler lets one unit run in all (llvmpipe,
/// lavapipe's, ends a shader invocation's loops there so that none can hang the process).
const SOFTWARE_LOOP_LIMIT: usize = 65_535;

/// Whether the kernels take these shapes on `like`'s device: no empty side, widths a unit
/// holds, and on a software adapter (no card behind it: lavapipe) no unit's loops past its
/// limit, which would end them early and silently. The blocked version takes the rest.
pub(super) fn takes(like: &CubeTensor, dims: &Dims) -> bool {
    let software = matches!(like.device, CubeDevice::Wgpu(_)) && like.client.properties().identity.physical.is_none();
    let empty = [dims.heads, dims.value_dim].contains(&0);
    !empty && dims.head_dim + dims.value_dim <= MAX_WIDTH && !(software && loop_iterations(dims) > SOFTWARE_LOOP_LIMIT)
}

/// At most the loop iterations one unit runs in any of the three kernels, no loop unrolled:
/// per tile the staging, and per staged row its dot products and accumulations.
fn loop_iterations(dims: &Dims) -> usize {
    let Dims { time, keys, head_dim: d, value_dim: e, kv_heads, heads, .. } = *dims;
    let stage = |rows: usize, width: usize| (rows * width).div_ceil(ROWS);
    let rows = staged_rows(d + e);
    let tile = stage(rows, d) + stage(rows, e) + 1;
    let forward = keys.div_ceil(rows) * (tile + rows * (2 + d + e) + e) + d + 2 * e;
    let dq = keys.div_ceil(rows) * (tile + rows * (1 + 2 * d + e)) + 2 * d + e;
    let rows = staged_rows(d + e + 2);
    let tile = stage(rows, d) + stage(rows, e) + stage(rows, 2) + 1 + rows * (1 + 2 * d + 2 * e);
    let dkv = heads / kv_heads * (time.div_ceil(rows) * tile + 1) + 2 * (d + e);
    forward.max(dq).max(dkv)
}

/// Whether the kernels unroll their loops over a row's values (so that a unit's rows live
/// in registers): where the compiler is CUDA's or HIP's. Elsewhere (wgpu) the driver's
/// compiler decides: lavapipe's takes minutes over the unrolled kernels at a head width of
/// 64, and a fraction of a second over the loops.
fn unrolled(like: &CubeTensor) -> bool {
    matches!(like.device, CubeDevice::Cuda(_) | CubeDevice::Hip(_))
}

/// Cubes along (tiles of `rows`, heads, batch).
fn cubes(rows: usize, heads: usize, batch: usize) -> CubeCount {
    let count = |n: usize, what: &str| {
        u32::try_from(n)
            .ok()
            .filter(|n| *n <= 65_535)
            .unwrap_or_else(|| panic!("causal_attention: {n} {what} is more than a kernel launch takes (65,535)"))
    };
    CubeCount::Static(count(rows.div_ceil(ROWS), "row tiles"), count(heads, "heads"), count(batch, "batches"))
}

fn empty(like: &CubeTensor, shape: Vec<usize>, dtype: DType) -> CubeTensor {
    empty_device_contiguous_dtype(like.client.clone(), like.device.clone(), Shape::from(shape), dtype)
}

fn address_type(tensors: &[&CubeTensor]) -> AddressType {
    tensors.iter().map(|t| t.required_address_type()).max().unwrap_or_default()
}

/// The output and log-sum-exp of [`super::CausalAttentionOps::causal_attention`].
pub(super) fn forward(q: CubeTensor, k: CubeTensor, v: CubeTensor, scale: f32, dims: Dims) -> (CubeTensor, CubeTensor) {
    let Dims { batch, heads, kv_heads, time, keys, head_dim, value_dim } = dims;
    let (q, k, v) = (into_contiguous(q), into_contiguous(k), into_contiguous(v));
    let out = empty(&q, vec![batch, heads, time, value_dim], q.dtype);
    let lse = empty(&q, vec![batch, heads, time], DType::F32);
    let (client, dtype, unroll) = (q.client.clone(), dtype_to_storage_type(q.dtype), unrolled(&q));
    let address = address_type(&[&q, &k, &v, &out, &lse]);
    // SAFETY: every index the kernel forms is inside its tensor: rows and keys are clamped
    // to the last of them before they are read, and written only when they exist.
    unsafe {
        forward_kernel::launch_unchecked(
            &client,
            cubes(time, heads, batch),
            CubeDim::new_1d(ROWS as u32),
            address,
            q.into_tensor_arg(),
            k.into_tensor_arg(),
            v.into_tensor_arg(),
            out.clone().into_tensor_arg(),
            lse.clone().into_tensor_arg(),
            scale,
            time,
            keys,
            heads / kv_heads,
            head_dim,
            value_dim,
            staged_rows(head_dim + value_dim),
            unroll,
            dtype,
        );
    }
    (out, lse)
}

/// The gradients of `q`, `k` and `v` of
/// [`super::CausalAttentionOps::causal_attention_backward`].
#[allow(clippy::too_many_arguments)]
pub(super) fn backward(
    q: CubeTensor,
    k: CubeTensor,
    v: CubeTensor,
    out: CubeTensor,
    lse: CubeTensor,
    grad: CubeTensor,
    scale: f32,
    dims: Dims,
) -> (CubeTensor, CubeTensor, CubeTensor) {
    let Dims { batch, heads, kv_heads, time, keys, head_dim, value_dim } = dims;
    let f32s = |t: CubeTensor| CubeBackend::float_cast(t, FloatDType::F32);
    // D = rowsum(grad * out) beside the log-sum-exp: [batch, heads, time, 2] in f32.
    let delta = CubeBackend::float_sum_dim(CubeBackend::float_mul(f32s(grad.clone()), f32s(out)), 3);
    let lse = CubeBackend::float_reshape(f32s(lse), Shape::from(vec![batch, heads, time, 1]));
    let stats = into_contiguous(CubeBackend::float_cat(vec![lse, delta], 3));
    let (q, k, v, grad) = (into_contiguous(q), into_contiguous(k), into_contiguous(v), into_contiguous(grad));
    let dq = empty(&q, vec![batch, heads, time, head_dim], q.dtype);
    let dkv = empty(&q, vec![batch, kv_heads, keys, head_dim + value_dim], q.dtype);
    let (client, dtype, group, unroll) =
        (q.client.clone(), dtype_to_storage_type(q.dtype), heads / kv_heads, unrolled(&q));
    let address = address_type(&[&q, &k, &v, &grad, &stats, &dq, &dkv]);
    let width = head_dim + value_dim;
    // SAFETY: as in `forward`; the key tiles' rows likewise.
    unsafe {
        dq_kernel::launch_unchecked(
            &client,
            cubes(time, heads, batch),
            CubeDim::new_1d(ROWS as u32),
            address,
            q.clone().into_tensor_arg(),
            k.clone().into_tensor_arg(),
            v.clone().into_tensor_arg(),
            grad.clone().into_tensor_arg(),
            stats.clone().into_tensor_arg(),
            dq.clone().into_tensor_arg(),
            scale,
            time,
            keys,
            group,
            head_dim,
            value_dim,
            staged_rows(width),
            unroll,
            dtype,
        );
        dkv_kernel::launch_unchecked(
            &client,
            cubes(keys, kv_heads, batch),
            CubeDim::new_1d(ROWS as u32),
            address,
            q.into_tensor_arg(),
            k.into_tensor_arg(),
            v.into_tensor_arg(),
            grad.into_tensor_arg(),
            stats.into_tensor_arg(),
            dkv.clone().into_tensor_arg(),
            scale,
            time,
            keys,
            group,
            head_dim,
            value_dim,
            staged_rows(width + 2),
            unroll,
            dtype,
        );
    }
    let part = |from: usize, to: usize| {
        CubeBackend::float_slice(
            dkv.clone(),
            &[(..).into(), (..).into(), (..).into(), burn::tensor::Slice::new(from as isize, Some(to as isize), 1)],
        )
    };
    (dq, part(0, head_dim), part(head_dim, width))
}
