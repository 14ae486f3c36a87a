//! A seeded model handed to the engine still lazy (Burn draws a parameter's first value when
//! it is first read) starts as the same model whatever the layout: world size, ZeRO stage,
//! recomputation, pipeline stages, data-parallel ranks per stage, compute dtype. The engine
//! reads a model's units in an order that depends on the layout, and ranks that are threads
//! share each lazy parameter's value; a 2-stage pipeline once started from another model
//! than the same config without `pipeline` (initial validation loss 2.58169 against
//! 2.57280).

use burn::tensor::Device;
use zerotrain::{Error, Plan, launch};
use zerotrain_models::{Gpt, GptConfig};

use crate::common::*;

/// The tiny GPT, built lazily on the CPU: nothing drawn yet.
pub(crate) fn lazy_gpt() -> Gpt {
    let config = GptConfig { n_layer: 3, n_head: 2, n_embd: 16, block_size: 8, vocab_size: 11, tied_head: true };
    Gpt::new(&config, &Device::flex().autodiff())
}

/// Every rank's fp32 masters (the whole model, global order) right after the engine is
/// built over a fresh lazy GPT, each rank given a clone of it as `zerotrain train` does;
/// the ranks must agree.
pub(crate) fn initial_masters(plan: &Plan) -> Vec<f32> {
    let init = lazy_gpt();
    let out = launch(plan, |ctx| {
        let engine = zerotrain::trainer(init.clone(), plan, &ctx)?;
        engine.master_params()
    })
    .unwrap_or_else(|e: Error| panic!("{e}"));
    for (rank, masters) in out.iter().enumerate() {
        assert!(masters == &out[0], "rank {rank} starts from another model than rank 0");
    }
    out.into_iter().next().expect("a rank")
}

/// A config of `stage` with the pipeline and other keys `extra` (each followed by a comma).
fn layout(stage: u8, extra: &str) -> String {
    recipe(stage, 1, 2, 0.0).replacen('{', &format!("{{ {extra}"), 1)
}

#[test]
fn a_lazy_seeded_model_starts_the_same_in_every_layout() {
    let pipeline = |stages: usize| format!(r#""pipeline": {{"stages": {stages}, "partition": "uniform"}},"#);
    let layouts: [(&str, String, usize); 7] = [
        ("one rank, stage 0", layout(0, ""), 1),
        ("two ranks, stage 3", layout(3, ""), 2),
        ("three ranks, stage 2, recomputation", layout(2, r#""activation_checkpointing": {},"#), 3),
        ("two stages, one rank each", layout(1, &pipeline(2)), 2),
        ("two stages of two ranks", layout(0, &pipeline(2)), 4),
        ("three stages", layout(0, &pipeline(3)), 3),
        ("two ranks, bf16", layout(1, r#""bf16": {"enabled": true},"#), 2),
    ];
    let mut first: Option<(&str, Vec<f32>)> = None;
    for (name, json, world) in &layouts {
        let masters = initial_masters(&plan(json, *world));
        assert!(masters.iter().any(|&x| x != 0.0) && masters.iter().all(|x| x.is_finite()), "{name}");
        match &first {
            None => first = Some((name, masters)),
            Some((reference, expected)) => {
                let differ = masters.iter().zip(expected).filter(|(a, b)| a.to_bits() != b.to_bits()).count();
                assert_eq!(masters.len(), expected.len(), "{name}");
                assert!(differ == 0, "{name}: {differ} of {} values differ from {reference}'s", masters.len());
            }
        }
    }
    // Another seed, another model.
    let other = plan(&layout(0, "").replacen('{', r#"{"seed": 7, "#, 1), 1);
    assert!(initial_masters(&other) != first.expect("a layout").1, "the seed chooses the model");
}
