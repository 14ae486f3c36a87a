//! Models declared in units ([`Engine::with_units`], [`Engine::forward_backward`]): equal to
//! a plain Burn loop at every stage, with and without activation checkpointing and
//! overlapped reduction, and bit for bit to each other where the sums are the same;
//! traffic and gathered memory exactly as the unit walk says; checkpoints that move between
//! groupings; clear errors for misdeclared units.

use std::path::Path;

use burn::module::Module;
use burn::nn::{Linear, LinearConfig};
use burn::tensor::{Device, Int, Tensor, TensorData};
use zerotrain::engine::{UnitModel, UnitSpec};
use zerotrain::{Engine, Error, LoadOptions, MemoryReport, Plan, launch};
use zerotrain_models::{Batch, Gpt, GptConfig, LmBatch, Mlp, TinyTransformer};

use crate::common::*;

pub(crate) const STEPS: u64 = 3;
/// As in `equivalence.rs`: the engine sums the same gradients in another order (over ranks,
/// over micro-steps, the root's contributions over units); Adam turns such rounding into
/// parameter differences up to ~lr x 1e-4 where a gradient is near zero. Measured worst
/// cases (`--nocapture`, the same on every run since the tests' initial models stopped
/// depending on concurrent tests, see `common::seeded`): transformer 1.23e-6, tied GPT
/// 4.9e-7, untied GPT 7.7e-7. Where the arithmetic is the same, the comparison is exact
/// (`at_one_rank_without_clipping_the_unit_walk_is_plain_burn_bit_for_bit`).
const PARAM_TOL: f32 = 2e-6;
const LOSS_TOL: f32 = 1e-6;

pub(crate) type Params = Vec<(String, Vec<f32>)>;

/// How a run drives the engine.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Mode {
    /// `Engine::with_units` + `forward_backward`, or `Engine::new` + `forward`/`backward`.
    pub units: bool,
    pub checkpointing: bool,
    pub overlap: bool,
}

pub(crate) const MODES: [Mode; 6] = [
    Mode { units: false, checkpointing: false, overlap: false },
    Mode { units: false, checkpointing: false, overlap: true },
    Mode { units: true, checkpointing: false, overlap: false },
    Mode { units: true, checkpointing: false, overlap: true },
    Mode { units: true, checkpointing: true, overlap: false },
    Mode { units: true, checkpointing: true, overlap: true },
];

/// The common recipe (clipping on), with `overlap_comm`, activation checkpointing, and
/// `zero` extra keys in `zero_optimization`; `precision` "fp32" or "bf16".
pub(crate) fn unit_recipe(stage: u8, gas: u64, mode: Mode, precision: &str, zero: &str) -> String {
    let json = recipe(stage, 2, gas, 0.05).replace(
        r#""stage3_param_persistence_threshold": 0"#,
        &format!(r#""stage3_param_persistence_threshold": 0, "overlap_comm": {}{zero}"#, mode.overlap),
    );
    let mut top = String::new();
    if mode.checkpointing {
        top.push_str(r#""activation_checkpointing": {},"#);
    }
    if precision == "bf16" {
        top.push_str(r#""bf16": {"enabled": true},"#);
    }
    json.replacen('{', &format!("{{ {top}"), 1)
}

/// A model and its data.
pub(crate) trait Workload: Sync {
    type Model: UnitModel + Sync;
    /// Rank `rank`'s batch of micro-step `micro` of step `step`.
    fn batch(
        &self,
        plan: &Plan,
        step: u64,
        micro: u64,
        rank: usize,
        device: &Device,
    ) -> <Self::Model as UnitModel>::Batch;
    /// The model's own loss on step `step`'s global batch (the reference).
    fn global_loss(&self, model: &Self::Model, plan: &Plan, step: u64, device: &Device) -> Tensor<1>;
}

/// The regression task of the other tests.
struct Regression<M>(std::marker::PhantomData<M>, fn(&M, &Batch) -> Tensor<1>);

impl<M: UnitModel<Batch = Batch> + Sync> Workload for Regression<M> {
    type Model = M;
    fn batch(&self, plan: &Plan, step: u64, micro: u64, rank: usize, device: &Device) -> Batch {
        TASK.batch(rank_indices(plan, step, micro, rank), device)
    }
    fn global_loss(&self, model: &M, plan: &Plan, step: u64, device: &Device) -> Tensor<1> {
        let n = plan.batch.train_batch_size;
        (self.1)(model, &TASK.batch(step * n..(step + 1) * n, device))
    }
}

/// Deterministic token sequences for a GPT.
pub(crate) struct Tokens {
    pub vocab: usize,
    pub len: usize,
}

impl Tokens {
    pub(crate) fn tokens(&self, indices: std::ops::Range<u64>, device: &Device) -> Tensor<2, Int> {
        let n = indices.end - indices.start;
        let values: Vec<i64> = indices
            .flat_map(|i| (0..self.len as u64).map(move |j| ((i * 7 + j * 3 + (i * j) % 5) % self.vocab as u64) as i64))
            .collect();
        Tensor::from_data(TensorData::new(values, [n as usize, self.len]), device)
    }
}

impl Workload for Tokens {
    type Model = Gpt;
    fn batch(&self, plan: &Plan, step: u64, micro: u64, rank: usize, device: &Device) -> LmBatch {
        self.tokens(rank_indices(plan, step, micro, rank), device).into()
    }
    fn global_loss(&self, model: &Gpt, plan: &Plan, step: u64, device: &Device) -> Tensor<1> {
        let n = plan.batch.train_batch_size;
        model.loss(self.tokens(step * n..(step + 1) * n, device))
    }
}

/// The whole model's loss through its units, for the one-unit path.
pub(crate) fn whole_loss<M: UnitModel>(model: &M, batch: &M::Batch) -> Tensor<1> {
    let mut hidden = None;
    for i in 0..model.units().len() {
        hidden = Some(model.forward_unit(i, hidden, batch));
    }
    model.output_loss(hidden.expect("units"), batch)
}

/// One micro-step of `batch` as `mode` drives the engine: through its unit walk, or the
/// whole loss forward and backward.
pub(crate) fn micro_step<M: UnitModel>(engine: &mut Engine<M>, mode: Mode, batch: &M::Batch) -> Result<(), Error> {
    if mode.units {
        engine.forward_backward(batch)?;
    } else {
        let loss = engine.forward(|m| whole_loss(m, batch))?;
        engine.backward(loss)?;
    }
    Ok(())
}

/// What a run produced: rank 0's losses, per-step bytes and fp32 masters (global order),
/// every rank's parameters and memory report.
pub(crate) struct Outcome {
    pub losses: Vec<f32>,
    pub bytes: Vec<u64>,
    pub master: Vec<f32>,
    pub params: Vec<Params>,
    pub memory: Vec<MemoryReport>,
}

pub(crate) fn train<W: Workload>(
    w: &W,
    init: &W::Model,
    plan: &Plan,
    mode: Mode,
    steps: u64,
) -> Result<Outcome, Error> {
    train_between(w, init, plan, mode, 0..steps, None, None)
}

/// Trains steps `steps`, after loading `resume` if given, and saves to `save` after.
pub(crate) fn train_between<W: Workload>(
    w: &W,
    init: &W::Model,
    plan: &Plan,
    mode: Mode,
    steps: std::ops::Range<u64>,
    resume: Option<&Path>,
    save: Option<&Path>,
) -> Result<Outcome, Error> {
    let out = launch(plan, |ctx| {
        let mut engine = if mode.units {
            Engine::with_units(init.clone(), plan, &ctx)?
        } else {
            Engine::new(init.clone(), plan, &ctx)?
        };
        if let Some(dir) = resume {
            engine.load_checkpoint(dir, None, LoadOptions::default())?;
        }
        let (mut losses, mut bytes) = (Vec::new(), Vec::new());
        for step in steps.clone() {
            for micro in 0..plan.batch.gradient_accumulation_steps {
                micro_step(&mut engine, mode, &w.batch(plan, step, micro, ctx.rank(), ctx.device()))?;
                if let Some(r) = engine.step()? {
                    losses.push(r.loss);
                    bytes.push(r.comm_bytes);
                }
            }
        }
        if let Some(dir) = save {
            engine.save_checkpoint(dir, None, serde_json::Value::Null)?;
        }
        let memory = engine.memory_report();
        let master = engine.master_params()?;
        Ok::<_, Error>((losses, bytes, master, params_by_path(&engine.full_model()?), memory))
    })?;
    let (losses, bytes, master) = (out[0].0.clone(), out[0].1.clone(), out[0].2.clone());
    let (params, memory) = out.into_iter().map(|(_, _, _, p, m)| (p, m)).unzip();
    Ok(Outcome { losses, bytes, master, params, memory })
}

/// Checks a run against reference losses and parameters: every loss within `tol.0`
/// relative, every rank's parameters the same, rank 0's within `tol.1` of `reference`.
/// Returns the worst relative loss and parameter differences.
pub(crate) fn check_run(what: &str, out: &Outcome, losses: &[f32], reference: &Params, tol: (f32, f32)) -> (f32, f32) {
    let mut worst_loss = 0.0f32;
    for (got, want) in out.losses.iter().zip(losses) {
        worst_loss = worst_loss.max((got - want).abs() / want.abs());
        assert!((got - want).abs() <= tol.0 * want.abs(), "{what}: loss {got} vs {want}");
    }
    for (rank, params) in out.params.iter().enumerate() {
        assert!(params == &out.params[0], "{what}: rank {rank} differs from rank 0");
    }
    let (diff, path) = max_abs_diff(&out.params[0], reference);
    assert!(diff <= tol.1, "{what}: max |param - reference| = {diff} at `{path}`");
    (worst_loss, diff)
}

/// For each world size, accumulation and stage: every mode equals plain Burn, ranks agree,
/// overlap changes no bit, checkpointing changes no bit, and the unit path's stages are
/// bitwise equal where the summation order is the same (0 = 1 and 2 = 3; all at
/// accumulation 1).
fn check_equivalence<W: Workload>(w: &W, init: &W::Model, world_sizes: &[usize]) {
    let device = Device::flex().autodiff();
    let (mut worst_param, mut worst_loss) = (0.0f32, 0.0f32);
    for &world_size in world_sizes {
        for gas in [1, 3] {
            let reference_plan = plan(&unit_recipe(0, gas, MODES[0], "fp32", ""), world_size);
            let (ref_losses, reference) = reference_run_on(
                init,
                &reference_plan,
                STEPS,
                |m, step| w.global_loss(m, &reference_plan, step, &device),
                &device,
            );
            let reference = params_by_path(&reference);
            let mut unit_path_by_stage = Vec::new();
            for stage in 0..=3 {
                let mut by_mode: Vec<(Mode, Params)> = Vec::new();
                for mode in MODES {
                    let what = format!("world {world_size} gas {gas} stage {stage} {mode:?}");
                    let plan = plan(&unit_recipe(stage, gas, mode, "fp32", ""), world_size);
                    let out = train(w, init, &plan, mode, STEPS).unwrap();
                    let (loss, param) = check_run(&what, &out, &ref_losses, &reference, (LOSS_TOL, PARAM_TOL));
                    (worst_loss, worst_param) = (worst_loss.max(loss), worst_param.max(param));
                    by_mode.push((mode, out.params.into_iter().next().unwrap()));
                }
                for (mode, params) in &by_mode {
                    let base = Mode { overlap: false, ..*mode };
                    let (_, same) = by_mode.iter().find(|(m, _)| *m == base).unwrap();
                    assert!(
                        params == same,
                        "world {world_size} gas {gas} stage {stage}: {mode:?} differs from {base:?}"
                    );
                }
                let (_, recomputed) = by_mode.iter().find(|(m, _)| m.checkpointing).unwrap();
                let (_, kept) = by_mode.iter().find(|(m, _)| m.units && !m.checkpointing).unwrap();
                assert!(recomputed == kept, "world {world_size} gas {gas} stage {stage}: recomputation changed bits");
                unit_path_by_stage.push(kept.clone());
            }
            let s = &unit_path_by_stage;
            assert!(s[0] == s[1] && s[2] == s[3], "world {world_size} gas {gas}: stages 0 = 1 and 2 = 3 bitwise");
            if gas == 1 {
                assert!(s[0] == s[2], "world {world_size}: all stages bitwise equal at accumulation 1");
            }
        }
    }
    eprintln!(
        "{}: worst |param - reference| {worst_param:e}, worst relative loss {worst_loss:e}",
        std::any::type_name::<W::Model>()
    );
}

/// At one rank, one micro-step per step and no clipping, the engine computes what plain
/// Burn computes, in the same order: the gradient crossing a unit boundary is the next
/// unit's input gradient exactly (the seed `sum(y * g)` back-propagates `g` times one),
/// the optimizer steps a flat range as it steps each tensor, and nothing is summed in
/// another order (no other rank, micro-step, or root unit to add). So every stage and mode
/// gives plain Burn's bits. (With clipping the norm is summed in another order; with a root,
/// its contributions are.)
#[test]
fn at_one_rank_without_clipping_the_unit_walk_is_plain_burn_bit_for_bit() {
    let device = Device::flex().autodiff();
    let regression = Regression(std::marker::PhantomData, |m: &TinyTransformer, b| m.loss(b));
    let transformer = seeded(14, |d| TinyTransformer::new(TASK.features, 16, 2, d));
    let gpt = tiny_gpt(false, 15);
    let tokens = Tokens { vocab: 11, len: 9 };
    let no_clip = |stage: u8, mode: Mode| {
        plan(
            &unit_recipe(stage, 1, mode, "fp32", "")
                .replace(r#""gradient_clipping": 0.05"#, r#""gradient_clipping": 0"#),
            1,
        )
    };
    fn exact<W: Workload>(w: &W, init: &W::Model, no_clip: &dyn Fn(u8, Mode) -> Plan, device: &Device) {
        let base = no_clip(0, MODES[0]);
        let (losses, reference) =
            reference_run_on(init, &base, STEPS, |m, step| w.global_loss(m, &base, step, device), device);
        let reference = params_by_path(&reference);
        for stage in 0..=3 {
            for mode in MODES {
                let out = train(w, init, &no_clip(stage, mode), mode, STEPS).unwrap();
                let (diff, path) = max_abs_diff(&out.params[0], &reference);
                assert!(
                    out.params[0] == reference,
                    "stage {stage} {mode:?}: `{path}` differs from plain Burn by {diff}"
                );
                assert_eq!(out.losses, losses, "stage {stage} {mode:?}");
            }
        }
    }
    exact(&regression, &transformer, &no_clip, &device);
    exact(&tokens, &gpt, &no_clip, &device);
}

#[test]
fn a_transformer_in_units_matches_plain_burn_in_every_mode_and_stage() {
    let init = seeded(11, |d| TinyTransformer::new(TASK.features, 16, 2, d));
    check_equivalence(&Regression(std::marker::PhantomData, |m: &TinyTransformer, b| m.loss(b)), &init, &[1, 2, 3]);
}

pub(crate) fn tiny_gpt(tied_head: bool, seed: u64) -> Gpt {
    seeded(seed, |d| {
        Gpt::new(&GptConfig { n_layer: 2, n_head: 2, n_embd: 16, block_size: 8, vocab_size: 11, tied_head }, d)
    })
}

/// The tied token embedding is the root unit: gathered for the whole pass, its gradients
/// from the embedding and the head summed.
#[test]
fn a_gpt_with_a_tied_head_in_units_matches_plain_burn_in_every_mode_and_stage() {
    check_equivalence(&Tokens { vocab: 11, len: 9 }, &tiny_gpt(true, 3), &[1, 2, 3]);
}

#[test]
fn a_gpt_with_an_untied_head_in_units_matches_plain_burn_in_every_mode_and_stage() {
    check_equivalence(&Tokens { vocab: 11, len: 9 }, &tiny_gpt(false, 4), &[2]);
}

/// LoRA on the built-in GPT (every linear layer of its blocks, random A and B so that both
/// train from the first step): the engine trains the adapters as plain Burn does, its
/// frozen base sharded at stage 3, in every mode.
#[test]
fn a_gpt_with_lora_in_units_matches_plain_burn_in_every_mode_and_stage() {
    let json = serde_json::json!({"r": 2, "init_lora_weights": false, "target_modules": "all-linear"});
    let lora = zerotrain::nn::lora::LoraConfig::from_json(&json, "test", "zerotrain.lora").unwrap();
    let config = GptConfig { n_layer: 2, n_head: 2, n_embd: 16, block_size: 8, vocab_size: 11, tied_head: true };
    let init = seeded(7, |d| Gpt::new(&config, d).with_lora(&lora).unwrap());
    assert_eq!(init.frozen_parameters().len(), params_by_path(&tiny_gpt(true, 7)).len());
    check_equivalence(&Tokens { vocab: 11, len: 9 }, &init, &[2]);
    // At stage 3 each of 2 ranks holds its half of the frozen base (fp32), to within each
    // unit's padding (the 4 units' and the root's: 16 elements at most each).
    let psi = 4 * config.num_params();
    let plan = plan(&recipe(3, 1, 1, 0.0), 2);
    let w = Tokens { vocab: 11, len: 9 };
    let held = launch(&plan, |ctx| {
        let mut engine = Engine::with_units(init.clone(), &plan, &ctx)?;
        let built = engine.memory_report().frozen;
        engine.forward_backward(&w.batch(&plan, 0, 0, ctx.rank(), ctx.device()))?;
        engine.step()?;
        Ok::<_, Error>([built, engine.memory_report().frozen])
    })
    .unwrap()
    .concat();
    for (rank, bytes) in held.iter().enumerate() {
        assert!(*bytes >= psi / 2 && *bytes <= psi / 2 + 4 * 16 * 5, "rank {rank}: {bytes} bytes of the base of {psi}");
    }
}

/// In bf16 the unit walk computes what the one-unit path computes, bit for bit, at every
/// stage and mode: the same bf16 operations in the same order (the seed back-propagates the
/// boundary gradient exactly), so the losses and parameters are identical.
#[test]
fn in_bf16_the_unit_walk_gives_the_one_unit_paths_bits() {
    let init = tiny_gpt(true, 8);
    let w = Tokens { vocab: 11, len: 9 };
    for gas in [1, 3] {
        for stage in 0..=3 {
            let one_unit =
                train(&w, &init, &plan(&unit_recipe(stage, gas, MODES[0], "bf16", ""), 2), MODES[0], 4).unwrap();
            for mode in &MODES[2..] {
                let what = format!("bf16 gas {gas} stage {stage} {mode:?}");
                let out = train(&w, &init, &plan(&unit_recipe(stage, gas, *mode, "bf16", ""), 2), *mode, 4).unwrap();
                assert_eq!(out.losses, one_unit.losses, "{what}");
                let (diff, path) = max_abs_diff(&out.params[0], &one_unit.params[0]);
                assert!(out.params[0] == one_unit.params[0], "{what}: parameters differ by {diff} at `{path}`");
            }
        }
    }
}

/// Padded size of a unit of `n` elements over `world_size` ranks (16-element alignment),
/// computed here from the rule, not by the engine.
pub(crate) fn padded(n: usize, world_size: usize) -> usize {
    n.div_ceil(16 * world_size) * 16 * world_size
}

/// Each declared unit's element count, and the root's (0 if none), grouping the model's
/// parameters by the module paths its `units()` lists.
pub(crate) fn unit_sizes<M: UnitModel>(model: &M) -> (Vec<usize>, usize) {
    let specs = model.units();
    let mut sizes = vec![0; specs.len()];
    let mut root = 0;
    for (path, values) in params_by_path(model) {
        let under = |p: &String| path == *p || path.starts_with(&format!("{p}."));
        match specs.iter().position(|s| s.params.iter().any(under)) {
            Some(u) => sizes[u] += values.len(),
            None => root += values.len(),
        }
    }
    (sizes, root)
}

/// Bytes per step each stage moves for a unit model, computed from the ring algorithms'
/// per-rank volumes: reduce-scatter and all-gather of `P` padded elements move
/// `P (N-1)/N`; all-reduce of `L` elements moves `L - own + (N-1) own` where `own` is the
/// rank's chunk. At stage 3 with checkpointing every declared unit is gathered twice per
/// micro-step and the root once: 3Ψ; recomputing only the first units, only those twice.
#[test]
fn bytes_per_step_follow_the_unit_walk_and_stage_3_moves_3_psi_with_checkpointing() {
    let init = tiny_gpt(true, 5);
    let w = Tokens { vocab: 11, len: 9 };
    let (sizes, root) = unit_sizes(&init);
    assert!(root > 0 && sizes.len() == 4, "the tied GPT has a root and 4 units: {sizes:?} {root}");
    for world_size in [2, 3] {
        let n = world_size;
        let bus = |p: usize| (p / n * (n - 1) * 4) as u64;
        let all_reduce = |len: usize, rank: usize| {
            let own = len / n + usize::from(rank < len % n);
            ((len - own + (n - 1) * own) * 4) as u64
        };
        let declared: Vec<usize> = sizes.iter().map(|&s| padded(s, n)).collect();
        let all: Vec<usize> = declared.iter().copied().chain([padded(root, n)]).collect();
        let sum = |v: &[usize], f: &dyn Fn(usize) -> u64| v.iter().map(|&p| f(p)).sum::<u64>();
        for gas in [1u64, 3] {
            for stage in 0..=3u8 {
                for mode in [MODES[2], MODES[4]] {
                    let plan = plan(&unit_recipe(stage, gas, mode, "fp32", ""), world_size);
                    let out = train(&w, &init, &plan, mode, 2).unwrap();
                    let rank = 0;
                    let data = match stage {
                        0 => sizes.iter().chain([&root]).map(|&s| all_reduce(s, rank)).sum(),
                        1 => 2 * sum(&all, &bus),
                        2 => gas * sum(&all, &bus) + sum(&all, &bus),
                        _ if mode.checkpointing => {
                            gas * (2 * sum(&declared, &bus) + bus(padded(root, n)) + sum(&all, &bus))
                        }
                        _ => gas * 2 * sum(&all, &bus),
                    };
                    let expected = data + all_reduce(n + 1, rank);
                    assert_eq!(out.bytes, vec![expected; 2], "world {n} gas {gas} stage {stage} {mode:?}");
                    if stage == 3 && mode.checkpointing {
                        // 3Ψ per micro-step, less the root's second gather.
                        let three_psi = 3 * sum(&all, &bus);
                        assert_eq!(data, gas * (three_psi - bus(padded(root, n))));
                    }
                }
            }
            // Recomputing only the first `k` units gathers only those a second time.
            for k in [0, 2] {
                let recipe = with_recompute_units(&unit_recipe(3, gas, MODES[4], "fp32", ""), k);
                let out = train(&w, &init, &plan(&recipe, world_size), MODES[4], 2).unwrap();
                let data = gas * (sum(&declared, &bus) + sum(&declared[..k], &bus) + bus(padded(root, n)));
                let expected = data + gas * sum(&all, &bus) + all_reduce(n + 1, 0);
                assert_eq!(out.bytes, vec![expected; 2], "world {n} gas {gas} recompute_units {k}");
            }
        }
    }
}

/// `recipe` (one of [`unit_recipe`]'s) recomputing only its first `units` units.
pub(crate) fn with_recompute_units(recipe: &str, units: usize) -> String {
    let timeout = r#""comm_timeout_s": 60"#;
    assert!(recipe.contains(timeout), "the recipe's zerotrain section moved");
    recipe.replacen(timeout, &format!(r#"{timeout}, "recompute_units": {units}"#), 1)
}

/// The stage-3 walk with checkpointing keeps at most the unit in use plus one prefetched
/// neighbour gathered, within `stage3_prefetch_bucket_size` and `stage3_max_live_parameters`
/// (in elements): the peak the engine reports is exactly the largest such pair; units not
/// recomputed (`recompute_units`) stay gathered beside it.
#[test]
fn gathered_parameters_never_exceed_the_unit_in_use_plus_the_prefetch_bound() {
    let init = seeded(6, |d| Mlp::new(&[6, 40, 24, 56, 6], d));
    let w = Regression(std::marker::PhantomData, |m: &Mlp, b| m.loss(b));
    let n = 2;
    let (sizes, root) = unit_sizes(&init);
    assert_eq!((sizes.len(), root), (4, 0));
    let units: Vec<u64> = sizes.iter().map(|&s| padded(s, n) as u64).collect();
    let mode = MODES[5];
    for (prefetch, max_live) in [(1_000_000u64, 1_000_000u64), (0, 1_000_000), (1_000_000, 500), (1000, 1_000_000)] {
        // The walk: forward 0..K prefetching i+1, backward K-1..0 prefetching i-1; a
        // neighbour is prefetched if it fits both bounds.
        let fits = |u: u64| u <= prefetch && u <= max_live;
        let k = units.len();
        let forward = (0..k).map(|i| units[i] + if i + 1 < k && fits(units[i + 1]) { units[i + 1] } else { 0 });
        let backward = (0..k).map(|i| units[i] + if i > 0 && fits(units[i - 1]) { units[i - 1] } else { 0 });
        let expected = forward.chain(backward).max().unwrap() * 4;
        let zero = format!(r#", "stage3_prefetch_bucket_size": {prefetch}, "stage3_max_live_parameters": {max_live}"#);
        let plan = plan(&unit_recipe(3, 2, mode, "fp32", &zero), n);
        let out = train(&w, &init, &plan, mode, 2).unwrap();
        for memory in &out.memory {
            assert_eq!(memory.peak_gathered, expected, "prefetch {prefetch} max_live {max_live}");
            let bound = (units.iter().max().unwrap() + prefetch.min(max_live).min(*units.iter().max().unwrap())) * 4;
            assert!(memory.peak_gathered <= bound + memory.persistent);
            // Between steps nothing is gathered: the model holds no parameter at all.
            assert_eq!(memory.params, (units.iter().sum::<u64>() / n as u64) * 4);
        }
    }
    // Recomputing only the first unit keeps the other three gathered from their forward to
    // their backward: the peak is the three together (the first with its prefetched
    // neighbour is less).
    let plan = plan(&with_recompute_units(&unit_recipe(3, 2, mode, "fp32", ""), 1), n);
    let out = train(&w, &init, &plan, mode, 2).unwrap();
    assert!(units[0] + units[1] < units[1..].iter().sum::<u64>());
    for memory in &out.memory {
        assert_eq!(memory.peak_gathered, units[1..].iter().sum::<u64>() * 4, "recompute_units 1");
    }
}

/// Saved with one grouping, world size and stage, a checkpoint resumes with any other: the
/// GPT's units interleave with its root in the global order, so each rank's file holds
/// several ranges.
#[test]
fn checkpoints_move_between_groupings_world_sizes_and_stages() {
    let init = tiny_gpt(true, 9);
    let w = Tokens { vocab: 11, len: 9 };
    let json = |stage: u8, mode: Mode| {
        unit_recipe(stage, 1, mode, "fp32", "")
            .replace("\"train_micro_batch_size_per_gpu\": 2", "\"train_batch_size\": 12")
    };
    let dir = std::env::temp_dir().join(format!("zt-units-ckpt-{}", std::process::id()));
    for (saver, resumers) in [
        ((4, 2, MODES[0]), [(2, 3, MODES[5]), (3, 1, MODES[3])]),
        ((3, 3, MODES[4]), [(2, 2, MODES[0]), (4, 0, MODES[2])]),
    ] {
        let _ = std::fs::remove_dir_all(&dir);
        let (n, stage, mode) = saver;
        train_between(&w, &init, &plan(&json(stage, mode), n), mode, 0..2, None, Some(&dir)).unwrap();
        let files = zerotrain_checkpoint::Checkpoint::open(&dir, None).unwrap().manifest().files.clone();
        assert!(mode.units == files.iter().any(|f| f.ranges.len() > 1), "per-unit shards are several ranges");
        for (n, stage, mode) in resumers {
            let plan = plan(&json(stage, mode), n);
            let resumed = train_between(&w, &init, &plan, mode, 2..4, Some(&dir), None).unwrap();
            let whole = train(&w, &init, &plan, mode, 4).unwrap();
            let worst = resumed.master.iter().zip(&whole.master).map(|(a, b)| (a - b).abs()).fold(0.0, f32::max);
            let what = format!("saved by {saver:?}, resumed by world {n} stage {stage} {mode:?}");
            assert!(worst <= 2e-6, "{what}: max |resumed - uninterrupted| = {worst}");
            for (a, b) in resumed.losses.iter().zip(&whole.losses[2..]) {
                assert!((a - b).abs() <= 1e-6 * b.abs(), "{what}: loss {a} vs {b}");
            }
        }
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Unit `b` also runs layer `a`: a parameter of another unit.
#[derive(Module, Debug)]
struct Misdeclared {
    a: Linear,
    b: Linear,
}

impl UnitModel for Misdeclared {
    type Batch = Tensor<2>;
    type Hidden = Tensor<2>;
    fn units(&self) -> Vec<UnitSpec> {
        vec![UnitSpec::new("a", ["a"]), UnitSpec::new("b", ["b"])]
    }
    fn forward_unit(&self, unit: usize, input: Option<Tensor<2>>, batch: &Tensor<2>) -> Tensor<2> {
        match input {
            None => self.a.forward(batch.clone()),
            Some(h) if unit == 1 => self.b.forward(self.a.forward(h)),
            Some(h) => h,
        }
    }
    fn output_loss(&self, output: Tensor<2>, _: &Tensor<2>) -> Tensor<1> {
        output.square().mean()
    }
}

#[test]
fn a_unit_using_another_units_parameter_or_a_one_unit_engine_is_a_clear_error() {
    let model = fresh(|d| Misdeclared { a: LinearConfig::new(3, 3).init(d), b: LinearConfig::new(3, 2).init(d) });
    let foreign = "produced gradients for parameters of other units: `a.weight` (unit `a`)";
    // At stage 3 with checkpointing unit `a` is released while `b` runs; without, it is
    // still gathered (its graph holds it) and its gradient shows up in `b`'s backward.
    for (stage, mode, needle) in
        [(0, MODES[2], foreign), (3, MODES[2], foreign), (3, MODES[4], "forward_unit(1) (unit `b`) panicked")]
    {
        let plan = plan(&unit_recipe(stage, 1, mode, "fp32", ""), 2);
        let err = launch(&plan, |ctx| {
            let mut engine = Engine::with_units(model.clone(), &plan, &ctx)?;
            let x = Tensor::<2>::from_data(TensorData::new(vec![0.5f32; 6], [2, 3]), ctx.device());
            engine.forward_backward(&x).map(|_| ())
        })
        .unwrap_err()
        .to_string();
        assert!(err.contains(needle), "stage {stage} {mode:?}: {err}");
    }
    let plan = plan(&unit_recipe(2, 1, MODES[2], "fp32", ""), 1);
    let err = launch(&plan, |ctx| {
        let mut engine = Engine::new(model.clone(), &plan, &ctx)?;
        let x = Tensor::<2>::from_data(TensorData::new(vec![0.5f32; 6], [2, 3]), ctx.device());
        engine.forward_backward(&x).map(|_| ())
    })
    .unwrap_err()
    .to_string();
    assert!(err.contains("forward_backward needs an engine built with Engine::with_units"), "{err}");
}

/// Models of two units and a layer `extra` no unit claims, each listing `$shared` as
/// shared parameters.
macro_rules! partial_model {
    ($name:ident, [$($shared:literal),*]) => {
        #[derive(Module, Debug)]
        struct $name {
            a: Linear,
            b: Linear,
            extra: Linear,
        }

        impl UnitModel for $name {
            type Batch = Tensor<2>;
            type Hidden = Tensor<2>;
            fn units(&self) -> Vec<UnitSpec> {
                vec![UnitSpec::new("a", ["a"]), UnitSpec::new("b", ["b"])]
            }
            fn shared(&self) -> Vec<String> {
                vec![$($shared.to_string()),*]
            }
            fn forward_unit(&self, unit: usize, input: Option<Tensor<2>>, batch: &Tensor<2>) -> Tensor<2> {
                match input {
                    None => self.extra.forward(self.a.forward(batch.clone())),
                    Some(h) if unit == 1 => self.extra.forward(self.b.forward(h)),
                    Some(h) => h,
                }
            }
            fn output_loss(&self, output: Tensor<2>, _: &Tensor<2>) -> Tensor<1> {
                output.square().mean()
            }
        }

        impl $name {
            fn new(device: &Device) -> Self {
                let layer = || LinearConfig::new(3, 3).init(device);
                Self { a: layer(), b: layer(), extra: layer() }
            }
        }
    };
}

partial_model!(Forgetful, []);
partial_model!(SharesExtra, ["extra"]);
partial_model!(SharesClaimed, ["a.weight"]);
partial_model!(SharesNothing, ["extr"]);

/// Root parameters the model does not list as shared are named in a warning; listed ones
/// are not; a shared path that a unit claims, or that names nothing, is an error.
#[test]
fn root_parameters_not_declared_shared_are_named_and_bad_shared_paths_are_errors() {
    let plan = plan(&unit_recipe(2, 1, MODES[2], "fp32", ""), 2);
    fn notices_or_error<M: UnitModel + Sync + 'static>(plan: &Plan, model: M) -> Result<Vec<String>, String> {
        launch(plan, |ctx| Engine::with_units(model.clone(), plan, &ctx).map(|e| e.notices().to_vec()))
            .map(|mut all| all.swap_remove(0))
            .map_err(|e| e.to_string())
    }
    let root = "no declared unit claims extra.weight, extra.bias: they form the root unit";
    let forgetful = notices_or_error(&plan, fresh(Forgetful::new)).unwrap();
    assert_eq!(forgetful.iter().filter(|n| n.contains(root)).count(), 1, "{forgetful:?}");
    let shared = notices_or_error(&plan, fresh(SharesExtra::new)).unwrap();
    assert!(!shared.iter().any(|n| n.contains("no declared unit claims")), "{shared:?}");
    let claimed = notices_or_error(&plan, fresh(SharesClaimed::new)).unwrap_err();
    assert!(
        claimed.contains("shared parameter path `a.weight` is not left to the root: unit `a` claims it"),
        "{claimed}"
    );
    let nothing = notices_or_error(&plan, fresh(SharesNothing::new)).unwrap_err();
    assert!(nothing.contains("shared parameter path `extr` is not left to the root: it names no trainable parameter"));
}

/// `evaluate` walks the units without gradients: the loss of the whole model, and at stage
/// 3 nothing stays gathered after it.
#[test]
fn evaluate_gives_the_whole_models_loss_one_unit_at_a_time() {
    let init = tiny_gpt(true, 10);
    let w = Tokens { vocab: 11, len: 9 };
    for stage in [0, 3] {
        let plan = plan(&unit_recipe(stage, 1, MODES[5], "fp32", ""), 2);
        let out = launch(&plan, |ctx| {
            let mut engine = Engine::with_units(init.clone(), &plan, &ctx)?;
            let batch = w.batch(&plan, 0, 0, ctx.rank(), ctx.device());
            engine.forward_backward(&batch)?;
            engine.step()?;
            let before = engine.memory_report().params;
            let value = engine.evaluate(&batch)?;
            let after = engine.memory_report().params;
            let whole = engine.full_model()?.loss(batch.tokens.clone()).into_scalar::<f32>();
            Ok::<_, Error>((value, whole, before, after))
        })
        .unwrap();
        for (value, whole, before, after) in out {
            assert!((value - whole).abs() <= 1e-6 * whole.abs(), "stage {stage}: {value} vs {whole}");
            assert_eq!(before, after, "stage {stage}: evaluate leaves the model as it found it");
        }
    }
}

/// Stage 1 with `reduce_scatter: false` all-reduces each unit and keeps its shard: the
/// same sums as the reduce-scatter, so the same bits, for twice the reduction traffic.
#[test]
fn stage_1_all_reduce_variant_equals_reduce_scatter_bit_for_bit() {
    let init = tiny_gpt(true, 12);
    let w = Tokens { vocab: 11, len: 9 };
    for gas in [1, 3] {
        let json = |rs: bool| unit_recipe(1, gas, MODES[3], "fp32", &format!(r#", "reduce_scatter": {rs}"#));
        let scattered = train(&w, &init, &plan(&json(true), 3), MODES[3], 3).unwrap();
        let reduced = train(&w, &init, &plan(&json(false), 3), MODES[3], 3).unwrap();
        assert!(scattered.master == reduced.master, "gas {gas}");
        assert_eq!(scattered.losses, reduced.losses);
        assert!(reduced.bytes[0] > scattered.bytes[0]);
    }
}

/// Buckets far smaller than a unit (several reduce-scatters per unit, two in flight at a
/// time) move the same bytes and give the same bits as one bucket per unit.
#[test]
fn small_buckets_give_the_same_bits_and_bytes_as_one_bucket_per_unit() {
    let init = tiny_gpt(true, 13);
    let w = Tokens { vocab: 11, len: 9 };
    for stage in [2, 3] {
        for mode in [MODES[3], MODES[5]] {
            let json =
                |bucket: u64| unit_recipe(stage, 3, mode, "fp32", &format!(r#", "reduce_bucket_size": {bucket}"#));
            let one = train(&w, &init, &plan(&json(500_000_000), 3), mode, 2).unwrap();
            let many = train(&w, &init, &plan(&json(96), 3), mode, 2).unwrap();
            assert!(one.master == many.master, "stage {stage} {mode:?}");
            assert_eq!(one.bytes, many.bytes, "stage {stage} {mode:?}");
        }
    }
}

/// At stage 3, `stage3_param_persistence_threshold` keeps every tensor of at most that many
/// elements whole on every rank (DeepSpeed's default of 1e5 keeps a small model entirely
/// unsharded): the engine says how many parameters, in how many tensors, and their bytes
/// per rank whole and sharded, counted here from the model's own tensors; with none kept
/// whole, or on one rank (whose shard is the whole), it says nothing.
#[test]
fn stage_3_says_what_its_persistence_threshold_keeps_whole() {
    let init = tiny_gpt(true, 6);
    let sizes: Vec<usize> = params_by_path(&init).iter().map(|(_, v)| v.len()).collect();
    let total: usize = sizes.iter().sum();
    let kept = recipe(3, 1, 1, 0.0).replace("persistence_threshold\": 0", "persistence_threshold\": 100000");
    assert!(kept.contains("100000"), "the recipe's threshold moved");
    let alone = plan(&kept, 1);
    let notices =
        launch(&alone, |ctx| Ok::<_, Error>(Engine::with_units(init.clone(), &alone, &ctx)?.notices().to_vec()))
            .unwrap();
    assert!(!notices[0].iter().any(|n| n.contains("persistence_threshold")), "one rank: {:?}", notices[0]);
    for threshold in [0, 16, 100_000] {
        let json = recipe(3, 1, 1, 0.0).replace(
            r#""stage3_param_persistence_threshold": 0"#,
            &format!(r#""stage3_param_persistence_threshold": {threshold}"#),
        );
        let plan = plan(&json, 2);
        let notices = launch(&plan, |ctx| {
            let engine = Engine::with_units(init.clone(), &plan, &ctx)?;
            Ok::<_, Error>(engine.notices().to_vec())
        })
        .unwrap();
        let note = notices[0].iter().find(|n| n.contains("persistence_threshold"));
        let kept: Vec<usize> = sizes.iter().copied().filter(|&n| n <= threshold).collect();
        if kept.is_empty() {
            assert!(note.is_none(), "threshold {threshold}: {note:?}");
            continue;
        }
        let (elems, note) = (kept.iter().sum::<usize>(), note.expect("a note on what stays whole"));
        let want = format!("keeps {elems} of {total} parameters");
        assert!(note.contains(&want) && note.contains(&format!("{} tensors of <= {threshold}", kept.len())), "{note}");
        assert!(
            note.contains(&format!("{} bytes each, against {} sharded", elems * 4, (elems * 4).div_ceil(2))),
            "{note}"
        );
    }
}

/// Evaluation at stage 3 gathers the whole model; that is reported apart
/// (`peak_eval_gathered`, every unit's padded size) and leaves training's peaks as
/// training left them.
#[test]
fn evaluation_at_stage_3_is_reported_apart_from_the_training_peak() {
    let init = seeded(6, |d| Mlp::new(&[6, 40, 24, 56, 6], d));
    let w = Regression(std::marker::PhantomData, |m: &Mlp, b| m.loss(b));
    let n = 2;
    let (sizes, _) = unit_sizes(&init);
    let whole: u64 = sizes.iter().map(|&s| padded(s, n) as u64 * 4).sum();
    let mode = MODES[5];
    let plan = plan(&unit_recipe(3, 1, mode, "fp32", ""), n);
    let reports = launch(&plan, |ctx| {
        let mut engine = Engine::with_units(init.clone(), &plan, &ctx)?;
        engine.forward_backward(&w.batch(&plan, 0, 0, ctx.rank(), ctx.device()))?;
        engine.step()?;
        let trained = engine.memory_report();
        engine.eval(|_| ())?;
        Ok::<_, Error>((trained, engine.memory_report()))
    })
    .unwrap();
    for (trained, evaluated) in reports {
        assert!(trained.peak_gathered > 0 && trained.peak_gathered < whole, "{trained:?}");
        assert_eq!(trained.peak_eval_gathered, 0);
        assert_eq!(evaluated.peak_gathered, trained.peak_gathered);
        assert_eq!(evaluated.peak_transient, trained.peak_transient);
        assert_eq!(evaluated.peak_eval_gathered, whole);
    }
}
