//! Tensor parallelism over MPI processes: a Hugging Face family on a tensor-parallel mesh
//! (alone or in pipeline stages) under `mpirun` trains as the same mesh of thread ranks
//! does.

use std::path::Path;
use std::process::{Command, Output};

/// Runs the `zerotrain` binary with `args` in `dir`, under `mpirun -np n` (`n > 0`).
fn zerotrain(dir: &Path, n: usize, args: &[&str]) -> Output {
    let bin = env!("CARGO_BIN_EXE_zerotrain");
    let mut c = if n == 0 {
        Command::new(bin)
    } else {
        let mut c = Command::new("mpirun");
        c.args(["--allow-run-as-root", "--oversubscribe", "-np", &n.to_string(), bin]);
        c
    };
    let out = c.args(args).current_dir(dir).output().unwrap();
    assert!(out.status.success(), "{args:?}: {}", String::from_utf8_lossy(&out.stderr));
    out
}

/// Every step's loss in a run folder's metrics.
fn losses(run: &Path) -> Vec<f64> {
    let text = std::fs::read_to_string(run.join("metrics.jsonl")).unwrap();
    text.lines().map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()["loss"].as_f64().unwrap()).collect()
}

/// LLaMA (4 heads over 2 kv heads) at `tensor_parallel.autotp_size` 2 and dp 2, at
/// sequence parallelism 2 and dp 2, and in two pipeline stages of tp 2, on four MPI
/// processes: each step's loss equals the four thread ranks' run bit for bit (the tensor group's sums have two operands, exact in either
/// order; the exchanges move values; the data-parallel reduction is the same rank-ordered
/// sum on both backends).
#[test]
fn a_tensor_parallel_mesh_over_mpi_trains_as_thread_ranks_do() {
    let dir = std::env::temp_dir().join(format!("zerotrain-mpi-tp-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let words = ["the", "rank", "holds", "a", "slice", "of", "each", "layer", "and", "sums", "its", "part", "."];
    let text: Vec<&str> = (0..4000usize).map(|i| words[(i * 7 + i * i / 11) % words.len()]).collect();
    std::fs::write(dir.join("text.txt"), text.join(" ")).unwrap();
    let tokenize = ["tokenize", "text.txt", "--tokenizer", "tokenizer.json", "--train-vocab", "280"];
    zerotrain(&dir, 0, &[&tokenize[..], &["--out", "data.tokens"]].concat());
    let model = r#"{"model_type": "llama", "hidden_size": 16, "intermediate_size": 24, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 280, "tie_word_embeddings": false}"#;
    std::fs::write(dir.join("model.json"), model).unwrap();
    let config = r#"{"train_batch_size": 8, "zero_optimization": {"stage": 2}, "tensor_parallel": {"autotp_size": 2},
        "optimizer": {"type": "AdamW", "params": {"lr": 0.01}}, "zerotrain": {"world_size": 4, "eval_every": 100},
        "model": {"hf_config": "model.json", "tokenizer": "tokenizer.json", "block_size": 8}}"#;
    std::fs::write(dir.join("tp.json"), config).unwrap();
    let sp = config
        .replace(r#""tensor_parallel": {"autotp_size": 2},"#, "")
        .replace(r#""world_size": 4"#, r#""world_size": 4, "mesh": {"sp": 2}"#);
    std::fs::write(dir.join("sp.json"), sp).unwrap();
    let piped = r#""train_batch_size": 8, "gradient_accumulation_steps": 2, "pipeline": {"stages": 2},"#;
    std::fs::write(dir.join("pp-tp.json"), config.replace(r#""train_batch_size": 8,"#, piped)).unwrap();
    for mesh in ["tp", "sp", "pp-tp"] {
        let config = format!("{mesh}.json");
        let train = ["train", "--config", &config, "--data", "data.tokens", "--steps", "4", "--out"];
        let (threads, mpi) = (format!("{mesh}-threads"), format!("{mesh}-mpi"));
        zerotrain(&dir, 0, &[&train[..], &[threads.as_str()]].concat());
        zerotrain(&dir, 4, &[&train[..], &[mpi.as_str()]].concat());
        let (threads, mpi) = (losses(&dir.join(threads)), losses(&dir.join(mpi)));
        assert_eq!(threads.len(), 4);
        assert_eq!(mpi, threads, "the same {mesh} mesh over MPI processes and over threads");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}
