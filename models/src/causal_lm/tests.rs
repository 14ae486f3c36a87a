use super::*;

/// The tokens `sampling` draws from `logits` over many draws.
fn drawn(logits: &[f32], sampling: Sampling) -> std::collections::BTreeSet<u32> {
    let mut rng = 9;
    (0..2000).map(|_| pick(logits, sampling, &mut rng)).collect()
}

/// Softmax of [2, 1, 0, -1]: 0.644, 0.237, 0.087, 0.032 (cumulative 0.644, 0.881,
/// 0.968, 1). The nucleus is the fewest most likely reaching top_p; top-k cuts first.
#[test]
fn the_nucleus_is_the_fewest_likeliest_tokens_reaching_top_p() {
    let logits = [0.0, 2.0, -1.0, 1.0];
    let with = |top_k, top_p| Sampling { temperature: 1.0, top_k, top_p };
    assert_eq!(drawn(&logits, with(0, 1.0)), [0, 1, 2, 3].into());
    assert_eq!(drawn(&logits, with(0, 0.5)), [1].into());
    assert_eq!(drawn(&logits, with(0, 0.85)), [1, 3].into());
    assert_eq!(drawn(&logits, with(0, 0.9)), [0, 1, 3].into());
    // Among the top 2 (0.731, 0.269 of them), 0.9 needs both; 0.7 the first.
    assert_eq!(drawn(&logits, with(2, 0.9)), [1, 3].into());
    assert_eq!(drawn(&logits, with(2, 0.7)), [1].into());
    assert_eq!(drawn(&logits, Sampling::GREEDY), [1].into());
}

/// With a cache of keys and values, the logits of the next token equal the last row of
/// a forward pass over every token so far: after the prompt, after each single token,
/// after several at once (queries behind cached keys); and `generate` picks the tokens
/// a forward pass over the window picks, past the point where the window slides.
fn cache_equals_full_passes<M: CausalLm>(model: M) {
    let model = model.valid();
    let device = burn::tensor::Device::flex();
    let ids = |tokens: &[u32]| {
        let v: Vec<i64> = tokens.iter().map(|&x| i64::from(x)).collect();
        Tensor::<2, Int>::from_data(TensorData::new(v, [1, tokens.len()]), &device)
    };
    let row = |t: Tensor<3>| t.into_data().convert::<f32>().try_to_vec::<f32>().unwrap();
    let full = |tokens: &[u32]| row(last_position(model.logits(ids(tokens))));
    let tokens = [3u32, 7, 1, 9, 4, 4, 0, 8, 2, 6, 5];
    let mut cache = KvCache::default();
    for (from, to) in [(0, 5), (5, 6), (6, 7), (7, 10), (10, 11)] {
        let cached = row(model.next_logits(ids(&tokens[from..to]), &mut cache).expect("a cache"));
        let expected = full(&tokens[..to]);
        assert_eq!(cache.len(), to);
        for (i, (c, e)) in cached.iter().zip(&expected).enumerate() {
            assert!((c - e).abs() <= 1e-5 * (1.0 + e.abs()), "after {to} tokens, logit {i}: {c} vs {e}");
        }
    }
    // Greedy: each token the argmax of a forward pass over the last `context`.
    let (prompt, context, count) = (&tokens[..4], 8, 10);
    let mut expected = prompt.to_vec();
    for _ in 0..count {
        let logits = full(&expected[expected.len().saturating_sub(context)..]);
        let best = (0..logits.len()).fold(0, |b, i| if logits[i] > logits[b] { i } else { b });
        expected.push(best as u32);
    }
    let got = model.generate(prompt, count, context, Sampling::GREEDY, &[], &mut 1).unwrap();
    assert_eq!(got, expected[prompt.len()..]);
}

/// GPT-2, and Qwen3 (grouped kv heads, per-head norms, linear rope scaling), with
/// weights of std 0.5 so that the likeliest tokens are far apart.
#[test]
fn cached_logits_and_generation_equal_full_forward_passes() {
    use crate::hf::{Family, HfConfig, weights::Weights};
    let gpt2 = serde_json::json!({"model_type": "gpt2", "n_embd": 16, "n_layer": 2, "n_head": 2,
                                  "n_positions": 16, "vocab_size": 10});
    let qwen3 = serde_json::json!({"model_type": "qwen3", "hidden_size": 8, "intermediate_size": 12,
        "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 10,
        "tie_word_embeddings": false, "rope_scaling": {"rope_type": "linear", "factor": 2.0}});
    for config in [gpt2, qwen3] {
        let device = burn::tensor::Device::flex();
        device.seed(5);
        let w = Weights::fresh(&device, 0.5);
        match HfConfig::from_json(config).unwrap().family {
            Family::Gpt2(shape) => cache_equals_full_passes(super::super::Gpt2::new(&shape, &w)),
            Family::Llama(shape) => cache_equals_full_passes(super::super::Llama::new(&shape, &w)),
        }
    }
}

/// Every float parameter's gradient in `grads`, in declaration order (none: empty).
/// The loss of `batch` through the units, as the engine runs them.
fn units_loss<M: CausalLm>(model: &M, batch: &LmBatch) -> Tensor<1> {
    let mut h = None;
    for unit in 0..model.units().len() {
        h = Some(model.forward_unit(unit, h, batch));
    }
    model.output_loss(h.expect("units"), batch)
}

/// Rows packing sequences (positions restarting at each, attention inside each, the
/// targets across a boundary not counted) give the loss and gradients of each sequence
/// run alone, summed (each divided by the same count), within 1e-5: the built-in GPT,
/// GPT-2 (learned positions), Qwen2 and LLaMA (rotary positions, grouped kv heads).
/// Rotary scores depend on relative positions only, so for those the test holds the
/// attention's bounds (the learned positions fail it where positions do not restart).
#[test]
fn packed_rows_train_as_their_sequences_alone() {
    use crate::hf::{Family, HfConfig, weights::Weights};
    fn check<M: CausalLm>(name: &str, model: M, vocab: i64) {
        let device = model.devices().into_iter().next().unwrap();
        // Row 0 packs sequences of 4, 5 and 2 tokens; row 1 is one of 11.
        let rows: [&[usize]; 2] = [&[4, 5, 2], &[11]];
        let ids: Vec<i64> = (0..22).map(|i| (i * 5 + i * i / 3 + 1) % vocab).collect();
        let (mut starts, mut weights, mut alone) = (Vec::new(), Vec::new(), Vec::new());
        for (r, lengths) in rows.iter().enumerate() {
            let mut at = 0;
            for &n in lengths.iter() {
                alone.push(ids[r * 11 + at..r * 11 + at + n].to_vec());
                for t in at..at + n {
                    if t < 10 {
                        starts.push(at as i64);
                        weights.push(if t + 1 < at + n { 1.0f32 } else { 0.0 });
                    }
                }
                at += n;
            }
        }
        let counted = weights.iter().sum::<f32>() as f64;
        let tokens = Tensor::<2, Int>::from_data(TensorData::new(ids.clone(), [2, 11]), &device);
        let weights = Tensor::<2>::from_data(TensorData::new(weights, [2, 10]), &device);
        let starts = Tensor::<2, Int>::from_data(TensorData::new(starts, [2, 10]), &device);
        let packed = units_loss(&model, &LmBatch::counted(tokens, weights, counted).with_starts(starts));
        let mut sum: Option<Tensor<1>> = None;
        for seq in alone.iter().filter(|s| s.len() > 1) {
            let n = seq.len();
            let tokens = Tensor::<2, Int>::from_data(TensorData::new(seq.clone(), [1, n]), &device);
            let ones = Tensor::<2>::ones([1, n - 1], &device);
            let loss = units_loss(&model, &LmBatch::counted(tokens, ones, counted));
            sum = Some(match sum {
                Some(s) => s + loss,
                None => loss,
            });
        }
        let sum = sum.expect("sequences");
        let value = |t: &Tensor<1>| t.clone().into_scalar::<f32>();
        let (a, b) = (value(&packed), value(&sum));
        assert!((a - b).abs() <= 1e-5 * a, "{name}: packed {a}, alone {b}");
        let (ga, gb) = (param_grads(&model, &packed.backward()), param_grads(&model, &sum.backward()));
        for (i, (x, y)) in ga.iter().zip(&gb).enumerate() {
            assert_eq!(x.len(), y.len(), "{name}: parameter {i}");
            let scale = y.iter().fold(0f32, |m, v| m.max(v.abs())).max(f32::MIN_POSITIVE);
            let error = x.iter().zip(y).fold(0f32, |m, (p, q)| m.max((p - q).abs())) / scale;
            assert!(error <= 1e-5, "{name}: parameter {i}'s gradient off by {error:e} of its largest");
        }
    }
    let device = burn::tensor::Device::flex().autodiff();
    device.seed(4);
    let config = crate::GptConfig { n_layer: 2, n_head: 2, n_embd: 8, block_size: 12, vocab_size: 37, tied_head: true };
    check("GPT", crate::Gpt::new(&config, &device), 37);
    let gpt2 = serde_json::json!({"model_type": "gpt2", "n_embd": 8, "n_layer": 2, "n_head": 2,
                                  "n_positions": 16, "vocab_size": 41});
    let qwen2 = serde_json::json!({"model_type": "qwen2", "hidden_size": 8, "intermediate_size": 12,
        "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 43,
        "tie_word_embeddings": false});
    let llama = serde_json::json!({"model_type": "llama", "hidden_size": 16, "intermediate_size": 12,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 43,
        "tie_word_embeddings": true});
    for config in [gpt2, qwen2, llama] {
        let w = Weights::fresh(&device, 0.5);
        match HfConfig::from_json(config).unwrap().family {
            Family::Gpt2(shape) => check("GPT-2", super::super::Gpt2::new(&shape, &w), 41),
            Family::Llama(shape) => check("LLaMA", super::super::Llama::new(&shape, &w), 43),
        }
    }
}

fn param_grads<M: Module>(model: &M, grads: &burn::tensor::Gradients) -> Vec<Vec<f32>> {
    struct Walk<'a>(&'a burn::tensor::Gradients, Vec<Vec<f32>>);
    impl burn::module::ModuleVisitor for Walk<'_> {
        fn visit_float<const D: usize>(&mut self, param: &burn::module::Param<Tensor<D>>) {
            let grad = param.val().grad(self.0).map(|g| g.into_data().convert::<f32>().try_to_vec().unwrap());
            self.1.push(grad.unwrap_or_default());
        }
    }
    let mut walk = Walk(grads, Vec::new());
    model.visit(&mut walk);
    walk.1
}

/// The built-in models' loss (the head and loss over blocks of tokens, what their last
/// unit computes) equals [`cross_entropy`] of their whole logits within 1e-6 relative in
/// f32, and every parameter's gradient within 1e-5 of its largest value (the gradients
/// pass through the same layers; only the head's sums run in another order).
#[test]
fn the_models_loss_equals_the_cross_entropy_of_their_whole_logits() {
    use crate::hf::{Family, HfConfig, weights::Weights};
    fn check<M: CausalLm>(name: &str, model: M, vocab: i64) {
        let device = model.devices().into_iter().next().unwrap();
        let ids: Vec<i64> = (0..2 * 9).map(|i| (i * 5 + i * i / 3) % vocab).collect();
        let tokens = Tensor::<2, Int>::from_data(TensorData::new(ids, [2, 9]), &device);
        let whole = model.whole_logits_loss(&tokens);
        let fused = model.next_token_loss(&tokens);
        let value = |t: &Tensor<1>| t.clone().into_scalar::<f32>();
        let (a, b) = (value(&whole), value(&fused));
        assert!((a - b).abs() <= 1e-6 * a, "{name}: whole logits {a}, blocks {b}");
        let (ga, gb) = (param_grads(&model, &whole.backward()), param_grads(&model, &fused.backward()));
        assert_eq!(ga.len(), gb.len());
        for (i, (x, y)) in ga.iter().zip(&gb).enumerate() {
            assert!(!x.is_empty() && x.len() == y.len(), "{name}: parameter {i} lacks a gradient");
            let scale = x.iter().fold(0f32, |m, v| m.max(v.abs())).max(f32::MIN_POSITIVE);
            let error = x.iter().zip(y).fold(0f32, |m, (p, q)| m.max((p - q).abs())) / scale;
            assert!(error <= 1e-5, "{name}: parameter {i}'s gradient off by {error:e} of its largest");
        }
    }
    let device = burn::tensor::Device::flex().autodiff();
    device.seed(3);
    for tied_head in [true, false] {
        let config = crate::GptConfig { n_layer: 1, n_head: 2, n_embd: 8, block_size: 8, vocab_size: 37, tied_head };
        check(&format!("GPT tied {tied_head}"), crate::Gpt::new(&config, &device), 37);
    }
    let gpt2 = serde_json::json!({"model_type": "gpt2", "n_embd": 8, "n_layer": 1, "n_head": 2,
                                  "n_positions": 16, "vocab_size": 41});
    let qwen2 = serde_json::json!({"model_type": "qwen2", "hidden_size": 8, "intermediate_size": 12,
        "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 43,
        "tie_word_embeddings": false});
    let llama = serde_json::json!({"model_type": "llama", "hidden_size": 8, "intermediate_size": 12,
        "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 2, "vocab_size": 43,
        "tie_word_embeddings": true});
    for config in [gpt2, qwen2, llama] {
        let w = Weights::fresh(&device, 0.5);
        match HfConfig::from_json(config).unwrap().family {
            Family::Gpt2(shape) => check("GPT-2", super::super::Gpt2::new(&shape, &w), 41),
            Family::Llama(shape) => check("LLaMA", super::super::Llama::new(&shape, &w), 43),
        }
    }
}
