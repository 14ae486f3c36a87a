//! The built-in GPT's parameter formula and its LoRA adapters.

use super::*;
use burn::module::Module;
use burn::tensor::TensorData;
use zerotrain::engine::ParamCount;

#[test]
fn the_parameter_formula_counts_the_built_model() {
    let device = Device::flex().autodiff();
    for tied_head in [true, false] {
        let config = GptConfig { n_layer: 2, n_head: 2, n_embd: 16, block_size: 8, vocab_size: 11, tied_head };
        let model = Gpt::new(&config, &device);
        assert_eq!(ParamCount::trainable(&model), config.num_params(), "tied {tied_head}");
        let (units, root) = config.unit_params();
        assert_eq!(units.iter().map(|(_, n)| n).sum::<u64>() + root, config.num_params());
        assert_eq!(units.len(), model.units().len());
        let loss = model.loss(Tensor::<2, Int>::from_data(TensorData::new(vec![1i64, 2, 3, 4, 5, 6], [2, 3]), &device));
        assert!(loss.into_scalar::<f32>() > 0.0);
    }
    assert!(
        GptConfig { n_head: 3, vocab_size: 5, ..GptConfig::default() }.validate().unwrap_err().contains("multiple")
    );
}

/// A PEFT config from its JSON keys.
fn lora(json: serde_json::Value) -> zerotrain::nn::lora::LoraConfig {
    zerotrain::nn::lora::LoraConfig::from_json(&json, "test", "zerotrain.lora").unwrap()
}

/// The paths of `model`'s parameters, and whether each has a gradient in `grads`.
fn with_gradients<M: Module>(model: &M, grads: &burn::tensor::Gradients) -> Vec<(String, bool)> {
    struct Seen<'a> {
        path: Vec<String>,
        grads: &'a burn::tensor::Gradients,
        out: Vec<(String, bool)>,
    }
    impl burn::module::ModuleVisitor for Seen<'_> {
        fn enter_module(&mut self, name: &str, _: &str) {
            self.path.push(name.to_string());
        }
        fn exit_module(&mut self, _: &str, _: &str) {
            self.path.pop();
        }
        fn visit_float<const D: usize>(&mut self, param: &burn::module::Param<Tensor<D>>) {
            self.out.push((self.path.join("."), param.val().grad(self.grads).is_some()));
        }
    }
    let mut seen = Seen { path: Vec::new(), grads, out: Vec::new() };
    model.visit(&mut seen);
    seen.out
}

fn tiny(tied_head: bool) -> GptConfig {
    GptConfig { n_layer: 2, n_head: 2, n_embd: 16, block_size: 8, vocab_size: 11, tied_head }
}

fn tokens(device: &Device) -> Tensor<2, Int> {
    Tensor::<2, Int>::from_data(TensorData::new(vec![1i64, 2, 3, 4, 5, 6, 7, 8, 9, 10], [2, 5]), device)
}

/// With B zero (PEFT's default start) the adapted model's loss is the base's, bit for bit;
/// only the adapters (r (in + out) each: six a block, the MLP's 16 -> 64 -> 16) and the
/// `modules_to_save` train, and backward gives nothing else a gradient.
#[test]
fn a_gpt_with_lora_starts_as_its_base_and_trains_only_its_adapters() {
    let device = Device::flex().autodiff();
    let base = Gpt::new(&tiny(true), &device);
    let want = base.loss(tokens(&device)).into_data();
    let model = base.with_lora(&lora(serde_json::json!({"r": 2, "target_modules": "all-linear"}))).unwrap();
    assert_eq!(model.loss(tokens(&device)).into_data(), want, "B = 0 changes nothing");
    let per_block = 4 * 2 * (16 + 16) + 2 * 2 * (16 + 64);
    assert_eq!(ParamCount::trainable(&model), 2 * per_block as u64);
    let grads = model.loss(tokens(&device)).backward();
    let seen = with_gradients(&model, &grads);
    assert_eq!(seen.iter().filter(|(p, _)| p.contains(".adapters.")).count(), 2 * 6 * 2, "{seen:?}");
    for (path, has) in &seen {
        assert_eq!(*has, path.contains(".adapters."), "`{path}`");
    }
    // A module trained whole beside the adapters: every parameter below it, and no adapter
    // inside it (PEFT's rule), so only block 0's query has one.
    let base = Gpt::new(&tiny(true), &device);
    let saved = serde_json::json!({"r": 2, "target_modules": ["query"], "modules_to_save": ["blocks.1"]});
    let model = base.with_lora(&lora(saved)).unwrap();
    let block = 4 * 16 * 16 + 3 * 16 + 4 * 16 + (16 * 64 + 64) + (64 * 16 + 16);
    assert_eq!(ParamCount::trainable(&model), (2 * (16 + 16) + block) as u64);
    let grads = model.loss(tokens(&device)).backward();
    for (path, has) in with_gradients(&model, &grads) {
        assert_eq!(has, path.starts_with("blocks.1.") || path.contains(".adapters."), "`{path}`");
    }
}

/// An adapted layer computes what its base would with the merged weight `W + s (B A)^T`
/// (Burn's `Linear` stores `[in, out]`): the loss of the adapted model (random A and B,
/// rslora's scaling, a per-layer rank) equals plain Burn's on the merged model.
#[test]
fn a_gpt_with_lora_computes_its_merged_models_loss() {
    let device = Device::flex().autodiff();
    let base = Gpt::new(&tiny(false), &device);
    let _ = base.loss(tokens(&device)); // the base's values drawn, so that its clone holds them
    let mut merged = base.clone();
    let config = serde_json::json!({"r": 3, "lora_alpha": 5, "use_rslora": true, "init_lora_weights": false,
                                    "target_modules": "all-linear", "rank_pattern": {"mlp_down": 2}});
    let model = base.with_lora(&lora(config)).unwrap();
    let got = model.loss(tokens(&device)).into_scalar::<f32>();
    let mut merged_layers = 0;
    for (block, adapted) in merged.blocks.iter_mut().zip(&model.blocks) {
        let linears = [&mut block.attn.query, &mut block.attn.key, &mut block.attn.value, &mut block.attn.output];
        let linears = linears.into_iter().chain([&mut block.mlp_up, &mut block.mlp_down]);
        for (linear, adapter) in linears.zip(adapted.adapters.layers()) {
            let adapter = adapter.as_ref().expect("all-linear adapts every layer");
            let delta = adapter.b.val().matmul(adapter.a.val()).transpose().mul_scalar(adapter.scaling());
            linear.weight = burn::module::Param::from_tensor((linear.weight.val() + delta).detach());
            merged_layers += 1;
        }
        let down = adapted.adapters.layers()[5].as_ref().unwrap();
        assert_eq!(down.a.val().dims(), [2, 64], "rank_pattern's rank");
        assert!((down.scaling() - 5.0 / 2f64.sqrt()).abs() < 1e-12, "rslora: alpha / sqrt(r)");
    }
    assert_eq!(merged_layers, 12);
    let want = merged.loss(tokens(&device)).into_scalar::<f32>();
    assert!((got - want).abs() <= 1e-6 * want.abs(), "adapted {got} against merged {want}");
    let plain = model.blocks[0].adapters.layers()[0].as_ref().unwrap();
    assert!(plain.b.val().abs().max().into_scalar::<f32>() > 0.0, "init_lora_weights false: B drawn");
}

/// What the built-in GPT cannot take is refused naming the key: no targets (PEFT has no
/// default for this model), targets naming no layer (with layers that exist), the head, a
/// `modules_to_save` naming no module.
#[test]
fn bad_lora_configs_for_the_gpt_are_errors_naming_the_key() {
    let device = Device::flex().autodiff();
    let refused = |tied: bool, json: serde_json::Value| {
        Gpt::new(&tiny(tied), &device).with_lora(&lora(json)).expect_err("refused")
    };
    let e = refused(true, serde_json::json!({"r": 2}));
    assert!(e.contains("zerotrain.lora.target_modules") && e.contains("no default"), "{e}");
    let e = refused(true, serde_json::json!({"target_modules": ["q_proj"]}));
    assert!(e.contains("q_proj") && e.contains("blocks.0.attn.query"), "{e}");
    let e = refused(false, serde_json::json!({"target_modules": ["head", "query"]}));
    assert!(e.contains("head") && e.contains("takes no adapter"), "{e}");
    let e = refused(true, serde_json::json!({"target_modules": ["query"], "modules_to_save": ["score"]}));
    assert!(e.contains("modules_to_save") && e.contains("score"), "{e}");
}
