//! The keys and values a decoder keeps for the tokens it has seen ([`KvCache`]), so that
//! generation computes each new token alone.

use burn::tensor::Tensor;

/// The keys and values a decoder has computed for the tokens it has seen, layer by layer,
/// so that each new token is computed alone (Hugging Face's `use_cache`): what
/// [`CausalLm::generate`](super::CausalLm::generate) keeps while it samples.
#[derive(Debug, Default)]
pub struct KvCache {
    layers: Vec<Option<(Tensor<4>, Tensor<4>)>>,
    len: usize,
}

impl KvCache {
    /// The number of tokens whose keys and values are held.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether no token is held.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Takes `time` more tokens: returns the position of the first.
    pub(crate) fn advance(&mut self, time: usize) -> usize {
        self.len += time;
        self.len - time
    }

    /// Layer `layer`'s keys and values `[batch, kv_heads, past + time, head_dim]`: those held
    /// followed by the new `k`, `v`, which are held from now on.
    pub(crate) fn extend(&mut self, layer: usize, k: Tensor<4>, v: Tensor<4>) -> (Tensor<4>, Tensor<4>) {
        if self.layers.len() <= layer {
            self.layers.resize_with(layer + 1, || None);
        }
        let (k, v) = match self.layers[layer].take() {
            Some((past_k, past_v)) => (Tensor::cat(vec![past_k, k], 2), Tensor::cat(vec![past_v, v], 2)),
            None => (k, v),
        };
        self.layers[layer] = Some((k.clone(), v.clone()));
        (k, v)
    }
}

/// A layer's attention inputs `k`, `v` with a cache's: all of them when there is a cache
/// (which holds them from now on), else these.
pub(crate) fn with_cached(cache: Option<(&mut KvCache, usize)>, k: Tensor<4>, v: Tensor<4>) -> (Tensor<4>, Tensor<4>) {
    match cache {
        Some((cache, layer)) => cache.extend(layer, k, v),
        None => (k, v),
    }
}
