//! Offload tiers (`offload_optimizer`, `offload_param`): offloaded training equals
//! in-memory training bit for bit, checkpoints move between offloaded and in-memory runs,
//! and every fault names its path.

use std::path::Path;

use zerotrain::{Engine, Error, LoadOptions, launch};

use crate::common::*;
use crate::tiers::{same, scratch, tier_keys};
use crate::units::{MODES, Mode, Tokens, Workload, tiny_gpt, train, unit_recipe};

/// `zero_optimization` keys that put the optimizer (and at stage 3 the parameters) on
/// NVMe under `root` ([`tier_keys`]).
fn nvme_keys(root: &Path, stage: u8) -> String {
    tier_keys(root, "nvme", if stage == 3 { "nvme" } else { "none" })
}

/// fp16's skipped steps (an overflowing first scale) skip the offloaded step the same way.
#[test]
fn a_skipped_fp16_step_is_skipped_offloaded_too() {
    let init = tiny_gpt(true, 22);
    let w = Tokens { vocab: 11, len: 9 };
    let root = scratch("fp16");
    let fp16 = |stage: u8, zero: &str| {
        unit_recipe(stage, 1, MODES[0], "fp32", zero).replacen(
            '{',
            r#"{"fp16": {"enabled": true, "initial_scale_power": 40, "hysteresis": 1},"#,
            1,
        )
    };
    for stage in [2, 3] {
        let want = train(&w, &init, &plan(&fp16(stage, ""), 2), MODES[0], 3).unwrap();
        let got = train(&w, &init, &plan(&fp16(stage, &nvme_keys(&root, stage)), 2), MODES[0], 3).unwrap();
        same(&format!("fp16 stage {stage}"), &got, &want);
    }
    let _ = std::fs::remove_dir_all(&root);
}

/// A checkpoint taken mid-run moves between offloaded and in-memory runs (and world
/// sizes), and the resumed run equals the uninterrupted one bit for bit.
#[test]
fn checkpoints_move_between_offloaded_and_in_memory_runs() {
    let init = tiny_gpt(true, 23);
    let w = Tokens { vocab: 11, len: 9 };
    let root = scratch("resume");
    let mode = MODES[5];
    for precision in ["fp32", "bf16"] {
        let in_memory = plan(&unit_recipe(3, 1, mode, precision, ""), 2);
        let offloaded = plan(&unit_recipe(3, 1, mode, precision, &nvme_keys(&root, 3)), 2);
        let whole = train(&w, &init, &in_memory, mode, 4).unwrap();
        for (first, second) in [(&offloaded, &in_memory), (&in_memory, &offloaded), (&offloaded, &offloaded)] {
            let ckpt = root.join("ckpt");
            let _ = std::fs::remove_dir_all(&ckpt);
            run_steps(&w, &init, first, 0..2, None, Some(&ckpt));
            let (losses, master) = run_steps(&w, &init, second, 2..4, Some(&ckpt), None);
            assert_eq!(losses, whole.losses[2..], "{precision}: losses after the resume");
            assert!(master == whole.master, "{precision}: masters after the resume");
        }
    }
    let _ = std::fs::remove_dir_all(&root);
}

/// Trains `steps` in units, loading `resume` first and saving to `save` after: rank 0's
/// losses and the masters.
fn run_steps(
    w: &Tokens,
    init: &zerotrain_models::Gpt,
    plan: &zerotrain::Plan,
    steps: std::ops::Range<u64>,
    resume: Option<&Path>,
    save: Option<&Path>,
) -> (Vec<f32>, Vec<f32>) {
    let out = launch(plan, |ctx| {
        let mut engine = Engine::with_units(init.clone(), plan, &ctx)?;
        if let Some(dir) = resume {
            engine.load_checkpoint(dir, None, LoadOptions::default())?;
        }
        let mut losses = Vec::new();
        for step in steps.clone() {
            use crate::units::Workload;
            engine.forward_backward(&w.batch(plan, step, 0, ctx.rank(), ctx.device()))?;
            losses.extend(engine.step()?.map(|r| r.loss));
        }
        if let Some(dir) = save {
            engine.save_checkpoint(dir, None, serde_json::Value::Null)?;
        }
        Ok::<_, Error>((losses, engine.master_params()?))
    })
    .unwrap();
    out.into_iter().next().unwrap()
}

/// Bad places for swap files end with an error naming the path, on every rank, and
/// nothing hangs: an unwritable `nvme_path`, a second job on the same `nvme_path`, and a
/// swap file deleted or truncated while the job runs.
#[test]
fn swap_faults_are_errors_naming_the_path() {
    let init = tiny_gpt(true, 24);
    let w = Tokens { vocab: 11, len: 9 };
    let root = scratch("faults");
    std::fs::create_dir_all(&root).unwrap();
    let mode = Mode { units: true, checkpointing: false, overlap: false };
    // A regular file where the folder should be.
    let blocker = root.join("not-a-dir");
    std::fs::write(&blocker, b"x").unwrap();
    let bad = plan(&unit_recipe(2, 1, mode, "bf16", &nvme_keys(&blocker, 2)), 2);
    let err = launch(&bad, |ctx| Engine::with_units(init.clone(), &bad, &ctx).map(drop)).unwrap_err().to_string();
    assert!(err.contains("not-a-dir"), "{err}");

    // A second job while the first holds the folder.
    let shared = root.join("shared");
    let first = plan(&unit_recipe(2, 1, mode, "bf16", &nvme_keys(&shared, 2)), 1);
    let err = launch(&first, |ctx| {
        let _holder = Engine::with_units(init.clone(), &first, &ctx)?;
        let second = launch(&first, |ctx| Engine::with_units(init.clone(), &first, &ctx).map(drop));
        Ok::<_, Error>(second.unwrap_err().to_string())
    })
    .unwrap()
    .remove(0);
    assert!(err.contains("zerotrain-optimizer.rank0") && err.contains("in use by another zerotrain run"), "{err}");

    // Damaged swap files, found at the next step.
    for damage in ["delete", "truncate"] {
        let p = plan(&unit_recipe(2, 1, mode, "bf16", &nvme_keys(&shared, 2)), 1);
        let err = launch(&p, |ctx| {
            let mut engine = Engine::with_units(init.clone(), &p, &ctx)?;
            use crate::units::Workload;
            engine.forward_backward(&w.batch(&p, 0, 0, ctx.rank(), ctx.device()))?;
            engine.step()?;
            let victim = shared.join("opt/zerotrain-optimizer.rank0/u1.master.swap");
            match damage {
                "delete" => std::fs::remove_file(&victim).unwrap(),
                _ => std::fs::OpenOptions::new().write(true).open(&victim).unwrap().set_len(8).unwrap(),
            }
            engine.forward_backward(&w.batch(&p, 1, 0, ctx.rank(), ctx.device()))?;
            engine.step().map(drop)
        })
        .unwrap_err()
        .to_string();
        assert!(err.contains("u1.master.swap"), "{damage}: {err}");
    }
    let _ = std::fs::remove_dir_all(&root);
}

/// A model handed over untouched (Burn initialises parameters lazily) is initialised by the
/// engine one unit at a time, on the group's first rank only, so no rank holds the whole
/// model (`zerotrain bench memory` measures the construction peak). Each parameter draws
/// from a stream of the config's `seed` and its path (`random.rs`' note), not from the
/// generator as the device was seeded when the model was built: two lazy models built
/// after different device seeds start alike, at stage 3 on two thread ranks sharing the lazy
/// model (as `launch` callers' clones do) as on one rank, and another config seed gives
/// another model. A model the caller initialised up front keeps its values.
#[test]
fn a_lazy_model_is_initialised_unit_by_unit_from_the_configs_seed() {
    use burn::tensor::Device;
    use zerotrain_models::Mlp;
    let dims = [6, 16, 16, 1];
    let masters = |model: &Mlp, plan: &zerotrain::Plan| {
        launch(plan, |ctx| Engine::with_units(model.clone(), plan, &ctx)?.master_params()).unwrap().remove(0)
    };
    let lazy = |device_seed: u64| {
        let device = Device::flex().autodiff();
        zerotrain::random::seeded(&device, device_seed, || Mlp::new(&dims, &device))
    };
    let two = plan(&unit_recipe(3, 1, MODES[2], "fp32", ""), 2);
    let one = plan(&unit_recipe(0, 1, MODES[2], "fp32", ""), 1);
    let first = masters(&lazy(9), &two);
    assert!(masters(&lazy(10), &two) == first, "the device's seed at build time chose the values");
    assert!(masters(&lazy(9), &one) == first, "one rank and two at stage 3 start from other models");
    let reseeded = plan(&unit_recipe(3, 1, MODES[2], "fp32", "").replacen('{', r#"{"seed": 5, "#, 1), 2);
    assert!(masters(&lazy(9), &reseeded) != first, "the config's seed chooses the model");
    let eager = seeded(9, |d| Mlp::new(&dims, d));
    let own: Vec<f32> = params_by_path(&eager).into_iter().flat_map(|(_, v)| v).collect();
    assert!(masters(&eager, &two) == own, "a model initialised up front keeps its values");
}

/// An offloaded checkpoint loads at another world size and stage, offloaded or not, and an
/// offloaded engine loads one written at another world size: the loaded masters are the
/// saved ones exactly.
#[test]
fn offloaded_checkpoints_move_between_world_sizes_and_stages() {
    let init = tiny_gpt(true, 25);
    let w = Tokens { vocab: 11, len: 9 };
    let root = scratch("reshard");
    let mode = MODES[5];
    let cases = [
        // (saved: world, stage, offloaded) -> (loaded: world, stage, offloaded)
        ((2, 3, true), (1, 1, true)),
        ((2, 3, true), (1, 2, false)),
        ((1, 2, false), (2, 3, true)),
        ((2, 1, true), (2, 3, true)),
    ];
    for ((sw, ss, so), (lw, ls, lo)) in cases {
        let what = format!("world {sw} stage {ss} offloaded {so} -> world {lw} stage {ls} offloaded {lo}");
        let keys = |stage: u8, offloaded: bool| if offloaded { nvme_keys(&root, stage) } else { String::new() };
        let saved_plan = plan(&unit_recipe(ss, 1, mode, "bf16", &keys(ss, so)), sw);
        let ckpt = root.join("ckpt");
        let _ = std::fs::remove_dir_all(&ckpt);
        let (_, saved) = run_steps(&w, &init, &saved_plan, 0..2, None, Some(&ckpt));
        let load_plan = plan(&unit_recipe(ls, 1, mode, "bf16", &keys(ls, lo)), lw);
        let loaded = launch(&load_plan, |ctx| {
            let mut engine = Engine::with_units(init.clone(), &load_plan, &ctx)?;
            engine.load_checkpoint(&ckpt, None, LoadOptions::default())?;
            engine.master_params()
        })
        .unwrap()
        .remove(0);
        assert!(loaded == saved, "{what}: the loaded masters differ");
    }
    let _ = std::fs::remove_dir_all(&root);
}

/// A torn step: an offloaded optimizer step that fails part-way (here in its third tile)
/// leaves some tiles stepped and some not. Every later use of the unit is an error saying so
/// (a save, the masters), never a checkpoint of mixed states; loading a checkpoint heals it
/// and training goes on.
#[test]
fn a_step_that_fails_part_way_is_never_used() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

    use crate::torn::Flaky;

    let init = tiny_gpt(true, 27);
    let w = Tokens { vocab: 11, len: 9 };
    let root = scratch("torn");
    let p = plan(&unit_recipe(2, 1, MODES[2], "bf16", &nvme_keys(&root, 2)), 1);
    let ckpt = root.join("ckpt");
    let (steps, fail_at) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(usize::MAX)));
    let outcome = launch(&p, |ctx| {
        let (s, f) = (Arc::clone(&steps), Arc::clone(&fail_at));
        let mut engine = Engine::builder(init.clone(), &p, &ctx)
            .optimizer(move |_| Box::new(Flaky { steps: Arc::clone(&s), fail_at: Arc::clone(&f) }))
            .build_units()?;
        let batch = |step| crate::units::Workload::batch(&w, &p, step, 0, ctx.rank(), ctx.device());
        engine.forward_backward(&batch(0))?;
        engine.step()?;
        engine.save_checkpoint(&ckpt, None, serde_json::Value::Null)?;
        fail_at.store(steps.load(Ordering::SeqCst) + 3, Ordering::SeqCst);
        engine.forward_backward(&batch(1))?;
        let failed = engine.step().unwrap_err().to_string();
        let saving = engine.save_checkpoint(root.join("torn-ckpt"), None, serde_json::Value::Null).unwrap_err();
        let masters = engine.master_params().unwrap_err();
        engine.load_checkpoint(&ckpt, None, LoadOptions::default())?;
        engine.forward_backward(&batch(1))?;
        let healed = engine.step()?.is_some();
        Ok::<_, Error>((failed, saving.to_string(), masters.to_string(), healed))
    })
    .unwrap()
    .remove(0);
    let (failed, saving, masters, healed) = outcome;
    assert!(failed.contains("injected failure"), "{failed}");
    for err in [&saving, &masters] {
        assert!(err.contains("failed part-way") && err.contains("load a checkpoint"), "{err}");
    }
    assert!(!root.join("torn-ckpt").join("latest").exists(), "nothing of the torn state was committed");
    assert!(healed, "training goes on after the load");
    let _ = std::fs::remove_dir_all(&root);
}

/// An optimizer (here a plain SGD of the user's) whose exported state is not one value per
/// element it steps: on NVMe its step fails naming it and both lengths (the tile's write
/// would otherwise overwrite the next tile's state, or panic), and in memory a save does.
#[test]
fn an_optimizer_state_of_the_wrong_length_is_an_error_naming_it() {
    use burn::tensor::{Device, Tensor};
    use zerotrain::engine::optimizer::{ExportedState, ShardOptimizer};

    struct Miscounting(usize);
    impl ShardOptimizer for Miscounting {
        fn step(&mut self, lr: f64, p: Tensor<1>, g: Tensor<1>) -> zerotrain::Result<Tensor<1>> {
            self.0 = p.dims()[0];
            Ok(p - g.mul_scalar(lr))
        }
        fn state_bytes(&self) -> u64 {
            0
        }
        fn export(&self) -> ExportedState {
            (vec![("momentum".into(), vec![0.0; self.0 + 3])], Vec::new())
        }
        fn import(&mut self, _: ExportedState, _: &Device) -> zerotrain::Result<()> {
            Ok(())
        }
    }

    let init = tiny_gpt(true, 31);
    let w = Tokens { vocab: 11, len: 9 };
    let root = scratch("miscounting");
    for keys in [nvme_keys(&root, 2), String::new()] {
        let p = plan(&unit_recipe(2, 1, MODES[2], "bf16", &keys), 1);
        let outcome = launch(&p, |ctx| {
            let mut engine =
                Engine::builder(init.clone(), &p, &ctx).optimizer(|_| Box::new(Miscounting(0))).build_units()?;
            engine.forward_backward(&crate::units::Workload::batch(&w, &p, 0, 0, ctx.rank(), ctx.device()))?;
            engine.step()?;
            engine.save_checkpoint(root.join("ckpt"), None, serde_json::Value::Null)
        });
        let e = outcome.unwrap_err().to_string();
        assert!(e.contains("the optimizer (Adam, optimizer.type) gave optimizer state `momentum` of"), "{e}");
        let (got, elems) = e
            .split(" of ")
            .nth(1)
            .and_then(|rest| {
                let got = rest.split(' ').next()?.parse::<usize>().ok()?;
                let elems = rest.split("values for the ").nth(1)?.split(' ').next()?.parse::<usize>().ok()?;
                Some((got, elems))
            })
            .unwrap_or_else(|| panic!("{e}"));
        assert_eq!(got, elems + 3, "{e}");
    }
    let _ = std::fs::remove_dir_all(&root);
}

/// With parameters and the optimizer on NVMe at stage 3, a rank holds between steps none of
/// the parameters' shards in memory when `max_in_cpu` is 0, at one rank as at three (ZeRO-Infinity: only the units in
/// use); with DeepSpeed's default of 1e9 elements every shard of this small model stays in
/// memory, the report lists them as parameters (the whole model at one rank, a third at
/// three), and the engine says so, naming the key. (A 30M GPT at one rank was found
/// listing its whole model, silently.)
#[test]
fn nvme_parameters_leave_memory_at_one_rank_as_at_three_unless_max_in_cpu_keeps_them() {
    let init = tiny_gpt(true, 31);
    let w = Tokens { vocab: 11, len: 9 };
    let root = scratch("param-cache");
    // The optimizer on NVMe too: in fp32 its masters are the parameters' own values.
    let keys = |max_in_cpu: &str| {
        format!(
            r#", "offload_optimizer": {{"device": "nvme", "nvme_path": "{}"}},
                 "offload_param": {{"device": "nvme", "nvme_path": "{}"{max_in_cpu}}}"#,
            root.join("opt").display(),
            root.join("param").display()
        )
    };
    let total: u64 = params_by_path(&init).iter().map(|(_, v)| 4 * v.len() as u64).sum();
    for world in [1usize, 3] {
        for (max_in_cpu, kept) in [(r#", "max_in_cpu": 0"#, false), ("", true)] {
            let plan = plan(&unit_recipe(3, 1, MODES[5], "fp32", &keys(max_in_cpu)), world);
            let out = launch(&plan, |ctx| {
                let mut engine = Engine::with_units(init.clone(), &plan, &ctx)?;
                for step in 0..2 {
                    engine.forward_backward(&w.batch(&plan, step, 0, ctx.rank(), ctx.device()))?;
                    engine.step()?;
                }
                Ok::<_, Error>((engine.memory_report().params, engine.notices().to_vec()))
            })
            .unwrap();
            let what = format!("{world} rank(s), max_in_cpu {max_in_cpu:?}");
            let held: u64 = out.iter().map(|(params, _)| params).sum();
            let named = out[0].1.iter().any(|n| n.contains("offload_param.max_in_cpu"));
            if kept {
                // Every rank's shard, padding included: at least the model, over all ranks.
                assert!(held >= total && held < total + 4096, "{what}: {held} bytes held, the model is {total}");
                assert!(named, "{what}: no notice of what max_in_cpu keeps: {:?}", out[0].1);
            } else {
                assert_eq!(held, 0, "{what}: parameter bytes held in memory between steps");
                assert!(!named, "{what}");
            }
        }
    }
    let _ = std::fs::remove_dir_all(&root);
}
