//! What each `zerotrain` subcommand does (the binary's own module; errors are `anyhow`).

use std::path::{Path, PathBuf};

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use anyhow::{Context, bail};
use indicatif::{ProgressBar, ProgressStyle};
use zerotrain::train::{StepMetrics, TrainOptions, TrainSummary};
use zerotrain::{Config, Overrides};
use zerotrain_checkpoint::Checkpoint;
use zerotrain_precision::Precision;

/// `zerotrain train`.
pub fn train(args: TrainArgs) -> anyhow::Result<()> {
    let plan = Config::from_file(&args.config)?
        .resolve(Overrides { world_size: args.world_size, total_steps: Some(args.steps) })?;
    if let Some(warning) = plan.warning() {
        eprintln!("warning: {warning}");
    }
    let stem = args.config.file_stem().and_then(|s| s.to_str()).unwrap_or("run").to_string();
    let out = args.out.unwrap_or_else(|| PathBuf::from("runs").join(stem));
    let (corpus, shape) = zerotrain::train::load_corpus(&plan, args.data.as_deref())?;
    // Under mpirun every process runs this; rank 0 alone speaks.
    let lead = zerotrain_zero::collective::mpi_environment().is_none_or(|(rank, _)| rank == 0);
    let say = |line: String| {
        if lead {
            println!("{line}");
        }
    };
    say(format!(
        "training a GPT of {} parameters ({} layers, width {}, context {}) on {} ({} characters, vocabulary {}): {} ranks, {}, {}",
        shape.num_params(),
        shape.n_layer,
        shape.n_embd,
        shape.block_size,
        corpus.name,
        corpus.train.len() + corpus.valid.len(),
        shape.vocab_size,
        plan.world_size,
        plan.zero.stage,
        plan.precision
    ));
    let stop = Arc::new(AtomicBool::new(false));
    let flag = Arc::clone(&stop);
    ctrlc::set_handler(move || {
        if flag.swap(true, Ordering::SeqCst) {
            eprintln!("\nzerotrain: stopping now");
            std::process::exit(130);
        }
        eprintln!("\nzerotrain: finishing this step, saving a checkpoint and stopping (Ctrl-C again to abort)");
    })?;
    let bar = if lead { ProgressBar::new(args.steps) } else { ProgressBar::hidden() };
    bar.set_style(
        ProgressStyle::with_template("{bar:30} {pos}/{len} steps  {msg}  ETA {eta}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    let log = |line: &str| if bar.is_hidden() { println!("{line}") } else { bar.println(line) };
    let progress = |m: &StepMetrics| {
        bar.set_position(m.step);
        bar.set_message(format!(
            "loss {:.4}  lr {:.2e}  scale {}  {:.0} tok/s",
            m.loss, m.lr, m.loss_scale, m.tokens_per_s
        ));
    };
    let options = TrainOptions {
        steps: args.steps,
        data: args.data,
        out,
        resume: args.resume,
        save_every: args.save_every,
        stop,
    };
    let s = zerotrain::train::train_gpt(&plan, &options, &log, &progress).context("training failed")?;
    bar.finish_and_clear();
    if lead {
        print_summary(&s);
    }
    Ok(())
}

/// `zerotrain train`'s arguments.
pub struct TrainArgs {
    pub config: PathBuf,
    pub world_size: Option<usize>,
    pub steps: u64,
    pub data: Option<PathBuf>,
    pub out: Option<PathBuf>,
    pub save_every: Option<u64>,
    pub resume: bool,
}

fn print_summary(s: &TrainSummary) {
    let (a, b) = s.val_loss;
    if s.interrupted {
        println!("stopped by Ctrl-C at step {} (checkpoint saved)", s.last_step);
    }
    println!(
        "validation loss {a:.5} -> {b:.5} ({:.1}x lower) in {:.1} s, steps {}..{}, {:.0} tokens/s",
        a / b,
        s.seconds,
        s.first_step,
        s.last_step,
        s.tokens_per_s
    );
    println!("model states per rank (bytes; Ψ = {}):", s.num_params);
    println!(
        "  {:>4} {:>12} {:>12} {:>12} {:>12} {:>15}",
        "rank", "params", "grads", "master", "optimizer", "peak transient"
    );
    for (rank, m) in s.memory.iter().enumerate() {
        println!(
            "  {rank:>4} {:>12} {:>12} {:>12} {:>12} {:>15}",
            m.params, m.grads, m.master, m.optimizer, m.peak_transient
        );
    }
    println!("rank 0 communication: {} B per step", s.comm_bytes_per_step);
    println!("samples from the trained model:");
    for sample in &s.samples {
        println!("  {sample}");
    }
    let out = s.out.display();
    println!("outputs: {out}/metrics.jsonl, {out}/loss.png, {out}/checkpoints/");
}

/// `zerotrain estimate`.
pub fn estimate(
    params: Option<f64>,
    ranks: u64,
    nodes: u64,
    offload: bool,
    model_config: Option<&Path>,
    json: bool,
) -> anyhow::Result<()> {
    let params = match (params, model_config) {
        (_, Some(file)) => {
            // Only the model section matters here (not, say, a schedule's "auto" length).
            let model = Config::from_file(file)?.raw.model.unwrap_or_default();
            if model.vocab_size == 0 {
                bail!("{}: model.vocab_size must be set to estimate from the model section", file.display());
            }
            model.validate().map_err(anyhow::Error::msg)?;
            model.num_params()
        }
        (Some(p), None) if p >= 1.0 && p.is_finite() => p as u64,
        _ => bail!("--params must be a positive number"),
    };
    if ranks == 0 || nodes == 0 {
        bail!("--world-size and --nodes must be at least 1");
    }
    let total = ranks * nodes;
    let rows = zerotrain::estimate::paper(params, total);
    let ds: Vec<(bool, u64, u64)> = [false, true]
        .iter()
        .filter(|&&o| !o || offload)
        .map(|&o| {
            let (cpu, gpu) = zerotrain::estimate::deepspeed_zero2(params, ranks, nodes, o, 1.5);
            (o, cpu, gpu)
        })
        .collect();
    if json {
        let ds: Vec<_> = ds
            .iter()
            .map(|(o, cpu, gpu)| serde_json::json!({ "offload": o, "per_cpu_bytes": cpu, "per_gpu_bytes": gpu }))
            .collect();
        let value = serde_json::json!({ "params": params, "ranks": total, "zero_paper": rows, "deepspeed_zero2": ds });
        println!("{}", serde_json::to_string_pretty(&value)?);
        return Ok(());
    }
    println!("model states per rank: {params} parameters on {total} ranks ({ranks} per node x {nodes} nodes)");
    println!("ZeRO paper, mixed-precision Adam (2 + 2 + 12 bytes per parameter):");
    println!(
        "  {:>5} {:>16} {:>16} {:>16} {:>16} {:>9}",
        "stage", "params B", "grads B", "optimizer B", "total B", "total GB"
    );
    for r in &rows {
        println!(
            "  {:>5} {:>16} {:>16} {:>16} {:>16} {:>9.2}",
            r.stage,
            r.params,
            r.grads,
            r.optimizer,
            r.total,
            r.total as f64 / 1e9
        );
    }
    println!("DeepSpeed estimate_zero2_model_states_mem_needs (stage 2, additional_buffer_factor 1.5):");
    for (o, cpu, gpu) in ds {
        let option = if o { "offload_optimizer=cpu " } else { "offload_optimizer=none" };
        println!("  {option}  per GPU {gpu:>16} B  per CPU {cpu:>16} B");
    }
    Ok(())
}

/// `zerotrain config check`.
pub fn config_check(file: &Path, world_size: Option<usize>, steps: Option<u64>, json: bool) -> anyhow::Result<()> {
    let plan = Config::from_file(file)?.resolve(Overrides { world_size, total_steps: steps })?;
    if json {
        println!("{}", serde_json::to_string_pretty(&plan)?);
    } else {
        println!("{} resolves to:\n{plan}", file.display());
    }
    Ok(())
}

/// `zerotrain bench convert`.
pub fn bench_convert(mib: usize, repeats: usize, json: bool) -> anyhow::Result<()> {
    let elems = (mib << 20) / 4;
    let rows = zerotrain::bench::conversion_table(elems, repeats);
    match json {
        true => println!("{}", serde_json::to_string_pretty(&rows)?),
        false => print!("{}", zerotrain::bench::format_conversion_table(&rows, elems, repeats)),
    }
    Ok(())
}

/// `zerotrain bench collectives`.
pub fn bench_collectives(world_sizes: &[usize], max_mib: usize, repeats: usize, json: bool) -> anyhow::Result<()> {
    let sizes: Vec<usize> =
        std::iter::successors(Some(4usize << 10), |s| Some(s * 4)).take_while(|&s| s <= max_mib << 20).collect();
    let plan = Config::parse(r#"{"train_micro_batch_size_per_gpu": 1}"#, "bench")?
        .resolve(Overrides { world_size: None, total_steps: None })?;
    let rows = if plan.backend == zerotrain::config::Backend::Mpi {
        // Under mpirun: every process joins the MPI measurement; rank 0 then measures the
        // threads backend with as many ranks, in this process, while the others wait.
        let all = zerotrain::launch(&plan, |ctx| {
            let comm = ctx.collective();
            let mut rows = zerotrain::bench::collectives_on(comm.as_ref(), "mpi", &sizes, repeats)?;
            if ctx.rank() == 0 {
                rows.extend(zerotrain::bench::collectives_threads(ctx.world_size(), &sizes, repeats)?);
            }
            comm.barrier()?;
            Ok::<_, zerotrain::Error>((ctx.rank(), rows))
        })?;
        match all.into_iter().next() {
            Some((0, rows)) => rows,
            _ => return Ok(()),
        }
    } else {
        let mut rows = Vec::new();
        for &n in world_sizes {
            rows.extend(zerotrain::bench::collectives_threads(n, &sizes, repeats)?);
        }
        rows
    };
    match json {
        true => println!("{}", serde_json::to_string_pretty(&rows)?),
        false => print!("{}", zerotrain::bench::format_collectives(&rows, repeats)),
    }
    Ok(())
}

/// `zerotrain bench engine`.
pub fn bench_engine(world_sizes: &[usize], steps: u64, json: bool) -> anyhow::Result<()> {
    use zerotrain::bench::engine;
    let (plain, ours) = engine::overhead(steps, 3)?;
    let mut rows = Vec::new();
    for &n in world_sizes {
        rows.extend(engine::stages(n, steps)?);
    }
    if json {
        let value = serde_json::json!({ "overhead": { "plain_burn_s": plain, "engine_s": ours, "ratio": ours / plain }, "stages": rows });
        println!("{}", serde_json::to_string_pretty(&value)?);
        return Ok(());
    }
    println!(
        "engine overhead (GPT 4x128, 16 sequences of 64 tokens, world size 1, stage 0; medians of 3 alternating rounds)"
    );
    println!("  plain Burn loop {:.1} ms/step, engine {:.1} ms/step: {:.3}x", plain * 1e3, ours * 1e3, ours / plain);
    let base: Vec<f64> = rows
        .iter()
        .map(|r| {
            rows.iter()
                .find(|b| b.world_size == r.world_size && b.precision == r.precision && b.stage == 0)
                .map_or(1.0, |b| b.step_seconds)
        })
        .collect();
    print!("{}", engine::format_stages(&rows, &base));
    Ok(())
}

/// `zerotrain bench growth`.
pub fn bench_growth(steps: u64, plot: &Path) -> anyhow::Result<()> {
    let rows = zerotrain::bench::engine::growth(steps)?;
    println!("growth (ZeRO-2, fp32, 8 sequences of 64 tokens per rank; medians; rank 0)");
    println!("{:>10} {:>6} {:>10} {:>16}", "params", "ranks", "step ms", "states B/rank");
    for r in &rows {
        println!("{:>10} {:>6} {:>10.1} {:>16}", r.params, r.world_size, r.step_seconds * 1e3, r.memory);
    }
    zerotrain::bench::engine::plot_growth(&rows, plot).map_err(anyhow::Error::msg)?;
    println!("plot: {}", plot.display());
    Ok(())
}

/// `zerotrain bench memory`.
pub fn bench_memory(millions: usize, stage: u8, world_size: usize) -> anyhow::Result<()> {
    use burn::tensor::Device;
    use zerotrain::models::{Mlp, RegressionTask};
    let width = ((millions as f64 * 1e6 / 2.0).sqrt()) as usize;
    let json = format!(
        r#"{{"train_micro_batch_size_per_gpu": 1, "zero_optimization": {{"stage": {stage}, "stage3_param_persistence_threshold": 0}}}}"#
    );
    let plan = Config::parse(&json, "bench")?.resolve(Overrides { world_size: Some(world_size), total_steps: None })?;
    let task = RegressionTask { seq_len: 1, features: width };
    let rows = zerotrain::launch(&plan, |ctx| {
        // Built inside the rank: under mpirun each process is one rank, and no copy of the
        // initial model outlives the engine's own.
        let model = Mlp::new(&[width, width, width], &Device::flex().autodiff());
        let mut engine = zerotrain::Engine::new(model, &plan, &ctx)?;
        for step in 0..2u64 {
            let batch = task.batch([step * 64 + ctx.rank() as u64], ctx.device());
            let loss = engine.forward(|m| m.loss(&batch))?;
            engine.backward(loss)?;
            engine.step()?;
        }
        let now = proc_status_kib("VmRSS:");
        Ok::<_, zerotrain::Error>((ctx.rank(), engine.memory_report(), engine.layout().clone(), now))
    })?;
    let peak = proc_status_kib("VmHWM:");
    let mib = |kib: Option<u64>| kib.map_or_else(|| "?".into(), |k| format!("{:.0}", k as f64 / 1024.0));
    for (rank, m, layout, now) in rows {
        let psi = layout.num_elems() as u64;
        let stage = zerotrain_zero::ZeroStage::from_index(u64::from(plan.zero.stage.index())).expect("valid stage");
        let formula = zerotrain_zero::memory::model_state_bytes(
            stage,
            psi,
            layout.shard_len() as u64,
            zerotrain_zero::memory::BytesPerParam::FP32_ADAM,
        );
        println!(
            "row stage={} rank={rank} ranks={} params={psi} model_states_MiB={:.0} formula_MiB={:.0} process_peak_rss_MiB={} process_rss_after_MiB={}",
            plan.zero.stage.index(),
            plan.world_size,
            m.model_states() as f64 / (1 << 20) as f64,
            formula.total() as f64 / (1 << 20) as f64,
            mib(peak),
            mib(now),
        );
    }
    Ok(())
}

fn proc_status_kib(field: &str) -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    status.lines().find(|l| l.starts_with(field))?.split_whitespace().nth(1)?.parse().ok()
}

/// `zerotrain consolidate`.
pub fn consolidate(dir: &Path, tag: Option<&str>, out: &Path, dtype: &str) -> anyhow::Result<()> {
    let dtype = match dtype {
        "f32" | "fp32" => Precision::Fp32,
        "f16" | "fp16" => Precision::Fp16,
        "bf16" => Precision::Bf16,
        other => bail!("--dtype must be f32, f16 or bf16, not `{other}`"),
    };
    let ckpt = Checkpoint::open(dir, tag)?;
    let bytes = zerotrain_checkpoint::consolidate(&ckpt, out, dtype)?;
    let m = ckpt.manifest();
    println!(
        "wrote {}: {} tensors, {} parameters, {bytes} bytes ({dtype}) from {} (step {}); peak RSS {}",
        out.display(),
        m.layout.len(),
        m.num_elems(),
        ckpt.dir().display(),
        m.global_step,
        proc_status_kib("VmHWM:").map_or_else(|| "unknown".into(), |kib| format!("{:.1} MiB", kib as f64 / 1024.0))
    );
    Ok(())
}

/// `zerotrain inspect`.
pub fn inspect(dir: &Path, tag: Option<&str>, verify: bool, json: bool) -> anyhow::Result<()> {
    let ckpt = Checkpoint::open(dir, tag)?;
    if verify {
        ckpt.verify()?;
    }
    let m = ckpt.manifest();
    if json {
        let mut value = serde_json::to_value(m)?;
        value["verified"] = serde_json::Value::Bool(verify);
        println!("{}", serde_json::to_string_pretty(&value)?);
        return Ok(());
    }
    println!("checkpoint  {}", ckpt.dir().display());
    println!("step        {} (tag {})", m.global_step, m.tag);
    println!("written by  {} ranks, ZeRO stage {}, {} compute", m.world_size, m.stage, m.precision);
    println!("parameters  {} in {} tensors", m.num_elems(), m.layout.len());
    println!("state       {}", m.tensors.join(", "));
    for f in &m.files {
        println!("  {:<20} elements {}..{}  {} bytes  {} blocks", f.name, f.start, f.end, f.size, f.block_crc32.len());
    }
    println!("client      {}", m.client_state);
    if verify {
        let bytes: u64 = m.files.iter().map(|f| f.size).sum();
        println!("verified    {} files, {bytes} bytes: every checksum matches", m.files.len());
    }
    Ok(())
}
