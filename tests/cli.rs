//! The `zerotrain` binary: exit codes and what it prints.

use std::process::{Command, Output};

#[path = "cli/chat_data.rs"]
mod chat_data;
#[path = "cli/gpt_lora.rs"]
mod gpt_lora;
#[path = "cli/hf.rs"]
mod hf;
#[path = "cli/hosts.rs"]
mod hosts;
#[path = "cli/launch.rs"]
mod launch;
#[path = "cli/lease.rs"]
mod lease;
#[path = "common/metrics.rs"]
mod metrics;
#[path = "cli/parallel.rs"]
mod parallel;
#[path = "cli/peft_torch.rs"]
mod peft_torch;
#[path = "cli/servers.rs"]
mod servers;

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

/// A fresh, empty temporary directory of this test process named by `name`.
fn scratch(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("zerotrain-cli-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
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

/// What a user needs before training: a stage-3 config without activation checkpointing
/// says its peak stays near the whole model, and parameter groups are listed as resolved.
#[test]
fn config_check_explains_stage_3_without_checkpointing_and_lists_param_groups() {
    let config = temp_config(
        "groups",
        r#"{"train_batch_size": 8, "zero_optimization": {"stage": 3},
            "optimizer": {"type": "AdamW", "params": {"lr": 0.001, "weight_decay": 0.1}},
            "zerotrain": {"param_groups": [{"params": ["*.bias"], "weight_decay": 0},
                                           {"params": ["head.*"], "lr": 0.0005}]}}"#,
    );
    let out = zerotrain(&["config", "check", config.to_str().unwrap(), "--world-size", "2"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let stdout = text(&out.stdout);
    let line = |prefix: &str| stdout.lines().filter(|l| l.starts_with(prefix)).map(str::to_string).collect::<Vec<_>>();
    let checkpointing = line("activation ckpt");
    assert_eq!(checkpointing.len(), 1, "{stdout}");
    assert!(checkpointing[0].contains("off: at stage 3") && checkpointing[0].contains("activation_checkpointing"));
    // 0.0005 / 0.001: a group's lr is a scale of the scheduled lr.
    assert_eq!(
        line("  param group"),
        [
            "  param group       *.bias: lr x 1, weight_decay 0",
            "  param group       head.*: lr x 0.5, weight_decay 0.1"
        ],
        "{stdout}"
    );

    let on = temp_config(
        "groups-on",
        r#"{"train_batch_size": 8, "zero_optimization": {"stage": 3}, "activation_checkpointing": {}}"#,
    );
    let out = zerotrain(&["config", "check", on.to_str().unwrap(), "--world-size", "2"]);
    let stdout = text(&out.stdout);
    assert!(stdout.contains("activation ckpt     on:"), "{stdout}");
    assert!(!stdout.contains("param group"), "{stdout}");
}

#[test]
fn config_check_json_is_machine_readable() {
    let out = zerotrain(&["config", "check", "tests/data/hf_trainer_zero3.json", "--world-size", "2", "--json"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let plan: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(plan["runtime"]["world_size"], 2);
    assert_eq!(plan["zero"]["stage"], 3);
    assert_eq!(plan["zero"]["offload"]["optimizer"], "host");
    let notes = plan["notes"]["no_effect"].as_array().unwrap();
    assert!(
        notes.iter().any(|n| n.as_str().unwrap().starts_with("zero_optimization.offload_optimizer.device \"cpu\"")),
        "{notes:?}"
    );
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
    let out_dir = std::env::temp_dir().join(format!("zerotrain-cli-train-{}", std::process::id()));
    let out = zerotrain(&[
        "train",
        "--config",
        "configs/zero3.json",
        "--world-size",
        "3",
        "--steps",
        "40",
        "--out",
        out_dir.to_str().unwrap(),
    ]);
    let _ = std::fs::remove_dir_all(&out_dir);
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
    let ops = ["memcpy f32", "f32 -> f16", "f16 -> f32", "f32 -> bf16", "bf16 -> f32", "f32 -> bf16 (half)"];
    for op in ops {
        assert!(stdout.lines().any(|l| l.starts_with(&format!("{op} "))), "missing {op}:\n{stdout}");
    }
    let out = zerotrain(&["bench", "convert", "--mib", "1", "--repeats", "1", "--json"]);
    let rows: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(rows.as_array().map(Vec::len), Some(ops.len()));
}

/// `bench gpu --json` prints one object per row, a line each: plain Burn in fp32 and in the
/// engine's precision, then the engine at every stage and mode asked for, with
/// `--blocked-attention` plain Burn with the attention kernels off, and with
/// `--whole-logits` plain Burn's loss of the whole logits last; on the CPU (where this runs)
/// nothing crosses to a device.
#[test]
fn bench_gpu_prints_a_json_line_per_row_with_plain_burn_in_the_engines_precision() {
    let shape = ["--layers", "1", "--width", "16", "--heads", "2", "--context", "8", "--vocab", "13", "--batch", "2"];
    let mut args = vec!["bench", "gpu", "--device", "cpu", "--steps", "1", "--stages", "0,3", "--precision", "bf16"];
    args.extend(shape);
    args.extend(["--mode", "one-unit,checkpointed", "--blocked-attention", "--whole-logits", "--json"]);
    let out = zerotrain(&args);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let rows: Vec<serde_json::Value> =
        text(&out.stdout).lines().map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}"))).collect();
    let key = |r: &serde_json::Value| (r["precision"].clone(), r["stage"].clone(), r["mode"].clone());
    let expected = [
        ("fp32", None, None),
        ("bf16", None, None),
        ("bf16", Some(0), Some("one-unit")),
        ("bf16", Some(0), Some("checkpointed")),
        ("bf16", Some(3), Some("one-unit")),
        ("bf16", Some(3), Some("checkpointed")),
        ("bf16", None, None),
        ("bf16", None, None),
    ];
    let want: Vec<_> =
        expected.iter().map(|&(p, s, m)| (serde_json::json!(p), serde_json::json!(s), serde_json::json!(m))).collect();
    assert_eq!(rows.iter().map(key).collect::<Vec<_>>(), want);
    let last: Vec<_> = rows[rows.len() - 2..].iter().map(|r| r["what"].clone()).collect();
    assert_eq!(last, ["plain bf16 blocked attn", "plain bf16 whole logits"]);
    for row in &rows {
        assert!(row["tokens_per_s"].as_f64().is_some_and(|t| t > 0.0), "{row}");
        if row["stage"].is_u64() {
            assert_eq!(row["host_device"], serde_json::json!({"to_device": 0, "to_host": 0}), "{row}");
        }
    }
    // `--breakdown`: the table says its phases wait for the device, and has the engine rows;
    // `--recompute-units`: a recomputing row per value.
    let mut args =
        vec!["bench", "gpu", "--device", "cpu", "--steps", "1", "--stages", "0", "--mode", "units,checkpointed"];
    args.extend(shape);
    args.extend(["--breakdown", "--recompute-units", "0,1"]);
    let out = zerotrain(&args);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let table = text(&out.stdout);
    assert!(table.lines().next().is_some_and(|l| l.contains("phase times synchronised")), "{table}");
    let engine_rows: Vec<&str> =
        table.lines().filter(|l| l.starts_with("engine")).map(|l| l.split("  ").next().unwrap().trim()).collect();
    assert_eq!(engine_rows, ["engine 0 units", "engine 0 recompute 0", "engine 0 recompute 1"], "{table}");
}

/// `bench gpu --model` trains a Hugging Face family's model of a `config.json` (random
/// weights) the same way: a LLaMA with grouped-query attention here, every row measured and
/// named; a context past its positions and the built-in GPT's shape flags are refused.
#[test]
fn bench_gpu_times_a_hugging_face_family_of_a_config_file() {
    let config = temp_config(
        "bench-llama",
        r#"{"model_type": "llama", "hidden_size": 16, "intermediate_size": 24, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 40, "max_position_embeddings": 16}"#,
    );
    let config = config.to_str().unwrap();
    let common = ["bench", "gpu", "--device", "cpu", "--steps", "1", "--batch", "2", "--model", config];
    let mut args = common.to_vec();
    args.extend(["--context", "8", "--stages", "0,3", "--mode", "one-unit,units", "--json"]);
    let out = zerotrain(&args);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let rows: Vec<serde_json::Value> = text(&out.stdout).lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    let whats: Vec<&str> = rows.iter().map(|r| r["what"].as_str().unwrap()).collect();
    assert_eq!(whats, ["plain Burn fp32", "engine 0 1-unit", "engine 0 units", "engine 3 1-unit", "engine 3 units"]);
    // 6 x parameters x tokens per second: the parameters counted from the config by hand
    // (embedding and head 40 x 16 each, per layer q, o 16 x 16, k, v 16 x 8, the MLP
    // 3 x 16 x 24, two norms; the final norm).
    let params = 2.0 * 40.0 * 16.0 + 2.0 * (2.0 * 256.0 + 2.0 * 128.0 + 3.0 * 384.0 + 32.0) + 16.0;
    for row in &rows {
        assert_eq!(row["model"].as_str(), Some(format!("llama {config}").as_str()), "{row}");
        let (tokens, tflops) = (row["tokens_per_s"].as_f64().unwrap(), row["tflops"].as_f64().unwrap());
        assert!(tokens > 0.0 && (tflops - 6.0 * params * tokens / 1e12).abs() <= 1e-9 * tflops.max(1e-12), "{row}");
    }
    let mut args = common.to_vec();
    args.extend(["--context", "17"]);
    let out = zerotrain(&args);
    assert!(!out.status.success() && out.stdout.is_empty());
    assert!(text(&out.stderr).contains("--context 17 is longer than"), "{}", text(&out.stderr));
    let mut args = common.to_vec();
    args.extend(["--layers", "3"]);
    let out = zerotrain(&args);
    assert!(text(&out.stderr).contains("cannot be used with"), "{}", text(&out.stderr));
}

/// `bench gpu` refuses a stage or a precision it cannot run by its flag, before the table's
/// heading or any row (a stage past 3 was reported as the config key `zero_optimization.stage`
/// after the heading was printed).
#[test]
fn bench_gpu_refuses_a_bad_stage_or_precision_by_its_flag_before_printing() {
    for (flag, value, says) in [
        ("--stages", "0,7", "--stages: a ZeRO stage is 0, 1, 2 or 3, got 7"),
        ("--precision", "fp8", "invalid value 'fp8' for '--precision <PRECISION>'"),
    ] {
        let out = zerotrain(&["bench", "gpu", "--device", "cpu", "--steps", "1", flag, value]);
        let stderr = text(&out.stderr);
        assert!(!out.status.success(), "{flag} {value}: {stderr}");
        assert!(stderr.contains(says), "{flag} {value}: {stderr}");
        assert!(out.stdout.is_empty(), "{flag} {value} printed: {}", text(&out.stdout));
    }
}

/// `bench/gpu/verify.sh --only` refuses a part it does not have, and an unknown argument,
/// before it unpacks or runs anything (a misspelt part would spend a GPU lease on nothing),
/// naming the parts it has; no report is written.
#[test]
fn gpu_verify_refuses_an_unknown_part_by_name_before_running_anything() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let out = std::env::temp_dir().join(format!("zerotrain-cli-{}-verify", std::process::id()));
    std::fs::create_dir_all(&out).unwrap();
    for (args, says) in [
        (
            &["--only", "bench,bnch"][..],
            "no part named bnch (the parts: cuda,ranks,wgpu,bench,pytorch,compile,families,breakdown)",
        ),
        (&["--fast"][..], "unknown argument --fast"),
    ] {
        let run = Command::new("bash").arg(root.join("bench/gpu/verify.sh")).args(args).env("OUT", &out).output();
        let run = run.expect("run bash");
        let stderr = text(&run.stderr);
        assert_eq!(run.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(stderr.contains(says), "{args:?}: {stderr}");
        assert!(!out.join("report.md").exists(), "{args:?} wrote a report");
    }
    let _ = std::fs::remove_dir_all(&out);
}

fn copy_dir(from: &std::path::Path, to: &std::path::Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        let target = to.join(entry.file_name());
        if entry.file_type().unwrap().is_dir() {
            copy_dir(&entry.path(), &target);
        } else {
            std::fs::copy(entry.path(), target).unwrap();
        }
    }
}

/// SIGKILL at every crash point of a save (before, during and after each shard write,
/// around the manifest and both renames): afterwards `latest` always names a complete
/// checkpoint, the old one or the new one.
#[test]
#[cfg_attr(not(feature = "crash-points"), ignore = "needs `--features crash-points`, as the README's test command has")]
fn a_save_killed_at_any_point_leaves_latest_complete() {
    use std::io::BufRead;
    let base = std::env::temp_dir().join(format!("zerotrain-crash-base-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&base);
    let first = zerotrain(&[
        "train",
        "--config",
        "configs/zero2.json",
        "--steps",
        "1",
        "--out",
        base.to_str().unwrap(),
        "--save-every",
        "1",
    ]);
    assert!(first.status.success(), "{}", text(&first.stderr));
    let mut killed_at = Vec::new();
    for k in 1.. {
        let dir = std::env::temp_dir().join(format!("zerotrain-crash-{}-{k}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        copy_dir(&base, &dir);
        let mut child = Command::new(env!("CARGO_BIN_EXE_zerotrain"))
            .args(["train", "--config", "configs/zero2.json", "--steps", "2", "--save-every", "1", "--resume", "--out"])
            .arg(&dir)
            .current_dir(env!("CARGO_MANIFEST_DIR"))
            .env("ZEROTRAIN_CRASH_AT", k.to_string())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let stderr = std::io::BufReader::new(child.stderr.take().unwrap());
        let reached =
            stderr.lines().map_while(Result::ok).find(|l| l.starts_with(&format!("zerotrain: crash point {k} ")));
        let finished = reached.is_none();
        match reached {
            Some(line) => {
                child.kill().unwrap(); // SIGKILL
                child.wait().unwrap();
                killed_at.push(line);
            }
            None => {
                assert!(child.wait().unwrap().success(), "the uninterrupted save must succeed");
            }
        }
        let ckpt = zerotrain_checkpoint::Checkpoint::open(&dir.join("checkpoints"), None)
            .unwrap_or_else(|e| panic!("kill point {k}: {e}"));
        ckpt.verify().unwrap_or_else(|e| panic!("kill point {k}: {e}"));
        let step = ckpt.manifest().global_step;
        assert!(step == 1 || step == 2, "kill point {k}: latest is step {step}");
        // Rerunning after the kill resumes and finishes at step 2, whatever was left behind.
        let rerun = Command::new(env!("CARGO_BIN_EXE_zerotrain"))
            .args(["train", "--config", "configs/zero2.json", "--steps", "2", "--save-every", "1", "--resume", "--out"])
            .arg(&dir)
            .current_dir(env!("CARGO_MANIFEST_DIR"))
            .output()
            .unwrap();
        assert!(rerun.status.success(), "rerun after kill point {k}: {}", text(&rerun.stderr));
        assert_eq!(
            zerotrain_checkpoint::Checkpoint::open(&dir.join("checkpoints"), None).unwrap().manifest().global_step,
            2
        );
        std::fs::remove_dir_all(&dir).unwrap();
        if finished {
            assert_eq!(step, 2);
            break;
        }
    }
    std::fs::remove_dir_all(&base).unwrap();
    eprintln!("killed a save at {} points: {killed_at:#?}", killed_at.len());
    assert_eq!(killed_at.len(), 13, "2 ranks: prepare (2) + 2 shards (3 each) + commit (5) points");
}

#[test]
fn inspect_verifies_and_consolidate_exports() {
    let dir = std::env::temp_dir().join(format!("zerotrain-cli-ckpt-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let run = dir.to_str().unwrap();
    assert!(zerotrain(&["train", "--config", "configs/tiny.json", "--steps", "2", "--out", run]).status.success());
    let checkpoints = dir.join("checkpoints");
    let d = checkpoints.to_str().unwrap();
    let out = zerotrain(&["inspect", d, "--verify"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(text(&out.stdout).contains("every checksum matches"), "{}", text(&out.stdout));
    let file = dir.join("model.safetensors");
    let out = zerotrain(&["consolidate", d, "--out", file.to_str().unwrap(), "--dtype", "bf16"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let bytes = std::fs::read(&file).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    assert_eq!(st.tensor("token.weight").unwrap().dtype(), safetensors::Dtype::BF16);
    // Corrupt one byte of a shard: inspect --verify names the file and fails.
    let shard = checkpoints.join("global_step2/rank1.safetensors");
    let mut data = std::fs::read(&shard).unwrap();
    let middle = data.len() / 2;
    data[middle] ^= 1;
    std::fs::write(&shard, data).unwrap();
    let out = zerotrain(&["inspect", d, "--verify"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(text(&out.stderr).contains("rank1.safetensors: corrupted"), "{}", text(&out.stderr));
    let out = zerotrain(&["consolidate", d, "--out", file.to_str().unwrap(), "--dtype", "f8"]);
    assert!(text(&out.stderr).contains("--dtype must be f32, f16 or bf16"), "{}", text(&out.stderr));
    std::fs::remove_dir_all(&dir).unwrap();
}

fn temp_run(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("zerotrain-run-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

#[test]
fn train_writes_metrics_plot_and_checkpoints_and_resumes_at_the_right_step() {
    let dir = temp_run("e2e");
    let run = dir.to_str().unwrap();
    let out = zerotrain(&["train", "--config", "configs/tiny.json", "--steps", "6", "--out", run, "--save-every", "3"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let metrics = |dir: &std::path::Path| -> Vec<serde_json::Value> {
        let text = std::fs::read_to_string(dir.join("metrics.jsonl")).unwrap();
        text.lines().map(|l| serde_json::from_str(l).unwrap()).collect()
    };
    let lines = metrics(&dir);
    assert_eq!(lines.iter().map(|m| m["step"].as_u64().unwrap()).collect::<Vec<_>>(), [1, 2, 3, 4, 5, 6]);
    for m in &lines {
        for key in ["loss", "lr", "loss_scale", "grad_norm", "tokens_per_s", "skipped"] {
            assert!(m.get(key).is_some(), "{key} missing in {m}");
        }
    }
    assert!(lines.iter().filter_map(|m| m.get("val_loss")).all(|v| v.as_f64().unwrap().is_finite()));
    assert_eq!(lines.iter().filter(|m| m.get("val_loss").is_some()).count(), 3, "eval_every 2");
    let png = std::fs::read(dir.join("loss.png")).unwrap();
    assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n");
    assert!(png.len() > 10_000, "{} bytes", png.len());
    let ckpt = zerotrain_checkpoint::Checkpoint::open(&dir.join("checkpoints"), None).unwrap();
    ckpt.verify().unwrap();
    assert_eq!(ckpt.manifest().global_step, 6);
    let stdout = text(&out.stdout);
    assert!(stdout.contains("steps 0..6") && stdout.contains("samples from the trained model:"), "{stdout}");

    let out = zerotrain(&["train", "--config", "configs/tiny.json", "--steps", "9", "--out", run, "--resume"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(text(&out.stdout).contains("steps 6..9"), "{}", text(&out.stdout));
    assert!(text(&out.stdout).contains("[Rank 0] step=7,"), "resumed at step 7: {}", text(&out.stdout));
    let steps: Vec<u64> = metrics(&dir).iter().map(|m| m["step"].as_u64().unwrap()).collect();
    assert_eq!(steps, (1..=9).collect::<Vec<_>>());
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn estimate_reproduces_the_paper_and_deepspeeds_estimator() {
    let out = zerotrain(&["estimate", "--params", "7.5e9", "--world-size", "64", "--json"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let gb: Vec<f64> = v["zero_paper"].as_array().unwrap().iter().map(|r| r["total"].as_f64().unwrap() / 1e9).collect();
    for (got, want) in gb.iter().zip([120.0, 31.4, 16.6, 1.88]) {
        assert!((got - want).abs() <= 0.005 * want, "{gb:?}");
    }
    let out = zerotrain(&["estimate", "--params", "2851000000", "--world-size", "8", "--offload"]);
    let stdout = text(&out.stdout);
    assert!(stdout.contains("offload_optimizer=none  per GPU      12116750000 B"), "{stdout}");
    assert!(stdout.contains("offload_optimizer=cpu   per GPU       5702000000 B"), "{stdout}");
    let out = zerotrain(&["estimate", "--model-config", "configs/default.json", "--world-size", "2"]);
    assert!(text(&out.stderr).contains("model.vocab_size must be set"), "{}", text(&out.stderr));
    let model = temp_config(
        "estimate-model",
        r#"{"model": {"n_layer": 2, "n_embd": 64, "n_head": 4, "block_size": 32, "vocab_size": 13}}"#,
    );
    let out = zerotrain(&["estimate", "--model-config", model.to_str().unwrap(), "--world-size", "2", "--json"]);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["params"], 102_848, "the default job's GPT, as the engine counts it");
    // A Hugging Face family's config: GPT-2 small's published count, its largest layer the
    // token embedding (50257 x 768).
    let out = zerotrain(&["estimate", "--model-config", "configs/gpt2_scratch.json", "--world-size", "8"]);
    let stdout = text(&out.stdout);
    assert!(stdout.contains("124439808 parameters on 8 ranks"), "{stdout}{}", text(&out.stderr));
    assert!(stdout.contains("largest layer 38597376 parameters"), "{stdout}");
    // The same model from its Hugging Face config.json itself.
    let out = zerotrain(&["estimate", "--model-config", "configs/models/gpt2-small.json", "--world-size", "8"]);
    let hf = text(&out.stdout);
    assert!(hf.contains("124439808 parameters on 8 ranks") && hf.contains("largest layer 38597376"), "{hf}");
}

#[test]
fn bad_training_input_is_a_one_line_error() {
    let dir = temp_run("bad");
    std::fs::create_dir_all(&dir).unwrap();
    let empty = dir.join("empty.txt");
    std::fs::write(&empty, "").unwrap();
    let short = dir.join("short.txt");
    std::fs::write(&short, "hello world").unwrap();
    let bad_model = temp_config("bad-model", r#"{"train_batch_size": 2, "model": {"n_embd": 30, "n_head": 4}}"#);
    let run = dir.join("run");
    let cases: Vec<(Vec<&str>, &str)> = vec![
        (vec!["--data", "no/such/file.txt"], "cannot read data file no/such/file.txt"),
        (vec!["--data", dir.to_str().unwrap()], "cannot read data file"),
        (vec!["--data", empty.to_str().unwrap()], "the corpus is empty"),
        (vec!["--data", short.to_str().unwrap()], "context length 8 needs at least 90 characters"),
        (vec!["--resume"], "--resume: no checkpoint in"),
    ];
    for (extra, needle) in cases {
        let mut args = vec!["train", "--config", "configs/tiny.json", "--steps", "2", "--out", run.to_str().unwrap()];
        args.extend(extra);
        let out = zerotrain(&args);
        let stderr = text(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {stderr}");
        assert!(
            stderr.contains(needle) && stderr.trim().lines().count() == 1 && !stderr.contains("panicked"),
            "{args:?}: {stderr}"
        );
    }
    let out = zerotrain(&["train", "--config", bad_model.to_str().unwrap(), "--out", run.to_str().unwrap()]);
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1));
    assert!(stderr.contains("`model.n_embd`") && stderr.trim().lines().count() == 1, "{stderr}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn sigint_and_sigterm_finish_the_step_save_and_exit_cleanly() {
    for signal in ["INT", "TERM"] {
        stop_signal_finishes_the_step_saves_and_exits_cleanly(signal);
    }
}

fn stop_signal_finishes_the_step_saves_and_exits_cleanly(signal: &str) {
    use std::io::BufRead;
    let dir = temp_run(&format!("signal-{signal}"));
    let mut child = Command::new(env!("CARGO_BIN_EXE_zerotrain"))
        .args(["train", "--config", "configs/tiny.json", "--steps", "100000", "--out"])
        .arg(&dir)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let mut stdout = std::io::BufReader::new(child.stdout.take().unwrap()).lines();
    stdout.by_ref().map_while(Result::ok).find(|l| l.starts_with("[Rank 0] step=20,")).expect("training runs");
    let status = Command::new("kill").args([&format!("-{signal}"), &child.id().to_string()]).status().unwrap();
    assert!(status.success());
    let rest: Vec<String> = stdout.map_while(Result::ok).collect();
    assert!(child.wait().unwrap().success(), "exit 0 after SIG{signal}");
    let stopped = rest.iter().find(|l| l.starts_with("stopped by SIGINT/SIGTERM at step")).expect("a summary line");
    let step: u64 = stopped.split_whitespace().nth(5).unwrap().parse().unwrap();
    let ckpt = zerotrain_checkpoint::Checkpoint::open(&dir.join("checkpoints"), None).unwrap();
    assert_eq!(ckpt.manifest().global_step, step, "{stopped}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn bench_collectives_prints_every_op_and_world_size() {
    let out =
        zerotrain(&["bench", "collectives", "--max-mib", "1", "--world-sizes", "2,3", "--repeats", "1", "--json"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let rows: Vec<serde_json::Value> = serde_json::from_slice(&out.stdout).unwrap();
    // 4 KiB .. 1 MiB in 4x steps = 5 sizes, 3 ops, 2 world sizes.
    assert_eq!(rows.len(), 5 * 3 * 2);
    assert!(rows.iter().all(|r| r["busbw"].as_f64().unwrap() > 0.0 && r["backend"] == "threads"));
}

/// The README's first command, `cargo run -- train ...`, needs cargo to know which of the
/// package's binaries to run; a second binary once broke it. Cargo runs `default-run`
/// when there are several, so: every binary of the manifest (and `src/bin/`) is listed,
/// and if there is more than one, `default-run` names `zerotrain` (checked on the
/// manifest rather than by running cargo inside the test).
#[test]
fn cargo_run_picks_the_zerotrain_binary() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let manifest = std::fs::read_to_string(root.join("Cargo.toml")).unwrap();
    let mut bins: Vec<String> = manifest
        .split("[[bin]]")
        .skip(1)
        .filter_map(|section| {
            section.lines().find(|l| l.starts_with("name = ")).map(|l| l[7..].trim_matches('"').into())
        })
        .collect();
    if let Ok(dir) = std::fs::read_dir(root.join("src/bin")) {
        bins.extend(dir.filter_map(|e| Some(e.ok()?.path().file_stem()?.to_str()?.to_string())));
    }
    assert!(bins.contains(&"zerotrain".to_string()), "{bins:?}");
    let default_run = manifest.lines().find(|l| l.starts_with("default-run = ")).map(|l| l[14..].trim_matches('"'));
    assert!(bins.len() == 1 || default_run == Some("zerotrain"), "binaries {bins:?}, default-run {default_run:?}");
    assert_eq!(default_run, Some("zerotrain"), "keep it so when a binary is added");
}

#[test]
fn estimate_world_size_is_the_total_and_nodes_times_gpus_per_node_must_agree() {
    let json = |args: &[&str]| {
        let out = zerotrain(&[&["estimate", "--params", "7.5e9", "--json"], args].concat());
        assert!(out.status.success(), "{args:?}: {}", text(&out.stderr));
        serde_json::from_slice::<serde_json::Value>(&out.stdout).unwrap()
    };
    // Regression: `--world-size 64 --nodes 8` meant 512 ranks (64 per node).
    let total = json(&["--world-size", "64", "--nodes", "8"]);
    assert_eq!(total["ranks"], 64);
    assert_eq!(total["zero_paper"][3]["total"], 16 * 7_500_000_000u64 / 64, "stage 3 holds 16Ψ/N");
    assert_eq!(json(&["--gpus-per-node", "8", "--nodes", "8"]), total);
    assert_eq!(json(&["--world-size", "64", "--gpus-per-node", "8", "--nodes", "8"]), total);
    for (args, needle) in [
        (&["--world-size", "64", "--gpus-per-node", "4", "--nodes", "8"][..], "is not --nodes 8 x --gpus-per-node 4"),
        (&["--world-size", "60", "--nodes", "8"][..], "--world-size 60 does not divide over --nodes 8"),
        (&["--world-size", "0"][..], "at least 1"),
    ] {
        let out = zerotrain(&[&["estimate", "--params", "7.5e9"], args].concat());
        assert!(!out.status.success() && text(&out.stderr).contains(needle), "{args:?}: {}", text(&out.stderr));
    }
}

#[test]
fn the_command_tells_the_config_about_mpirun_and_the_library_refuses_a_plan_made_without_it() {
    // The command reads mpirun's environment and passes it to the (pure) resolution.
    let auto = temp_config("auto-backend", r#"{"train_micro_batch_size_per_gpu": 1, "zerotrain": {"world_size": 2}}"#);
    let auto = auto.to_str().unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_zerotrain"))
        .args(["config", "check", auto, "--json"])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .env("OMPI_COMM_WORLD_RANK", "0")
        .env("OMPI_COMM_WORLD_SIZE", "3")
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out.stderr));
    let plan: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!((plan["runtime"]["backend"].as_str(), plan["runtime"]["world_size"].as_u64()), (Some("mpi"), Some(3)));
    // The same file without that environment: threads, the file's world size.
    let plan: serde_json::Value =
        serde_json::from_slice(&zerotrain(&["config", "check", auto, "--json"]).stdout).unwrap();
    assert_eq!((plan["runtime"]["backend"].as_str(), plan["runtime"]["world_size"].as_u64()), (Some("auto"), Some(2)));
}

fn train_in(dir: &std::path::Path, steps: &str, resume: bool) -> Output {
    let dir = dir.to_str().unwrap();
    let mut args = vec!["train", "--config", "configs/tiny.json", "--steps", steps, "--out", dir];
    if resume {
        args.push("--resume");
    }
    zerotrain(&args)
}

fn entries(dir: &std::path::Path) -> Vec<String> {
    let mut names: Vec<String> =
        std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    names.sort();
    names
}

/// Regressions: training into a folder with checkpoints but without `--resume` reset
/// `latest` and moved the old checkpoint aside; two trainers on one folder corrupted each
/// other; with `latest` deleted, `--resume` said nothing was saved.
#[test]
fn a_used_run_folder_is_refused_without_resume_locked_in_use_and_resumable_without_latest() {
    let dir = temp_run("reuse");
    let ckpts = dir.join("checkpoints");
    assert!(train_in(&dir, "3", false).status.success());
    let before = entries(&ckpts);
    let latest = std::fs::read_to_string(ckpts.join("latest")).unwrap();

    let out = train_in(&dir, "5", false);
    let stderr = text(&out.stderr);
    assert!(!out.status.success() && stderr.contains("--resume") && stderr.contains("nothing was changed"), "{stderr}");
    assert_eq!(entries(&ckpts), before, "the earlier run's checkpoints are untouched");
    assert_eq!(std::fs::read_to_string(ckpts.join("latest")).unwrap(), latest);

    let held = std::fs::OpenOptions::new().write(true).open(dir.join(".zerotrain.lock")).unwrap();
    held.lock().unwrap();
    let out = train_in(&dir, "5", true);
    let stderr = text(&out.stderr);
    assert!(!out.status.success() && stderr.contains("in use by another zerotrain run"), "{stderr}");
    assert_eq!(entries(&ckpts), before);
    held.unlock().unwrap();

    std::fs::remove_file(ckpts.join("latest")).unwrap();
    let out = train_in(&dir, "5", true);
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    assert!(out.status.success(), "{stderr}");
    assert!(stderr.contains("no `latest`; resuming from the newest complete checkpoint, global_step3"), "{stderr}");
    assert!(stdout.contains("steps 3..5"), "{stdout}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Regressions from hostile input: overflowing and absurd sizes panicked or aborted on an
/// allocation, duplicate keys were accepted, endless files were read without bound, a
/// 10 MB unknown key took 30 s and was echoed whole, I/O causes printed twice.
#[test]
fn hostile_inputs_are_short_one_line_errors_never_panics_or_aborts() {
    let huge_key = format!(r#"{{"{}": 1}}"#, "k".repeat(10 << 20));
    let configs = [
        ("overflow", r#"{"train_micro_batch_size_per_gpu": 9223372036854775808, "zerotrain": {"world_size": 2}}"#),
        ("micro", r#"{"train_micro_batch_size_per_gpu": 1099511627776}"#),
        ("n-embd", r#"{"train_batch_size": 2, "model": {"n_embd": 4294967296, "n_head": 1}}"#),
        ("too-big", r#"{"train_batch_size": 2, "model": {"n_embd": 65536, "n_head": 1}}"#),
        ("duplicate", r#"{"train_batch_size": 2, "zero_optimization": {"stage": 1, "stage": 3}}"#),
        ("huge-key", huge_key.as_str()),
    ];
    let expected = [
        "batch sizes are inconsistent",
        "`train_micro_batch_size_per_gpu`: 1099511627776 is more than the 1048576",
        "model.n_embd is 4294967296, more than the built-in GPT's limit of 65536",
        "more than the built-in GPT's limit of 4294967296",
        "duplicate key `stage`",
        "unknown key `kkkk",
    ];
    for ((name, json), needle) in configs.iter().zip(expected) {
        let path = temp_config(&format!("hostile-{name}"), json);
        let out = zerotrain(&["config", "check", path.to_str().unwrap()]);
        let stderr = text(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{name}: {stderr}");
        assert!(stderr.contains(needle) && stderr.trim().lines().count() == 1, "{name}: {stderr}");
        assert!(stderr.len() < 1000, "{name}: a {} byte message", stderr.len());
    }
    let run = temp_run("hostile");
    let big_model =
        temp_config("hostile-memory", r#"{"train_batch_size": 2, "model": {"n_embd": 4096, "n_layer": 16}}"#);
    // A FIFO: its open would wait for a writer that never comes.
    let fifo = big_model.with_file_name("fifo.json");
    let _ = std::fs::remove_file(&fifo);
    assert!(std::process::Command::new("mkfifo").arg(&fifo).status().unwrap().success());
    // tokenize's training of a tokenizer reads its input.
    fn tokenize(input: &str) -> Vec<&str> {
        let mut args = vec!["tokenize", input, "--tokenizer", "/tmp/zt-never.json", "--train-vocab", "300"];
        args.extend(["--out", "/tmp/zt-never.tokens"]);
        args
    }
    let cases: Vec<(Vec<&str>, &str)> = vec![
        (vec!["config", "check", "/dev/zero"], "a device, not a regular file: refused"),
        (vec!["config", "check", fifo.to_str().unwrap()], "a FIFO, not a regular file: refused"),
        (vec!["config", "check", "configs/tiny.json", "--world-size", "20000"], "20000 thread ranks is more than"),
        (
            vec!["train", "--config", "configs/tiny.json", "--data", "/dev/zero"],
            "a device, not a regular file: refused",
        ),
        (
            vec!["train", "--config", "configs/tiny.json", "--data", fifo.to_str().unwrap()],
            "a FIFO, not a regular file",
        ),
        (tokenize(fifo.to_str().unwrap()), "a FIFO, not a regular file"),
        (tokenize("/dev/zero"), "a device, not a regular file"),
        // Fine-tuning rows are read the same way.
        (
            vec![
                "tokenize",
                fifo.to_str().unwrap(),
                "--tokenizer",
                "/tmp/zt-never.json",
                "--format",
                "messages",
                "--out",
                "/tmp/zt-never.tokens",
            ],
            "a FIFO, not a regular file",
        ),
        (vec!["train", "--config", "configs/tiny.json", "--out", "/proc/zerotrain"], "cannot create /proc/zerotrain"),
        (vec!["train", "--config", big_model.to_str().unwrap(), "--world-size", "2"], "of memory is available"),
        (vec!["train", "--config", "configs/tiny.json", "--data", "no/such/file"], "No such file or directory"),
    ];
    for (args, needle) in cases {
        let mut args = args;
        if args[0] == "train" && !args.contains(&"--out") {
            args.extend(["--out", run.to_str().unwrap()]);
        }
        let out = zerotrain(&args);
        let stderr = text(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {stderr}");
        assert!(stderr.contains(needle) && stderr.trim().lines().count() == 1, "{args:?}: {stderr}");
        assert_eq!(stderr.matches(needle).count(), 1, "{args:?}: the cause is printed once: {stderr}");
    }
    let _ = std::fs::remove_dir_all(&run);
}

/// The pipeline recipe: `config check` names each stage's units and the bubble; the job
/// trains on 2 stages, and its checkpoint resumes without a pipeline (configs/zero1.json
/// trains the same GPT shape).
#[test]
fn the_pipeline_recipe_checks_trains_and_resumes_without_the_pipeline() {
    let out = zerotrain(&["config", "check", "configs/pipeline.json", "--steps", "20"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let stdout = text(&out.stdout);
    for needle in [
        "pipeline            2 stages x 1 data-parallel rank(s), schedule 1f1b",
        "bubble            (K-1)/(M+K-1) = 1/5 = 20.0%",
        "stage 0           embed, blocks.0 (51968 parameters)",
        "stage 1           blocks.1, head (50048 parameters)",
        "the root: the tied token embedding",
    ] {
        assert!(stdout.contains(needle), "missing {needle:?} in:\n{stdout}");
    }
    let dir = temp_run("pipeline");
    let run = dir.to_str().unwrap();
    let out = zerotrain(&["train", "--config", "configs/pipeline.json", "--steps", "8", "--out", run]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(text(&out.stdout).contains("steps 0..8"), "{}", text(&out.stdout));
    let ckpt = zerotrain_checkpoint::Checkpoint::open(&dir.join("checkpoints"), None).unwrap();
    assert_eq!((ckpt.manifest().global_step, ckpt.manifest().world_size), (8, 2));
    let out = zerotrain(&["train", "--config", "configs/zero1.json", "--steps", "10", "--out", run, "--resume"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(text(&out.stdout).contains("steps 8..10"), "{}", text(&out.stdout));
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `bench offload` runs end to end on a small range: the NVMe step reads and writes 12
/// bytes per element each way (bf16 training: fp32 masters and Adam's two moments), its
/// swap folder is left empty, and every figure is a positive rate.
#[test]
fn bench_offload_measures_the_tiers_and_leaves_no_swap_files() {
    let dir = std::env::temp_dir().join(format!("zerotrain-cli-{}-bench-offload", std::process::id()));
    let out = zerotrain(&[
        "bench",
        "offload",
        "--millions",
        "1",
        "--tile-millions",
        "1",
        "--repeats",
        "1",
        "--json",
        "--nvme",
        dir.to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let r: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(r["elems"], 1_000_000);
    assert_eq!(r["nvme_step_bytes"], 2 * 12 * 1_000_000);
    for key in ["memcpy_gb_s", "host_adam_gb_s", "burn_adam_s", "disk_write_gb_s", "disk_read_gb_s", "nvme_step_s"] {
        assert!(r[key].as_f64().is_some_and(|v| v > 0.0 && v.is_finite()), "{key}: {}", r[key]);
    }
    let swap = dir.join("zerotrain-bench.rank0");
    let left: Vec<_> = std::fs::read_dir(&swap)
        .unwrap()
        .flatten()
        .filter(|e| e.path().extension().is_some_and(|x| x == "swap"))
        .collect();
    assert!(left.is_empty(), "swap files left in {}", swap.display());
    let _ = std::fs::remove_dir_all(&dir);
}

/// `estimate` gives DeepSpeed's ZeRO-3 estimator's figures (DeepSpeed 0.19.8's own values
/// for 2.851B parameters, a 1e8-parameter largest layer, 8 GPUs: see
/// `bench/reference/deepspeed_traces.json`), and asks for the largest layer when it lacks it.
#[test]
fn estimate_shows_deepspeeds_zero3_figures_with_offload() {
    let args = ["estimate", "--params", "2.851e9", "--world-size", "8", "--offload", "--json"];
    let out = zerotrain(&[&args[..], &["--largest-layer-params", "1e8"]].concat());
    assert!(out.status.success(), "{}", text(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let rows = v["deepspeed_zero3"].as_array().unwrap();
    let got: Vec<(u64, u64, u64)> = rows
        .iter()
        .map(|r| {
            let n = |k: &str| r[k].as_u64().unwrap();
            (n("per_gpu_bytes"), n("per_cpu_bytes_zero_init"), n("per_cpu_bytes"))
        })
        .collect();
    assert_eq!(
        got,
        [
            (6_814_750_000, 4_800_000_000, 136_848_000_000),
            (1_112_750_000, 68_424_000_000, 136_848_000_000),
            (400_000_000, 76_977_000_000, 136_848_000_000)
        ]
    );
    let out = zerotrain(&args[..5]);
    assert!(out.status.success());
    assert!(text(&out.stdout).contains("needs the largest layer"), "{}", text(&out.stdout));
}

/// A job training with its optimizer and parameters on NVMe, SIGKILLed in the middle of
/// its second save, leaves stale swap files behind; the rerun removes them, resumes from the
/// last checkpoint and trains the remaining steps exactly as the uninterrupted job did.
#[test]
#[cfg_attr(not(feature = "crash-points"), ignore = "needs `--features crash-points`, as the README's test command has")]
fn a_killed_nvme_job_resumes_as_if_uninterrupted() {
    use std::io::BufRead;
    let root = std::env::temp_dir().join(format!("zerotrain-cli-{}-nvme-kill", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    let swap = root.join("swap");
    let recipe = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/configs/zero3_nvme.json")).unwrap();
    let config =
        temp_config("nvme-kill", &recipe.replace("\"runs/swap\"", &format!("{:?}", swap.display().to_string())));
    let train = |out: &std::path::Path, resume: bool| {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_zerotrain"));
        cmd.args(["train", "--config", config.to_str().unwrap(), "--steps", "4", "--save-every", "2"])
            .args(resume.then_some("--resume"))
            .arg("--out")
            .arg(out)
            .current_dir(env!("CARGO_MANIFEST_DIR"));
        cmd
    };
    let losses = |out: &std::path::Path| -> Vec<String> {
        let text = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
        let lines = text.lines().map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap());
        lines
            .filter(|v| v["step"].as_u64().is_some_and(|s| s > 2))
            .map(|v| format!("{}:{}", v["step"], v["loss"]))
            .collect()
    };
    let whole = root.join("whole");
    let out = train(&whole, false).output().unwrap();
    assert!(out.status.success(), "{}", text(&out.stderr));
    // Stage 3 with its parameters on NVMe: no samples by default (they would gather the
    // whole model on rank 0), and the summary says why and how to get them.
    let stdout = text(&out.stdout);
    assert!(!stdout.lines().any(|l| l.starts_with("samples from the trained model:")), "{stdout}");
    assert!(
        stdout.contains("no samples from the trained model: stage 3 keeps the parameters' shards on NVMe"),
        "{stdout}"
    );

    let killed = root.join("killed");
    // Two ranks: 13 crash points per save; 16 is inside the second (step 4) save.
    let mut child = train(&killed, false)
        .env("ZEROTRAIN_CRASH_AT", "16")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let stderr = std::io::BufReader::new(child.stderr.take().unwrap());
    let reached = stderr.lines().map_while(Result::ok).find(|l| l.starts_with("zerotrain: crash point 16 "));
    assert!(reached.is_some(), "the job reached its second save");
    child.kill().unwrap(); // SIGKILL
    child.wait().unwrap();
    let stale = |rank: usize| {
        let dir = swap.join(format!("zerotrain-optimizer.rank{rank}"));
        std::fs::read_dir(dir).unwrap().flatten().filter(|e| e.path().extension().is_some_and(|x| x == "swap")).count()
    };
    assert!(stale(0) > 0 && stale(1) > 0, "the killed job left its swap files");
    let rerun = train(&killed, true).arg("--samples").arg("on").output().unwrap();
    assert!(rerun.status.success(), "{}", text(&rerun.stderr));
    // Asked for, they are written: completions of held-out sums, each with its verdict.
    let stdout = text(&rerun.stdout);
    let samples = stdout.split("samples from the trained model:\n").nth(1).unwrap_or_default();
    assert_eq!(samples.lines().filter(|l| l.contains("; expected ")).count(), 8, "{stdout}");
    assert_eq!(stale(0) + stale(1), 0, "swap files are scratch: none outlive the job");
    let (got, want) = (losses(&killed), losses(&whole));
    // The killed job logged steps 3-4 before its save; the rerun logs them again from step 2.
    assert_eq!(got[got.len() - 2..], want[..], "steps 3-4 after the resume");
    let _ = std::fs::remove_dir_all(&root);
}

/// `bench offload-gpt` trains the same seeded GPT with its states on NVMe and in memory to
/// the same losses (the headline's correctness, on a model that fits), the loss on its
/// repeated batch falls, and the report's swap traffic is the tiers' sizes: the first step
/// reads the bf16 parameter shards twice (forward and recomputation: 2 x 2 bytes per
/// parameter) and the masters (4; no moments exist yet), and writes masters, both moments
/// and the new shards (4 + 8 + 2 bytes per parameter).
#[test]
fn bench_offload_gpt_trains_the_same_on_nvme_as_in_memory() {
    let dir = std::env::temp_dir().join(format!("zerotrain-cli-{}-offload-gpt", std::process::id()));
    let run = |nvme: bool| -> serde_json::Value {
        let mut args = vec!["bench", "offload-gpt", "--layers", "2", "--width", "128", "--tokens", "8", "--steps", "3"];
        args.extend(["--lr", "1e-3", "--json"]);
        let path = dir.display().to_string();
        if nvme {
            args.extend(["--nvme", &path]);
        }
        let out = zerotrain(&args);
        assert!(out.status.success(), "{}", text(&out.stderr));
        serde_json::from_slice(&out.stdout).unwrap()
    };
    let (swapped, in_memory) = (run(true), run(false));
    let losses = |r: &serde_json::Value| -> Vec<f64> {
        r["steps"].as_array().unwrap().iter().map(|s| s[0].as_f64().unwrap()).collect()
    };
    assert_eq!(losses(&swapped), losses(&in_memory));
    let l = losses(&swapped);
    assert!(l[2] < l[0], "the loss on the repeated batch falls: {l:?}");
    let params = swapped["params"].as_u64().unwrap();
    let first = &swapped["steps"][0];
    // Direct I/O moves whole 4 KiB pages: each file of each unit rounds up.
    let (read, written) = (first[2].as_u64().unwrap(), first[3].as_u64().unwrap());
    assert!(read >= 8 * params && read < 8 * params + (1 << 20), "read {read} for {params} parameters");
    assert!(written >= 14 * params && written < 14 * params + (1 << 20), "wrote {written} for {params} parameters");
    assert_eq!(in_memory["steps"][0][2], 0);
    let _ = std::fs::remove_dir_all(&dir);
}

/// `zerotrain train` under a `local_sgd` section trains replica groups: the metrics count
/// the rounds (one every `sync_every` steps), the round steps move the shard among groups
/// on top of the group's own traffic, `config check` describes the groups, and a resume
/// continues the rounds' cadence from the checkpoint.
#[test]
fn train_runs_replica_groups_and_its_metrics_count_the_rounds() {
    let dir = temp_run("groups");
    std::fs::create_dir_all(&dir).unwrap();
    let config = dir.join("groups.json");
    let tiny = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/configs/tiny.json")).unwrap();
    let json =
        tiny.replacen('{', r#"{ "local_sgd": {"groups": 2, "sync_every": 2, "outer_optimizer": {"type": "sgd"}},"#, 1);
    std::fs::write(&config, json).unwrap();
    let check = zerotrain(&["config", "check", config.to_str().unwrap()]);
    assert!(check.status.success(), "{}", text(&check.stderr));
    let described = text(&check.stdout);
    assert!(
        described.contains("replica groups      2 groups of 1 rank(s)") && described.contains("per round"),
        "{described}"
    );
    let run = dir.join("run");
    let out =
        zerotrain(&["train", "--config", config.to_str().unwrap(), "--steps", "6", "--out", run.to_str().unwrap()]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let text_lines = std::fs::read_to_string(run.join("metrics.jsonl")).unwrap();
    let lines: Vec<serde_json::Value> = text_lines.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    let rounds: Vec<u64> = lines.iter().map(|m| m["rounds"].as_u64().unwrap()).collect();
    assert_eq!(rounds, [0, 1, 1, 2, 2, 3]);
    let bytes: Vec<u64> = lines.iter().map(|m| m["comm_bytes"].as_u64().unwrap()).collect();
    // Groups of one rank: only the rounds move anything.
    assert!(bytes[0] == 0 && bytes[2] == 0 && bytes[1] > 0 && bytes[1] == bytes[3], "{bytes:?}");
    let out = zerotrain(&[
        "train",
        "--config",
        config.to_str().unwrap(),
        "--steps",
        "8",
        "--out",
        run.to_str().unwrap(),
        "--resume",
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let text_lines = std::fs::read_to_string(run.join("metrics.jsonl")).unwrap();
    let last: serde_json::Value = serde_json::from_str(text_lines.lines().last().unwrap()).unwrap();
    assert_eq!((last["step"].as_u64(), last["rounds"].as_u64()), (Some(8), Some(1)), "rounds restart at a resume");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Replica groups as separate jobs: `zerotrain serve` runs the parameter server, two
/// `zerotrain train` processes (one group each, loopback) meet there every 2 steps and end
/// with the same weights (the same final validation loss); a job whose server does not
/// answer ends within its timeout with an error naming the address.
#[test]
fn groups_as_separate_processes_meet_at_a_parameter_server() {
    let dir = temp_run("servers");
    std::fs::create_dir_all(&dir).unwrap();
    let tiny = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/configs/tiny.json")).unwrap();
    let config = |name: &str, section: &str| {
        let path = dir.join(name);
        let json = tiny.replacen('{', &format!(r#"{{ "local_sgd": {section},"#), 1).replace(
            r#""zerotrain": { "world_size": 2, "eval_every": 2 }"#,
            r#""zerotrain": { "world_size": 1, "eval_every": 2, "comm_timeout_s": 30 }"#,
        );
        std::fs::write(&path, json).unwrap();
        path
    };
    // Port 0 is not knowable in advance: the server prints the address it took. It reads
    // any group's config (its servers and group do not matter to it).
    let server_config =
        config("server.json", r#"{"groups": 2, "sync_every": 2, "servers": ["127.0.0.1:0"], "group": 0}"#);
    let mut server = Command::new(env!("CARGO_BIN_EXE_zerotrain"))
        .args(["serve", "--listen", "127.0.0.1:0", "--config", server_config.to_str().unwrap()])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    std::io::BufRead::read_line(&mut std::io::BufReader::new(server.stdout.take().unwrap()), &mut line).unwrap();
    let addr = line.trim().rsplit(' ').next().unwrap().to_string();
    assert!(line.contains("listening on 127.0.0.1:"), "{line}");
    let jobs: Vec<_> = (0..2)
        .map(|group| {
            let section = format!(r#"{{"groups": 2, "sync_every": 2, "servers": ["{addr}"], "group": {group}}}"#);
            let path = config(&format!("group{group}.json"), &section);
            let out = dir.join(format!("run{group}"));
            Command::new(env!("CARGO_BIN_EXE_zerotrain"))
                .args(["train", "--config", path.to_str().unwrap(), "--steps", "4", "--out", out.to_str().unwrap()])
                .current_dir(env!("CARGO_MANIFEST_DIR"))
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    let outs: Vec<_> = jobs.into_iter().map(|j| j.wait_with_output().unwrap()).collect();
    let _ = server.kill();
    let _ = server.wait();
    let mut finals = Vec::new();
    for (group, out) in outs.iter().enumerate() {
        assert!(out.status.success(), "group {group}: {}", text(&out.stderr));
        let metrics = std::fs::read_to_string(dir.join(format!("run{group}")).join("metrics.jsonl")).unwrap();
        let last: serde_json::Value = serde_json::from_str(metrics.lines().last().unwrap()).unwrap();
        assert_eq!(last["rounds"].as_u64(), Some(2), "group {group}: {last}");
        finals.push(last["val_loss"].as_f64().unwrap());
    }
    assert_eq!(finals[0], finals[1], "after the last round both groups hold the global weights");

    let lost =
        config("lost.json", r#"{"groups": 2, "servers": ["127.0.0.1:9"], "group": 0}"#).to_str().unwrap().to_owned();
    let json = std::fs::read_to_string(&lost).unwrap().replace(r#""comm_timeout_s": 30"#, r#""comm_timeout_s": 2"#);
    std::fs::write(&lost, json).unwrap();
    let out = zerotrain(&["train", "--config", &lost, "--steps", "2", "--out", dir.join("lost").to_str().unwrap()]);
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("127.0.0.1:9") && stderr.contains("does not answer") && !stderr.contains("panicked"),
        "{stderr}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Regressions from issue 50's hostile sizes and a newcomer's frictions: `estimate` of
/// absurd parameter counts is refused (2e19 overflowed a multiply) and a `config.json` of
/// 2^24 layers is sized from its shape in a moment (building it took 25 GB); `tokenize
/// --train-vocab 2^40` is refused (the trainer allocated by it); `tokenize --out` naming
/// its input is refused and the text survives; `train --steps 0` saves the model it
/// starts from, as the path it prints says.
#[test]
fn absurd_sizes_are_refused_and_a_run_of_no_steps_saves_its_start() {
    for params in ["2e19", "1e300"] {
        let out = zerotrain(&["estimate", "--params", params, "--world-size", "8"]);
        let err = text(&out.stderr);
        assert!(out.status.code() == Some(1) && err.contains("is no model any machine holds"), "{params}: {err}");
    }
    let huge = temp_config(
        "huge-layers",
        r#"{"model_type": "llama", "hidden_size": 16, "intermediate_size": 24, "num_hidden_layers": 16777216,
            "num_attention_heads": 2, "vocab_size": 100, "tie_word_embeddings": false}"#,
    );
    let out = zerotrain(&["estimate", "--model-config", huge.to_str().unwrap(), "--world-size", "8", "--json"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    // Per layer: 2 norms of 16, q/k/v/o of 16 x 16, gate/up/down of 16 x 24; then the
    // embedding, the final norm and the untied head.
    let layer = 2 * 16 + 4 * 16 * 16 + 3 * 16 * 24;
    assert_eq!(json["params"], 16777216u64 * layer + 100 * 16 + 16 + 100 * 16, "{json}");

    let dir = temp_run("frictions");
    std::fs::create_dir_all(&dir).unwrap();
    let textfile = dir.join("text.txt");
    std::fs::write(&textfile, "the rank holds a shard\n\n".repeat(50)).unwrap();
    let tokenizer = dir.join("tokenizer.json");
    let tokenize = |out: &std::path::Path, vocab: &str| {
        zerotrain(&[
            "tokenize",
            textfile.to_str().unwrap(),
            "--tokenizer",
            tokenizer.to_str().unwrap(),
            "--train-vocab",
            vocab,
            "--out",
            out.to_str().unwrap(),
        ])
    };
    let out = tokenize(&dir.join("t.tokens"), "1099511627776");
    assert!(text(&out.stderr).contains("at most 16777216 tokens"), "{}", text(&out.stderr));
    let out = tokenize(&dir.join(".").join("text.txt"), "300");
    assert!(!out.status.success() && text(&out.stderr).contains("is an input"), "{}", text(&out.stderr));
    assert_eq!(std::fs::read_to_string(&textfile).unwrap(), "the rank holds a shard\n\n".repeat(50));

    let run = dir.join("run");
    let out = zerotrain(&["train", "--config", "configs/tiny.json", "--steps", "0", "--out", run.to_str().unwrap()]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let latest = std::fs::read_to_string(run.join("checkpoints").join("latest")).unwrap();
    assert_eq!(latest.trim(), "global_step0");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A count past what a flag takes is refused by name, before anything runs (`generate
/// --tokens 2^64 - 1` overflowed adding the prompt's length and panicked).
#[test]
fn counts_past_a_flags_range_are_refused_naming_the_flag() {
    let out =
        zerotrain(&["generate", "--config", "configs/tiny.json", "--prompt", "a", "--tokens", "18446744073709551615"]);
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("--tokens") && !stderr.contains("panicked"), "{stderr}");
}

/// `config check` refuses the mesh plans `train` refuses, by the same field, and exits
/// non-zero (it printed them as "1/3 of its attention heads" and exited 0): heads of the
/// built-in GPT that do not divide over tp 3; a family's kv heads over tp 2, MLP width over
/// tp 2, context over sp 2 and over sp 32; a `model.hf_dir` that does not exist.
#[test]
fn config_check_refuses_what_train_refuses_on_a_mesh() {
    let llama = |extra: &str| {
        format!(
            r#"{{"model_type": "llama", "hidden_size": 16, "intermediate_size": 24, "num_hidden_layers": 1,
                "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 64 {extra}}}"#
        )
    };
    let hf = |name: &str, model: &str, mesh: &str, block: usize| {
        let config = temp_config(&format!("mesh-check-{name}"), "{}");
        std::fs::write(config.with_file_name("model.json"), model).unwrap();
        let json = format!(
            r#"{{"train_batch_size": 2, {mesh}, "model": {{"hf_config": "model.json", "block_size": {block}}}}}"#
        );
        std::fs::write(&config, json).unwrap();
        config
    };
    let tp2 = r#""tensor_parallel": {"autotp_size": 2}, "zerotrain": {"world_size": 2}"#;
    let sp = |n: usize| format!(r#""zerotrain": {{"world_size": {n}, "mesh": {{"sp": {n}}}}}"#);
    let builtin = temp_config(
        "mesh-check-builtin",
        r#"{"train_batch_size": 3, "model": {"n_head": 4}, "tensor_parallel": {"autotp_size": 3}, "zerotrain": {"world_size": 3}}"#,
    );
    let no_folder =
        temp_config("mesh-check-folder", r#"{"train_batch_size": 2, "model": {"hf_dir": "no/such/folder"}}"#);
    let cases = [
        (builtin, "model.n_head (4) does not divide by the tensor- times the sequence-parallel size 3 x 1"),
        (
            hf("kv", &llama("").replace(r#""num_key_value_heads": 2"#, r#""num_key_value_heads": 1"#), tp2, 8),
            "`num_key_value_heads` (1) does not divide",
        ),
        (hf("mlp", &llama("").replace("24", "47"), tp2, 8), "`intermediate_size` (47) does not divide"),
        (hf("sp2", &llama(""), &sp(2), 15), "a context of 15 tokens does not divide by zerotrain.mesh.sp 2"),
        (hf("sp32", &llama(""), &sp(32), 16), "does not divide"),
        (no_folder, "no/such/folder"),
    ];
    for (config, said) in cases {
        let out = zerotrain(&["config", "check", config.to_str().unwrap()]);
        let stderr = text(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{}: {stderr}", config.display());
        assert!(stderr.contains(said), "{}: {stderr}", config.display());
    }
}
