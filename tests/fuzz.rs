//! Fuzz harness: configs and checkpoint manifests from structure-aware generators (and byte
//! mutations of real files) must give a value or a typed error: never a panic, an abort
//! or an unbounded allocation.
//!
//! CI runs `FUZZ_CASES_DEFAULT` cases per target in seconds. A long run:
//! `ZEROTRAIN_FUZZ_CASES=100000 cargo test --features crash-points --test fuzz -- --nocapture`
//! (each target prints its case count).

use std::path::{Path, PathBuf};

use proptest::collection::vec;
use proptest::prelude::*;
use proptest::test_runner::{Config as RunnerConfig, TestRunner};
use serde_json::Value;
use zerotrain::config::{ComputeDevice, LauncherEnvironment, MpirunEnvironment};
use zerotrain::{Config, Overrides};
use zerotrain_checkpoint::{
    Checkpoint, FORMAT_VERSION, LayoutEntry, Manifest, commit, prepare, write_buffers, write_shard,
};
use zerotrain_cli::keys::AppKeys;
use zerotrain_precision::Precision;

const FUZZ_CASES_DEFAULT: u32 = 300;

fn runner() -> (TestRunner, u32) {
    let cases = std::env::var("ZEROTRAIN_FUZZ_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(FUZZ_CASES_DEFAULT);
    let config = RunnerConfig { cases, failure_persistence: None, ..RunnerConfig::default() };
    (TestRunner::new(config), cases)
}

/// Keys and names the configs use, so that generated files reach deep into resolution.
const WORDS: &[&str] = &[
    "train_batch_size",
    "train_micro_batch_size_per_gpu",
    "gradient_accumulation_steps",
    "gradient_clipping",
    "steps_per_print",
    "wall_clock_breakdown",
    "seed",
    "optimizer",
    "type",
    "params",
    "lr",
    "betas",
    "eps",
    "weight_decay",
    "adam_w_mode",
    "momentum",
    "nesterov",
    "scheduler",
    "warmup_min_lr",
    "warmup_max_lr",
    "warmup_num_steps",
    "warmup_type",
    "total_num_steps",
    "cycle_min_lr",
    "cycle_max_lr",
    "cycle_first_step_size",
    "last_batch_iteration",
    "zero_optimization",
    "stage",
    "reduce_bucket_size",
    "stage3_param_persistence_threshold",
    "offload_optimizer",
    "device",
    "fp16",
    "bf16",
    "enabled",
    "loss_scale",
    "initial_scale_power",
    "loss_scale_window",
    "hysteresis",
    "min_loss_scale",
    "communication_data_type",
    "data_types",
    "grad_accum_dtype",
    "zerotrain",
    "world_size",
    "backend",
    "comm_timeout_s",
    "keep_last_n_checkpoints",
    "loss_scale_at_minimum",
    "check_grad_overflow",
    "model",
    "n_layer",
    "n_head",
    "n_embd",
    "block_size",
    "vocab_size",
    "tied_head",
    "checkpoint_every",
    "eval_every",
    "auto",
    "Adam",
    "AdamW",
    "SGD",
    "WarmupLR",
    "WarmupDecayLR",
    "WarmupCosineLR",
    "OneCycle",
    "fp32",
    "threads",
    "mpi",
    "linear",
    "none",
    "pipeline",
    "stages",
    "partition",
    "partition_method",
    "activation_checkpoint_interval",
    "activation_checkpointing",
    "partition_activations",
    "number_checkpoints",
    "overlap_comm",
    "reduce_scatter",
    "stage3_prefetch_bucket_size",
    "stage3_max_live_parameters",
    "contiguous_gradients",
    "allgather_bucket_size",
    "schedule",
    "1f1b",
    "gpipe",
    "parameters",
    "uniform",
    "param_groups",
    "*.bias",
];

/// A config with every section the library resolves, valid as written; the structured
/// fuzzer edits it at [`CONFIG_FIELDS`], so each case gets past parsing into the sections'
/// rules (random configs rarely nest known keys deep enough).
fn full_config() -> Value {
    serde_json::json!({
        "train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4,
        "gradient_clipping": 1.0, "steps_per_print": 5, "wall_clock_breakdown": true, "seed": 3,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.99], "eps": 1e-8, "weight_decay": 0.1}},
        "scheduler": {"type": "WarmupCosineLR", "params": {"warmup_num_steps": 10, "total_num_steps": 100,
                                                          "warmup_min_ratio": 0.1, "cos_min_ratio": 0.01}},
        "zero_optimization": {"stage": 2, "overlap_comm": true, "reduce_scatter": true, "reduce_bucket_size": 1000,
                              "stage3_prefetch_bucket_size": 100, "stage3_max_live_parameters": 1000,
                              "stage3_param_persistence_threshold": 10, "contiguous_gradients": true},
        "bf16": {"enabled": true},
        "communication_data_type": "bf16",
        "data_types": {"grad_accum_dtype": "fp32"},
        "pipeline": {"stages": 2, "partition": "parameters", "activation_checkpoint_interval": 1},
        "activation_checkpointing": {"partition_activations": false, "number_checkpoints": 2},
        "zerotrain": {"world_size": 2, "schedule": "gpipe", "comm_timeout_s": 30, "keep_last_n_checkpoints": 2,
                      "param_groups": [{"params": ["*.bias"], "weight_decay": 0}, {"params": ["head.*"], "lr": 1e-4}]}
    })
}

/// JSON pointers into [`full_config`] whose values the structured fuzzer replaces.
const CONFIG_FIELDS: &[&str] = &[
    "/train_batch_size",
    "/gradient_accumulation_steps",
    "/gradient_clipping",
    "/optimizer/type",
    "/optimizer/params/lr",
    "/optimizer/params/betas",
    "/scheduler/type",
    "/scheduler/params/warmup_num_steps",
    "/scheduler/params/total_num_steps",
    "/zero_optimization/stage",
    "/zero_optimization/overlap_comm",
    "/zero_optimization/reduce_bucket_size",
    "/zero_optimization/stage3_prefetch_bucket_size",
    "/zero_optimization/stage3_max_live_parameters",
    "/zero_optimization/contiguous_gradients",
    "/bf16",
    "/bf16/enabled",
    "/communication_data_type",
    "/pipeline",
    "/pipeline/stages",
    "/pipeline/partition",
    "/pipeline/activation_checkpoint_interval",
    "/activation_checkpointing",
    "/activation_checkpointing/number_checkpoints",
    "/zerotrain/world_size",
    "/zerotrain/schedule",
    "/zerotrain/param_groups",
    "/zerotrain/param_groups/0/params",
    "/zerotrain/param_groups/1/lr",
    "/zerotrain/param_groups/0/weight_decay",
];

fn text() -> impl Strategy<Value = String> {
    prop_oneof![
        4 => proptest::sample::select(WORDS).prop_map(str::to_string),
        1 => vec(any::<char>(), 0..12).prop_map(String::from_iter),
    ]
}

fn leaf() -> impl Strategy<Value = Value> {
    let ints = prop_oneof![Just(0i64), Just(-1), Just(1), Just(2), Just(i64::MAX), Just(i64::MIN), any::<i64>()];
    let uints = prop_oneof![Just(u64::MAX), Just(1u64 << 40), Just(1u64 << 53), Just(1u64 << 63), any::<u64>()];
    let floats =
        prop_oneof![Just(0.0f64), Just(-0.5), Just(0.1), Just(1e308), Just(-1e308), Just(5e-324), any::<f64>()];
    prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        ints.prop_map(Value::from),
        uints.prop_map(Value::from),
        floats.prop_map(|f| serde_json::Number::from_f64(f).map_or(Value::Null, Value::Number)),
        text().prop_map(Value::String),
    ]
}

fn value() -> impl Strategy<Value = Value> {
    leaf().prop_recursive(4, 48, 6, |inner| {
        prop_oneof![
            vec(inner.clone(), 0..4).prop_map(Value::Array),
            vec((text(), inner), 0..6).prop_map(|kv| Value::Object(kv.into_iter().collect())),
        ]
    })
}

fn overrides() -> impl Strategy<Value = Overrides> {
    let sizes = prop_oneof![Just(None), (1usize..6).prop_map(Some), Just(Some(20_000)), Just(Some(usize::MAX))];
    let steps = prop_oneof![Just(None), Just(Some(0u64)), Just(Some(100)), Just(Some(u64::MAX))];
    let mpirun = prop_oneof![Just(None), (1usize..5).prop_map(|n| Some(MpirunEnvironment { rank: 0, world_size: n }))];
    let device = prop_oneof![
        Just(None),
        Just(Some(ComputeDevice::Cpu)),
        Just(Some(ComputeDevice::Wgpu)),
        Just(Some(ComputeDevice::Cuda))
    ];
    let launcher =
        prop_oneof![Just(None), (1usize..5).prop_map(|n| Some(LauncherEnvironment { rank: n - 1, world_size: n }))];
    (sizes, steps, mpirun, launcher, device).prop_map(|(world_size, total_steps, mpirun, launcher, device)| Overrides {
        world_size,
        total_steps,
        mpirun,
        launcher,
        device,
    })
}

/// Parses and resolves `text` as the `zerotrain` command does; any result is fine.
fn parse_and_resolve(text: &str, overrides: Overrides) {
    if let Ok((config, keys)) = Config::parse_with::<AppKeys>(text, "fuzz") {
        let _ = config.resolve(overrides);
        let _ = keys.resolve();
    }
}

#[test]
fn generated_configs_resolve_or_fail_cleanly() {
    let (mut runner, cases) = runner();
    let config = vec((text(), value()), 0..10).prop_map(|kv| Value::Object(kv.into_iter().collect()));
    runner
        .run(&(config, overrides()), |(config, overrides)| {
            parse_and_resolve(&config.to_string(), overrides);
            Ok(())
        })
        .unwrap();
    println!("configs: {cases} generated cases, no panic");
}

#[test]
fn edits_of_a_config_with_every_section_resolve_or_fail_cleanly() {
    let base = full_config();
    assert!(
        Config::parse(&base.to_string(), "base").unwrap().resolve(Overrides::default()).is_ok(),
        "the base config resolves, so edits reach each section's rules"
    );
    let (mut runner, cases) = runner();
    let strategy = (vec((prop::sample::select(CONFIG_FIELDS), value()), 1..6), overrides());
    runner
        .run(&strategy, |(edits, overrides)| {
            let mut config = base.clone();
            for (pointer, replacement) in edits {
                if let Some(slot) = config.pointer_mut(pointer) {
                    *slot = replacement;
                }
            }
            parse_and_resolve(&config.to_string(), overrides);
            Ok(())
        })
        .unwrap();
    println!("structured configs: {cases} generated cases, no panic");
}

#[test]
fn byte_mutations_of_the_shipped_recipes_resolve_or_fail_cleanly() {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/configs");
    // The recipes (configs/models/ holds Hugging Face config.json presets, not recipes).
    let recipes: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "json"))
        .map(|p| std::fs::read_to_string(p).unwrap())
        .collect();
    let (mut runner, cases) = runner();
    let edit = (any::<prop::sample::Index>(), any::<u8>(), 0u8..3);
    let strategy = (prop::sample::select(recipes), vec(edit, 1..8), overrides());
    runner
        .run(&strategy, |(recipe, edits, overrides)| {
            let mut bytes = recipe.into_bytes();
            for (at, byte, kind) in edits {
                let i = at.index(bytes.len().max(1));
                match kind {
                    0 if !bytes.is_empty() => bytes[i] = byte,
                    1 => bytes.insert(i.min(bytes.len()), byte),
                    _ if !bytes.is_empty() => {
                        bytes.remove(i);
                    }
                    _ => {}
                }
            }
            parse_and_resolve(&String::from_utf8_lossy(&bytes), overrides);
            Ok(())
        })
        .unwrap();
    println!("recipe mutations: {cases} cases, no panic");
}

/// A real 2-shard checkpoint of 1000 elements, written once.
fn sample_checkpoint(root: &Path) -> Manifest {
    let partial = prepare(root, "global_step1").unwrap();
    for (rank, range) in [(0, 0u64..500), (1, 500..1000)] {
        let master: Vec<f32> = range.clone().map(|i| i as f32).collect();
        write_shard(&partial, rank, std::slice::from_ref(&range), &[("master", &master), ("optim.m", &master)])
            .unwrap();
    }
    let buffer_layout = vec![
        LayoutEntry { path: "bn.running_mean".into(), shape: vec![3], offset: 0 },
        LayoutEntry { path: "bn.running_var".into(), shape: vec![3], offset: 3 },
    ];
    let buffers = write_buffers(&partial, buffer_layout, &[0.0, 0.1, 0.2, 1.0, 1.1, 1.2]).unwrap();
    let manifest = Manifest {
        format_version: FORMAT_VERSION,
        tag: "global_step1".into(),
        global_step: 1,
        world_size: 2,
        stage: 2,
        precision: "fp32".into(),
        layout: vec![
            LayoutEntry { path: "w".into(), shape: vec![40, 20], offset: 0 },
            LayoutEntry { path: "b".into(), shape: vec![200], offset: 800 },
        ],
        tensors: vec!["master".into(), "optim.m".into()],
        files: vec![],
        buffers: Some(buffers),
        engine: serde_json::json!({}),
        config: serde_json::json!({}),
        client_state: serde_json::json!({}),
    };
    commit(root, manifest, None).unwrap();
    Checkpoint::open(root, None).unwrap().manifest().clone()
}

/// JSON pointers into a manifest whose values the generator replaces.
const MANIFEST_FIELDS: &[&str] = &[
    "/format_version",
    "/tag",
    "/global_step",
    "/world_size",
    "/stage",
    "/layout",
    "/layout/0/shape",
    "/layout/0/shape/0",
    "/layout/1/offset",
    "/layout/1/path",
    "/tensors",
    "/tensors/1",
    "/files",
    "/files/0/name",
    "/files/0/rank",
    "/files/0/start",
    "/files/1/end",
    "/files/0/size",
    "/files/1/block_bytes",
    "/files/0/block_crc32",
    "/buffers",
    "/buffers/layout/0/shape/0",
    "/buffers/layout/1/offset",
    "/buffers/layout/1/path",
    "/buffers/file/name",
    "/buffers/file/ranges/0/1",
    "/buffers/file/size",
    "/buffers/file/block_crc32",
    "/engine",
    "/client_state",
];

/// The manifest file for `value`, with a valid checksum (so that validation is reached).
fn manifest_bytes(value: &Value) -> Vec<u8> {
    let raw = value.to_string();
    format!(r#"{{"manifest":{raw},"crc32":{}}}"#, crc32fast::hash(raw.as_bytes())).into_bytes()
}

#[test]
fn hostile_manifests_load_and_consolidate_or_fail_cleanly() {
    let root = std::env::temp_dir().join(format!("zerotrain-fuzz-manifest-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    let base = serde_json::to_value(sample_checkpoint(&root)).unwrap();
    let manifest_path: PathBuf = root.join("global_step1/manifest.json");
    let out = root.join("out.safetensors");
    let (mut runner, cases) = runner();
    let strategy = vec((prop::sample::select(MANIFEST_FIELDS), value()), 1..4);
    runner
        .run(&strategy, |edits| {
            let mut manifest = base.clone();
            for (pointer, replacement) in edits {
                if let Some(slot) = manifest.pointer_mut(pointer) {
                    *slot = replacement;
                }
            }
            std::fs::write(&manifest_path, manifest_bytes(&manifest)).unwrap();
            if let Ok(ckpt) = Checkpoint::open(&root, Some("global_step1")) {
                let _ = ckpt.verify();
                let _ = zerotrain_checkpoint::consolidate(&ckpt, &out, Precision::Bf16);
            }
            Ok(())
        })
        .unwrap();
    std::fs::remove_dir_all(&root).unwrap();
    println!("manifests: {cases} generated cases, no panic");
}
