//! Causal attention and its gradients over blocks of query rows, in any backend's own
//! operations: what every backend runs until it has a kernel of its own.
//!
//! The queries of one key-value head are stacked along time (`[batch, kv_heads, group *
//! time, head_dim]`, a view of `[batch, heads, time, head_dim]` since the heads of a group are
//! consecutive), so grouped-query attention multiplies each key and value once. Row `r` of
//! that stack is the query at position `past + r % time`, and sees keys `0..=` it. A block of
//! rows forms its scores `[batch, kv_heads, rows, keys]` in f32, and nothing larger: the
//! forward keeps each row's log-sum-exp, and the backward forms each block's probabilities
//! again from it (the recomputation flash attention makes), so no `[time, time]` tensor
//! outlives a block. The matmuls run in the inputs' dtype, the softmax in f32. Rows that
//! pack several sequences give each query its sequence's first key (`starts`), below which
//! it sees nothing, as flash attention's varlen form bounds each sequence.

use burn::backend::tensor::{BoolTensor, FloatTensor, IntTensor};
use burn::backend::{Backend, TensorMetadata, get_or_init_device_settings};
use burn::tensor::{FloatDType, Scalar, Shape, Slice};

/// Scores per block (f32): 16 Mi, 64 MiB (256 in unit tests, so that they cross blocks).
/// A quarter of GPT-2 small's `[heads, time, time]` at 1,024 (one layer, one sequence), so a
/// block is never the whole scores of a long sequence, and under the 128 MiB that software
/// GPU adapters (lavapipe) allocate at most in one buffer: a block of 256 MiB, the whole
/// `[1, 4, 4096, 4096]` of a 4-head model at context 4,096, could not be allocated there.
const BLOCK_SCORES: usize = if cfg!(test) { 1 << 8 } else { 1 << 24 };

/// The shapes of one call, checked.
#[derive(Clone, Copy, Debug)]
pub(super) struct Dims {
    pub batch: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub time: usize,
    pub keys: usize,
    pub head_dim: usize,
    pub value_dim: usize,
}

impl Dims {
    /// The dims of `q` `[batch, heads, time, d]`, `k` `[batch, kv, keys, d]`, `v` `[batch,
    /// kv, keys, dv]`, or what does not fit.
    pub(super) fn of(q: &Shape, k: &Shape, v: &Shape) -> Result<Self, String> {
        let ([b, h, t, d], [bk, kv, tk, dk], [bv, kvv, tv, dv]) = (dims4(q)?, dims4(k)?, dims4(v)?);
        if bk != b || bv != b || kvv != kv || tv != tk || dk != d {
            return Err(format!("queries {q:?}, keys {k:?} and values {v:?} do not fit together"));
        }
        if kv == 0 || h % kv != 0 {
            return Err(format!("{h} query heads are not a multiple of {kv} key-value heads"));
        }
        if tk < t {
            return Err(format!("{t} queries but only {tk} keys: the queries are the last of the keys' positions"));
        }
        if t == 0 || d == 0 || b == 0 {
            return Err(format!("empty queries {q:?}"));
        }
        Ok(Self { batch: b, heads: h, kv_heads: kv, time: t, keys: tk, head_dim: d, value_dim: dv })
    }

    /// Keys before the first query.
    fn past(&self) -> usize {
        self.keys - self.time
    }

    /// Rows of the stacked queries.
    fn rows(&self) -> usize {
        self.heads / self.kv_heads * self.time
    }

    /// Rows per block.
    fn block(&self) -> usize {
        (BLOCK_SCORES / (self.batch * self.kv_heads * self.keys).max(1)).clamp(1, self.rows())
    }
}

fn dims4(shape: &Shape) -> Result<[usize; 4], String> {
    <[usize; 4]>::try_from(shape.as_slice()).map_err(|_| format!("{shape:?} is not 4-dimensional"))
}

/// Rows `start..end` along dimension 2.
fn rows<B: Backend>(t: FloatTensor<B>, start: usize, end: usize) -> FloatTensor<B> {
    B::float_slice(
        t,
        &[Slice::from(..), Slice::from(..), Slice::new(start as isize, Some(end as isize), 1), Slice::from(..)],
    )
}

/// Where rows `start..end` must not look: key `j` past the row's position, and where rows
/// pack sequences ([`Starts`]), before the start of the row's sequence.
fn masked<B: Backend>(
    dims: &Dims,
    start: usize,
    end: usize,
    starts: Option<&Starts<B>>,
    device: &B::Device,
) -> BoolTensor<B> {
    let settings = get_or_init_device_settings::<B>(device);
    let shape = Shape::new([dims.batch, dims.kv_heads, end - start, dims.keys]);
    let positions = B::int_arange(start as i64..end as i64, device, settings.int_dtype);
    let positions = B::int_remainder_scalar(positions, Scalar::Int(dims.time as i64));
    let positions = B::int_add_scalar(positions, Scalar::Int(dims.past() as i64));
    let positions = B::int_expand(B::int_reshape(positions, Shape::new([1, 1, end - start, 1])), shape.clone());
    let keys = B::int_arange(0..dims.keys as i64, device, settings.int_dtype);
    let keys = B::int_expand(B::int_reshape(keys, Shape::new([1, 1, 1, dims.keys])), shape.clone());
    let after = B::int_greater(keys.clone(), positions, settings.bool_dtype);
    let Some(starts) = starts else { return after };
    let first = B::int_slice(starts.0.clone(), &[Slice::from(..), Slice::new(start as isize, Some(end as isize), 1)]);
    let first = B::int_expand(B::int_reshape(first, Shape::new([dims.batch, 1, end - start, 1])), shape);
    B::bool_or(after, B::int_lower(keys, first, settings.bool_dtype))
}

/// Where each stacked query row's sequence starts among the keys, `[batch, rows]`: the
/// `[batch, time]` starts repeated for each query head of a kv head's group.
pub(super) struct Starts<B: Backend>(IntTensor<B>);

impl<B: Backend> Starts<B> {
    /// The rows' starts from `starts` `[batch, time]`, checked against `dims`.
    pub(super) fn of(starts: IntTensor<B>, dims: &Dims) -> Self {
        let shape = starts.shape();
        assert!(
            shape.as_slice() == [dims.batch, dims.time],
            "causal attention: sequence starts {shape:?} for queries [{}, {}]",
            dims.batch,
            dims.time
        );
        let group = dims.heads / dims.kv_heads;
        Self(if group == 1 { starts } else { B::int_cat(vec![starts; group], 1) })
    }
}

/// `[batch, heads, time, x]` as `[batch, kv_heads, group * time, x]` (a view).
fn stacked<B: Backend>(t: FloatTensor<B>, dims: &Dims) -> FloatTensor<B> {
    let x = t.shape()[3];
    B::float_reshape(t, Shape::new([dims.batch, dims.kv_heads, dims.rows(), x]))
}

/// The scaled, masked scores of query rows `q` `[b, kv, rows, d]` (rows `start..`) against
/// `k`, in f32.
fn scores<B: Backend>(
    (dims, starts): (&Dims, Option<&Starts<B>>),
    q: FloatTensor<B>,
    k: &FloatTensor<B>,
    start: usize,
    scale: f32,
) -> FloatTensor<B> {
    let end = start + q.shape()[2];
    let device = q.device();
    let s = B::float_matmul(q, B::float_transpose(k.clone()));
    let s = B::float_mul_scalar(B::float_cast(s, FloatDType::F32), Scalar::Float(f64::from(scale)));
    B::float_mask_fill(s, masked::<B>(dims, start, end, starts, &device), Scalar::Float(f64::NEG_INFINITY))
}

/// The forward pass: the output `[batch, heads, time, dv]` in the inputs' dtype, and each
/// row's log-sum-exp of its scaled scores `[batch, heads, time]` in f32; where `starts`
/// `[batch, time]` is given, each query sees the keys from its start only.
pub(super) fn forward<B: Backend>(
    q: FloatTensor<B>,
    k: FloatTensor<B>,
    v: FloatTensor<B>,
    starts: Option<IntTensor<B>>,
    scale: f32,
) -> (FloatTensor<B>, FloatTensor<B>) {
    let dims = Dims::of(&q.shape(), &k.shape(), &v.shape()).unwrap_or_else(|e| panic!("causal attention: {e}"));
    let starts = starts.map(|s| Starts::of(s, &dims));
    let dtype = FloatDType::from(v.dtype());
    let q = stacked::<B>(q, &dims);
    let (mut outs, mut lses) = (Vec::new(), Vec::new());
    let block = dims.block();
    for start in (0..dims.rows()).step_by(block) {
        let end = (start + block).min(dims.rows());
        let s = scores::<B>((&dims, starts.as_ref()), rows::<B>(q.clone(), start, end), &k, start, scale);
        let max = B::float_max_dim(s.clone(), 3);
        let p = B::float_exp(B::float_sub(s, max.clone()));
        let sum = B::float_sum_dim(p.clone(), 3);
        let out = B::float_matmul(B::float_cast(p, dtype), v.clone());
        outs.push(B::float_cast(B::float_div(B::float_cast(out, FloatDType::F32), sum.clone()), dtype));
        lses.push(B::float_add(max, B::float_log(sum)));
    }
    let out = B::float_reshape(B::float_cat(outs, 2), Shape::new([dims.batch, dims.heads, dims.time, dims.value_dim]));
    let lse = B::float_reshape(B::float_cat(lses, 2), Shape::new([dims.batch, dims.heads, dims.time]));
    (out, lse)
}

/// The gradients of `q`, `k` and `v` (in their dtypes) from the output's gradient `grad`,
/// the output `out` and the log-sum-exp `lse` of [`forward`] (with the same `starts`).
#[allow(clippy::too_many_arguments)]
pub(super) fn backward<B: Backend>(
    q: FloatTensor<B>,
    k: FloatTensor<B>,
    v: FloatTensor<B>,
    starts: Option<IntTensor<B>>,
    out: FloatTensor<B>,
    lse: FloatTensor<B>,
    grad: FloatTensor<B>,
    scale: f32,
) -> (FloatTensor<B>, FloatTensor<B>, FloatTensor<B>) {
    let dims = Dims::of(&q.shape(), &k.shape(), &v.shape()).unwrap_or_else(|e| panic!("causal attention: {e}"));
    let starts = starts.map(|s| Starts::of(s, &dims));
    let (q_dtype, k_dtype, v_dtype) = (q.dtype(), k.dtype(), v.dtype());
    let dtype = FloatDType::from(v_dtype);
    let grad = B::float_cast(grad, dtype);
    let f32 = |t: FloatTensor<B>| B::float_cast(t, FloatDType::F32);
    // D = rowsum(dO * O): the softmax's own term of each row's gradient.
    let d_rows = B::float_sum_dim(B::float_mul(f32(grad.clone()), f32(out)), 3);
    let (q, grad, d_rows) = (stacked::<B>(q, &dims), stacked::<B>(grad, &dims), stacked::<B>(d_rows, &dims));
    let lse = B::float_reshape(lse, Shape::new([dims.batch, dims.kv_heads, dims.rows(), 1]));
    let mut dq: Vec<FloatTensor<B>> = Vec::new();
    let (mut dk, mut dv): (Option<FloatTensor<B>>, Option<FloatTensor<B>>) = (None, None);
    let accumulate = |sum: Option<FloatTensor<B>>, x: FloatTensor<B>| {
        Some(match sum {
            Some(sum) => B::float_add(sum, x),
            None => x,
        })
    };
    let block = dims.block();
    for start in (0..dims.rows()).step_by(block) {
        let end = (start + block).min(dims.rows());
        let q_rows = rows::<B>(q.clone(), start, end);
        let grad_rows = rows::<B>(grad.clone(), start, end);
        let s = scores::<B>((&dims, starts.as_ref()), q_rows.clone(), &k, start, scale);
        let p = B::float_exp(B::float_sub(s, rows::<B>(lse.clone(), start, end)));
        let p_low = B::float_cast(p.clone(), dtype);
        dv = accumulate(dv, f32(B::float_matmul(B::float_transpose(p_low), grad_rows.clone())));
        let dp = f32(B::float_matmul(grad_rows, B::float_transpose(v.clone())));
        let ds = B::float_mul(p, B::float_sub(dp, rows::<B>(d_rows.clone(), start, end)));
        let ds = B::float_cast(B::float_mul_scalar(ds, Scalar::Float(f64::from(scale))), FloatDType::from(q_dtype));
        dq.push(B::float_matmul(ds.clone(), B::float_cast(k.clone(), FloatDType::from(q_dtype))));
        dk = accumulate(dk, f32(B::float_matmul(B::float_transpose(ds), q_rows)));
    }
    let dq = B::float_reshape(B::float_cat(dq, 2), Shape::new([dims.batch, dims.heads, dims.time, dims.head_dim]));
    let dk = B::float_cast(dk.expect("at least one block"), FloatDType::from(k_dtype));
    let dv = B::float_cast(dv.expect("at least one block"), FloatDType::from(v_dtype));
    (B::float_cast(dq, FloatDType::from(q_dtype)), dk, dv)
}
