//! LoRA on the built-in GPT from the commands: counted, trained, resumed, exported, and
//! refused where it is not built.

use crate::hf::{folder, refused, run_ok};
use crate::metrics::losses;

/// LoRA on the built-in GPT from the commands (configs/tiny.json's model, r 4 on every linear
/// layer, A and B both drawn, so that the adapters act from the first step): `config check` and `estimate` count the adapters, r (in + out) each (four 16 x 16
/// projections and the MLP's 16 x 64 pair a block), and the whole base frozen beside them;
/// `train` at stage 3 over 2 ranks trains those alone, its checkpoint holds them and none of
/// the base, and it resumes on 1 rank as if uninterrupted; 2 pipeline stages, tp 2 and sp 2
/// train the same run; a resume that would draw another base (another seed) is refused, as
/// is `--adapter`, not built for this model; an NF4 base is counted and trains. (Before,
/// `train` trained every parameter and `config check` counted them all, as if the section
/// were not there.)
#[test]
fn lora_trains_the_built_in_gpt_from_the_commands() {
    let dir = folder("lora-built-in");
    let tiny = std::fs::read_to_string("configs/tiny.json").unwrap();
    let with = |name: &str, extra: &str| {
        let json = tiny
            .replace(
                r#""eval_every": 2"#,
                &format!(r#""eval_every": 2, "lora": {{"r": 4, "target_modules": "all-linear", "init_lora_weights": false{extra}}}"#),
            )
            .replace(r#""stage": 2"#, r#""stage": 3, "stage3_param_persistence_threshold": 0"#)
            // The global batch fixed, so that one rank accumulates what two computed.
            .replacen('{', r#"{"train_batch_size": 8, "#, 1);
        assert!(json.contains("lora") && json.contains("threshold"), "configs/tiny.json moved: {json}");
        let path = dir.join(format!("{name}.json"));
        std::fs::write(&path, json).unwrap();
        path.to_str().unwrap().to_string()
    };
    let config = with("lora", "");
    let adapters = 4 * 4 * (16 + 16) + 2 * 4 * (16 + 64);
    let (whole, resumed) = (dir.join("whole"), dir.join("resumed"));
    let (whole, resumed) = (whole.to_str().unwrap(), resumed.to_str().unwrap());
    let out = run_ok(&["train", "--config", &config, "--steps", "4", "--out", whole]);
    assert!(out.contains(&format!("Ψ = {adapters})")), "{out}");
    let base: u64 = out.split("training a GPT of ").nth(1).and_then(|s| s.split(' ').next()).unwrap().parse().unwrap();
    let check = run_ok(&["config", "check", &config]);
    let want = format!("{adapters} trained parameters (adapters): ");
    assert!(
        check.contains(&want) && check.contains(&format!("; {base} frozen parameters (its shard in fp32)")),
        "{check}"
    );
    // `estimate` of the same model (it needs the vocabulary given: 13 characters, as train said).
    assert!(out.contains("vocabulary 13)"), "{out}");
    let sized =
        std::fs::read_to_string(&config).unwrap().replace(r#""block_size": 8"#, r#""block_size": 8, "vocab_size": 13"#);
    let sized_path = dir.join("sized.json");
    std::fs::write(&sized_path, sized).unwrap();
    let estimate = run_ok(&["estimate", "--model-config", sized_path.to_str().unwrap(), "--world-size", "2"]);
    assert!(
        estimate.contains(&format!(
            "LoRA (the config's precision and tiers): {adapters} trained parameters, {base} frozen"
        )),
        "{estimate}"
    );
    run_ok(&["train", "--config", &config, "--steps", "2", "--out", resumed]);
    let step2 = std::path::Path::new(resumed).join("checkpoints").join("global_step2");
    let file: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(step2.join("manifest.json")).unwrap()).unwrap();
    let layout = file["manifest"]["layout"].as_array().unwrap();
    assert!(file["manifest"]["buffers"].is_null(), "the frozen base is not saved: {}", file["manifest"]["buffers"]);
    assert!(
        layout.len() == 12 && layout.iter().all(|e| e["path"].as_str().unwrap().contains(".adapters.")),
        "{layout:?}"
    );
    run_ok(&["train", "--config", &config, "--steps", "4", "--out", resumed, "--resume", "--world-size", "1"]);
    let (a, b) = (losses(std::path::Path::new(whole)), losses(std::path::Path::new(resumed)));
    assert_eq!(b.iter().map(|l| l.0).collect::<Vec<_>>(), [1, 2, 3, 4], "{b:?}");
    for ((step, x), (_, y)) in a.iter().zip(&b) {
        assert!((x - y).abs() <= 1e-5 * x.abs(), "step {step}: {x} uninterrupted, {y} resumed on 1 rank");
    }
    // In 2 pipeline stages (one data-parallel rank accumulating the same global batch, ZeRO
    // stage 1), the same run.
    // Stage 1: stage 3 does not combine with a pipeline (as in DeepSpeed).
    let piped = std::fs::read_to_string(&config).unwrap().replacen('{', r#"{"pipeline": {"stages": 2}, "#, 1);
    let piped = piped.replace(r#""stage": 3"#, r#""stage": 1"#);
    let (piped_path, piped_run) = (dir.join("piped.json"), dir.join("piped"));
    std::fs::write(&piped_path, piped).unwrap();
    run_ok(&["train", "--config", piped_path.to_str().unwrap(), "--steps", "4", "--out", piped_run.to_str().unwrap()]);
    for ((step, x), (_, y)) in a.iter().zip(&losses(&piped_run)) {
        assert!((x - y).abs() <= 1e-5 * x.abs(), "step {step}: {x} on 2 ranks, {y} in 2 pipeline stages");
    }
    // `consolidate` writes the adapters, and says that is all a LoRA checkpoint holds.
    let exported = dir.join("adapters.safetensors");
    let ckpt = std::path::Path::new(resumed).join("checkpoints");
    let said = run_ok(&["consolidate", ckpt.to_str().unwrap(), "--out", exported.to_str().unwrap()]);
    assert!(
        said.contains(&format!("12 tensors, {adapters} parameters"))
            && said.contains(r#"not its frozen base ({"seed":42})"#),
        "{said}"
    );
    let reseeded = std::fs::read_to_string(&config).unwrap().replacen('{', r#"{"seed": 5, "#, 1);
    assert!(reseeded.contains(r#""seed": 5, "train_batch_size""#));
    let reseeded_path = dir.join("reseeded.json");
    std::fs::write(&reseeded_path, reseeded).unwrap();
    refused(
        &["train", "--config", reseeded_path.to_str().unwrap(), "--steps", "6", "--out", resumed, "--resume"],
        &["seed"],
    );
    // An NF4 base (QLoRA): `config check` gives each rank's share, the block's six matrices
    // in NF4 (computed here: half a byte a value in words of eight, four bytes a block of
    // 64), the rest (embeddings, norms, biases) in f32; it trains; at tp 2 the attention's
    // output projection would be cut into runs of 8 inputs, which its blocks of 64 cross:
    // refused naming it.
    let nf4 = with("nf4", r#", "quantize": "nf4""#);
    let matrices = [256u64, 256, 256, 256, 1024, 1024];
    let in_nf4: u64 = matrices.iter().map(|n| 4 * (n.div_ceil(8) + n.div_ceil(64))).sum();
    let share = (in_nf4 + 4 * (base - matrices.iter().sum::<u64>())).div_ceil(2);
    let check = run_ok(&["config", "check", &nf4]);
    assert!(
        check.contains("the layers' matrices in NF4") && check.contains(&format!("({share} bytes a rank)")),
        "{share}: {check}"
    );
    let nf4_run = dir.join("nf4-run");
    run_ok(&["train", "--config", &nf4, "--steps", "2", "--out", nf4_run.to_str().unwrap()]);
    assert_eq!(losses(&nf4_run).len(), 2);
    let tp_nf4 = std::fs::read_to_string(&nf4).unwrap().replacen('{', r#"{"tensor_parallel": {"autotp_size": 2}, "#, 1);
    let tp_nf4_path = dir.join("tp-nf4.json");
    std::fs::write(&tp_nf4_path, tp_nf4).unwrap();
    refused(
        &[
            "train",
            "--config",
            tp_nf4_path.to_str().unwrap(),
            "--steps",
            "1",
            "--out",
            dir.join("tp-nf4").to_str().unwrap(),
        ],
        &["zerotrain.lora.quantize", "blocks.0.attn.output.weight", "runs of 8", "multiple of 64"],
    );
    // On a mesh of 2 ranks (tp 2, or sp 2: one data-parallel rank accumulating the same
    // global batch), the same run: the adapters follow their bases' cuts.
    let tiny_json = std::fs::read_to_string(&config).unwrap();
    let tp = tiny_json.replacen('{', r#"{"tensor_parallel": {"autotp_size": 2}, "#, 1);
    let sp = tiny_json.replace(r#""zerotrain": {"#, r#""zerotrain": {"mesh": {"sp": 2}, "#);
    assert!(sp.contains(r#""sp": 2"#), "{sp}");
    for (how, json) in [("tp", tp), ("sp", sp)] {
        let (path, run) = (dir.join(format!("{how}.json")), dir.join(how));
        std::fs::write(&path, json).unwrap();
        run_ok(&["train", "--config", path.to_str().unwrap(), "--steps", "4", "--out", run.to_str().unwrap()]);
        for ((step, x), (_, y)) in a.iter().zip(&losses(&run)) {
            assert!((x - y).abs() <= 1e-5 * x.abs(), "step {step}: {x} on 2 data-parallel ranks, {y} at {how} 2");
        }
    }
    let adapter = dir.join("adapter");
    let plain = ["train", "--config", "configs/tiny.json", "--steps", "1", "--out", whole, "--adapter"];
    refused(&[&plain[..], &[adapter.to_str().unwrap()]].concat(), &["--adapter", "built-in GPT"]);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// QLoRA on the built-in GPT at tp 2 where every cut falls on NF4's blocks (width 128: the
/// row-parallel layers get runs of 64 and 256 inputs, the column-parallel ones whole
/// outputs of 128 inputs): each tensor-parallel rank quantises its parts to the whole
/// weights' NF4 values, so the run trains as 2 data-parallel ranks do with the same global
/// batch, its losses within 1e-5.
#[test]
fn qlora_on_the_built_in_gpt_splits_over_tp_where_its_cuts_fall_on_blocks() {
    let dir = folder("qlora-built-in-tp");
    let json = std::fs::read_to_string("configs/tiny.json")
        .unwrap()
        .replace(r#""n_embd": 16"#, r#""n_embd": 128"#)
        .replace(
            r#""eval_every": 2"#,
            r#""eval_every": 2, "lora": {"r": 4, "target_modules": "all-linear", "init_lora_weights": false, "quantize": "nf4"}"#,
        )
        .replace(r#""stage": 2"#, r#""stage": 3, "stage3_param_persistence_threshold": 0"#)
        .replacen('{', r#"{"train_batch_size": 8, "#, 1);
    assert!(json.contains(r#""n_embd": 128"#) && json.contains("nf4") && json.contains("threshold"), "{json}");
    let tp = json.replacen('{', r#"{"tensor_parallel": {"autotp_size": 2}, "#, 1);
    let runs: Vec<_> = [("dp", json), ("tp", tp)]
        .into_iter()
        .map(|(how, json)| {
            let (path, run) = (dir.join(format!("{how}.json")), dir.join(how));
            std::fs::write(&path, json).unwrap();
            run_ok(&["train", "--config", path.to_str().unwrap(), "--steps", "3", "--out", run.to_str().unwrap()]);
            losses(&run)
        })
        .collect();
    assert_eq!(runs[0].len(), 3);
    for ((step, x), (_, y)) in runs[0].iter().zip(&runs[1]) {
        assert!((x - y).abs() <= 1e-5 * x.abs(), "step {step}: {x} on 2 data-parallel ranks, {y} at tp 2");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}
