//! Shared pieces of the whole-world tests: configs, data split by rank, a single-process
//! reference loop in plain Burn, and parameter comparison by module path.

use burn::module::{Module, ModuleVisitor, Param};
use burn::optim::{AdamWConfig, GradientsParams, ModuleOptimizer};
use burn::tensor::{Device, Tensor};
use zerotrain::{Config, Overrides, Plan};
use zerotrain_models::{Batch, RegressionTask};

/// Note: building models in tests. Burn draws a parameter's initial values from Flex's
/// process-wide RNG at the parameter's first access, not at construction. Tests run in
/// threads of one process, so a test that seeded and built a model could get values shaped
/// by another test seeding or drawing before the first access: the initial model, and so
/// every measured difference, varied from run to run (engine and reference always shared
/// it, so no comparison was wrong, but none was repeatable). Every model the tests build is
/// therefore seeded (or not), built and materialised under the library's lock on the
/// generator, the one engines' forward passes seed and draw under (`zerotrain::random`).
pub use zerotrain::random::lock as rng_lock;

/// `build` on a fresh autodiff device after seeding Flex's RNG with `seed`, every value
/// drawn before the lock is released (see the note above).
pub fn seeded<M: Module>(seed: u64, build: impl FnOnce(&Device) -> M) -> M {
    let device = Device::flex().autodiff();
    zerotrain::random::seeded(&device, seed, || materialized(build(&device)))
}

/// `build` without a seed (values do not matter), still under the lock so that it cannot
/// draw between another test's seed and that test's draws.
pub fn fresh<M: Module>(build: impl FnOnce(&Device) -> M) -> M {
    let _rng = rng_lock();
    materialized(build(&Device::flex().autodiff()))
}

/// `model` with every lazily initialised value drawn.
fn materialized<M: Module>(model: M) -> M {
    struct Touch;
    impl ModuleVisitor for Touch {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            drop(param.val());
        }
    }
    model.visit(&mut Touch);
    model
}

/// The task every equivalence test trains on.
pub const TASK: RegressionTask = RegressionTask { seq_len: 5, features: 6 };

/// A plan from JSON text at `world_size`.
pub fn plan(json: &str, world_size: usize) -> Plan {
    Config::parse(json, "test")
        .unwrap()
        .resolve(Overrides { world_size: Some(world_size), ..Overrides::default() })
        .unwrap()
}

/// The common recipe: AdamW, `micro` samples per rank, `gas` accumulation steps.
pub fn recipe(stage: u8, micro: u64, gas: u64, clip: f64) -> String {
    format!(
        r#"{{
        "train_micro_batch_size_per_gpu": {micro},
        "gradient_accumulation_steps": {gas},
        "gradient_clipping": {clip},
        "optimizer": {{"type": "AdamW", "params": {{"lr": 0.01, "betas": [0.9, 0.99], "eps": 1e-8, "weight_decay": 0.1}}}},
        "scheduler": {{"type": "WarmupLR", "params": {{"warmup_min_lr": 0.001, "warmup_max_lr": 0.01, "warmup_num_steps": 3, "warmup_type": "linear"}}}},
        "zero_optimization": {{"stage": {stage}, "stage3_param_persistence_threshold": 0}},
        "zerotrain": {{"comm_timeout_s": 60}}
    }}"#
    )
}

/// The lr of optimizer step `step` (from 0) under the recipe's schedule, written from
/// DeepSpeed's definition rather than asked of the engine: WarmupLR, linear, 0.001 to 0.01
/// over 3 steps, and DeepSpeed's convention that step `k` runs at the schedule's value for
/// `last_batch_iteration = k - 1` (the min at -1 and 0, then `min + (max - min) * i / 3`).
pub fn recipe_lr(step: u64) -> f64 {
    let (min, max, warmup) = (0.001, 0.01, 3.0);
    match step.checked_sub(1) {
        None => min,
        Some(i) if (i as f64) < warmup => min + (max - min) * i as f64 / warmup,
        Some(_) => max,
    }
}

/// The Burn optimizer the recipe describes, built independently of the engine.
pub fn reference_optimizer() -> ModuleOptimizer {
    AdamWConfig::new().with_beta_1(0.9).with_beta_2(0.99).with_epsilon(1e-8).with_weight_decay(0.1).init()
}

/// Sample indices of `rank`'s micro-batch `micro_step` of optimizer step `step`.
pub fn rank_indices(plan: &Plan, step: u64, micro_step: u64, rank: usize) -> std::ops::Range<u64> {
    let b = &plan.batch;
    let start = step * b.train_batch_size
        + micro_step * b.micro_batch_per_rank * plan.world_size() as u64
        + rank as u64 * b.micro_batch_per_rank;
    start..start + b.micro_batch_per_rank
}

/// The losses and final parameters of `steps` optimizer steps of plain Burn on the global
/// batch: mean loss over all samples, global-norm clipping as DeepSpeed (PyTorch's
/// `clip_grad_norm_`) does it, DeepSpeed's lr sequence.
pub fn reference_run<M: Module>(
    init: &M,
    plan: &Plan,
    steps: u64,
    loss: impl Fn(&M, &Batch) -> Tensor<1>,
    device: &Device,
) -> (Vec<f32>, M) {
    let global =
        |step: u64| TASK.batch(step * plan.batch.train_batch_size..(step + 1) * plan.batch.train_batch_size, device);
    reference_run_on(init, plan, steps, |model, step| loss(model, &global(step)), device)
}

/// [`reference_run`] with the loss of optimizer step `step`'s global batch from `loss`.
pub fn reference_run_on<M: Module>(
    init: &M,
    plan: &Plan,
    steps: u64,
    loss: impl Fn(&M, u64) -> Tensor<1>,
    device: &Device,
) -> (Vec<f32>, M) {
    let mut model = init.clone().fork(device);
    let mut optim = reference_optimizer();
    let mut losses = Vec::new();
    for step in 0..steps {
        let l = loss(&model, step);
        losses.push(l.clone().into_scalar::<f32>());
        let mut grads = GradientsParams::from_grads(l.backward(), &model);
        if plan.optim.gradient_clipping > 0.0 {
            let norm = global_norm(&model, &grads);
            let coef = plan.optim.gradient_clipping / (norm + 1e-6);
            if coef < 1.0 {
                scale_grads(&model, &mut grads, coef as f32);
            }
        }
        model = optim.step(recipe_lr(step), model, grads);
    }
    (losses, model)
}

fn global_norm<M: Module>(model: &M, grads: &GradientsParams) -> f64 {
    struct Norm<'a>(&'a GradientsParams, f64);
    impl ModuleVisitor for Norm<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            if let Some(g) = self.0.get::<D>(param.id) {
                self.1 += g
                    .into_data()
                    .try_to_vec::<f32>()
                    .unwrap()
                    .iter()
                    .map(|&x| f64::from(x) * f64::from(x))
                    .sum::<f64>();
            }
        }
    }
    let mut v = Norm(grads, 0.0);
    model.visit(&mut v);
    v.1.sqrt()
}

fn scale_grads<M: Module>(model: &M, grads: &mut GradientsParams, coef: f32) {
    struct Scale<'a>(&'a mut GradientsParams, f32);
    impl ModuleVisitor for Scale<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            if let Some(g) = self.0.remove::<D>(param.id) {
                self.0.register(param.id, g.mul_scalar(self.1));
            }
        }
    }
    model.visit(&mut Scale(grads, coef));
}

/// Every float parameter as (module path, values), in visit order.
pub fn params_by_path<M: Module>(model: &M) -> Vec<(String, Vec<f32>)> {
    floats_by_path(model, |_| true)
}

/// The float tensors whose gradient tracking `keep` accepts, as (module path, values in
/// f32), in visit order.
pub fn floats_by_path<M: Module>(model: &M, keep: impl Fn(bool) -> bool) -> Vec<(String, Vec<f32>)> {
    struct Collect<F>(Vec<String>, Vec<(String, Vec<f32>)>, F);
    impl<F: Fn(bool) -> bool> ModuleVisitor for Collect<F> {
        fn enter_module(&mut self, name: &str, _: &str) {
            self.0.push(name.into());
        }
        fn exit_module(&mut self, _: &str, _: &str) {
            self.0.pop();
        }
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            if (self.2)(param.val().is_require_grad()) {
                let data = param.val().into_data().try_cast(burn::tensor::DType::F32).unwrap();
                self.1.push((self.0.join("."), data.try_to_vec::<f32>().unwrap()));
            }
        }
    }
    let mut c = Collect(Vec::new(), Vec::new(), keep);
    model.visit(&mut c);
    c.1
}

/// Largest absolute difference between two parameter sets with the same paths, and the
/// path where it occurs.
pub fn max_abs_diff(a: &[(String, Vec<f32>)], b: &[(String, Vec<f32>)]) -> (f32, String) {
    assert_eq!(a.len(), b.len());
    let mut worst = (0.0f32, String::new());
    for ((pa, va), (pb, vb)) in a.iter().zip(b) {
        assert_eq!(pa, pb);
        assert_eq!(va.len(), vb.len(), "{pa}");
        for (x, y) in va.iter().zip(vb) {
            if (x - y).abs() > worst.0 {
                worst = ((x - y).abs(), pa.clone());
            }
        }
    }
    worst
}
