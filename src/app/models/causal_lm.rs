//! What every built-in language model shares: next-token batches and their loss, and the
//! [`CausalLm`] the commands (`eval`, `generate`, training on token files) are written
//! against.

use burn::module::Module;
use burn::tensor::activation::log_softmax;
use burn::tensor::{FloatDType, Int, Tensor};

use crate::engine::UnitModel;

/// A decoder-only language model: logits for token ids, and units over next-token batches
/// (`[batch, time + 1]` ids: inputs and targets).
pub trait CausalLm: UnitModel<Batch = Tensor<2, Int>, Hidden = Tensor<3>> + Module + Clone + Sync + 'static {
    /// Logits `[batch, time, vocab]` for token ids `[batch, time]`.
    fn logits(&self, ids: Tensor<2, Int>) -> Tensor<3>;
}

impl CausalLm for super::Gpt {
    fn logits(&self, ids: Tensor<2, Int>) -> Tensor<3> {
        self.forward(ids)
    }
}

impl CausalLm for super::Gpt2 {
    fn logits(&self, ids: Tensor<2, Int>) -> Tensor<3> {
        self.forward(ids)
    }
}

impl CausalLm for super::Llama {
    fn logits(&self, ids: Tensor<2, Int>) -> Tensor<3> {
        self.forward(ids)
    }
}

/// The model's input tokens: all but the last of each sequence in `tokens`.
pub(crate) fn inputs(tokens: &Tensor<2, Int>) -> Tensor<2, Int> {
    let [b, t1] = tokens.dims();
    tokens.clone().slice([0..b, 0..t1 - 1])
}

/// Mean cross-entropy (in f32) of `logits` `[batch, time, vocab]` against the next tokens
/// of `tokens` `[batch, time + 1]`.
pub(crate) fn cross_entropy(logits: Tensor<3>, tokens: &Tensor<2, Int>) -> Tensor<1> {
    let [b, t1] = tokens.dims();
    let t = t1 - 1;
    let targets = tokens.clone().slice([0..b, 1..t1]).reshape([b * t, 1]);
    let logits = logits.cast(FloatDType::F32);
    let vocab = logits.dims()[2];
    let log_probs = log_softmax(logits.reshape([b * t, vocab]), 1);
    log_probs.gather(1, targets).mean().neg()
}
