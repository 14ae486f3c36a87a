//! What each `zerotrain` subcommand does (the binary's own module; errors are `anyhow`).

use std::path::{Path, PathBuf};

use anyhow::{Context, bail};
use zerotrain::{Config, Overrides};
use zerotrain_checkpoint::Checkpoint;
use zerotrain_precision::Precision;

/// `zerotrain train`.
pub fn train(
    config: &Path,
    world_size: Option<usize>,
    steps: u64,
    out: Option<PathBuf>,
    save_every: u64,
    resume: bool,
) -> anyhow::Result<()> {
    let plan = Config::from_file(config)?.resolve(Overrides { world_size, total_steps: Some(steps) })?;
    if let Some(warning) = plan.warning() {
        eprintln!("warning: {warning}");
    }
    println!("training the built-in transformer: {} ranks, {}, {steps} steps", plan.world_size, plan.zero.stage);
    let checkpoints = out.map(|dir| zerotrain::train::CheckpointSettings { dir, every: save_every, resume });
    let s = zerotrain::train::train_demo(&plan, steps, checkpoints.as_ref(), &|line| println!("{line}"))
        .context("training failed")?;
    let m = s.memory;
    println!(
        "validation loss {:.5} -> {:.5} ({:.1}x lower) in {:.1} s, {:.0} samples/s",
        s.initial_val_loss,
        s.final_val_loss,
        s.initial_val_loss / s.final_val_loss,
        s.seconds,
        s.samples_per_second
    );
    println!(
        "rank 0 model states: params {} B, grads {} B, master {} B, optimizer {} B (Ψ = {}, {}); peak transient {} B",
        m.params, m.grads, m.master, m.optimizer, s.num_params, plan.precision, m.peak_transient
    );
    println!("rank 0 communication: {} B per step", s.comm_bytes_per_step);
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
        peak_rss().map_or_else(|| "unknown".into(), |kib| format!("{:.1} MiB", kib as f64 / 1024.0))
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

/// This process's peak resident set, in KiB (Linux `VmHWM`).
fn peak_rss() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    line.split_whitespace().nth(1)?.parse().ok()
}
