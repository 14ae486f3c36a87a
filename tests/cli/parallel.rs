//! Tensor and sequence parallelism from the command line: a Hugging Face family and the
//! built-in GPT trained on meshes of thread ranks, the family's checkpoints the whole
//! model's; shapes that cannot split refused by name.

use super::hf::{eval_json, folder, fresh_llama, losses, run_ok, train_args};
use super::{text, zerotrain};

/// LLaMA with 4 heads over 2 kv heads at `tensor_parallel.autotp_size` 2 on two thread
/// ranks: stopped at step 3 and resumed at tp 1 on one rank, and again at sequence
/// parallelism 2 (`zerotrain.mesh.sp`) on two, it trains steps 4..6 with the losses of the
/// run that never stopped (within 1e-5 relative: the same samples, the sums grouped
/// otherwise); `eval` at tp 1 reads the checkpoint the tp 2 run wrote (the whole
/// model) and scores it as the resumed run's final checkpoint within 1e-4 relative (one
/// more AdamW update than the last loss compared, which can move a parameter whose
/// gradient is near zero by up to the lr); its `consolidate --format hf` export scores as
/// the checkpoint does. Validation at sp 2, and `eval` and `generate` with the configs of
/// every mesh (tp 2, sp 2, two pipeline stages), agree with the whole model's.
#[test]
fn a_family_trains_on_a_tensor_parallel_mesh_and_resumes_whole() {
    let dir = folder("tensor-parallel");
    let tp = r#", "tensor_parallel": {"autotp_size": 2}"#;
    let (split, tokens) = fresh_llama(&dir, 2, tp);
    let (whole, _) = fresh_llama(&dir, 1, "");
    let model = r#"{"model_type": "llama", "hidden_size": 16, "intermediate_size": 24, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 280, "tie_word_embeddings": false}"#;
    std::fs::write(dir.join("model.json"), model).unwrap();
    let (uninterrupted, resumed) = (dir.join("uninterrupted"), dir.join("resumed"));
    run_ok(&train_args(&split, &tokens, "6", &uninterrupted, &[]));
    run_ok(&train_args(&split, &tokens, "3", &resumed, &[]));
    let sequence = dir.join("sp.json");
    let sp_config = std::fs::read_to_string(&split).unwrap().replace(tp, "");
    std::fs::write(&sequence, sp_config.replace(r#""world_size": 2"#, r#""world_size": 2, "mesh": {"sp": 2}"#))
        .unwrap();
    let at_sp = dir.join("at-sp");
    run_ok(&train_args(&split, &tokens, "3", &at_sp, &[]));
    run_ok(&train_args(&whole, &tokens, "6", &resumed, &["--resume"]));
    run_ok(&train_args(&sequence, &tokens, "6", &at_sp, &["--resume"]));
    let a = losses(&uninterrupted);
    // A fresh model starts where it starts at dp 2 (every value drawn from the seed and its
    // name), at tp 2 and at sp 2: the first losses agree within 1e-5 relative.
    let dp = dir.join("dp.json");
    std::fs::write(&dp, std::fs::read_to_string(&split).unwrap().replace(tp, "")).unwrap();
    let (at_dp, fresh_sp) = (dir.join("at-dp"), dir.join("fresh-sp"));
    run_ok(&train_args(&dp, &tokens, "1", &at_dp, &[]));
    run_ok(&train_args(&sequence, &tokens, "1", &fresh_sp, &[]));
    let first = losses(&at_dp)[0].1;
    for (how, loss) in [("tp 2", a[0].1), ("sp 2", losses(&fresh_sp)[0].1)] {
        assert!((loss - first).abs() <= 1e-5 * first, "a fresh model's first loss at {how} {loss}, at dp 2 {first}");
    }
    for (how, run) in [("at tp 1", &resumed), ("at sp 2", &at_sp)] {
        let b = losses(run);
        assert_eq!(b.iter().map(|l| l.0).collect::<Vec<_>>(), [1, 2, 3, 4, 5, 6], "{b:?}");
        for ((step, x), (_, y)) in a.iter().zip(&b) {
            assert!((x - y).abs() <= 1e-5 * x.abs(), "step {step}: {x} at tp 2 throughout, {y} resumed {how}");
        }
    }
    let score = |run: &std::path::Path| {
        eval_json(&whole, ["--tokens", tokens.to_str().unwrap()], Some(&run.join("checkpoints")))
    };
    let (at_tp2, at_tp1) = (score(&uninterrupted), score(&resumed));
    assert!(
        (at_tp2 - at_tp1).abs() <= 1e-4 * at_tp1,
        "eval of the tp 2 checkpoint {at_tp2}, of the resumed one {at_tp1}"
    );
    // Validation at sp 2 is the whole windows' loss (each rank's part averaged over the
    // sequence group): the sp run's last val_loss is the uninterrupted tp 2 run's, within
    // the bound above.
    let (val_tp2, val_sp) = (last_val_loss(&uninterrupted), last_val_loss(&at_sp));
    assert!((val_tp2 - val_sp).abs() <= 1e-4 * val_tp2, "val_loss at sp 2 {val_sp}, at tp 2 {val_tp2}");
    // `eval` and `generate` take the configs the model trained with: eval scores the same
    // checkpoint on the tp 2, sp 2 and pipelined meshes as whole (within 1e-5 relative: the
    // sums grouped otherwise), and greedy generation gives the same ids from each.
    let piped = dir.join("pp.json");
    let pp_config = std::fs::read_to_string(&split).unwrap().replace(tp, r#", "pipeline": {"stages": 2}"#);
    std::fs::write(&piped, pp_config).unwrap();
    let ckpt = uninterrupted.join("checkpoints");
    let greedy = |config: &std::path::Path| {
        let args = ["generate", "--config", config.to_str().unwrap(), "--checkpoint", ckpt.to_str().unwrap()];
        let out = run_ok(&[&args[..], &["--prompt", "the", "--tokens", "5", "--temperature", "0", "--json"]].concat());
        serde_json::from_str::<serde_json::Value>(&out).unwrap()["ids"].clone()
    };
    let want_ids = greedy(&whole);
    for (how, config) in [("tp 2", &split), ("sp 2", &sequence), ("pp 2", &piped)] {
        let got = eval_json(config, ["--tokens", tokens.to_str().unwrap()], Some(&ckpt));
        assert!((got - at_tp2).abs() <= 1e-5 * at_tp2, "eval on {how}: {got}, whole {at_tp2}");
        assert_eq!(greedy(config), want_ids, "generate with the {how} config");
    }
    // `consolidate --format hf` reads the tp 2 checkpoint as it would an unsplit run's: the
    // exported folder scores what the checkpoint does.
    let exported = dir.join("exported");
    let ckpt = uninterrupted.join("checkpoints");
    run_ok(&["consolidate", ckpt.to_str().unwrap(), "--format", "hf", "--out", exported.to_str().unwrap()]);
    let from_folder = dir.join("from-folder.json");
    let json = format!(
        r#"{{"train_batch_size": 1, "model": {{"hf_dir": {:?}, "block_size": 8}}}}"#,
        exported.display().to_string()
    );
    std::fs::write(&from_folder, json).unwrap();
    let folder_score = eval_json(&from_folder, ["--tokens", tokens.to_str().unwrap()], None);
    assert!(
        (folder_score - at_tp2).abs() <= 1e-6 * at_tp2,
        "the export scores {folder_score}, its checkpoint {at_tp2}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The validation loss of a run's last metrics line that has one.
fn last_val_loss(run: &std::path::Path) -> f64 {
    let metrics = std::fs::read_to_string(run.join("metrics.jsonl")).unwrap();
    let lines = metrics.lines().map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap());
    lines.filter_map(|v| v["val_loss"].as_f64()).next_back().expect("a validation loss")
}

/// The built-in GPT on a mesh of two thread ranks, at tp 2 (`tensor_parallel.autotp_size`)
/// and at sp 2 (`zerotrain.mesh.sp`), and in two pipeline stages of tp 2 or sp 2 each (four ranks),
/// trains with the losses of the same job at dp 2 within 1e-5 relative: every rank's part
/// is cut from the model the run at dp 2 starts from, the same global batch is read, and
/// only the sums' grouping differs (two micro-batches a step, so that each rank's place in
/// the batch matters). The tp 2 run's checkpoint resumes at dp 2 with the next losses of the
/// dp 2 run; two replica groups (`local_sgd`) of tp 2 each train as two groups of whole
/// models, within the same bound, through two rounds.
#[test]
fn the_built_in_gpt_trains_on_a_mesh_as_it_does_whole() {
    let dir = folder("builtin-mesh");
    let runs = [
        ("dp", r#"{"train_batch_size": 8, "gradient_accumulation_steps": 2, "zerotrain": {"world_size": 2}}"#),
        (
            "tp",
            r#"{"train_batch_size": 8, "gradient_accumulation_steps": 2, "tensor_parallel": {"autotp_size": 2}, "zerotrain": {"world_size": 2}}"#,
        ),
        (
            "sp",
            r#"{"train_batch_size": 8, "gradient_accumulation_steps": 2, "zerotrain": {"world_size": 2, "mesh": {"sp": 2}}}"#,
        ),
        (
            "pp-tp",
            r#"{"train_batch_size": 8, "gradient_accumulation_steps": 2, "pipeline": {"stages": 2}, "tensor_parallel": {"autotp_size": 2},
                "zerotrain": {"world_size": 4}}"#,
        ),
        (
            "pp-sp",
            r#"{"train_batch_size": 8, "gradient_accumulation_steps": 2, "pipeline": {"stages": 2}, "zerotrain": {"world_size": 4, "mesh": {"sp": 2}}}"#,
        ),
    ];
    // The job of config `json` (written as `name.json`) trained to `steps` into the folder
    // `out` (resuming it where `resume` says): its losses.
    let train = |name: &str, json: &str, (steps, out, resume): (&str, &str, bool)| {
        let (config, out) = (dir.join(format!("{name}.json")), dir.join(out));
        std::fs::write(&config, json).unwrap();
        let mut args = vec!["train", "--config", config.to_str().unwrap(), "--steps", steps];
        args.extend(["--out", out.to_str().unwrap()]);
        args.extend(resume.then_some("--resume"));
        run_ok(&args);
        losses(&out)
    };
    let seen: Vec<_> = runs.iter().map(|(name, json)| train(name, json, ("4", name, false))).collect();
    assert_eq!(seen[0].iter().map(|l| l.0).collect::<Vec<_>>(), [1, 2, 3, 4], "{:?}", seen[0]);
    for (run, (name, _)) in seen.iter().zip(runs).skip(1) {
        assert_eq!(run.len(), seen[0].len(), "{name}");
        for ((step, x), (_, y)) in seen[0].iter().zip(run) {
            assert!((x - y).abs() <= 1e-5 * x.abs(), "{name}, step {step}: {y}, at dp 2 {x}");
        }
    }
    // The tp 2 run's checkpoint (the whole model's) resumes at dp 2 with the losses of the
    // dp 2 run that went on.
    let dp = runs[0].1;
    let (went_on, resumed) = (train("dp", dp, ("6", "dp", true)), train("dp", dp, ("6", "tp", true)));
    assert_eq!(resumed.iter().map(|l| l.0).collect::<Vec<_>>(), [1, 2, 3, 4, 5, 6], "{resumed:?}");
    for ((step, x), (_, y)) in went_on.iter().zip(&resumed).skip(4) {
        assert!((x - y).abs() <= 1e-5 * x.abs(), "step {step}: {y} resumed from tp 2 at dp 2, {x} at dp 2 throughout");
    }
    // Replica groups, each a mesh of tp 2, against the same groups of whole models: the
    // rounds average each tensor part between the groups as they average whole shards.
    let groups = r#"{"train_batch_size": 8, "gradient_accumulation_steps": 2,
        "local_sgd": {"groups": 2, "sync_every": 2}, "zerotrain": {"world_size": 2}}"#;
    let of_meshes = groups.replace(r#""world_size": 2"#, r#""world_size": 4, "mesh": {"tp": 2}"#);
    let seen =
        [train("groups", groups, ("4", "groups", false)), train("groups-tp", &of_meshes, ("4", "groups-tp", false))];
    assert_eq!(seen[1].len(), 4, "{:?}", seen[1]);
    for ((step, x), (_, y)) in seen[0].iter().zip(&seen[1]) {
        assert!((x - y).abs() <= 1e-5 * x.abs(), "groups of tp 2, step {step}: {y}, of whole models {x}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Shapes that cannot split are refused by the config field before anything trains: the
/// built-in GPT's heads that do not divide over the mesh (`model.n_head`), a family whose
/// kv heads do not (`num_key_value_heads`).
#[test]
fn models_that_cannot_split_are_refused_by_name() {
    let dir = folder("tensor-parallel-refused");
    let builtin = dir.join("builtin.json");
    std::fs::write(
        &builtin,
        r#"{"train_batch_size": 2, "model": {"n_head": 2}, "tensor_parallel": {"autotp_size": 4},
            "zerotrain": {"world_size": 4}}"#,
    )
    .unwrap();
    let out = zerotrain(&[
        "train",
        "--config",
        builtin.to_str().unwrap(),
        "--steps",
        "1",
        "--out",
        dir.join("a").to_str().unwrap(),
    ]);
    let err = text(&out.stderr);
    assert!(
        !out.status.success()
            && err.contains("model.n_head (2) does not divide by the tensor- times the sequence-parallel size 4 x 1"),
        "{err}"
    );
    assert!(!dir.join("a").join("metrics.jsonl").exists(), "refused before it trained");
    let (kv1, tokens) = fresh_llama(&dir, 2, r#", "tensor_parallel": {"autotp_size": 2}"#);
    let out = zerotrain(&train_args(&kv1, &tokens, "1", &dir.join("b"), &[]));
    let err = text(&out.stderr);
    assert!(
        !out.status.success()
            && err.contains("`num_key_value_heads` (1) does not divide by the tensor-parallel size 2"),
        "{err}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}
