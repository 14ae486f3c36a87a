//! Checkpoints: exact resume, resharding to any world size and stage, bad input, export.

use std::path::{Path, PathBuf};

use zerotrain::{Engine, Error, LoadOptions, Plan, launch};
use zerotrain_models::Mlp;

use crate::common::*;

fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("zt-world-ckpt-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

fn seeded(seed: u64) -> Mlp {
    crate::common::seeded(seed, |d| Mlp::new(&[6, 24, 24, 6], d))
}

/// What a phase of training produced on rank 0.
struct Trained {
    losses: Vec<f32>,
    master: Vec<f32>,
    client: serde_json::Value,
}

/// Builds engines from `init`, optionally loads `resume_from`, trains steps `steps`, and
/// optionally saves to `save_to` afterwards.
fn train(
    plan: &Plan,
    init: &Mlp,
    steps: std::ops::Range<u64>,
    resume_from: Option<&Path>,
    save_to: Option<&Path>,
) -> Result<Trained, Error> {
    let out = launch(plan, |ctx| {
        let mut engine = Engine::new(init.clone(), plan, &ctx)?;
        let client = match resume_from {
            Some(dir) => engine.load_checkpoint(dir, None, LoadOptions::default())?,
            None => serde_json::Value::Null,
        };
        let mut losses = Vec::new();
        for step in steps.clone() {
            for micro in 0..plan.batch.gradient_accumulation_steps {
                let batch = TASK.batch(rank_indices(plan, step, micro, ctx.rank()), ctx.device());
                let loss = engine.forward(|m| m.loss(&batch))?;
                engine.backward(loss)?;
                if let Some(r) = engine.step()? {
                    losses.push(r.loss);
                }
            }
        }
        if let Some(dir) = save_to {
            engine.save_checkpoint(dir, None, serde_json::json!({ "next_step": steps.end }))?;
        }
        Ok::<_, Error>(Trained { losses, master: engine.master_params()?, client })
    })?;
    Ok(out.into_iter().next().unwrap())
}

fn with_precision(json: String, precision: &str) -> String {
    match precision {
        "fp16" => json.replacen('{', r#"{ "fp16": {"enabled": true, "initial_scale_power": 12},"#, 1),
        _ => json,
    }
}

#[test]
fn save_and_resume_is_bitwise_identical_to_an_uninterrupted_run() {
    let init = seeded(21);
    for precision in ["fp32", "fp16"] {
        for stage in 0..=3 {
            let what = format!("{precision} stage {stage}");
            let plan = plan(&with_precision(recipe(stage, 2, 2, 0.05), precision), 2);
            let whole = train(&plan, &init, 0..6, None, None).unwrap();
            let dir = temp_dir(&format!("resume-{precision}-{stage}"));
            let first = train(&plan, &init, 0..3, None, Some(&dir)).unwrap();
            // A different initial model: everything must come from the checkpoint.
            let second = train(&plan, &seeded(99), 3..6, Some(&dir), None).unwrap();
            assert_eq!(second.client, serde_json::json!({ "next_step": 3 }), "{what}");
            assert_eq!([first.losses, second.losses].concat(), whole.losses, "{what}: losses");
            assert!(second.master == whole.master, "{what}: final fp32 masters differ");
            std::fs::remove_dir_all(&dir).unwrap();
        }
    }
}

#[test]
fn a_checkpoint_from_4_ranks_resumes_at_2_3_and_5_ranks_and_other_stages() {
    let init = seeded(22);
    // A fixed global batch of 60 samples: every world size sees the same batches.
    let json = |stage: u8| {
        recipe(stage, 2, 1, 0.05).replace("\"train_micro_batch_size_per_gpu\": 2", "\"train_batch_size\": 60")
    };
    let dir = temp_dir("reshard");
    train(&plan(&json(2), 4), &init, 0..3, None, Some(&dir)).unwrap();
    for (world_size, stage) in [(2, 3), (3, 1), (5, 2)] {
        let plan = plan(&json(stage), world_size);
        let resumed = train(&plan, &init, 3..6, Some(&dir), None).unwrap();
        let whole = train(&plan, &init, 0..6, None, None).unwrap();
        let worst = resumed.master.iter().zip(&whole.master).map(|(a, b)| (a - b).abs()).fold(0.0, f32::max);
        assert!(worst <= 2e-6, "world {world_size} stage {stage}: max |resumed - uninterrupted| = {worst}");
        for (a, b) in resumed.losses.iter().zip(&whole.losses[3..]) {
            assert!((a - b).abs() <= 1e-6 * b.abs(), "world {world_size} stage {stage}: loss {a} vs {b}");
        }
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn bad_checkpoints_and_mismatched_models_give_specific_errors() {
    let init = seeded(23);
    let plan2 = plan(&recipe(2, 2, 1, 0.0), 2);
    let dir = temp_dir("bad");
    train(&plan2, &init, 0..1, None, Some(&dir)).unwrap();
    let load = |plan: &Plan, model: &Mlp, tag: Option<&str>, options: LoadOptions| {
        launch(plan, |ctx| {
            let mut engine = Engine::new(model.clone(), plan, &ctx)?;
            engine.load_checkpoint(&dir, tag, options).map(|_| ())
        })
    };
    let err = load(&plan2, &init, Some("../bad"), LoadOptions::default()).unwrap_err().to_string();
    assert!(err.contains("invalid checkpoint tag \"../bad\""), "{err}");
    let other = fresh(|d| Mlp::new(&[6, 16, 6], d));
    let err = load(&plan2, &other, None, LoadOptions::default()).unwrap_err().to_string();
    assert!(
        err.contains("does not fit this model")
            && err.contains("layers.0.weight [6, 16]")
            && err.contains("layers.2.bias [6]"),
        "{err}"
    );
    let sgd = plan(
        &recipe(2, 2, 1, 0.0)
            .replace(r#""type": "AdamW""#, r#""type": "SGD""#)
            .replace(r#", "betas": [0.9, 0.99], "eps": 1e-8"#, ""),
        2,
    );
    let err = load(&sgd, &init, None, LoadOptions::default()).unwrap_err().to_string();
    assert!(err.contains("holds AdamW optimizer state but the config trains with SGD"), "{err}");
    load(&sgd, &init, None, LoadOptions { load_module_only: true, ..LoadOptions::default() }).unwrap();
    std::fs::remove_file(dir.join("global_step1/rank1.safetensors")).unwrap();
    let err = load(&plan2, &init, None, LoadOptions::default()).unwrap_err().to_string();
    // Rank 1 hit the missing file; rank 0 only saw a peer fail: the root cause is reported.
    assert!(err.starts_with("rank 1 failed") && err.contains("rank1.safetensors") && err.contains("missing"), "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Ranks that open different checkpoints (a tag each here; `latest` rewritten by another job
/// between their reads would do the same) are refused on every rank, naming the ranks that
/// differ from rank 0, before any loads its shard: each would otherwise load its part of
/// another checkpoint, and the model would train on as a mix of both.
#[test]
fn ranks_that_open_different_checkpoints_are_refused_before_loading() {
    let init = seeded(29);
    let plan3 = plan(&recipe(3, 2, 1, 0.0), 3);
    let dir = temp_dir("differ");
    train(&plan3, &init, 0..1, None, Some(&dir)).unwrap();
    train(&plan3, &init, 0..2, None, Some(&dir)).unwrap();
    let tags = ["global_step1", "global_step1", "global_step2"];
    let results = std::sync::Mutex::new(Vec::new());
    let outcome = launch(&plan3, |ctx| {
        let mut engine = Engine::new(init.clone(), &plan3, &ctx)?;
        let loaded = engine.load_checkpoint(&dir, Some(tags[ctx.rank()]), LoadOptions::default()).map(|_| ());
        let error = loaded.as_ref().err().map(ToString::to_string);
        results.lock().unwrap().push((ctx.rank(), error));
        loaded
    });
    assert!(outcome.is_err(), "ranks loading different checkpoints were let through");
    let results = results.into_inner().unwrap();
    assert_eq!(results.len(), 3);
    for (rank, error) in results {
        let error = error.unwrap_or_else(|| panic!("rank {rank} loaded"));
        assert!(error.contains("rank(s) [2] opened another checkpoint than rank 0"), "rank {rank}: {error}");
        let step = if rank == 2 { "at step 2" } else { "at step 1" };
        assert!(error.contains(step), "rank {rank}: {error}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn the_consolidated_file_loads_into_burn_with_the_engines_values() {
    use burn::store::{ModuleSnapshot, SafetensorsStore};
    let init = seeded(24);
    let plan = plan(&recipe(3, 2, 1, 0.0), 3);
    let dir = temp_dir("consolidate");
    let trained = train(&plan, &init, 0..2, None, Some(&dir)).unwrap();
    let ckpt = zerotrain_checkpoint::Checkpoint::open(&dir, None).unwrap();
    let file = dir.join("model.safetensors");
    zerotrain_checkpoint::consolidate(&ckpt, &file, zerotrain_precision::Precision::Fp32).unwrap();

    let mut model = seeded(1234);
    let mut store = SafetensorsStore::from_file(&file);
    let applied = model.load_from(&mut store).unwrap();
    assert!(applied.errors.is_empty(), "{applied:?}");
    let loaded: Vec<f32> = params_by_path(&model).into_iter().flat_map(|(_, v)| v).collect();
    assert!(loaded == trained.master, "Burn's loader must give the engine's exact parameters");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Python's `safetensors` and numpy read the consolidated file with the engine's values
/// (Burn's `[in, out]` Linear layout). Ignored where it cannot run (it needs them installed);
/// `.ci/run` installs them and runs it: `cargo test --test world -- --ignored --exact
/// checkpoint::the_consolidated_file_reads_in_python`.
#[test]
#[ignore = "needs python3 with safetensors and numpy (pip install safetensors numpy); .ci/run runs it"]
fn the_consolidated_file_reads_in_python() {
    let init = seeded(25);
    let plan = plan(&recipe(3, 2, 1, 0.0), 3);
    let dir = temp_dir("consolidate-python");
    let trained = train(&plan, &init, 0..2, None, Some(&dir)).unwrap();
    let ckpt = zerotrain_checkpoint::Checkpoint::open(&dir, None).unwrap();
    let file = dir.join("model.safetensors");
    zerotrain_checkpoint::consolidate(&ckpt, &file, zerotrain_precision::Precision::Fp32).unwrap();
    let script = format!(
        "import numpy as np\nfrom safetensors.numpy import load_file\nt = load_file({:?})\n\
         print(sum(int(v.size) for v in t.values()), float(np.float64(t['layers.0.weight'].astype(np.float64).sum())), t['layers.0.weight'].shape)",
        file.display().to_string()
    );
    let out = std::process::Command::new("python3").args(["-c", &script]).output().expect("python3 runs");
    assert!(out.status.success(), "python: {}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8_lossy(&out.stdout);
    let fields: Vec<&str> = text.split_whitespace().collect();
    assert_eq!(fields[0].parse::<usize>().unwrap(), trained.master.len(), "{text}");
    let expected: f64 = trained.master[..6 * 24].iter().map(|&v| f64::from(v)).sum();
    let got: f64 = fields[1].parse().unwrap();
    assert!((got - expected).abs() < 1e-9 * expected.abs().max(1.0), "{got} vs {expected}");
    assert!(text.contains("(6, 24)"), "Burn's Linear weight is [in, out]: {text}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Regression: the manifest's engine state was not validated, so extreme counters panicked
/// on resume and a loss scale of 0, -1 or 1e308 was accepted. The checksum only proves the
/// file is unchanged since it was written, so these manifests carry valid checksums.
#[test]
fn hostile_engine_state_in_a_checksummed_manifest_is_refused() {
    let dir = temp_dir("hostile-state");
    let plan = plan(&recipe(2, 2, 1, 0.0), 2);
    let init = seeded(5);
    train(&plan, &init, 0..1, None, Some(&dir)).unwrap();
    let original = zerotrain_checkpoint::Checkpoint::open(&dir, None).unwrap().manifest().clone();
    let scaler =
        |scale: f64| serde_json::json!({"scale": scale, "iter": 1, "last_overflow_iter": -1, "hysteresis_left": 2});
    type Edit = Box<dyn Fn(&mut serde_json::Value)>;
    let cases: Vec<(&str, Edit, &str)> = vec![
        ("scale 0", Box::new(move |e| e["loss_scaler"] = scaler(0.0)), "loss scale 0 is not in"),
        ("scale -1", Box::new(move |e| e["loss_scaler"] = scaler(-1.0)), "loss scale -1 is not in"),
        ("scale 1e308", Box::new(move |e| e["loss_scaler"] = scaler(1e308)), "is not in (0, 2^64]"),
        ("steps", Box::new(|e| e["counters"]["global_steps"] = u64::MAX.into()), "counter global_steps"),
        ("lr", Box::new(|e| e["lr_iteration"] = i64::MAX.into()), "lr schedule position"),
        ("skipped", Box::new(|e| e["counters"]["skipped_steps"] = 5.into()), "5 skipped steps of 1 steps"),
        (
            "adam step",
            Box::new(|e| {
                for item in e["optimizer_scalars"].as_array_mut().expect("Adam saves its step count") {
                    item[1] = serde_json::json!({"Int": -5});
                }
            }),
            "optimizer scalar",
        ),
    ];
    for (name, mutate, needle) in cases {
        let mut m = original.clone();
        mutate(&mut m.engine);
        std::fs::write(dir.join(&m.tag).join("manifest.json"), m.to_bytes().unwrap()).unwrap();
        let err = launch(&plan, |ctx| {
            let mut engine = Engine::new(init.clone(), &plan, &ctx)?;
            engine.load_checkpoint(&dir, None, LoadOptions::default()).map(|_| ())
        })
        .unwrap_err()
        .to_string();
        assert!(err.contains("engine state") && err.contains(needle), "{name}: {err}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Regression: loading inside an accumulation window kept the window's gradients, which
/// the next step then applied to the loaded weights.
#[test]
fn loading_inside_an_accumulation_window_is_refused() {
    let dir = temp_dir("load-in-window");
    let plan = plan(&recipe(1, 2, 2, 0.0), 2);
    let init = seeded(6);
    train(&plan, &init, 0..1, None, Some(&dir)).unwrap();
    let err = launch(&plan, |ctx| {
        let mut engine = Engine::new(init.clone(), &plan, &ctx)?;
        let batch = TASK.batch(rank_indices(&plan, 0, 0, ctx.rank()), ctx.device());
        let loss = engine.forward(|m| m.loss(&batch))?;
        engine.backward(loss)?;
        engine.load_checkpoint(&dir, None, LoadOptions::default()).map(|_| ())
    })
    .unwrap_err()
    .to_string();
    assert!(err.contains("inside an accumulation window (1 of 2 micro-steps done)"), "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
}
