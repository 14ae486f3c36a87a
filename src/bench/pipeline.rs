//! The pipeline benchmark: each stage's idle fraction against GPipe's bubble, the memory a
//! stage holds, and throughput against plain data parallelism on the same ranks.

use std::time::Instant;

use burn::tensor::Device;
use serde::Serialize;
use zerotrain_zero::pipeline::bubble_fraction;

use zerotrain::{Engine, Plan, Result, launch};
use zerotrain_models::{Mlp, RegressionTask};

/// The benchmark model: an MLP of `LAYERS` equal layers (balanced stages), one unit each.
const LAYERS: usize = 8;
/// Its width.
const WIDTH: usize = 256;
/// Samples per micro-batch.
const MICRO: u64 = 64;

/// One row: a pipeline shape and schedule, measured.
#[derive(Debug, Clone, Serialize)]
pub struct PipelineRow {
    /// Stages `K`.
    pub stages: usize,
    /// Micro-batches per step `M`.
    pub micro_batches: usize,
    /// `gpipe`, `1f1b`, or `data parallel` (no pipeline, the same ranks and batch).
    pub schedule: String,
    /// Median step time, seconds (rank 0).
    pub step_seconds: f64,
    /// Each stage's median idle fraction: time waiting for neighbours over step time.
    pub idle: Vec<f64>,
    /// GPipe's bubble `(K-1)/(M+K-1)`.
    pub formula: f64,
    /// Samples per second over the world.
    pub samples_per_s: f64,
    /// The first stage's model states per rank, bytes (to 1 KiB).
    pub states: u64,
    /// Each stage's most activation bytes kept at once (checkpointed boundaries; to 1 KiB).
    pub activations: Vec<u64>,
}

/// The plan of `stages` stages (1: plain data parallelism over `world_size` ranks, with
/// the same global batch, `micro_batches` micro-batches of [`MICRO`] samples).
fn plan(stages: usize, micro_batches: usize, schedule: &str, world_size: usize) -> Result<Plan> {
    let (pipeline, micro, accumulation) = if stages > 1 {
        let section = format!(
            r#""pipeline": {{"stages": {stages}, "partition": "uniform", "activation_checkpoint_interval": 1}},"#
        );
        (section, MICRO, micro_batches as u64)
    } else {
        let total = MICRO * micro_batches as u64;
        let accumulation = (micro_batches / world_size).max(1) as u64;
        (String::new(), total / (world_size as u64 * accumulation), accumulation)
    };
    let json = format!(
        r#"{{ {pipeline} "train_micro_batch_size_per_gpu": {micro}, "gradient_accumulation_steps": {accumulation},
             "zero_optimization": {{"stage": 1}}, "optimizer": {{"type": "AdamW", "params": {{"lr": 1e-3}}}},
             "zerotrain": {{"schedule": "{schedule}"}} }}"#
    );
    super::resolve(&json, world_size)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Measures `(K, M)` for K in `stages` and M in 1, 4, 8, 16, both schedules, on `K`
/// ranks (one data-parallel rank per stage), `steps` steps after one warm-up; and plain
/// data parallelism (ZeRO-1) on the same ranks and global batch beside each. One launch
/// per K, so that it runs under mpirun too (there K is the process count, once).
pub fn table(stages: &[usize], steps: usize) -> Result<Vec<PipelineRow>> {
    let task = RegressionTask { seq_len: 1, features: WIDTH };
    let device = Device::flex().autodiff();
    device.seed(3);
    let init = Mlp::new(&[WIDTH; LAYERS + 1], &device);
    let mut rows = Vec::new();
    for &k in stages {
        let mut configs: Vec<(usize, &str, Plan)> = Vec::new();
        for m in [1, 4, 8, 16] {
            configs.push((m, "gpipe", plan(k, m, "gpipe", k)?));
            configs.push((m, "1f1b", plan(k, m, "1f1b", k)?));
            if (MICRO * m as u64).is_multiple_of(k as u64) {
                configs.push((m, "data parallel", plan(1, m, "1f1b", k)?));
            }
        }
        let out = launch(&configs[0].2, |ctx| {
            let mut measured = Vec::new();
            for (_, _, plan) in &configs {
                measured.push(measure(&init, &task, plan, &ctx, steps)?);
            }
            Ok::<_, zerotrain::Error>(measured)
        })?;
        let rank0 = out.into_iter().next().expect("rank 0");
        for ((m, name, plan), (step_seconds, per_rank)) in configs.iter().zip(rank0) {
            let stages = plan.pipeline.map_or(1, |p| p.stages);
            let first_of = |s: usize| &per_rank[s * (plan.world_size() / stages)];
            rows.push(PipelineRow {
                stages: k,
                micro_batches: *m,
                schedule: name.to_string(),
                step_seconds,
                idle: if stages > 1 { (0..stages).map(|s| first_of(s)[0]).collect() } else { Vec::new() },
                formula: bubble_fraction(k, *m),
                samples_per_s: plan.batch.train_batch_size as f64 / step_seconds,
                states: (first_of(0)[1] * 1024.0) as u64,
                activations: (0..stages).map(|s| (first_of(s)[2] * 1024.0) as u64).collect(),
            });
        }
    }
    Ok(rows)
}

/// One configuration on this rank: rank 0's median step time, and every rank's median
/// idle fraction, model states and kept activations (KiB), gathered over the world.
fn measure(
    init: &Mlp,
    task: &RegressionTask,
    plan: &Plan,
    ctx: &zerotrain::RankContext,
    steps: usize,
) -> Result<(f64, Vec<[f64; 3]>)> {
    let stages = plan.pipeline.map_or(1, |p| p.stages);
    let data_parallel = plan.world_size() / stages;
    let mut engine = Engine::with_units(init.clone(), plan, ctx)?;
    let (d, per) = ((ctx.rank() % data_parallel) as u64, plan.batch.micro_batch_per_rank);
    let (mut times, mut idle) = (Vec::new(), Vec::new());
    for step in 0..=steps as u64 {
        let start = Instant::now();
        let report = engine.train_batch(|micro| {
            let first = step * plan.batch.train_batch_size + (micro as u64 * data_parallel as u64 + d) * per;
            task.batch(first..first + per, ctx.device())
        })?;
        let seconds = start.elapsed().as_secs_f64();
        if step > 0 {
            times.push(seconds);
            idle.push(report.times.pipe_wait / seconds);
        }
    }
    let memory = engine.memory_report();
    let kib = |bytes: u64| (bytes as f64 / 1024.0) as f32;
    let mine = [median(idle) as f32, kib(memory.model_states()), kib(memory.peak_activations)];
    let mut all = vec![0.0f32; 3 * plan.world_size()];
    ctx.collective().all_gather((&mine[..]).into(), (&mut all).into())?;
    let per_rank = all.chunks(3).map(|c| [f64::from(c[0]), f64::from(c[1]), f64::from(c[2])]).collect();
    Ok((median(times), per_rank))
}

/// The table as text.
pub fn format(rows: &[PipelineRow], backend: &str) -> String {
    let mut out = format!(
        "pipeline ({backend}; MLP of {LAYERS} layers x {WIDTH}, one unit each, {MICRO} samples per micro-batch, ZeRO-1, \
         recompute every unit; medians; rank 0)\n"
    );
    out.push_str(&format!(
        "{:>2} {:>3} {:<14} {:>9} {:>10} {:>8} {:<26} {:>12} {:<30}\n",
        "K",
        "M",
        "schedule",
        "step ms",
        "samples/s",
        "bubble",
        "idle per stage",
        "states B/rk",
        "kept activations B per stage"
    ));
    for r in rows {
        let idle: Vec<String> = r.idle.iter().map(|i| format!("{:.0}%", i * 100.0)).collect();
        let kept: Vec<String> = r.activations.iter().map(u64::to_string).collect();
        out.push_str(&format!(
            "{:>2} {:>3} {:<14} {:>9.1} {:>10.0} {:>7.0}% {:<26} {:>12} {:<30}\n",
            r.stages,
            r.micro_batches,
            r.schedule,
            r.step_seconds * 1e3,
            r.samples_per_s,
            if r.idle.is_empty() { 0.0 } else { r.formula * 100.0 },
            if idle.is_empty() { "-".to_string() } else { idle.join(" ") },
            r.states,
            kept.join(" ")
        ));
    }
    out
}
