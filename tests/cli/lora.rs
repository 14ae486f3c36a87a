//! LoRA fine-tuning of the Hugging Face families (`zerotrain.lora`, `--adapter`,
//! `consolidate --format peft`): gradients against numpy's differences
//! (`bench/reference/lora.py`), the same run at every stage, world size, accumulation and
//! tensor-parallel size, PEFT's files written and read, and bad input refused by name.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use burn::module::{ModuleVisitor, Param};
use burn::tensor::{Device, Int, Tensor, TensorData};
use zerotrain_models::CausalLm;
use zerotrain_models::family::{self, Adapters, WithModel};
use zerotrain_models::hf::peft::{self, AdapterFolder};

use super::{folder, fresh_llama, reference, run_ok, train_args};
use crate::{text, zerotrain};

/// Runs `bench/reference/lora.py`; its stdout.
fn lora_reference(args: &[&str]) -> String {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/bench/reference/lora.py");
    let out = std::process::Command::new("python3").arg(script).args(args).output().expect("python3 runs");
    assert!(out.status.success(), "lora.py {args:?}: {}", text(&out.stderr));
    text(&out.stdout)
}

/// `zerotrain eval --json`'s loss of `config`'s model on the text file `text`, `extra`
/// (`--adapter DIR`, `--checkpoint DIR`) added.
pub(crate) fn text_loss(config: &Path, text: &Path, extra: &[&str]) -> f64 {
    let mut args = vec!["eval", "--config", config.to_str().unwrap(), "--text", text.to_str().unwrap(), "--json"];
    args.extend(extra);
    super::number(&run_ok(&args), "loss")
}

/// The loss of `tokens` `[1, n]` and the gradient of every float tensor that got one, by
/// PEFT's name (adapters) or module path (anything else: it should have none).
struct Gradients(Tensor<2, Int>);

impl WithModel for Gradients {
    type Output = (f64, BTreeMap<String, Vec<f32>>);

    fn run<M: CausalLm>(self, model: M) -> Self::Output {
        let loss = model.next_token_loss(&self.0);
        let value = f64::from(loss.clone().into_data().iter::<f32>().next().expect("a loss"));
        let grads = loss.backward();
        struct Collect<'a> {
            path: Vec<String>,
            grads: &'a burn::tensor::Gradients,
            out: BTreeMap<String, Vec<f32>>,
        }
        impl ModuleVisitor for Collect<'_> {
            fn enter_module(&mut self, name: &str, _: &str) {
                self.path.push(name.to_string());
            }
            fn exit_module(&mut self, _: &str, _: &str) {
                self.path.pop();
            }
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
                if let Some(grad) = param.val().grad(self.grads) {
                    let path = self.path.join(".");
                    let name = peft::tensor_name(&path).unwrap_or(path);
                    self.out.insert(name, grad.into_data().iter::<f32>().collect());
                }
            }
        }
        let mut collect = Collect { path: Vec::new(), grads: &grads, out: BTreeMap::new() };
        model.visit(&mut collect);
        (value, collect.out)
    }
}

/// The largest difference as a share of the reference's largest value.
fn relative(got: &[f32], want: &[f64]) -> f64 {
    assert_eq!(got.len(), want.len());
    let scale = want.iter().fold(0f64, |m, v| m.max(v.abs())).max(1e-30);
    got.iter().zip(want).fold(0f64, |m, (g, w)| m.max((f64::from(*g) - w).abs())) / scale
}

/// A random adapter PEFT's format holds (made by numpy, B not zero) on GPT-2's Conv1D
/// layers (`c_attn`, both `c_proj`, `c_fc`) and on every linear layer of a LLaMA with
/// grouped kv heads (rslora): zerotrain's loss and every adapter gradient equal numpy's
/// float64 loss of the merged model and its central differences within 1e-5, and no base
/// parameter gets a gradient.
#[test]
#[ignore = "needs python3 with numpy, safetensors, tokenizers and ml_dtypes; .ci/run runs it"]
fn adapter_gradients_match_numpy_differences_for_gpt2_and_llama() {
    let dir = folder("lora-grads");
    let cases: [(&str, &[&str], &str); 2] = [
        ("gpt2", &["--family", "gpt2"], r#"{"r": 2, "lora_alpha": 3, "target_modules": ["c_attn", "c_proj", "c_fc"]}"#),
        (
            "llama-gqa",
            &["--family", "llama", "--kv-heads", "2"],
            r#"{"r": 2, "lora_alpha": 4, "use_rslora": true, "target_modules": "all-linear"}"#,
        ),
    ];
    let ids: Vec<i64> = vec![5, 17, 42, 99, 3, 250, 8, 61, 120];
    for (name, args, lora) in cases {
        let (hf, adapter) = (dir.join(name), dir.join(format!("{name}-adapter")));
        reference(&[&["make", hf.to_str().unwrap()], args].concat());
        lora_reference(&["adapter", hf.to_str().unwrap(), adapter.to_str().unwrap(), "--config", lora]);
        let ids_json = serde_json::to_string(&ids).unwrap();
        let want: serde_json::Value = serde_json::from_str(
            lora_reference(&["grads", hf.to_str().unwrap(), adapter.to_str().unwrap(), "--ids", &ids_json]).trim(),
        )
        .unwrap();
        let folder = AdapterFolder::read(&adapter).unwrap();
        let adapters = Adapters::from_folder(&folder);
        let groups = zerotrain::nn::parallel::ParallelGroups::alone();
        let device = Device::flex().autodiff();
        let (_, model) = family::import_adapted(&hf, &device, &groups, Some(&adapters), 0).unwrap();
        let tokens = Tensor::<2, Int>::from_data(TensorData::new(ids.clone(), [1, ids.len()]), &device);
        let (loss, grads) = model.run(Gradients(tokens));
        let want_loss = want["loss"].as_f64().unwrap();
        assert!((loss - want_loss).abs() / want_loss < 1e-5, "{name}: loss {loss} vs numpy {want_loss}");
        let expected = want["grads"].as_object().unwrap();
        let got_names: Vec<&String> = grads.keys().collect();
        let want_names: Vec<&String> = expected.keys().collect();
        assert_eq!(got_names, want_names, "{name}: only the adapters get gradients");
        for (tensor, values) in expected {
            let values: Vec<f64> = values.as_array().unwrap().iter().map(|v| v.as_f64().unwrap()).collect();
            let error = relative(&grads[tensor], &values);
            assert!(error < 1e-5, "{name}: {tensor}'s gradient is {error:e} off numpy's");
        }
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A config training `model.json` with `lora` on `world` ranks at `stage`, `micro` sequences
/// per rank (a global batch of 6), on a mesh of `tp`.
pub(super) fn lora_config(dir: &Path, name: &str, layout: (usize, u8, usize, usize), lora: &str) -> PathBuf {
    lora_config_with(dir, name, layout, lora, "")
}

/// [`lora_config`] with `zero` added to its `zero_optimization` section (offload tiers).
fn lora_config_with(
    dir: &Path,
    name: &str,
    (world, stage, micro, tp): (usize, u8, usize, usize),
    lora: &str,
    zero: &str,
) -> PathBuf {
    let config = dir.join(format!("{name}.json"));
    let mesh = if tp > 1 { format!(r#", "mesh": {{"tp": {tp}}}"#) } else { String::new() };
    let json = format!(
        r#"{{"train_batch_size": 6, "train_micro_batch_size_per_gpu": {micro},
            "zero_optimization": {{"stage": {stage}, "stage3_param_persistence_threshold": 0{zero}}},
            "optimizer": {{"type": "AdamW", "params": {{"lr": 0.02}}}},
            "zerotrain": {{"world_size": {world}, "eval_every": 100, "lora": {lora}{mesh}}},
            "model": {{"hf_config": "model-kv2.json", "tokenizer": "tokenizer.json", "block_size": 8}}}}"#
    );
    std::fs::write(&config, json).unwrap();
    config
}

/// The adapter tensors of a PEFT folder, by name.
fn adapter_tensors(dir: &Path) -> BTreeMap<String, (Vec<usize>, Vec<f32>)> {
    let bytes = std::fs::read(dir.join(peft::ADAPTER_WEIGHTS_FILE)).unwrap();
    let file = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    file.tensors()
        .into_iter()
        .map(|(name, t)| {
            let values = t.data().chunks(4).map(|b| f32::from_le_bytes(b.try_into().unwrap())).collect();
            (name, (t.shape().to_vec(), values))
        })
        .collect()
}

/// LoRA on every linear layer trains the same run (losses within 1e-5, adapters within 2e-5
/// after 3 AdamW steps) at stages 0-3, on 1, 2 and 3 ranks, with 1 and 3 micro-batches per
/// step, with the optimizer state in host memory and on NVMe and the stage-3 shards on NVMe,
/// and on a tensor-parallel mesh of 2 against the unsplit run; the checkpoint holds the
/// adapters alone, which `consolidate --format peft` writes under PEFT's names and shapes,
/// with an `adapter_config.json` that reads back as the config trained.
#[test]
fn lora_trains_the_same_run_at_every_stage_world_size_accumulation_and_mesh() {
    let dir = folder("lora-layouts");
    let (_, tokens) = fresh_llama(&dir, 1, "");
    let model = r#"{"model_type": "llama", "hidden_size": 16, "intermediate_size": 24, "num_hidden_layers": 2,
        "num_attention_heads": 2, "num_key_value_heads": 2, "vocab_size": 280, "tie_word_embeddings": true}"#;
    std::fs::write(dir.join("model-kv2.json"), model).unwrap();
    let lora = r#"{"r": 2, "lora_alpha": 4, "target_modules": "all-linear", "init_lora_weights": false}"#;
    let nvme = |what: &str| format!(r#""nvme_path": {:?}"#, dir.join(what).display().to_string());
    let tiers = [
        String::new(),
        r#", "offload_optimizer": {"device": "cpu"}"#.to_string(),
        format!(
            r#", "offload_optimizer": {{"device": "nvme", {}}}, "offload_param": {{"device": "nvme", {}}}"#,
            nvme("opt"),
            nvme("param")
        ),
    ];
    let layouts = [
        ((1, 0, 6, 1), 0),
        ((1, 3, 2, 1), 0),
        ((2, 1, 3, 1), 0),
        ((2, 3, 1, 1), 0),
        ((3, 2, 2, 1), 0),
        ((3, 3, 2, 1), 0),
        ((2, 0, 6, 2), 0),
        ((2, 2, 3, 1), 1),
        ((2, 3, 3, 1), 2),
    ];
    let mut runs = Vec::new();
    for (layout, tier) in layouts {
        let name = format!("w{}-s{}-m{}-tp{}-t{tier}", layout.0, layout.1, layout.2, layout.3);
        let config = lora_config_with(&dir, &name, layout, lora, &tiers[tier]);
        let run = dir.join(format!("run-{name}"));
        run_ok(&train_args(&config, &tokens, "3", &run, &[]));
        let out = dir.join(format!("peft-{name}"));
        let ckpt = run.join("checkpoints");
        run_ok(&["consolidate", ckpt.to_str().unwrap(), "--format", "peft", "--out", out.to_str().unwrap()]);
        runs.push((name, super::losses(&run), adapter_tensors(&out), out));
    }
    let (first, losses, tensors, out) = &runs[0];
    // 2 layers x 7 projections, two factors each, PEFT's names and shapes ([r, in], [out, r]).
    assert_eq!(tensors.len(), 28, "{:?}", tensors.keys());
    let (a_shape, _) = &tensors["base_model.model.model.layers.1.mlp.down_proj.lora_A.weight"];
    let (b_shape, _) = &tensors["base_model.model.model.layers.0.self_attn.k_proj.lora_B.weight"];
    assert_eq!((a_shape.as_slice(), b_shape.as_slice()), ([2, 24].as_slice(), [16, 2].as_slice()));
    let written = AdapterFolder::read(out).unwrap();
    assert_eq!((written.config.r, written.config.lora_alpha), (2, 4.0));
    assert_eq!(losses.len(), 3);
    for (name, other_losses, other, _) in &runs[1..] {
        for ((step, a), (_, b)) in losses.iter().zip(other_losses) {
            assert!((a - b).abs() <= 1e-5 * a.abs(), "step {step}: {first} {a}, {name} {b}");
        }
        for (tensor, (_, values)) in tensors {
            let theirs = &other[tensor].1;
            let worst = values.iter().zip(theirs).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
            assert!(worst <= 2e-5, "{tensor}: {first} and {name} differ by {worst}");
        }
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// What a LoRA config or an adapter gets wrong is refused naming it: target_modules that
/// match nothing (with module paths that exist), r 0, a dropout of 1, a modules_to_save that
/// is no module, an adapter made for another base (a tensor's shape), a zerotrain.lora that
/// disagrees with the adapter's own config; and --format peft of a run without LoRA.
#[test]
fn bad_lora_configs_and_adapters_are_refused_by_name() {
    let dir = folder("lora-refusals");
    let (_, tokens) = fresh_llama(&dir, 1, "");
    let model = r#"{"model_type": "llama", "hidden_size": 16, "intermediate_size": 24, "num_hidden_layers": 2,
        "num_attention_heads": 2, "num_key_value_heads": 2, "vocab_size": 280, "tie_word_embeddings": true}"#;
    std::fs::write(dir.join("model-kv2.json"), model).unwrap();
    let fails = |name: &str, lora: &str, extra: &[&str]| {
        let config = lora_config(&dir, name, (1, 0, 6, 1), lora);
        let run = dir.join(format!("run-{name}"));
        let out = zerotrain(&train_args(&config, &tokens, "1", &run, extra));
        assert!(!out.status.success(), "{name} trained");
        text(&out.stderr)
    };
    let e = fails("none", r#"{"target_modules": ["qproj"]}"#, &[]);
    assert!(
        e.contains(r#"target_modules ["qproj"] matches none"#) && e.contains("model.layers.0.self_attn.q_proj"),
        "{e}"
    );
    let e = fails("r0", r#"{"r": 0}"#, &[]);
    assert!(e.contains("zerotrain.lora.r") && e.contains("at least 1"), "{e}");
    let e = fails("dropout", r#"{"lora_dropout": 1.0}"#, &[]);
    assert!(e.contains("zerotrain.lora.lora_dropout") && e.contains("[0, 1)"), "{e}");
    let e = fails("save", r#"{"modules_to_save": ["score"]}"#, &[]);
    assert!(e.contains("modules_to_save") && e.contains("\"score\""), "{e}");
    // An adapter trained here, then given to a wider model and to a config that disagrees.
    let config = lora_config(&dir, "ok", (1, 0, 6, 1), r#"{"r": 2, "target_modules": ["q_proj"]}"#);
    let run = dir.join("run-ok");
    run_ok(&train_args(&config, &tokens, "1", &run, &[]));
    let adapter = dir.join("adapter");
    let ckpt = run.join("checkpoints");
    run_ok(&["consolidate", ckpt.to_str().unwrap(), "--format", "peft", "--out", adapter.to_str().unwrap()]);
    let e = fails("rank", r#"{"r": 4, "target_modules": ["q_proj"]}"#, &["--adapter", adapter.to_str().unwrap()]);
    assert!(e.contains("zerotrain.lora.r disagrees") && e.contains("adapter_config.json"), "{e}");
    let wide = model.replace(r#""hidden_size": 16"#, r#""hidden_size": 24"#);
    std::fs::write(dir.join("model-kv2.json"), wide).unwrap();
    let e = fails("other-base", r#"{"r": 2, "target_modules": ["q_proj"]}"#, &["--adapter", adapter.to_str().unwrap()]);
    assert!(e.contains("lora_A.weight` has shape [2, 16]") && e.contains("another base"), "{e}");
    let (whole, _) = fresh_llama(&dir, 1, "");
    let plain = dir.join("run-plain");
    run_ok(&train_args(&whole, &tokens, "1", &plain, &[]));
    let out = zerotrain(&[
        "consolidate",
        plain.join("checkpoints").to_str().unwrap(),
        "--format",
        "peft",
        "--out",
        dir.join("nope").to_str().unwrap(),
    ]);
    assert!(text(&out.stderr).contains("was not trained with zerotrain.lora"), "{}", text(&out.stderr));
    std::fs::remove_dir_all(&dir).unwrap();
}

/// PEFT's own numbers, made once with torch by `bench/reference/peft_fixture.py` from inputs
/// numpy re-creates here (a checkpoint, a text, a random adapter in PEFT's format, each from
/// a seed): `zerotrain eval --adapter` scores the text as `PeftModel.from_pretrained` does,
/// within 1e-5, on one rank and at stage 3 on two; and the `adapter_config.json` PEFT writes
/// when it saves that adapter reads in zerotrain as the same config, its tensors named as
/// the adapter zerotrain read; and the case's config trains as many parameters in zerotrain
/// (`config check`) as in PEFT. A case trains whole modules beside its adapters
/// (`modules_to_save`: every MLP, with a target inside it that PEFT leaves unadapted, and
/// every module whose path ends in `norm`).
#[test]
#[ignore = "needs python3 with numpy, safetensors, tokenizers and ml_dtypes; .ci/run runs it"]
fn an_adapter_scores_in_zerotrain_as_peft_scores_it() {
    let fixture: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/bench/reference/peft_lora.json")).unwrap(),
    )
    .unwrap();
    let dir = folder("lora-peft");
    let text_file = dir.join("text.txt");
    let text_args: Vec<&str> = fixture["text"].as_array().unwrap().iter().map(|v| v.as_str().unwrap()).collect();
    reference(&[&["text", text_file.to_str().unwrap()], text_args.as_slice()].concat());
    assert_eq!(fixture["context"], 16, "the configs here evaluate at 16");
    for case in fixture["cases"].as_array().unwrap() {
        let name = case["name"].as_str().unwrap();
        let (hf, adapter) = (dir.join(name), dir.join(format!("{name}-adapter")));
        let make: Vec<&str> = case["make"].as_array().unwrap().iter().map(|v| v.as_str().unwrap()).collect();
        reference(&[&["make", hf.to_str().unwrap()], make.as_slice()].concat());
        let lora = case["lora"].to_string();
        lora_reference(&["adapter", hf.to_str().unwrap(), adapter.to_str().unwrap(), "--config", &lora]);
        let want = case["peft_loss"].as_f64().unwrap();
        for (world, stage) in [(1, 0), (2, 3)] {
            let config = super::config(&dir, &hf, world, stage, "");
            let got = text_loss(&config, &text_file, &["--adapter", adapter.to_str().unwrap()]);
            assert!((got - want).abs() / want < 1e-5, "{name} on {world} rank(s): {got} vs PEFT's {want}");
        }
        // PEFT's own adapter_config.json, beside the same tensors.
        let saved = dir.join(format!("{name}-as-peft-saves"));
        std::fs::create_dir_all(&saved).unwrap();
        std::fs::copy(adapter.join(peft::ADAPTER_WEIGHTS_FILE), saved.join(peft::ADAPTER_WEIGHTS_FILE)).unwrap();
        std::fs::write(saved.join(peft::ADAPTER_CONFIG_FILE), case["peft_written_config"].to_string()).unwrap();
        let (ours, theirs) = (AdapterFolder::read(&adapter).unwrap(), AdapterFolder::read(&saved).unwrap());
        // PEFT writes "all-linear" resolved into the layers' names; the rest is as given.
        assert_eq!(theirs.config.first_difference(&ours.config).filter(|k| *k != "target_modules"), None, "{name}");
        let config = super::config(&dir, &hf, 1, 0, "");
        let got = text_loss(&config, &text_file, &["--adapter", saved.to_str().unwrap()]);
        assert!((got - want).abs() / want < 1e-5, "{name} with PEFT's config: {got} vs {want}");
        let names: Vec<String> = adapter_tensors(&adapter).into_keys().collect();
        let peft_names: Vec<String> =
            case["peft_tensor_names"].as_array().unwrap().iter().map(|v| v.as_str().unwrap().to_string()).collect();
        assert_eq!(names, peft_names, "{name}: PEFT saves the tensors under the names zerotrain reads");
        // The case's LoraConfig trains in zerotrain what it trains in PEFT (get_peft_model).
        let fresh = dir.join(format!("{name}-fresh.json"));
        let json = format!(
            r#"{{"train_micro_batch_size_per_gpu": 1, "zerotrain": {{"world_size": 1, "lora": {lora}}},
                "model": {{"hf_dir": {:?}, "block_size": 16}}}}"#,
            hf.display().to_string()
        );
        std::fs::write(&fresh, json).unwrap();
        let check = run_ok(&["config", "check", fresh.to_str().unwrap()]);
        let trained = check.split(" trained parameters").next().and_then(|s| s.rsplit(' ').next()).unwrap();
        assert_eq!(
            trained,
            case["peft_trainable_params"].to_string(),
            "{name}: zerotrain trains, PEFT trains: {check}"
        );
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A LoRA run (3 steps at stage 3 on two ranks, GPT-2's Conv1D and a GQA LLaMA) consolidated
/// with `--merge` is a Hugging Face folder without adapters that scores a text as the base
/// with the exported adapter does (`eval --adapter`), and as numpy's forward pass of it
/// does, within 1e-5; `--format hf` without `--merge` says what to use instead. With the
/// base's files changed since, merging and resuming are refused naming a tensor.
#[test]
#[ignore = "needs python3 with numpy, safetensors, tokenizers and ml_dtypes; .ci/run runs it"]
fn a_merged_export_scores_as_the_base_with_its_adapter() {
    let dir = folder("lora-merge");
    let text_file = dir.join("text.txt");
    reference(&["text", text_file.to_str().unwrap(), "--bytes", "6000"]);
    for (name, args) in
        [("gpt2", &["--family", "gpt2"][..]), ("llama-gqa", &["--family", "llama", "--kv-heads", "2"][..])]
    {
        let hf = dir.join(name);
        reference(&[&["make", hf.to_str().unwrap()], args].concat());
        let lora = r#"{"r": 4, "lora_alpha": 8, "target_modules": "all-linear", "rank_pattern": {"c_fc": 2}}"#;
        let trained = dir.join(format!("train-{name}.json"));
        let json = format!(
            r#"{{"train_batch_size": 4, "zero_optimization": {{"stage": 3}},
                "optimizer": {{"type": "AdamW", "params": {{"lr": 0.02}}}},
                "zerotrain": {{"world_size": 2, "lora": {lora}}}, "model": {{"hf_dir": {:?}, "block_size": 16}}}}"#,
            hf.display().to_string()
        );
        std::fs::write(&trained, json).unwrap();
        let run = dir.join(format!("run-{name}"));
        run_ok(&train_args(&trained, &text_file, "3", &run, &[]));
        let ckpt = run.join("checkpoints");
        let (adapter, merged) = (dir.join(format!("{name}-peft")), dir.join(format!("{name}-merged")));
        run_ok(&["consolidate", ckpt.to_str().unwrap(), "--format", "peft", "--out", adapter.to_str().unwrap()]);
        run_ok(&[
            "consolidate",
            ckpt.to_str().unwrap(),
            "--format",
            "hf",
            "--merge",
            "--out",
            merged.to_str().unwrap(),
        ]);
        let out = zerotrain(&[
            "consolidate",
            ckpt.to_str().unwrap(),
            "--format",
            "hf",
            "--out",
            dir.join("x").to_str().unwrap(),
        ]);
        assert!(text(&out.stderr).contains("--merge"), "{}", text(&out.stderr));
        let with_adapter =
            text_loss(&super::config(&dir, &hf, 1, 0, ""), &text_file, &["--adapter", adapter.to_str().unwrap()]);
        let merged_loss = text_loss(&super::config(&dir, &merged, 1, 0, ""), &text_file, &[]);
        let numpy = super::number(
            &reference(&["loss", merged.to_str().unwrap(), text_file.to_str().unwrap(), "--context", "16"]),
            "loss",
        );
        for (what, got) in [("merged", merged_loss), ("numpy of the merged folder", numpy)] {
            assert!(
                (got - with_adapter).abs() / with_adapter < 1e-5,
                "{name}: {what} {got}, base + adapter {with_adapter}"
            );
        }
        let base = text_loss(&super::config(&dir, &hf, 1, 0, ""), &text_file, &[]);
        assert!((base - with_adapter).abs() > 1e-4, "{name}: the adapter changes the loss");
        // The base changed under the run (same shapes, other values): refused by tensor.
        reference(&[&["make", hf.to_str().unwrap(), "--seed", "2"], args].concat());
        let again = dir.join(format!("{name}-merged-again"));
        let out = zerotrain(&[
            "consolidate",
            ckpt.to_str().unwrap(),
            "--format",
            "hf",
            "--merge",
            "--out",
            again.to_str().unwrap(),
        ]);
        let e = text(&out.stderr);
        assert!(!out.status.success() && e.contains("differs from the one the checkpoint was trained on"), "{e}");
        let out = zerotrain(&train_args(&trained, &text_file, "4", &run, &["--resume"]));
        let e = text(&out.stderr);
        assert!(!out.status.success() && e.contains("frozen base differs") && e.contains("tensor `"), "{e}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Writes `model-kv2.json` (the name [`lora_config`] reads) as a LLaMA of width 16, 2 layers,
/// 2 heads and one key-value head of width 8, MLP 24, vocabulary 280, tied head.
pub(super) fn write_kv1_llama(dir: &Path) {
    let model = r#"{"model_type": "llama", "hidden_size": 16, "intermediate_size": 24, "num_hidden_layers": 2,
        "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 280, "tie_word_embeddings": true}"#;
    std::fs::write(dir.join("model-kv2.json"), model).unwrap();
}

/// `config check` of a LoRA config counts the trained and frozen parameters of its model
/// (counted here from the shapes: r x (in + out) per adapted projection), says what trains,
/// and refuses what `train` refuses.
#[test]
fn config_check_counts_trained_and_frozen_parameters() {
    let dir = folder("lora-check");
    let (_, _) = fresh_llama(&dir, 1, "");
    write_kv1_llama(&dir);
    let config = lora_config(&dir, "check", (2, 3, 3, 1), r#"{"r": 2, "target_modules": ["q_proj", "down_proj"]}"#);
    let printed = run_ok(&["config", "check", config.to_str().unwrap()]);
    // q: 16 -> 16, down: 24 -> 16; kv heads 1 of width 8.
    let trained = 2 * (2 * (16 + 16) + 2 * (24 + 16));
    let layer = 16 * 16 + 2 * (8 * 16) + 16 * 16 + 3 * (24 * 16) + 2 * 16;
    let frozen = 280 * 16 + 2 * layer + 16;
    assert!(printed.contains(&format!("{trained} trained parameters (adapters)")), "{printed}");
    assert!(printed.contains(&format!("{frozen} frozen parameters")), "{printed}");
    assert!(printed.contains("lora                r 2, alpha 8 (scaling 4)"), "{printed}");
    assert!(printed.contains("the frozen base sharded over the ranks with the parameters"), "{printed}");
    let bad = lora_config(&dir, "bad", (2, 3, 3, 1), r#"{"target_modules": ["qproj"]}"#);
    let out = zerotrain(&["config", "check", bad.to_str().unwrap()]);
    assert!(!out.status.success() && text(&out.stderr).contains("matches none"), "{}", text(&out.stderr));
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A LoRA run's checkpoint holds what trains and nothing of the frozen base (no buffers:
/// the base is built again from its source on resume), so a run stopped at step 2 on a
/// tensor-parallel mesh of 2 and resumed on one rank trains steps 3 and 4 as a run that
/// never stopped (losses within 1e-5, adapters within 2e-5): each tensor rank's part of the
/// base comes from the model, not from a saved slice.
#[test]
fn a_lora_checkpoint_holds_no_base_and_resumes_on_another_mesh() {
    let dir = folder("lora-resume");
    let (_, tokens) = fresh_llama(&dir, 1, "");
    let model = r#"{"model_type": "llama", "hidden_size": 16, "intermediate_size": 24, "num_hidden_layers": 2,
        "num_attention_heads": 2, "num_key_value_heads": 2, "vocab_size": 280, "tie_word_embeddings": true}"#;
    std::fs::write(dir.join("model-kv2.json"), model).unwrap();
    let lora = r#"{"r": 2, "lora_alpha": 4, "target_modules": "all-linear", "init_lora_weights": false}"#;
    let (one, mesh) = (lora_config(&dir, "one", (1, 0, 6, 1), lora), lora_config(&dir, "mesh", (2, 3, 6, 2), lora));
    let (whole, resumed) = (dir.join("whole"), dir.join("resumed"));
    run_ok(&train_args(&one, &tokens, "4", &whole, &[]));
    run_ok(&train_args(&mesh, &tokens, "2", &resumed, &[]));
    let step2 = resumed.join("checkpoints").join("global_step2");
    let file: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(step2.join("manifest.json")).unwrap()).unwrap();
    let manifest = &file["manifest"];
    assert!(manifest["buffers"].is_null(), "the frozen base is not saved: {}", manifest["buffers"]);
    let layout = manifest["layout"].as_array().unwrap();
    assert!(layout.len() == 28 && layout.iter().all(|e| e["path"].as_str().unwrap().contains(".adapter.")));
    assert!(!step2.join(zerotrain_checkpoint::BUFFERS_FILE).exists());
    run_ok(&train_args(&one, &tokens, "4", &resumed, &["--resume"]));
    let (a, b) = (super::losses(&whole), super::losses(&resumed));
    assert_eq!(b.iter().map(|l| l.0).collect::<Vec<_>>(), [1, 2, 3, 4], "{b:?}");
    for ((step, x), (_, y)) in a.iter().zip(&b) {
        assert!((x - y).abs() <= 1e-5 * x.abs(), "step {step}: {x} uninterrupted, {y} resumed off the mesh");
    }
    let export = |run: &Path, out: &str| {
        let out = dir.join(out);
        let ckpt = run.join("checkpoints");
        run_ok(&["consolidate", ckpt.to_str().unwrap(), "--format", "peft", "--out", out.to_str().unwrap()]);
        adapter_tensors(&out)
    };
    let (x, y) = (export(&whole, "x"), export(&resumed, "y"));
    for (name, (_, values)) in &x {
        let worst = values.iter().zip(&y[name].1).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
        assert!(worst <= 2e-5, "{name}: {worst}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `lora_dropout` drops the adapters' input while training only: a run with dropout 0.5
/// trains other adapters than one without (the same seed, the same data), while scoring one
/// adapter with and without dropout in its config gives the same loss.
#[test]
fn lora_dropout_acts_in_training_only() {
    let dir = folder("lora-dropout");
    let (_, tokens) = fresh_llama(&dir, 1, "");
    std::fs::write(
        dir.join("model-kv2.json"),
        r#"{"model_type": "llama", "hidden_size": 16, "intermediate_size": 24, "num_hidden_layers": 2,
        "num_attention_heads": 2, "num_key_value_heads": 2, "vocab_size": 280, "tie_word_embeddings": true}"#,
    )
    .unwrap();
    let with = |dropout: f64| {
        format!(r#"{{"r": 2, "target_modules": "all-linear", "init_lora_weights": false, "lora_dropout": {dropout}}}"#)
    };
    let mut trained = Vec::new();
    for (name, dropout) in [("none", 0.0), ("half", 0.5)] {
        let config = lora_config(&dir, name, (1, 0, 6, 1), &with(dropout));
        let run = dir.join(format!("run-{name}"));
        run_ok(&train_args(&config, &tokens, "2", &run, &[]));
        trained.push((config, super::losses(&run), run));
    }
    let (first, second) = (&trained[0].1, &trained[1].1);
    assert!((first[0].1 - second[0].1).abs() > 1e-4, "dropout changes the training loss: {first:?} {second:?}");
    let adapter = dir.join("adapter");
    let ckpt = trained[0].2.join("checkpoints");
    run_ok(&["consolidate", ckpt.to_str().unwrap(), "--format", "peft", "--out", adapter.to_str().unwrap()]);
    let text_file = dir.join("text.txt");
    let score = |config: &Path| text_loss(config, &text_file, &["--adapter", adapter.to_str().unwrap()]);
    // The adapter's own config rules; the dropout there is set to each value in turn.
    let config_file = adapter.join(peft::ADAPTER_CONFIG_FILE);
    let mut json: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&config_file).unwrap()).unwrap();
    let plain = lora_config(&dir, "plain", (1, 0, 6, 1), "null");
    let a = score(&plain);
    json["lora_dropout"] = serde_json::json!(0.5);
    std::fs::write(&config_file, json.to_string()).unwrap();
    let b = score(&plain);
    assert_eq!(a, b, "evaluation does not drop");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `modules_to_save` trains whole modules beside the adapters, named by PEFT's rule (a path
/// ending in the name: `norm` is every RMSNorm); the checkpoint and the PEFT export hold
/// them (`base_model.model.<path>`), and an adapter read back with them scores as the
/// checkpoint does.
#[test]
fn modules_to_save_train_whole_and_travel_with_the_adapter() {
    let dir = folder("lora-save");
    let (_, tokens) = fresh_llama(&dir, 1, "");
    std::fs::write(
        dir.join("model-kv2.json"),
        r#"{"model_type": "llama", "hidden_size": 16, "intermediate_size": 24, "num_hidden_layers": 2,
        "num_attention_heads": 2, "num_key_value_heads": 2, "vocab_size": 280, "tie_word_embeddings": true}"#,
    )
    .unwrap();
    let lora = r#"{"r": 2, "target_modules": ["q_proj"], "modules_to_save": ["norm"]}"#;
    let config = lora_config(&dir, "save", (2, 3, 3, 1), lora);
    let run = dir.join("run");
    run_ok(&train_args(&config, &tokens, "3", &run, &[]));
    let adapter = dir.join("adapter");
    let ckpt = run.join("checkpoints");
    run_ok(&["consolidate", ckpt.to_str().unwrap(), "--format", "peft", "--out", adapter.to_str().unwrap()]);
    let tensors = adapter_tensors(&adapter);
    let names: Vec<&str> = tensors.keys().map(String::as_str).collect();
    for norm in
        ["model.norm.weight", "model.layers.0.input_layernorm.weight", "model.layers.1.post_attention_layernorm.weight"]
    {
        let name = format!("{}{norm}", peft::PREFIX);
        let (_, values) = &tensors[&name];
        assert!(values.iter().any(|v| (v - 1.0).abs() > 1e-4), "{norm} trained off its ones: {values:?}");
    }
    assert_eq!(names.len(), 2 * 2 + 5, "two q_proj adapters and five norms: {names:?}");
    let text_file = dir.join("text.txt");
    let plain = lora_config(&dir, "plain", (1, 0, 6, 1), "null");
    let from_checkpoint = text_loss(&config, &text_file, &["--checkpoint", run.to_str().unwrap()]);
    let from_adapter = text_loss(&plain, &text_file, &["--adapter", adapter.to_str().unwrap()]);
    assert!((from_checkpoint - from_adapter).abs() <= 1e-6 * from_checkpoint, "{from_checkpoint} vs {from_adapter}");
    std::fs::remove_dir_all(&dir).unwrap();
}
