//! Checks of the families that need no Python: imports of checkpoints written here with
//! the safetensors crate, the presets' sizes, the recipes' parameter groups.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use burn::module::{Module, ModuleVisitor, Param};
use burn::tensor::{Device, Tensor};
use serde_json::json;

use super::*;
use crate::hf::files;
use zerotrain::engine::UnitModel;

mod parallel;
mod parallel_training;
mod refusals;

fn folder(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("zerotrain-hf-unit-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn llama_config(tied: bool) -> serde_json::Value {
    json!({"model_type": "llama", "hidden_size": 8, "intermediate_size": 12, "num_hidden_layers": 2,
           "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 10, "tie_word_embeddings": tied})
}

/// Writes `config` and, as one safetensors file, every tensor the model needs (values
/// `0.01 * i`), with `edit` applied to the (name -> (dtype, shape, bytes)) map first.
fn write(
    dir: &Path,
    config: &serde_json::Value,
    edit: impl FnOnce(&mut BTreeMap<String, (safetensors::Dtype, Vec<usize>, Vec<u8>)>),
) {
    std::fs::write(dir.join(CONFIG_FILE), config.to_string()).unwrap();
    let parsed = HfConfig::from_json(config.clone()).unwrap();
    let mut tensors: BTreeMap<String, (safetensors::Dtype, Vec<usize>, Vec<u8>)> = parameter_names(&parsed)
        .into_iter()
        .map(|(name, shape)| {
            let n: usize = shape.iter().product();
            let bytes = (0..n).flat_map(|i| (0.01 * i as f32).to_le_bytes()).collect();
            (name, (safetensors::Dtype::F32, shape, bytes))
        })
        .collect();
    edit(&mut tensors);
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = tensors
        .iter()
        .map(|(name, (dtype, shape, bytes))| {
            (name.clone(), safetensors::tensor::TensorView::new(*dtype, shape.clone(), bytes).unwrap())
        })
        .collect();
    safetensors::serialize_to_file(views, None, &dir.join(files::SINGLE_FILE)).unwrap();
}

/// Every float tensor of `model`: (module path, initialised yet, values read now).
fn floats<M: Module>(model: &M, read: bool) -> Vec<(String, bool, Vec<f32>)> {
    struct Walk {
        path: Vec<String>,
        read: bool,
        out: Vec<(String, bool, Vec<f32>)>,
    }
    impl ModuleVisitor for Walk {
        fn enter_module(&mut self, name: &str, _: &str) {
            self.path.push(name.to_string());
        }
        fn exit_module(&mut self, _: &str, _: &str) {
            self.path.pop();
        }
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            let initialised = param.is_initialized();
            let values = match self.read {
                true => param.val().into_data().convert::<f32>().try_to_vec::<f32>().unwrap(),
                false => Vec::new(),
            };
            self.out.push((self.path.join("."), initialised, values));
        }
    }
    let mut walk = Walk { path: Vec::new(), read, out: Vec::new() };
    model.visit(&mut walk);
    walk.out
}

fn import_error(dir: &Path) -> String {
    match import(dir, &Device::flex()) {
        Ok(_) => panic!("{} imported", dir.display()),
        Err(e) => e.to_string(),
    }
}

#[test]
fn module_paths_are_the_checkpoints_tensor_names() {
    let configs = [
        json!({"model_type": "gpt2", "n_embd": 8, "n_head": 2, "n_layer": 2, "vocab_size": 10, "n_positions": 6}),
        llama_config(true),
        llama_config(false),
        json!({"model_type": "qwen2", "hidden_size": 8, "intermediate_size": 12, "num_hidden_layers": 1,
               "num_attention_heads": 2, "vocab_size": 10}),
    ];
    for config in configs {
        let parsed = HfConfig::from_json(config.clone()).unwrap();
        let asked = parameter_names(&parsed);
        let model = fresh(&parsed, &Device::flex().autodiff(), 0);
        let (paths, units) = match &model {
            HfModel::Gpt2(m) => (floats(m, false), m.units().len()),
            HfModel::Llama(m) => (floats(m, false), m.units().len()),
        };
        let paths: std::collections::BTreeSet<String> = paths.into_iter().map(|(p, _, _)| p).collect();
        let asked: std::collections::BTreeSet<String> = asked.into_iter().map(|(p, _)| p).collect();
        assert_eq!(paths, asked, "{config}");
        assert!(units >= 3, "{config}");
    }
}

#[test]
fn an_imported_model_holds_the_files_values_and_reads_them_only_when_used() {
    let dir = folder("values");
    write(&dir, &llama_config(true), |t| {
        // bf16 in the file: read exactly into f32.
        let bytes = (0..80).flat_map(|i| half::bf16::from_f32(i as f32 / 64.0).to_le_bytes()).collect();
        t.insert("model.embed_tokens.weight".into(), (safetensors::Dtype::BF16, vec![10, 8], bytes));
    });
    let (_, model) = import(&dir, &Device::flex()).unwrap();
    let HfModel::Llama(model) = model else { panic!("llama") };
    assert!(floats(&model, false).iter().all(|(_, initialised, _)| !initialised), "nothing is read before use");
    let values = floats(&model, true);
    let of = |name: &str| values.iter().find(|(p, _, _)| p == name).unwrap().2.clone();
    assert_eq!(of("model.embed_tokens.weight"), (0..80).map(|i| i as f32 / 64.0).collect::<Vec<_>>());
    assert_eq!(of("model.layers.0.mlp.down_proj.weight"), (0..96).map(|i| 0.01 * i as f32).collect::<Vec<_>>());
    std::fs::remove_dir_all(&dir).unwrap();
}

/// An engine built over an imported model reads each tensor straight from the files into
/// its unit's buffer (at stage 3, and at stage 1 where the model keeps its parameters):
/// the model's lazy parameters are never initialised (a clone shares their state), and the
/// engine holds the files' values exactly, f16 and bf16 ones widened.
#[test]
fn an_engine_reads_an_imported_model_straight_from_its_files() {
    let dir = folder("engine-values");
    write(&dir, &llama_config(false), |t| {
        let bf16 = (0..80).flat_map(|i| half::bf16::from_f32(i as f32 / 64.0 - 0.5).to_le_bytes()).collect();
        t.insert("model.embed_tokens.weight".into(), (safetensors::Dtype::BF16, vec![10, 8], bf16));
        let f16 = (0..80).flat_map(|i| half::f16::from_f32(1.0 / (1.0 + i as f32)).to_le_bytes()).collect();
        t.insert("lm_head.weight".into(), (safetensors::Dtype::F16, vec![10, 8], f16));
    });
    let expected: Vec<(String, Vec<f32>)> = {
        let (_, model) = import(&dir, &Device::flex()).unwrap();
        floats(&model_of(model), true).into_iter().map(|(path, _, values)| (path, values)).collect()
    };
    assert_eq!(expected[0].1[3], 3.0 / 64.0 - 0.5);
    for stage in [1, 3] {
        let json = format!(r#"{{"train_micro_batch_size_per_gpu": 1, "zero_optimization": {{"stage": {stage}}}}}"#);
        let device = Device::flex().autodiff();
        let (plan, ctx) = one_rank(&json, &device);
        let (_, model) = import(&dir, &device).unwrap();
        let model = model_of(model);
        assert!(model.initial_values().is_some(), "an imported model points at its files");
        let kept = model.clone();
        let mut engine = zerotrain::Engine::with_units(model, &plan, &ctx).unwrap();
        let unread = floats(&kept, false).iter().filter(|(_, initialised, _)| !initialised).count();
        assert_eq!(unread, expected.len(), "stage {stage}: the engine initialised none of the lazy parameters");
        let held = floats(&engine.full_model().unwrap(), true);
        let held: Vec<(String, Vec<f32>)> = held.into_iter().map(|(path, _, values)| (path, values)).collect();
        assert_eq!(held, expected, "stage {stage}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A bf16 engine over a checkpoint stored in bf16 reads those units in bf16 (f32 would hold
/// nothing more): two thirds of the f32 path's buffers at construction, and the same
/// training, bit for bit, as over the same model initialised first (read through f32), at
/// stages 1 and 3, states in memory or on NVMe, on one rank and two. The head's unit holds
/// an f16 tensor and goes through f32 either way.
#[test]
fn a_bf16_checkpoint_is_read_in_bf16_and_trains_as_through_f32() {
    let dir = folder("bf16-read");
    write(&dir, &llama_config(false), |t| {
        for (dtype, _, bytes) in t.values_mut() {
            let values: Vec<f32> =
                bytes.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect();
            *bytes = values.iter().flat_map(|v| half::bf16::from_f32(v * 1.37).to_le_bytes()).collect();
            *dtype = safetensors::Dtype::BF16;
        }
        let (dtype, _, bytes) = t.get_mut("lm_head.weight").unwrap();
        let values: Vec<f32> =
            bytes.chunks_exact(2).map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32()).collect();
        *bytes = values.iter().flat_map(|v| half::f16::from_f32(*v).to_le_bytes()).collect();
        *dtype = safetensors::Dtype::F16;
    });
    let swap = serde_json::to_string(&dir.join("swap").display().to_string()).unwrap();
    let nvme = |max_in_cpu: f64| {
        format!(
            r#"{{"stage": 3, "stage3_param_persistence_threshold": 0,
                "offload_optimizer": {{"device": "nvme", "nvme_path": {swap}}},
                "offload_param": {{"device": "nvme", "nvme_path": {swap}, "max_in_cpu": {max_in_cpu}}}}}"#
        )
    };
    let zeros = [r#"{"stage": 1}"#.to_string(), r#"{"stage": 3}"#.to_string(), nvme(0.0), nvme(1e9)];
    for world in [1, 2] {
        for zero in &zeros {
            let json = format!(
                r#"{{"train_batch_size": {world}, "train_micro_batch_size_per_gpu": 1, "bf16": {{"enabled": true}},
                    "zero_optimization": {zero}, "zerotrain": {{"world_size": {world}}}}}"#
            );
            let plan = zerotrain::Config::parse(&json, "t").unwrap().resolve(zerotrain::Overrides::default()).unwrap();
            let run = |initialised: bool| {
                zerotrain::launch(&plan, |ctx| -> zerotrain::Result<_> {
                    let (_, model) = import(&dir, ctx.device()).unwrap();
                    let model = model_of(model);
                    if initialised {
                        floats(&model, true);
                    }
                    let mut engine = zerotrain::Engine::with_units(model, &plan, &ctx)?;
                    let transient = engine.memory_report().peak_transient;
                    let data = burn::tensor::TensorData::new(vec![1i64, 4, 2, 7, 9, 0], [1, 6]);
                    let ids: crate::LmBatch = Tensor::<2, burn::tensor::Int>::from_data(data, ctx.device()).into();
                    let loss = engine.train_batch(&mut |_| ids.clone())?.loss;
                    let held: Vec<(String, Vec<f32>)> =
                        floats(&engine.full_model()?, true).into_iter().map(|(p, _, v)| (p, v)).collect();
                    Ok((transient, loss.to_bits(), held))
                })
                .unwrap()
            };
            let (direct, through_f32) = (run(false), run(true));
            for (rank, (d, f)) in direct.iter().zip(&through_f32).enumerate() {
                let case = format!("{world} rank(s), rank {rank}, {zero}");
                // The largest unit is a layer: 2 + 2 bytes an element against 4 + 2.
                assert_eq!(d.0 * 3, f.0 * 2, "{case}: construction buffers, bf16 against f32");
                assert_eq!((d.1, &d.2), (f.1, &f.2), "{case}: loss and parameters after a step");
            }
        }
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The plan of config `json` and a context for one rank on this thread, on `device`.
fn one_rank(json: &str, device: &Device) -> (zerotrain::Plan, zerotrain::RankContext) {
    let plan = zerotrain::Config::parse(json, "t").unwrap().resolve(zerotrain::Overrides::default()).unwrap();
    let world = zerotrain_zero::ThreadWorld::new(1, std::time::Duration::from_secs(60));
    (plan, zerotrain::RankContext::new(std::sync::Arc::new(world.communicator(0)), device.clone()))
}

fn model_of(model: HfModel) -> crate::Llama {
    match model {
        HfModel::Llama(model) => model,
        HfModel::Gpt2(_) => panic!("llama"),
    }
}

#[test]
fn the_presets_have_their_published_parameter_counts() {
    let count = |file: &str| {
        let config =
            HfConfig::read(&Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/../configs/models")).join(file)).unwrap();
        parameter_names(&config).iter().map(|(_, s)| s.iter().product::<usize>()).sum::<usize>()
    };
    // GPT-2 small: 124,439,808 parameters (Hugging Face's `gpt2`, head tied).
    assert_eq!(count("gpt2-small.json"), 124_439_808);
    // Counted by hand: embedding, 12 layers of q/o (768x768), k/v (768x256), the SwiGLU MLP
    // (3 x 768x2048) and two norms, the final norm; the head tied.
    let layer = 2 * 768 * 768 + 2 * 768 * 256 + 3 * 768 * 2048 + 2 * 768;
    assert_eq!(count("llama-100m.json"), 32000 * 768 + 12 * layer + 768);
    // TinyLlama-1.1B's shape (`bench gpu --model llama`): 1,100,048,384 parameters, its
    // published count (22 layers of 2048, 32 query and 4 key-value heads, MLP 5632, an
    // untied head).
    assert_eq!(count("llama-1b.json"), 1_100_048_384);
}

/// At stage 3 with parameters and optimizer state on NVMe, building the engine of an
/// imported checkpoint holds about one unit at a time on the building rank, never the
/// model: each tensor is read when the engine initialises its unit (measured by the test
/// build's counting allocator, on this thread, where a one-rank engine is built).
#[test]
fn a_stage_3_import_holds_about_one_unit_at_a_time() {
    use crate::stream_tests::live_bytes;
    let dir = folder("one-unit");
    let config = json!({"model_type": "llama", "hidden_size": 128, "intermediate_size": 384, "num_hidden_layers": 16,
        "num_attention_heads": 4, "vocab_size": 64, "tie_word_embeddings": false});
    write(&dir, &config, |_| {});
    let swap = serde_json::to_string(&dir.join("swap").display().to_string()).unwrap();
    let json = format!(
        r#"{{"train_micro_batch_size_per_gpu": 1, "activation_checkpointing": {{}},
            "zero_optimization": {{"stage": 3, "sub_group_size": 1e5, "stage3_param_persistence_threshold": 0,
              "offload_optimizer": {{"device": "nvme", "nvme_path": {swap}}},
              "offload_param": {{"device": "nvme", "nvme_path": {swap}, "max_in_cpu": 0}}}}}}"#
    );
    let device = Device::flex().autodiff();
    let (plan, ctx) = one_rank(&json, &device);
    let layer = (4 * 128 * 128 + 3 * 128 * 384 + 2 * 128) * 4;
    let model_bytes: usize = parameter_names(&HfConfig::from_json(config).unwrap())
        .iter()
        .map(|(_, s)| s.iter().product::<usize>() * 4)
        .sum();

    let before = live_bytes::reset();
    let (_, model) = import(&dir, &device).unwrap();
    let HfModel::Llama(model) = model else { panic!("llama") };
    let engine = zerotrain::Engine::with_units(model, &plan, &ctx).unwrap();
    let held = live_bytes::peak() - before;
    eprintln!("model {model_bytes} B, a layer {layer} B; building held at most {held} B");
    assert!(model_bytes > 15 * layer);
    // One unit's values read from the files straight into its flat buffer, and the
    // aligned copies its master and parameter shard are written through (2.5 MB measured
    // for 16 layers: 2.9 layers). Holding the model would be 13.7 MB.
    assert!(held < 4 * layer as isize, "building held {held} B, a layer is {layer} B, the model {model_bytes} B");
    drop(engine);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A fresh GPT-2 starts as Hugging Face's `_init_weights` starts one: projections and
/// embeddings at N(0, initializer_range), the two residual projections (`c_proj`) at
/// initializer_range / sqrt(2 n_layer), norms at one, biases at zero. The standard
/// deviation of 4,096 draws is within 5% of its own (a 4.4-sigma bound).
#[test]
fn a_fresh_gpt2_scales_its_residual_projections_as_hugging_face_does() {
    let config = HfConfig::from_json(json!({"model_type": "gpt2", "n_embd": 64, "n_layer": 8, "n_head": 4,
        "n_positions": 16, "vocab_size": 64, "initializer_range": 0.05}))
    .unwrap();
    let device = Device::flex();
    let model = match fresh(&config, &device, 3) {
        HfModel::Gpt2(m) => m,
        HfModel::Llama(_) => unreachable!("a gpt2 config"),
    };
    let std = |v: &[f32]| (v.iter().map(|&x| f64::from(x) * f64::from(x)).sum::<f64>() / v.len() as f64).sqrt();
    let scaled = 0.05 / 16f64.sqrt();
    for (path, _, values) in floats(&model, true) {
        let expected = if path.ends_with("c_proj.weight") {
            scaled
        } else if path.ends_with("ln_1.weight") || path.ends_with("ln_2.weight") || path.ends_with("ln_f.weight") {
            assert!(values.iter().all(|&x| x == 1.0), "{path}");
            continue;
        } else if path.ends_with(".bias") {
            assert!(values.iter().all(|&x| x == 0.0), "{path}");
            continue;
        } else {
            0.05
        };
        let got = std(&values[..4096.min(values.len())]);
        assert!(
            (got / expected - 1.0).abs() < 0.05 || values.len() < 4096 && (got / expected - 1.0).abs() < 0.2,
            "{path}: std {got}, Hugging Face's {expected}"
        );
    }
}
