//! The layers of the Hugging Face families, with Hugging Face's parameter names and layouts
//! (a module path here is the checkpoint's tensor name): projections stored `[out, in]` as
//! `nn.Linear` ([`Dense`]) or `[in, out]` as GPT-2's `Conv1D`, LayerNorm and RMSNorm
//! (`weight`, `bias`), embeddings, causal attention over grouped heads, rotary positions.
//! Norms and softmax compute in f32 whatever the model's dtype, as Hugging Face's do.

use burn::module::{Module, Param};
use burn::tensor::module::{embedding, layer_norm, linear};
use burn::tensor::{FloatDType, Int, Tensor, TensorData};

use crate::Packing;
use crate::hf::rope::RopeScaling;
use crate::hf::weights::{Init, Weights};
pub use crate::kv_cache::KvCache;
pub(crate) use crate::kv_cache::with_cached;
use zerotrain::nn::parallel::{ParallelGroup, Split, vocab_parallel_lookup};

mod projections;
pub use projections::{Conv1D, Cut, Dense};

/// Causal attention of `q`, `k`, `v` `[batch, heads, time, head_dim]` (as
/// [`causal_attention`]) where each rank of `seq` holds a consecutive part of the sequence
/// (DeepSpeed-Ulysses): the parts are traded for all of the sequence of a share of the
/// heads, attended, and traded back; `[batch, time, heads * head_dim]` of this rank's part.
/// Where rows pack sequences (`packed`), each query attends within its own, however the
/// sequence cut falls across them: the ranks attend whole rows.
pub fn sequence_parallel_attention(
    q: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<4>,
    seq: &ParallelGroup,
    packed: Option<&Packing>,
) -> Tensor<3> {
    if seq.size() == 1 {
        return attention(q, k, v, None, packed);
    }
    let [b, h, t, hd] = q.dims();
    let scale = (hd as f32).sqrt().recip();
    let whole = |x: Tensor<4>| seq.all_to_all(x, 1, 2);
    let out = match packed {
        Some(p) => zerotrain::nn::packed_causal_attention(whole(q), whole(k), whole(v), p.starts.clone(), scale),
        None => zerotrain::nn::causal_attention(whole(q), whole(k), whole(v), scale),
    };
    seq.all_to_all(out, 2, 1).swap_dims(1, 2).reshape([b, t, h * hd])
}

/// Position ids of `time` tokens: `start..start + time` as `[1, time]`, or where rows pack
/// sequences, each token's position in its own (`[batch, time]`, this rank's part).
pub fn positions(start: usize, time: usize, packed: Option<&Packing>, device: &burn::tensor::Device) -> Tensor<2, Int> {
    match packed {
        Some(p) => p.positions.clone(),
        None => Tensor::<1, Int>::arange(start as i64..(start + time) as i64, device).reshape([1, time]),
    }
}

/// A training or scoring pass's attention: [`causal_attention`], over the sequence group
/// where `seq` splits each row ([`sequence_parallel_attention`]), each query inside its own
/// sequence where rows pack several (`packed`: [`zerotrain::nn::packed_causal_attention`]).
pub fn attention(
    q: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<4>,
    seq: Option<&ParallelGroup>,
    packed: Option<&Packing>,
) -> Tensor<3> {
    match (seq, packed) {
        (Some(seq), _) => sequence_parallel_attention(q, k, v, seq, packed),
        (None, None) => causal_attention(q, k, v),
        (None, Some(p)) => {
            let [b, h, t, hd] = q.dims();
            let scale = (hd as f32).sqrt().recip();
            let out = zerotrain::nn::packed_causal_attention(q, k, v, p.starts.clone(), scale);
            out.swap_dims(1, 2).reshape([b, t, h * hd])
        }
    }
}

/// LayerNorm with `weight` and `bias`, in f32.
#[derive(Module, Debug)]
pub struct Norm {
    weight: Param<Tensor<1>>,
    bias: Param<Tensor<1>>,
    #[module(skip)]
    eps: f64,
}

impl Norm {
    /// `name.weight` and `name.bias` of width `d`.
    pub fn new(w: &Weights, name: &str, d: usize, eps: f64) -> Self {
        Self {
            weight: w.param(&format!("{name}.weight"), [d], Init::Ones),
            bias: w.param(&format!("{name}.bias"), [d], Init::Zeros),
            eps,
        }
    }

    /// `(x - mean) / sqrt(var + eps) * weight + bias` over the last dimension.
    pub fn forward(&self, x: Tensor<3>) -> Tensor<3> {
        let dtype = x.dtype();
        let f32 = |t: Tensor<1>| t.cast(FloatDType::F32);
        let y = layer_norm(x.cast(FloatDType::F32), f32(self.weight.val()), Some(f32(self.bias.val())), self.eps);
        y.cast(dtype)
    }
}

/// RMSNorm with `weight`: `x / rms(x)` in f32, then scaled in the model's dtype (as
/// `LlamaRMSNorm`).
#[derive(Module, Debug)]
pub struct RmsNorm {
    weight: Param<Tensor<1>>,
    #[module(skip)]
    eps: f64,
}

impl RmsNorm {
    /// `name.weight` of width `d`.
    pub fn new(w: &Weights, name: &str, d: usize, eps: f64) -> Self {
        Self { weight: w.param(&format!("{name}.weight"), [d], Init::Ones), eps }
    }

    /// `x / sqrt(mean(x^2) + eps) * weight` over the last dimension.
    pub fn forward(&self, x: Tensor<3>) -> Tensor<3> {
        let dtype = x.dtype();
        let x = x.cast(FloatDType::F32);
        let rms = x.clone().square().mean_dim(2).add_scalar(self.eps).sqrt();
        let weight = self.weight.val();
        let d = weight.dims()[0];
        (x / rms).cast(dtype) * weight.reshape([1, 1, d])
    }
}

/// A token (or position) embedding table `weight` `[rows, d]`: whole, or this rank's rows
/// of a vocabulary split over a tensor-parallel group.
#[derive(Module, Debug)]
pub struct Embed {
    weight: Param<Tensor<2>>,
    /// The group and the first row this rank holds, where the rows are split.
    #[module(skip)]
    split: Option<(ParallelGroup, usize)>,
}

impl Embed {
    /// `name.weight` `[rows, d]`, whole on every rank.
    pub fn new(w: &Weights, name: &str, rows: usize, d: usize) -> Self {
        Self { weight: w.param(&format!("{name}.weight"), [rows, d], Init::Normal), split: None }
    }

    /// `name.weight` `[rows, d]` with its rows split over `w`'s group (a vocabulary: parts
    /// that need not be equal).
    pub fn vocabulary(w: &Weights, name: &str, rows: usize, d: usize) -> Self {
        let group = w.tensor_parallel();
        let weight = w.split_param(&format!("{name}.weight"), [rows, d], Split::Uneven { dim: 0 }, Init::Normal);
        let split = (group.size() > 1).then(|| (group.clone(), group.part(rows).start));
        Self { weight, split }
    }

    /// `[batch, time] -> [batch, time, d]`, the same on every rank.
    pub fn forward(&self, ids: Tensor<2, Int>) -> Tensor<3> {
        match &self.split {
            Some((group, first)) => vocab_parallel_lookup(self.weight.val(), *first, ids, group),
            None => embedding(self.weight.val(), ids),
        }
    }

    /// Logits `h E^T` `[batch, time, rows]` (a head tied to this table): this rank's part
    /// of the vocabulary where the rows are split.
    pub fn logits(&self, h: Tensor<3>) -> Tensor<3> {
        let h = match &self.split {
            Some((group, _)) => group.copy_to(h),
            None => h,
        };
        linear(h, self.weight.val().transpose(), None)
    }

    /// The table `[rows, d]` (this rank's rows): a tied head's weight, for its loss.
    pub fn table(&self) -> Tensor<2> {
        self.weight.val()
    }
}

/// Causal attention of `q` `[batch, heads, time, head_dim]` over `k`, `v`
/// `[batch, kv_heads, past + time, head_dim]` (each kv head serves `heads / kv_heads` query
/// heads, consecutively; the queries are the last `time` of the positions), scaled by
/// `1/sqrt(head_dim)`; `[batch, time, heads * head_dim]`.
///
/// Through [`zerotrain::nn::causal_attention`]: on the CPU both matmuls in the model's
/// dtype and the softmax in f32, as Hugging Face's eager attention computes it; on CUDA and
/// wgpu its own kernels, every product in f32; grouped-query attention without copies of
/// the keys and values; and under autodiff nothing of `[time, keys]` kept for backward.
pub fn causal_attention(q: Tensor<4>, k: Tensor<4>, v: Tensor<4>) -> Tensor<3> {
    let [b, h, t, hd] = q.dims();
    let scale = (hd as f32).sqrt().recip();
    zerotrain::nn::causal_attention(q, k, v, scale).swap_dims(1, 2).reshape([b, t, h * hd])
}

/// `[batch, time, heads * head_dim] -> [batch, heads, time, head_dim]`.
pub fn split_heads(x: Tensor<3>, heads: usize) -> Tensor<4> {
    let [b, t, width] = x.dims();
    x.reshape([b, t, heads, width / heads]).swap_dims(1, 2)
}

/// Rotary positions: the inverse frequencies of each pair of a head's dimensions.
#[derive(Debug, Clone)]
pub struct Rope {
    inv_freq: Vec<f64>,
}

impl Rope {
    /// `theta^(-2i/head_dim)` for `i < head_dim / 2`, stretched as `scaling` says.
    pub fn new(head_dim: usize, theta: f64, scaling: RopeScaling) -> Self {
        let base = (0..head_dim / 2).map(|i| theta.powf(-((2 * i) as f64) / head_dim as f64));
        let inv_freq = match scaling {
            RopeScaling::None => base.collect(),
            RopeScaling::Linear { factor } => base.map(|f| f / factor).collect(),
            RopeScaling::Llama3 { factor, low_freq_factor, high_freq_factor, original_max_position_embeddings } => {
                let old = original_max_position_embeddings;
                let (low_wavelen, high_wavelen) = (old / low_freq_factor, old / high_freq_factor);
                base.map(|f| {
                    let wavelen = 2.0 * std::f64::consts::PI / f;
                    if wavelen < high_wavelen {
                        f
                    } else if wavelen > low_wavelen {
                        f / factor
                    } else {
                        let smooth = (old / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor);
                        (1.0 - smooth) * f / factor + smooth * f
                    }
                })
                .collect()
            }
        };
        Self { inv_freq }
    }

    /// Queries `q` and keys `k` `[batch, heads, time, head_dim]` rotated by position
    /// (Hugging Face's half-split pairing: dimension `i` with `i + head_dim / 2`), their
    /// first row at position `start`; one table of angles serves both.
    pub fn rotate(&self, q: Tensor<4>, k: Tensor<4>, start: usize) -> (Tensor<4>, Tensor<4>) {
        let [_, _, t, hd] = q.dims();
        let (cos, sin) = self.table(start..start + t, hd);
        let device = q.device();
        let dtype = q.dtype();
        let table = |v: Vec<f32>| Tensor::<4>::from_data(TensorData::new(v, [1, 1, t, hd]), &device).cast(dtype);
        Self::apply(q, k, (table(cos), table(sin)))
    }

    /// [`rotate`](Self::rotate) where each row `b`'s query `t` is at position
    /// `positions[b, t]` (rows packing sequences, each from 0), every position below `len`;
    /// the angles are those `rotate` computes, gathered.
    pub fn rotate_at(
        &self,
        q: Tensor<4>,
        k: Tensor<4>,
        positions: &Tensor<2, Int>,
        len: usize,
    ) -> (Tensor<4>, Tensor<4>) {
        let [b, _, t, hd] = q.dims();
        let (cos, sin) = self.table(0..len, hd);
        let (device, dtype) = (q.device(), q.dtype());
        let at = positions.clone().reshape([b * t]);
        let table = |v: Vec<f32>| {
            let whole = Tensor::<2>::from_data(TensorData::new(v, [len, hd]), &device).cast(dtype);
            whole.select(0, at.clone()).reshape([b, 1, t, hd])
        };
        Self::apply(q, k, (table(cos), table(sin)))
    }

    /// The cosines and sines `[positions, head_dim]` of `positions`' angles.
    fn table(&self, positions: std::ops::Range<usize>, hd: usize) -> (Vec<f32>, Vec<f32>) {
        let half = hd / 2;
        let n = positions.len() * hd;
        let (mut cos, mut sin) = (Vec::with_capacity(n), Vec::with_capacity(n));
        for pos in positions {
            for i in 0..hd {
                let angle = pos as f64 * self.inv_freq[i % half];
                cos.push(angle.cos() as f32);
                sin.push(angle.sin() as f32);
            }
        }
        (cos, sin)
    }

    /// `q` and `k` rotated by the angles' cosines and sines (broadcast over the heads).
    fn apply(q: Tensor<4>, k: Tensor<4>, (cos, sin): (Tensor<4>, Tensor<4>)) -> (Tensor<4>, Tensor<4>) {
        let [_, _, t, hd] = q.dims();
        let half = hd / 2;
        let apply = |x: Tensor<4>| {
            let [b, h, _, _] = x.dims();
            let first = x.clone().slice([0..b, 0..h, 0..t, 0..half]);
            let second = x.clone().slice([0..b, 0..h, 0..t, half..hd]);
            let rotated = Tensor::cat(vec![second.neg(), first], 3);
            x * cos.clone() + rotated * sin.clone()
        };
        (apply(q), apply(k))
    }
}

#[cfg(test)]
mod tests {
    use burn::tensor::{Device, FloatDType, Tensor, TensorData};

    use super::causal_attention;

    /// `[b, heads, len, hd]` values in [-1, 1) from a fixed sequence, rounded to `dtype`.
    fn values(dims: [usize; 4], seed: u64, dtype: FloatDType, device: &Device) -> (Tensor<4>, Vec<f64>) {
        let n: usize = dims.iter().product();
        let raw: Vec<f32> = (0..n as u64).map(|i| (((i + seed) * 2_654_435_761 % 1000) as f32 / 500.0) - 1.0).collect();
        let t = Tensor::<4>::from_data(TensorData::new(raw, dims), device).cast(dtype);
        let rounded = t.clone().cast(FloatDType::F32).into_data().try_to_vec::<f32>().unwrap();
        (t, rounded.into_iter().map(f64::from).collect())
    }

    /// Attention in f64 from the definition: query `i` of `t` sits at position `keys - t + i`
    /// and sees the keys up to it; query head `hq` reads kv head `hq / (h / kv)`.
    #[allow(clippy::too_many_arguments)]
    fn reference(
        q: &[f64],
        k: &[f64],
        v: &[f64],
        b: usize,
        h: usize,
        kv: usize,
        t: usize,
        keys: usize,
        hd: usize,
    ) -> Vec<f64> {
        let mut out = vec![0.0; b * t * h * hd];
        for bi in 0..b {
            for hq in 0..h {
                let hk = hq / (h / kv);
                for i in 0..t {
                    let seen = keys - t + i + 1;
                    let at = |x: &[f64], heads: usize, head: usize, len: usize, row: usize| {
                        let base = ((bi * heads + head) * len + row) * hd;
                        x[base..base + hd].to_vec()
                    };
                    let query = at(q, h, hq, t, i);
                    let scores: Vec<f64> = (0..seen)
                        .map(|j| {
                            at(k, kv, hk, keys, j).iter().zip(&query).map(|(a, b)| a * b).sum::<f64>()
                                / (hd as f64).sqrt()
                        })
                        .collect();
                    let top = scores.iter().cloned().fold(f64::MIN, f64::max);
                    let weights: Vec<f64> = scores.iter().map(|s| (s - top).exp()).collect();
                    let total: f64 = weights.iter().sum();
                    for (j, w) in weights.iter().enumerate() {
                        for (d, value) in at(v, kv, hk, keys, j).iter().enumerate() {
                            out[((bi * t + i) * h + hq) * hd + d] += w / total * value;
                        }
                    }
                }
            }
        }
        out
    }

    /// Grouped heads (1 to 3 query heads per kv head), a block of queries after cached keys,
    /// one new query, lengths that are not powers of two: within 1e-5 of the f64 reference in
    /// f32; in bf16 within 0.03, the bound from its roundings (inputs here are exact in bf16;
    /// a score |s| <= sqrt(head_dim) = 2 rounded to bf16 moves by up to 2 x 2^-8, so a
    /// probability by a factor within 1 +- 0.016; the probabilities rounded, 2^-8 each; the
    /// output, |v| <= 1, rounded once more: 0.016 + 0.004 + 0.004 < 0.03).
    #[test]
    fn attention_equals_the_f64_reference_for_groups_cached_keys_and_bf16() {
        let device = Device::flex();
        let (b, hd) = (2, 4);
        for (dtype, bound) in [(FloatDType::F32, 1e-5), (FloatDType::BF16, 0.03)] {
            for (h, kv, t, keys) in [(4, 2, 5, 5), (3, 1, 3, 7), (3, 3, 1, 6), (6, 2, 7, 7), (2, 2, 9, 9)] {
                let (q, qr) = values([b, h, t, hd], 1, dtype, &device);
                let (k, kr) = values([b, kv, keys, hd], 2, dtype, &device);
                let (v, vr) = values([b, kv, keys, hd], 3, dtype, &device);
                let got = causal_attention(q, k, v);
                assert_eq!(got.dims(), [b, t, h * hd]);
                assert_eq!(got.dtype(), dtype.into());
                let got = got.cast(FloatDType::F32).into_data().try_to_vec::<f32>().unwrap();
                let want = reference(&qr, &kr, &vr, b, h, kv, t, keys, hd);
                let worst = got.iter().zip(&want).map(|(g, w)| (f64::from(*g) - w).abs()).fold(0.0, f64::max);
                assert!(worst <= bound, "{dtype:?} h {h} kv {kv} t {t} keys {keys}: off by {worst}");
            }
        }
    }
}
