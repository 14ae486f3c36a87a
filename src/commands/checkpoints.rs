//! `zerotrain consolidate` and `zerotrain inspect`: a checkpoint written out whole (one
//! safetensors file, or a Hugging Face folder) or summarised and verified.

use std::path::{Path, PathBuf};

use anyhow::bail;
use zerotrain_checkpoint::Checkpoint;
use zerotrain_precision::Precision;

use super::proc_status_kib;

/// `zerotrain consolidate`'s arguments (see `cli::Command::Consolidate`).
#[derive(Debug, Clone, clap::Args)]
pub struct ConsolidateArgs {
    /// The checkpoint directory (holding `latest` and the tags).
    pub dir: PathBuf,
    /// The tag to read (default: the one `latest` names).
    #[arg(long)]
    pub tag: Option<String>,
    /// The output file (`--format safetensors`) or new folder (`--format hf`, `peft`).
    #[arg(long)]
    pub out: PathBuf,
    /// Output dtype: f32, bf16 or f16 (default: f32; with `--format hf`, the
    /// config's dtype or torch_dtype).
    #[arg(long)]
    pub dtype: Option<String>,
    /// safetensors (one file keyed by module path), hf (config.json, sharded
    /// safetensors and the tokenizer, loadable by transformers) or peft (a LoRA run's
    /// adapters: adapter_config.json and adapter_model.safetensors, loadable by PEFT).
    #[arg(long, default_value = "safetensors")]
    pub format: String,
    /// `--format hf`: the largest shard, e.g. 5GB, 500MB or bytes.
    #[arg(long, default_value = "5GB")]
    pub max_shard_size: String,
    /// `--format hf` or `peft`: the folder with the model's config.json and tokenizer
    /// (default: DIR, where zerotrain train puts them).
    #[arg(long)]
    pub hf_config: Option<PathBuf>,
    /// `--format hf` of a LoRA run: the whole model with its adapters merged into the
    /// weights (W + scaling B A), loadable by transformers without PEFT.
    #[arg(long)]
    pub merge: bool,
}

/// `zerotrain consolidate`.
pub fn consolidate(args: ConsolidateArgs) -> anyhow::Result<()> {
    use zerotrain_models::family;
    let ConsolidateArgs { dir, tag, out, dtype, format, max_shard_size, hf_config, merge } = args;
    if merge && format != "hf" {
        bail!("--merge writes a Hugging Face folder: give it with --format hf");
    }
    let dtype = match dtype.as_deref() {
        None => None,
        Some("f32" | "fp32") => Some(Precision::Fp32),
        Some("f16" | "fp16") => Some(Precision::Fp16),
        Some("bf16") => Some(Precision::Bf16),
        Some(other) => bail!("--dtype must be f32, f16 or bf16, not `{other}`"),
    };
    let peak =
        || proc_status_kib("VmHWM:").map_or_else(|| "unknown".into(), |kib| format!("{:.1} MiB", kib as f64 / 1024.0));
    match format.as_str() {
        "safetensors" => {}
        "hf" => {
            let max = parse_size(&max_shard_size)?;
            let export = if merge { family::merge::export_merged } else { family::export::export };
            let e = export(&dir, tag.as_deref(), &out, dtype, max, hf_config.as_deref())?;
            println!(
                "wrote {}: {} tensors, {} bytes ({}) in {} shard(s), config.json and the tokenizer; peak RSS {}",
                out.display(),
                e.tensors,
                e.bytes,
                e.dtype,
                e.shards.len(),
                peak()
            );
            return Ok(());
        }
        "peft" => {
            let dtype = dtype.unwrap_or(Precision::Fp32);
            let e = zerotrain_models::hf::peft::export(&dir, tag.as_deref(), &out, dtype, hf_config.as_deref())?;
            println!(
                "wrote {}: adapters of {} modules, {} tensors, {} bytes ({dtype}), adapter_config.json; peak RSS {}",
                out.display(),
                e.modules,
                e.tensors,
                e.bytes,
                peak()
            );
            return Ok(());
        }
        other => bail!("--format must be safetensors, hf or peft, not `{other}`"),
    }
    let dtype = dtype.unwrap_or(Precision::Fp32);
    let ckpt = Checkpoint::open(&dir, tag.as_deref())?;
    let bytes = zerotrain_checkpoint::consolidate(&ckpt, &out, dtype)?;
    let m = ckpt.manifest();
    println!(
        "wrote {}: {} tensors, {} parameters, {bytes} bytes ({dtype}) from {} (step {}); peak RSS {}",
        out.display(),
        m.layout.len(),
        m.num_elems(),
        ckpt.dir().display(),
        m.global_step,
        peak()
    );
    if zerotrain_models::hf::peft::trained_lora(&ckpt)?.is_some() {
        let base = &m.client_state[zerotrain_models::family::base::KEY];
        println!(
            "a LoRA run's checkpoint: those are its adapters (and modules_to_save), not its frozen base ({base}), \
             which no checkpoint holds"
        );
    }
    Ok(())
}

/// A size such as `5GB`, `500MB`, `64KiB` or a number of bytes.
fn parse_size(text: &str) -> anyhow::Result<u64> {
    let t = text.trim();
    let split = t.find(|c: char| !c.is_ascii_digit() && c != '.').unwrap_or(t.len());
    let (number, unit) = t.split_at(split);
    let scale: f64 = match unit.trim().to_ascii_uppercase().as_str() {
        "" | "B" => 1.0,
        "KB" => 1e3,
        "MB" => 1e6,
        "GB" => 1e9,
        "KIB" => 1024.0,
        "MIB" => 1024.0 * 1024.0,
        "GIB" => 1024.0 * 1024.0 * 1024.0,
        _ => bail!("--max-shard-size `{text}`: give bytes or a size such as 5GB, 500MB or 64KiB"),
    };
    let value: f64 = number.parse().map_err(|_| anyhow::anyhow!("--max-shard-size `{text}` is not a size"))?;
    let bytes = value * scale;
    if !bytes.is_finite() || bytes < 1.0 {
        bail!("--max-shard-size `{text}` must be at least one byte");
    }
    Ok(bytes as u64)
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
    println!("written by  {}, ZeRO stage {}, {} compute", super::count(m.world_size, "rank"), m.stage, m.precision);
    println!("parameters  {} in {} tensors", m.num_elems(), m.layout.len());
    println!("state       {}", m.tensors.join(", "));
    for f in &m.files {
        let ranges = match f.ranges.as_slice() {
            [[start, end]] => format!("elements {start}..{end}"),
            many => format!("{} elements in {} ranges", f.num_elems(), many.len()),
        };
        println!("  {:<20} {ranges}  {} bytes  {} blocks", f.name, f.size, f.block_crc32.len());
    }
    println!("client      {}", m.client_state);
    if verify {
        let bytes: u64 = m.files.iter().map(|f| f.size).sum();
        println!("verified    {} files, {bytes} bytes: every checksum matches", m.files.len());
    }
    Ok(())
}
