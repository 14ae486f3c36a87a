//! Engine benchmarks: overhead against a plain Burn loop, and the cost of each stage.

use std::time::Instant;

use burn::module::Module;
use burn::optim::{AdamWConfig, GradientsParams};
use burn::tensor::Device;
use serde::Serialize;
use zerotrain_zero::ZeroStage;
use zerotrain_zero::memory::{BytesPerParam, model_state_bytes};

use crate::app::data::{Corpus, windows};
use crate::app::models::{Gpt, GptConfig};
use crate::{Config, Engine, Overrides, PhaseTimes, Plan, Result, launch};

/// The benchmark model: a 4-layer GPT of width 128 (about 0.8M parameters).
pub fn bench_model(vocab: usize) -> GptConfig {
    GptConfig { n_layer: 4, n_head: 4, n_embd: 128, block_size: 64, vocab_size: vocab, tied_head: true }
}

fn bench_plan(stage: u8, precision: &str, world_size: usize, micro: u64) -> Result<Plan> {
    let half = match precision {
        "bf16" => r#""bf16": {"enabled": true},"#,
        _ => "",
    };
    let json = format!(
        r#"{{ {half} "train_micro_batch_size_per_gpu": {micro}, "zero_optimization": {{"stage": {stage}, "stage3_param_persistence_threshold": 0}},
             "optimizer": {{"type": "AdamW", "params": {{"lr": 1e-3, "weight_decay": 0.0}}}}, "zerotrain": {{"backend": "threads"}} }}"#
    );
    Ok(Config::parse(&json, "bench")?.resolve(Overrides { world_size: Some(world_size), ..Overrides::default() })?)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Engine (world size 1, stage 0) against a plain Burn `ModuleOptimizer` loop on the same
/// model and batches: (plain seconds per step, engine seconds per step), medians over
/// `rounds` alternating rounds of `steps` steps.
pub fn overhead(steps: u64, rounds: usize) -> Result<(f64, f64)> {
    let corpus = Corpus::arithmetic(20_000, 1);
    let shape = bench_model(corpus.vocab.len());
    let plan = bench_plan(0, "fp32", 1, 16)?;
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
            Ok::<_, crate::Error>(times)
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

/// Stages 0-3 in fp32 and bf16 at `world_size` ranks: `steps` measured steps after 2 warm-up.
pub fn stages(world_size: usize, steps: u64) -> Result<Vec<StageRow>> {
    let corpus = Corpus::arithmetic(20_000, 1);
    let shape = bench_model(corpus.vocab.len());
    let device = Device::flex().autodiff();
    device.seed(1);
    let init = Gpt::new(&shape, &device);
    let mut rows = Vec::new();
    for precision in ["fp32", "bf16"] {
        for stage in 0..=3u8 {
            let plan = bench_plan(stage, precision, world_size, 8)?;
            let out = launch(&plan, |ctx| {
                let mut engine = Engine::new(init.clone(), &plan, &ctx)?;
                let (mut step_times, mut reports) = (Vec::new(), Vec::new());
                for step in 0..steps + 2 {
                    let t = Instant::now();
                    let first = ctx.rank() as u64 * 8;
                    let tokens = windows(&corpus.train, shape.block_size, 1, step, first, 8, ctx.device());
                    let loss = engine.forward(|m| m.loss(tokens))?;
                    engine.backward(loss)?;
                    let report = engine.step()?.expect("accumulation 1");
                    if step >= 2 {
                        step_times.push(t.elapsed().as_secs_f64());
                        reports.push(report);
                    }
                }
                Ok::<_, crate::Error>((
                    step_times,
                    reports,
                    engine.memory_report(),
                    engine.sharding().units()[0].layout.clone(),
                ))
            })?;
            let (step_times, reports, memory, layout) = out.into_iter().next().expect("rank 0");
            let pick = |f: fn(&PhaseTimes) -> f64| median(reports.iter().map(|r| f(&r.times)).collect());
            let times = PhaseTimes {
                forward: pick(|t| t.forward),
                backward: pick(|t| t.backward),
                reduce: pick(|t| t.reduce),
                optimizer: pick(|t| t.optimizer),
                gather: pick(|t| t.gather),
                comm_wait: pick(|t| t.comm_wait),
                comm_busy: pick(|t| t.comm_busy),
            };
            let (n, padded, shard) = (world_size as u64, layout.padded_elems() as u64, layout.shard_len() as u64);
            let elem = if precision == "fp32" { 4 } else { 2 };
            // 2Ψ per step for every stage at accumulation 1 (stage 3 gathers once per step).
            let theory = if n > 1 { 2 * padded * elem * (n - 1) / n } else { 0 };
            let st = ZeroStage::from_index(stage.into()).expect("stage");
            let cost = if precision == "fp32" { BytesPerParam::FP32_ADAM } else { BytesPerParam::MIXED_ADAM };
            let formula = model_state_bytes(st, layout.num_elems() as u64, shard, cost).total();
            rows.push(StageRow {
                world_size,
                stage,
                precision: precision.into(),
                step_seconds: median(step_times),
                times,
                comm_bytes: reports.last().map_or(0, |r| r.comm_bytes),
                theory_bytes: theory,
                memory: memory.model_states(),
                formula,
            });
        }
    }
    Ok(rows)
}

/// The stage table as text.
pub fn format_stages(rows: &[StageRow], stage0: &[f64]) -> String {
    let mut out = String::from(
        "stage cost (GPT 4x128, 8 sequences of 64 tokens per rank; medians; ms; rank 0)\n\
         ranks stage dtype   step   vs st0  forward backward  reduce  optim  gather   bytes/step  theory(2Ψ)  states B    formula B\n",
    );
    for (r, base) in rows.iter().zip(stage0) {
        let t = r.times;
        out.push_str(&format!(
            "{:>5} {:>5} {:<5} {:>6.1} {:>7.2}x {:>7.1} {:>8.1} {:>7.1} {:>6.1} {:>7.1} {:>12} {:>11} {:>9} {:>10}\n",
            r.world_size,
            r.stage,
            r.precision,
            r.step_seconds * 1e3,
            r.step_seconds / base,
            t.forward * 1e3,
            t.backward * 1e3,
            t.reduce * 1e3,
            t.optimizer * 1e3,
            t.gather * 1e3,
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
            let plan = bench_plan(2, "fp32", world_size, 8)?;
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
                Ok::<_, crate::Error>((median(times), engine.memory_report().model_states()))
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
    crate::app::train::plot_font();
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
