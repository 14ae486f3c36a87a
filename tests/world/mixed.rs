//! fp16 and bf16 training: loss scaling, skipped steps, half-precision traffic and memory.

use zerotrain::{Engine, Error, MemoryReport, Plan, StepReport, launch};
use zerotrain_models::{Mlp, TinyTransformer};
use zerotrain_zero::memory::{BytesPerParam, model_state_bytes};
use zerotrain_zero::{FlatLayout, ZeroStage};

use crate::common::*;

/// The common recipe with `precision` ("fp32", "fp16" or "bf16") and `extra` top-level keys.
fn mixed_recipe(stage: u8, precision: &str, extra: &str) -> String {
    let section = match precision {
        "fp16" => r#""fp16": {"enabled": true, "loss_scale_window": 1000, "hysteresis": 2},"#,
        "bf16" => r#""bf16": {"enabled": true},"#,
        _ => "",
    };
    recipe(stage, 2, 1, 0.05).replacen('{', &format!("{{ {section} {extra}"), 1)
}

struct Run {
    reports: Vec<StepReport>,
    /// The fp32 master weights after training.
    master: Vec<f32>,
    memory: MemoryReport,
    layout: FlatLayout,
}

/// Trains the MLP on `steps`; at the steps in `poison` the last rank's loss becomes inf.
fn run_mlp(plan: &Plan, init: &Mlp, steps: &[u64], poison: &[u64]) -> Result<Run, Error> {
    let out = launch(plan, |ctx| {
        let mut engine = Engine::new(init.clone(), plan, &ctx)?;
        let mut reports = Vec::new();
        for &step in steps {
            let batch = TASK.batch(rank_indices(plan, step, 0, ctx.rank()), ctx.device());
            let loss = engine.forward(|m| m.loss(&batch))?;
            let poisoned = poison.contains(&step) && ctx.rank() == plan.world_size() - 1;
            engine.backward(if poisoned { loss.mul_scalar(f32::INFINITY) } else { loss })?;
            reports.push(engine.step()?.expect("accumulation 1"));
        }
        let memory = engine.memory_report();
        let master = engine.master_params()?;
        Ok::<_, Error>(Run { reports, master, memory, layout: engine.sharding().units()[0].layout.clone() })
    })?;
    // Every rank reaches the same decisions: the same steps skipped, the same scales.
    let decisions =
        |run: &Run| run.reports.iter().map(|r| (r.skipped, r.loss_scale, r.next_loss_scale)).collect::<Vec<_>>();
    for (rank, run) in out.iter().enumerate() {
        assert_eq!(decisions(run), decisions(&out[0]), "rank {rank} decided differently from rank 0");
        assert!(run.master == out[0].master, "rank {rank}'s master differs");
    }
    Ok(out.into_iter().next().unwrap())
}

fn seeded_mlp() -> Mlp {
    seeded(5, |d| Mlp::new(&[6, 16, 6], d))
}

#[test]
fn fp16_and_bf16_track_the_fp32_loss_curve_at_every_stage() {
    let init = seeded(9, |d| TinyTransformer::new(TASK.features, 16, 2, d));
    const STEPS: u64 = 200;
    let curve = |precision: &str, stage: u8| {
        let plan = plan(&mixed_recipe(stage, precision, ""), 2);
        let losses = launch(&plan, |ctx| {
            let mut engine = Engine::new(init.clone(), &plan, &ctx)?;
            let mut losses = Vec::new();
            for step in 0..STEPS {
                let batch = TASK.batch(rank_indices(&plan, step, 0, ctx.rank()), ctx.device());
                let loss = engine.forward(|m| m.loss(&batch))?;
                engine.backward(loss)?;
                losses.push(engine.step()?.unwrap().loss);
            }
            Ok::<_, Error>(losses)
        })
        .unwrap();
        // Means over windows of 20 steps.
        losses[0].chunks(20).map(|w| w.iter().sum::<f32>() / w.len() as f32).collect::<Vec<f32>>()
    };
    let mut worst = [0.0f32; 2];
    for stage in 0..=3 {
        let reference = curve("fp32", stage);
        assert!(reference[9] < reference[0] * 0.5, "fp32 must learn: {reference:?}");
        for (i, (precision, tolerance)) in [("fp16", 2e-3), ("bf16", 1e-2)].into_iter().enumerate() {
            let half = curve(precision, stage);
            for (window, (h, f)) in half.iter().zip(&reference).enumerate() {
                let relative = (h - f).abs() / f;
                worst[i] = worst[i].max(relative);
                assert!(
                    relative <= tolerance,
                    "{precision} stage {stage} window {window}: {h} vs fp32 {f} ({relative:.4})"
                );
            }
        }
    }
    eprintln!("worst relative difference of 20-step mean loss vs fp32: fp16 {:.2e}, bf16 {:.2e}", worst[0], worst[1]);
}

#[test]
fn a_forced_fp16_overflow_skips_the_step_everywhere_and_follows_the_scale_trace() {
    let init = seeded_mlp();
    for world_size in [2, 3] {
        for stage in 0..=3 {
            let what = format!("world {world_size} stage {stage}");
            let plan = plan(&mixed_recipe(stage, "fp16", ""), world_size);
            let poisoned = run_mlp(&plan, &init, &[0, 1, 2, 3, 4], &[2]).unwrap();
            let clean = run_mlp(&plan, &init, &[0, 1, 3, 4], &[]).unwrap();
            let skipped: Vec<bool> = poisoned.reports.iter().map(|r| r.skipped).collect();
            assert_eq!(skipped, [false, false, true, false, false], "{what}");
            // Hysteresis 2: the first overflow uses up one hysteresis; the scale stays.
            assert!(poisoned.reports.iter().all(|r| r.next_loss_scale == 65536.0), "{what}");
            // The fp32 masters after two more steps are bitwise equal: the skipped step
            // changed neither them nor the optimizer state nor the lr schedule.
            assert!(poisoned.master == clean.master, "{what}: the skipped step left a trace");
        }
    }
    // Three overflows in a row: 65536 (hysteresis), then halving twice; then training goes on.
    let plan = plan(&mixed_recipe(2, "fp16", ""), 2);
    let run = run_mlp(&plan, &init, &(0..40).collect::<Vec<_>>(), &[1, 2, 3]).unwrap();
    let scales: Vec<f64> = run.reports[..5].iter().map(|r| r.next_loss_scale).collect();
    assert_eq!(scales, [65536.0, 65536.0, 32768.0, 16384.0, 16384.0]);
    let late: f32 = run.reports[35..].iter().map(|r| r.loss).sum::<f32>() / 5.0;
    assert!(
        late < run.reports[0].loss * 0.7,
        "training converges after the overflows: {} -> {late}",
        run.reports[0].loss
    );
}

#[test]
fn a_scale_too_large_for_fp16_backs_off_until_steps_succeed() {
    let init = seeded_mlp();
    let json =
        mixed_recipe(1, "fp16", "").replace(r#""hysteresis": 2"#, r#""hysteresis": 1, "initial_scale_power": 40"#);
    let run = run_mlp(&plan(&json, 2), &init, &(0..30).collect::<Vec<_>>(), &[]).unwrap();
    let first_good = run.reports.iter().position(|r| !r.skipped).expect("some step succeeds");
    assert!(first_good > 0, "2^40 must overflow fp16 gradients");
    for (i, r) in run.reports[..first_good].iter().enumerate() {
        assert!(r.skipped && r.next_loss_scale == r.loss_scale / 2.0, "step {i}: {r:?}");
    }
    assert!(run.reports[first_good..].iter().all(|r| !r.skipped && r.loss.is_finite()));
    assert_eq!(run.reports[first_good].loss_scale, 2f64.powi(40 - first_good as i32));
}

#[test]
fn an_overflow_at_the_minimum_scale_is_an_error_unless_configured_to_stay() {
    let init = seeded_mlp();
    let at_min = r#""hysteresis": 1, "initial_scale_power": 4, "min_loss_scale": 16"#;
    let json = mixed_recipe(2, "fp16", "").replace(r#""hysteresis": 2"#, at_min);
    let err = run_mlp(&plan(&json, 2), &init, &[0, 1], &[1]).err().expect("must fail");
    assert!(err.to_string().contains("loss scale already at its minimum (16)"), "{err}");
    let stay = mixed_recipe(2, "fp16", "")
        .replace(r#""hysteresis": 2"#, at_min)
        .replace("\"comm_timeout_s\": 60", "\"comm_timeout_s\": 60, \"loss_scale_at_minimum\": \"stay\"");
    let run = run_mlp(&plan(&stay, 2), &init, &[0, 1, 2], &[1]).unwrap();
    assert_eq!(run.reports.iter().map(|r| r.skipped).collect::<Vec<_>>(), [false, true, false]);
    assert!(run.reports.iter().all(|r| r.next_loss_scale == 16.0));
}

#[test]
fn half_precision_moves_exactly_half_the_bytes_of_fp32() {
    let init = seeded_mlp();
    for stage in 0..=3 {
        let bytes = |precision: &str| {
            let run = run_mlp(&plan(&mixed_recipe(stage, precision, ""), 2), &init, &[0, 1], &[]).unwrap();
            run.reports[1].comm_bytes
        };
        // The loss/norm metrics are 3 f32 values in every run (2 ranks: 3 elements, the
        // chunk this rank reduces has 2, so it receives 2 x 4 + 1 x 4 bytes).
        let metrics = 12;
        let (full, fp16, bf16) = (bytes("fp32"), bytes("fp16"), bytes("bf16"));
        assert_eq!(fp16 - metrics, (full - metrics) / 2, "stage {stage}");
        assert_eq!(bf16, fp16, "stage {stage}");
    }
}

#[test]
fn mixed_precision_memory_equals_the_zero_formula() {
    let init = seeded_mlp();
    for precision in ["fp16", "bf16"] {
        for world_size in [1, 2, 3] {
            for stage_index in 0..=3u8 {
                let what = format!("{precision} world {world_size} stage {stage_index}");
                let run =
                    run_mlp(&plan(&mixed_recipe(stage_index, precision, ""), world_size), &init, &[0], &[]).unwrap();
                let (m, l) = (run.memory, &run.layout);
                let (psi, padded, shard) = (l.num_elems() as u64, l.padded_elems() as u64, l.shard_len() as u64);
                let stage = ZeroStage::from_index(stage_index.into()).unwrap();
                let paper = model_state_bytes(stage, psi, shard, BytesPerParam::MIXED_ADAM);
                let grads = if stage == ZeroStage::OptimizerStates { 2 * padded } else { paper.grads };
                // Stage 3 keeps no half-precision copy of its shard: the gather casts the fp32
                // master, so parameters cost nothing between steps (14Ψ/N instead of 16Ψ/N).
                let params = if stage == ZeroStage::Parameters { 0 } else { paper.params };
                assert_eq!(
                    (m.params, m.grads, m.master, m.optimizer),
                    (params, grads, paper.master, paper.optimizer),
                    "{what}"
                );
            }
        }
    }
}

#[test]
fn fp32_gradient_accumulation_costs_two_more_bytes_per_accumulated_element() {
    let init = seeded_mlp();
    let json = mixed_recipe(2, "bf16", r#""data_types": {"grad_accum_dtype": "fp32"},"#);
    let run = run_mlp(&plan(&json, 2), &init, &[0], &[]).unwrap();
    assert_eq!(run.memory.grads, 4 * run.layout.shard_len() as u64);
}
