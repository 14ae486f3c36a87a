//! What every built-in language model shares: next-token batches and their loss, and the
//! [`CausalLm`] the commands (`eval`, `generate`, training on token files) are written
//! against.

use burn::module::Module;
use burn::tensor::activation::log_softmax;
use burn::tensor::{FloatDType, Int, Tensor, TensorData};

use super::layers::KvCache;
use super::lm_batch::LmBatch;
use zerotrain::engine::UnitModel;
use zerotrain::nn::LinearCrossEntropy;
use zerotrain::nn::parallel::ParallelGroup;

/// A decoder-only language model: logits for token ids, and units over next-token batches
/// ([`LmBatch`]: `[batch, time + 1]` ids, inputs and targets, and which targets count).
pub trait CausalLm: UnitModel<Batch = LmBatch, Hidden = Tensor<3>> + Module + Clone + Sync + 'static {
    /// Logits `[batch, time, vocab]` for token ids `[batch, time]`.
    fn logits(&self, ids: Tensor<2, Int>) -> Tensor<3>;

    /// The mean next-token [`cross_entropy`] on `tokens` `[batch, time + 1]` (the model run
    /// as one: what the units compute together). The built-in models compute it through
    /// [`LinearCrossEntropy`](zerotrain::nn::LinearCrossEntropy), never forming the whole
    /// logits.
    fn next_token_loss(&self, tokens: &Tensor<2, Int>) -> Tensor<1> {
        self.whole_logits_loss(tokens)
    }

    /// The same loss as [`cross_entropy`] of the whole logits `[batch, time, vocab]` (what
    /// [`next_token_loss`](Self::next_token_loss) is for a model without a blocked head):
    /// the unfused reference, and what `bench gpu --whole-logits` times.
    fn whole_logits_loss(&self, tokens: &Tensor<2, Int>) -> Tensor<1> {
        cross_entropy(self.logits(inputs(tokens)), tokens)
    }

    /// Logits `[batch, 1, vocab]` of the token after `ids` `[batch, time]`, which follow the
    /// tokens `cache` holds (they are at positions `cache.len()..`) and whose keys and
    /// values join it; `None` for a model that keeps no cache (then it is left as it was).
    fn next_logits(&self, ids: Tensor<2, Int>, cache: &mut KvCache) -> Option<Tensor<3>> {
        let _ = (ids, cache);
        None
    }

    /// Continues `prompt` by `count` tokens, each from the logits of the last `context`
    /// tokens: greedy at temperature 0, else sampled from the `top_k` most likely (all when
    /// 0) at `temperature`, drawing from the deterministic generator `rng`; ends early after
    /// a token of `stop` (the model's end tokens), which it keeps. A model with a
    /// [`next_logits`](Self::next_logits) computes the prompt once and then each new token
    /// alone, over the keys and values it has cached, until the tokens pass `context`;
    /// from there (and for a model without) each token is a forward pass over the last
    /// `context`. Runs where the model's parameters are; a device that fails reading the
    /// logits is an [`Error::Device`](zerotrain::Error::Device), not a token.
    fn generate(
        &self,
        prompt: &[u32],
        count: usize,
        context: usize,
        sampling: Sampling,
        stop: &[u32],
        rng: &mut u64,
    ) -> zerotrain::Result<Vec<u32>> {
        // Without autodiff: on an autodiff device each forward's graph stays reachable from
        // the parameters (leaves that require grad) until a backward that never comes.
        let model = self.valid();
        let device = model.devices().into_iter().next().unwrap_or_default();
        let ids = |tokens: &[u32]| {
            let ids: Vec<i64> = tokens.iter().map(|&x| i64::from(x)).collect();
            Tensor::<2, Int>::from_data(TensorData::new(ids, [1, tokens.len()]), &device)
        };
        let mut tokens = prompt.to_vec();
        let mut cache = KvCache::default();
        for _ in 0..count {
            let cached = match tokens.len() <= context {
                true => model.next_logits(ids(&tokens[cache.len()..]), &mut cache),
                false => None,
            };
            let last = cached.unwrap_or_else(|| {
                cache = KvCache::default();
                last_position(model.logits(ids(&tokens[tokens.len().saturating_sub(context)..])))
            });
            let last = zerotrain::engine::readout::f32s(last.cast(FloatDType::F32), "the logits")?;
            let next = pick(&last, sampling, rng);
            tokens.push(next);
            if stop.contains(&next) {
                break;
            }
        }
        Ok(tokens.split_off(prompt.len()))
    }
}

/// How [`CausalLm::generate`] picks each token.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sampling {
    /// 0: the most likely token; else the softmax's temperature.
    pub temperature: f32,
    /// Sample among the `top_k` most likely tokens only (0: all).
    pub top_k: usize,
    /// Then among the fewest most likely whose probabilities (at `temperature`, among those
    /// `top_k`) reach `top_p` (nucleus sampling; 1: all).
    pub top_p: f32,
}

impl Sampling {
    /// The most likely token every time.
    pub const GREEDY: Self = Self { temperature: 0.0, top_k: 0, top_p: 1.0 };

    /// At `temperature` among the `top_k` most likely (0: all), no nucleus.
    pub const fn top_k(temperature: f32, top_k: usize) -> Self {
        Self { temperature, top_k, top_p: 1.0 }
    }
}

/// The most likely token (temperature 0), or one sampled at `temperature` among the
/// `top_k` most likely, and of those the fewest whose probabilities reach `top_p`: the
/// order `transformers` applies its temperature, top-k and top-p warpers in.
fn pick(logits: &[f32], sampling: Sampling, rng: &mut u64) -> u32 {
    let best = logits.iter().enumerate().fold(0, |b, (i, &l)| if l > logits[b] { i } else { b });
    if sampling.temperature <= 0.0 || logits.is_empty() {
        return best as u32;
    }
    let mut candidates: Vec<usize> = (0..logits.len()).collect();
    let nucleus = sampling.top_p < 1.0;
    if nucleus || sampling.top_k > 0 && sampling.top_k < logits.len() {
        candidates.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
    }
    if sampling.top_k > 0 {
        candidates.truncate(sampling.top_k);
    }
    let max = logits[best];
    let mut weights: Vec<f64> =
        candidates.iter().map(|&i| f64::from((logits[i] - max) / sampling.temperature).exp()).collect();
    if nucleus {
        let (total, mut sum) = (weights.iter().sum::<f64>(), 0.0);
        let keep = weights.iter().position(|w| {
            sum += w;
            sum >= f64::from(sampling.top_p) * total
        });
        let keep = keep.map_or(weights.len(), |at| at + 1);
        candidates.truncate(keep);
        weights.truncate(keep);
    }
    let total: f64 = weights.iter().sum();
    *rng = rng.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    let mut target = (*rng >> 11) as f64 / (1u64 << 53) as f64 * total;
    for (&i, w) in candidates.iter().zip(&weights) {
        target -= w;
        if target <= 0.0 {
            return i as u32;
        }
    }
    best as u32
}

impl CausalLm for super::Gpt {
    fn logits(&self, ids: Tensor<2, Int>) -> Tensor<3> {
        self.forward(ids)
    }

    fn next_token_loss(&self, tokens: &Tensor<2, Int>) -> Tensor<1> {
        self.whole_loss(tokens)
    }
}

impl CausalLm for super::Gpt2 {
    fn logits(&self, ids: Tensor<2, Int>) -> Tensor<3> {
        self.forward(ids)
    }

    fn next_token_loss(&self, tokens: &Tensor<2, Int>) -> Tensor<1> {
        self.whole_loss(tokens)
    }

    fn next_logits(&self, ids: Tensor<2, Int>, cache: &mut KvCache) -> Option<Tensor<3>> {
        Some(self.forward_cached(ids, cache))
    }
}

impl CausalLm for super::Llama {
    fn logits(&self, ids: Tensor<2, Int>) -> Tensor<3> {
        self.forward(ids)
    }

    fn next_token_loss(&self, tokens: &Tensor<2, Int>) -> Tensor<1> {
        self.whole_loss(tokens)
    }

    fn next_logits(&self, ids: Tensor<2, Int>, cache: &mut KvCache) -> Option<Tensor<3>> {
        Some(self.forward_cached(ids, cache))
    }
}

/// The last position of `x` `[batch, time, width]`: `[batch, 1, width]`.
pub(crate) fn last_position(x: Tensor<3>) -> Tensor<3> {
    let time = x.dims()[1];
    x.narrow(1, time - 1, 1)
}

/// Unit `unit` of a decoder declared as its embedding (unit 0, on the batch's inputs),
/// `blocks` blocks, and its head and loss (the last unit: see [`head_loss`]).
pub(crate) fn decoder_unit(
    unit: usize,
    input: Option<Tensor<3>>,
    batch: &LmBatch,
    blocks: usize,
    embed: impl FnOnce(Tensor<2, Int>) -> Tensor<3>,
    block: impl FnOnce(usize, Tensor<3>) -> Tensor<3>,
    head: impl FnOnce(Tensor<3>) -> Tensor<3>,
) -> Tensor<3> {
    match (unit, input) {
        (0, _) => embed(inputs(&batch.tokens)),
        (i, Some(h)) if i <= blocks => block(i - 1, h),
        (_, Some(h)) => head(h),
        (_, None) => unreachable!("only unit 0 runs without an input"),
    }
}

/// What a decoder's last unit returns: the mean next-token loss of its final (normed)
/// hidden states `h` `[batch, time, d]` under the head `weight` `[vocab, d]` and `bias`,
/// against the next tokens of `batch` (those of positions `first..`, where `h` is a
/// sequence-parallel rank's part of the sequence; of its counted targets only, divided as
/// it says, where only some count), as a `[1, 1, 1]` tensor (the
/// unit's output; [`unit_loss`] reads it). Through [`LinearCrossEntropy`], so the logits
/// never exist whole: the head's matmul and the loss run over blocks of tokens. Where the
/// vocabulary is split over a tensor-parallel group (`split`: the group, the whole
/// vocabulary's size; `weight` this rank's rows), each rank forms its part of the logits
/// and the ranks exchange three values per token (`LinearCrossEntropy::forward_parallel`).
pub(crate) fn head_loss(
    h: Tensor<3>,
    (weight, bias): (Tensor<2>, Option<Tensor<1>>),
    (batch, first): (&LmBatch, usize),
    split: Option<(&ParallelGroup, usize)>,
) -> Tensor<3> {
    let [b, t, d] = h.dims();
    let (targets, weights) = batch.targets(first, t);
    let h = h.reshape([b * t, d]);
    if let Some(weights) = weights {
        return LinearCrossEntropy::new()
            .forward_weighted(h, (weight, bias), targets, weights, split)
            .reshape([1, 1, 1]);
    }
    match split {
        Some((group, vocab)) if group.size() > 1 => {
            LinearCrossEntropy::new().forward_parallel(h, (weight, bias), targets, vocab, group).reshape([1, 1, 1])
        }
        _ => LinearCrossEntropy::new().forward(h, weight, bias, targets).reshape([1, 1, 1]),
    }
}

/// The loss a decoder's last unit returned ([`head_loss`]'s `[1, 1, 1]`).
pub(crate) fn unit_loss(output: Tensor<3>) -> Tensor<1> {
    output.reshape([1])
}

/// The model's input tokens: all but the last of each sequence in `tokens`.
pub(crate) fn inputs(tokens: &Tensor<2, Int>) -> Tensor<2, Int> {
    let [b, t1] = tokens.dims();
    tokens.clone().slice([0..b, 0..t1 - 1])
}

/// Mean cross-entropy (in f32) of `logits` `[batch, time, vocab]` against the next tokens
/// of `tokens` `[batch, time + 1]`: the loss of every causal language model here, averaged
/// over all `batch * time` predictions however many (through [`zerotrain::reduce::mean`]).
pub fn cross_entropy(logits: Tensor<3>, tokens: &Tensor<2, Int>) -> Tensor<1> {
    let [b, t1] = tokens.dims();
    let t = t1 - 1;
    let targets = tokens.clone().slice([0..b, 1..t1]).reshape([b * t, 1]);
    let logits = logits.cast(FloatDType::F32);
    let vocab = logits.dims()[2];
    let log_probs = log_softmax(logits.reshape([b * t, vocab]), 1);
    // Through `reduce::mean`: `batch * time` may pass what one device reduction counts.
    zerotrain::reduce::mean(log_probs.gather(1, targets)).neg()
}

#[cfg(test)]
mod tests;
