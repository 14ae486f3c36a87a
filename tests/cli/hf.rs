//! Hugging Face checkpoints in and out, against Python: every checkpoint and tokenizer is
//! made here by `bench/reference/hf_models.py` (Python's safetensors and tokenizers, random
//! weights), whose numpy forward pass is the reference zerotrain's losses are held to.

use std::path::{Path, PathBuf};

use super::{text, zerotrain};

/// Runs the reference script; its stdout.
pub(crate) fn reference(args: &[&str]) -> String {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/bench/reference/hf_models.py");
    let out = std::process::Command::new("python3").arg(script).args(args).output().expect("python3 runs");
    assert!(out.status.success(), "hf_models.py {args:?}: {}", text(&out.stderr));
    text(&out.stdout)
}

pub(crate) fn number(json: &str, key: &str) -> f64 {
    let value: serde_json::Value = serde_json::from_str(json.trim()).unwrap_or_else(|e| panic!("{e}: {json}"));
    value[key].as_f64().unwrap_or_else(|| panic!("no {key} in {json}"))
}

/// A fresh folder for one test.
pub(crate) fn folder(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("zerotrain-hf-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// A config training or evaluating `hf_dir` at context 16 on `world` ranks at `stage`.
pub(crate) fn config(dir: &Path, hf_dir: &Path, world: usize, stage: u8, extra: &str) -> PathBuf {
    let path = dir.join(format!("config-{world}-{stage}.json"));
    let json = format!(
        r#"{{"train_batch_size": {}, "zero_optimization": {{"stage": {stage}, "stage3_param_persistence_threshold": 0}},
            "zerotrain": {{"world_size": {world}}}, "model": {{"hf_dir": {:?}, "block_size": 16}} {extra}}}"#,
        2 * world,
        hf_dir.display().to_string()
    );
    std::fs::write(&path, json).unwrap();
    path
}

/// `zerotrain eval` of each family (GPT-2; LLaMA with and without a tied head, grouped
/// kv heads, llama3 rope scaling, attention and MLP biases, a head_dim other than width /
/// heads; Qwen2's q/k/v biases and linear scaling from a sharded index; a config.json as
/// `transformers` 5 writes it, whose rotary base and scaling are only in `rope_parameters`;
/// Mistral with a sliding window as long as the context; Qwen3's normalised queries and
/// keys, with a head_dim other than width / heads) equals the numpy forward pass
/// within 1e-5, at one rank and at stage 3 on two. A context longer than the window, which
/// would need sliding-window attention, is refused naming both.
#[test]
#[ignore = "needs python3 with numpy, safetensors, tokenizers and ml_dtypes; .ci/run runs it"]
fn eval_matches_the_numpy_reference_for_every_family() {
    let dir = folder("eval");
    let text_file = dir.join("text.txt");
    reference(&["text", text_file.to_str().unwrap(), "--bytes", "2500"]);
    let cases: [(&str, &[&str]); 8] = [
        ("gpt2", &["--family", "gpt2"]),
        ("llama-untied", &["--family", "llama"]),
        ("llama-gqa-tied-llama3", &["--family", "llama", "--kv-heads", "2", "--tied", "--rope", "llama3"]),
        ("qwen2-sharded-linear", &["--family", "qwen2", "--kv-heads", "1", "--rope", "linear", "--shards", "3"]),
        ("llama-biases-head-dim", &["--family", "llama", "--kv-heads", "2", "--biases", "--head-dim", "12"]),
        ("llama-v5-llama3", &["--family", "llama", "--kv-heads", "2", "--rope", "llama3", "--layout", "v5"]),
        ("mistral-window", &["--family", "mistral", "--kv-heads", "2", "--sliding-window", "16"]),
        ("qwen3-qk-norm", &["--family", "qwen3", "--kv-heads", "2", "--head-dim", "12", "--tied"]),
    ];
    for (name, args) in cases {
        let hf = dir.join(name);
        reference(&[&["make", hf.to_str().unwrap()], args].concat());
        let expected =
            number(&reference(&["loss", hf.to_str().unwrap(), text_file.to_str().unwrap(), "--context", "16"]), "loss");
        for (world, stage) in [(1, 0), (2, 3)] {
            let got = eval_json(&config(&dir, &hf, world, stage, ""), ["--text", text_file.to_str().unwrap()], None);
            let relative = (got - expected).abs() / expected;
            assert!(
                relative < 1e-5,
                "{name} on {world} rank(s) at stage {stage}: {got} vs numpy {expected} ({relative:e})"
            );
        }
    }
    let long = dir.join("long.json");
    let json = std::fs::read_to_string(config(&dir, &dir.join("mistral-window"), 1, 0, "")).unwrap();
    std::fs::write(&long, json.replace(r#""block_size": 16"#, r#""block_size": 17"#)).unwrap();
    let out = zerotrain(&["eval", "--config", long.to_str().unwrap(), "--text", text_file.to_str().unwrap()]);
    let stderr = text(&out.stderr);
    assert!(stderr.contains("model.block_size 17 is longer than the model's sliding_window (16)"), "{stderr}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `zerotrain generate --temperature 0` continues a prompt with the tokens the numpy forward
/// pass finds likeliest, from the prompt's ids as `transformers`' `tokenizer(prompt)` gives
/// them (a LLaMA tokenizer's beginning token first; a `transformers` 5 config), GPT-2's, and
/// a Mistral's with a SentencePiece-style (Metaspace) tokenizer, whose decoder takes the
/// space off a text's first word: the continuation is decoded after the prompt, as
/// `transformers` decodes a generation, so the space between them stays ("the cat", not
/// "thecat"); it stops after the first of generation_config.json's `eos_token_id`s it samples, as
/// `transformers` does, unless told `--ignore-eos`.
#[test]
#[ignore = "needs python3 with numpy, safetensors, tokenizers and ml_dtypes; .ci/run runs it"]
fn greedy_generation_follows_the_numpy_reference() {
    let dir = folder("greedy");
    for (name, args) in [
        ("llama-v5", &["--family", "llama", "--kv-heads", "2", "--rope", "llama3", "--layout", "v5"][..]),
        ("gpt2", &["--family", "gpt2"][..]),
        ("mistral-metaspace", &["--family", "mistral", "--kv-heads", "2", "--tokenizer", "metaspace"][..]),
    ] {
        let hf = dir.join(name);
        reference(&[&["make", hf.to_str().unwrap()], args].concat());
        let expected: serde_json::Value =
            serde_json::from_str(&reference(&["greedy", hf.to_str().unwrap(), "the", "--tokens", "8"])).unwrap();
        // Near ties could fall either way between f32 and f64; these fixtures have none.
        assert!(expected["margin"].as_f64().unwrap() > 1e-3, "{name}: {expected}");
        let config = config(&dir, &hf, 1, 0, "");
        let generate = |extra: &[&str]| -> serde_json::Value {
            let mut args = vec!["generate", "--config", config.to_str().unwrap(), "--prompt", "the"];
            args.extend(["--tokens", "8", "--temperature", "0", "--json"]);
            serde_json::from_str(run_ok(&[&args[..], extra].concat()).trim()).unwrap()
        };
        let got = generate(&["--ignore-eos"]);
        for key in ["prompt_ids", "ids", "text"] {
            assert_eq!(got[key], expected[key], "{name}: {key}");
        }
        // The reference's 8 ids, up to and with the first of `stop`.
        let ids = expected["ids"].as_array().unwrap().clone();
        let until = |stop: &[serde_json::Value]| {
            let end = ids.iter().position(|id| stop.contains(id)).map_or(ids.len(), |at| at + 1);
            serde_json::Value::from(ids[..end].to_vec())
        };
        let generation = hf.join("generation_config.json");
        let written: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&generation).unwrap()).unwrap();
        assert_eq!(generate(&[])["ids"], until(&[written["eos_token_id"].clone()]), "{name}: the file's end token");
        let third = ids[2].clone();
        std::fs::write(&generation, serde_json::json!({"eos_token_id": [100000, third]}).to_string()).unwrap();
        let stopped = generate(&[])["ids"].clone();
        assert!(stopped.as_array().unwrap().len() <= 3, "{name}: {stopped}");
        assert_eq!(stopped, until(std::slice::from_ref(&third)), "{name}: an end token it samples third");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Runs `zerotrain` and returns its stdout, failing with its stderr.
pub(crate) fn run_ok(args: &[&str]) -> String {
    let out = zerotrain(args);
    assert!(out.status.success(), "zerotrain {args:?}: {}", text(&out.stderr));
    text(&out.stdout)
}

/// Runs `zerotrain` and checks that it fails as a refusal does: exit status 1, every one
/// of `needles` in its stderr, no panic.
pub(crate) fn refused(args: &[&str], needles: &[&str]) {
    let out = zerotrain(args);
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{args:?}: {stderr}");
    assert!(needles.iter().all(|n| stderr.contains(n)) && !stderr.contains("panicked"), "{args:?}: {stderr}");
}

/// `zerotrain train`'s arguments: `config` on `data` to `steps`, into `out`, then `extra`.
pub(crate) fn train_args<'a>(
    config: &'a Path,
    data: &'a Path,
    steps: &'a str,
    out: &'a Path,
    extra: &[&'a str],
) -> Vec<&'a str> {
    let mut args = vec!["train", "--config", config.to_str().unwrap(), "--data", data.to_str().unwrap()];
    args.extend(["--steps", steps, "--out", out.to_str().unwrap()]);
    args.extend(extra);
    args
}

/// `zerotrain eval --json`'s loss of `config`'s model (or `checkpoint`'s) on `input`
/// (`--text FILE` or `--tokens FILE`).
pub(super) fn eval_json(config: &Path, input: [&str; 2], checkpoint: Option<&Path>) -> f64 {
    let mut args = vec!["eval", "--config", config.to_str().unwrap(), input[0], input[1], "--json"];
    if let Some(dir) = checkpoint {
        args.extend(["--checkpoint", dir.to_str().unwrap()]);
    }
    number(&run_ok(&args), "loss")
}

/// Python's check that two Hugging Face folders hold the same tensors, bit for bit, the
/// same config, and the same tokenizer files (each the first has, the second has too);
/// prints what differs, or `same`.
fn same_folders(a: &Path, b: &Path) -> String {
    let script = r#"
import json, os, sys
import ml_dtypes  # numpy learns bfloat16
import numpy as np
from safetensors.numpy import load_file
def tensors(d):
    index = os.path.join(d, "model.safetensors.index.json")
    files = sorted(set(json.load(open(index))["weight_map"].values())) if os.path.exists(index) else ["model.safetensors"]
    out = {}
    for f in files:
        out.update(load_file(os.path.join(d, f)))
    return out
a, b = tensors(sys.argv[1]), tensors(sys.argv[2])
diff = [k for k in sorted(set(a) | set(b)) if k not in a or k not in b or a[k].dtype != b[k].dtype
        or a[k].shape != b[k].shape or a[k].tobytes() != b[k].tobytes()]
ca, cb = (json.load(open(os.path.join(d, "config.json"))) for d in sys.argv[1:3])
def text(d, name):
    path = os.path.join(d, name)
    return open(path).read() if os.path.exists(path) else None
names = ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"]
tok = [n for n in names if text(sys.argv[1], n) is None or text(sys.argv[1], n) != text(sys.argv[2], n)]
print("same" if not diff and ca == cb and not tok else f"tensors {diff[:5]} config {ca == cb} files {tok}")
"#;
    let out = std::process::Command::new("python3")
        .args(["-c", script, a.to_str().unwrap(), b.to_str().unwrap()])
        .output()
        .expect("python3 runs");
    assert!(out.status.success(), "{}", text(&out.stderr));
    text(&out.stdout).trim().to_string()
}

/// A Hugging Face folder in f32 and in bf16 (GPT-2; Qwen2 from a sharded index; a LLaMA
/// whose config.json is `transformers` 5's, naming its dtype `dtype`) goes through a
/// zerotrain run whose step changes nothing (lr 0) at stage 3 on two ranks and comes back
/// out bit for bit: tensors, dtype, config.json, tokenizer.json and the files beside them
/// (tokenizer_config.json with its chat template, special_tokens_map.json,
/// generation_config.json); an export in shards of a few KB writes an index that reads back
/// as the same tensors.
#[test]
#[ignore = "needs python3 with numpy, safetensors, tokenizers and ml_dtypes; .ci/run runs it"]
fn a_checkpoint_goes_through_zerotrain_and_back_bit_for_bit() {
    let dir = folder("round-trip");
    let data = dir.join("text.txt");
    reference(&["text", data.to_str().unwrap(), "--bytes", "6000"]);
    let lr0 = r#", "optimizer": {"type": "AdamW", "params": {"lr": 0.0, "weight_decay": 0.1}}"#;
    for (name, args) in [
        ("gpt2-f32", &["--family", "gpt2"][..]),
        ("qwen2-bf16", &["--family", "qwen2", "--kv-heads", "2", "--dtype", "bf16", "--shards", "2"][..]),
        ("llama-v5-bf16", &["--family", "llama", "--rope", "llama3", "--dtype", "bf16", "--layout", "v5"][..]),
    ] {
        let hf = dir.join(name);
        reference(&[&["make", hf.to_str().unwrap()], args].concat());
        let bf16 = if name.ends_with("bf16") { r#", "bf16": {"enabled": true}"# } else { "" };
        let config = config(&dir, &hf, 2, 3, &format!("{lr0}{bf16}"));
        let run = dir.join(format!("run-{name}"));
        run_ok(&train_args(&config, &data, "1", &run, &[]));
        let ckpt = run.join("checkpoints");
        let out = dir.join(format!("out-{name}"));
        run_ok(&["consolidate", ckpt.to_str().unwrap(), "--format", "hf", "--out", out.to_str().unwrap()]);
        assert_eq!(same_folders(&hf, &out), "same", "{name}");
        let sharded = dir.join(format!("sharded-{name}"));
        let printed = run_ok(&[
            "consolidate",
            ckpt.to_str().unwrap(),
            "--format",
            "hf",
            "--out",
            sharded.to_str().unwrap(),
            "--max-shard-size",
            "8KB",
        ]);
        assert!(sharded.join("model.safetensors.index.json").is_file() && printed.contains("shard(s)"), "{printed}");
        assert_eq!(same_folders(&hf, &sharded), "same", "{name}, sharded");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The token ids zerotrain writes are the ids Python's tokenizers gives for the same
/// tokenizer.json, document by document, as `transformers`' `tokenizer(text)` encodes a
/// text (with the beginning token a LLaMA tokenizer puts before each), each document closed
/// by the end token `transformers` takes (tokenizer_config.json's `eos_token`: Qwen2's chat
/// `<|im_end|>`, not the `<|endoftext|>` it also has); and a BPE zerotrain trains loads in
/// Python and encodes the same there.
#[test]
#[ignore = "needs python3 with numpy, safetensors, tokenizers and ml_dtypes; .ci/run runs it"]
fn token_ids_are_python_tokenizers_ids() {
    let dir = folder("tokenizer");
    let (gpt2, qwen2, llama) = (dir.join("gpt2"), dir.join("qwen2"), dir.join("llama"));
    for (folder, family) in [(&gpt2, "gpt2"), (&qwen2, "qwen2"), (&llama, "llama")] {
        reference(&["make", folder.to_str().unwrap(), "--family", family]);
    }
    let data = dir.join("text.txt");
    reference(&["text", data.to_str().unwrap(), "--bytes", "3000", "--seed", "5"]);
    let doc = std::fs::read_to_string(&data).unwrap().replace("\n\n", "\n");
    std::fs::write(&data, &doc).unwrap();
    let cases = [
        (gpt2.join("tokenizer.json"), None),
        (qwen2.join("tokenizer.json"), None),
        (llama.join("tokenizer.json"), None),
        (dir.join("trained.json"), Some("320")),
    ];
    for (tokenizer, train) in cases {
        let tokens = dir.join("t.tokens");
        let mut args = vec!["tokenize", data.to_str().unwrap(), "--tokenizer", tokenizer.to_str().unwrap()];
        args.extend(["--out", tokens.to_str().unwrap(), "--valid-fraction", "0"]);
        if let Some(vocab) = train {
            args.extend(["--train-vocab", vocab]);
        }
        let printed = run_ok(&args);
        let ids = read_token_file(&tokens);
        // The tokenizer folder for the Python side: tokenizer.json and the config beside it.
        let tok_dir = dir.join("tok");
        let _ = std::fs::remove_dir_all(&tok_dir);
        std::fs::create_dir_all(&tok_dir).unwrap();
        std::fs::copy(&tokenizer, tok_dir.join("tokenizer.json")).unwrap();
        let config = tokenizer.with_file_name("tokenizer_config.json");
        if config.exists() {
            std::fs::copy(&config, tok_dir.join("tokenizer_config.json")).unwrap();
        }
        let python: serde_json::Value =
            serde_json::from_str(&reference(&["ids", tok_dir.to_str().unwrap(), data.to_str().unwrap()])).unwrap();
        let mut expected: Vec<u32> =
            python["ids"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect();
        // The end token transformers takes (the config's eos_token), else <|endoftext|>.
        let eos = python["eos"].as_u64().or(python["endoftext"].as_u64()).unwrap() as u32;
        expected.push(eos);
        assert_eq!(ids, expected, "{}", tokenizer.display());
        assert!(ids.len() > 100);
        assert!(printed.contains(&format!("(id {eos})")), "{printed}");
    }
    // Qwen2's chat tokenizer ends documents on <|im_end|>, not on the <|endoftext|> it also
    // has; the LLaMA one begins each with a token of its own.
    let ids = |folder: &Path| -> serde_json::Value {
        serde_json::from_str(&reference(&["ids", folder.to_str().unwrap(), data.to_str().unwrap()])).unwrap()
    };
    let (qwen2, llama) = (ids(&qwen2), ids(&llama));
    assert_ne!(qwen2["eos"], qwen2["endoftext"]);
    assert!(llama["begin"].is_u64() && llama["ids"][0] == llama["begin"] && qwen2["begin"].is_null());
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The tokens of a token file (its documents back to back, each with its end token),
/// read by this test from the documented layout.
fn read_token_file(path: &Path) -> Vec<u32> {
    let bytes = std::fs::read(path).unwrap();
    assert_eq!(&bytes[..8], b"ZTTOKENS");
    let width = u32::from_le_bytes(bytes[12..16].try_into().unwrap()) as usize;
    let n = u64::from_le_bytes(bytes[16..24].try_into().unwrap()) as usize;
    let crc = u32::from_le_bytes(bytes[48..52].try_into().unwrap());
    assert_eq!(crc, crc32fast::hash(&bytes[64..]), "the header's checksum covers the rest");
    (0..n)
        .map(|i| {
            let at = 64 + i * width;
            if width == 2 {
                u32::from(u16::from_le_bytes([bytes[at], bytes[at + 1]]))
            } else {
                u32::from_le_bytes(bytes[at..at + 4].try_into().unwrap())
            }
        })
        .collect()
}

/// Deterministic English-like text, `words` words in paragraphs.
fn words(words: usize, seed: u64) -> String {
    const WORDS: [&str; 16] = [
        "the", "rank", "holds", "a", "shard", "of", "state", "and", "gathers", "each", "unit", "before", "its",
        "forward", "pass", ".",
    ];
    let mut state = seed;
    let mut out = String::new();
    for i in 0..words {
        state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        out.push_str(WORDS[(state >> 60) as usize]);
        out.push(if i % 97 == 96 { '\n' } else { ' ' });
    }
    out
}

/// A LLaMA-shaped config.json (fresh weights) and a BPE trained by `zerotrain tokenize` on
/// the text: no Python. Returns (config file for `zerotrain`, token file).
pub(super) fn fresh_llama(dir: &Path, world: usize, extra: &str) -> (PathBuf, PathBuf) {
    let text = dir.join("text.txt");
    std::fs::write(&text, words(6000, 3)).unwrap();
    let (tokenizer, tokens) = (dir.join("tokenizer.json"), dir.join("data.tokens"));
    if !tokens.exists() {
        run_ok(&[
            "tokenize",
            text.to_str().unwrap(),
            "--tokenizer",
            tokenizer.to_str().unwrap(),
            "--train-vocab",
            "280",
            "--out",
            tokens.to_str().unwrap(),
            "--valid-fraction",
            "0.1",
        ]);
        let model = r#"{"model_type": "llama", "hidden_size": 16, "intermediate_size": 24, "num_hidden_layers": 2,
            "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 280, "tie_word_embeddings": true}"#;
        std::fs::write(dir.join("model.json"), model).unwrap();
    }
    let config = dir.join(format!("train-{world}.json"));
    let json = format!(
        r#"{{"train_batch_size": 8, "train_micro_batch_size_per_gpu": {}, "zero_optimization": {{"stage": 2}},
            "optimizer": {{"type": "AdamW", "params": {{"lr": 0.01}}}},
            "zerotrain": {{"world_size": {world}, "eval_every": 100}},
            "model": {{"hf_config": "model.json", "tokenizer": "tokenizer.json", "block_size": 8}} {extra}}}"#,
        8 / world
    );
    std::fs::write(&config, json).unwrap();
    (config, tokens)
}

pub(super) use super::metrics::losses;

/// A run on a token file, stopped at step 3 on two ranks and resumed on one, trains steps
/// 4..6 on the same samples as a run that never stopped (the checkpoint records the data
/// position); resuming on another token file is refused by name.
#[test]
fn a_run_resumed_at_another_world_size_continues_the_same_samples() {
    let dir = folder("resume-data");
    let (two, tokens) = fresh_llama(&dir, 2, "");
    let (one, _) = fresh_llama(&dir, 1, "");
    let whole = dir.join("whole");
    run_ok(&train_args(&two, &tokens, "6", &whole, &[]));
    let resumed = dir.join("resumed");
    run_ok(&train_args(&two, &tokens, "3", &resumed, &[]));
    run_ok(&train_args(&one, &tokens, "6", &resumed, &["--resume"]));
    let (a, b) = (losses(&whole), losses(&resumed));
    assert_eq!(a.iter().map(|l| l.0).collect::<Vec<_>>(), [1, 2, 3, 4, 5, 6]);
    assert_eq!(b.len(), 6, "{b:?}");
    for ((step, x), (_, y)) in a.iter().zip(&b) {
        assert!((x - y).abs() <= 1e-5 * x.abs(), "step {step}: {x} uninterrupted, {y} resumed on one rank");
    }
    // Another corpus: the checkpoint's position means nothing there.
    let other = dir.join("other.txt");
    std::fs::write(&other, words(5000, 9)).unwrap();
    let out = zerotrain(&train_args(&one, &other, "7", &resumed, &["--resume"]));
    let err = text(&out.stderr);
    assert!(
        !out.status.success() && err.contains("the checkpoint was trained on") && err.contains("data.tokens"),
        "{err}"
    );
    assert!(err.contains("cannot resume:") && !err.contains("engine used out of order"), "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `generate` is deterministic for a seed, greedy at temperature 0, and refuses a bad
/// temperature or top-p by name; `eval` of a fresh model from `hf_config` scores a text file.
#[test]
fn generate_is_repeatable_per_seed_and_eval_scores_a_fresh_model() {
    let dir = folder("generate");
    let (config, _) = fresh_llama(&dir, 1, "");
    let sample = |seed: &str, temperature: &str| {
        run_ok(&[
            "generate",
            "--config",
            config.to_str().unwrap(),
            "--prompt",
            "the rank holds",
            "--tokens",
            "12",
            "--seed",
            seed,
            "--temperature",
            temperature,
        ])
    };
    let (a, b, c) = (sample("1", "1.5"), sample("1", "1.5"), sample("2", "1.5"));
    assert!(a.starts_with("the rank holds") && a.len() > "the rank holds".len() + 5, "{a}");
    assert_eq!(a, b, "one seed, one text");
    assert_ne!(a, c, "another seed, another text");
    assert_eq!(sample("1", "0"), sample("2", "0"), "greedy ignores the seed");
    let out = zerotrain(&["generate", "--config", config.to_str().unwrap(), "--prompt", "x", "--temperature=-1"]);
    assert!(text(&out.stderr).contains("--temperature must be 0 (greedy) or positive"), "{}", text(&out.stderr));
    let out = zerotrain(&["generate", "--config", config.to_str().unwrap(), "--prompt", "x", "--top-p", "0"]);
    assert!(text(&out.stderr).contains("--top-p must be above 0 and at most 1, not 0"), "{}", text(&out.stderr));
    let printed =
        run_ok(&["eval", "--config", config.to_str().unwrap(), "--text", dir.join("text.txt").to_str().unwrap()]);
    let loss: f64 = printed.split("mean loss ").nth(1).unwrap().split_whitespace().next().unwrap().parse().unwrap();
    // A fresh model of N(0, 0.02) weights predicts nearly uniformly over its 280 tokens.
    assert!((loss - (280f64).ln()).abs() < 0.05, "{printed}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `zerotrain ARGS`'s peak resident size in bytes, from the kernel's accounting of the
/// finished child (`wait4`); panics unless it succeeded.
fn peak_rss(args: &[&str]) -> u64 {
    use std::io::Read;
    #[expect(clippy::zombie_processes, reason = "reaped by the wait4 below, which also gives its peak")]
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_zerotrain"))
        .args(args)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut err = String::new();
    child.stderr.take().unwrap().read_to_string(&mut err).unwrap();
    let (mut status, mut usage) = (0, unsafe { std::mem::zeroed::<libc::rusage>() });
    // SAFETY: the child is ours and not yet reaped; both out-pointers are live locals.
    let pid = unsafe { libc::wait4(child.id() as libc::pid_t, &mut status, 0, &mut usage) };
    assert!(pid > 0 && libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0, "zerotrain {args:?}: {err}");
    usage.ru_maxrss as u64 * 1024
}

/// `generate` holds the model and one window's activations, however many tokens it adds:
/// each token's forward pass leaves nothing behind. (On an autodiff device every forward
/// kept its graph, reachable from the parameters, and the process grew by about the
/// model's size per token: a 1.1B model was killed for memory after a few tokens.)
#[test]
fn generating_more_tokens_holds_no_more_memory() {
    let dir = folder("generate-memory");
    let (config, _) = fresh_llama(&dir, 1, "");
    let (hidden, inter, layers, kv, vocab) = (512usize, 1024usize, 2usize, 256usize, 280usize);
    let model = format!(
        r#"{{"model_type": "llama", "hidden_size": {hidden}, "intermediate_size": {inter}, "num_hidden_layers": {layers},
            "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": {vocab}, "tie_word_embeddings": true}}"#
    );
    std::fs::write(dir.join("model.json"), model).unwrap();
    // q and o are hidden x hidden, k and v hidden x kv (2 of 4 heads), the MLP three
    // hidden x intermediate, two norms per layer, the final norm and the tied embedding.
    let per_layer = 2 * hidden * hidden + 2 * hidden * kv + 3 * hidden * inter + 2 * hidden;
    let model_bytes = ((layers * per_layer + hidden + vocab * hidden) * 4) as u64;
    let peak = |tokens: &str| {
        let config = config.to_str().unwrap();
        peak_rss(&["generate", "--config", config, "--prompt", "the rank holds", "--tokens", tokens, "--ignore-eos"])
    };
    let (one, many) = (peak("1"), peak("24"));
    assert!(
        many < one + model_bytes,
        "24 tokens peaked at {many} B, 1 token at {one} B: more than the model's {model_bytes} B apart"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `tokenize` reads its files a batch of documents at a time: a corpus of 160 MB peaks far
/// below its own size (holding it whole, as it did, took twice that), and gives the ids of
/// each document read alone. A file that turns out malformed after many documents leaves
/// no token file, whole or partial.
#[test]
fn tokenize_holds_a_batch_of_the_corpus_not_all_of_it() {
    let dir = folder("tokenize-stream");
    let (small, big) = (dir.join("small.txt"), dir.join("big.txt"));
    let paragraph = words(1500, 9);
    std::fs::write(&small, format!("{paragraph}\n\n{}", words(200, 4))).unwrap();
    let tokenizer = dir.join("tokenizer.json");
    let out = |name: &str| dir.join(name).to_str().unwrap().to_string();
    let train = ["tokenize", small.to_str().unwrap(), "--tokenizer", tokenizer.to_str().unwrap()];
    run_ok(&[&train[..], &["--train-vocab", "300", "--out", &out("small.tokens")]].concat());
    let mut corpus = std::io::BufWriter::new(std::fs::File::create(&big).unwrap());
    let mut bytes = 0;
    while bytes < 160_000_000 {
        std::io::Write::write_all(&mut corpus, paragraph.as_bytes()).unwrap();
        std::io::Write::write_all(&mut corpus, b"\n\n").unwrap();
        bytes += paragraph.len() + 2;
    }
    drop(corpus);
    let big_args = ["tokenize", big.to_str().unwrap(), "--tokenizer", tokenizer.to_str().unwrap()];
    let peak = peak_rss(&[&big_args[..], &["--out", &out("big.tokens"), "--valid-fraction", "0"]].concat());
    assert!(peak < bytes as u64 / 2, "a {bytes} B corpus peaked at {peak} B");
    // Every document is the same paragraph: its ids, then the end token, over and over.
    let one = read_token_file(&dir.join("small.tokens"));
    let (first, tokens) =
        (&one[..one.iter().position(|&t| t == 0).unwrap() + 1], read_token_file(&dir.join("big.tokens")));
    assert_eq!(tokens.len() % first.len(), 0);
    assert!(tokens.chunks(first.len()).all(|doc| doc == first));
    std::fs::remove_file(&big).unwrap();

    let jsonl = dir.join("docs.jsonl");
    let line = format!("{}\n", serde_json::json!({"text": paragraph}));
    std::fs::write(&jsonl, format!("{}{{\"body\": \"no text\"}}\n", line.repeat(3000))).unwrap();
    let args = ["tokenize", jsonl.to_str().unwrap(), "--tokenizer", tokenizer.to_str().unwrap(), "--out"];
    let failed = zerotrain(&[&args[..], &[&out("bad.tokens")]].concat());
    assert!(text(&failed.stderr).contains("line 3001: no string field `text`"), "{}", text(&failed.stderr));
    assert!(!dir.join("bad.tokens").exists() && !dir.join("bad.tokens.partial").exists());
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Training a fresh LLaMA-shaped model on a token file lowers the loss `eval` measures on
/// text it never saw and on the file's held-out split (`--tokens`), scored from the run's
/// checkpoint. Scoring reads only the weights: a config naming another optimizer scores
/// the checkpoint the same.
#[test]
fn training_lowers_the_held_out_loss_measured_from_the_checkpoint() {
    let dir = folder("finetune");
    let (config, tokens) = fresh_llama(&dir, 2, "");
    let held_out = dir.join("held_out.txt");
    std::fs::write(&held_out, words(800, 77)).unwrap();
    let (text, split) = (["--text", held_out.to_str().unwrap()], ["--tokens", tokens.to_str().unwrap()]);
    let before = (eval_json(&config, text, None), eval_json(&config, split, None));
    let run = dir.join("run");
    run_ok(&train_args(&config, &tokens, "40", &run, &[]));
    let checkpoint = run.join("checkpoints");
    let after = (eval_json(&config, text, Some(&checkpoint)), eval_json(&config, split, Some(&checkpoint)));
    assert!(after.0 < 0.7 * before.0, "held-out text: loss {} -> {}", before.0, after.0);
    assert!(after.1 < 0.7 * before.1, "the token file's held-out split: loss {} -> {}", before.1, after.1);
    let sgd = dir.join("sgd.json");
    std::fs::write(&sgd, std::fs::read_to_string(&config).unwrap().replace("AdamW", "SGD")).unwrap();
    assert_eq!(eval_json(&sgd, text, Some(&checkpoint)), after.0, "the optimizer's state is not the model's");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The files beside a run's checkpoints are the ones its weights were trained with: every
/// checkpoint records their checksums, so a `tokenizer.json` swapped for another one of the
/// same size is refused by `eval` and `generate` naming it, and an edited `config.json`
/// (another `rms_norm_eps`) by `consolidate --format hf`; restored, both work. `--checkpoint`
/// may name the run folder, whose `checkpoints` is meant.
#[test]
fn files_changed_beside_a_checkpoint_are_refused_by_name() {
    let dir = folder("companions");
    let (config, tokens) = fresh_llama(&dir, 1, "");
    let run = dir.join("run");
    run_ok(&train_args(&config, &tokens, "2", &run, &[]));
    let ckpt = run.join("checkpoints");
    let held_out = dir.join("held_out.txt");
    std::fs::write(&held_out, words(300, 5)).unwrap();
    let text_arg = ["--text", held_out.to_str().unwrap()];
    let scored = eval_json(&config, text_arg, Some(&ckpt));
    assert_eq!(eval_json(&config, text_arg, Some(&run)), scored, "the run folder names its checkpoints");
    let args = ["eval", "--config", config.to_str().unwrap(), text_arg[0], text_arg[1], "--json", "--checkpoint"];
    let said: serde_json::Value =
        serde_json::from_str(run_ok(&[&args[..], &[ckpt.to_str().unwrap()]].concat()).trim()).unwrap();
    let weights = said["weights"].as_str().unwrap();
    assert!(weights.starts_with("scored the fp32 masters of") && weights.contains("computed in fp32"), "{weights}");

    let tokenizer = ckpt.join("tokenizer.json");
    let original = std::fs::read(&tokenizer).unwrap();
    let other = dir.join("other");
    std::fs::create_dir_all(&other).unwrap();
    std::fs::write(other.join("text.txt"), words(6000, 11)).unwrap();
    let other_tokenizer = other.join("tokenizer.json");
    run_ok(&[
        "tokenize",
        other.join("text.txt").to_str().unwrap(),
        "--tokenizer",
        other_tokenizer.to_str().unwrap(),
        "--train-vocab",
        "280",
        "--out",
        other.join("t.tokens").to_str().unwrap(),
    ]);
    std::fs::copy(&other_tokenizer, &tokenizer).unwrap();
    let eval = zerotrain(&[
        "eval",
        "--config",
        config.to_str().unwrap(),
        text_arg[0],
        text_arg[1],
        "--checkpoint",
        ckpt.to_str().unwrap(),
    ]);
    let err = text(&eval.stderr);
    assert!(!eval.status.success() && err.contains("checkpoints/tokenizer.json was changed since checkpoint"), "{err}");
    let generate = zerotrain(&[
        "generate",
        "--config",
        config.to_str().unwrap(),
        "--prompt",
        "the rank",
        "--checkpoint",
        ckpt.to_str().unwrap(),
    ]);
    assert!(!generate.status.success() && text(&generate.stderr).contains("tokenizer.json was changed"));
    std::fs::write(&tokenizer, &original).unwrap();

    let config_json = ckpt.join("config.json");
    let original = std::fs::read_to_string(&config_json).unwrap();
    let mut edited: serde_json::Value = serde_json::from_str(&original).unwrap();
    edited["rms_norm_eps"] = serde_json::json!(0.5);
    std::fs::write(&config_json, edited.to_string()).unwrap();
    let export = |name: &str| {
        zerotrain(&["consolidate", ckpt.to_str().unwrap(), "--format", "hf", "--out", dir.join(name).to_str().unwrap()])
    };
    let out = export("edited");
    assert!(!out.status.success() && text(&out.stderr).contains("config.json was changed since checkpoint"));
    assert!(!dir.join("edited").exists());
    std::fs::write(&config_json, original).unwrap();
    let out = export("restored");
    assert!(out.status.success(), "{}", text(&out.stderr));
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A model without `model.block_size` evaluates and generates over its own positions (not
/// the built-in GPT's 32), and says so: `eval --json` reports the context and where it
/// comes from; a text shorter than one window is scored whole, as one window of its own
/// length (the loss of `model.block_size` set to its length less one); `generate` refuses a
/// prompt longer than the positions instead of cutting it, and warns past them.
#[test]
fn a_model_without_block_size_uses_its_own_positions_and_says_so() {
    let dir = folder("positions");
    let (with, _) = fresh_llama(&dir, 1, "");
    let model = r#"{"model_type": "llama", "hidden_size": 16, "intermediate_size": 24, "num_hidden_layers": 2,
        "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 280, "tie_word_embeddings": true,
        "max_position_embeddings": 64}"#;
    std::fs::write(dir.join("model.json"), model).unwrap();
    let without = dir.join("without.json");
    std::fs::write(&without, std::fs::read_to_string(&with).unwrap().replace(r#", "block_size": 8"#, "")).unwrap();
    let eval = |config: &Path, file: &Path| -> serde_json::Value {
        let out = run_ok(&["eval", "--config", config.to_str().unwrap(), "--text", file.to_str().unwrap(), "--json"]);
        serde_json::from_str(out.trim()).unwrap()
    };
    let long = dir.join("long.txt");
    std::fs::write(&long, words(400, 8)).unwrap();
    let scored = eval(&without, &long);
    assert_eq!(scored["context"], 64, "{scored}");
    assert!(scored["context_from"].as_str().unwrap().contains("max_position_embeddings"), "{scored}");
    // A text of fewer tokens than one window: one window of its own length.
    let short = dir.join("short.txt");
    std::fs::write(&short, "the rank holds a shard of state and gathers each unit").unwrap();
    let whole = eval(&without, &short);
    let tokens = whole["tokens"].as_u64().unwrap();
    assert!(tokens > 4 && tokens < 64 && whole["windows"] == 1 && whole["context"] == tokens, "{whole}");
    let exact = dir.join("exact.json");
    let json =
        std::fs::read_to_string(&with).unwrap().replace(r#""block_size": 8"#, &format!(r#""block_size": {tokens}"#));
    std::fs::write(&exact, json).unwrap();
    assert_eq!(whole["loss"], eval(&exact, &short)["loss"], "the window of the text's length");
    // generate: over the 64 positions; a longer prompt is refused, not cut.
    let generate = |prompt: &str, tokens: &str| {
        zerotrain(&[
            "generate",
            "--config",
            without.to_str().unwrap(),
            "--prompt",
            prompt,
            "--tokens",
            tokens,
            "--json",
            "--temperature",
            "0",
            "--ignore-eos",
        ])
    };
    let out = generate("the rank holds", "4");
    assert!(out.status.success(), "{}", text(&out.stderr));
    let got: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(got["context"], 64);
    let long_prompt = words(200, 3);
    let out = generate(&long_prompt, "4");
    let err = text(&out.stderr);
    assert!(!out.status.success() && err.contains("more than the model's positions (64)"), "{err}");
    let out = generate("the rank holds", "70");
    assert!(out.status.success() && text(&out.stderr).contains("pass the model's positions (64)"));
    // Training defaults to the smaller of the positions and 1024 (run_clm's and TRL's
    // default), one rule for every rank, whatever the machine's memory: 64 here, 1024 for
    // a model of 2048 positions.
    let (tokens, run) = (dir.join("data.tokens"), dir.join("run"));
    let said = run_ok(&train_args(&without, &tokens, "1", &run, &[]));
    assert!(said.contains("context 64: the model's max_position_embeddings; model.block_size not set"), "{said}");
    std::fs::write(
        dir.join("model.json"),
        model.replace(r#""max_position_embeddings": 64"#, r#""max_position_embeddings": 2048"#),
    )
    .unwrap();
    let said = run_ok(&train_args(&without, &tokens, "1", &dir.join("run-2048"), &[]));
    let want =
        "context 1024: model.block_size not set: the smaller of the model's 2048 max_position_embeddings and 1024";
    assert!(said.contains(want), "{said}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A token file whose header's id bound was raised past its tokenizer's, one token set to
/// an id past the model's vocabulary and the checksum recomputed, is refused by `eval` and
/// `train` naming the file and both bounds (it reached Burn's embedding lookup and panicked
/// there once the tokenizer's fingerprint matched).
#[test]
fn a_token_file_whose_id_bound_was_raised_is_refused_by_name() {
    let dir = folder("raised-bound");
    let (config, tokens) = fresh_llama(&dir, 1, "");
    let mut bytes = std::fs::read(&tokens).unwrap();
    let width = u32::from_le_bytes(bytes[12..16].try_into().unwrap()) as usize;
    bytes[40..48].copy_from_slice(&60_000u64.to_le_bytes());
    bytes[64..64 + width].copy_from_slice(&59_999u32.to_le_bytes()[..width]);
    let crc = crc32fast::hash(&bytes[64..]);
    bytes[48..52].copy_from_slice(&crc.to_le_bytes());
    let altered = dir.join("altered.tokens");
    std::fs::write(&altered, bytes).unwrap();
    let eval = ["eval", "--config", config.to_str().unwrap(), "--tokens", altered.to_str().unwrap()];
    let run = dir.join("run");
    let train = train_args(&config, &altered, "1", &run, &[]);
    for args in [&eval[..], &train[..]] {
        let out = zerotrain(args);
        let err = text(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {err}");
        assert!(err.contains("altered.tokens") && err.contains("header says ids below 60000"), "{args:?}: {err}");
        assert!(err.contains("has ids below 280") && !err.contains("panicked"), "{args:?}: {err}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A model too large for this machine is refused by `eval` and `generate` with the memory
/// it would need, before anything of it is allocated (eval aborted on a 65.5 GB allocation
/// for a 34.6G-parameter `hf_config`; `train` refused it with its estimate already).
#[test]
fn scoring_or_sampling_a_model_past_this_machines_memory_is_refused_with_the_estimate() {
    let dir = folder("too-large");
    let (small, _) = fresh_llama(&dir, 1, "");
    let model = r#"{"model_type": "llama", "hidden_size": 8192, "intermediate_size": 22016, "num_hidden_layers": 48,
        "num_attention_heads": 64, "num_key_value_heads": 8, "vocab_size": 32000}"#;
    std::fs::write(dir.join("model.json"), model).unwrap();
    let text_file = dir.join("text.txt");
    let runs: [&[&str]; 2] = [
        &["eval", "--config", small.to_str().unwrap(), "--text", text_file.to_str().unwrap()],
        &["generate", "--config", small.to_str().unwrap(), "--prompt", "the rank"],
    ];
    for args in runs {
        let out = zerotrain(args);
        let err = text(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {err}");
        assert!(
            err.contains("parameters needs about") && err.contains("GiB of memory is available"),
            "{args:?}: {err}"
        );
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Ids of a vocabulary padded past the tokenizer's (a model of 300 ids over a tokenizer of
/// 280) decode as nothing, as `transformers` decodes them; `generate` says so, listing
/// them, rather than dropping them silently.
#[test]
fn generated_ids_the_tokenizer_has_no_token_for_are_named() {
    let dir = folder("padded-vocab");
    let (config, _) = fresh_llama(&dir, 1, "");
    let model = std::fs::read_to_string(dir.join("model.json"))
        .unwrap()
        .replace(r#""vocab_size": 280"#, r#""vocab_size": 300"#);
    std::fs::write(dir.join("model.json"), model).unwrap();
    let args = ["generate", "--config", config.to_str().unwrap(), "--prompt", "the rank", "--tokens", "100"];
    let out = zerotrain(&[&args[..], &["--temperature", "1", "--top-k", "0", "--ignore-eos", "--json"]].concat());
    let stderr = text(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let ids: Vec<u64> = serde_json::from_slice::<serde_json::Value>(&out.stdout).unwrap()["ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap())
        .collect();
    let padded: std::collections::BTreeSet<u64> = ids.iter().copied().filter(|&id| id >= 280).collect();
    assert!(!padded.is_empty(), "100 tokens drawn from 300 ids hit none of the 20 padded ones: {ids:?}");
    assert!(stderr.contains("has no token for") && stderr.contains(&format!("{padded:?}")), "{padded:?}: {stderr}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[path = "lora.rs"]
pub(crate) mod lora;

#[path = "qlora.rs"]
mod qlora;

#[path = "counted.rs"]
mod counted;
