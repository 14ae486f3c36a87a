//! zerotrain's own operations (`zerotrain::nn`) on the device, through the backend's
//! fusion stream: causal attention and the loss over blocks of tokens, their outputs and
//! every input's gradient, against Burn's unfused attention and loss on the CPU in f32 (an
//! implementation that shares none of their code).

use burn::tensor::activation::{log_softmax, softmax};
use burn::tensor::{Bool, Device, FloatDType, Int, Tensor, TensorData};
use zerotrain::nn::{LinearCrossEntropy, causal_attention, packed_causal_attention, set_attention_kernels};

use super::Gpu;

/// Deterministic values in [-1, 1).
fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut state = seed;
    (0..n)
        .map(|_| {
            state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (state >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
        })
        .collect()
}

/// A leaf requiring its gradient, in `dtype`.
fn leaf<const D: usize>(v: &[f32], shape: [usize; D], device: &Device, dtype: FloatDType) -> Tensor<D> {
    Tensor::<D>::from_data(TensorData::new(v.to_vec(), shape), device).cast(dtype).detach().require_grad()
}

fn read<const D: usize>(t: Tensor<D>) -> Vec<f64> {
    t.cast(FloatDType::F32).into_data().try_to_vec::<f32>().unwrap().into_iter().map(f64::from).collect()
}

/// The largest difference relative to `want`'s largest value.
fn relative_error(got: &[f64], want: &[f64]) -> f64 {
    assert_eq!(got.len(), want.len());
    let scale = want.iter().fold(0.0f64, |m, x| m.max(x.abs())).max(f64::MIN_POSITIVE);
    got.iter().zip(want).fold(0.0f64, |m, (g, w)| m.max((g - w).abs())) / scale
}

/// Attention `[batch, heads, time, d]` over `kv_heads` after `past` cached keys, values of
/// `dv`: the output and the gradients of `sum(out * upstream)` by q, k, v. `fused`: through
/// [`causal_attention`]; else Burn's unfused ops with the kv heads repeated.
fn attention(device: &Device, dtype: FloatDType, fused: bool, shape: [usize; 7]) -> [Vec<f64>; 4] {
    let [b, h, kv, t, past, d, dv] = shape;
    let keys = past + t;
    let q = leaf(&values(b * h * t * d, 1), [b, h, t, d], device, dtype);
    let k = leaf(&values(b * kv * keys * d, 2), [b, kv, keys, d], device, dtype);
    let v = leaf(&values(b * kv * keys * dv, 3), [b, kv, keys, dv], device, dtype);
    let upstream =
        Tensor::<4>::from_data(TensorData::new(values(b * h * t * dv, 4), [b, h, t, dv]), device).cast(dtype);
    let scale = 0.4f32;
    let out = match fused {
        true => causal_attention(q.clone(), k.clone(), v.clone(), scale),
        false => {
            let repeat = |x: Tensor<4>| {
                let w = x.dims()[3];
                x.reshape([b, kv, 1, keys, w]).expand([b, kv, h / kv, keys, w]).reshape([b, h, keys, w])
            };
            let scores = q.clone().matmul(repeat(k.clone()).swap_dims(2, 3)).mul_scalar(scale);
            let positions = Tensor::<1, Int>::arange(past as i64..keys as i64, device).reshape([t, 1]);
            let future: Tensor<2, Bool> =
                Tensor::<1, Int>::arange(0..keys as i64, device).reshape([1, keys]).greater(positions);
            let mask = future.reshape([1, 1, t, keys]).expand([b, h, t, keys]);
            softmax(scores.mask_fill(mask, f32::NEG_INFINITY), 3).matmul(repeat(v.clone()))
        }
    };
    let grads = (out.clone() * upstream).sum().backward();
    let grad = |x: &Tensor<4>| read(x.grad(&grads).expect("a gradient"));
    [read(out), grad(&q), grad(&k), grad(&v)]
}

/// The loss of hidden states `[n, d]` under a head `[vocab, d]` and bias: its value and its
/// gradients by the three. `fused`: [`LinearCrossEntropy`] in blocks of 16 tokens; else
/// Burn's log-softmax of the whole logits.
fn loss(device: &Device, dtype: FloatDType, fused: bool) -> [Vec<f64>; 4] {
    let (n, d, vocab) = (53, 16, 301);
    let hidden = leaf(&values(n * d, 5), [n, d], device, dtype);
    let weight = leaf(&values(vocab * d, 6), [vocab, d], device, dtype);
    let bias = leaf(&values(vocab, 7), [vocab], device, dtype);
    let ids: Vec<i64> = (0..n as i64).map(|i| i * 37 % vocab as i64).collect();
    let targets = Tensor::<1, Int>::from_data(TensorData::new(ids, [n]), device);
    let value = match fused {
        true => LinearCrossEntropy::new().with_block_tokens(16).forward(
            hidden.clone(),
            weight.clone(),
            Some(bias.clone()),
            targets,
        ),
        false => {
            let logits = hidden.clone().matmul(weight.clone().transpose()) + bias.clone().unsqueeze_dim(0);
            log_softmax(logits.cast(FloatDType::F32), 1).gather(1, targets.reshape([n, 1])).mean().neg()
        }
    };
    let grads = value.clone().backward();
    [
        read(value),
        read(hidden.grad(&grads).expect("a gradient")),
        read(weight.grad(&grads).expect("a gradient")),
        read(bias.grad(&grads).expect("a gradient")),
    ]
}

/// On `on`'s device in `dtype`, attention and the loss equal Burn's unfused ops on the CPU
/// in f32 within `bound` of each result's largest value. The attention shapes `[batch, heads,
/// kv_heads, time, cached keys, head_dim, value_dim]` cross the kernels' tiles of 32 rows and
/// their staged key tiles (32 rows at widths up to 128, 20 at 200) at no multiple of either:
/// multi-head, groups of 2 and 16 (one kv head), queries after 9, 33 and 40 cached keys, one
/// token, a value width unlike the key's; and two shapes the blocked version takes: a width
/// past the kernels' (560), and on lavapipe a group of 16 over 70 rows at widths 24 and 40
/// (201,000 loop iterations for a `dk`/`dv` unit, past the 65,535 its compiler runs; the
/// other shapes stay under it). Switched off (`set_attention_kernels`), the blocked version
/// runs and is as close.
pub fn nn_ops_on_the_device_equal_burns_unfused_ops_on_the_cpu(on: Gpu, dtype: FloatDType, bound: f64) {
    let _alone = super::device_alone();
    let (device, cpu) = ((on.device)().autodiff(), Device::flex().autodiff());
    let names = ["output", "dq", "dk", "dv"];
    for shape in [
        [2, 4, 4, 37, 0, 16, 16],
        [2, 4, 2, 37, 0, 16, 16],
        [1, 4, 2, 5, 9, 8, 8],
        [1, 16, 1, 20, 33, 8, 16],
        [1, 1, 1, 1, 40, 64, 64],
        [1, 2, 2, 45, 0, 100, 100],
        [1, 16, 1, 70, 33, 24, 40],
        [1, 2, 1, 9, 0, 300, 260],
    ] {
        let (got, want) = (attention(&device, dtype, true, shape), attention(&cpu, FloatDType::F32, false, shape));
        for (name, (g, w)) in names.iter().zip(got.iter().zip(&want)) {
            let error = relative_error(g, w);
            assert!(error <= bound, "{} {dtype:?} attention {shape:?}: {name} off by {error:e}", on.name);
        }
    }
    // Switched off, the blocked version runs: as close to Burn's, in another order.
    let shape = [2, 4, 2, 37, 0, 16, 16];
    let kernels = attention(&device, dtype, true, shape);
    set_attention_kernels(false);
    let blocked = attention(&device, dtype, true, shape);
    set_attention_kernels(true);
    let want = attention(&cpu, FloatDType::F32, false, shape);
    for (name, (g, w)) in names.iter().zip(blocked.iter().zip(&want)) {
        let error = relative_error(g, w);
        assert!(error <= bound, "{} {dtype:?} blocked attention {shape:?}: {name} off by {error:e}", on.name);
    }
    assert_ne!(kernels, blocked, "{}: switching the attention kernels off changed nothing", on.name);
    let (got, want) = (loss(&device, dtype, true), loss(&cpu, FloatDType::F32, false));
    for (name, (g, w)) in ["loss", "hidden", "weight", "bias"].iter().zip(got.iter().zip(&want)) {
        let error = relative_error(g, w);
        assert!(error <= bound, "{} {dtype:?} loss: {name}'s off by {error:e}", on.name);
    }
}

/// Rows packing sequences (row 0: 5, 17 and 15 tokens; row 1: one of 37), grouped kv
/// heads: the packed attention on the device (the fusion stream carrying the sequence
/// starts, the blocked version running) equals Burn's unfused ops on the CPU masked to each
/// query's own sequence, output and every gradient, within 1e-5 in f32.
pub fn packed_attention_on_the_device_equals_the_masked_unfused_ops(on: Gpu) {
    let _alone = super::device_alone();
    let (device, cpu) = ((on.device)().autodiff(), Device::flex().autodiff());
    let (b, h, kv, t, d) = (2, 4, 2, 37, 16);
    let starts: Vec<i64> = (0..t as i64)
        .map(|p| match p {
            0..5 => 0,
            5..22 => 5,
            _ => 22,
        })
        .chain(std::iter::repeat_n(0, t))
        .collect();
    let run = |device: &Device, fused: bool| -> [Vec<f64>; 4] {
        let dtype = FloatDType::F32;
        let q = leaf(&values(b * h * t * d, 1), [b, h, t, d], device, dtype);
        let k = leaf(&values(b * kv * t * d, 2), [b, kv, t, d], device, dtype);
        let v = leaf(&values(b * kv * t * d, 3), [b, kv, t, d], device, dtype);
        let upstream = Tensor::<4>::from_data(TensorData::new(values(b * h * t * d, 4), [b, h, t, d]), device);
        let first = Tensor::<2, Int>::from_data(TensorData::new(starts.clone(), [b, t]), device);
        let out = match fused {
            true => packed_causal_attention(q.clone(), k.clone(), v.clone(), first, 0.4),
            false => {
                let repeat =
                    |x: Tensor<4>| x.reshape([b, kv, 1, t, d]).expand([b, kv, h / kv, t, d]).reshape([b, h, t, d]);
                let scores = q.clone().matmul(repeat(k.clone()).swap_dims(2, 3)).mul_scalar(0.4);
                let keys = Tensor::<1, Int>::arange(0..t as i64, device).reshape([1, 1, t]).expand([b, t, t]);
                let at = Tensor::<1, Int>::arange(0..t as i64, device).reshape([1, t, 1]).expand([b, t, t]);
                let first = first.reshape([b, t, 1]).expand([b, t, t]);
                let hidden: Tensor<3, Bool> = keys.clone().greater(at).bool_or(keys.lower(first));
                let mask = hidden.reshape([b, 1, t, t]).expand([b, h, t, t]);
                softmax(scores.mask_fill(mask, f32::NEG_INFINITY), 3).matmul(repeat(v.clone()))
            }
        };
        let grads = (out.clone() * upstream).sum().backward();
        let grad = |x: &Tensor<4>| read(x.grad(&grads).expect("a gradient"));
        [read(out), grad(&q), grad(&k), grad(&v)]
    };
    let (got, want) = (run(&device, true), run(&cpu, false));
    for (name, (g, w)) in ["output", "dq", "dk", "dv"].iter().zip(got.iter().zip(&want)) {
        let error = relative_error(g, w);
        assert!(error <= 1e-5, "{} packed attention: {name} off by {error:e}", on.name);
    }
}

/// A sequence whose whole scores `[batch, heads, time, time]` are past what the device
/// allocates in one buffer (4 heads at 4,096 positions: 256 MiB in f32; lavapipe allocates
/// at most 128 MiB at once) attends on the device: the blocked version forms at most a block
/// of scores at a time, and equals Burn's unfused ops on the CPU, output and gradients. Where
/// the kernels take the shape (a GPU: `kernels`), they run it too; on lavapipe its loops are
/// past what that compiler runs, so the blocked version is what runs there either way.
pub fn a_long_sequence_attends_without_its_whole_scores(on: Gpu, kernels: bool) {
    let _alone = super::device_alone();
    let (device, cpu) = ((on.device)().autodiff(), Device::flex().autodiff());
    let shape = [1, 4, 4, 4096, 0, 8, 8];
    let want = attention(&cpu, FloatDType::F32, false, shape);
    let runs: &[bool] = if kernels { &[false, true] } else { &[false] };
    for &on_kernels in runs {
        set_attention_kernels(on_kernels);
        let got = attention(&device, FloatDType::F32, true, shape);
        set_attention_kernels(true);
        for (name, (g, w)) in ["output", "dq", "dk", "dv"].iter().zip(got.iter().zip(&want)) {
            let error = relative_error(g, w);
            assert!(error <= 1e-5, "{} attention {shape:?} (kernels {on_kernels}): {name} off by {error:e}", on.name);
        }
    }
}

/// On the device's own allocator, at a fixed 2,048 tokens (batch x time): what attention
/// holds between forward and backward does not grow with the context (the output and a
/// value per query row), where Burn's unfused attention's `[time, time]` probabilities grow
/// 4x from context 256 to 1024 (4 MiB to 16 MiB in f32 at 2 heads). Both backward passes
/// give the inputs their gradients.
pub fn attention_holds_on_the_device_what_grows_with_the_tokens_not_the_context(on: Gpu) {
    let _alone = super::device_alone();
    let device = (on.device)().autodiff();
    let (tokens, heads, d) = (2048, 2, 16);
    let kept = |time: usize, fused: bool| -> u64 {
        let b = tokens / time;
        let q = leaf(&values(b * heads * time * d, 8), [b, heads, time, d], &device, FloatDType::F32);
        let k = leaf(&values(b * heads * time * d, 9), [b, heads, time, d], &device, FloatDType::F32);
        let v = leaf(&values(b * heads * time * d, 10), [b, heads, time, d], &device, FloatDType::F32);
        let before = super::bytes_in_use(&device);
        let out = match fused {
            true => causal_attention(q.clone(), k.clone(), v.clone(), 0.25),
            false => {
                let mask = burn::nn::attention::generate_autoregressive_mask(b, time, &device)
                    .reshape([b, 1, time, time])
                    .expand([b, heads, time, time]);
                let scores = q.clone().matmul(k.clone().swap_dims(2, 3)).mul_scalar(0.25);
                softmax(scores.mask_fill(mask, f32::NEG_INFINITY), 3).matmul(v.clone())
            }
        };
        let held = super::bytes_in_use(&device) - before;
        let grads = out.sum().backward();
        assert!(q.grad(&grads).is_some() && k.grad(&grads).is_some() && v.grad(&grads).is_some());
        held
    };
    let (ours, theirs) = ([kept(256, true), kept(1024, true)], [kept(256, false), kept(1024, false)]);
    eprintln!("{}: held after forward: ours {ours:?} B, unfused {theirs:?} B", on.name);
    let probabilities = (tokens * heads * 1024 * size_of::<f32>()) as u64;
    assert!(theirs[1] >= probabilities && theirs[1] >= 3 * theirs[0], "{}: the unfused held {theirs:?}", on.name);
    assert!(ours[1] <= ours[0] + ours[0] / 4, "{}: held {ours:?}: it grows with the context", on.name);
    assert!(ours[1] <= probabilities / 16, "{}: held {} B at context 1024", on.name, ours[1]);
}
