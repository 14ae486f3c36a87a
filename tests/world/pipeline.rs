//! Pipeline parallelism ([`Engine::train_batch`] with `pipeline.stages`): K = 2, 3, 4 stages
//! with 1 and 2 data-parallel ranks each, both schedules, 1, 4 and 8 micro-batches, train
//! exactly like plain Burn on the same global batch; checkpoints move between pipelined
//! and plain runs; a failing stage ends the job.

use std::path::Path;

use burn::tensor::Device;
use zerotrain::{Engine, Error, LoadOptions, MemoryReport, Pipeline, Plan, launch};
use zerotrain_models::Gpt;

use crate::common::*;
use crate::units::{Tokens, tiny_gpt};

const STEPS: u64 = 2;
/// As in `units.rs`: same gradients, summed in other orders (the root's two contributions
/// from the first and last stages are summed after reduction).
const PARAM_TOL: f32 = 5e-6;
const LOSS_TOL: f32 = 1e-6;

const W: Tokens = Tokens { vocab: 11, len: 9 };

/// A pipeline recipe: `stages` stages, `schedule`, `micro` micro-batches per step (one
/// sample each per data-parallel rank), ZeRO `stage`, `extra` top-level keys.
fn pipeline_recipe(stage: u8, stages: usize, schedule: &str, micro: u64, extra: &str) -> String {
    recipe(stage, 1, micro, 0.05)
        .replacen(
            '{',
            &format!(
                r#"{{ {extra} "pipeline": {{"stages": {stages}, "partition": "uniform"}},
                  "zerotrain": {{"schedule": "{schedule}", "comm_timeout_s": 60}},"#
            ),
            1,
        )
        .replace(r#""zerotrain": {"comm_timeout_s": 60}"#, r#""steps_per_print": 10"#)
}

/// Samples of data index `d`'s micro-batch `micro` of step `step`, `data_parallel` ranks.
fn indices(plan: &Plan, step: u64, micro: usize, d: usize, data_parallel: usize) -> std::ops::Range<u64> {
    let per = plan.batch.micro_batch_per_rank;
    let start = step * plan.batch.train_batch_size + (micro * data_parallel + d) as u64 * per;
    start..start + per
}

struct Run {
    losses: Vec<f32>,
    master: Vec<f32>,
    memory: Vec<MemoryReport>,
    pipe_wait: f64,
}

/// Trains `steps` with `train_batch` (pipelined or not, as the plan says), after loading
/// `resume`, saving to `save` after.
fn run(
    plan: &Plan,
    init: &Gpt,
    steps: std::ops::Range<u64>,
    resume: Option<&Path>,
    save: Option<&Path>,
) -> Result<Run, Error> {
    let stages = plan.pipeline.map_or(1, |p| p.stages);
    let data_parallel = plan.world_size() / stages;
    let out = launch(plan, |ctx| {
        let mut engine = zerotrain::trainer(init.clone(), plan, &ctx)?;
        if let Some(dir) = resume {
            engine.load_checkpoint(dir, None, LoadOptions::default())?;
        }
        let d = ctx.data_parallel_rank();
        assert_eq!((d, ctx.data_parallel_size()), (ctx.rank() % data_parallel, data_parallel));
        let (mut losses, mut pipe_wait) = (Vec::new(), 0.0);
        for step in steps.clone() {
            let report = engine.train_batch(&mut |micro| {
                W.tokens(indices(plan, step, micro, d, data_parallel), ctx.device()).into()
            })?;
            losses.push(report.loss);
            pipe_wait += report.times.pipe_wait;
        }
        if let Some(dir) = save {
            engine.save_checkpoint(dir, None, serde_json::Value::Null)?;
        }
        let master = engine.master_params()?;
        Ok::<_, Error>((losses, master, engine.memory_report(), pipe_wait))
    })?;
    for (rank, (losses, master, _, _)) in out.iter().enumerate() {
        assert_eq!(losses, &out[0].0, "rank {rank} reports another loss");
        assert!(master == &out[0].1, "rank {rank} holds other parameters");
    }
    let (losses, master) = (out[0].0.clone(), out[0].1.clone());
    let pipe_wait = out.iter().map(|o| o.3).sum();
    Ok(Run { losses, master, memory: out.into_iter().map(|o| o.2).collect(), pipe_wait })
}

/// The plain-Burn reference's losses and parameters (global order) for `plan`'s batches.
fn reference(init: &Gpt, plan: &Plan) -> (Vec<f32>, Vec<f32>) {
    let device = Device::flex().autodiff();
    let n = plan.batch.train_batch_size;
    let (losses, model) = reference_run_on(
        init,
        plan,
        STEPS,
        |m: &Gpt, step| m.loss(W.tokens(step * n..(step + 1) * n, &device)),
        &device,
    );
    (losses, params_by_path(&model).into_iter().flat_map(|(_, v)| v).collect())
}

#[test]
fn every_pipeline_shape_and_schedule_trains_like_plain_burn() {
    let init = tiny_gpt(true, 21);
    let (mut worst_param, mut worst_loss) = (0.0f32, 0.0f32);
    for micro in [1, 4, 8] {
        for data_parallel in [1, 2] {
            let base = plan(&recipe(0, 1, micro, 0.05), data_parallel);
            let (ref_losses, ref_params) = reference(&init, &base);
            for stages in [2, 3, 4] {
                for schedule in ["gpipe", "1f1b"] {
                    for zero in [0, 1, 2] {
                        let what = format!("K={stages} D={data_parallel} {schedule} M={micro} ZeRO-{zero}");
                        let plan = plan(&pipeline_recipe(zero, stages, schedule, micro, ""), stages * data_parallel);
                        assert_eq!(plan.batch.train_batch_size, base.batch.train_batch_size, "{what}");
                        let out = run(&plan, &init, 0..STEPS, None, None).unwrap();
                        for (got, want) in out.losses.iter().zip(&ref_losses) {
                            worst_loss = worst_loss.max((got - want).abs() / want.abs());
                            assert!((got - want).abs() <= LOSS_TOL * want.abs(), "{what}: loss {got} vs {want}");
                        }
                        let diff = out.master.iter().zip(&ref_params).map(|(a, b)| (a - b).abs()).fold(0.0, f32::max);
                        worst_param = worst_param.max(diff);
                        assert!(diff <= PARAM_TOL, "{what}: max |param - reference| = {diff}");
                    }
                }
            }
        }
    }
    eprintln!("pipeline vs plain Burn: worst parameter {worst_param:e}, worst relative loss {worst_loss:e}");
}

/// In bf16 a pipeline computes what the same model computes unpipelined, to bf16's
/// rounding: activations and gradients cross stages in bf16 as they would cross units.
#[test]
fn in_bf16_a_pipeline_agrees_with_the_unpipelined_walk() {
    let init = tiny_gpt(true, 22);
    let bf16 = r#""bf16": {"enabled": true},"#;
    for micro in [1, 4] {
        let flat = plan(&recipe(1, 1, micro, 0.05).replacen('{', &format!("{{ {bf16}"), 1), 2);
        let expected = run(&flat, &init, 0..STEPS, None, None).unwrap();
        for (stages, schedule) in [(2, "gpipe"), (2, "1f1b"), (4, "1f1b")] {
            let plan = plan(&pipeline_recipe(1, stages, schedule, micro, bf16), 2 * stages);
            let out = run(&plan, &init, 0..STEPS, None, None).unwrap();
            let what = format!("bf16 K={stages} {schedule} M={micro}");
            for (got, want) in out.losses.iter().zip(&expected.losses) {
                assert!((got - want).abs() <= 2e-3 * want.abs(), "{what}: loss {got} vs {want}");
            }
            let diff = out.master.iter().zip(&expected.master).map(|(a, b)| (a - b).abs()).fold(0.0, f32::max);
            assert!(diff <= 2e-3, "{what}: parameters differ by {diff}");
        }
    }
}

/// Each rank's model states are its stage's units (and the root) over its data-parallel
/// group: the stages' states add up to the unpipelined engine's, the root once per stage.
/// Time waiting for other stages is counted in a pipeline, and only there.
#[test]
fn a_stage_holds_only_its_units() {
    let init = tiny_gpt(false, 23);
    let flat = run(&plan(&recipe(0, 1, 2, 0.05), 1), &init, 0..1, None, None).unwrap();
    let whole = flat.memory[0].model_states();
    assert_eq!(flat.pipe_wait, 0.0, "one stage waits for no neighbour");
    for stages in [2, 4] {
        let out = run(&plan(&pipeline_recipe(0, stages, "1f1b", 2, ""), stages), &init, 0..1, None, None).unwrap();
        let sum: u64 = out.memory.iter().map(MemoryReport::model_states).sum();
        assert_eq!(sum, whole, "K={stages}: the untied GPT has no root, so the stages partition its states");
        assert!(out.memory.iter().all(|m| m.model_states() < whole), "K={stages}");
        assert!(out.pipe_wait > 0.0, "K={stages}: stages wait for their neighbours' activations");
    }
}

/// A checkpoint saved by a pipeline resumes without one and at another shape, and the
/// reverse, equal to uninterrupted training at the new shape.
#[test]
fn checkpoints_move_between_pipelines_and_plain_runs() {
    let init = tiny_gpt(true, 24);
    let dir = std::env::temp_dir().join(format!("zt-pipeline-ckpt-{}", std::process::id()));
    let plain = |zero: u8, n: usize| {
        plan(&recipe(zero, 1, 4, 0.05).replace("\"train_micro_batch_size_per_gpu\": 1", "\"train_batch_size\": 8"), n)
    };
    let piped = |zero: u8, stages: usize, n: usize| {
        plan(
            &pipeline_recipe(zero, stages, "1f1b", 4, "")
                .replace("\"train_micro_batch_size_per_gpu\": 1", "\"train_batch_size\": 8"),
            n,
        )
    };
    for (saver, resumers) in
        [(piped(1, 2, 4), vec![plain(2, 2), piped(0, 4, 4)]), (plain(2, 2), vec![piped(1, 2, 4), piped(2, 2, 2)])]
    {
        let _ = std::fs::remove_dir_all(&dir);
        run(&saver, &init, 0..2, None, Some(&dir)).unwrap();
        for plan in resumers {
            let resumed = run(&plan, &init, 2..4, Some(&dir), None).unwrap();
            let whole = run(&plan, &init, 0..4, None, None).unwrap();
            let worst = resumed.master.iter().zip(&whole.master).map(|(a, b)| (a - b).abs()).fold(0.0, f32::max);
            let what = format!(
                "saved {:?}, resumed {:?} x {}",
                saver.pipeline.map(|p| p.stages),
                plan.pipeline.map(|p| p.stages),
                plan.world_size()
            );
            assert!(worst <= 2e-6, "{what}: {worst}");
            for (a, b) in resumed.losses.iter().zip(&whole.losses[2..]) {
                assert!((a - b).abs() <= 1e-6 * b.abs(), "{what}: loss {a} vs {b}");
            }
        }
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A stage that fails in the middle of a step (its data loader errs on the second
/// micro-batch) ends every rank with its error, without waiting for the timeout.
#[test]
fn a_stage_failing_mid_pipeline_ends_the_job_with_its_error() {
    let init = tiny_gpt(true, 25);
    for schedule in ["gpipe", "1f1b"] {
        // Collectives that would wait 10 minutes: every other rank must end by the failure
        // reaching it, not by a timeout of its own.
        let recipe =
            pipeline_recipe(1, 3, schedule, 4, "").replace("\"comm_timeout_s\": 60", "\"comm_timeout_s\": 600");
        let plan = plan(&recipe, 6);
        let ended = std::sync::Mutex::new(Vec::new());
        let err = launch(&plan, |ctx| {
            let mut engine = Pipeline::new(init.clone(), &plan, &ctx)?;
            for step in 0..2u64 {
                let trained = engine.train_batch(|micro| {
                    if step == 1 && micro == 1 && ctx.rank() == 3 {
                        panic!("rank 3's data loader failed");
                    }
                    W.tokens(indices(&plan, step, micro, ctx.rank() % 2, 2), ctx.device()).into()
                });
                if let Err(e) = trained {
                    ended.lock().unwrap().push((ctx.rank(), e.is_consequence(), e.to_string()));
                    return Err(e);
                }
            }
            Ok::<_, Error>(())
        })
        .unwrap_err()
        .to_string();
        assert!(err.contains("rank 3 panicked: rank 3's data loader failed"), "{schedule}: {err}");
        let ended = ended.into_inner().unwrap();
        let others: Vec<_> = ended.iter().filter(|(rank, _, _)| *rank != 3).collect();
        assert_eq!(others.len(), 5, "{schedule}: {ended:?}");
        assert!(others.iter().all(|(_, heard, _)| *heard), "{schedule}: a rank ended otherwise: {ended:?}");
    }
}

/// Misuse and impossible shapes are errors that say what to do.
#[test]
fn pipeline_misuse_is_a_clear_error() {
    let init = tiny_gpt(true, 26);
    let five = plan(&pipeline_recipe(0, 5, "1f1b", 2, ""), 5);
    let err = launch(&five, |ctx| Pipeline::new(init.clone(), &five, &ctx).map(|_| ())).unwrap_err().to_string();
    assert!(err.contains("pipeline.stages is 5 but the model declares 4 units"), "{err}");
    // A pipeline plan builds a Pipeline, never an Engine, and the reverse.
    let two = plan(&pipeline_recipe(0, 2, "1f1b", 2, ""), 2);
    let err = launch(&two, |ctx| Engine::new(init.clone(), &two, &ctx).map(|_| ())).unwrap_err().to_string();
    assert!(err.contains("build a Pipeline (Pipeline::new)"), "{err}");
    let err = launch(&two, |ctx| Engine::with_units(init.clone(), &two, &ctx).map(|_| ())).unwrap_err().to_string();
    assert!(err.contains("build the rank's stage with Pipeline::new"), "{err}");
    let flat = plan(&recipe(0, 1, 2, 0.05), 2);
    let err = launch(&flat, |ctx| Pipeline::new(init.clone(), &flat, &ctx).map(|_| ())).unwrap_err().to_string();
    assert!(err.contains("the plan has no pipeline section"), "{err}");
    let _: fn(&mut Pipeline<Gpt>, &zerotrain_models::LmBatch) -> zerotrain::Result<f32> = Pipeline::evaluate;
}

/// A pipeline's model goes back to one rank only: each stage's first rank sends its units
/// (the root from the first stage), so rank 0 holds exactly the masters of every stage and
/// no other rank holds the model; the exported file loads into Burn with those values.
#[test]
fn a_pipelines_model_is_gathered_on_one_rank_and_exported() {
    use burn::store::{ModuleSnapshot, SafetensorsStore};
    let init = tiny_gpt(true, 27);
    let plan = plan(&pipeline_recipe(1, 2, "1f1b", 2, ""), 4);
    let file = std::env::temp_dir().join(format!("zt-pipeline-export-{}.safetensors", std::process::id()));
    let out = launch(&plan, |ctx| {
        let mut pipeline = Pipeline::new(init.clone(), &plan, &ctx)?;
        let d = pipeline.data_parallel_rank();
        pipeline.train_batch(|micro| W.tokens(indices(&plan, 0, micro, d, 2), ctx.device()).into())?;
        let model = pipeline.gather_model(0)?;
        pipeline.save_model(&file, zerotrain_precision::Precision::Fp32)?;
        Ok::<_, Error>((model.map(|m| params_by_path(&m)), pipeline.master_params()?))
    })
    .unwrap();
    for (rank, (model, _)) in out.iter().enumerate() {
        assert_eq!(model.is_some(), rank == 0, "rank {rank}");
    }
    let (model, master) = (out[0].0.clone().unwrap(), &out[0].1);
    let gathered: Vec<f32> = model.iter().flat_map(|(_, v)| v.iter().copied()).collect();
    assert!(&gathered == master, "the gathered model holds every stage's masters");
    let mut loaded = tiny_gpt(true, 999);
    let applied = loaded.load_from(&mut SafetensorsStore::from_file(&file).allow_partial(false)).unwrap();
    assert!(applied.errors.is_empty() && applied.missing.is_empty(), "{applied:?}");
    assert!(params_by_path(&loaded) == model, "the exported file holds the gathered values");
    std::fs::remove_file(&file).unwrap();
}
