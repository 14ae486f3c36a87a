//! Training a family split over a tensor-parallel mesh through the engine (thread ranks)
//! against training it whole over the same data-parallel ranks: the same losses, gradient
//! norms (clipping on, so a norm that miscounted would move every parameter) and final
//! parameters (each tensor rank's gathered part against its slice of the whole).

use std::collections::BTreeMap;

use burn::module::{ModuleVisitor, Param};
use burn::tensor::{Int, Tensor, TensorData};
use serde_json::json;
use zerotrain::nn::parallel::ParallelGroup;
use zerotrain::{Config, Overrides, Plan, RankContext};

use super::super::*;
use super::parallel::{expected_split, largest_error, slice_of};

/// The values of every float parameter of `model`, by module path.
fn values<M: burn::module::Module>(model: &M) -> BTreeMap<String, Vec<f32>> {
    struct Walk(Vec<String>, BTreeMap<String, Vec<f32>>);
    impl ModuleVisitor for Walk {
        fn enter_module(&mut self, name: &str, _: &str) {
            self.0.push(name.to_string());
        }
        fn exit_module(&mut self, _: &str, _: &str) {
            self.0.pop();
        }
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            let values = param.val().into_data().convert::<f32>().try_to_vec::<f32>().unwrap();
            self.1.insert(self.0.join("."), values);
        }
    }
    let mut walk = Walk(Vec::new(), BTreeMap::new());
    model.visit(&mut walk);
    walk.1
}

/// What a rank saw: each step's loss and gradient norm, and (on a data-parallel group's
/// first rank) its model's parameters after the last step.
type Seen = (Vec<(f32, f32)>, Option<BTreeMap<String, Vec<f32>>>);

/// One rank's training run of whichever family the model is.
struct Job<'a> {
    plan: &'a Plan,
    ctx: &'a RankContext,
    vocab: i64,
}

impl WithModel for Job<'_> {
    type Output = zerotrain::Result<Seen>;

    fn run<M: CausalLm>(self, model: M) -> Self::Output {
        let mut engine = zerotrain::trainer(model, self.plan, self.ctx)?;
        let (d, device) = (engine.data_parallel_rank() as i64, self.ctx.device().clone());
        let mut steps = Vec::new();
        for step in 0..3i64 {
            let mut batch = |_micro: usize| {
                let ids = (0..12).map(|i| i + 12 * d + 100 * step).map(|i| (i * 7 + i * i / 5) % self.vocab).collect();
                Tensor::<2, Int>::from_data(TensorData::new::<i64, _>(ids, [2, 6]), &device)
            };
            let report = engine.train_batch(&mut batch)?;
            steps.push((report.loss, report.grad_norm));
        }
        Ok((steps, engine.gather_model(0)?.map(|m| values(&m))))
    }
}

/// Three SGD steps of the model of `config` at (`tp`, `dp`) and ZeRO `stage` over thread
/// ranks, each data-parallel place reading its rows of one global batch per step.
fn train(config: &serde_json::Value, tp: usize, dp: usize, stage: u8) -> Vec<Seen> {
    let plan_json = json!({
        "train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.05,
        "optimizer": {"type": "SGD", "params": {"lr": 0.5}},
        "zero_optimization": {"stage": stage}, "tensor_parallel": {"autotp_size": tp},
        "zerotrain": {"backend": "threads", "comm_timeout_s": 20}
    });
    let overrides = Overrides { world_size: Some(tp * dp), ..Overrides::default() };
    let plan: Plan = Config::parse(&plan_json.to_string(), "t.json").unwrap().resolve(overrides).unwrap();
    let parsed = HfConfig::from_json(config.clone()).unwrap();
    let vocab = parsed.vocab_size() as i64;
    let rank = |ctx: RankContext| -> zerotrain::Result<Seen> {
        let (ctx, plan, group) = match tp {
            1 => (ctx, plan.clone(), ParallelGroup::alone()),
            _ => {
                let m = zerotrain::mesh::split(&ctx, &plan)?;
                (m.ctx, m.plan, m.tensor)
            }
        };
        let model = fresh_split(&parsed, ctx.device(), &group, 5).map_err(zerotrain::Error::Model)?;
        model.run(Job { plan: &plan, ctx: &ctx, vocab })
    };
    zerotrain::launch(&plan, rank).unwrap()
}

/// (tp 2, dp 1), (tp 2, dp 2) at stages 0 to 3, and tp 4 for GPT-2, each against the whole
/// model at the same dp: losses and norms within 1e-5 relative, parameters within 1e-5 of
/// each tensor's largest value (three steps of SGD at lr 0.5 on gradients that agree to
/// 1e-6 relative; clipping to 0.05 is active, so a norm that counted a whole parameter
/// twice or missed a rank's slice would scale every update).
#[test]
fn a_split_model_trains_as_the_whole_model_does() {
    let llama = json!({"model_type": "llama", "hidden_size": 16, "intermediate_size": 24, "num_hidden_layers": 2,
                       "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 10, "tie_word_embeddings": false});
    let gpt2 =
        json!({"model_type": "gpt2", "n_embd": 16, "n_layer": 1, "n_head": 4, "n_positions": 8, "vocab_size": 13});
    let shapes = |config: &serde_json::Value| -> BTreeMap<String, Vec<usize>> {
        parameter_names(&HfConfig::from_json(config.clone()).unwrap()).into_iter().collect()
    };
    let cases = [(&llama, 2, 1, 0), (&llama, 2, 2, 1), (&llama, 2, 2, 3), (&gpt2, 2, 2, 2), (&gpt2, 4, 1, 0)];
    for (config, tp, dp, stage) in cases {
        let whole = train(config, 1, dp, stage);
        let split = train(config, tp, dp, stage);
        let at = format!("{} tp {tp} dp {dp} stage {stage}", config["model_type"]);
        let (want_steps, want_model) = (&whole[0].0, whole[0].1.as_ref().unwrap());
        for (r, (steps, model)) in split.iter().enumerate() {
            for (s, ((loss, norm), (want_loss, want_norm))) in steps.iter().zip(want_steps).enumerate() {
                assert!(
                    (loss - want_loss).abs() <= 1e-5 * want_loss,
                    "{at}, rank {r}, step {s}: loss {loss} vs {want_loss}"
                );
                assert!(
                    (norm - want_norm).abs() <= 1e-5 * want_norm,
                    "{at}, rank {r}, step {s}: norm {norm} vs {want_norm}"
                );
            }
            let Some(model) = model else { continue };
            let t = r % tp;
            for (name, got) in model {
                let want = slice_of(&want_model[name], &shapes(config)[name], expected_split(name), t, tp);
                let error = largest_error(got, &want);
                assert!(error <= 1e-5, "{at}, tensor rank {t}: `{name}` is off by {error:e}");
            }
        }
    }
}
