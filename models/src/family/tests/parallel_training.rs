//! Training a family split over a tensor-parallel mesh through the engine (thread ranks)
//! against training it whole over the same data-parallel ranks: the same losses, gradient
//! norms (clipping on, so a norm that miscounted would move every parameter) and final
//! parameters (each tensor rank's gathered part against its slice of the whole).

use std::collections::BTreeMap;
use std::path::Path;

use burn::module::{ModuleVisitor, Param};
use burn::tensor::{Int, Tensor, TensorData};
use serde_json::json;
use zerotrain::nn::parallel::{ParallelGroups, Split};
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
/// first rank) its model's parameters after the last step, its trainable parameters, memory
/// and each step's traffic, and the validation loss of one batch after the last step.
struct Seen {
    steps: Vec<(f32, f32)>,
    model: Option<BTreeMap<String, Vec<f32>>>,
    memory: (u64, zerotrain::engine::MemoryReport, Vec<u64>),
    validation: f32,
}

/// A run: the mesh, the stage, the steps to take, and a checkpoint to start from and one
/// to save at the end.
#[derive(Clone, Copy)]
struct Run<'a> {
    /// Replica groups (`local_sgd`, a round every 2 steps), each `pp x tp x sp x dp` ranks.
    groups: usize,
    /// Pipeline stages (each a mesh of `tp x sp x dp` ranks).
    pp: usize,
    tp: usize,
    sp: usize,
    dp: usize,
    stage: u8,
    steps: u64,
    /// Train in bf16 (else fp32).
    bf16: bool,
    load: Option<&'a Path>,
    save: Option<&'a Path>,
}

/// One rank's training run of whichever family the model is.
struct Job<'a> {
    plan: &'a Plan,
    ctx: &'a RankContext,
    /// The rank's mesh, where it is on one (its trainer is the mesh's).
    mesh: Option<&'a zerotrain::mesh::MeshRank>,
    vocab: i64,
    run: Run<'a>,
}

impl WithModel for Job<'_> {
    type Output = zerotrain::Result<Seen>;

    fn run<M: CausalLm>(self, model: M) -> Self::Output {
        let local = zerotrain::engine::ParamCount::trainable(&model);
        let mut engine = match self.mesh {
            Some(mesh) => mesh.trainer(model)?,
            None => zerotrain::trainer(model, self.plan, self.ctx)?,
        };
        if let Some(dir) = self.run.load {
            engine.load_checkpoint(dir, None, zerotrain::LoadOptions::default())?;
        }
        let (d, device) = (engine.data_parallel_rank() as i64, self.ctx.device().clone());
        // Each step reads 8 sequences of 9 ids (8 inputs, divisible by every sp here);
        // data-parallel rank d (of every replica group's) its 8 / dp of them.
        let rows = 8 / engine.data_parallel_size() as i64;
        let (mut steps, mut comm) = (Vec::new(), Vec::new());
        for _ in 0..self.run.steps {
            let step = engine.counters().global_steps as i64;
            let mut batch = |_micro: usize| {
                let ids =
                    (0..9 * rows).map(|i| i + 9 * rows * d + 100 * step).map(|i| (i * 7 + i * i / 5) % self.vocab);
                Tensor::<2, Int>::from_data(TensorData::new::<i64, _>(ids.collect(), [rows as usize, 9]), &device)
                    .into()
            };
            let report = engine.train_batch(&mut batch)?;
            steps.push((report.loss, report.grad_norm));
            comm.push(report.comm_bytes);
        }
        if let Some(dir) = self.run.save {
            engine.save_checkpoint(dir, None, serde_json::Value::Null)?;
        }
        // Every rank evaluates the same 3 sequences (under sequence parallelism, each its
        // part of every one).
        let ids = (0..27).map(|i: i64| (i * 5 + 3) % self.vocab).collect();
        let validation =
            engine.evaluate(&Tensor::<2, Int>::from_data(TensorData::new::<i64, _>(ids, [3, 9]), &device).into())?;
        let memory = (local, engine.memory_report(), comm);
        Ok(Seen { steps, model: engine.gather_model(0)?.map(|m| values(&m)), memory, validation })
    }
}

/// `run`'s SGD steps on the model of `config` over thread ranks, each data-parallel place
/// reading its rows of one global batch of 8 sequences per step.
fn train(config: &serde_json::Value, run: Run<'_>) -> Vec<Seen> {
    let parsed = HfConfig::from_json(config.clone()).unwrap();
    let vocab = parsed.vocab_size() as i64;
    train_on(run, vocab, |job, groups| {
        fresh_split(&parsed, job.ctx.device(), groups, 5).map_err(zerotrain::Error::Model)?.run(job)
    })
}

/// `run` over thread ranks of a model of `vocab` ids that `rank` builds for its groups
/// and trains through the job it is given.
fn train_on(
    run: Run<'_>,
    vocab: i64,
    rank: impl Fn(Job<'_>, &ParallelGroups) -> zerotrain::Result<Seen> + Sync,
) -> Vec<Seen> {
    let (tp, sp, dp, pp) = (run.tp, run.sp, run.dp, run.pp);
    let mut plan_json = json!({
        "train_batch_size": 8, "gradient_clipping": 0.05,
        "optimizer": {"type": "SGD", "params": {"lr": 0.5, "momentum": 0.9}},
        "zero_optimization": {"stage": run.stage}, "tensor_parallel": {"autotp_size": tp},
        "zerotrain": {"backend": "threads", "comm_timeout_s": 20, "mesh": {"sp": sp}},
        "bf16": {"enabled": run.bf16}
    });
    if pp > 1 {
        plan_json["pipeline"] = json!({"stages": pp});
    }
    if run.groups > 1 {
        plan_json["local_sgd"] = json!({"groups": run.groups, "sync_every": 2});
    }
    let overrides = Overrides { world_size: Some(run.groups * pp * tp * sp * dp), ..Overrides::default() };
    let plan: Plan = Config::parse(&plan_json.to_string(), "t.json").unwrap().resolve(overrides).unwrap();
    let one = |ctx: RankContext| -> zerotrain::Result<Seen> {
        if plan.mesh.is_trivial() {
            return rank(Job { plan: &plan, ctx: &ctx, mesh: None, vocab, run }, &ParallelGroups::alone());
        }
        let m = zerotrain::mesh::split(&ctx, &plan)?;
        rank(Job { plan: &m.plan, ctx: &m.ctx, mesh: Some(&m), vocab, run }, &m.groups())
    };
    zerotrain::launch(&plan, one).unwrap()
}

fn shapes(config: &serde_json::Value) -> BTreeMap<String, Vec<usize>> {
    parameter_names(&HfConfig::from_json(config.clone()).unwrap()).into_iter().collect()
}

fn llama() -> serde_json::Value {
    json!({"model_type": "llama", "hidden_size": 16, "intermediate_size": 24, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 10, "tie_word_embeddings": false})
}

fn llama_mha() -> serde_json::Value {
    json!({"model_type": "llama", "hidden_size": 16, "intermediate_size": 24, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 10, "tie_word_embeddings": true})
}

fn gpt2() -> serde_json::Value {
    json!({"model_type": "gpt2", "n_embd": 16, "n_layer": 1, "n_head": 4, "n_positions": 8, "vocab_size": 13})
}

/// Tensor parallelism ((tp 2, dp 1), (tp 2, dp 2) at stages 0 to 3, tp 4 for GPT-2),
/// sequence parallelism ((sp 2, dp 1) and (sp 2, dp 2) for LLaMA with grouped kv heads, sp
/// 4 for GPT-2 at stage 3) and both ((tp 2, sp 2) for LLaMA with a kv head per query head),
/// each against the whole model at the same dp: losses and norms within 1e-5 relative,
/// parameters within 1e-5 of each tensor's largest value (three steps of SGD with momentum
/// at lr 0.5 on gradients that agree to 1e-6 relative; clipping to 0.05 is active, so a
/// norm that counted a whole parameter twice or missed a rank's slice would scale every
/// update).
#[test]
fn a_split_model_trains_as_the_whole_model_does() {
    let (llama, gpt2, mha) = (llama(), gpt2(), llama_mha());
    let cases = [
        (&llama, 2, 1, 1, 0),
        (&llama, 2, 1, 2, 1),
        (&llama, 2, 1, 2, 3),
        (&gpt2, 2, 1, 2, 2),
        (&gpt2, 4, 1, 1, 0),
        (&llama, 1, 2, 1, 0),
        (&llama, 1, 2, 2, 2),
        (&gpt2, 1, 4, 1, 3),
        (&mha, 2, 2, 1, 1),
    ];
    for (config, tp, sp, dp, stage) in cases {
        let run = |tp, sp| Run { groups: 1, pp: 1, tp, sp, dp, stage, steps: 3, bf16: false, load: None, save: None };
        let whole = train(config, run(1, 1));
        let split = train(config, run(tp, sp));
        let at = format!("{} tp {tp} sp {sp} dp {dp} stage {stage}", config["model_type"]);
        let shape = |name: &str| shapes(config)[name].clone();
        check_against_whole(&at, (&whole, &split), (tp, &|_| 0), &shape, &expected_split);
    }
}

/// `split`'s runs against `whole`'s: every rank's losses, norms and validation loss within
/// 1e-5 relative of its group's (`whole`'s rank 0, or `whole_rank(r)`'s with replica
/// groups), and each
/// gathered model's parameters (`shape` and `cut` say each one's whole shape and split)
/// their tensor rank's slices of the whole model's within 1e-5 of each tensor's largest
/// value. Returns how many ranks gathered a model.
fn check_against_whole(
    at: &str,
    (whole, split): (&[Seen], &[Seen]),
    (tp, whole_rank): (usize, &dyn Fn(usize) -> usize),
    shape: &dyn Fn(&str) -> Vec<usize>,
    cut: &dyn Fn(&str) -> Split,
) -> usize {
    let want_model = whole[0].model.as_ref().unwrap();
    let mut gathered = 0;
    for (r, Seen { steps, model, validation, .. }) in split.iter().enumerate() {
        let want = &whole[whole_rank(r)];
        let want_validation = want.validation;
        assert!(
            (validation - want_validation).abs() <= 1e-5 * want_validation,
            "{at}, rank {r}: validation loss {validation} vs {want_validation}"
        );
        let want_steps = &want.steps;
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
        gathered += 1;
        assert_eq!(model.len(), want_model.len(), "{at}: rank {r} gathered every parameter");
        let t = r % tp;
        for (name, got) in model {
            let want = slice_of(&want_model[name], &shape(name), cut(name), t, tp);
            let error = largest_error(got, &want);
            assert!(error <= 1e-5, "{at}, tensor rank {t}: `{name}` is off by {error:e}");
        }
    }
    gathered
}

/// A checkpoint saved by a tensor-parallel run is the whole model's: GPT-2 saved at (tp 2,
/// dp 2) resumes at (tp 1, dp 4) and (tp 4, dp 1), and one saved at (tp 1, dp 4) resumes
/// at (tp 2, dp 2), each with the next two losses of the uninterrupted (tp 2, dp 2) run
/// within 1e-5 relative (the same global batch; only the sums' grouping differs); the
/// masters saved at tp 2 equal those saved at tp 1 after the same steps within 1e-5 of
/// each tensor's largest value, and both checkpoints list the whole model's shapes.
#[test]
fn a_tensor_parallel_checkpoint_resumes_at_any_mesh() {
    let config = gpt2();
    let dir = super::folder("parallel-checkpoints");
    let (at_tp2, at_tp1) = (dir.join("tp2"), dir.join("tp1"));
    let run = |tp, dp| Run { groups: 1, pp: 1, tp, sp: 1, dp, stage: 1, steps: 2, bf16: false, load: None, save: None };
    let uninterrupted = train(&config, Run { steps: 4, ..run(2, 2) });
    let want: Vec<f32> = uninterrupted[0].steps[2..].iter().map(|s| s.0).collect();
    train(&config, Run { save: Some(&at_tp2), ..run(2, 2) });
    train(&config, Run { save: Some(&at_tp1), ..run(1, 4) });
    for (from, tp, dp) in [(&at_tp2, 1, 4), (&at_tp2, 4, 1), (&at_tp1, 2, 2)] {
        let resumed = train(&config, Run { load: Some(from), ..run(tp, dp) });
        for (r, Seen { steps, .. }) in resumed.iter().enumerate() {
            for (s, ((loss, _), want)) in steps.iter().zip(&want).enumerate() {
                let at = format!("{} at tp {tp} dp {dp}, rank {r}, step {}", from.display(), s + 2);
                assert!((loss - want).abs() <= 1e-5 * want, "{at}: loss {loss}, uninterrupted {want}");
            }
        }
    }
    let open = |dir: &Path| zerotrain_checkpoint::Checkpoint::open(dir, None).unwrap();
    let (split, whole) = (open(&at_tp2), open(&at_tp1));
    let layout = |c: &zerotrain_checkpoint::Checkpoint| -> Vec<(String, Vec<u64>)> {
        c.manifest().layout.iter().map(|e| (e.path.clone(), e.shape.clone())).collect()
    };
    assert_eq!(layout(&split), layout(&whole), "the tp 2 checkpoint lists the whole model");
    assert_eq!(split.manifest().world_size, 4);
    for entry in &whole.manifest().layout {
        let n = entry.shape.iter().product::<u64>();
        let read = |c: &zerotrain_checkpoint::Checkpoint| {
            let mut out = vec![0f32; n as usize];
            c.read_range("master", entry.offset..entry.offset + n, &mut out).unwrap();
            out
        };
        let error = largest_error(&read(&split), &read(&whole));
        assert!(error <= 1e-5, "`{}`'s master saved at tp 2 is off by {error:e}", entry.path);
    }
}

/// bf16 meshes, (tp 2) and (sp 2) for LLaMA and (tp 2) for GPT-2 at stage 2, against the
/// whole model in bf16 over three steps. Bound: a regrouped sum rounds to bf16 at one more
/// place (each rank's part of a row-parallel product, or an attention output exchanged in
/// bf16), so a value may move by one bf16 rounding, 2^-8 relative: the losses (computed in
/// f32 from those activations, averaged) within 2^-8 relative, the gradient norms (every
/// element possibly a rounding off, in the same direction at worst) within 2 x 2^-8.
/// Measured when written: losses within 1e-5, norms within 1e-3.
#[test]
fn bf16_meshes_train_as_the_whole_model_does_within_a_rounding() {
    for (config, tp, sp) in [(llama(), 2, 1), (llama(), 1, 2), (gpt2(), 2, 1)] {
        let run =
            |tp, sp| Run { groups: 1, pp: 1, tp, sp, dp: 1, stage: 2, steps: 3, bf16: true, load: None, save: None };
        let (whole, split) = (train(&config, run(1, 1)), train(&config, run(tp, sp)));
        let ulp = 2f32.powi(-8);
        for (r, Seen { steps, .. }) in split.iter().enumerate() {
            for (s, ((loss, norm), (want_loss, want_norm))) in steps.iter().zip(&whole[0].steps).enumerate() {
                let at = format!("{} tp {tp} sp {sp}, rank {r}, step {s}", config["model_type"]);
                assert!((loss - want_loss).abs() <= ulp * want_loss, "{at}: loss {loss} vs {want_loss}");
                assert!((norm - want_norm).abs() <= 2.0 * ulp * want_norm, "{at}: norm {norm} vs {want_norm}");
            }
        }
    }
}

/// Each rank of (tp 2, dp 2) at stage 2 (fp32, SGD with momentum) holds its part of the
/// model (the count the plan gives: its half of every split parameter, every whole one)
/// as parameters, and a data-parallel shard of that part as gradients and momentum: 4 bytes
/// per element, the shards of the two data-parallel ranks together the part, padded to the
/// 16-element alignment of each unit's shards at most.
#[test]
fn a_rank_holds_its_part_of_every_state() {
    let config = llama();
    let shapes = parameter_names(&HfConfig::from_json(config.clone()).unwrap());
    let units = 2 + 2; // the embedding, two layers, the head
    let run = Run { groups: 1, pp: 1, tp: 2, sp: 1, dp: 2, stage: 2, steps: 1, bf16: false, load: None, save: None };
    for (r, Seen { memory: (local, memory, _), .. }) in train(&config, run).iter().enumerate() {
        let t = r % 2;
        let planned: u64 = shapes
            .iter()
            .map(|(name, shape)| {
                let all = shape.iter().product::<usize>() as u64;
                let Some(dim) = expected_split(name).dim() else { return all };
                let ranges = expected_split(name).ranges(shape[dim], t, 2, name).unwrap();
                all / shape[dim] as u64 * ranges.iter().map(|r| r.len() as u64).sum::<u64>()
            })
            .sum();
        assert_eq!(*local, planned, "rank {r}: the part the plan gives");
        assert_eq!(memory.params, 4 * planned, "rank {r}: parameters");
        for (what, bytes) in [("gradients", memory.grads), ("momentum", memory.optimizer)] {
            let (least, most) = (4 * planned, 4 * (planned + 16 * 2 * units));
            assert!(
                (least..=most).contains(&(2 * bytes)),
                "rank {r}: {what} {bytes} B, two shards not in {least}..={most}"
            );
        }
    }
}

/// The built-in GPT's cuts, written out: q, k, v and the MLP's up projection by output
/// features (Burn's `Linear` stores `[d_in, d_out]`: dimension 1; their biases with them),
/// attention's output and the MLP's down projection by input features (dimension 0), the
/// token table and an untied head by vocabulary; everything else whole.
fn gpt_split(name: &str) -> Split {
    let column = ["attn.query.weight", "attn.key.weight", "attn.value.weight", "mlp_up.weight"];
    let column_bias = ["attn.query.bias", "attn.value.bias", "mlp_up.bias"];
    let row = ["attn.output.weight", "mlp_down.weight"];
    match name {
        "token.weight" | "head.bias" => Split::Uneven { dim: 0 },
        "head.weight" => Split::Uneven { dim: 1 },
        _ if column.iter().any(|p| name.ends_with(p)) => Split::Even { dim: 1, blocks: 1 },
        _ if column_bias.iter().chain(&row).any(|p| name.ends_with(p)) => Split::Even { dim: 0, blocks: 1 },
        _ => Split::Whole,
    }
}

/// The whole shape of the built-in GPT's parameter `name` at width `d`, vocabulary `v`,
/// context `t`.
fn gpt_shape(name: &str, (d, v, t): (usize, usize, usize)) -> Vec<usize> {
    match name.rsplit('.').nth(1).unwrap_or(name) {
        "token" => vec![v, d],
        "position" => vec![t, d],
        "head" if name.ends_with("weight") => vec![d, v],
        "head" => vec![v],
        "mlp_up" if name.ends_with("weight") => vec![d, 4 * d],
        "mlp_up" => vec![4 * d],
        "mlp_down" if name.ends_with("weight") => vec![4 * d, d],
        "query" | "key" | "value" | "output" if name.ends_with("weight") => vec![d, d],
        _ => vec![d],
    }
}

/// The built-in GPT (burn-nn's layers) split over a mesh ((tp 2, dp 2) at stage 3 tied,
/// tp 4 untied over 11 ids (parts of 2 and 3), (sp 2, dp 2) at stage 2, (tp 2, sp 2)
/// untied), each against the whole GPT at the same dp: it starts from the same values (the
/// parts are cut from what the engine draws for the whole model), so the losses and norms
/// agree within 1e-5 relative and every gathered parameter is its slice of the whole
/// model's within 1e-5 of its largest value (the bound of the family test above).
#[test]
fn the_built_in_gpt_split_over_a_mesh_trains_as_the_whole_gpt_does() {
    let config =
        |tied_head| crate::GptConfig { n_layer: 2, n_head: 4, n_embd: 16, block_size: 8, vocab_size: 11, tied_head };
    let gpt = |config: crate::GptConfig, run: Run<'_>| {
        train_on(run, 11, |job, groups| {
            let (device, seed) = (job.ctx.device(), job.plan.runtime.seed);
            match run.tp * run.sp {
                1 => job.run(crate::Gpt::new(&config, device)),
                _ => job.run(crate::Gpt::new_split(&config, device, groups, seed).map_err(zerotrain::Error::Model)?),
            }
        })
    };
    for (tied, tp, sp, dp, stage) in [(true, 2, 1, 2, 3), (false, 4, 1, 1, 1), (true, 1, 2, 2, 2), (false, 2, 2, 1, 0)]
    {
        let run = |tp, sp| Run { groups: 1, pp: 1, tp, sp, dp, stage, steps: 3, bf16: false, load: None, save: None };
        let (whole, split) = (gpt(config(tied), run(1, 1)), gpt(config(tied), run(tp, sp)));
        let at = format!("gpt tied {tied} tp {tp} sp {sp} dp {dp} stage {stage}");
        let shape = |name: &str| gpt_shape(name, (16, 11, 8));
        check_against_whole(&at, (&whole, &split), (tp, &|_| 0), &shape, &gpt_split);
    }
}

/// Meshes inside pipeline stages: 2 stages of (tp 2) for LLaMA with grouped kv heads at
/// ZeRO stage 1, of (sp 2) at stage 0, of (tp 2, dp 2) for GPT-2 at stage 2, each against
/// the whole model unpipelined at the same dp: losses and norms within 1e-5 relative,
/// every gathered parameter its slice of the whole model's within 1e-5 of its largest
/// value (the bounds of the unpipelined meshes above: a pipeline moves activations between
/// stages unchanged). A checkpoint saved after two steps of the (tp 2) pipeline resumes
/// unpipelined at tp 1 with the next two losses of the pipeline that never stopped.
#[test]
fn a_mesh_in_each_pipeline_stage_trains_as_the_whole_model_does() {
    let (llama, gpt2) = (llama(), gpt2());
    for (config, pp, tp, sp, dp, stage) in [(&llama, 2, 2, 1, 1, 1), (&llama, 2, 1, 2, 1, 0), (&gpt2, 2, 2, 1, 2, 2)] {
        let run = |pp, tp, sp| Run { groups: 1, pp, tp, sp, dp, stage, steps: 3, bf16: false, load: None, save: None };
        let (whole, split) = (train(config, run(1, 1, 1)), train(config, run(pp, tp, sp)));
        let at = format!("{} pp {pp} tp {tp} sp {sp} dp {dp} stage {stage}", config["model_type"]);
        let shape = |name: &str| shapes(config)[name].clone();
        let gathered = check_against_whole(&at, (&whole, &split), (tp, &|_| 0), &shape, &expected_split);
        assert_eq!(gathered, tp, "{at}: one whole model per tensor rank");
    }
    let dir = super::folder("pipelined-mesh");
    let run = |pp, tp| Run { groups: 1, pp, tp, sp: 1, dp: 1, stage: 1, steps: 2, bf16: false, load: None, save: None };
    let uninterrupted = train(&llama, Run { steps: 4, ..run(2, 2) });
    train(&llama, Run { save: Some(&dir), ..run(2, 2) });
    let resumed = train(&llama, Run { load: Some(&dir), ..run(1, 1) });
    for (s, ((loss, _), (want, _))) in resumed[0].steps.iter().zip(&uninterrupted[0].steps[2..]).enumerate() {
        assert!((loss - want).abs() <= 1e-5 * want, "step {}: resumed at tp 1 {loss}, uninterrupted {want}", s + 2);
    }
}

/// Replica groups (`local_sgd`, 2 groups meeting every 2 steps), each a mesh of its own:
/// LLaMA at (tp 2) in each group at stage 1, GPT-2 at (sp 2, dp 2) at stage 2, against
/// the same groups of whole models over 4 steps (two rounds): each group's losses and
/// norms within 1e-5 relative of the whole groups' (a round averages each tensor part's
/// shard between the ranks holding it in the two groups, as it averages whole shards), and
/// group 0's gathered parts the slices of its whole model after the last round.
#[test]
fn replica_groups_of_meshes_train_as_groups_of_whole_models_do() {
    let (llama, gpt2) = (llama(), gpt2());
    for (config, tp, sp, dp, stage) in [(&llama, 2, 1, 1, 1), (&gpt2, 1, 2, 2, 2)] {
        let run = |tp, sp| Run { groups: 2, pp: 1, tp, sp, dp, stage, steps: 4, bf16: false, load: None, save: None };
        let (whole, split) = (train(config, run(1, 1)), train(config, run(tp, sp)));
        let at = format!("{} in 2 groups of tp {tp} sp {sp} dp {dp} at stage {stage}", config["model_type"]);
        let shape = |name: &str| shapes(config)[name].clone();
        // Split rank r is in group r / (tp sp dp); the whole run's group g starts at rank g dp.
        let group_of = |r: usize| r / (tp * sp * dp) * dp;
        let gathered = check_against_whole(&at, (&whole, &split), (tp, &group_of), &shape, &expected_split);
        assert_eq!(gathered, tp, "{at}: group 0's tensor ranks each gathered their part");
        let (first, second) = (&whole[0].steps, &whole[dp].steps);
        assert_ne!(first[0], second[0], "{at}: the groups read different samples");
    }
}

/// A step's reported traffic counts the tensor group's (the model's own collectives): at
/// (tp 2, dp 1) every step of LLaMA (2 layers, hidden 16, 8 sequences of 8 tokens) moves
/// at least Megatron's bytes (four all-reduces of the f32 activations per layer, one each
/// for the embedding's lookup and the head's input, three values per token for the loss,
/// each all-reduce of `B` bytes counted `2 (N - 1) / N B` = `B` at N = 2), and at most
/// 1 KiB more (the engine's own agreement on the loss and norm).
#[test]
fn a_steps_traffic_counts_the_tensor_groups() {
    let run = Run { groups: 1, pp: 1, tp: 2, sp: 1, dp: 1, stage: 0, steps: 2, bf16: false, load: None, save: None };
    let (tokens, hidden, layers) = (64u64, 16u64, 2u64);
    let megatron = (4 * layers + 2) * tokens * hidden * 4 + 3 * tokens * 4;
    for (r, Seen { memory: (_, _, comm), .. }) in train(&llama(), run).iter().enumerate() {
        for (s, &bytes) in comm.iter().enumerate() {
            assert!(
                (megatron..=megatron + 1024).contains(&bytes),
                "rank {r}, step {s}: {bytes} B, Megatron's {megatron}"
            );
        }
    }
}

/// `module` with its float parameter at `path` scaled by `factor` (its value read now).
fn scaled<M: burn::module::Module>(module: M, path: &str, factor: f32) -> M {
    struct Scale<'a> {
        at: Vec<String>,
        path: &'a str,
        factor: f32,
    }
    impl burn::module::ModuleMapper for Scale<'_> {
        fn enter_module(&mut self, name: &str, _: &str) {
            self.at.push(name.to_string());
        }
        fn exit_module(&mut self, _: &str, _: &str) {
            self.at.pop();
        }
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
            if self.at.join(".") != self.path {
                return param;
            }
            let factor = self.factor;
            param.map(|t| t.mul_scalar(factor))
        }
    }
    module.map(&mut Scale { at: Vec::new(), path, factor })
}

/// The parameters every tensor rank holds whole start as tensor rank 0's on all of them: a
/// built-in GPT at tp 2 whose tensor rank 1 built its part with another position table and
/// final norm (scaled by 1.5) trains as the whole GPT does, within the bound of the test
/// above, and every rank's gathered copy of them is the whole model's.
#[test]
fn whole_parameters_start_as_tensor_rank_0_s_on_every_rank() {
    let config = crate::GptConfig { n_layer: 1, n_head: 4, n_embd: 16, block_size: 8, vocab_size: 11, tied_head: true };
    let gpt = |run: Run<'_>| {
        train_on(run, 11, |job, groups| {
            let (device, seed) = (job.ctx.device(), job.plan.runtime.seed);
            match run.tp {
                1 => job.run(crate::Gpt::new(&config, device)),
                _ => {
                    let part = crate::Gpt::new_split(&config, device, groups, seed).map_err(zerotrain::Error::Model)?;
                    // Scaling reads (so draws) the lazy parameters: under the generator's
                    // lock, as a caller's draws beside training ranks must be, or the draw
                    // could land inside tensor rank 0's seeded draws and change its model.
                    let part = match groups.tensor.rank() {
                        0 => part,
                        _ => {
                            let _held = zerotrain::random::lock();
                            scaled(scaled(part, "position.weight", 1.5), "norm.gamma", 1.5)
                        }
                    };
                    job.run(part)
                }
            }
        })
    };
    let run = |tp| Run { groups: 1, pp: 1, tp, sp: 1, dp: 1, stage: 1, steps: 2, bf16: false, load: None, save: None };
    let (whole, split) = (gpt(run(1)), gpt(run(2)));
    let shape = |name: &str| gpt_shape(name, (16, 11, 8));
    let gathered = check_against_whole(
        "gpt tp 2, rank 1's whole parameters drawn otherwise",
        (&whole, &split),
        (2, &|_| 0),
        &shape,
        &gpt_split,
    );
    assert_eq!(gathered, 2);
}
