//! Checkpoints and tokenizers an import refuses, each by name: tensors that do not fit
//! the config, NaN or infinite weights, a config asking for far more tensors than the files
//! hold, tensor names with control characters, tokenizer ids past the vocabulary.

use super::*;

#[test]
fn a_checkpoint_that_does_not_fit_its_config_is_refused_naming_the_tensor_and_file() {
    let dir = folder("refused");
    write(&dir, &llama_config(false), |t| {
        t.remove("model.layers.1.mlp.up_proj.weight");
    });
    let err = import_error(&dir);
    assert!(
        err.contains("no file holds tensor `model.layers.1.mlp.up_proj.weight`") && err.contains("[12, 8]"),
        "{err}"
    );

    write(&dir, &llama_config(false), |t| {
        t.get_mut("model.norm.weight").unwrap().1 = vec![2, 4];
    });
    let err = import_error(&dir);
    assert!(
        err.contains("model.safetensors: tensor `model.norm.weight` has shape [2, 4]; the config needs [8]"),
        "{err}"
    );

    write(&dir, &llama_config(false), |t| {
        t.insert("model.layers.2.mlp.up_proj.weight".into(), (safetensors::Dtype::F32, vec![1], vec![0; 4]));
    });
    let err = import_error(&dir);
    assert!(err.contains("tensor `model.layers.2.mlp.up_proj.weight` has no place in the model"), "{err}");

    write(&dir, &llama_config(false), |t| {
        t.insert("model.norm.weight".into(), (safetensors::Dtype::I32, vec![8], vec![0; 32]));
    });
    let err = import_error(&dir);
    assert!(err.contains("tensor `model.norm.weight` is I32"), "{err}");

    std::fs::write(dir.join(CONFIG_FILE), r#"{"model_type": "bert"}"#).unwrap();
    let err = import_error(&dir);
    assert!(err.contains("config.json: model_type `bert` is not a family"), "{err}");

    std::fs::write(dir.join(files::INDEX_FILE), r#"{"weight_map": {"model.norm.weight": "model-2.safetensors"}}"#)
        .unwrap();
    write(&dir, &llama_config(false), |_| {});
    let err = import_error(&dir);
    assert!(err.contains("model-2.safetensors: cannot open it"), "{err}");
    std::fs::write(dir.join(files::INDEX_FILE), r#"{"weight_map": {"model.norm.weight": "../x.safetensors"}}"#)
        .unwrap();
    let err = import_error(&dir);
    assert!(err.contains("not a file name in its folder"), "{err}");
    std::fs::write(dir.join(files::INDEX_FILE), r#"{"weight_map": {"model.norm.weight": ""}}"#).unwrap();
    let err = import_error(&dir);
    assert!(err.contains("is in ``, which is not a file name in its folder"), "{err}");
    // A FIFO in the checkpoint's place is refused at once, not waited on.
    std::fs::remove_file(dir.join(files::INDEX_FILE)).unwrap();
    std::fs::remove_file(dir.join(files::SINGLE_FILE)).unwrap();
    assert!(std::process::Command::new("mkfifo").arg(dir.join(files::SINGLE_FILE)).status().unwrap().success());
    let err = import_error(&dir);
    assert!(err.contains("a FIFO, not a regular file: refused"), "{err}");
    std::fs::remove_file(dir.join(files::SINGLE_FILE)).unwrap();
    write(&dir, &llama_config(false), |_| {});

    std::fs::rename(dir.join(files::SINGLE_FILE), dir.join("pytorch_model.bin")).unwrap();
    let err = import_error(&dir);
    assert!(err.contains("has neither model.safetensors nor") && err.contains("only pytorch_model.bin"), "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A NaN or an infinity among a checkpoint's weights is refused when the engine reads it,
/// naming the file, the tensor and the element; finite bf16 weights read as they are.
#[test]
fn non_finite_weights_are_refused_naming_the_tensor() {
    let dir = folder("nan");
    for (bad, name) in [(f32::NAN, "NaN"), (f32::NEG_INFINITY, "-inf")] {
        write(&dir, &llama_config(false), |t| {
            t.get_mut("model.layers.1.self_attn.k_proj.weight").unwrap().2[12..16].copy_from_slice(&bad.to_le_bytes());
        });
        let (_, model) = import(&dir, &Device::flex()).unwrap();
        let HfModel::Llama(model) = model else { unreachable!("a llama config") };
        let values = model.initial_values().expect("an import reads from its files");
        let mut buf = vec![0.0f32; 8];
        values
            .read("model.layers.1.self_attn.v_proj.weight", 0..8, zerotrain_precision::BufMut::F32(&mut buf))
            .unwrap();
        let err = values
            .read("model.layers.1.self_attn.k_proj.weight", 0..8, zerotrain_precision::BufMut::F32(&mut buf))
            .unwrap_err();
        assert!(
            err.contains("model.safetensors: tensor `model.layers.1.self_attn.k_proj.weight` holds")
                && err.contains(&format!("{name} at element 3 of 32")),
            "{err}"
        );
    }
}

/// A config of millions of layers beside a small checkpoint is refused before a model is
/// built for it, saying how many tensors each holds.
#[test]
fn a_config_asking_for_far_more_tensors_than_the_files_hold_is_refused_before_building() {
    let dir = folder("huge");
    write(&dir, &llama_config(false), |_| {});
    let mut config = llama_config(false);
    config["num_hidden_layers"] = json!(1 << 24);
    std::fs::write(dir.join(CONFIG_FILE), config.to_string()).unwrap();
    let err = import_error(&dir);
    assert!(
        err.contains("config.json asks for a model of 150994947 tensors (16777216 layers), but its files hold 21"),
        "{err}"
    );
}

/// A tensor name holding control characters (terminal escapes would forge lines where it
/// is printed) is refused, printed escaped.
#[test]
fn a_tensor_name_with_control_characters_is_refused_escaped() {
    let dir = folder("escapes");
    write(&dir, &llama_config(false), |t| {
        let norm = t.remove("model.norm.weight").unwrap();
        t.insert("model.norm.weight\u{1b}[2K\rforged".to_string(), norm);
    });
    let err = import_error(&dir);
    assert!(err.contains(r#"holds control characters: "model.norm.weight\u{1b}[2K\rforged""#), "{err}");
    assert!(!err.contains('\u{1b}'), "{err:?}");
}

/// A tokenizer whose ids pass the model's vocab_size is refused naming both files, though
/// it has fewer tokens than the vocabulary (an id past a gap): an embedding lookup of that
/// id once panicked inside Burn.
#[test]
fn a_tokenizer_id_past_the_models_vocabulary_is_refused() {
    let dir = folder("id-bound");
    let bpe = crate::text::train_byte_level_bpe(["the rank holds a shard"].into_iter(), 280).unwrap();
    let mut json: serde_json::Value = serde_json::from_str(&bpe.to_string(false).unwrap()).unwrap();
    json["model"]["vocab"]["<|far|>"] = json!(1000);
    json["added_tokens"].as_array_mut().unwrap().push(json!({"id": 1000, "content": "<|far|>", "single_word": false,
        "lstrip": false, "rstrip": false, "normalized": false, "special": true}));
    std::fs::write(dir.join("tokenizer.json"), json.to_string()).unwrap();
    let mut config = llama_config(false);
    config["vocab_size"] = json!(305);
    std::fs::write(dir.join("model.json"), config.to_string()).unwrap();
    let wanted = load::ModelSource {
        from: load::HfSource::Config(dir.join("model.json")),
        tokenizer: Some(dir.join("tokenizer.json")),
        block_size: Some(4),
        lora: None,
    };
    let err = load::load_model(&wanted, &dir.join("config.json"), &Device::flex().autodiff(), None, 0).err().unwrap();
    let err = err.to_string();
    assert!(err.contains("tokenizer.json has ids up to 1000, beyond the model's vocab_size 305"), "{err}");
}
