//! Cross-entropy over logits whose vocabulary is split across a group.

use burn::tensor::{FloatDType, Int, Tensor};

use super::ParallelGroup;
use super::linear::local_ids;

/// The mean cross-entropy of `logits` `[tokens, part]`, this rank's consecutive part of a
/// vocabulary of `vocab` ids ([`ParallelGroup::share`]: the part a vocabulary-parallel head
/// computes), against
/// `targets` `[tokens]` (ids into the whole vocabulary): the same scalar on every rank, and
/// each rank's logits receive their slice of the unsplit loss's gradient. No rank forms the
/// whole logits: the group exchanges three numbers per token (the maximum, the sum of
/// exponentials, the target's logit), as Megatron-LM's vocabulary-parallel loss does. It
/// computes in f32 whatever the logits' dtype, and returns an f32 `[1]`.
///
/// # Panics
/// Where the logits' width is not this rank's share of `vocab`.
pub fn vocab_parallel_cross_entropy(
    logits: Tensor<2>,
    targets: Tensor<1, Int>,
    vocab: usize,
    group: &ParallelGroup,
) -> Tensor<1> {
    let [tokens, local] = logits.dims();
    let part = group.share(vocab);
    assert_eq!(
        local,
        part.len(),
        "vocab_parallel_cross_entropy: rank {} holds ids {part:?} of {vocab}, the logits {local}",
        group.rank()
    );
    let z = logits.cast(FloatDType::F32);
    // The maximum only steadies the exponentials; the loss does not depend on it.
    let max = group.max(z.clone().max_dim(1));
    let sum = group.reduce_from((z.clone() - max.clone()).exp().sum_dim(1));
    let (ids, inside) = local_ids(targets.reshape([tokens, 1]), &part);
    let target = group.reduce_from(z.gather(1, ids) * inside.float());
    (sum.log() + max - target).mean()
}
