//! Every offload tier, alone or with the others, trains the in-memory model bit for bit:
//! the whole matrix of `offload_param` x `offload_optimizer` devices DeepSpeed allows, and
//! the offload configs users bring from LLaMA-Factory, Hugging Face and
//! text-generation-webui, each resumed in the middle of its run.

use std::path::{Path, PathBuf};

use serde_json::{Value, json};
use zerotrain::{Config, Overrides, Plan};

use crate::common::*;
use crate::units::{MODES, Mode, Outcome, Tokens, tiny_gpt, train, train_between, unit_recipe};

const STEPS: u64 = 4;
const TIERS: [&str; 3] = ["none", "cpu", "nvme"];

/// A fresh scratch folder for one test.
pub(crate) fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("zerotrain-offload-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

/// `zero_optimization` keys putting the optimizer and the parameters on `optimizer` and
/// `param` (`"none"`, `"cpu"` or `"nvme"`) under `root`. NVMe optimizer tiles of 1024
/// elements (several per unit shard of the tiny GPT), pipelined; only the first unit's
/// parameter shard cached in memory, so both kinds of NVMe parameter shard are used.
pub(crate) fn tier_keys(root: &Path, optimizer: &str, param: &str) -> String {
    let mut keys = String::new();
    if optimizer != "none" {
        let nvme = format!(
            r#", "nvme_path": "{}", "pipeline_read": true, "pipeline_write": true, "buffer_count": 9"#,
            root.join("opt").display()
        );
        let nvme = if optimizer == "nvme" { nvme.as_str() } else { "" };
        keys += &format!(r#", "sub_group_size": 1000, "offload_optimizer": {{"device": "{optimizer}"{nvme}}}"#);
    }
    if param != "none" {
        let nvme = format!(r#", "nvme_path": "{}", "max_in_cpu": 600"#, root.join("param").display());
        let nvme = if param == "nvme" { nvme.as_str() } else { "" };
        keys += &format!(r#", "offload_param": {{"device": "{param}"{nvme}}}"#);
    }
    keys
}

/// Trains `STEPS` steps as two runs: the first half, saved to `ckpt`, and the second,
/// resumed from it. Returns the second run's outcome with every loss.
fn resumed_halfway(w: &Tokens, plan: &Plan, mode: Mode, ckpt: &Path) -> Outcome {
    let init = tiny_gpt(true, 21);
    let _ = std::fs::remove_dir_all(ckpt);
    let first = train_between(w, &init, plan, mode, 0..STEPS / 2, None, Some(ckpt)).unwrap();
    let mut second = train_between(w, &init, plan, mode, STEPS / 2..STEPS, Some(ckpt), None).unwrap();
    second.losses.splice(0..0, first.losses);
    second
}

/// `got` is `want` bit for bit: the losses, the fp32 masters, every rank's parameters.
pub(crate) fn same(what: &str, got: &Outcome, want: &Outcome) {
    assert_eq!(got.losses, want.losses, "{what}: losses");
    assert!(got.master == want.master, "{what}: master weights differ");
    for (rank, params) in got.params.iter().enumerate() {
        let (diff, path) = max_abs_diff(params, &want.params[rank]);
        assert!(params == &want.params[rank], "{what}: rank {rank}'s parameters differ by {diff} at `{path}`");
    }
}

/// Runs `check(world_size, precision, gas, mode)` over the matrix the offload tests share.
fn for_each_run(mut check: impl FnMut(usize, &str, u64, Mode)) {
    for world_size in [1, 2] {
        for precision in ["fp32", "bf16"] {
            for gas in [1, 3] {
                for mode in [MODES[0], MODES[5]] {
                    check(world_size, precision, gas, mode);
                }
            }
        }
    }
}

/// DeepSpeed issue 2272 (NVMe offload silently hurting convergence) is the bug never to
/// have, and this engine had its own: parameters on NVMe without an NVMe optimizer tier
/// trained from the first step's shard forever. Every combination DeepSpeed allows, at
/// every sharded stage, precision, world size, accumulation and walk, with clipping on and
/// a resume in the middle, gives the in-memory run's bits; an NVMe optimizer tier holds no
/// optimizer state in memory; parameters offloaded below stage 3 are refused by name.
#[test]
fn every_combination_of_offload_tiers_trains_as_in_memory_bit_for_bit() {
    let w = Tokens { vocab: 11, len: 9 };
    let root = scratch("matrix");
    for stage in 1..=2u8 {
        for param in ["cpu", "nvme"] {
            let json = unit_recipe(stage, 1, MODES[0], "fp32", &tier_keys(&root, "none", param));
            let err = Config::parse(&json, "test").unwrap().resolve(Overrides::default()).unwrap_err().to_string();
            assert!(err.contains("zero_optimization.offload_param") && err.contains("stage 3"), "{err}");
        }
    }
    let init = tiny_gpt(true, 21);
    for_each_run(|world_size, precision, gas, mode| {
        for stage in 1..=3u8 {
            let in_memory = plan(&unit_recipe(stage, gas, mode, precision, ""), world_size);
            let want = train(&w, &init, &in_memory, mode, STEPS).unwrap();
            let params = if stage == 3 { &TIERS[..] } else { &TIERS[..1] };
            for optimizer in TIERS {
                for &param in params.iter().filter(|&&p| (optimizer, p) != ("none", "none")) {
                    let what = format!(
                        "world {world_size} stage {stage} {precision} gas {gas} {mode:?}, optimizer {optimizer}, \
                         param {param}"
                    );
                    let keys = tier_keys(&root, optimizer, param);
                    let offloaded = plan(&unit_recipe(stage, gas, mode, precision, &keys), world_size);
                    let got = resumed_halfway(&w, &offloaded, mode, &root.join("ckpt"));
                    same(&what, &got, &want);
                    if optimizer == "nvme" {
                        for (m, reference) in got.memory.iter().zip(&want.memory) {
                            assert_eq!(m.optimizer, 0, "{what}: no optimizer state in memory");
                            // Adam's two moments always; the masters too in mixed precision.
                            let swapped_states = reference.optimizer + reference.master;
                            assert!(m.swapped >= swapped_states, "{what}: {} swapped < {swapped_states}", m.swapped);
                        }
                    }
                }
            }
        }
    });
    let _ = std::fs::remove_dir_all(&root);
}

/// The offload configs users bring, as their projects ship them: each trains the tiny GPT as
/// the same config without its offload sections does, bit for bit, in every precision,
/// world size, accumulation and walk, resumed halfway. Their `"auto"` values resolve as a
/// Hugging Face Trainer's defaults would; the batch, precision and walk are set per run;
/// `nvme_path` points into a scratch folder.
#[test]
fn offload_configs_from_real_projects_train_as_in_memory_bit_for_bit() {
    let w = Tokens { vocab: 11, len: 9 };
    let root = scratch("projects");
    let init = tiny_gpt(true, 21);
    let files = [
        "llama_factory_z2_offload.json",
        "llama_factory_z3_offload.json",
        "hf_zero2_offload.json",
        "hf_trainer_zero3.json",
        "hf_zero3_nvme.json",
        "text_generation_webui_z3_nvme.json",
    ];
    for file in files {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data").join(file);
        let shipped: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        for_each_run(|world_size, precision, gas, mode| {
            let what = format!("{file}: world {world_size} {precision} gas {gas} {mode:?}");
            let offloaded = for_run(&shipped, &root, precision, gas, mode);
            let mut in_memory = offloaded.clone();
            let zero = in_memory["zero_optimization"].as_object_mut().unwrap();
            assert!(zero.remove("offload_param").is_some() | zero.remove("offload_optimizer").is_some(), "{what}");
            let resolve = |config: &Value| {
                let config = Config::parse(&config.to_string(), file).unwrap();
                config.resolve(Overrides { world_size: Some(world_size), ..Overrides::default() }).unwrap()
            };
            let want = train(&w, &init, &resolve(&in_memory), mode, STEPS).unwrap();
            let got = resumed_halfway(&w, &resolve(&offloaded), mode, &root.join("ckpt"));
            same(&what, &got, &want);
        });
    }
    let _ = std::fs::remove_dir_all(&root);
}

/// `shipped` for one run: 2 samples per rank, `gas` accumulation steps, `precision`,
/// activation checkpointing as `mode` says, NVMe paths under `root`, a short timeout.
fn for_run(shipped: &Value, root: &Path, precision: &str, gas: u64, mode: Mode) -> Value {
    let mut config = shipped.clone();
    let top = config.as_object_mut().unwrap();
    top.insert("train_batch_size".into(), json!("auto"));
    top.insert("train_micro_batch_size_per_gpu".into(), json!(2));
    top.insert("gradient_accumulation_steps".into(), json!(gas));
    top.insert("fp16".into(), json!({"enabled": false}));
    top.insert("bf16".into(), json!({"enabled": precision == "bf16"}));
    top.insert("zerotrain".into(), json!({"comm_timeout_s": 60}));
    if mode.checkpointing {
        top.insert("activation_checkpointing".into(), json!({}));
    }
    let zero = top.get_mut("zero_optimization").and_then(Value::as_object_mut).unwrap();
    for (section, folder) in [("offload_optimizer", "opt"), ("offload_param", "param")] {
        if let Some(path) = zero.get_mut(section).and_then(|s| s.get_mut("nvme_path")) {
            *path = json!(root.join(folder));
        }
    }
    config
}

/// `model` with every float parameter rounded to bf16 (to nearest, ties to even), as a
/// bf16 checkpoint would hold it.
fn rounded_to_bf16<M: burn::module::Module>(model: M) -> M {
    use burn::module::{ModuleMapper, Param};
    use burn::tensor::{Tensor, TensorData};
    struct Round;
    impl ModuleMapper for Round {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
            param.map(|t| {
                let (shape, device, grad) = (t.shape(), t.device(), t.is_require_grad());
                let values: Vec<f32> = t.into_data().try_to_vec().unwrap();
                let round = |x: f32| {
                    let bits = x.to_bits();
                    f32::from_bits(bits.wrapping_add(0x7FFF + ((bits >> 16) & 1)) & 0xFFFF_0000)
                };
                let t =
                    Tensor::<D>::from_data(TensorData::new(values.into_iter().map(round).collect(), shape), &device);
                if grad { t.require_grad() } else { t }
            })
        }
    }
    model.map(&mut Round)
}

/// Blocks the disk holds for the masters' swap files under `root`, and how many there are.
fn master_blocks(root: &Path) -> (u64, usize) {
    use std::os::unix::fs::MetadataExt;
    let mut found = (0, 0);
    for entry in std::fs::read_dir(root).into_iter().flatten().flatten() {
        let path = entry.path();
        if path.is_dir() {
            let (blocks, files) = master_blocks(&path);
            found = (found.0 + blocks, found.1 + files);
        } else if path.to_string_lossy().ends_with(".master.swap") {
            found = (found.0 + entry.metadata().unwrap().blocks(), found.1 + 1);
        }
    }
    found
}

/// A bf16 model whose values bf16 holds exactly (a bf16 checkpoint's) gets no masters
/// written to NVMe when its engine is built: until the first step writes them, its
/// parameters are its masters (the masters' files exist and hold no blocks; the first
/// step fills them). The in-memory run's bits all the same, at stages 1 and 3, on one and
/// two ranks, parameters in memory or on NVMe, and from a checkpoint saved before any step
/// and resumed in memory.
#[test]
fn masters_a_bf16_model_holds_exactly_are_written_by_its_first_step() {
    use crate::units::Workload;
    use zerotrain::{Engine, launch};
    let w = Tokens { vocab: 11, len: 9 };
    let root = scratch("bf16-exact");
    let init = rounded_to_bf16(tiny_gpt(true, 21));
    let mode = MODES[5];
    for world_size in [1, 2] {
        for stage in [1u8, 3] {
            let in_memory = plan(&unit_recipe(stage, 1, mode, "bf16", ""), world_size);
            let want = train(&w, &init, &in_memory, mode, STEPS).unwrap();
            let params = if stage == 3 { &["none", "nvme"][..] } else { &["none"][..] };
            for &param in params {
                let what = format!("world {world_size} stage {stage}, param {param}");
                let offloaded =
                    plan(&unit_recipe(stage, 1, mode, "bf16", &tier_keys(&root, "nvme", param)), world_size);
                let blocks = launch(&offloaded, |ctx| {
                    let mut engine = Engine::with_units(init.clone(), &offloaded, &ctx)?;
                    // Every rank reads the folder every rank writes: each read between two
                    // barriers, so that no rank's step (before) or engine's end, which
                    // removes its swap files (after), runs during another's read.
                    ctx.collective().barrier()?;
                    let before = master_blocks(&root.join("opt"));
                    ctx.collective().barrier()?;
                    engine.forward_backward(&w.batch(&offloaded, 0, 0, ctx.rank(), ctx.device()))?;
                    engine.step()?;
                    ctx.collective().barrier()?;
                    let after = master_blocks(&root.join("opt"));
                    ctx.collective().barrier()?;
                    Ok::<_, zerotrain::Error>((before, after))
                })
                .unwrap();
                let (before, after) = blocks[0];
                assert!(before.1 > 0 && before.0 == 0, "{what}: {} masters' files hold {} blocks", before.1, before.0);
                assert!(after.0 > 0, "{what}: the first step wrote no masters");
                same(&what, &train(&w, &init, &offloaded, mode, STEPS).unwrap(), &want);
                let ckpt = root.join("ckpt0");
                let _ = std::fs::remove_dir_all(&ckpt);
                train_between(&w, &init, &offloaded, mode, 0..0, None, Some(&ckpt)).unwrap();
                let resumed = train_between(&w, &init, &in_memory, mode, 0..STEPS, Some(&ckpt), None).unwrap();
                same(&format!("{what}, saved before a step"), &resumed, &want);
            }
        }
    }
    let _ = std::fs::remove_dir_all(&root);
}
