//! The `zerotrain` binary: exit codes and what it prints.

use std::process::{Command, Output};

fn zerotrain(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_zerotrain"))
        .args(args)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("run zerotrain")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// A config file in a fresh temporary directory.
fn temp_config(name: &str, json: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("zerotrain-cli-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("ds_config.json");
    std::fs::write(&path, json).unwrap();
    path
}

#[test]
fn config_check_prints_the_plan_and_exits_zero() {
    let out = zerotrain(&["config", "check", "configs/zero2.json", "--world-size", "4"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let stdout = text(&out.stdout);
    for needle in [
        "train_batch_size 32 = micro batch 8 x accumulation 1 x world size 4",
        "stage 2 (optimizer states and gradients sharded)",
        "parameters: full copy, gradients: 1/4 shard, optimizer state: 1/4 shard",
        r#""type":"Adam","lr":0.003,"betas":[0.9,0.95]"#,
        "global L2 norm <= 1",
    ] {
        assert!(stdout.contains(needle), "missing {needle:?} in:\n{stdout}");
    }
}

#[test]
fn config_check_json_is_machine_readable() {
    let out = zerotrain(&["config", "check", "tests/data/hf_trainer_zero3.json", "--world-size", "2", "--json"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let plan: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(plan["world_size"], 2);
    assert_eq!(plan["zero"]["stage"], 3);
    assert_eq!(plan["not_implemented"][0], "zero_optimization.offload_optimizer");
}

#[test]
fn config_check_errors_name_the_file_and_key_and_exit_nonzero() {
    let bad = temp_config(
        "bad-key",
        r#"{"train_batch_size": 8, "zero_optimization": {"stage": 2, "reduce_bucket_sise": 5e8}}"#,
    );
    let out = zerotrain(&["config", "check", bad.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(1));
    let stderr = text(&out.stderr);
    assert!(stderr.contains(bad.to_str().unwrap()), "{stderr}");
    assert!(
        stderr.contains("unknown key `zero_optimization.reduce_bucket_sise` (did you mean `reduce_bucket_size`?)"),
        "{stderr}"
    );
    assert!(!stderr.contains("panicked"), "{stderr}");

    let out = zerotrain(&["config", "check", "no/such/file.json"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(text(&out.stderr).contains("cannot read config no/such/file.json"), "{}", text(&out.stderr));

    let mismatch = temp_config("batch", r#"{"train_batch_size": 10, "train_micro_batch_size_per_gpu": 4}"#);
    let out = zerotrain(&["config", "check", mismatch.to_str().unwrap(), "--world-size", "2"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        text(&out.stderr).contains("train_batch_size (10) must equal train_micro_batch_size_per_gpu (4)"),
        "{}",
        text(&out.stderr)
    );
}

#[test]
fn train_runs_the_built_in_job_and_lowers_the_validation_loss() {
    let out = zerotrain(&["train", "--config", "configs/zero3.json", "--world-size", "3", "--steps", "40"]);
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{}\n{}", stdout, text(&out.stderr));
    assert!(stdout.contains("[Rank 0] step=40, skipped=0"), "{stdout}");
    let line = stdout.lines().find(|l| l.starts_with("validation loss")).expect("summary line");
    let numbers: Vec<f32> = line.split_whitespace().filter_map(|w| w.parse().ok()).collect();
    assert!(numbers[1] < numbers[0], "{line}");
}

#[test]
fn bench_convert_prints_every_conversion_beside_memcpy() {
    let out = zerotrain(&["bench", "convert", "--mib", "1", "--repeats", "1"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let stdout = text(&out.stdout);
    for op in ["memcpy f32", "f32 -> f16", "f16 -> f32", "f32 -> bf16", "bf16 -> f32"] {
        assert!(stdout.lines().any(|l| l.starts_with(op)), "missing {op}:\n{stdout}");
    }
    let out = zerotrain(&["bench", "convert", "--mib", "1", "--repeats", "1", "--json"]);
    let rows: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(rows.as_array().map(Vec::len), Some(5));
}
