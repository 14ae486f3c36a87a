//! Engine benchmarks: overhead against a plain Burn loop, and the cost of each stage.

use std::time::Instant;

use burn::module::Module;
use burn::optim::{AdamWConfig, GradientsParams};
use burn::tensor::Device;
use serde::Serialize;
use zerotrain_zero::memory::{BytesPerParam, model_state_bytes};
use zerotrain_zero::{Sharding, ZeroStage};

use super::RunMode;
use zerotrain::{Engine, PhaseTimes, Plan, Result, launch};
use zerotrain_models::data::{Corpus, windows};
use zerotrain_models::{Gpt, GptConfig, LmBatch};

/// The benchmark model: a 4-layer GPT of width 128 (about 0.8M parameters).
pub fn bench_model(vocab: usize) -> GptConfig {
    GptConfig { n_layer: 4, n_head: 4, n_embd: 128, block_size: 64, vocab_size: vocab, tied_head: true }
}

/// The benchmarks' plan: AdamW, `micro` samples per rank, the stage, precision and mode;
/// `overlap` sets `overlap_comm` (else DeepSpeed's default). Under mpirun it runs on MPI.
fn bench_plan(stage: u8, precision: &str, world_size: usize, micro: u64, mode: RunMode, overlap: bool) -> Result<Plan> {
    let half = match precision {
        "bf16" => r#""bf16": {"enabled": true},"#,
        _ => "",
    };
    let checkpointing = mode.config_keys();
    let overlap = if overlap { r#", "overlap_comm": true"# } else { "" };
    let json = format!(
        r#"{{ {half} {checkpointing} "train_micro_batch_size_per_gpu": {micro},
             "zero_optimization": {{"stage": {stage}, "stage3_param_persistence_threshold": 0 {overlap}}},
             "optimizer": {{"type": "AdamW", "params": {{"lr": 1e-3, "weight_decay": 0.0}}}} }}"#
    );
    super::resolve(&json, world_size)
}

/// The median of `v` (the upper one of an even count).
pub(super) fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Engine (world size 1, stage 0) against a plain Burn `ModuleOptimizer` loop on the same
/// model and batches: (plain seconds per step, engine seconds per step), medians over
/// `rounds` alternating rounds of `steps` steps.
pub fn overhead(steps: u64, rounds: usize) -> Result<(f64, f64)> {
    let corpus = Corpus::arithmetic(20_000, 1);
    let shape = bench_model(corpus.vocab.len());
    let plan = bench_plan(0, "fp32", 1, 16, RunMode::OneUnit, false)?;
    let device = Device::flex().autodiff();
    device.seed(1);
    let init = Gpt::new(&shape, &device);
    let (mut plain, mut engine_times) = (Vec::new(), Vec::new());
    for _ in 0..rounds.max(1) {
        // Plain Burn: the loop the engine replaces.
        let mut model = init.clone().fork(&device);
        let mut optim = AdamWConfig::new().with_epsilon(1e-8).with_weight_decay(0.0).init();
        for step in 0..steps + 2 {
            let t = Instant::now();
            let tokens = windows(&corpus.train, shape.block_size, 1, step, 0, 16, &device);
            let loss = model.loss(tokens);
            let grads = GradientsParams::from_grads(loss.backward(), &model);
            model = optim.step(1e-3, model, grads);
            if step >= 2 {
                plain.push(t.elapsed().as_secs_f64());
            }
        }
        let times = launch(&plan, |ctx| {
            let mut engine = Engine::new(init.clone(), &plan, &ctx)?;
            let mut times = Vec::new();
            for step in 0..steps + 2 {
                let t = Instant::now();
                let tokens = windows(&corpus.train, shape.block_size, 1, step, 0, 16, ctx.device());
                let loss = engine.forward(|m| m.loss(tokens))?;
                engine.backward(loss)?;
                engine.step()?;
                if step >= 2 {
                    times.push(t.elapsed().as_secs_f64());
                }
            }
            Ok::<_, zerotrain::Error>(times)
        })?;
        engine_times.extend(times.into_iter().next().unwrap_or_default());
    }
    Ok((median(plain), median(engine_times)))
}

/// One row of the stage table.
#[derive(Debug, Clone, Serialize)]
pub struct StageRow {
    /// Ranks.
    pub world_size: usize,
    /// ZeRO stage.
    pub stage: u8,
    /// `fp32` or `bf16`.
    pub precision: String,
    /// How the model runs: one unit, units, units with activation checkpointing.
    pub mode: RunMode,
    /// Median step time, seconds (rank 0).
    pub step_seconds: f64,
    /// Median of each phase, seconds (rank 0).
    pub times: PhaseTimes,
    /// Bytes rank 0 moved per step.
    pub comm_bytes: u64,
    /// The stage's theoretical volume per step (bus convention, plus padding).
    pub theory_bytes: u64,
    /// Rank 0's model-state bytes.
    pub memory: u64,
    /// The ZeRO formula for them.
    pub formula: u64,
}

/// The modes each dtype is measured in.
const MODES: [(&str, &[RunMode]); 2] = [
    ("fp32", &[RunMode::OneUnit, RunMode::Units, RunMode::Checkpointed]),
    ("bf16", &[RunMode::OneUnit, RunMode::Checkpointed]),
];

/// Stages 0-3 in every mode of `MODES` at `world_size` ranks (`overlap`: with
/// `overlap_comm` at every stage): `steps` measured steps after 2 warm-up. One launch for
/// all of them, so that it runs under mpirun too (the world size then is mpirun's).
pub fn stages(world_size: usize, steps: u64, overlap: bool) -> Result<Vec<StageRow>> {
    let corpus = Corpus::arithmetic(20_000, 1);
    let shape = bench_model(corpus.vocab.len());
    let device = Device::flex().autodiff();
    device.seed(1);
    let init = Gpt::new(&shape, &device);
    let mut configs = Vec::new();
    for (precision, modes) in MODES {
        for &mode in modes {
            for stage in 0..=3u8 {
                configs.push((precision, mode, stage, bench_plan(stage, precision, world_size, 8, mode, overlap)?));
            }
        }
    }
    let out = launch(&configs[0].3, |ctx| {
        let mut rows = Vec::new();
        for (precision, mode, stage, plan) in &configs {
            let mut engine = mode.engine(init.clone(), plan, &ctx)?;
            let (mut step_times, mut reports) = (Vec::new(), Vec::new());
            for step in 0..steps + 2 {
                let t = Instant::now();
                let first = ctx.rank() as u64 * 8;
                let tokens = windows(&corpus.train, shape.block_size, 1, step, first, 8, ctx.device()).into();
                mode.micro_step(&mut engine, &tokens, |m, b: &LmBatch| m.loss(b.tokens.clone()))?;
                let report = engine.step()?.expect("accumulation 1");
                if step >= 2 {
                    step_times.push(t.elapsed().as_secs_f64());
                    reports.push(report);
                }
            }
            let (memory, sharding) = (engine.memory_report(), engine.sharding());
            rows.push(StageRow {
                world_size: plan.world_size(),
                stage: *stage,
                precision: precision.to_string(),
                mode: *mode,
                step_seconds: median(step_times),
                times: median_times(&reports),
                comm_bytes: reports.last().map_or(0, |r| r.comm_bytes),
                theory_bytes: theory_bytes(*stage, *mode, sharding, precision),
                memory: memory.model_states(),
                formula: formula_bytes(*stage, sharding, precision),
            });
        }
        Ok::<_, zerotrain::Error>(rows)
    })?;
    Ok(out.into_iter().next().expect("rank 0"))
}

/// Each phase's median over the steps.
pub(super) fn median_times(reports: &[zerotrain::StepReport]) -> PhaseTimes {
    let pick = |f: fn(&PhaseTimes) -> f64| median(reports.iter().map(|r| f(&r.times)).collect());
    PhaseTimes {
        forward: pick(|t| t.forward),
        backward: pick(|t| t.backward),
        reduce: pick(|t| t.reduce),
        optimizer: pick(|t| t.optimizer),
        gather: pick(|t| t.gather),
        comm_wait: pick(|t| t.comm_wait),
        comm_busy: pick(|t| t.comm_busy),
        pipe_wait: pick(|t| t.pipe_wait),
    }
}

/// The data volume of one step at accumulation 1, bus convention ((N-1)/N of each
/// buffer; 16-bit elements gathered in bf16, reduced in bf16 over threads): 2Ψ (each unit
/// reduced once and gathered once), except stage 3 with checkpointing, which gathers
/// every declared unit twice: 3Ψ less the root's second gather.
fn theory_bytes(stage: u8, mode: RunMode, sharding: &Sharding, precision: &str) -> u64 {
    let n = sharding.world_size() as u64;
    let elem = if precision == "fp32" { 4 } else { 2 };
    let bus = |elems: u64| elems * elem * (n - 1) / n;
    let units = sharding.units();
    let padded: u64 = units.iter().map(|u| u.layout.padded_elems() as u64).sum();
    let root = units.iter().find(|u| u.name == "root").map_or(0, |u| u.layout.padded_elems() as u64);
    match (stage, mode) {
        // All-reduce moves 2(N-1)/N of each unit's real elements.
        (0, _) => 2 * units.iter().map(|u| bus(u.layout.num_elems() as u64)).sum::<u64>(),
        (3, RunMode::Checkpointed) => 3 * bus(padded) - bus(root),
        _ => 2 * bus(padded),
    }
}

/// The ZeRO formula for a rank's model states (its shard: every unit's).
fn formula_bytes(stage: u8, sharding: &Sharding, precision: &str) -> u64 {
    let st = ZeroStage::from_index(stage.into()).expect("stage");
    let cost = if precision == "fp32" { BytesPerParam::FP32_ADAM } else { BytesPerParam::MIXED_ADAM };
    model_state_bytes(st, sharding.global().num_elems() as u64, sharding.local_len() as u64, cost).total()
}

/// The stage table as text; `base[i]` is row `i`'s stage 0 one-unit step time.
pub fn format_stages(rows: &[StageRow], base: &[f64], backend: &str, overlap: bool) -> String {
    let overlap = if overlap { "overlap_comm at every stage" } else { "overlap_comm at stage 3" };
    let mut out = format!(
        "stage cost ({backend}, {overlap}; GPT 4x128, 8 sequences of 64 tokens per rank; medians; ms; rank 0; \
         vs st0: stage 0 one unit)\n{}",
        "ranks stage dtype mode          step  vs st0 forward backward reduce  optim gather  wait  busy  bytes/step    theory  states B  formula B\n"
    );
    for (r, base) in rows.iter().zip(base) {
        let t = r.times;
        let ms = |s: f64| s * 1e3;
        out.push_str(&format!(
            "{:>5} {:>5} {:<5} {:<12} {:>6.1} {:>6.2}x {:>7.1} {:>8.1} {:>6.1} {:>6.1} {:>6.1} {:>5.1} {:>5.1} {:>11} {:>9} {:>9} {:>10}\n",
            r.world_size,
            r.stage,
            r.precision,
            format!("{:?}", r.mode).to_lowercase(),
            ms(r.step_seconds),
            r.step_seconds / base,
            ms(t.forward),
            ms(t.backward),
            ms(t.reduce),
            ms(t.optimizer),
            ms(t.gather),
            ms(t.comm_wait),
            ms(t.comm_busy),
            r.comm_bytes,
            r.theory_bytes,
            r.memory,
            r.formula
        ));
    }
    out
}

/// One point of the growth table.
#[derive(Debug, Clone, Serialize)]
pub struct GrowthRow {
    /// Trainable parameters.
    pub params: u64,
    /// Ranks.
    pub world_size: usize,
    /// Median step time, seconds (rank 0).
    pub step_seconds: f64,
    /// Rank 0's model-state bytes.
    pub memory: u64,
}

/// Step time and per-rank memory at ZeRO-2 for three GPT sizes over a 20x range and world
/// sizes 1, 2 and 4.
pub fn growth(steps: u64) -> Result<Vec<GrowthRow>> {
    let corpus = Corpus::arithmetic(20_000, 1);
    let vocab = corpus.vocab.len();
    let shapes =
        [(2, 64), (4, 128), (4, 256)].map(|(n_layer, n_embd)| GptConfig { n_layer, n_embd, ..bench_model(vocab) });
    let mut rows = Vec::new();
    for shape in shapes {
        let device = Device::flex().autodiff();
        device.seed(1);
        let init = Gpt::new(&shape, &device);
        for world_size in [1, 2, 4] {
            let plan = bench_plan(2, "fp32", world_size, 8, RunMode::OneUnit, false)?;
            let out = launch(&plan, |ctx| {
                let mut engine = Engine::new(init.clone(), &plan, &ctx)?;
                let mut times = Vec::new();
                for step in 0..steps + 2 {
                    let t = Instant::now();
                    let tokens =
                        windows(&corpus.train, shape.block_size, 1, step, ctx.rank() as u64 * 8, 8, ctx.device());
                    let loss = engine.forward(|m| m.loss(tokens))?;
                    engine.backward(loss)?;
                    engine.step()?;
                    if step >= 2 {
                        times.push(t.elapsed().as_secs_f64());
                    }
                }
                Ok::<_, zerotrain::Error>((median(times), engine.memory_report().model_states()))
            })?;
            let (step_seconds, memory) = out[0];
            rows.push(GrowthRow { params: shape.num_params(), world_size, step_seconds, memory });
        }
    }
    Ok(rows)
}

/// Two panels: step time and per-rank memory against parameters, one line per world size.
pub fn plot_growth(rows: &[GrowthRow], out: &std::path::Path) -> std::result::Result<(), String> {
    use plotters::prelude::*;
    crate::train::plot_font();
    let root = BitMapBackend::new(out, (1100, 450)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| e.to_string())?;
    let panels = root.split_evenly((1, 2));
    let max_p = rows.iter().map(|r| r.params).max().unwrap_or(1) as f64 * 1.1;
    let colours = [BLUE, RED, GREEN];
    for (panel, (title, value)) in panels.iter().zip([
        ("step time (ms)", Box::new(|r: &GrowthRow| r.step_seconds * 1e3) as Box<dyn Fn(&GrowthRow) -> f64>),
        ("model states per rank (MB)", Box::new(|r: &GrowthRow| r.memory as f64 / 1e6)),
    ]) {
        let max_v = rows.iter().map(&value).fold(0.0, f64::max) * 1.1;
        let mut chart = ChartBuilder::on(panel)
            .caption(title, ("sans-serif", 20))
            .margin(12)
            .x_label_area_size(36)
            .y_label_area_size(56)
            .build_cartesian_2d(0f64..max_p, 0f64..max_v.max(1e-9))
            .map_err(|e| e.to_string())?;
        chart.configure_mesh().x_desc("parameters").draw().map_err(|e| e.to_string())?;
        for (i, n) in [1usize, 2, 4].iter().enumerate() {
            let points: Vec<(f64, f64)> =
                rows.iter().filter(|r| r.world_size == *n).map(|r| (r.params as f64, value(r))).collect();
            let colour = colours[i];
            chart
                .draw_series(LineSeries::new(points.clone(), colour.stroke_width(2)).point_size(4))
                .map_err(|e| e.to_string())?
                .label(format!("{n} rank(s)"))
                .legend(move |(x, y)| PathElement::new([(x, y), (x + 20, y)], colour));
        }
        chart
            .configure_series_labels()
            .border_style(BLACK)
            .background_style(WHITE.mix(0.8))
            .draw()
            .map_err(|e| e.to_string())?;
    }
    root.present().map_err(|e| format!("{}: {e}", out.display()))
}
