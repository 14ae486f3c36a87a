//! [`LinearCrossEntropy`] against the loss and gradients written out in f64, and against
//! Burn's own unfused head and log-softmax.

use burn::tensor::activation::log_softmax;
use burn::tensor::{Device, FloatDType, Int, Tensor, TensorData};

use super::{LinearCrossEntropy, TokenWeights};

/// A head problem: hidden states `[n, d]`, a weight `[vocab, d]`, a bias, targets.
struct Problem {
    n: usize,
    d: usize,
    vocab: usize,
    hidden: Vec<f32>,
    weight: Vec<f32>,
    bias: Vec<f32>,
    targets: Vec<i64>,
}

impl Problem {
    fn new(n: usize, d: usize, vocab: usize, seed: u64) -> Self {
        Self::scaled(n, d, vocab, seed, 1.0)
    }

    /// Weights drawn from `[-weight_scale, weight_scale]`.
    fn scaled(n: usize, d: usize, vocab: usize, seed: u64, weight_scale: f32) -> Self {
        let mut state = seed;
        let mut draw = |scale: f32| {
            state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((state >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
        };
        let hidden = (0..n * d).map(|_| draw(2.0)).collect();
        let weight = (0..vocab * d).map(|_| draw(weight_scale)).collect();
        let bias = (0..vocab).map(|_| draw(0.5)).collect();
        let targets = (0..n).map(|i| ((i * 7 + i * i) % vocab) as i64).collect();
        Self { n, d, vocab, hidden, weight, bias, targets }
    }

    /// The loss and its gradients by hidden, weight and bias, in f64 from the formulas:
    /// `mean_i(lse_i - z_{i,t_i})`, `g = (softmax(z) - one_hot(t)) / n`, `dh = g W`,
    /// `dW = g^T h`, `db = sum_i g_i`.
    fn reference(&self) -> (f64, Vec<f64>, Vec<f64>, Vec<f64>) {
        let (n, d, v) = (self.n, self.d, self.vocab);
        let (mut loss, mut dh, mut dw, mut db) = (0.0, vec![0.0; n * d], vec![0.0; v * d], vec![0.0; v]);
        for i in 0..n {
            let z: Vec<f64> = (0..v)
                .map(|j| {
                    let dot: f64 =
                        (0..d).map(|k| f64::from(self.hidden[i * d + k]) * f64::from(self.weight[j * d + k])).sum();
                    dot + f64::from(self.bias[j])
                })
                .collect();
            let max = z.iter().copied().fold(f64::MIN, f64::max);
            let sum: f64 = z.iter().map(|x| (x - max).exp()).sum();
            let lse = max + sum.ln();
            let t = self.targets[i] as usize;
            loss += lse - z[t];
            for j in 0..v {
                let g = ((z[j] - lse).exp() - if j == t { 1.0 } else { 0.0 }) / n as f64;
                db[j] += g;
                for k in 0..d {
                    dh[i * d + k] += g * f64::from(self.weight[j * d + k]);
                    dw[j * d + k] += g * f64::from(self.hidden[i * d + k]);
                }
            }
        }
        (loss / n as f64, dh, dw, db)
    }

    /// Hidden, weight and bias as leaves on `device` in `dtype` (tracked where `track`
    /// says, on an autodiff device), and the targets.
    fn tensors(
        &self,
        device: &Device,
        dtype: FloatDType,
        track: [bool; 3],
    ) -> (Tensor<2>, Tensor<2>, Tensor<1>, Tensor<1, Int>) {
        let hidden =
            leaf(Tensor::from_data(TensorData::new(self.hidden.clone(), [self.n, self.d]), device), dtype, track[0]);
        let weight = leaf(
            Tensor::from_data(TensorData::new(self.weight.clone(), [self.vocab, self.d]), device),
            dtype,
            track[1],
        );
        let bias = leaf(Tensor::from_data(TensorData::new(self.bias.clone(), [self.vocab]), device), dtype, track[2]);
        let targets = Tensor::from_data(TensorData::new(self.targets.clone(), [self.n]), device);
        (hidden, weight, bias, targets)
    }
}

/// `t` in `dtype` as a leaf, tracked (requiring its gradient) when `tracked`.
fn leaf<const D: usize>(t: Tensor<D>, dtype: FloatDType, tracked: bool) -> Tensor<D> {
    let t = t.cast(dtype).detach();
    if tracked { t.require_grad() } else { t }
}

fn values<const D: usize>(t: Tensor<D>) -> Vec<f64> {
    t.cast(FloatDType::F32).into_data().try_to_vec::<f32>().unwrap().into_iter().map(f64::from).collect()
}

/// The largest difference between `got` and `want`, relative to `want`'s largest value.
fn relative_error(got: &[f64], want: &[f64]) -> f64 {
    assert_eq!(got.len(), want.len());
    let scale = want.iter().fold(0.0f64, |m, x| m.max(x.abs()));
    got.iter().zip(want).fold(0.0f64, |m, (g, w)| m.max((g - w).abs())) / scale
}

/// In f32, every block size (one token, uneven blocks, one block short of all, exactly
/// all, more than all, chosen by the vocabulary) gives the f64 loss within 1e-6 relative
/// and every gradient within 2e-6 of its largest value: each value is a sum of at most
/// `vocab` = 53 f32 products and one log-sum-exp, whose rounding stays well below that.
#[test]
fn every_block_size_gives_the_loss_and_gradients_of_the_formulas() {
    let p = Problem::new(37, 8, 53, 3);
    let (loss, dh, dw, db) = p.reference();
    let device = Device::flex().autodiff();
    for block in [1, 5, 36, 37, 1000, 0] {
        let (hidden, weight, bias, targets) = p.tensors(&device, FloatDType::F32, [true; 3]);
        let head = LinearCrossEntropy::new().with_block_tokens(block);
        let got = head.forward(hidden.clone(), weight.clone(), Some(bias.clone()), targets);
        let value = values(got.clone())[0];
        assert!((value - loss).abs() <= 1e-6 * loss, "block {block}: loss {value} against {loss}");
        let grads = got.backward();
        for (name, got, want) in [
            ("hidden", values(hidden.grad(&grads).unwrap()), &dh),
            ("weight", values(weight.grad(&grads).unwrap()), &dw),
            ("bias", values(bias.grad(&grads).unwrap()), &db),
        ] {
            let error = relative_error(&got, want);
            assert!(error <= 2e-6, "block {block}: {name}'s gradient off by {error:e} of its largest");
        }
    }
}

/// Burn's unfused loss (the whole logits, log-softmax, gather, mean) and its autodiff
/// gradients equal the blocks' within 1e-6 relative in f32.
#[test]
fn the_blocks_equal_the_whole_logits_loss() {
    let p = Problem::new(64, 16, 97, 11);
    let device = Device::flex().autodiff();
    let (hidden, weight, bias, targets) = p.tensors(&device, FloatDType::F32, [true; 3]);
    let whole = {
        let logits = hidden.clone().matmul(weight.clone().transpose()) + bias.clone().unsqueeze_dim(0);
        log_softmax(logits, 1).gather(1, targets.clone().reshape([p.n, 1])).mean().neg()
    };
    let (h2, w2, b2, _) = p.tensors(&device, FloatDType::F32, [true; 3]);
    let blocks =
        LinearCrossEntropy::new().with_block_tokens(10).forward(h2.clone(), w2.clone(), Some(b2.clone()), targets);
    let (a, b) = (values(whole.clone())[0], values(blocks.clone())[0]);
    assert!((a - b).abs() <= 1e-6 * a, "whole {a}, blocks {b}");
    let (gw, gb) = (whole.backward(), blocks.backward());
    for (name, x, y) in [
        ("hidden", values(hidden.grad(&gw).unwrap()), values(h2.grad(&gb).unwrap())),
        ("weight", values(weight.grad(&gw).unwrap()), values(w2.grad(&gb).unwrap())),
        ("bias", values(bias.grad(&gw).unwrap()), values(b2.grad(&gb).unwrap())),
    ] {
        let error = relative_error(&y, &x);
        assert!(error <= 1e-6, "{name}: off by {error:e} of its largest");
    }
}

/// In fp16 under a loss scale of 1024, as mixed precision runs it, with GPT-2's batch of
/// 8,192 tokens and weights of its initial size: the hidden states' gradient is at most
/// 2.7e-6 here, below fp16's smallest normal (6.1e-5), where fp16 steps by 6e-8. Kept in f32
/// until the scale multiplies it, every gradient lands within 3e-3 of its largest value (a
/// few fp16 roundings of 4.9e-4 each: the gradient by the logits narrowed, the matmul, the
/// result; 9e-4 measured). Narrowed to fp16 before the scale, the hidden states' gradient
/// is off by 1.2e-2 (measured), so this test fails.
#[test]
fn fp16_gradients_survive_a_loss_scale_as_autodiff_would_give_them() {
    let p = Problem::scaled(8192, 8, 40, 5, 0.02);
    let (loss, dh, dw, db) = p.reference();
    let device = Device::flex().autodiff();
    let (hidden, weight, bias, targets) = p.tensors(&device, FloatDType::F16, [true; 3]);
    let got = LinearCrossEntropy::new().with_block_tokens(64).forward(
        hidden.clone(),
        weight.clone(),
        Some(bias.clone()),
        targets,
    );
    let value = values(got.clone())[0];
    assert!((value - loss).abs() <= 5e-3 * loss.max(1.0), "loss {value} against {loss}");
    let grads = got.mul_scalar(1024.0).backward();
    let (gh, gw, gb) = (hidden.grad(&grads).unwrap(), weight.grad(&grads).unwrap(), bias.grad(&grads).unwrap());
    for (name, dtype) in [("hidden", gh.dtype()), ("weight", gw.dtype()), ("bias", gb.dtype())] {
        assert_eq!(dtype, burn::tensor::DType::F16, "{name}'s gradient is in the parameter's dtype");
    }
    for (name, got, want) in [("hidden", values(gh), &dh), ("weight", values(gw), &dw), ("bias", values(gb), &db)] {
        let got: Vec<f64> = got.into_iter().map(|x| x / 1024.0).collect();
        let error = relative_error(&got, want);
        assert!(error <= 3e-3, "{name}'s gradient off by {error:e} of its largest");
    }
}

/// Without autodiff the value alone; with only the hidden states tracked, only they get a
/// gradient (a frozen head), equal to the formula's.
#[test]
fn only_what_is_tracked_gets_a_gradient() {
    let p = Problem::new(20, 4, 30, 7);
    let (loss, dh, _, _) = p.reference();
    let (hidden, weight, bias, targets) = p.tensors(&Device::flex(), FloatDType::F32, [false; 3]);
    let value = values(LinearCrossEntropy::new().with_block_tokens(3).forward(hidden, weight, Some(bias), targets))[0];
    assert!((value - loss).abs() <= 1e-6 * loss, "without autodiff: {value} against {loss}");

    let device = Device::flex().autodiff();
    let (hidden, weight, bias, targets) = p.tensors(&device, FloatDType::F32, [true, false, false]);
    let got = LinearCrossEntropy::new().with_block_tokens(3).forward(
        hidden.clone(),
        weight.clone(),
        Some(bias.clone()),
        targets,
    );
    let grads = got.backward();
    assert!(weight.grad(&grads).is_none() && bias.grad(&grads).is_none(), "a frozen head got a gradient");
    let error = relative_error(&values(hidden.grad(&grads).unwrap()), &dh);
    assert!(error <= 2e-6, "hidden's gradient off by {error:e}");
}

/// Weighted, over uneven blocks: Burn's unfused loss with each token's log-probability
/// weighted (0 at the masked tokens, 1 or 2.5 elsewhere) and summed, divided by 13, and its
/// autodiff gradients, equal the blocks' within 1e-6 relative in f32; the masked tokens'
/// targets change neither.
#[test]
fn weighted_tokens_give_the_weighted_sum_and_its_gradients() {
    let p = Problem::new(29, 8, 41, 13);
    let device = Device::flex().autodiff();
    let w: Vec<f32> = (0..p.n).map(|i| [0.0, 1.0, 2.5][i % 3]).collect();
    let weights = || Tensor::<1>::from_data(TensorData::new(w.clone(), [p.n]), &device);
    let (hidden, weight, bias, targets) = p.tensors(&device, FloatDType::F32, [true; 3]);
    let whole = {
        let logits = hidden.clone().matmul(weight.clone().transpose()) + bias.clone().unsqueeze_dim(0);
        let picked = log_softmax(logits, 1).gather(1, targets.clone().reshape([p.n, 1])).reshape([p.n]);
        (picked * weights()).sum().neg().div_scalar(13.0)
    };
    // The masked tokens' targets moved: the loss must not see them.
    let moved: Vec<i64> = values_int(targets.clone())
        .into_iter()
        .enumerate()
        .map(|(i, t)| if i % 3 == 0 { (t + 7) % 41 } else { t })
        .collect();
    let moved = Tensor::<1, Int>::from_data(TensorData::new(moved, [p.n]), &device);
    let (h2, w2, b2, _) = p.tensors(&device, FloatDType::F32, [true; 3]);
    let counted = TokenWeights { weights: weights(), divisor: 13.0 };
    let blocks = LinearCrossEntropy::new().with_block_tokens(4).forward_weighted(
        h2.clone(),
        (w2.clone(), Some(b2.clone())),
        moved,
        counted,
        None,
    );
    let (a, b) = (values(whole.clone())[0], values(blocks.clone())[0]);
    assert!((a - b).abs() <= 1e-6 * a.abs(), "whole {a}, blocks {b}");
    let (gw, gb) = (whole.backward(), blocks.backward());
    for (name, x, y) in [
        ("hidden", values(hidden.grad(&gw).unwrap()), values(h2.grad(&gb).unwrap())),
        ("weight", values(weight.grad(&gw).unwrap()), values(w2.grad(&gb).unwrap())),
        ("bias", values(bias.grad(&gw).unwrap()), values(b2.grad(&gb).unwrap())),
    ] {
        let error = relative_error(&y, &x);
        assert!(error <= 1e-6, "{name}: off by {error:e} of its largest");
    }
}

fn values_int(t: Tensor<1, Int>) -> Vec<i64> {
    t.into_data().convert::<i64>().try_to_vec::<i64>().unwrap()
}
