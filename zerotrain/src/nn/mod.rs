//! Building blocks for a user's own models that keep training memory down where Burn's own
//! would not: [`LinearCrossEntropy`], a language model's output head and loss that never
//! hold the whole `[tokens, vocabulary]` logits, and [`causal_attention`], which never keeps
//! the `[time, time]` probabilities for backward; and [`lora`], PEFT's low-rank adapters
//! for a frozen linear layer.
//!
//! They are plain functions of Burn tensors, on every backend and with or without autodiff;
//! the built-in models of `zerotrain-models` use them too.

mod attention;
mod cross_entropy;
pub mod lora;
pub mod parallel;

pub use attention::{
    CausalAttentionOps, attention_kernels, causal_attention, packed_causal_attention, set_attention_kernels,
};
pub use cross_entropy::{LinearCrossEntropy, TokenWeights};

#[cfg(test)]
mod tests;
