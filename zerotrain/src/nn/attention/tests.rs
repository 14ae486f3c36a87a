//! [`causal_attention`] against attention and its gradients written out in f64. Unit tests
//! run with blocks of a few rows (`blocked.rs`), so every case crosses block boundaries.

use burn::tensor::{Device, FloatDType, Tensor, TensorData};

use super::causal_attention;

/// One attention problem: shapes, scale and values (the output's upstream gradient too).
struct Case {
    batch: usize,
    heads: usize,
    kv_heads: usize,
    time: usize,
    past: usize,
    head_dim: usize,
    value_dim: usize,
    scale: f32,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    upstream: Vec<f32>,
}

impl Case {
    #[allow(clippy::too_many_arguments)]
    fn new(
        batch: usize,
        heads: usize,
        kv_heads: usize,
        time: usize,
        past: usize,
        d: usize,
        dv: usize,
        seed: u64,
    ) -> Self {
        let mut state = seed;
        let mut draw = |n: usize| -> Vec<f32> {
            (0..n)
                .map(|_| {
                    state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                    (state >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
                })
                .collect()
        };
        let keys = time + past;
        Self {
            batch,
            heads,
            kv_heads,
            time,
            past,
            head_dim: d,
            value_dim: dv,
            scale: 1.3 / (d as f32).sqrt(),
            q: draw(batch * heads * time * d),
            k: draw(batch * kv_heads * keys * d),
            v: draw(batch * kv_heads * keys * dv),
            upstream: draw(batch * heads * time * dv),
        }
    }

    /// The output and the gradients of `sum(out * upstream)` by q, k and v, in f64 from the
    /// definitions: `p = softmax(scale q k^T)` over the keys up to each query's position,
    /// `out = p v`; `dv = p^T g`, `ds = p (g v^T - rowsum(p g v^T))`, `dq = scale ds k`,
    /// `dk = scale ds^T q`; query head `h` uses kv head `h / (heads / kv_heads)`.
    fn reference(&self) -> [Vec<f64>; 4] {
        let (t, keys, d, dv) = (self.time, self.time + self.past, self.head_dim, self.value_dim);
        let group = self.heads / self.kv_heads;
        let mut out = vec![0.0; self.q.len() / d * dv];
        let (mut dq, mut dk, mut dvv) = (vec![0.0; self.q.len()], vec![0.0; self.k.len()], vec![0.0; self.v.len()]);
        let at = |x: &[f32], i: usize| f64::from(x[i]);
        for b in 0..self.batch {
            for h in 0..self.heads {
                let kvh = b * self.kv_heads + h / group;
                for i in 0..t {
                    let qi = ((b * self.heads + h) * t + i) * d;
                    let oi = ((b * self.heads + h) * t + i) * dv;
                    let seen = self.past + i + 1;
                    let s: Vec<f64> = (0..seen)
                        .map(|j| {
                            (0..d).map(|c| at(&self.q, qi + c) * at(&self.k, (kvh * keys + j) * d + c)).sum::<f64>()
                        })
                        .map(|x| x * f64::from(self.scale))
                        .collect();
                    let max = s.iter().copied().fold(f64::MIN, f64::max);
                    let e: Vec<f64> = s.iter().map(|x| (x - max).exp()).collect();
                    let total: f64 = e.iter().sum();
                    let p: Vec<f64> = e.iter().map(|x| x / total).collect();
                    let v_at = |j: usize, c: usize| at(&self.v, (kvh * keys + j) * dv + c);
                    for c in 0..dv {
                        out[oi + c] = (0..seen).map(|j| p[j] * v_at(j, c)).sum();
                    }
                    let g = |c: usize| at(&self.upstream, oi + c);
                    let dp: Vec<f64> = (0..seen).map(|j| (0..dv).map(|c| g(c) * v_at(j, c)).sum()).collect();
                    let row: f64 = (0..seen).map(|j| p[j] * dp[j]).sum();
                    for j in 0..seen {
                        let ds = p[j] * (dp[j] - row) * f64::from(self.scale);
                        for c in 0..dv {
                            dvv[(kvh * keys + j) * dv + c] += p[j] * g(c);
                        }
                        for c in 0..d {
                            dq[qi + c] += ds * at(&self.k, (kvh * keys + j) * d + c);
                            dk[(kvh * keys + j) * d + c] += ds * at(&self.q, qi + c);
                        }
                    }
                }
            }
        }
        [out, dq, dk, dvv]
    }

    /// The output and the gradients by q, k, v through [`causal_attention`] on `device`, in
    /// `dtype`.
    fn run(&self, device: &Device, dtype: FloatDType) -> [Vec<f64>; 4] {
        let keys = self.time + self.past;
        let leaf = |values: &[f32], shape: [usize; 4]| {
            let t = Tensor::<4>::from_data(TensorData::new(values.to_vec(), shape), device).cast(dtype).detach();
            if device.is_autodiff() { t.require_grad() } else { t }
        };
        let q = leaf(&self.q, [self.batch, self.heads, self.time, self.head_dim]);
        let k = leaf(&self.k, [self.batch, self.kv_heads, keys, self.head_dim]);
        let v = leaf(&self.v, [self.batch, self.kv_heads, keys, self.value_dim]);
        let upstream = leaf(&self.upstream, [self.batch, self.heads, self.time, self.value_dim]).detach();
        let out = causal_attention(q.clone(), k.clone(), v.clone(), self.scale);
        let values = |t: Tensor<4>| -> Vec<f64> {
            t.cast(FloatDType::F32).into_data().try_to_vec::<f32>().unwrap().into_iter().map(f64::from).collect()
        };
        if !device.is_autodiff() {
            return [values(out), Vec::new(), Vec::new(), Vec::new()];
        }
        let grads = (out.clone() * upstream).sum().backward();
        let grad = |t: &Tensor<4>| values(t.grad(&grads).expect("a gradient"));
        [values(out), grad(&q), grad(&k), grad(&v)]
    }
}

/// The largest difference relative to `want`'s largest value, or to 0.1 where that is
/// smaller (one token's query and key get no gradient: a softmax of one score is 1 whatever
/// the score).
fn relative_error(got: &[f64], want: &[f64]) -> f64 {
    assert_eq!(got.len(), want.len());
    let scale = want.iter().fold(0.1f64, |m, x| m.max(x.abs()));
    got.iter().zip(want).fold(0.0f64, |m, (g, w)| m.max((g - w).abs())) / scale
}

/// Multi-head, grouped (2 and 4 query heads per kv head), multi-query, 16 heads, one token,
/// lengths that are no multiple of the blocks, and queries after cached keys.
fn cases() -> Vec<(&'static str, Case)> {
    vec![
        ("multi-head", Case::new(2, 3, 3, 7, 0, 5, 3, 1)),
        ("grouped by 2", Case::new(2, 4, 2, 9, 0, 4, 4, 2)),
        ("multi-query, after 4 cached keys", Case::new(1, 4, 1, 5, 4, 4, 6, 3)),
        ("16 heads by 4", Case::new(1, 16, 4, 11, 3, 8, 8, 4)),
        ("one token", Case::new(1, 1, 1, 1, 0, 3, 2, 5)),
        ("one query after 6 keys", Case::new(2, 2, 1, 1, 6, 3, 3, 6)),
    ]
}

/// Every case in `dtype` on Flex with autodiff: the output and every input's gradient
/// within `bound` of their largest value.
fn every_case_within(dtype: FloatDType, bound: f64) {
    let device = Device::flex().autodiff();
    for (name, case) in cases() {
        let (want, got) = (case.reference(), case.run(&device, dtype));
        for (i, what) in ["output", "dq", "dk", "dv"].iter().enumerate() {
            let error = relative_error(&got[i], &want[i]);
            assert!(error <= bound, "{name} in {dtype:?}: {what} off by {error:e} of its largest");
        }
    }
}

/// In f32 the output and every input's gradient are within 2e-6 of their largest value (a
/// few sums of at most 15 f32 terms; 3.9e-7 measured at most).
#[test]
fn output_and_gradients_equal_the_definition_in_f32() {
    every_case_within(FloatDType::F32, 2e-6);
}

/// In fp16 (the matmuls in fp16, the softmax in f32) within 4e-3 of the largest value:
/// scores and probabilities rounded to fp16's 2^-11 (4.9e-4) before their matmuls, over up
/// to 15 terms (1.3e-3 measured at most).
#[test]
fn output_and_gradients_stay_within_fp16_rounding() {
    every_case_within(FloatDType::F16, 4e-3);
}

/// Without autodiff the forward alone, equal to the definition.
#[test]
fn without_autodiff_the_output_equals_the_definition() {
    let case = Case::new(2, 4, 2, 6, 2, 4, 4, 7);
    let got = case.run(&Device::flex(), FloatDType::F32);
    let error = relative_error(&got[0], &case.reference()[0]);
    assert!(error <= 2e-6, "output off by {error:e}");
}

/// Shapes that do not fit are refused, naming what.
#[test]
fn shapes_that_do_not_fit_are_refused_by_name() {
    let device = Device::flex();
    let t = |shape: [usize; 4]| Tensor::<4>::zeros(shape, &device);
    for (q, k, v, says) in [
        ([1, 3, 4, 2], [1, 2, 4, 2], [1, 2, 4, 2], "not a multiple of 2 key-value heads"),
        ([1, 2, 5, 2], [1, 2, 4, 2], [1, 2, 4, 2], "5 queries but only 4 keys"),
        ([1, 2, 4, 2], [1, 2, 4, 3], [1, 2, 4, 2], "do not fit together"),
    ] {
        let caught = std::panic::catch_unwind(|| causal_attention(t(q), t(k), t(v), 1.0));
        let message = caught.err().and_then(|e| e.downcast_ref::<String>().cloned()).unwrap_or_default();
        assert!(message.contains(says), "{q:?} {k:?} {v:?}: {message:?}");
    }
}

/// Rows that pack sequences: the packed attention's output and the gradients of q, k and v
/// (under an upstream gradient) equal each sequence's own causal attention run alone,
/// within 1e-6 in f32, with grouped kv heads and blocks that cross sequence boundaries;
/// a whole row (one sequence) equals plain causal attention.
#[test]
fn packed_rows_attend_within_each_sequence_as_if_alone() {
    use burn::tensor::Int;
    let (batch, heads, kv, time, d) = (2, 4, 2, 11, 3);
    let c = Case::new(batch, heads, kv, time, 0, d, d, 41);
    let device = Device::flex().autodiff();
    let tensor = |v: &[f32], h: usize| {
        Tensor::<4>::from_data(TensorData::new(v.to_vec(), [batch, h, time, d]), &device).require_grad()
    };
    let sequences: [&[(usize, usize)]; 2] = [&[(0, 4), (4, 9), (9, 11)], &[(0, 11)]];
    let starts: Vec<i64> =
        sequences.iter().flat_map(|row| row.iter().flat_map(|&(a, b)| std::iter::repeat_n(a as i64, b - a))).collect();
    let starts = Tensor::<2, Int>::from_data(TensorData::new(starts, [batch, time]), &device);
    let (q, k, v) = (tensor(&c.q, heads), tensor(&c.k, kv), tensor(&c.v, kv));
    let upstream = Tensor::<4>::from_data(TensorData::new(c.upstream.clone(), [batch, heads, time, d]), &device);
    let out = super::packed_causal_attention(q.clone(), k.clone(), v.clone(), starts, c.scale);
    let grads = (out.clone() * upstream.clone()).sum().backward();
    let got = |t: Tensor<4>| t.into_data().try_to_vec::<f32>().unwrap();
    let (out, dq, dk, dv) =
        (got(out), got(q.grad(&grads).unwrap()), got(k.grad(&grads).unwrap()), got(v.grad(&grads).unwrap()));
    let mut worst = 0.0f32;
    for (b, row) in sequences.iter().enumerate() {
        for &(a, e) in row.iter() {
            let part = |t: &Tensor<4>| {
                let values = t.clone().slice([b..b + 1, 0..t.dims()[1], a..e, 0..d]).into_data();
                Tensor::<4>::from_data(values, &device).require_grad()
            };
            let (qs, ks, vs) = (part(&q), part(&k), part(&v));
            let alone = causal_attention(qs.clone(), ks.clone(), vs.clone(), c.scale);
            let up = upstream.clone().slice([b..b + 1, 0..heads, a..e, 0..d]);
            let g = (alone.clone() * up).sum().backward();
            for (name, whole, alone, h) in [
                ("output", &out, got(alone), heads),
                ("dq", &dq, got(qs.grad(&g).unwrap()), heads),
                ("dk", &dk, got(ks.grad(&g).unwrap()), kv),
                ("dv", &dv, got(vs.grad(&g).unwrap()), kv),
            ] {
                for hh in 0..h {
                    for t in a..e {
                        for x in 0..d {
                            let packed = whole[((b * h + hh) * time + t) * d + x];
                            let own = alone[(hh * (e - a) + t - a) * d + x];
                            let diff = (packed - own).abs();
                            worst = worst.max(diff);
                            assert!(
                                diff <= 1e-6,
                                "row {b}, sequence {a}..{e}: {name} [{hh}, {t}, {x}] {packed} vs {own}"
                            );
                        }
                    }
                }
            }
        }
    }
    assert!(worst.is_finite());
}
