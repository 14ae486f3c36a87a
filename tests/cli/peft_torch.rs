//! What needs torch itself: PEFT loading the adapters zerotrain exports. CI installs no
//! torch, so this is ignored there (its numbers for zerotrain's reading of PEFT's adapters
//! are a fixture: `hf::lora`); run it with `ZEROTRAIN_TORCH_PYTHON` naming a Python that has
//! torch, transformers and peft (`cargo test --test cli -- --ignored peft_torch`).

use crate::hf::lora::text_loss;
use crate::hf::{config, folder, number, reference, run_ok, train_args};
use crate::text;

/// A LoRA run's export (`consolidate --format peft`, after 3 steps at stage 3 on two ranks)
/// loads with `PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), dir)`,
/// and PEFT scores a text with it as `zerotrain eval --adapter` does, within 1e-5: GPT-2's
/// Conv1D layers (PEFT's fan_in_fan_out) and every linear layer of a LLaMA with grouped kv
/// heads.
#[test]
#[ignore = "needs torch, transformers and peft (ZEROTRAIN_TORCH_PYTHON names a Python that has them)"]
fn peft_loads_what_zerotrain_exports_and_scores_it_alike() {
    let python = std::env::var("ZEROTRAIN_TORCH_PYTHON").unwrap_or_else(|_| "python3".into());
    let dir = folder("peft-torch");
    let text_file = dir.join("text.txt");
    reference(&["text", text_file.to_str().unwrap(), "--bytes", "6000"]);
    for (name, args) in
        [("gpt2", &["--family", "gpt2"][..]), ("llama-gqa", &["--family", "llama", "--kv-heads", "2"][..])]
    {
        let hf = dir.join(name);
        reference(&[&["make", hf.to_str().unwrap()], args].concat());
        let trained = dir.join(format!("train-{name}.json"));
        let json = format!(
            r#"{{"train_batch_size": 4, "zero_optimization": {{"stage": 3}},
                "optimizer": {{"type": "AdamW", "params": {{"lr": 0.02}}}},
                "zerotrain": {{"world_size": 2, "lora": {{"r": 4, "lora_alpha": 8, "target_modules": "all-linear"}}}},
                "model": {{"hf_dir": {:?}, "block_size": 16}}}}"#,
            hf.display().to_string()
        );
        std::fs::write(&trained, json).unwrap();
        let run = dir.join(format!("run-{name}"));
        run_ok(&train_args(&trained, &text_file, "3", &run, &[]));
        let adapter = dir.join(format!("{name}-peft"));
        let ckpt = run.join("checkpoints");
        run_ok(&["consolidate", ckpt.to_str().unwrap(), "--format", "peft", "--out", adapter.to_str().unwrap()]);
        let script = concat!(env!("CARGO_MANIFEST_DIR"), "/bench/reference/peft_fixture.py");
        let out = std::process::Command::new(&python)
            .args([script, "score", hf.to_str().unwrap(), adapter.to_str().unwrap(), text_file.to_str().unwrap()])
            .args(["--context", "16"])
            .output()
            .expect("python runs");
        assert!(out.status.success(), "PEFT could not score the export: {}", text(&out.stderr));
        let peft_loss = number(&text(&out.stdout), "loss");
        let plain = config(&dir, &hf, 1, 0, "");
        let ours = text_loss(&plain, &text_file, &["--adapter", adapter.to_str().unwrap()]);
        assert!((ours - peft_loss).abs() / peft_loss < 1e-5, "{name}: zerotrain {ours}, PEFT {peft_loss}");
        let base = text_loss(&plain, &text_file, &[]);
        assert!((base - ours).abs() > 1e-4, "{name}: the trained adapter changes the loss ({base} without it)");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}
