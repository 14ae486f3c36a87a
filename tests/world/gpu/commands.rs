//! The commands on the device:
//! - `zerotrain bench gpu` in each half precision: where the device computes in it, every
//!   row is measured (plain Burn in fp32 and in it, then the engine); where it does not
//!   (wgpu has no bf16), the bench is refused by its flag before any row. Before, the plain
//!   half-precision row ran kernels the device cannot compile: they panicked in the device's
//!   own thread, once per kernel, and the row was printed with a time as if measured.
//! - `zerotrain train` on the device says, for each rank, the bytes of model states the
//!   engine copied between host memory and its device over the run: none where the states
//!   live on the device, some where the optimizer is offloaded to the CPU.
//! - `zerotrain generate` on the config's device, in its compute dtype. Before, a model
//!   from `model.hf_dir` or `model.hf_config` was sampled on the CPU in f32 whatever
//!   `zerotrain.device` and `bf16.enabled` said.

use std::path::Path;
use std::process::{Command, Output};
use std::sync::Mutex;

use burn::tensor::DType;
use zerotrain::config::ComputeDevice;
use zerotrain_cli::bench::RunMode;
use zerotrain_cli::bench::gpu::{BenchModel, GpuBench};
use zerotrain_models::GptConfig;

use super::{Gpu, device_alone};

pub fn bench_in_half_precision_measures_every_row_or_refuses_before_the_first(on: Gpu) {
    let _alone = device_alone();
    let device = match on.name {
        "wgpu" => ComputeDevice::Wgpu,
        "cuda" => ComputeDevice::Cuda,
        other => panic!("no ComputeDevice for {other}"),
    };
    let shape = GptConfig { n_layer: 1, n_head: 2, n_embd: 16, block_size: 8, vocab_size: 13, tied_head: true };
    for (precision, dtype) in [("bf16", DType::BF16), ("fp16", DType::F16)] {
        let supported = (on.device)().supports_dtype(dtype);
        let bench = GpuBench {
            model: BenchModel::Builtin(shape),
            device,
            batch: 2,
            steps: 1,
            stages: vec![0],
            precision: precision.into(),
            modes: vec![RunMode::Units],
            recompute_units: Vec::new(),
            peak_tflops: 1.0,
            breakdown: false,
            blocked_attention: false,
            whole_logits: false,
        };
        let rows = Mutex::new(Vec::new());
        let result = bench.run(|row| rows.lock().unwrap().push(row.what.clone()));
        let rows = rows.into_inner().unwrap();
        eprintln!("{precision} on {}: supported {supported}, rows {rows:?}", on.name);
        if supported {
            assert!(result.is_ok(), "{precision}: {}", result.err().map(|e| e.to_string()).unwrap_or_default());
            let plain_half = format!("plain Burn {precision}");
            assert_eq!(rows, ["plain Burn fp32", plain_half.as_str(), "engine 0 units"]);
        } else {
            let error = result.err().map(|e| e.to_string()).unwrap_or_default();
            let says = format!("this {} device cannot compute in {precision}", on.name);
            assert!(error.contains("`--precision`") && error.contains(&says), "{precision}: {error:?}");
            assert!(rows.is_empty(), "{precision}: rows measured before the refusal: {rows:?}");
        }
    }
}

/// `zerotrain` with `args` in `dir`.
fn zerotrain(dir: &Path, args: &[&str]) -> Output {
    let out = Command::new(env!("CARGO_BIN_EXE_zerotrain")).args(args).current_dir(dir).output();
    out.expect("run zerotrain")
}

/// A LLaMA-family model from a `config.json` (random weights from the config's seed) and a
/// byte-level BPE trained by `zerotrain tokenize`, sampled greedily by `zerotrain generate`
/// with the config's device on the CPU and on `on`: the same tokens (the logits agree to
/// f32 rounding, and a greedy pick is stable under it for this model); with `bf16.enabled`,
/// tokens where the device computes in bf16 and a refusal naming the key where it does not.
pub fn generate_samples_on_the_configured_device(on: Gpu) {
    let _alone = device_alone();
    let dir = std::env::temp_dir().join(format!("zt-generate-{}-{}", on.name, std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let words = ["the", "cat", "sat", "on", "a", "mat", "dog", "ran", "far", "away"];
    let text: Vec<String> = (0..300)
        .map(|i| (0..9).map(|j| words[(i * 7 + j * j * 3) % words.len()]).collect::<Vec<_>>().join(" "))
        .collect();
    std::fs::write(dir.join("text.txt"), text.join("\n")).unwrap();
    let made =
        zerotrain(&dir, &["tokenize", "text.txt", "--tokenizer", "tok.json", "--out", "t.bin", "--train-vocab", "280"]);
    assert!(made.status.success(), "{}", String::from_utf8_lossy(&made.stderr));
    let llama = r#"{"model_type": "llama", "vocab_size": 280, "hidden_size": 32, "intermediate_size": 48,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 64, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "tie_word_embeddings": false, "hidden_act": "silu", "architectures": ["LlamaForCausalLM"]}"#;
    std::fs::write(dir.join("config.json"), llama).unwrap();
    let run = |device: &str, half: &str| {
        let json = format!(
            r#"{{ {half} "train_micro_batch_size_per_gpu": 1, "zero_optimization": {{"stage": 3}},
                 "optimizer": {{"type": "AdamW", "params": {{"lr": 1e-3}}}}, "zerotrain": {{"device": "{device}"}},
                 "model": {{"hf_config": "config.json", "tokenizer": "tok.json", "block_size": 16}} }}"#
        );
        let file = format!("{device}{}.json", half.len());
        std::fs::write(dir.join(&file), json).unwrap();
        let args = [
            "generate",
            "--config",
            &file,
            "--prompt",
            "the cat",
            "--tokens",
            "6",
            "--temperature",
            "0",
            "--ignore-eos",
        ];
        zerotrain(&dir, &args)
    };
    let cpu = run("cpu", "");
    assert!(cpu.status.success(), "cpu: {}", String::from_utf8_lossy(&cpu.stderr));
    let there = run(on.name, "");
    assert!(there.status.success(), "{}: {}", on.name, String::from_utf8_lossy(&there.stderr));
    let text = |o: &Output| String::from_utf8_lossy(&o.stdout).into_owned();
    assert!(text(&cpu).starts_with("the cat") && text(&cpu).len() > "the cat\n".len(), "{}", text(&cpu));
    assert_eq!(text(&there), text(&cpu), "greedy tokens on {} and on the CPU", on.name);
    let bf16 = run(on.name, r#""bf16": {"enabled": true},"#);
    let stderr = String::from_utf8_lossy(&bf16.stderr);
    if (on.device)().supports_dtype(DType::BF16) {
        assert!(bf16.status.success() && text(&bf16).starts_with("the cat"), "{}: {stderr}", on.name);
    } else {
        let says = format!("`bf16.enabled`: this rank's {} device cannot compute in bf16", on.name);
        assert!(!bf16.status.success() && stderr.contains(&says), "{}: {}{stderr}", on.name, text(&bf16));
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// `zerotrain train` of `configs/tiny.json` (stage 2) on `on` for 2 steps: the line of
/// model-state bytes crossing host<->device says 0 both ways for one rank with every state on
/// the device, and more than 0 both ways on each of 2 ranks with `offload_optimizer` on the
/// CPU (gradients go to the host, updated parameters come back), and the same on 2 ranks as
/// processes under `zerotrain launch`, where each process says its own rank's. (Two thread
/// ranks sharing a device reduce through host memory, so they cross even without offload.)
pub fn train_says_each_ranks_host_device_bytes(on: Gpu) {
    // Not `device_alone`: the device is used by the commands' own processes only, and this
    // process measures nothing of it.
    let dir = std::env::temp_dir().join(format!("zt-crossed-{}-{}", on.name, std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let mut config: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("configs/tiny.json")).unwrap(),
    )
    .unwrap();
    config["zerotrain"]["device"] = on.name.into();
    // `launched`: the ranks as processes of `zerotrain launch`, each saying its own.
    let crossed = |config: &serde_json::Value, name: &str, ranks: usize, launched: bool| -> Vec<(u64, u64)> {
        std::fs::write(dir.join(format!("{name}.json")), config.to_string()).unwrap();
        let file = format!("{name}.json");
        let world = ranks.to_string();
        let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port().to_string();
        let train = ["train", "--config", &file, "--steps", "2", "--out", name];
        let out = match launched {
            true => {
                let mut args = vec!["launch", "--nproc-per-node", &world, "--master-port", &port, "--"];
                args.extend(train);
                zerotrain(&dir, &args)
            }
            false => zerotrain(&dir, &[&train[..], &["--world-size", &world]].concat()),
        };
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(out.status.success(), "{}: {stdout}{}", on.name, String::from_utf8_lossy(&out.stderr));
        (0..ranks)
            .map(|rank| {
                let start = format!("rank {rank}: model states crossed host<->device over 2 steps: ");
                let line = stdout
                    .lines()
                    .find_map(|l| l.split_once(&start).map(|(_, rest)| rest))
                    .unwrap_or_else(|| panic!("no {start}: {stdout}"));
                let bytes: Vec<u64> = line.split_whitespace().filter_map(|w| w.parse().ok()).collect();
                assert_eq!(bytes.len(), 2, "{line}");
                (bytes[0], bytes[1])
            })
            .collect()
    };
    assert_eq!(crossed(&config, "on-device", 1, false), [(0, 0)], "{}", on.name);
    config["zero_optimization"]["offload_optimizer"] = serde_json::json!({"device": "cpu"});
    let threads = crossed(&config, "offloaded", 2, false);
    for (rank, (to_device, to_host)) in threads.iter().enumerate() {
        assert!(
            *to_device > 0 && *to_host > 0,
            "{} rank {rank}: {to_device} B to the device, {to_host} B to the host",
            on.name
        );
    }
    // As processes the same ranks copy the same model states.
    assert_eq!(crossed(&config, "launched", 2, true), threads, "{}: launched against threads", on.name);
    let _ = std::fs::remove_dir_all(&dir);
}
