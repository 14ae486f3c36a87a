//! What real models reach for (issue 22's API list), each checked against a reference
//! written here: parameter groups, a program's own optimizer, the gradients before the
//! step, accumulation boundaries set by hand, the lr set by hand, several tensors between
//! units, a unit's own loss term, evaluation kept out of the step's report, and a
//! checkpoint directory checked before training.

use burn::module::{Module, ModuleVisitor, Param};
use burn::nn::{Linear, LinearConfig};
use burn::optim::{AdamWConfig, GradientsParams, ModuleOptimizer, SgdConfig};
use burn::tensor::{Device, Tensor};
use zerotrain::engine::optimizer::{ExportedState, ShardGroup, ShardOptimizer};
use zerotrain::engine::{UnitModel, UnitSpec};
use zerotrain::{Engine, Error, LoadOptions, Plan, launch};
use zerotrain_models::{Batch, Mlp};

use crate::common::*;

const LR: f64 = 0.01;

/// Constant-lr AdamW (lr 0.01, wd 0.1), `micro` samples per rank, `extra` keys, and extra
/// `zerotrain` keys.
fn constant(stage: u8, micro: u64, world: usize, extra: &str, zerotrain: &str) -> Plan {
    plan(
        &format!(
            r#"{{ {extra} "train_micro_batch_size_per_gpu": {micro},
                "optimizer": {{"type": "AdamW", "params": {{"lr": {LR}, "betas": [0.9, 0.99], "eps": 1e-8, "weight_decay": 0.1}}}},
                "zero_optimization": {{"stage": {stage}, "stage3_param_persistence_threshold": 0}},
                "zerotrain": {{"comm_timeout_s": 60 {zerotrain}}}}}"#
        ),
        world,
    )
}

fn seeded_mlp(seed: u64) -> Mlp {
    seeded(seed, |d| Mlp::new(&[6, 16, 16, 6], d))
}

/// The global batch of step `step` for `plan`.
fn global(plan: &Plan, step: u64, device: &Device) -> Batch {
    let n = plan.batch.train_batch_size;
    TASK.batch(step * n..(step + 1) * n, device)
}

/// Trains `steps` of `plan` with `Engine::with_units` and returns rank 0's parameters.
fn engine_params(init: &Mlp, plan: &Plan, steps: u64) -> Vec<(String, Vec<f32>)> {
    launch(plan, |ctx| {
        let mut engine = Engine::with_units(init.clone(), plan, &ctx)?;
        for step in 0..steps {
            engine.forward_backward(&TASK.batch(rank_indices(plan, step, 0, ctx.rank()), ctx.device()))?;
            engine.step()?;
        }
        Ok::<_, Error>(params_by_path(&engine.full_model()?))
    })
    .unwrap()
    .swap_remove(0)
}

/// The gradients of `grads` for the parameters whose path `keep` accepts.
fn only(model: &Mlp, grads: &GradientsParams, keep: impl Fn(&str) -> bool) -> GradientsParams {
    struct Pick<'a, F>(Vec<String>, &'a GradientsParams, GradientsParams, F);
    impl<F: Fn(&str) -> bool> ModuleVisitor for Pick<'_, F> {
        fn enter_module(&mut self, name: &str, _: &str) {
            self.0.push(name.into());
        }
        fn exit_module(&mut self, _: &str, _: &str) {
            self.0.pop();
        }
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            if (self.3)(&self.0.join("."))
                && let Some(g) = self.1.get::<D>(param.id)
            {
                self.2.register(param.id, g);
            }
        }
    }
    let mut pick = Pick(Vec::new(), grads, GradientsParams::new(), keep);
    model.visit(&mut pick);
    pick.2
}

/// Parameter groups (biases without decay, layer 0 at a tenth of the lr) equal plain Burn
/// stepping each group with its own optimizer and settings.
#[test]
fn parameter_groups_step_each_group_with_its_lr_and_weight_decay() {
    let init = seeded_mlp(41);
    let groups =
        r#", "param_groups": [{"params": ["*.bias"], "weight_decay": 0}, {"params": ["layers.0.*"], "lr": 0.001}]"#;
    let device = Device::flex().autodiff();
    let base = constant(0, 2, 2, "", groups);
    let mut model = init.clone().fork(&device);
    let adamw = |wd: f32| -> ModuleOptimizer {
        AdamWConfig::new().with_beta_1(0.9).with_beta_2(0.99).with_epsilon(1e-8).with_weight_decay(wd).init()
    };
    let (mut bias, mut first, mut rest) = (adamw(0.0), adamw(0.1), adamw(0.1));
    for step in 0..4 {
        let loss = model.loss(&global(&base, step, &device));
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        let is_bias = |p: &str| p.ends_with(".bias");
        let g = only(&model, &grads, is_bias);
        model = bias.step(LR, model, g);
        let g = only(&model, &grads, |p| !is_bias(p) && p.starts_with("layers.0."));
        model = first.step(LR * 0.1, model, g);
        let g = only(&model, &grads, |p| !is_bias(p) && !p.starts_with("layers.0."));
        model = rest.step(LR, model, g);
    }
    let reference = params_by_path(&model);
    let ungrouped = engine_params(&init, &constant(0, 2, 2, "", ""), 4);
    assert!(max_abs_diff(&ungrouped, &reference).0 > 1e-4, "the groups must matter for this test to mean anything");
    for stage in 0..=3 {
        let got = engine_params(&init, &constant(stage, 2, 2, "", groups), 4);
        let (diff, path) = max_abs_diff(&got, &reference);
        assert!(diff <= 2e-6, "stage {stage}: `{path}` differs from plain Burn's grouped step by {diff}");
    }
}

/// Sign descent, a program's own optimizer: `p -= lr * sign(g)`.
struct SignSgd;

impl ShardOptimizer for SignSgd {
    fn step(&mut self, lr: f64, params: Tensor<1>, grads: Tensor<1>) -> zerotrain::Result<Tensor<1>> {
        Ok(params - grads.sign().mul_scalar(lr))
    }
    fn state_bytes(&self) -> u64 {
        0
    }
    fn export(&self) -> ExportedState {
        (Vec::new(), Vec::new())
    }
    fn import(&mut self, _: ExportedState, _: &Device) -> zerotrain::Result<()> {
        Ok(())
    }
}

/// A program's optimizer steps every shard; at one rank it equals sign descent done by
/// hand bit for bit, and the segments it is given cover every parameter exactly once.
#[test]
fn a_programs_own_optimizer_steps_every_shard() {
    let init = seeded_mlp(42);
    let device = Device::flex().autodiff();
    let one = constant(0, 4, 1, "", "");
    let mut model = init.clone().fork(&device);
    for step in 0..3 {
        let loss = model.loss(&global(&one, step, &device));
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        model = model.map(&mut SignStep(grads));
    }
    let reference = params_by_path(&model);
    for (world, stage) in [(1, 0), (1, 3), (2, 2)] {
        let plan = constant(stage, 4 / world as u64, world, "", "");
        let seen = std::sync::Mutex::new(Vec::new());
        let out = launch(&plan, |ctx| {
            let mut engine = Engine::builder(init.clone(), &plan, &ctx)
                .optimizer(|group: &ShardGroup<'_>| -> Box<dyn ShardOptimizer> {
                    assert_eq!(group.optimizer.kind(), "AdamW", "the config's optimizer is passed along");
                    Box::new(SignSgd)
                })
                .build_units()?;
            let segments: usize =
                (0..engine.sharding().units().len()).map(|u| engine.sharding().units()[u].layout.entries().len()).sum();
            seen.lock().unwrap().push(segments);
            for step in 0..3 {
                engine.forward_backward(&TASK.batch(rank_indices(&plan, step, 0, ctx.rank()), ctx.device()))?;
                engine.step()?;
            }
            Ok::<_, Error>(params_by_path(&engine.full_model()?))
        })
        .unwrap();
        let (diff, path) = max_abs_diff(&out[0], &reference);
        if world == 1 {
            assert_eq!(diff, 0.0, "stage {stage}: `{path}` differs from sign descent by hand");
        } else {
            // Summed in another order, a gradient within rounding of zero may change sign
            // (2 lr apart per step): rare, not never.
            let pairs = out[0].iter().zip(&reference).flat_map(|((_, a), (_, b))| a.iter().zip(b));
            let (moved, total) = pairs.fold((0, 0), |(m, t), (a, b)| (m + usize::from((a - b).abs() > 1e-6), t + 1));
            assert!(moved * 100 < total, "world {world}: {moved} of {total} elements left sign descent");
        }
    }
}

/// One sign-descent step of the gradients it holds.
struct SignStep(GradientsParams);

impl burn::module::ModuleMapper for SignStep {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        let Some(g) = self.0.remove::<D>(param.id) else { return param };
        param.map(|p| (p.inner() - g.sign().mul_scalar(LR)).autodiff().require_grad())
    }
}

/// The gradients before the step: their global norm is the one the step clips to, scaling
/// them by hand to a norm of 0.05 equals `gradient_clipping: 0.05` bit for bit, reading
/// them gives the norm back, and editing one parameter's gradient moves only it.
#[test]
fn gradients_before_the_step_serve_logging_and_custom_clipping() {
    let init = seeded_mlp(43);
    for (stage, world) in [(0, 1), (1, 2), (3, 3)] {
        let clipped = constant(stage, 2, world, r#""gradient_clipping": 0.05,"#, "");
        let plain = constant(stage, 2, world, "", "");
        let builtin = engine_params(&init, &clipped, 3);
        let by_hand = launch(&plain, |ctx| {
            let mut engine = Engine::with_units(init.clone(), &plain, &ctx)?;
            let batch = |step| TASK.batch(rank_indices(&plain, step, 0, ctx.rank()), ctx.device());
            assert!(
                matches!(engine.gradients(), Err(Error::Usage(m)) if m.contains("before the accumulation boundary"))
            );
            for step in 0..3 {
                engine.forward_backward(&batch(step))?;
                let mut grads = engine.gradients()?;
                let norm = grads.global_norm()?;
                let mut squares = 0.0f64;
                grads.for_each(|_, _, values| {
                    squares += values.iter().map(|&g| f64::from(g) * f64::from(g)).sum::<f64>()
                })?;
                if world == 1 || stage == 0 {
                    assert!(
                        (squares.sqrt() - norm).abs() <= 1e-5 * norm,
                        "stage {stage}: {} vs {norm}",
                        squares.sqrt()
                    );
                }
                let coef = (0.05 / (norm + 1e-6)).min(1.0);
                grads.scale(coef);
                let report = engine.step()?.expect("a boundary");
                // The step reports the norm of what it clips: the scaled gradient's.
                let reported = f64::from(report.grad_norm);
                assert!((reported - norm * coef).abs() <= 1e-6 * norm, "stage {stage}: {reported} vs {}", norm * coef);
            }
            Ok::<_, Error>(params_by_path(&engine.full_model()?))
        })
        .unwrap()
        .swap_remove(0);
        let (diff, path) = max_abs_diff(&by_hand, &builtin);
        assert!(
            by_hand == builtin,
            "stage {stage} world {world}: scaling by hand differs from gradient_clipping by {diff} at {path}"
        );
    }
    // Editing: a zeroed gradient leaves its parameter where plain SGD (no decay) would.
    let sgd = plan(r#"{"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}"#, 1);
    let out = launch(&sgd, |ctx| {
        let mut engine = Engine::with_units(init.clone(), &sgd, &ctx)?;
        engine.forward_backward(&TASK.batch(0..2, ctx.device()))?;
        let mut grads = engine.gradients()?;
        grads.for_each_mut(|path, _, values| {
            if path == "layers.1.weight" {
                values.fill(0.0);
            }
        })?;
        let edited_norm = grads.global_norm()?;
        engine.step()?;
        Ok::<_, Error>((edited_norm, params_by_path(&engine.full_model()?)))
    })
    .unwrap();
    let (norm, after) = &out[0];
    let before = params_by_path(&init);
    for ((path, a), (_, b)) in after.iter().zip(&before) {
        assert_eq!(a == b, path == "layers.1.weight", "{path}: only the zeroed gradient leaves its parameter");
    }
    assert!(norm.is_finite() && *norm > 0.0);
}

/// `set_gradient_accumulation_boundary` (DeepSpeed's; PyTorch's `no_sync` in effect):
/// saying by hand where the configured windows end changes nothing; a shorter window steps
/// after its micro-steps at every stage alike; and a backward after the boundary, before
/// the step, is an error rather than a lost gradient.
#[test]
fn accumulation_boundaries_set_by_hand() {
    let init = seeded_mlp(44);
    let run = |plan: &Plan, window: u64, by_hand: bool| {
        launch(plan, |ctx| {
            let mut engine = Engine::with_units(init.clone(), plan, &ctx)?;
            let mut samples = 0;
            for step in 0..2 {
                for micro in 0..window {
                    if by_hand {
                        engine.set_gradient_accumulation_boundary(Some(micro + 1 == window));
                    }
                    engine.forward_backward(&TASK.batch(rank_indices(plan, step, micro, ctx.rank()), ctx.device()))?;
                    let report = engine.step()?;
                    assert_eq!(report.is_some(), micro + 1 == window, "micro-step {micro} of {window}");
                }
                samples = engine.counters().global_samples;
            }
            Ok::<_, Error>((params_by_path(&engine.full_model()?), samples))
        })
        .unwrap()
        .swap_remove(0)
    };
    let mut short = Vec::new();
    for stage in 0..=3 {
        let plan = constant(stage, 2, 2, r#""gradient_accumulation_steps": 3,"#, "");
        assert!(run(&plan, 3, false) == run(&plan, 3, true), "stage {stage}: the configured boundary by hand");
        let (params, samples) = run(&plan, 2, true);
        assert_eq!(samples, 2 * 2 * 2 * 2, "stage {stage}: two steps of 2 micro-steps of 2 samples on 2 ranks");
        short.push(params);
    }
    // Stages 0-1 reduce once at the window's end, 2-3 every micro-step: the same sums.
    for (stage, params) in short.iter().enumerate() {
        let (diff, path) = max_abs_diff(params, &short[2]);
        assert!(diff <= 2e-6, "stage {stage} vs 2: `{path}` {diff}");
    }
    let plan = constant(0, 2, 1, r#""gradient_accumulation_steps": 2,"#, "");
    let err = launch(&plan, |ctx| {
        let mut engine = Engine::new(init.clone(), &plan, &ctx)?;
        for _ in 0..3 {
            let batch = TASK.batch(0..2, ctx.device());
            let loss = engine.forward(|m| m.loss(&batch))?;
            engine.backward(loss)?;
        }
        Ok::<_, Error>(())
    })
    .unwrap_err()
    .to_string();
    assert!(err.contains("a backward pass after the accumulation boundary"), "{err}");
}

/// `set_lr`: the next steps run at it (parameter groups at their scale of it), the schedule
/// keeps counting, and a checkpoint keeps it; `None` hands back to the schedule.
#[test]
fn the_lr_set_by_hand_drives_the_steps_and_survives_a_checkpoint() {
    let init = seeded_mlp(45);
    let plan = plan(&recipe(2, 2, 1, 0.0), 2);
    let dir = std::env::temp_dir().join(format!("zt-set-lr-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let out = launch(&plan, |ctx| {
        let mut engine = Engine::with_units(init.clone(), &plan, &ctx)?;
        let batch = |step| TASK.batch(rank_indices(&plan, step, 0, ctx.rank()), ctx.device());
        engine.set_lr(Some(0.123));
        assert_eq!(engine.get_lr(), 0.123);
        engine.forward_backward(&batch(0))?;
        let first = engine.step()?.unwrap().lr;
        engine.forward_backward(&batch(1))?;
        let second = engine.step()?.unwrap().lr;
        engine.save_checkpoint(&dir, None, serde_json::Value::Null)?;
        let mut resumed = Engine::with_units(init.clone(), &plan, &ctx)?;
        resumed.load_checkpoint(&dir, None, LoadOptions::default())?;
        let kept = resumed.get_lr();
        resumed.set_lr(None);
        Ok::<_, Error>((first, second, kept, resumed.get_lr()))
    })
    .unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
    assert_eq!(out[0], (0.123, 0.123, 0.123, recipe_lr(2)), "the schedule counted the two steps meanwhile");
}

/// Evaluation between steps (which gathers every unit at stage 3) stays out of the next
/// step's report: the same bytes as without it.
#[test]
fn evaluation_between_steps_stays_out_of_the_step_report() {
    let init = seeded_mlp(46);
    let plan = constant(3, 2, 2, "", "");
    let bytes = |evaluate: bool| {
        launch(&plan, |ctx| {
            let mut engine = Engine::with_units(init.clone(), &plan, &ctx)?;
            let mut bytes = Vec::new();
            for step in 0..3 {
                let batch = TASK.batch(rank_indices(&plan, step, 0, ctx.rank()), ctx.device());
                if evaluate {
                    engine.evaluate(&batch)?;
                    engine.eval(|m| m.loss(&batch).into_scalar::<f32>())?;
                }
                engine.forward_backward(&batch)?;
                bytes.push(engine.step()?.unwrap().comm_bytes);
            }
            Ok::<_, Error>(bytes)
        })
        .unwrap()
        .swap_remove(0)
    };
    assert_eq!(bytes(true), bytes(false));
}

/// `evaluate_many` gives each batch the loss `evaluate` gives it, bit for bit, and at stage 3
/// gathers each unit once for all the batches: five batches one by one take five times the
/// all-gathers that the five together take.
#[test]
fn evaluating_batches_together_gathers_each_unit_once_and_gives_each_its_loss() {
    let init = seeded_mlp(48);
    let plan = constant(3, 2, 2, "", "");
    let out = launch(&plan, |ctx| {
        let mut engine = Engine::with_units(init.clone(), &plan, &ctx)?;
        let batches: Vec<_> =
            (0..5).map(|step| TASK.batch(rank_indices(&plan, step, 0, ctx.rank()), ctx.device())).collect();
        engine.forward_backward(&batches[0])?;
        engine.step()?;
        let gathers = |engine: &Engine<Mlp>| engine.comm_stats().all_gather.calls;
        let start = gathers(&engine);
        let alone = batches.iter().map(|b| engine.evaluate(b)).collect::<Result<Vec<f32>, Error>>()?;
        let middle = gathers(&engine);
        let together = engine.evaluate_many(&batches)?;
        Ok::<_, Error>((alone, together, middle - start, gathers(&engine) - middle))
    })
    .unwrap();
    for (alone, together, separately, at_once) in out {
        assert_eq!(
            alone.iter().map(|l| l.to_bits()).collect::<Vec<_>>(),
            together.iter().map(|l| l.to_bits()).collect::<Vec<_>>()
        );
        assert!(at_once > 0 && separately == 5 * at_once, "{separately} all-gathers one by one, {at_once} together");
    }
}

/// The library checks a checkpoint directory before training: empty is a fresh start, one
/// with checkpoints is refused unless resuming, and resuming needs something to resume.
#[test]
fn a_checkpoint_directory_is_checked_before_training() {
    let dir = std::env::temp_dir().join(format!("zt-resume-point-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    assert_eq!(zerotrain::resume_point(&dir, false).unwrap(), None);
    let err = zerotrain::resume_point(&dir, true).unwrap_err().to_string();
    assert!(err.contains("no checkpoint in"), "{err}");
    let plan = plan(&recipe(1, 2, 1, 0.0), 1);
    let init = seeded_mlp(47);
    launch(&plan, |ctx| Engine::new(init.clone(), &plan, &ctx)?.save_checkpoint(&dir, None, serde_json::Value::Null))
        .unwrap();
    let err = zerotrain::resume_point(&dir, false).unwrap_err().to_string();
    assert!(err.contains("holds checkpoints of an earlier run") && err.contains("nothing was changed"), "{err}");
    assert_eq!(zerotrain::resume_point(&dir, true).unwrap(), Some(None));
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A model whose units pass two tensors, a residual stream and a side input every unit
/// reads (as a decoder reads an encoder's output), and whose middle unit adds a loss term
/// of its own (an auxiliary loss, as a mixture of experts has).
#[derive(Module, Debug)]
pub struct TwoStream {
    embed: Linear,
    side: Linear,
    mix: Vec<Linear>,
    out: Linear,
}

impl TwoStream {
    fn new(device: &Device) -> Self {
        Self {
            embed: LinearConfig::new(6, 12).init(device),
            side: LinearConfig::new(6, 12).init(device),
            mix: (0..2).map(|_| LinearConfig::new(12, 12).init(device)).collect(),
            out: LinearConfig::new(12, 6).init(device),
        }
    }

    /// The whole model's loss in one pass (the reference).
    fn loss(&self, batch: &Batch) -> Tensor<1> {
        let mut hidden = None;
        let mut terms = Vec::new();
        for unit in 0..4 {
            let (h, term) = self.forward_unit_with_loss(unit, hidden, batch);
            terms.extend(term);
            hidden = Some(h);
        }
        let main = self.output_loss(hidden.unwrap(), batch);
        terms.into_iter().fold(main, |total, t| total + t)
    }
}

impl UnitModel for TwoStream {
    type Batch = Batch;
    type Hidden = (Tensor<3>, Tensor<3>);

    fn units(&self) -> Vec<UnitSpec> {
        let mut units = vec![UnitSpec::new("embed", ["embed", "side"])];
        units.extend((0..2).map(|i| UnitSpec::new(format!("mix{i}"), [format!("mix.{i}")])));
        units.push(UnitSpec::new("out", ["out"]));
        units
    }

    fn forward_unit(&self, unit: usize, input: Option<Self::Hidden>, batch: &Batch) -> Self::Hidden {
        self.forward_unit_with_loss(unit, input, batch).0
    }

    fn forward_unit_with_loss(
        &self,
        unit: usize,
        input: Option<Self::Hidden>,
        batch: &Batch,
    ) -> (Self::Hidden, Option<Tensor<1>>) {
        match (unit, input) {
            (0, _) => ((self.embed.forward(batch.input.clone()).tanh(), self.side.forward(batch.input.clone())), None),
            (3, Some((stream, side))) => ((self.out.forward(stream), side), None),
            (i, Some((stream, side))) => {
                let stream = stream.clone()
                    + self.mix[i - 1].forward(stream * burn::tensor::activation::sigmoid(side.clone())).tanh();
                // The auxiliary term: keep the first mix's activations small.
                let term = (i == 1).then(|| stream.clone().powi_scalar(2).mean().mul_scalar(0.1));
                ((stream, side), term)
            }
            (_, None) => unreachable!("only unit 0 reads the batch"),
        }
    }

    fn output_loss(&self, output: Self::Hidden, batch: &Batch) -> Tensor<1> {
        (output.0 - batch.target.clone()).powi_scalar(2).mean()
    }
}

/// Two tensors flow between units and across pipeline stages, and the middle unit's loss
/// term is added and back-propagated: the unit walk (kept and recomputed, every stage) and
/// a 2-stage pipeline equal plain Burn on the whole model's loss.
#[test]
fn tuples_between_units_and_a_units_loss_term_train_like_plain_burn() {
    let device = Device::flex().autodiff();
    let init = seeded(48, TwoStream::new);
    let base = constant(0, 2, 2, "", "");
    let mut model = init.clone().fork(&device);
    let mut optim: ModuleOptimizer =
        AdamWConfig::new().with_beta_1(0.9).with_beta_2(0.99).with_epsilon(1e-8).with_weight_decay(0.1).init();
    let mut losses = Vec::new();
    for step in 0..3 {
        let loss = model.loss(&TASK.batch(step * 4..(step + 1) * 4, &device));
        losses.push(loss.clone().into_scalar::<f32>());
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        model = optim.step(LR, model, grads);
    }
    let reference = params_by_path(&model);
    let train = |plan: &Plan| {
        launch(plan, |ctx| {
            let mut trainer = zerotrain::trainer(init.clone(), plan, &ctx)?;
            let (d, n) = (ctx.data_parallel_rank() as u64, ctx.data_parallel_size() as u64);
            let mut got = Vec::new();
            for step in 0..3u64 {
                let report = trainer.train_batch(&mut |_| {
                    let first = step * 4 + d * (4 / n);
                    TASK.batch(first..first + 4 / n, ctx.device())
                })?;
                got.push(report.loss);
            }
            Ok::<_, Error>((got, trainer.master_params()?))
        })
        .unwrap()
        .swap_remove(0)
    };
    let flat: Vec<f32> = reference.iter().flat_map(|(_, v)| v.iter().copied()).collect();
    let pipeline = r#""pipeline": {"stages": 2, "partition": "uniform"},"#;
    for (what, plan) in [
        ("stage 0", base.clone()),
        ("stage 3, recomputed", constant(3, 2, 2, r#""activation_checkpointing": {},"#, "")),
        ("2 stages x 2", constant(1, 2, 4, pipeline, "")),
    ] {
        let (got, master) = train(&plan);
        for (a, b) in got.iter().zip(&losses) {
            assert!((a - b).abs() <= 1e-6 * b.abs(), "{what}: loss {a} vs {b} (the term included)");
        }
        let diff = master.iter().zip(&flat).map(|(a, b)| (a - b).abs()).fold(0.0, f32::max);
        assert!(diff <= 2e-6, "{what}: parameters differ from plain Burn by {diff}");
    }
    let _: SgdConfig = SgdConfig::new();
}
