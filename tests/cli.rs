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
        let ckpt = zerotrain_checkpoint::Checkpoint::open(&dir, None).unwrap_or_else(|e| panic!("kill point {k}: {e}"));
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
        assert_eq!(zerotrain_checkpoint::Checkpoint::open(&dir, None).unwrap().manifest().global_step, 2);
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
    let d = dir.to_str().unwrap();
    assert!(zerotrain(&["train", "--config", "configs/zero3.json", "--steps", "2", "--out", d]).status.success());
    let out = zerotrain(&["inspect", d, "--verify"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(text(&out.stdout).contains("every checksum matches"), "{}", text(&out.stdout));
    let file = dir.join("model.safetensors");
    let out = zerotrain(&["consolidate", d, "--out", file.to_str().unwrap(), "--dtype", "bf16"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let bytes = std::fs::read(&file).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    assert_eq!(st.tensor("input.weight").unwrap().dtype(), safetensors::Dtype::BF16);
    // Corrupt one byte of a shard: inspect --verify names the file and fails.
    let shard = dir.join("global_step2/rank1.safetensors");
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
