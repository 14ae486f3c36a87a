//! The adapter against its formula computed in f64 loops (outputs and gradients), its cuts
//! over thread ranks against the unsplit adapter, and PEFT's config rules.

use burn::module::Param;
use burn::nn::LinearConfig;
use burn::tensor::{Device, Tensor};
use serde_json::json;

use super::*;
use crate::nn::parallel::tests::{columns, draw, on_ranks, relative_error, tensor, values};

const S: f64 = 0.75;

fn spec(r: usize) -> AdapterSpec {
    AdapterSpec { r, alpha: S * r as f64, scaling: S, dropout: 0.0, init: LoraInit::Random }
}

fn param(values: &[f32], shape: [usize; 2]) -> Param<Tensor<2>> {
    Param::from_tensor(tensor(values, shape, true))
}

/// `y[t][o] = s * sum_k B[o][k] (A x_t)[k]` and the gradients of `sum(y * w)`, in f64.
struct Reference {
    y: Vec<f32>,
    grad_a: Vec<f32>,
    grad_b: Vec<f32>,
    grad_x: Vec<f32>,
}

fn reference(
    x: &[f32],
    a: &[f32],
    b: &[f32],
    w: &[f32],
    (tokens, d_in, r, d_out): (usize, usize, usize, usize),
) -> Reference {
    let at = |m: &[f32], i: usize| f64::from(m[i]);
    let down: Vec<f64> = (0..tokens * r)
        .map(|tk| (0..d_in).map(|i| at(a, (tk % r) * d_in + i) * at(x, (tk / r) * d_in + i)).sum())
        .collect();
    let y = (0..tokens * d_out)
        .map(|to| S * (0..r).map(|k| at(b, (to % d_out) * r + k) * down[(to / d_out) * r + k]).sum::<f64>())
        .map(|v| v as f32)
        .collect();
    // g[t][k] = s * sum_o w[t][o] B[o][k]: the gradient reaching A x.
    let g: Vec<f64> = (0..tokens * r)
        .map(|tk| S * (0..d_out).map(|o| at(w, (tk / r) * d_out + o) * at(b, o * r + tk % r)).sum::<f64>())
        .collect();
    let grad_b = (0..d_out * r)
        .map(|ok| S * (0..tokens).map(|t| at(w, t * d_out + ok / r) * down[t * r + ok % r]).sum::<f64>())
        .map(|v| v as f32)
        .collect();
    let grad_a = (0..r * d_in)
        .map(|ki| (0..tokens).map(|t| g[t * r + ki / d_in] * at(x, t * d_in + ki % d_in)).sum::<f64>() as f32)
        .collect();
    let grad_x = (0..tokens * d_in)
        .map(|ti| (0..r).map(|k| g[(ti / d_in) * r + k] * at(a, k * d_in + ti % d_in)).sum::<f64>() as f32)
        .collect();
    Reference { y, grad_a, grad_b, grad_x }
}

/// A frozen `Linear` with an adapter computes `base(x) + s B A x`; backward reaches A and
/// B with their formula's gradients and leaves the base without any.
#[test]
fn an_adapted_linear_adds_the_scaled_update_and_trains_only_the_adapter() {
    let (tokens, d_in, r, d_out) = (6, 5, 2, 3);
    let device = Device::flex().autodiff();
    let base = LinearConfig::new(d_in, d_out).init(&device);
    let mut layer = LoraLinear::new(base, Some(&spec(r)));
    let (a, b, x, w) =
        (draw(r * d_in, 1, 1.0), draw(d_out * r, 2, 1.0), draw(tokens * d_in, 3, 1.0), draw(tokens * d_out, 4, 1.0));
    let adapter = layer.adapter.as_mut().expect("asked for");
    (adapter.a, adapter.b) = (param(&a, [r, d_in]), param(&b, [d_out, r]));
    let input = tensor(&x, [2, tokens / 2, d_in], true);
    let y = layer.forward(input.clone());
    let plain = layer.base.forward(input.clone().detach());
    let want = reference(&x, &a, &b, &w, (tokens, d_in, r, d_out));
    let update = values(y.clone() - plain);
    assert!(relative_error(&update, &want.y) < 1e-5, "{update:?} vs {:?}", want.y);
    let grads = (y * tensor(&w, [2, tokens / 2, d_out], false)).sum().backward();
    let adapter = layer.adapter.as_ref().expect("asked for");
    let grad = |p: &Param<Tensor<2>>| values(p.val().grad(&grads).expect("the adapter trains"));
    assert!(relative_error(&grad(&adapter.a), &want.grad_a) < 1e-5);
    assert!(relative_error(&grad(&adapter.b), &want.grad_b) < 1e-5);
    assert!(layer.base.weight.val().grad(&grads).is_none(), "the frozen base got a weight gradient");
    assert!(layer.base.bias.as_ref().is_some_and(|b| b.val().grad(&grads).is_none()), "the frozen bias got one");
}

/// PEFT's starts: `true` leaves B zero (the adapted layer is the base) and A within
/// `1 / sqrt(in)`; `false` starts B non-zero too; `"gaussian"` draws A with std `1 / r`.
#[test]
fn adapters_start_as_init_lora_weights_says() {
    let device = Device::flex();
    let (d_in, d_out, r) = (64, 48, 8);
    let with = |init| LoraAdapter::init(d_in, d_out, &AdapterSpec { init, ..spec(r) }, &device);
    let kaiming = with(LoraInit::KaimingZero);
    let (a, b) = (values(kaiming.a.val()), values(kaiming.b.val()));
    let bound = 1.0 / (d_in as f32).sqrt();
    assert!(a.iter().all(|v| v.abs() <= bound) && a.iter().any(|v| v.abs() > bound / 2.0), "A within 1/sqrt(in)");
    assert!(b.iter().all(|&v| v == 0.0), "B starts at zero");
    let random = values(with(LoraInit::Random).b.val());
    assert!(random.iter().all(|v| v.abs() <= 1.0 / (r as f32).sqrt()) && random.iter().any(|&v| v != 0.0));
    let gaussian = values(with(LoraInit::GaussianZero).a.val());
    let std = (gaussian.iter().map(|v| v * v).sum::<f32>() / gaussian.len() as f32).sqrt();
    assert!((std - 1.0 / r as f32).abs() < 0.2 / r as f32, "std {std}, want {}", 1.0 / r as f32);
}

/// Over 2 thread ranks, an adapter on a column-parallel base (B cut by rows, A whole, the
/// input entered through the group's copy) gives each rank its rows of the unsplit update,
/// the unsplit gradient of A on every rank, its rows of B's, and the unsplit input
/// gradient; on a row-parallel base (A cut by columns, B whole, the input this rank's
/// features) every rank gets the whole update, its columns of A's gradient and the whole of
/// B's.
#[test]
fn adapters_follow_their_bases_cut_over_a_tensor_parallel_group() {
    let (tokens, d_in, r, d_out, n) = (4, 6, 2, 4, 2);
    let (a, b, x, w) =
        (draw(r * d_in, 5, 1.0), draw(d_out * r, 6, 1.0), draw(tokens * d_in, 7, 1.0), draw(tokens * d_out, 8, 1.0));
    let want = reference(&x, &a, &b, &w, (tokens, d_in, r, d_out));
    let column = on_ranks(n, |group| {
        let rows = group.rank() * d_out / n..(group.rank() + 1) * d_out / n;
        let b_rows = b[rows.start * r..rows.end * r].to_vec();
        let adapter = LoraAdapter::new(
            param(&a, [r, d_in]),
            param(&b_rows, [d_out / n, r]),
            &spec(r),
            AdapterCut::Column(group.clone()),
        );
        let input = tensor(&x, [1, tokens, d_in], true);
        let y = adapter.delta(group.copy_to(input.clone()));
        let grads =
            (y.clone() * tensor(&columns(&w, d_out, rows.clone()), [1, tokens, d_out / n], false)).sum().backward();
        let grad = |t: Tensor<2>| values(t.grad(&grads).expect("trained"));
        (rows, values(y), grad(adapter.a.val()), grad(adapter.b.val()), values(input.grad(&grads).expect("tracked")))
    });
    for (rows, y, grad_a, grad_b, grad_x) in column {
        assert!(relative_error(&y, &columns(&want.y, d_out, rows.clone())) < 1e-5, "rows {rows:?} of the update");
        assert!(relative_error(&grad_a, &want.grad_a) < 1e-5, "A's gradient is the group's sum");
        assert!(relative_error(&grad_b, &want.grad_b[rows.start * r..rows.end * r]) < 1e-5);
        assert!(relative_error(&grad_x, &want.grad_x) < 1e-5, "the input's gradient");
    }
    let row = on_ranks(n, |group| {
        let cols = group.rank() * d_in / n..(group.rank() + 1) * d_in / n;
        let a_cols = columns(&a, d_in, cols.clone());
        let adapter = LoraAdapter::new(
            param(&a_cols, [r, d_in / n]),
            param(&b, [d_out, r]),
            &spec(r),
            AdapterCut::Row(group.clone()),
        );
        let y = adapter.delta(tensor(&columns(&x, d_in, cols.clone()), [1, tokens, d_in / n], false));
        let grads = (y.clone() * tensor(&w, [1, tokens, d_out], false)).sum().backward();
        let grad = |t: Tensor<2>| values(t.grad(&grads).expect("trained"));
        (cols, values(y), grad(adapter.a.val()), grad(adapter.b.val()))
    });
    for (cols, y, grad_a, grad_b) in row {
        assert!(relative_error(&y, &want.y) < 1e-5, "the whole update on every rank");
        assert!(relative_error(&grad_a, &columns(&want.grad_a, d_in, cols)) < 1e-5);
        assert!(relative_error(&grad_b, &want.grad_b) < 1e-5);
    }
}

fn parse(value: serde_json::Value) -> Result<LoraConfig, String> {
    LoraConfig::from_json(&value, "config", "zerotrain.lora").map_err(|e| e.to_string())
}

fn adapted(config: &LoraConfig, path: &str) -> Option<AdapterSpec> {
    config.adapter(path, true, path == "lm_head", &["q_proj", "v_proj"]).unwrap()
}

/// PEFT's matching: a list names a module by its path or its last dotted names (not a
/// name's tail: `o_proj` is not `do_proj`), a string is a regex of the whole path,
/// `"all-linear"` leaves the head out, `exclude_modules` wins, `layers_to_transform` reads
/// the index after `layers_pattern`'s name (or any name), and `rank_pattern` /
/// `alpha_pattern` give a module its own rank and alpha (rslora scaling by the root).
#[test]
fn modules_are_adapted_by_peft_s_matching_rules() {
    let q = "model.layers.0.self_attn.q_proj";
    let config = parse(json!({"target_modules": ["q_proj", "mlp.down_proj"], "r": 4, "lora_alpha": 8})).unwrap();
    assert_eq!(adapted(&config, q).map(|s| (s.r, s.scaling)), Some((4, 2.0)));
    assert!(adapted(&config, "model.layers.0.mlp.down_proj").is_some());
    assert!(adapted(&config, "model.layers.0.mlp.xdown_proj").is_none());
    assert!(adapted(&config, "model.layers.0.self_attn.k_proj").is_none());
    let regex = parse(json!({"target_modules": r".*\.1\..*_proj"})).unwrap();
    assert!(adapted(&regex, "model.layers.1.self_attn.k_proj").is_some());
    assert!(adapted(&regex, "model.layers.0.self_attn.k_proj").is_none());
    assert!(adapted(&regex, "model.layers.1.self_attn.k_proj.x").is_none(), "the whole path must match");
    let all = parse(json!({"target_modules": "all-linear", "exclude_modules": ["o_proj"]})).unwrap();
    assert!(adapted(&all, q).is_some() && adapted(&all, "lm_head").is_none());
    assert!(adapted(&all, "model.layers.3.self_attn.o_proj").is_none());
    let default = parse(json!({})).unwrap();
    assert!(adapted(&default, q).is_some() && adapted(&default, "model.layers.0.mlp.up_proj").is_none());
    let layers = parse(json!({"target_modules": ["q_proj"], "layers_to_transform": [1, 2]})).unwrap();
    assert!(adapted(&layers, q).is_none() && adapted(&layers, "model.layers.2.self_attn.q_proj").is_some());
    let pattern =
        parse(json!({"target_modules": ["c_attn"], "layers_to_transform": 1, "layers_pattern": "h"})).unwrap();
    assert!(adapted(&pattern, "transformer.h.1.attn.c_attn").is_some());
    assert!(adapted(&pattern, "transformer.h.0.attn.c_attn").is_none());
    let patterns = parse(json!({"target_modules": "all-linear", "r": 8, "lora_alpha": 16, "use_rslora": true,
        "rank_pattern": {"v_proj": 4}, "alpha_pattern": {r"layers\.1\.self_attn\.v_proj": 2}}))
    .unwrap();
    let v1 = adapted(&patterns, "model.layers.1.self_attn.v_proj").unwrap();
    assert_eq!((v1.r, v1.alpha, v1.scaling), (4, 2.0, 1.0));
    let q0 = adapted(&patterns, q).unwrap();
    assert_eq!((q0.r, q0.scaling), (8, 16.0 / 8f64.sqrt()));
    let twice = parse(json!({"target_modules": ["v_proj"], "rank_pattern": {"v_proj": 4, r".*\.v_proj": 2}})).unwrap();
    let e = twice.adapter("model.layers.0.self_attn.v_proj", true, false, &[]).unwrap_err();
    assert!(e.contains("rank_pattern") && e.contains("v_proj"), "{e}");
}

/// Every key PEFT writes is read, at its own values where zerotrain builds it and at the
/// value that turns it off where it does not (DoRA refused by name); a key PEFT does not
/// write is refused unless it says nothing.
#[test]
fn peft_s_own_keys_are_accepted_and_variants_not_built_are_refused_by_name() {
    let written = json!({"alpha_pattern": {}, "auto_mapping": null, "base_model_name_or_path": "gpt2", "bias": "none",
        "corda_config": null, "eva_config": null, "exclude_modules": null, "fan_in_fan_out": true,
        "inference_mode": true, "init_lora_weights": true, "layer_replication": null, "layers_pattern": null,
        "layers_to_transform": null, "loftq_config": {}, "lora_alpha": 32, "lora_bias": false, "lora_dropout": 0.05,
        "megatron_config": null, "megatron_core": "megatron.core", "modules_to_save": null, "peft_type": "LORA",
        "peft_version": "0.19.1", "qalora_group_size": 16, "r": 16, "rank_pattern": {}, "revision": null,
        "target_modules": ["c_attn"], "target_parameters": null, "task_type": "CAUSAL_LM",
        "trainable_token_indices": null, "use_dora": false, "use_qalora": false, "use_rslora": false,
        "ensure_weight_tying": false, "lora_ga_config": null, "use_bdlora": null, "a_newer_switch": null});
    let config = parse(written.clone()).unwrap();
    assert_eq!((config.r, config.lora_alpha, config.lora_dropout, config.fan_in_fan_out), (16, 32.0, 0.05, true));
    let out = config.to_peft_json("gpt2", &["transformer.h.0.attn.c_attn".into()], true);
    assert_eq!(parse(out.clone()).unwrap().first_difference(&config), None, "written back as read: {out}");
    assert_eq!(out["peft_version"], "0.19.1");
    for (key, value, says) in [
        ("use_dora", json!(true), "DoRA"),
        ("lora_bias", json!(true), "bias"),
        ("r", json!(0), "at least 1"),
        ("lora_dropout", json!(1.0), "[0, 1)"),
        ("lora_dropout", json!(-0.1), "[0, 1)"),
        ("bias", json!("all"), "none"),
        ("init_lora_weights", json!("pissa"), "not built"),
        ("peft_type", json!("IA3"), "LoRA"),
        ("target_modules", json!([]), "no module"),
        ("target_modules", json!("(unclosed"), "regular expression"),
        ("a_newer_switch", json!(true), "unknown key"),
    ] {
        let mut bad = written.clone();
        bad[key] = value.clone();
        let e = parse(bad).unwrap_err();
        assert!(e.contains(&format!("zerotrain.lora.{key}")) && e.contains(says), "{key} = {value}: {e}");
    }
}

/// Targets are checked against the model: matching nothing names the pattern and a few
/// layers that exist; a `modules_to_save` that is no module is refused.
#[test]
fn targets_that_name_nothing_are_refused_naming_what_exists() {
    let linears: Vec<(String, bool)> = ["model.layers.0.self_attn.q_proj", "model.layers.0.mlp.up_proj", "lm_head"]
        .map(|p| (p.to_string(), p == "lm_head"))
        .into();
    let modules: Vec<String> = linears.iter().map(|(p, _)| p.clone()).chain(["model.norm".to_string()]).collect();
    let none = parse(json!({"target_modules": ["qproj"]})).unwrap();
    let e = none.check_against(&linears, &modules, &[]).unwrap_err();
    assert!(e.contains("[\"qproj\"]") && e.contains("model.layers.0.self_attn.q_proj"), "{e}");
    let save = parse(json!({"target_modules": ["q_proj"], "modules_to_save": ["score"]})).unwrap();
    let e = save.check_against(&linears, &modules, &[]).unwrap_err();
    assert!(e.contains("modules_to_save") && e.contains("\"score\""), "{e}");
    let fine = parse(json!({"target_modules": ["q_proj"], "modules_to_save": ["norm"]})).unwrap();
    fine.check_against(&linears, &modules, &[]).unwrap();
}
