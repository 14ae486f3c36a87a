//! The output head and its mean cross-entropy over blocks of tokens.
//!
//! *Note: a loss that computes its gradients in forward.* A language model's head turns
//! `N` hidden states of width `d` into `N x V` logits, and the loss reads them through a
//! log-softmax: for GPT-2 small at batch 8 that is 8,192 x 50,257 values, 1.6 GB in f32,
//! and autodiff keeps the logits, their f32 copy and the log-softmax for backward, then
//! forms as many gradients. [`LinearCrossEntropy`] never holds more than one block of
//! tokens' logits: for each block it computes the logits, their log-softmax, the block's
//! loss, and at once the gradient of the mean loss with respect to the block's logits,
//! `(softmax - one_hot(target)) / N`, which it multiplies into the gradients of the
//! hidden states, the weight and the bias, and drops. Burn 0.22 has no user-defined
//! backward outside a backend extension, so the gradients reach autodiff through a
//! surrogate built from tracked inputs and constant gradients:
//!
//! `loss = (s - detach(s)) + value`, where `s = sum(h * dh) + sum(W * dW) + sum(b * db)`.
//!
//! `s - detach(s)` is exactly 0 (a finite number minus itself), so the value is the loss's
//! exactly; its gradient with respect to `h` is `dh` times the upstream gradient, and the
//! same for `W` and `b`. The upstream gradient (the loss scale, the accumulation divisor) is
//! applied in f32 before the gradient narrows to the parameters' dtype, as autodiff would
//! have done through the logits: the gradients are kept in f32 so that `1/N`-sized values
//! do not underflow fp16 before the loss scale reaches them. The logits' matmuls and the two
//! gradient matmuls run in the inputs' dtype (on tensor cores in bf16 and fp16), the
//! log-softmax in f32, as the unfused loss does. Only what is tracked gets a gradient: a
//! run without autodiff (evaluation) computes the value alone.

use std::ops::Range;

use burn::tensor::activation::log_softmax;
use burn::tensor::{FloatDType, IndexingUpdateOp, Int, Tensor};

use super::parallel::{ParallelGroup, local_ids};
use crate::reduce;

/// A language model's output projection and its mean next-token cross-entropy, computed
/// over blocks of tokens so that the `[tokens, vocabulary]` logits never exist whole, in
/// forward or in backward.
///
/// Equals `cross_entropy(hidden W^T + b, targets)` (log-softmax in f32, the mean over all
/// tokens) and its gradients with respect to `hidden`, `weight` and `bias`; each block's
/// gradient is formed during forward (see the module's note), so a backward pass costs
/// nothing more and a forward pass in training costs the two gradient matmuls. Where the
/// inputs are not tracked by autodiff, it computes the value alone.
///
/// ```
/// use burn::tensor::{Device, Int, Tensor, TensorData};
/// use zerotrain::nn::LinearCrossEntropy;
///
/// let device = Device::flex().autodiff();
/// let hidden = Tensor::<2>::from_data(TensorData::new(vec![0.5f32, -1.0, 2.0, 0.25], [2, 2]), &device).require_grad();
/// let weight = Tensor::<2>::from_data(TensorData::new(vec![1.0f32, 0.0, 0.0, 1.0, 1.0, 1.0], [3, 2]), &device).require_grad();
/// let targets = Tensor::<1, Int>::from_data(TensorData::new(vec![2i64, 0], [2]), &device);
/// let loss = LinearCrossEntropy::new().forward(hidden.clone(), weight.clone(), None, targets);
/// let grads = loss.backward();
/// assert_eq!(hidden.grad(&grads).unwrap().dims(), [2, 2]);
/// assert_eq!(weight.grad(&grads).unwrap().dims(), [3, 2]);
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LinearCrossEntropy {
    /// Tokens per block; 0: as many as make `block_elements` logits of the whole vocabulary.
    block_tokens: usize,
    /// Logits per block where the block is chosen by the vocabulary; 0:
    /// [`BLOCK_ELEMENTS`](Self::BLOCK_ELEMENTS).
    block_elements: usize,
}

impl LinearCrossEntropy {
    /// Logits per block when the block is chosen by the vocabulary: 16 Mi, 64 MiB in f32
    /// (333 tokens of GPT-2's 50,257-token vocabulary, where its whole batch of 8 x 1,024
    /// tokens' logits take 1.6 GB).
    pub const BLOCK_ELEMENTS: usize = 1 << 24;

    /// The longest block: its per-token values are summed in one reduction (a longer one
    /// would pass what every backend counts; see [`reduce`](crate::reduce)).
    pub const MAX_BLOCK_TOKENS: usize = 1 << 15;

    /// Blocks of [`BLOCK_ELEMENTS`](Self::BLOCK_ELEMENTS) logits.
    pub fn new() -> Self {
        Self::default()
    }

    /// Blocks of `tokens` tokens (at least 1, at most
    /// [`MAX_BLOCK_TOKENS`](Self::MAX_BLOCK_TOKENS)); 0 chooses by the vocabulary.
    pub fn with_block_tokens(self, tokens: usize) -> Self {
        Self { block_tokens: tokens.min(Self::MAX_BLOCK_TOKENS), ..self }
    }

    /// Blocks of as many tokens as make `elements` logits of the whole vocabulary (at least
    /// one token); 0 restores [`BLOCK_ELEMENTS`](Self::BLOCK_ELEMENTS). A fixed
    /// [`with_block_tokens`](Self::with_block_tokens) takes precedence.
    pub fn with_block_elements(self, elements: usize) -> Self {
        Self { block_elements: elements, ..self }
    }

    /// Tokens per block for a vocabulary of `vocab` ids: for a vocabulary-parallel head,
    /// the whole vocabulary's count, never a rank's part (every rank of the group must
    /// cut the same blocks, since each block is one exchange of the group).
    pub fn block_tokens(&self, vocab: usize) -> usize {
        let elements = match self.block_elements {
            0 => Self::BLOCK_ELEMENTS,
            n => n,
        };
        match self.block_tokens {
            0 => (elements / vocab.max(1)).clamp(1, Self::MAX_BLOCK_TOKENS),
            n => n,
        }
    }

    /// The mean cross-entropy (a 1-element f32 tensor) of `hidden` `[tokens, d]` projected
    /// by `weight` `[vocab, d]` (PyTorch's `F.linear` layout; pass a Burn `Linear`'s
    /// `[d, vocab]` weight transposed) plus `bias` `[vocab]`, against `targets` `[tokens]`
    /// (ids below `vocab`).
    ///
    /// # Panics
    /// On shapes that do not fit together, or no tokens, naming them; `targets` at or past
    /// `vocab` are not checked on every backend.
    pub fn forward(
        &self,
        hidden: Tensor<2>,
        weight: Tensor<2>,
        bias: Option<Tensor<1>>,
        targets: Tensor<1, Int>,
    ) -> Tensor<1> {
        let vocab = weight.dims()[0];
        self.run(hidden, (weight, bias), targets, (vocab, None), None)
    }

    /// [`forward`](Self::forward) of a head whose vocabulary of `vocab` ids is split over
    /// `group` (a vocabulary-parallel head): `weight` `[part, d]` and `bias` `[part]` are
    /// this rank's consecutive rows of the whole head's ([`ParallelGroup::part`]), `hidden`
    /// the whole hidden states (equal on every rank), `targets` ids into the whole
    /// vocabulary. Every rank gets the whole loss, its rows of the weight and bias their
    /// gradients, and `hidden` the whole gradient (it enters through
    /// [`ParallelGroup::copy_to`], whose backward sums the ranks' parts). No rank forms the
    /// whole logits, nor more than one block of its part: per block, the group exchanges
    /// three values per token (the maximum, the sum of exponentials, the target's logit),
    /// as Megatron-LM's vocabulary-parallel cross-entropy does (over all tokens at once
    /// there; one block here with `with_block_tokens` of at least the tokens).
    ///
    /// # Panics
    /// As [`forward`](Self::forward), and where the weight's rows are not this rank's share
    /// of `vocab`.
    pub fn forward_parallel(
        &self,
        hidden: Tensor<2>,
        (weight, bias): (Tensor<2>, Option<Tensor<1>>),
        targets: Tensor<1, Int>,
        vocab: usize,
        group: &ParallelGroup,
    ) -> Tensor<1> {
        let split = Self::rows_of(&weight, vocab, group);
        self.run(group.copy_to(hidden), (weight, bias), targets, (vocab, Some(split)), None)
    }

    /// The weighted form of [`forward`](Self::forward) (and, with `split` a group and the
    /// whole vocabulary's size, of [`forward_parallel`](Self::forward_parallel)): `Σ_i w_i
    /// loss_i / divisor` over the tokens, `w` and `divisor` from `weights`, and its
    /// gradients. A language model trained on answers only passes 1 at the tokens that
    /// count and 0 elsewhere, and the number of counted tokens of the whole optimizer step
    /// (over its micro-batches and ranks) as the divisor; weights of 1 and a divisor of the
    /// token count give the mean, [`forward`](Self::forward). A block's tokens of weight 0
    /// still cost their logits.
    ///
    /// # Panics
    /// As [`forward`](Self::forward), and where the weights are not one per token.
    pub fn forward_weighted(
        &self,
        hidden: Tensor<2>,
        (weight, bias): (Tensor<2>, Option<Tensor<1>>),
        targets: Tensor<1, Int>,
        weights: TokenWeights,
        split: Option<(&ParallelGroup, usize)>,
    ) -> Tensor<1> {
        let (hidden, vocab, split) = match split {
            Some((group, vocab)) if group.size() > 1 => {
                (group.copy_to(hidden), vocab, Some(Self::rows_of(&weight, vocab, group)))
            }
            _ => (hidden, weight.dims()[0], None),
        };
        self.run(hidden, (weight, bias), targets, (vocab, split), Some(weights))
    }

    /// This rank's ids of a `vocab` split over `group`, checked against the rows of its
    /// `weight`.
    fn rows_of(weight: &Tensor<2>, vocab: usize, group: &ParallelGroup) -> (ParallelGroup, Range<usize>) {
        let part = group.part(vocab);
        assert_eq!(
            weight.dims()[0],
            part.len(),
            "LinearCrossEntropy::forward_parallel: rank {} holds ids {part:?} of {vocab}, the weight {} rows",
            group.rank(),
            weight.dims()[0]
        );
        (group.clone(), part)
    }

    /// The loss over blocks of tokens, each token's loss weighted and their sum divided as
    /// `weights` says (`None`: the mean); `whole_vocab` is the whole vocabulary's size,
    /// which a split head's rank holds `split`'s part of.
    fn run(
        &self,
        hidden: Tensor<2>,
        (weight, bias): (Tensor<2>, Option<Tensor<1>>),
        targets: Tensor<1, Int>,
        (whole_vocab, split): (usize, Option<(ParallelGroup, Range<usize>)>),
        weights: Option<TokenWeights>,
    ) -> Tensor<1> {
        let ([n, d], [vocab, dw], [nt]) = (hidden.dims(), weight.dims(), targets.dims());
        assert!(d == dw, "LinearCrossEntropy: hidden [{n}, {d}] and weight [{vocab}, {dw}] differ in width");
        assert!(nt == n, "LinearCrossEntropy: {nt} targets for {n} hidden states");
        assert!(n > 0, "LinearCrossEntropy: no tokens");
        if let Some(w) = &weights {
            assert!(w.weights.dims() == [n], "LinearCrossEntropy: weights {:?} for {n} tokens", w.weights.dims());
        }
        if let Some(b) = &bias {
            assert!(b.dims() == [vocab], "LinearCrossEntropy: bias {:?} for a vocabulary of {vocab}", b.dims());
        }
        let wants = Wants {
            hidden: hidden.is_tracked(),
            weight: weight.is_tracked(),
            bias: bias.as_ref().is_some_and(Tensor::is_tracked),
        };
        let mut blocks = Blocks::new(constant(weight.clone()), bias.clone().map(constant), wants, split);
        let h = constant(hidden.clone());
        // A split head's blocks are as long as the whole vocabulary's would be: each block
        // is three exchanges of the group, so every rank must cut the same blocks, whatever
        // its part (parts differ by one id where the vocabulary does not divide).
        let step = self.block_tokens(whole_vocab);
        let (per_token, divisor) = match weights {
            Some(TokenWeights { weights, divisor }) => (Some(constant(weights.cast(FloatDType::F32))), divisor),
            None => (None, n as f64),
        };
        for start in (0..n).step_by(step) {
            let len = step.min(n - start);
            let w = per_token.as_ref().map(|w| w.clone().narrow(0, start, len).reshape([len, 1]));
            blocks.add(h.clone().narrow(0, start, len), targets.clone().narrow(0, start, len).reshape([len, 1]), w);
        }
        blocks.loss(divisor, hidden, weight, bias)
    }
}

/// Per-token weights of a [`LinearCrossEntropy`] loss and what their weighted sum is
/// divided by ([`LinearCrossEntropy::forward_weighted`]).
#[derive(Debug, Clone)]
pub struct TokenWeights {
    /// One weight per token `[tokens]` (not tracked: no gradient reaches them).
    pub weights: Tensor<1>,
    /// What the weighted sum is divided by (positive).
    pub divisor: f64,
}

/// `t` outside autodiff's graph: its value, neither tracked nor requiring a gradient
/// (`detach` alone keeps a leaf's `require_grad`, and every operation on it would be
/// recorded).
fn constant<const D: usize>(t: Tensor<D>) -> Tensor<D> {
    t.set_require_grad(false)
}

/// `x` added into the running `sum` (which starts as `x`).
fn add_to<const D: usize>(sum: &mut Option<Tensor<D>>, x: Tensor<D>) {
    *sum = Some(match sum.take() {
        Some(sum) => sum + x,
        None => x,
    });
}

/// Which inputs are tracked by autodiff, and so get a gradient.
#[derive(Clone, Copy)]
struct Wants {
    hidden: bool,
    weight: bool,
    bias: bool,
}

impl Wants {
    fn any(self) -> bool {
        self.hidden || self.weight || self.bias
    }
}

/// What the blocks add up: the summed loss, and the unnormalised gradients (f32).
struct Blocks {
    weight: Tensor<2>,
    bias: Option<Tensor<1>>,
    wants: Wants,
    /// The group a vocabulary-parallel head's rows are split over, and this rank's ids.
    split: Option<(ParallelGroup, Range<usize>)>,
    total: Option<Tensor<1>>,
    hidden_grads: Vec<Tensor<2>>,
    weight_grad: Option<Tensor<2>>,
    bias_grad: Option<Tensor<1>>,
}

impl Blocks {
    /// Blocks projected by the detached `weight` and `bias`.
    fn new(
        weight: Tensor<2>,
        bias: Option<Tensor<1>>,
        wants: Wants,
        split: Option<(ParallelGroup, Range<usize>)>,
    ) -> Self {
        let (total, hidden_grads, weight_grad, bias_grad) = (None, Vec::new(), None, None);
        Self { weight, bias, wants, split, total, hidden_grads, weight_grad, bias_grad }
    }

    /// One block: detached hidden states `h` `[len, d]`, their targets `[len, 1]` and the
    /// tokens' weights `[len, 1]` (none: 1 each).
    fn add(&mut self, h: Tensor<2>, targets: Tensor<2, Int>, weights: Option<Tensor<2>>) {
        let mut logits = h.clone().matmul(self.weight.clone().transpose());
        if let Some(b) = &self.bias {
            logits = logits + b.clone().unsqueeze_dim(0);
        }
        let (picked, probs, targets, inside) = match &self.split {
            None => {
                let log_probs = log_softmax(logits.cast(FloatDType::F32), 1);
                let picked = log_probs.clone().gather(1, targets.clone());
                let inside = picked.ones_like();
                (picked, log_probs.exp(), targets, inside)
            }
            Some((group, part)) => normalise_split(logits.cast(FloatDType::F32), targets, group, part),
        };
        let picked = match &weights {
            Some(w) => picked * w.clone(),
            None => picked,
        };
        let block = reduce::sum(picked).neg();
        add_to(&mut self.total, block);
        if !self.wants.any() {
            return;
        }
        // softmax - one_hot(target): the gradient of the block's summed loss by its logits
        // (a split head's rank subtracts the one where it holds the target).
        let grad = probs.scatter(1, targets, inside.neg(), IndexingUpdateOp::Add);
        let grad = match weights {
            Some(w) => grad * w,
            None => grad,
        };
        if self.wants.bias {
            let vocab = grad.dims()[1];
            let g = grad.clone().sum_dim(0).reshape([vocab]);
            add_to(&mut self.bias_grad, g);
        }
        let grad = grad.cast(self.weight.dtype());
        if self.wants.hidden {
            self.hidden_grads.push(grad.clone().matmul(self.weight.clone()).cast(FloatDType::F32));
        }
        if self.wants.weight {
            let g = grad.transpose().matmul(h).cast(FloatDType::F32);
            add_to(&mut self.weight_grad, g);
        }
    }

    /// The summed loss divided by `divisor` (the token count for the mean), carrying the
    /// blocks' gradients to the tracked `hidden`, `weight` and `bias` (the module's note).
    fn loss(self, divisor: f64, hidden: Tensor<2>, weight: Tensor<2>, bias: Option<Tensor<1>>) -> Tensor<1> {
        let scale = 1.0 / divisor;
        let value = self.total.expect("at least one block").mul_scalar(scale);
        let term =
            |input: Tensor<2>, grad: Tensor<2>| reduce::sum(input.cast(FloatDType::F32) * grad.mul_scalar(scale));
        let mut terms = Vec::new();
        if self.wants.hidden {
            terms.push(term(hidden, Tensor::cat(self.hidden_grads, 0)));
        }
        if let Some(grad) = self.weight_grad {
            terms.push(term(weight, grad));
        }
        if let (Some(bias), Some(grad)) = (bias, self.bias_grad) {
            terms.push(term(bias.unsqueeze_dim(0), grad.unsqueeze_dim(0)));
        }
        match terms.into_iter().reduce(|a, b| a + b) {
            Some(s) => (s.clone() - s.detach()) + value,
            None => value,
        }
    }
}

/// A block of a vocabulary-parallel head: this rank's f32 logits `z` `[len, part]` of ids
/// `part`, and the targets `[len, 1]` in the whole vocabulary. Returns the log-probability
/// of each target `[len, 1]` (equal on every rank), this rank's probabilities `[len,
/// part]`, the targets as rows of the part (0 outside it), and 1 where this rank holds the
/// target (else 0), `[len, 1]`.
fn normalise_split(
    z: Tensor<2>,
    targets: Tensor<2, Int>,
    group: &ParallelGroup,
    part: &Range<usize>,
) -> (Tensor<2>, Tensor<2>, Tensor<2, Int>, Tensor<2>) {
    // The maximum only steadies the exponentials; the result does not depend on it.
    let max = group.max(z.clone().max_dim(1));
    let exp = (z.clone() - max.clone()).exp();
    let sum = group.reduce_from(exp.clone().sum_dim(1));
    let (ids, inside) = local_ids(targets, part);
    let inside = inside.float();
    let target = group.reduce_from(z.gather(1, ids.clone()) * inside.clone());
    let picked = target - max - sum.clone().log();
    (picked, exp / sum, ids, inside)
}
