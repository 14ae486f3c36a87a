//! What one micro-step of a causal language model reads ([`LmBatch`]): token rows, and,
//! where only some targets count (a chat's answers), which ones and what their loss is
//! divided by.
//!
//! # Note: the divisor of a counted loss
//! Trained on answers only, the loss of an optimizer step is the sum of the counted
//! targets' losses over all its micro-batches and all the ranks that split its batch,
//! divided by their number `N` (what transformers does since 4.46 and TRL's
//! `SFTTrainer` with it); a mean of each micro-batch's mean would weigh a short answer's
//! tokens more than a long one's. The engine divides each micro-batch's loss by the
//! accumulation steps and averages the gradients over its sharding group (the
//! data-parallel ranks, and the sequence ranks that hold parts of the same rows); so a
//! micro-batch's loss is its counted sum divided by `N / (steps × group)`,
//! [`Counted::divisor`], which the data knows before the step runs (every rank can count
//! the step's targets from the file), and the engine's divisions then leave `Σ / N`.

use burn::tensor::{Int, Tensor};
use zerotrain::nn::TokenWeights;

/// One micro-batch of a causal language model: `[batch, time + 1]` tokens (inputs and
/// next-token targets), every target counted in a mean loss, or only those
/// [`Counted`] says.
#[derive(Debug, Clone)]
pub struct LmBatch {
    /// Inputs and next-token targets, `[batch, time + 1]`.
    pub tokens: Tensor<2, Int>,
    /// Which targets count and what their loss is divided by; `None`: every target, the
    /// mean over them.
    pub counted: Option<Counted>,
    /// Where rows pack several sequences, where each starts; `None`: a row is one sequence
    /// (or a window of a corpus), its positions from 0.
    pub packed: Option<Packing>,
}

/// Where the sequences packed into an [`LmBatch`]'s rows start: each input position's
/// sequence start (`[batch, time]`, positions in the row), and so its position within its
/// sequence. Attention stays inside a sequence and positions restart at each; a target
/// that is the next sequence's first token must not count (its weight is 0).
#[derive(Debug, Clone)]
pub struct Packing {
    /// `[batch, time]`: where the sequence of input position `t` starts in its row.
    pub starts: Tensor<2, Int>,
    /// `[batch, time]`: `t - starts[t]`, its position within its sequence.
    pub positions: Tensor<2, Int>,
}

/// Which targets of an [`LmBatch`] count in its loss (module note).
#[derive(Debug, Clone)]
pub struct Counted {
    /// `[batch, time]`: 1 where target `t` (token `t + 1` of the row) counts, else 0.
    pub weights: Tensor<2>,
    /// What the micro-batch's summed loss of counted targets is divided by (positive).
    pub divisor: f64,
}

impl LmBatch {
    /// Every target counted, the loss their mean.
    pub fn new(tokens: Tensor<2, Int>) -> Self {
        Self { tokens, counted: None, packed: None }
    }

    /// Only the targets `weights` `[batch, time]` marks count, their summed loss divided by
    /// `divisor` (the module note).
    ///
    /// # Panics
    /// Where `weights` is not one per target or `divisor` is not positive.
    pub fn counted(tokens: Tensor<2, Int>, weights: Tensor<2>, divisor: f64) -> Self {
        let [b, t1] = tokens.dims();
        assert_eq!(weights.dims(), [b, t1 - 1], "LmBatch: one weight per target of [{b}, {t1}] tokens");
        assert!(divisor > 0.0, "LmBatch: a divisor of {divisor}");
        Self { tokens, counted: Some(Counted { weights, divisor }), packed: None }
    }

    /// The batch with its rows packing sequences that start where `starts` `[batch, time]`
    /// says (each input position's sequence start in its row: at most the position).
    ///
    /// # Panics
    /// Where `starts` is not one per input.
    pub fn with_starts(self, starts: Tensor<2, Int>) -> Self {
        let [b, t1] = self.tokens.dims();
        assert_eq!(starts.dims(), [b, t1 - 1], "LmBatch: one sequence start per input of [{b}, {t1}] tokens");
        let at =
            Tensor::<1, Int>::arange(0..(t1 - 1) as i64, &starts.device()).reshape([1, t1 - 1]).expand([b, t1 - 1]);
        let positions = at - starts.clone();
        Self { packed: Some(Packing { starts, positions }), ..self }
    }

    /// Where rows pack sequences: this rank's part of the positions (`first..first + t`)
    /// and the whole rows' starts (sequence-parallel attention sees whole rows).
    pub fn packing(&self, first: usize, t: usize) -> Option<Packing> {
        let packed = self.packed.as_ref()?;
        let b = self.rows();
        let positions = packed.positions.clone().slice([0..b, first..first + t]);
        Some(Packing { starts: packed.starts.clone(), positions })
    }

    /// The batch as one of `parts` that share its loss, each averaged with the others by
    /// the engine (micro-batches, data-parallel ranks, the sequence ranks that hold parts
    /// of its rows): a counted loss's divisor divided by `parts` (the module note); a mean
    /// loss is left as it is.
    pub fn shared_by(mut self, parts: u64) -> Self {
        if let Some(counted) = &mut self.counted {
            counted.divisor /= parts.max(1) as f64;
        }
        self
    }

    /// How many rows.
    pub fn rows(&self) -> usize {
        self.tokens.dims()[0]
    }

    /// The targets of positions `first..first + t` flattened `[batch * t]` (the part of a
    /// sequence-parallel rank), with their weights where only some count.
    pub fn targets(&self, first: usize, t: usize) -> (Tensor<1, Int>, Option<TokenWeights>) {
        let b = self.rows();
        let targets = self.tokens.clone().slice([0..b, first + 1..first + t + 1]).reshape([b * t]);
        let weights = self.counted.as_ref().map(|c| TokenWeights {
            weights: c.weights.clone().slice([0..b, first..first + t]).reshape([b * t]),
            divisor: c.divisor,
        });
        (targets, weights)
    }
}

impl From<Tensor<2, Int>> for LmBatch {
    fn from(tokens: Tensor<2, Int>) -> Self {
        Self::new(tokens)
    }
}
