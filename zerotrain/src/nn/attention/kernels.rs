//! Causal attention and its gradients as cubecl kernels: what the GPU builds (CUDA, and
//! wgpu, which CI runs on lavapipe) run, flash attention's way. `launch.rs` chooses and
//! launches them.
//!
//! *Note: the shape of the kernels.* Three kernels, each a cube of [`ROWS`] units over one
//! (batch, head) and one tile of rows, so that nothing `[time, keys]` is ever written:
//! - forward: a unit per query row holds its (scaled) query and its output accumulator; the
//!   cube walks the key tiles its rows can see (causal: none past the tile's last row), each
//!   tile's keys and values staged once in shared memory for all its units, with the online
//!   softmax (running maximum and sum, the accumulator rescaled once a tile). It writes the
//!   output and each row's log-sum-exp.
//! - `dq`: the same walk, each row forming its probabilities again from the log-sum-exp and
//!   `dot(do, v) - D` (`D` = `rowsum(do * out)`), accumulating `dq` in registers.
//! - `dk`/`dv`: a unit per key row holds its key, value and both accumulators; the cube walks
//!   every query head of its kv head's group and the query tiles that can see its keys, each
//!   tile's queries, upstream gradients and row statistics staged in shared memory. A kv
//!   head's gradients come from one unit, so grouped-query attention needs no atomics and
//!   repeats nothing.
//!
//! Every product and sum is in f32 whatever the tensors' dtype; the tensors are read and
//! written in their own. On CUDA (and HIP) the loops over a row's values are unrolled, so
//! that a unit's rows live in registers; on wgpu the driver's compiler decides. The row
//! statistics travel as one `[rows, 2]` tensor (log-sum-exp, `D`) and `dk`, `dv` as one
//! `[keys, head_dim + value_dim]`: wgpu allows a kernel 8 storage buffers, cubecl's
//! metadata among them. Rows too wide for a unit's registers, and on lavapipe work that
//! would run a unit's loops past its compiler's limit, take the blocked version instead
//! (`launch.rs`).

use burn_cubecl::cubecl;
use cubecl::prelude::*;

/// Units per cube: query rows (forward, `dq`) or key rows (`dk`/`dv`) per tile.
pub(super) const ROWS: usize = 32;

/// Below any score: the running maximum before a row has seen a key (finite, so that no
/// `inf - inf` appears).
const LOWEST: f32 = -3.0e38;

/// Loads `rows` rows of `width` values from `src` (rows from `first`, clamped to `last`) into
/// `dst`, converted to f32, each unit of the cube a share of them.
#[cube]
fn stage<E: Float>(
    src: &Tensor<E>,
    dst: &mut Shared<[f32]>,
    base: usize,
    first: usize,
    last: usize,
    #[comptime] rows: usize,
    #[comptime] width: usize,
) {
    let unit = usize::cast_from(UNIT_POS_X);
    let each = comptime!((rows * width).div_ceil(ROWS));
    for i in 0..each {
        let e = i * ROWS + unit;
        if e < comptime!(rows * width) {
            let row = min(first + e / width, last);
            dst[e] = f32::cast_from(src[base + row * width + e % width]);
        }
    }
}

#[cube]
fn dot_shared(a: &Array<f32>, b: &Shared<[f32]>, at: usize, #[comptime] width: usize, #[comptime] unroll: bool) -> f32 {
    let mut sum = f32::new(0.0);
    #[unroll(unroll)]
    for d in 0..width {
        sum += a[d] * b[at + d];
    }
    sum
}

#[cube(launch_unchecked, address_type = "dynamic")]
#[allow(clippy::too_many_arguments)]
pub(super) fn forward_kernel<E: Float>(
    q: &Tensor<E>,
    k: &Tensor<E>,
    v: &Tensor<E>,
    out: &mut Tensor<E>,
    lse: &mut Tensor<f32>,
    scale: f32,
    time: usize,
    keys: usize,
    group: usize,
    #[comptime] head_dim: usize,
    #[comptime] value_dim: usize,
    #[comptime] block: usize,
    #[comptime] unroll: bool,
    #[define(E)] _dtype: ElemType,
) {
    let unit = usize::cast_from(UNIT_POS_X);
    let first_row = usize::cast_from(CUBE_POS_X) * ROWS;
    let heads = usize::cast_from(CUBE_COUNT_Y);
    let bh = usize::cast_from(CUBE_POS_Z) * heads + usize::cast_from(CUBE_POS_Y);
    let kvh = bh / group;
    let past = keys - time;
    let valid = first_row + unit < time;
    let row = min(first_row + unit, time - 1);
    let position = past + row;
    let last_key = past + min(first_row + ROWS, time) - 1;

    let mut query = Array::<f32>::new(head_dim);
    let q_at = (bh * time + row) * head_dim;
    #[unroll(unroll)]
    for d in 0..head_dim {
        query[d] = f32::cast_from(q[q_at + d]) * scale;
    }
    let mut acc = Array::<f32>::new(value_dim);
    #[unroll(unroll)]
    for d in 0..value_dim {
        acc[d] = f32::new(0.0);
    }
    let mut scores = Array::<f32>::new(block);
    let mut ks = Shared::<[f32]>::new_slice(comptime!(block * head_dim));
    let mut vs = Shared::<[f32]>::new_slice(comptime!(block * value_dim));
    let mut running = f32::new(LOWEST);
    let mut sum = f32::new(0.0);

    let tiles = last_key / block + 1;
    for tile in 0..tiles {
        let start = tile * block;
        stage::<E>(k, &mut ks, kvh * keys * head_dim, start, last_key, block, head_dim);
        stage::<E>(v, &mut vs, kvh * keys * value_dim, start, last_key, block, value_dim);
        sync_cube();
        let mut tile_max = f32::new(LOWEST);
        for j in 0..block {
            let s = select(
                start + j <= position,
                dot_shared(&query, &ks, j * head_dim, head_dim, unroll),
                f32::new(LOWEST),
            );
            scores[j] = s;
            tile_max = max(tile_max, s);
        }
        let new_max = max(running, tile_max);
        let correction = (running - new_max).exp();
        sum *= correction;
        #[unroll(unroll)]
        for d in 0..value_dim {
            acc[d] *= correction;
        }
        for j in 0..block {
            if start + j <= position {
                let p = (scores[j] - new_max).exp();
                sum += p;
                #[unroll(unroll)]
                for d in 0..value_dim {
                    acc[d] += p * vs[j * value_dim + d];
                }
            }
        }
        running = new_max;
        sync_cube();
    }
    if valid {
        let o_at = (bh * time + row) * value_dim;
        #[unroll(unroll)]
        for d in 0..value_dim {
            out[o_at + d] = E::cast_from(acc[d] / sum);
        }
        lse[bh * time + row] = running + sum.ln();
    }
}

#[cube(launch_unchecked, address_type = "dynamic")]
#[allow(clippy::too_many_arguments)]
pub(super) fn dq_kernel<E: Float>(
    q: &Tensor<E>,
    k: &Tensor<E>,
    v: &Tensor<E>,
    grad: &Tensor<E>,
    stats: &Tensor<f32>,
    dq: &mut Tensor<E>,
    scale: f32,
    time: usize,
    keys: usize,
    group: usize,
    #[comptime] head_dim: usize,
    #[comptime] value_dim: usize,
    #[comptime] block: usize,
    #[comptime] unroll: bool,
    #[define(E)] _dtype: ElemType,
) {
    let unit = usize::cast_from(UNIT_POS_X);
    let first_row = usize::cast_from(CUBE_POS_X) * ROWS;
    let heads = usize::cast_from(CUBE_COUNT_Y);
    let bh = usize::cast_from(CUBE_POS_Z) * heads + usize::cast_from(CUBE_POS_Y);
    let kvh = bh / group;
    let past = keys - time;
    let valid = first_row + unit < time;
    let row = min(first_row + unit, time - 1);
    let position = past + row;
    let last_key = past + min(first_row + ROWS, time) - 1;

    let mut query = Array::<f32>::new(head_dim);
    let mut acc = Array::<f32>::new(head_dim);
    let q_at = (bh * time + row) * head_dim;
    #[unroll(unroll)]
    for d in 0..head_dim {
        query[d] = f32::cast_from(q[q_at + d]) * scale;
        acc[d] = f32::new(0.0);
    }
    let mut upstream = Array::<f32>::new(value_dim);
    let g_at = (bh * time + row) * value_dim;
    #[unroll(unroll)]
    for d in 0..value_dim {
        upstream[d] = f32::cast_from(grad[g_at + d]);
    }
    let lse = stats[(bh * time + row) * 2];
    let delta = stats[(bh * time + row) * 2 + 1];
    let mut ks = Shared::<[f32]>::new_slice(comptime!(block * head_dim));
    let mut vs = Shared::<[f32]>::new_slice(comptime!(block * value_dim));

    let tiles = last_key / block + 1;
    for tile in 0..tiles {
        let start = tile * block;
        stage::<E>(k, &mut ks, kvh * keys * head_dim, start, last_key, block, head_dim);
        stage::<E>(v, &mut vs, kvh * keys * value_dim, start, last_key, block, value_dim);
        sync_cube();
        for j in 0..block {
            if start + j <= position {
                let p = (dot_shared(&query, &ks, j * head_dim, head_dim, unroll) - lse).exp();
                let ds = p * (dot_shared(&upstream, &vs, j * value_dim, value_dim, unroll) - delta);
                #[unroll(unroll)]
                for d in 0..head_dim {
                    acc[d] += ds * ks[j * head_dim + d];
                }
            }
        }
        sync_cube();
    }
    if valid {
        #[unroll(unroll)]
        for d in 0..head_dim {
            dq[q_at + d] = E::cast_from(acc[d] * scale);
        }
    }
}

#[cube(launch_unchecked, address_type = "dynamic")]
#[allow(clippy::too_many_arguments)]
pub(super) fn dkv_kernel<E: Float>(
    q: &Tensor<E>,
    k: &Tensor<E>,
    v: &Tensor<E>,
    grad: &Tensor<E>,
    stats: &Tensor<f32>,
    dkv: &mut Tensor<E>,
    scale: f32,
    time: usize,
    keys: usize,
    group: usize,
    #[comptime] head_dim: usize,
    #[comptime] value_dim: usize,
    #[comptime] block: usize,
    #[comptime] unroll: bool,
    #[define(E)] _dtype: ElemType,
) {
    let unit = usize::cast_from(UNIT_POS_X);
    let first_key = usize::cast_from(CUBE_POS_X) * ROWS;
    let kv_heads = usize::cast_from(CUBE_COUNT_Y);
    let kvh = usize::cast_from(CUBE_POS_Z) * kv_heads + usize::cast_from(CUBE_POS_Y);
    let past = keys - time;
    let valid = first_key + unit < keys;
    let key = min(first_key + unit, keys - 1);
    // The first query row that sees the tile's first key.
    let first_row = max(first_key, past) - past;

    let mut kr = Array::<f32>::new(head_dim);
    let mut dk = Array::<f32>::new(head_dim);
    let k_at = (kvh * keys + key) * head_dim;
    #[unroll(unroll)]
    for d in 0..head_dim {
        kr[d] = f32::cast_from(k[k_at + d]) * scale;
        dk[d] = f32::new(0.0);
    }
    let mut vr = Array::<f32>::new(value_dim);
    let mut dv = Array::<f32>::new(value_dim);
    let v_at = (kvh * keys + key) * value_dim;
    #[unroll(unroll)]
    for d in 0..value_dim {
        vr[d] = f32::cast_from(v[v_at + d]);
        dv[d] = f32::new(0.0);
    }
    let mut qs = Shared::<[f32]>::new_slice(comptime!(block * head_dim));
    let mut gs = Shared::<[f32]>::new_slice(comptime!(block * value_dim));
    let mut ss = Shared::<[f32]>::new_slice(comptime!(block * 2));

    if first_row < time {
        let tiles = (time - first_row + block - 1) / block;
        for h in 0..group {
            let bh = kvh * group + h;
            for tile in 0..tiles {
                let start = first_row + tile * block;
                stage::<E>(q, &mut qs, bh * time * head_dim, start, time - 1, block, head_dim);
                stage::<E>(grad, &mut gs, bh * time * value_dim, start, time - 1, block, value_dim);
                stage::<f32>(stats, &mut ss, bh * time * 2, start, time - 1, block, 2usize);
                sync_cube();
                for i in 0..block {
                    if start + i < time && key <= past + start + i {
                        let p = (dot_shared(&kr, &qs, i * head_dim, head_dim, unroll) - ss[i * 2]).exp();
                        let ds = p * (dot_shared(&vr, &gs, i * value_dim, value_dim, unroll) - ss[i * 2 + 1]);
                        #[unroll(unroll)]
                        for d in 0..value_dim {
                            dv[d] += p * gs[i * value_dim + d];
                        }
                        #[unroll(unroll)]
                        for d in 0..head_dim {
                            dk[d] += ds * qs[i * head_dim + d];
                        }
                    }
                }
                sync_cube();
            }
        }
    }
    if valid {
        let at = (kvh * keys + key) * comptime!(head_dim + value_dim);
        #[unroll(unroll)]
        for d in 0..head_dim {
            dkv[at + d] = E::cast_from(dk[d] * scale);
        }
        #[unroll(unroll)]
        for d in 0..value_dim {
            dkv[at + head_dim + d] = E::cast_from(dv[d]);
        }
    }
}
