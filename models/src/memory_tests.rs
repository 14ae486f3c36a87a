//! What the `zerotrain::nn` building blocks hold, measured by the counting allocator of
//! this crate's tests (this thread's bytes): the loss without the whole logits, attention
//! without its `[time, time]` probabilities.

use burn::tensor::activation::log_softmax;
use burn::tensor::{Device, Int, Tensor, TensorData};
use zerotrain::nn::{LinearCrossEntropy, causal_attention};

use crate::stream_tests::live_bytes;

/// A loss over 4,096 tokens of a 4,096-token vocabulary (64 MiB of f32 logits) holds at
/// most a quarter of that at once in blocks of 256 tokens (4 MiB of logits each), forward
/// and backward, where Burn's unfused loss holds more than the logits (this thread's
/// bytes, by the counting allocator; 9.3 MB against 201 MB measured).
#[test]
fn the_blocked_loss_never_holds_the_whole_logits() {
    let (n, d, vocab) = (4096, 16, 4096);
    let logits_bytes = (n * vocab * size_of::<f32>()) as isize;
    let device = Device::flex().autodiff();
    let leaf = |len: usize, shape: [usize; 2]| {
        let values: Vec<f32> = (0..len).map(|i| ((i * 37 % 101) as f32 - 50.0) / 100.0).collect();
        Tensor::<2>::from_data(TensorData::new(values, shape), &device).require_grad()
    };
    let targets = || {
        let ids: Vec<i64> = (0..n as i64).map(|i| i * 13 % vocab as i64).collect();
        Tensor::<1, Int>::from_data(TensorData::new(ids, [n]), &device)
    };
    let (hidden, weight) = (leaf(n * d, [n, d]), leaf(vocab * d, [vocab, d]));
    let before = live_bytes::reset();
    let loss =
        LinearCrossEntropy::new().with_block_tokens(256).forward(hidden.clone(), weight.clone(), None, targets());
    let grads = loss.backward();
    let blocked = live_bytes::peak() - before;
    assert!(hidden.grad(&grads).is_some() && weight.grad(&grads).is_some());
    drop(grads);

    let before = live_bytes::reset();
    let logits = hidden.clone().matmul(weight.clone().transpose());
    let loss = log_softmax(logits, 1).gather(1, targets().reshape([n, 1])).mean().neg();
    let grads = loss.backward();
    let whole = live_bytes::peak() - before;
    assert!(hidden.grad(&grads).is_some());
    eprintln!("logits {logits_bytes} B; held at most {blocked} B in blocks, {whole} B whole");
    assert!(whole > logits_bytes, "the unfused loss held {whole} B, less than its logits: the count misses them");
    assert!(blocked <= logits_bytes / 4, "the blocked loss held {blocked} B of {logits_bytes} B of logits");
}

/// Attention at a fixed 4,096 tokens (batch x time) keeps, between forward and backward, what
/// does not grow with the context: the output and a value per query row (the inputs
/// existed before). Burn's unfused attention keeps its `[time, time]` probabilities, which
/// grow 4x from context 512 to 2048 at the same tokens (16 MiB to 64 MiB at 2 heads).
/// Both backward passes give the inputs their gradients.
#[test]
fn attention_keeps_what_grows_with_the_tokens_not_the_context() {
    let (tokens, heads, d) = (4096, 2, 16);
    let device = Device::flex().autodiff();
    let kept = |time: usize, fused: bool| -> isize {
        let batch = tokens / time;
        let values: Vec<f32> = (0..batch * heads * time * d).map(|i| ((i * 37 % 101) as f32 - 50.0) / 100.0).collect();
        let leaf =
            || Tensor::<4>::from_data(TensorData::new(values.clone(), [batch, heads, time, d]), &device).require_grad();
        let (q, k, v) = (leaf(), leaf(), leaf());
        let before = live_bytes::reset();
        let out = match fused {
            true => causal_attention(q.clone(), k.clone(), v.clone(), 0.25),
            false => {
                let scores = q.clone().matmul(k.clone().swap_dims(2, 3)).mul_scalar(0.25);
                let mask = burn::nn::attention::generate_autoregressive_mask(batch, time, &device)
                    .reshape([batch, 1, time, time])
                    .expand([batch, heads, time, time]);
                burn::tensor::activation::softmax(scores.mask_fill(mask, f32::NEG_INFINITY), 3).matmul(v.clone())
            }
        };
        let held = live_bytes::reset() - before;
        let grads = out.sum().backward();
        assert!(q.grad(&grads).is_some() && k.grad(&grads).is_some() && v.grad(&grads).is_some());
        held
    };
    let (ours, theirs) = ([kept(512, true), kept(2048, true)], [kept(512, false), kept(2048, false)]);
    eprintln!("kept after forward: ours {ours:?} B, unfused {theirs:?} B");
    let probabilities = (tokens * heads * 2048 * size_of::<f32>()) as isize;
    assert!(
        theirs[1] >= probabilities && theirs[1] >= 3 * theirs[0],
        "the unfused kept {theirs:?}: the count misses it"
    );
    assert!(ours[1] <= ours[0] + ours[0] / 4, "kept {ours:?}: it grows with the context");
    assert!(ours[1] <= probabilities / 16, "kept {} B at context 2048", ours[1]);
}
