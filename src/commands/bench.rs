//! The `zerotrain bench` subcommands.

use std::path::Path;

use crate::bench::RunMode;
use zerotrain::Config;

use super::{overrides, proc_status_kib};

/// `zerotrain bench convert`.
pub fn bench_convert(mib: usize, repeats: usize, json: bool) -> anyhow::Result<()> {
    let elems = (mib << 20) / 4;
    let rows = crate::bench::conversion_table(elems, repeats);
    match json {
        true => println!("{}", serde_json::to_string_pretty(&rows)?),
        false => print!("{}", crate::bench::format_conversion_table(&rows, elems, repeats)),
    }
    Ok(())
}

/// `zerotrain bench servers`.
pub fn bench_servers(params: f64, dtype: &str, repeats: usize, json: bool) -> anyhow::Result<()> {
    let dtype = match dtype {
        "bf16" => zerotrain_precision::Precision::Bf16,
        "fp32" => zerotrain_precision::Precision::Fp32,
        other => anyhow::bail!("--dtype must be bf16 or fp32, got `{other}`"),
    };
    if !(1.0..=4e9).contains(&params) {
        anyhow::bail!("--params must be between 1 and 4e9, got {params}");
    }
    let rows = crate::bench::servers::rounds(params as usize, dtype, repeats)?;
    match json {
        true => println!("{}", serde_json::to_string_pretty(&rows)?),
        false => print!("{}", crate::bench::servers::format(&rows)),
    }
    Ok(())
}

/// `zerotrain bench collectives`.
pub fn bench_collectives(world_sizes: &[usize], max_mib: usize, repeats: usize, json: bool) -> anyhow::Result<()> {
    let sizes: Vec<usize> =
        std::iter::successors(Some(4usize << 10), |s| Some(s * 4)).take_while(|&s| s <= max_mib << 20).collect();
    let plan = Config::parse(r#"{"train_micro_batch_size_per_gpu": 1}"#, "bench")?.resolve(overrides(None, None)?)?;
    let rows = if plan.runtime.backend == zerotrain::config::Backend::Mpi {
        // Under mpirun: every process joins the MPI measurement; rank 0 then measures the
        // threads backend with as many ranks, in this process, while the others wait.
        let all = zerotrain::launch(&plan, |ctx| {
            let comm = ctx.collective();
            let mut rows = crate::bench::collectives_on(comm.as_ref(), "mpi", &sizes, repeats)?;
            if ctx.rank() == 0 {
                rows.extend(crate::bench::collectives_threads(ctx.world_size(), &sizes, repeats)?);
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
            rows.extend(crate::bench::collectives_threads(n, &sizes, repeats)?);
        }
        rows
    };
    match json {
        true => println!("{}", serde_json::to_string_pretty(&rows)?),
        false => print!("{}", crate::bench::format_collectives(&rows, repeats)),
    }
    Ok(())
}

/// `zerotrain bench engine`.
pub fn bench_engine(world_sizes: &[usize], steps: u64, overlap: bool, json: bool) -> anyhow::Result<()> {
    use crate::bench::engine;
    let mpirun = zerotrain::detect_mpirun();
    let overhead = if mpirun.is_none() { Some(engine::overhead(steps, 3)?) } else { None };
    let mut rows = Vec::new();
    match mpirun {
        // One launch: under mpirun a process may start MPI once.
        Some(m) => rows.extend(engine::stages(m.world_size, steps, overlap)?),
        None => {
            for &n in world_sizes {
                rows.extend(engine::stages(n, steps, overlap)?);
            }
        }
    }
    if mpirun.is_some_and(|m| m.rank != 0) {
        return Ok(());
    }
    if json {
        let overhead = overhead
            .map(|(plain, ours)| serde_json::json!({ "plain_burn_s": plain, "engine_s": ours, "ratio": ours / plain }));
        let value = serde_json::json!({ "overhead": overhead, "stages": rows });
        println!("{}", serde_json::to_string_pretty(&value)?);
        return Ok(());
    }
    if let Some((plain, ours)) = overhead {
        println!(
            "engine overhead (GPT 4x128, 16 sequences of 64 tokens, world size 1, stage 0; medians of 3 alternating rounds)"
        );
        println!(
            "  plain Burn loop {:.1} ms/step, engine {:.1} ms/step: {:.3}x",
            plain * 1e3,
            ours * 1e3,
            ours / plain
        );
    }
    let base: Vec<f64> = rows
        .iter()
        .map(|r| {
            let plain_dp = |b: &&engine::StageRow| {
                b.world_size == r.world_size && b.precision == r.precision && b.stage == 0 && b.mode == RunMode::OneUnit
            };
            rows.iter().find(plain_dp).map_or(1.0, |b| b.step_seconds)
        })
        .collect();
    let backend = if mpirun.is_some() { "mpi" } else { "threads" };
    print!("{}", engine::format_stages(&rows, &base, backend, overlap));
    Ok(())
}

/// `zerotrain bench pipeline`.
pub fn bench_pipeline(stages: &[usize], steps: usize, json: bool) -> anyhow::Result<()> {
    use crate::bench::pipeline;
    let mpirun = zerotrain::detect_mpirun();
    let stages = match mpirun {
        Some(m) => vec![m.world_size],
        None => stages.to_vec(),
    };
    let rows = pipeline::table(&stages, steps)?;
    if mpirun.is_some_and(|m| m.rank != 0) {
        return Ok(());
    }
    match json {
        true => println!("{}", serde_json::to_string_pretty(&rows)?),
        false => print!("{}", pipeline::format(&rows, if mpirun.is_some() { "mpi" } else { "threads" })),
    }
    Ok(())
}

/// `zerotrain bench growth`.
pub fn bench_growth(steps: u64, plot: &Path) -> anyhow::Result<()> {
    let rows = crate::bench::engine::growth(steps)?;
    println!("growth (ZeRO-2, fp32, 8 sequences of 64 tokens per rank; medians; rank 0)");
    println!("{:>10} {:>6} {:>10} {:>16}", "params", "ranks", "step ms", "states B/rank");
    for r in &rows {
        println!("{:>10} {:>6} {:>10.1} {:>16}", r.params, r.world_size, r.step_seconds * 1e3, r.memory);
    }
    crate::bench::engine::plot_growth(&rows, plot).map_err(anyhow::Error::msg)?;
    println!("plot: {}", plot.display());
    Ok(())
}

/// `zerotrain bench memory`: one `row ...` line per rank.
pub fn bench_memory(
    millions: usize,
    layers: usize,
    stage: u8,
    world_size: usize,
    mode: RunMode,
    nvme: Option<&std::path::Path>,
) -> anyhow::Result<()> {
    use burn::tensor::Device;
    use zerotrain_models::{Mlp, RegressionTask};
    let width = ((millions as f64 * 1e6 / layers.max(1) as f64).sqrt()) as usize;
    let checkpointing = mode.config_keys();
    let offload = match nvme {
        Some(dir) => {
            let dir = serde_json::to_string(&dir.display().to_string())?;
            let param = if stage == 3 {
                format!(r#", "offload_param": {{"device": "nvme", "nvme_path": {dir}, "max_in_cpu": 0}}"#)
            } else {
                String::new()
            };
            format!(
                r#", "sub_group_size": 1e6, "offload_optimizer": {{"device": "nvme", "nvme_path": {dir},
                   "pipeline_read": true, "pipeline_write": true, "buffer_count": 9}}{param}"#
            )
        }
        None => String::new(),
    };
    let json = format!(
        r#"{{ {checkpointing} "train_micro_batch_size_per_gpu": 1,
             "zero_optimization": {{"stage": {stage}, "stage3_param_persistence_threshold": 0 {offload}}}}}"#
    );
    let plan = Config::parse(&json, "bench")?.resolve(overrides(Some(world_size), None)?)?;
    let task = RegressionTask { seq_len: 1, features: width };
    let rows = zerotrain::launch(&plan, |ctx| {
        // Built inside the rank: under mpirun each process is one rank, and no copy of the
        // initial model outlives the engine's own.
        let model = Mlp::new(&vec![width; layers + 1], &Device::flex().autodiff());
        let mut engine = mode.engine(model, &plan, &ctx)?;
        let build_peak = proc_status_kib("VmHWM:");
        reset_peak_rss();
        for step in 0..2u64 {
            let batch = task.batch([step * 64 + ctx.rank() as u64], ctx.device());
            mode.micro_step(&mut engine, &batch, |m, b| m.loss(b))?;
            engine.step()?;
        }
        let (train_peak, now) = (proc_status_kib("VmHWM:"), proc_status_kib("VmRSS:"));
        let layout = engine.sharding().global().clone();
        Ok::<_, zerotrain::Error>((ctx.rank(), engine.memory_report(), layout.num_elems(), build_peak, train_peak, now))
    })?;
    let mib = |kib: Option<u64>| kib.map_or_else(|| "?".into(), |k| format!("{:.0}", k as f64 / 1024.0));
    let bytes_mib = |b: u64| format!("{:.0}", b as f64 / (1 << 20) as f64);
    for (rank, m, psi, build_peak, train_peak, now) in rows {
        let psi = psi as u64;
        let stage = zerotrain_zero::ZeroStage::from_index(u64::from(plan.zero.stage.index())).expect("valid stage");
        let shard = psi.div_ceil(plan.world_size() as u64);
        let formula = zerotrain_zero::memory::model_state_bytes(
            stage,
            psi,
            shard,
            zerotrain_zero::memory::BytesPerParam::FP32_ADAM,
        );
        println!(
            "row stage={} mode={mode:?} rank={rank} ranks={} params={psi} model_states_MiB={} swapped_MiB={} formula_MiB={} \
             gathered_peak_MiB={} transient_peak_MiB={} build_peak_rss_MiB={} train_peak_rss_MiB={} rss_after_MiB={}",
            plan.zero.stage.index(),
            plan.world_size(),
            bytes_mib(m.model_states()),
            bytes_mib(m.swapped),
            bytes_mib(formula.total()),
            bytes_mib(m.peak_gathered),
            bytes_mib(m.peak_transient),
            mib(build_peak),
            mib(train_peak),
            mib(now),
        );
    }
    Ok(())
}

/// Resets this process's peak resident size (`VmHWM`) to its current size, so that the
/// training peak is measured apart from the engine's construction (Linux 4.0+; elsewhere
/// the peak stays cumulative).
fn reset_peak_rss() {
    let _ = std::fs::write("/proc/self/clear_refs", "5");
}

/// `zerotrain bench gpu`.
pub fn bench_gpu(bench: &crate::bench::gpu::GpuBench, json: bool) -> anyhow::Result<()> {
    if let Err(e) = bench.model.validate() {
        anyhow::bail!("{e}");
    }
    if !bench.device.is_built() {
        let name = bench.device.name();
        anyhow::bail!("--device {name}: this build has no {name} support; rebuild with `--features {name}`");
    }
    if bench.steps == 0 || bench.batch == 0 {
        anyhow::bail!("--steps and --batch must be at least 1");
    }
    if let Some(stage) = bench.stages.iter().find(|&&s| s > 3) {
        anyhow::bail!("--stages: a ZeRO stage is 0, 1, 2 or 3, got {stage}");
    }
    use std::io::Write;
    if !json {
        print!("{}", bench.heading());
    }
    let _ = std::io::stdout().flush();
    // Each row printed as it is measured: a run stopped by a time limit keeps what it did.
    bench.run(|row| {
        let text = if json {
            serde_json::to_string(row).map(|line| line + "\n").unwrap_or_else(|e| format!("{{\"error\": \"{e}\"}}\n"))
        } else {
            crate::bench::gpu::GpuBench::line(row)
        };
        let mut out = std::io::stdout().lock();
        let _ = out.write_all(text.as_bytes()).and_then(|()| out.flush());
    })?;
    Ok(())
}

/// `zerotrain bench offload-gpt`: a GPT trained with its states on NVMe, step by step.
pub fn bench_offload_gpt(
    shape: crate::bench::offload::GptShape,
    steps: u64,
    lr: f64,
    nvme: Option<&Path>,
    json: bool,
) -> anyhow::Result<()> {
    let r = crate::bench::offload::run_gpt(shape, steps, lr, nvme)?;
    if json {
        println!("{}", serde_json::to_string_pretty(&r)?);
    } else {
        let gb = |b: u64| b as f64 / 1e9;
        println!(
            "GPT of {} parameters (fp32 Adam states {:.1} GB), built in {:.1} s",
            r.params,
            gb(r.fp32_adam_state_bytes),
            r.build_s
        );
        for (i, (loss, s, read, written)) in r.steps.iter().enumerate() {
            println!(
                "step {}: loss {loss:.5}, {s:.1} s, swap read {:.1} GB, written {:.1} GB",
                i + 1,
                gb(*read),
                gb(*written)
            );
        }
        println!(
            "peak resident size {:.2} GiB; {:.1} GB in swap files",
            r.peak_rss_bytes as f64 / (1u64 << 30) as f64,
            gb(r.swapped_bytes)
        );
    }
    Ok(())
}

/// `zerotrain bench offload`: the host AdamW against memcpy and Burn's AdamW, the NVMe
/// optimizer step against the disk's own bandwidth.
pub fn bench_offload(
    millions: usize,
    nvme: &Path,
    tile_millions: usize,
    repeats: usize,
    json: bool,
) -> anyhow::Result<()> {
    let report = crate::bench::offload::run(millions * 1_000_000, nvme, tile_millions * 1_000_000, repeats)?;
    match json {
        true => println!("{}", serde_json::to_string_pretty(&report)?),
        false => print!("{}", crate::bench::offload::format(&report)),
    }
    Ok(())
}
