//! QLoRA: a frozen base stored in NF4 at stage 3 (`zerotrain.lora.quantize: "nf4"`), its
//! adapters trained as plain Burn trains them on the dequantised base, and the bytes each
//! rank holds of it.

use burn::module::{Module, ModuleMapper, Param};
use burn::tensor::{Device, Tensor, TensorData};
use zerotrain::Error;

use crate::common::*;
use crate::frozen::{Adapted, LAYERS, elems, train};

/// bitsandbytes' 16 NF4 levels, as the numpy reference lists them.
fn levels() -> Vec<f32> {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/bench/reference/nf4.json");
    let fixture: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    fixture["levels"].as_array().unwrap().iter().map(|v| v.as_f64().unwrap() as f32).collect()
}

/// `weight` (Burn's `[in, out]`) as QLoRA dequantises it, computed here: PyTorch's
/// `[out, in]` flat order cut into blocks of 64, each value the nearest level times its
/// block's absmax.
fn dequantised(weight: Tensor<2>, levels: &[f32]) -> Tensor<2> {
    let (device, [d_in, d_out]) = (weight.device(), weight.dims());
    let torch: Vec<f32> = weight.transpose().into_data().try_to_vec::<f32>().unwrap();
    let mut out = torch.clone();
    for (block, dst) in torch.chunks(64).zip(out.chunks_mut(64)) {
        let absmax = block.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        for (v, d) in block.iter().zip(dst) {
            let distance = |l: &f32| (l * absmax - v).abs();
            *d = absmax * *levels.iter().min_by(|a, b| distance(a).total_cmp(&distance(b))).unwrap();
        }
    }
    Tensor::<2>::from_data(TensorData::new(out, [d_out, d_in]), &device).transpose()
}

/// `model` with each layer's base weight replaced by its dequantised NF4 values (the root's
/// input projection and the biases stay as they are, as QLoRA keeps them).
fn with_nf4_base(model: &Adapted) -> Adapted {
    let levels = levels();
    let mut model = model.clone();
    for layer in &mut model.layers {
        let w = dequantised(layer.base.weight.val(), &levels);
        layer.base.weight = Param::from_tensor(w).set_require_grad(false);
    }
    model
}

fn nf4(json: String) -> String {
    json.replace(r#""comm_timeout_s": 60"#, r#""comm_timeout_s": 60, "lora": {"quantize": "nf4"}"#)
}

/// The adapters over an NF4 base train as plain Burn trains them over the base
/// dequantised by the reference above, on 1, 2 and 3 ranks, with 1 and 3 micro-batches a
/// step, the base's shards in memory and on NVMe; the full model the engine gathers holds
/// the dequantised base.
#[test]
fn an_nf4_base_trains_its_adapters_as_plain_burn_on_the_dequantised_base() {
    let init = seeded(53, Adapted::new);
    let quantised = with_nf4_base(&init);
    let base = floats_by_path(&quantised, |trains| !trains);
    let dir = std::env::temp_dir().join(format!("zt-qlora-{}", std::process::id()));
    let on_nvme = format!(
        r#""stage3_param_persistence_threshold": 0, "offload_param": {{"device": "nvme", "nvme_path": {:?}, "max_in_cpu": 0}}"#,
        dir.display().to_string()
    );
    let device = Device::flex().autodiff();
    for (world, gas) in [(1, 1), (2, 3), (3, 1)] {
        let (_, reference) =
            reference_run(&quantised, &plan(&recipe(0, 2, gas, 0.0), world), 3, |m, b| m.loss(b), &device);
        let reference = floats_by_path(&reference, |trains| trains);
        for tier in [false, true] {
            let mut json = nf4(recipe(3, 2, gas, 0.0));
            if tier {
                json = json.replace(r#""stage3_param_persistence_threshold": 0"#, &on_nvme);
            }
            for (rank, (_, frozen, trained)) in train(&init, &plan(&json, world), 3).iter().enumerate() {
                let what = format!("world {world}, accumulation {gas}, nvme {tier}, rank {rank}");
                let (diff, path) = max_abs_diff(frozen, &base);
                assert!(diff <= 1e-6, "{what}: the gathered base differs from the dequantised one by {diff} at {path}");
                let (diff, path) = max_abs_diff(trained, &reference);
                assert!(diff <= 2e-6, "{what}: differs from plain Burn by {diff} at {path}");
            }
            let _ = std::fs::remove_dir_all(&dir);
        }
    }
}

/// Each rank holds its share of the NF4 base: half a byte a value and one f32 absmax a
/// block of 64 for the layers' matrices, four bytes a value for the rest (the root's input
/// projection, the biases), over N ranks to within each unit's padding. Also printed: the
/// losses against the unquantised base's (reported, not asserted).
#[test]
fn each_rank_holds_its_share_of_the_nf4_base() {
    let init = seeded(59, Adapted::new);
    let (_, psi) = elems(&init);
    let matrices: Vec<u64> = init.layers.iter().map(|l| l.base.weight.val().shape().num_elements() as u64).collect();
    let in_matrices: u64 = matrices.iter().sum();
    let stored: u64 = matrices.iter().map(|n| n / 2 + 4 * n.div_ceil(64)).sum::<u64>() + 4 * (psi - in_matrices);
    let padding = 4 * 16 * (LAYERS as u64 + 2);
    for world in [1, 2, 4] {
        let n = world as u64;
        for (rank, (report, _, _)) in train(&init, &plan(&nf4(recipe(3, 2, 1, 0.0)), world), 1).iter().enumerate() {
            let share = stored.div_ceil(n);
            let what =
                format!("world {world}, rank {rank}: {} bytes of the NF4 base, its share {share}", report.frozen);
            assert!(report.frozen >= share && report.frozen <= share + padding, "{what}");
        }
    }
    let losses = |json: String| {
        let p = plan(&json, 2);
        zerotrain::launch(&p, |ctx| {
            let mut engine = zerotrain::Engine::with_units(init.clone(), &p, &ctx)?;
            let mut losses = vec![];
            for step in 0..3 {
                losses.push(engine.forward_backward(&TASK.batch(rank_indices(&p, step, 0, ctx.rank()), ctx.device()))?);
                engine.step()?;
            }
            Ok::<_, Error>(losses)
        })
        .unwrap()
    };
    let (full, quantised) = (losses(recipe(3, 2, 1, 0.0)), losses(nf4(recipe(3, 2, 1, 0.0))));
    eprintln!(
        "rank 0's losses: unquantised {:?}, nf4 {:?}; base bytes {stored} against {}",
        full[0],
        quantised[0],
        4 * psi
    );
}

/// The built-in GPT's weights with its blocks' six linear layers' weights (`blocks.{i}.`
/// `attn.query`, `.key`, `.value`, `.output`, `mlp_up`, `mlp_down`: the paths QLoRA
/// quantises, listed here) dequantised by the reference above; the embeddings, the head
/// and every vector as they are.
struct Dequantise {
    path: Vec<String>,
    layers: Vec<String>,
    levels: Vec<f32>,
}

impl ModuleMapper for Dequantise {
    fn enter_module(&mut self, name: &str, _: &str) {
        self.path.push(name.to_string());
    }

    fn exit_module(&mut self, _: &str, _: &str) {
        self.path.pop();
    }

    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        if !self.layers.contains(&self.path.join(".")) {
            return param;
        }
        let value = param.val();
        let device = value.device();
        let weight = Tensor::<2>::from_data(value.into_data(), &device);
        let values = dequantised(weight, &self.levels).into_data();
        Param::from_tensor(Tensor::<D>::from_data(values, &device)).set_require_grad(false)
    }
}

/// The built-in GPT with LoRA on every linear layer of its blocks and an NF4 base: its
/// blocks' matrices are held in NF4 while its embedding and head units' matrices (token
/// and position tables, the untied head) stay as they are, and the adapters train as plain
/// Burn trains them on that base, on 1 and 2 ranks, with and without recomputation.
#[test]
fn the_built_in_gpts_nf4_base_quantises_its_blocks_layers_alone() {
    use crate::units::{MODES, STEPS, Tokens, Workload, check_run, train as train_units, unit_recipe};
    use zerotrain_models::{Gpt, GptConfig};
    let json = serde_json::json!({"r": 2, "init_lora_weights": false, "target_modules": "all-linear"});
    let lora = zerotrain::nn::lora::LoraConfig::from_json(&json, "test", "zerotrain.lora").unwrap();
    let config = GptConfig { n_layer: 2, n_head: 2, n_embd: 16, block_size: 8, vocab_size: 11, tied_head: false };
    let init = seeded(67, |d| Gpt::new(&config, d).with_lora(&lora).unwrap());
    let names = ["attn.query", "attn.key", "attn.value", "attn.output", "mlp_up", "mlp_down"];
    let layers = (0..2).flat_map(|i| names.map(|n| format!("blocks.{i}.{n}.weight"))).collect();
    let quantised = init.clone().map(&mut Dequantise { path: Vec::new(), layers, levels: levels() });
    let w = Tokens { vocab: 11, len: 9 };
    let device = Device::flex().autodiff();
    let reference_plan = plan(&unit_recipe(0, 1, MODES[2], "fp32", ""), 2);
    let global = |m: &Gpt, step| w.global_loss(m, &reference_plan, step, &device);
    let (losses, reference) = reference_run_on(&quantised, &reference_plan, STEPS, global, &device);
    let reference = params_by_path(&reference);
    // The same global batch: 2 micro-batches a step on 1 rank, 1 on each of 2.
    for (world, gas, mode) in [(1, 2, MODES[2]), (2, 1, MODES[5])] {
        let plan = plan(&nf4(unit_recipe(3, gas, mode, "fp32", "")), world);
        let out = train_units(&w, &init, &plan, mode, STEPS).unwrap();
        check_run(&format!("world {world}, {mode:?}"), &out, &losses, &reference, (1e-6, 2e-6));
    }
}
