//! The families split over tensor-parallel thread ranks against the same model whole: the
//! loss, the logits and every parameter's gradient (each rank's slice against the slice
//! of the whole model's gradient that Megatron's plan gives that rank, written out here
//! name by name), fresh and imported; shapes that cannot split are refused by field.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use burn::module::{ModuleVisitor, Param};
use burn::tensor::{Device, Int, Tensor, TensorData};
use serde_json::json;
use zerotrain::engine::UnitModel;
use zerotrain::nn::parallel::{ParallelGroup, ParallelGroups, Split};
use zerotrain_zero::{Collective, ThreadWorld};

use super::super::*;
use super::{folder, write};

/// `f(group)` on each of `n` thread ranks of one world, in rank order.
fn on_ranks<T: Send>(n: usize, f: impl Fn(ParallelGroup) -> T + Sync) -> Vec<T> {
    let world = ThreadWorld::new(n, Duration::from_secs(60));
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..n)
            .map(|r| {
                let comm: Arc<dyn Collective> = Arc::new(world.communicator(r));
                let f = &f;
                s.spawn(move || f(ParallelGroup::new(comm)))
            })
            .collect();
        handles.into_iter().map(|h| h.join().expect("a rank panicked")).collect()
    })
}

/// `group` as the tensor group, no sequence parallelism.
pub(super) fn tensor(group: &ParallelGroup) -> ParallelGroups {
    ParallelGroups { tensor: group.clone(), sequence: ParallelGroup::alone() }
}

/// What a run of a model gives: the loss, the logits, and each parameter's gradient and
/// value by module path.
struct Run {
    loss: f32,
    logits: Vec<f32>,
    grads: BTreeMap<String, Vec<f32>>,
    values: BTreeMap<String, Vec<f32>>,
}

fn run<M: CausalLm>(model: M, vocab: i64) -> Run {
    struct Walk<'a> {
        path: Vec<String>,
        grads: &'a burn::tensor::Gradients,
        out: (BTreeMap<String, Vec<f32>>, BTreeMap<String, Vec<f32>>),
    }
    impl ModuleVisitor for Walk<'_> {
        fn enter_module(&mut self, name: &str, _: &str) {
            self.path.push(name.to_string());
        }
        fn exit_module(&mut self, _: &str, _: &str) {
            self.path.pop();
        }
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            let read = |t: Tensor<D>| t.into_data().convert::<f32>().try_to_vec::<f32>().unwrap();
            let grad = param.val().grad(self.grads).map(read).unwrap_or_default();
            self.out.0.insert(self.path.join("."), grad);
            self.out.1.insert(self.path.join("."), read(param.val()));
        }
    }
    let device = Device::flex().autodiff();
    let ids: Vec<i64> = (0..2 * 7).map(|i| (i * 5 + i * i / 3) % vocab).collect();
    let tokens = Tensor::<2, Int>::from_data(TensorData::new(ids, [2, 7]), &device);
    let loss = model.next_token_loss(&tokens);
    let grads = loss.clone().backward();
    let logits = model.logits(tokens.slice([0..2, 0..6])).into_data().convert::<f32>().try_to_vec().unwrap();
    let mut walk = Walk { path: Vec::new(), grads: &grads, out: Default::default() };
    model.visit(&mut walk);
    Run { loss: loss.into_scalar::<f32>(), logits, grads: walk.out.0, values: walk.out.1 }
}

fn run_hf(model: HfModel, vocab: i64) -> Run {
    match model {
        HfModel::Gpt2(m) => run(m, vocab),
        HfModel::Llama(m) => run(m, vocab),
    }
}

/// Megatron's plan, written out by name: how each parameter of the two families splits.
pub(super) fn expected_split(name: &str) -> Split {
    let rows = Split::Even { dim: 0, blocks: 1 };
    let columns = Split::Even { dim: 1, blocks: 1 };
    let vocabulary = Split::Uneven { dim: 0 };
    let is = |suffix: &str| name.ends_with(suffix);
    if is("embed_tokens.weight") || is("lm_head.weight") || is("wte.weight") {
        vocabulary
    } else if ["q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"].iter().any(|p| name.contains(p)) {
        rows // [out, in], bias [out]
    } else if is("o_proj.weight") || is("down_proj.weight") {
        columns
    } else if is("c_attn.weight") {
        Split::Even { dim: 1, blocks: 3 }
    } else if is("c_attn.bias") {
        Split::Even { dim: 0, blocks: 3 }
    } else if is("c_fc.weight") {
        columns // Conv1D: [in, out]
    } else if is("c_fc.bias") || (is("c_proj.weight") && name.contains("h.")) {
        rows
    } else {
        Split::Whole
    }
}

/// `values` of a tensor of `shape` sliced as `split` gives rank `rank` of `n`.
pub(super) fn slice_of(values: &[f32], shape: &[usize], split: Split, rank: usize, n: usize) -> Vec<f32> {
    let Some(dim) = split.dim() else { return values.to_vec() };
    let ranges = split.ranges(shape[dim], rank, n, "test").unwrap();
    let inner: usize = shape[dim + 1..].iter().product();
    let outer: usize = shape[..dim].iter().product();
    let mut out = Vec::new();
    for o in 0..outer {
        for r in &ranges {
            let at = (o * shape[dim] + r.start) * inner;
            out.extend_from_slice(&values[at..at + r.len() * inner]);
        }
    }
    out
}

pub(super) fn largest_error(got: &[f32], want: &[f32]) -> f32 {
    assert_eq!(got.len(), want.len());
    let scale = want.iter().fold(0f32, |m, v| m.max(v.abs())).max(f32::MIN_POSITIVE);
    got.iter().zip(want).fold(0f32, |m, (g, w)| m.max((g - w).abs())) / scale
}

/// `ranks`' runs against the whole model's run: each rank's loss and logits equal the
/// whole's, each parameter (value and gradient) is its slice. Bound: each value regroups
/// sums of at most a few hundred f32 terms into one partial per rank: 1e-5 relative to
/// the largest (the loss: 1e-6).
fn check(what: &str, whole: &Run, ranks: &[Run], shapes: &BTreeMap<String, Vec<usize>>) {
    let n = ranks.len();
    for (r, got) in ranks.iter().enumerate() {
        let at = format!("{what}, rank {r} of {n}");
        assert!((got.loss - whole.loss).abs() <= 1e-6 * whole.loss.abs(), "{at}: loss {} vs {}", got.loss, whole.loss);
        let error = largest_error(&got.logits, &whole.logits);
        assert!(error <= 1e-5, "{at}: the logits are off by {error:e}");
        assert_eq!(got.grads.keys().collect::<Vec<_>>(), whole.grads.keys().collect::<Vec<_>>(), "{at}");
        for (name, grad) in &got.grads {
            let split = expected_split(name);
            let shape = &shapes[name];
            let value = slice_of(&whole.values[name], shape, split, r, n);
            assert_eq!(got.values[name], value, "{at}: `{name}` is not its slice of the whole");
            let error = largest_error(grad, &slice_of(&whole.grads[name], shape, split, r, n));
            assert!(error <= 1e-5, "{at}: `{name}`'s gradient is off by {error:e} ({split:?})");
        }
    }
}

fn configs() -> Vec<(serde_json::Value, Vec<usize>)> {
    vec![
        // Grouped-query attention: 4 heads over 2 kv heads; 10 ids split 5 + 5.
        (
            json!({"model_type": "llama", "hidden_size": 16, "intermediate_size": 24, "num_hidden_layers": 2,
                   "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 10, "tie_word_embeddings": false}),
            vec![2],
        ),
        // Qwen2's q, k, v biases and a tied head; 11 ids over 4 ranks: 2, 3, 3, 3.
        (
            json!({"model_type": "qwen2", "hidden_size": 16, "intermediate_size": 8, "num_hidden_layers": 1,
                   "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 11, "tie_word_embeddings": true}),
            vec![2, 4],
        ),
        // GPT-2: c_attn's q, k and v each split by heads; 13 ids.
        (
            json!({"model_type": "gpt2", "n_embd": 16, "n_layer": 2, "n_head": 4, "n_positions": 8, "vocab_size": 13}),
            vec![2, 4],
        ),
    ]
}

/// Fresh models: every rank's part of the model drawn from the seed and the names is its
/// slice of the whole model drawn the same way, and trains to the same loss and gradients.
#[test]
fn fresh_split_models_equal_the_whole_model_and_its_gradients() {
    for (config, sizes) in configs() {
        let parsed = HfConfig::from_json(config.clone()).unwrap();
        let vocab = parsed.vocab_size() as i64;
        let shapes: BTreeMap<String, Vec<usize>> = parameter_names(&parsed).into_iter().collect();
        let build =
            |group: &ParallelGroup| fresh_split(&parsed, &Device::flex().autodiff(), &tensor(group), 11).unwrap();
        let whole = run_hf(build(&ParallelGroup::alone()), vocab);
        for n in sizes {
            let ranks = on_ranks(n, |group| run_hf(build(&group), vocab));
            check(&format!("{config} fresh"), &whole, &ranks, &shapes);
        }
    }
}

/// Imported models: each rank reads its slice of every split tensor (the model's lazy
/// parameters and the engine's first values alike) and trains as the whole model does.
#[test]
fn imported_split_models_read_their_slices_and_equal_the_whole_model() {
    for (i, (config, sizes)) in configs().into_iter().enumerate() {
        let dir = folder(&format!("parallel-{i}"));
        write(&dir, &config, |tensors| {
            for (name, (_, shape, bytes)) in tensors.iter_mut() {
                let n: usize = shape.iter().product();
                let values = crate::hf::slices::drawn(3, name, n, 0.3);
                *bytes = values.iter().flat_map(|v| v.to_le_bytes()).collect();
            }
        });
        let parsed = HfConfig::from_json(config.clone()).unwrap();
        let vocab = parsed.vocab_size() as i64;
        let shapes: BTreeMap<String, Vec<usize>> = parameter_names(&parsed).into_iter().collect();
        let whole = run_hf(import(&dir, &Device::flex().autodiff()).unwrap().1, vocab);
        for n in sizes {
            let ranks = on_ranks(n, |group| {
                let (rank, size) = (group.rank(), group.size());
                let model = import_split(&dir, &Device::flex().autodiff(), &tensor(&group)).unwrap().1;
                let initial = match &model {
                    HfModel::Gpt2(m) => m.initial_values(),
                    HfModel::Llama(m) => m.initial_values(),
                }
                .unwrap();
                // The engine's reads of first values: this rank's slice, elements 1.. of it.
                for (name, shape) in &shapes {
                    let all = crate::hf::slices::drawn(3, name, shape.iter().product(), 0.3);
                    let want = slice_of(&all, shape, expected_split(name), rank, size);
                    let mut got = vec![0f32; want.len() - 1];
                    initial.read(name, 1..want.len(), (&mut got).into()).unwrap();
                    assert_eq!(got, want[1..], "rank {rank} of {size}: the first values of `{name}`");
                }
                run_hf(model, vocab)
            });
            check(&format!("{config} imported"), &whole, &ranks, &shapes);
        }
    }
}

/// Heads, kv heads or an MLP width that do not divide over the group are refused, naming
/// the config field, fresh and imported.
#[test]
fn shapes_that_do_not_divide_are_refused_by_their_field() {
    let llama = json!({"model_type": "llama", "hidden_size": 12, "intermediate_size": 18, "num_hidden_layers": 1,
                       "num_attention_heads": 6, "num_key_value_heads": 3, "vocab_size": 10});
    let gpt2 = json!({"model_type": "gpt2", "n_embd": 12, "n_layer": 1, "n_head": 6, "n_inner": 20, "vocab_size": 10});
    let dir = folder("parallel-refused");
    write(&dir, &llama, |_| {});
    let errors = on_ranks(4, |group| {
        let fresh_llama =
            fresh_split(&HfConfig::from_json(llama.clone()).unwrap(), &Device::flex(), &tensor(&group), 1);
        let fresh_gpt2 = fresh_split(&HfConfig::from_json(gpt2.clone()).unwrap(), &Device::flex(), &tensor(&group), 1);
        let imported = import_split(&dir, &Device::flex(), &tensor(&group)).err().unwrap().to_string();
        (fresh_llama.err().unwrap(), fresh_gpt2.err().unwrap(), imported)
    });
    for (llama, gpt2, imported) in errors {
        assert!(llama.contains("`num_attention_heads` (6) does not divide by the tensor-parallel size 4"), "{llama}");
        assert!(gpt2.contains("`n_head` (6) does not divide by the tensor-parallel size 4"), "{gpt2}");
        assert!(imported.contains("`num_attention_heads` (6)") && imported.contains("more problem"), "{imported}");
    }
}

/// One forward and backward of `model`'s loss through its units (as the engine runs them)
/// on 2 sequences of `.1` ids, from a vocabulary of `.0`.
struct LossOnly(i64, usize);

impl WithModel for LossOnly {
    type Output = ();

    fn run<M: CausalLm>(self, model: M) {
        let ids: Vec<i64> = (0..2 * self.1 as i64).map(|i| (i * 5 + i * i / 3) % self.0).collect();
        let tokens = Tensor::<2, Int>::from_data(TensorData::new(ids, [2, self.1]), &Device::flex().autodiff()).into();
        let mut h = None;
        for unit in 0..model.units().len() {
            h = Some(model.forward_unit(unit, h, &tokens));
        }
        let _ = model.output_loss(h.expect("units"), &tokens).backward();
    }
}

/// The tensor group's traffic for one forward and backward of the loss is Megatron's: per
/// layer four all-reduces of the `[tokens, hidden]` activations in f32 (the attention's and
/// the MLP's outputs forward, the gradients of their inputs backward: q, k and v share one,
/// gate and up one), one each for the embedding's lookup and the head's input, and three
/// values per token for the loss; each all-reduce of `B` bytes counts `2 (N - 1) / N * B`
/// (the ring convention the backends count in).
#[test]
fn the_tensor_groups_traffic_is_megatrons() {
    let llama = json!({"model_type": "llama", "hidden_size": 16, "intermediate_size": 24, "num_hidden_layers": 3,
                       "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 10, "tie_word_embeddings": false});
    let gpt2 =
        json!({"model_type": "gpt2", "n_embd": 16, "n_layer": 2, "n_head": 4, "n_positions": 8, "vocab_size": 13});
    for (config, n) in [(llama, 2), (gpt2, 4)] {
        let parsed = HfConfig::from_json(config.clone()).unwrap();
        let (layers, vocab) = (parsed.num_layers(), parsed.vocab_size() as i64);
        let traffic = on_ranks(n, |group| {
            let model = fresh_split(&parsed, &Device::flex().autodiff(), &tensor(&group), 1).unwrap();
            let before = group.collective().stats();
            model.run(LossOnly(vocab, 7));
            group.collective().stats().since(&before).all_reduce
        });
        let (tokens, hidden) = (12u64, 16u64);
        let ring = |bytes: u64| 2 * (n as u64 - 1) * bytes / n as u64;
        let activations = (4 * layers as u64 + 2) * ring(tokens * hidden * 4);
        let want = (4 * layers as u64 + 2 + 3, activations + 3 * ring(tokens * 4));
        for (r, got) in traffic.iter().enumerate() {
            assert_eq!((got.calls, got.bytes), want, "{config} at tp {n}, rank {r}: (all-reduces, bytes)");
        }
    }
}

/// A GPT-2-small-shaped model (124.4M parameters) split over 4 tensor ranks: each rank's
/// part holds the count the plan gives (its quarter of every split parameter, every whole
/// one), below 0.3x of the whole model with the embedding; nothing is initialised to count.
#[test]
fn a_gpt2_small_shaped_part_at_tp_4_holds_a_quarter_of_the_splits_and_the_rest() {
    let config = json!({"model_type": "gpt2", "n_embd": 768, "n_layer": 12, "n_head": 12, "n_positions": 1024,
                        "vocab_size": 50257});
    let parsed = HfConfig::from_json(config).unwrap();
    let shapes = parameter_names(&parsed);
    let whole: u64 = shapes.iter().map(|(_, s)| s.iter().product::<usize>() as u64).sum();
    let counts = on_ranks(4, |group| {
        let model = fresh_split(&parsed, &Device::flex().autodiff(), &tensor(&group), 1).unwrap();
        let held = match &model {
            HfModel::Gpt2(m) => zerotrain::engine::ParamCount::trainable(m),
            HfModel::Llama(m) => zerotrain::engine::ParamCount::trainable(m),
        };
        let planned: u64 = shapes
            .iter()
            .map(|(name, shape)| {
                let all = shape.iter().product::<usize>() as u64;
                let Some(dim) = expected_split(name).dim() else { return all };
                let ranges = expected_split(name).ranges(shape[dim], group.rank(), 4, name).unwrap();
                all / shape[dim] as u64 * ranges.iter().map(|r| r.len() as u64).sum::<u64>()
            })
            .sum();
        (held, planned)
    });
    assert_eq!(whole, 124_439_808, "GPT-2 small's parameter count");
    for (r, (held, planned)) in counts.into_iter().enumerate() {
        assert_eq!(held, planned, "rank {r}");
        let share = held as f64 / whole as f64;
        assert!(share <= 0.3, "rank {r} holds {held} of {whole} parameters ({share:.3}x)");
    }
}

/// Ulysses' traffic for one forward and backward at sp 2 (LLaMA, 2 layers, 4 heads over 2
/// kv heads of width 4, 2 sequences of 8 positions): per layer four all-to-alls forward (q,
/// k, v and the output) and their four inverses backward, each rank sending the other half
/// of each f32 tensor: (q 512 + k 256 + v 256 + output 512 bytes) / 2 each way; nothing
/// else crosses the sequence group.
#[test]
fn the_sequence_groups_traffic_is_ulysses() {
    let config = json!({"model_type": "llama", "hidden_size": 16, "intermediate_size": 24, "num_hidden_layers": 2,
                        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 10});
    let parsed = HfConfig::from_json(config).unwrap();
    let traffic = on_ranks(2, |group| {
        let groups = ParallelGroups { tensor: ParallelGroup::alone(), sequence: group.clone() };
        let model = fresh_split(&parsed, &Device::flex().autodiff(), &groups, 1).unwrap();
        let before = group.collective().stats();
        model.run(LossOnly(10, 9));
        group.collective().stats().since(&before)
    });
    let per_layer = 2 * (512 + 256 + 256 + 512) / 2;
    for (r, got) in traffic.iter().enumerate() {
        assert_eq!((got.send.calls, got.send.bytes), (2 * 8, 2 * per_layer), "rank {r}: (sends, bytes)");
        assert_eq!((got.all_reduce.calls, got.all_gather.calls), (0, 0), "rank {r}");
    }
}
