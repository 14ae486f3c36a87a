//! Stages 0-3 at world sizes 1-4 train exactly like a single-process plain-Burn loop on the
//! same global batch, and like each other.

use burn::module::Module;
use burn::tensor::{Device, Tensor};
use zerotrain::{Engine, Plan, launch};
use zerotrain_models::{Batch, Mlp, TinyTransformer};

use crate::common::*;

const STEPS: u64 = 4;
/// fp32 tolerance on parameters after `STEPS` AdamW steps at lr 1e-2. The engine sums the
/// same gradients in another order (per rank, then across ranks), so values differ in the
/// last bits; measured worst case 2.8e-7 (transformer), 6e-8 (MLP).
const PARAM_TOL: f32 = 2e-6;
/// Relative tolerance on the per-step mean loss; measured worst case 1.4e-7.
const LOSS_TOL: f32 = 1e-6;

type Params = Vec<(String, Vec<f32>)>;

/// Trains with the engine; rank 0 starts from `init`, other ranks from a fresh random
/// model (the engine must broadcast rank 0's). Returns rank 0's step losses and every
/// rank's final parameters.
fn engine_run<M, L>(init: &M, fresh: &(dyn Fn(&Device) -> M + Sync), plan: &Plan, loss: &L) -> (Vec<f32>, Vec<Params>)
where
    M: Module + Sync,
    L: Fn(&M, &Batch) -> Tensor<1> + Sync,
{
    let results = launch(plan, |ctx| {
        let model = if ctx.rank() == 0 { init.clone() } else { fresh(ctx.device()) };
        let mut engine = Engine::new(model, plan, &ctx)?;
        let mut losses = Vec::new();
        for step in 0..STEPS {
            for micro in 0..plan.batch.gradient_accumulation_steps {
                let batch = TASK.batch(rank_indices(plan, step, micro, ctx.rank()), ctx.device());
                let l = engine.forward(|m| loss(m, &batch))?;
                engine.backward(l)?;
                if let Some(report) = engine.step()? {
                    losses.push(report.loss);
                }
            }
        }
        assert_eq!(engine.counters().global_steps, STEPS);
        assert_eq!(engine.counters().micro_steps, STEPS * plan.batch.gradient_accumulation_steps);
        Ok::<_, zerotrain::Error>((losses, params_by_path(&engine.full_model()?)))
    })
    .unwrap();
    let losses = results[0].0.clone();
    (losses, results.into_iter().map(|(_, p)| p).collect())
}

/// For each world size, stage, accumulation and clipping: engine == reference within
/// tolerance, all ranks identical, and stages bitwise equal where the summation order is
/// the same (all four at accumulation 1; 0 = 1 and 2 = 3 otherwise).
fn check_model<M, L>(init: &M, fresh: &(dyn Fn(&Device) -> M + Sync), loss: L)
where
    M: Module + Sync,
    L: Fn(&M, &Batch) -> Tensor<1> + Sync,
{
    let device = Device::flex().autodiff();
    let (mut worst_param, mut worst_loss) = (0.0f32, 0.0f32);
    for world_size in 1..=4 {
        for gas in [1, 3] {
            for clip in [0.0, 0.05] {
                let reference_plan = plan(&recipe(0, 2, gas, clip), world_size);
                let (ref_losses, ref_model) = reference_run(init, &reference_plan, STEPS, &loss, &device);
                let ref_params = params_by_path(&ref_model);
                let mut by_stage: Vec<Params> = Vec::new();
                for stage in 0..=3 {
                    let what = format!("world {world_size} stage {stage} gas {gas} clip {clip}");
                    let plan = plan(&recipe(stage, 2, gas, clip), world_size);
                    let (losses, ranks) = engine_run(init, fresh, &plan, &loss);
                    assert_eq!(losses.len(), STEPS as usize, "{what}");
                    for (got, want) in losses.iter().zip(&ref_losses) {
                        worst_loss = worst_loss.max((got - want).abs() / want.abs());
                        assert!((got - want).abs() <= LOSS_TOL * want.abs(), "{what}: loss {got} vs reference {want}");
                    }
                    for (rank, params) in ranks.iter().enumerate() {
                        assert_eq!(params, &ranks[0], "{what}: rank {rank} differs from rank 0");
                    }
                    let (diff, path) = max_abs_diff(&ranks[0], &ref_params);
                    assert!(diff <= PARAM_TOL, "{what}: max |param - reference| = {diff} at `{path}`");
                    worst_param = worst_param.max(diff);
                    by_stage.push(ranks.into_iter().next().unwrap());
                }
                assert!(
                    by_stage[0] == by_stage[1],
                    "world {world_size} gas {gas} clip {clip}: stages 0 and 1 must be bitwise equal"
                );
                assert!(
                    by_stage[2] == by_stage[3],
                    "world {world_size} gas {gas} clip {clip}: stages 2 and 3 must be bitwise equal"
                );
                if gas == 1 {
                    assert!(
                        by_stage[0] == by_stage[2],
                        "world {world_size} clip {clip}: all stages must be bitwise equal at gas 1"
                    );
                }
            }
        }
    }
    eprintln!(
        "{}: worst |param - reference| {worst_param:e}, worst relative loss difference {worst_loss:e}",
        std::any::type_name::<M>()
    );
}

#[test]
fn mlp_matches_plain_burn_at_every_world_size_and_stage() {
    let dims = [TASK.features, 24, 24, TASK.features];
    let init = seeded(7, |d| Mlp::new(&dims, d));
    check_model(&init, &|_: &Device| crate::common::fresh(|d| Mlp::new(&dims, d)), |m: &Mlp, b: &Batch| m.loss(b));
}

#[test]
fn transformer_block_matches_plain_burn_at_every_world_size_and_stage() {
    let init = seeded(11, |d| TinyTransformer::new(TASK.features, 16, 2, d));
    check_model(
        &init,
        &|_: &Device| crate::common::fresh(|d| TinyTransformer::new(TASK.features, 16, 2, d)),
        |m: &TinyTransformer, b: &Batch| m.loss(b),
    );
}

/// A model with a layer its loss never touches.
#[derive(burn::module::Module, Debug)]
struct PartlyUsed {
    used: Mlp,
    unused: burn::nn::Linear,
}

/// A parameter the forward pass never touches contributes a zero gradient, as in
/// DeepSpeed's flat buffers: the used parameters train exactly as plain Burn does, and
/// AdamW only decays the unused one, `p <- p * (1 - lr * weight_decay)` each step, at every
/// stage and with accumulation (the first micro-step fills its slot with zeros, the next
/// one adds nothing).
#[test]
fn a_parameter_unused_in_forward_gets_a_zero_gradient() {
    let device = Device::flex().autodiff();
    let build = |d: &Device| PartlyUsed {
        used: Mlp::new(&[TASK.features, 12, TASK.features], d),
        unused: burn::nn::LinearConfig::new(3, 4).init(d),
    };
    let new = |_: &Device| crate::common::fresh(build);
    let init = seeded(5, build);
    let init_unused: Vec<(String, Vec<f32>)> = params_by_path(&init.unused);
    for stage in 0..=3 {
        let plan = plan(&recipe(stage, 2, 2, 0.0), 2);
        let (_, reference) = reference_run(&init.used, &plan, STEPS, |m: &Mlp, b: &Batch| m.loss(b), &device);
        let (_, ranks) = engine_run(&init, &new, &plan, &|m: &PartlyUsed, b: &Batch| m.used.loss(b));
        let (used, unused): (Params, Params) = ranks[0].iter().cloned().partition(|(path, _)| !path.contains("unused"));
        let reference = params_by_path(&reference);
        assert_eq!(used.len(), reference.len());
        for ((path, got), (_, want)) in used.iter().zip(&reference) {
            let diff = got.iter().zip(want).map(|(a, b)| (a - b).abs()).fold(0.0, f32::max);
            assert!(diff <= PARAM_TOL, "stage {stage}: `{path}` differs from plain Burn by {diff}");
        }
        assert_eq!(unused.len(), init_unused.len());
        for ((path, got), (_, start)) in unused.iter().zip(&init_unused) {
            let mut want = start.clone();
            for step in 0..STEPS {
                let keep = (1.0 - recipe_lr(step) * 0.1) as f32;
                want.iter_mut().for_each(|w| *w *= keep);
            }
            let diff = got.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0.0, f32::max);
            assert!(diff <= 1e-7, "stage {stage}: unused `{path}` is off the decay-only value by {diff}");
        }
    }
}
