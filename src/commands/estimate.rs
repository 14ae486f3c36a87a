//! `zerotrain estimate`: model-state memory per rank by stage (the ZeRO paper's formulas and
//! DeepSpeed's estimators), for a parameter count or a model's config.

use std::path::PathBuf;

use anyhow::{Context, bail};

use crate::keys;

/// `zerotrain estimate`'s arguments (see `cli::Command::Estimate`).
#[derive(Debug, Clone, clap::Args)]
pub struct EstimateArgs {
    /// Parameters (e.g. 7.5e9); or take them from --model-config.
    #[arg(long, required_unless_present = "model_config")]
    pub params: Option<f64>,
    /// Parameters of the largest layer (unit), for DeepSpeed's ZeRO-3 estimate; or take
    /// it from --model-config (the largest unit of the GPT).
    #[arg(long)]
    pub largest_layer_params: Option<f64>,
    /// Total number of ranks (GPUs) over all nodes; default: --nodes x --gpus-per-node.
    #[arg(long, required_unless_present = "gpus_per_node")]
    pub world_size: Option<u64>,
    /// Ranks per node (DeepSpeed's `num_gpus_per_node`); default: --world-size / --nodes.
    #[arg(long)]
    pub gpus_per_node: Option<u64>,
    /// Nodes (machines) the ranks are spread over.
    #[arg(long, default_value_t = 1)]
    pub nodes: u64,
    /// Show DeepSpeed's estimates with offload to CPU too (stage 2: the optimizer;
    /// stage 3: the optimizer, then the parameters too).
    #[arg(long)]
    pub offload: bool,
    /// A config whose `model` section gives the parameter count, or a Hugging Face
    /// `config.json` (such as the presets in configs/models/).
    #[arg(long)]
    pub model_config: Option<PathBuf>,
    /// Print JSON.
    #[arg(long)]
    pub json: bool,
}

/// The largest model estimated: 10^15 parameters, a thousand times the largest trained,
/// so that every byte count below fits its arithmetic.
const MAX_PARAMS: u64 = 1_000_000_000_000_000;

/// The most ranks estimated (2^24).
const MAX_RANKS: u64 = 1 << 24;

/// `zerotrain estimate`.
pub fn estimate(args: EstimateArgs) -> anyhow::Result<()> {
    let EstimateArgs { params, largest_layer_params, world_size, gpus_per_node, nodes, offload, model_config, json } =
        args;
    let (params, largest) = model_size(params, largest_layer_params, model_config.as_deref())?;
    if params > MAX_PARAMS || largest > params {
        bail!(
            "a model of {params} parameters (largest layer {largest}): more than {MAX_PARAMS} parameters, or a layer \
             larger than the model, is no model any machine holds"
        );
    }
    let (total, ranks) = ranks_per_node(world_size, gpus_per_node, nodes)?;
    let rows = zerotrain::estimate::paper(params, total);
    let ds: Vec<(bool, u64, u64)> = [false, true]
        .iter()
        .filter(|&&o| !o || offload)
        .map(|&o| {
            let (cpu, gpu) = zerotrain::estimate::deepspeed_zero2(params, ranks, nodes, o, 1.5);
            (o, cpu, gpu)
        })
        .collect();
    let zero3 = zero3_rows(params, largest, ranks, nodes, offload);
    let lora = match model_config.as_deref() {
        Some(file) if !is_hf_config(file) => lora_rows(file, total)?,
        _ => Vec::new(),
    };
    if json {
        let ds: Vec<_> = ds
            .iter()
            .map(|(o, cpu, gpu)| serde_json::json!({ "offload": o, "per_cpu_bytes": cpu, "per_gpu_bytes": gpu }))
            .collect();
        let value = serde_json::json!({ "params": params, "ranks": total, "zero_paper": rows, "deepspeed_zero2": ds,
                                        "largest_layer_params": largest, "deepspeed_zero3": zero3, "lora": lora });
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
    print_lora(&lora);
    if zero3.is_empty() {
        println!("DeepSpeed's ZeRO-3 estimate needs the largest layer: --largest-layer-params or --model-config");
        return Ok(());
    }
    println!(
        "DeepSpeed estimate_zero3_model_states_mem_needs (stage 3, largest layer {largest} parameters, \
         additional_buffer_factor 1.5; per CPU with zero_init / without, as zerotrain builds models):"
    );
    for row in &zero3 {
        let option = match (row["offload_optimizer"] == true, row["offload_param"] == true) {
            (false, _) => "offload none               ",
            (true, false) => "offload_optimizer=cpu      ",
            (true, true) => "offload_optimizer+param=cpu",
        };
        println!(
            "  {option}  per GPU {:>16} B  per CPU {:>16} B / {:>16} B",
            row["per_gpu_bytes"].as_u64().unwrap_or_default(),
            row["per_cpu_bytes_zero_init"].as_u64().unwrap_or_default(),
            row["per_cpu_bytes"].as_u64().unwrap_or_default()
        );
    }
    Ok(())
}

/// A LoRA config's bytes per rank by stage on `ranks` ranks (none without `zerotrain.lora`
/// or a Hugging Face model): its trained parameters' model states and its frozen base, by
/// the config's precision and tiers ([`zerotrain::estimate::placement`] and
/// [`zerotrain::estimate::frozen_placement`]), the base in NF4 only at stage 3, where
/// `quantize` holds it.
fn lora_rows(file: &std::path::Path, ranks: u64) -> anyhow::Result<Vec<serde_json::Value>> {
    use zerotrain_zero::ZeroStage;
    let (config, _) = zerotrain::Config::from_file_with::<keys::AppKeys>(file)?;
    if config.raw.zerotrain.as_ref().is_none_or(|z| z.lora.is_none()) {
        return Ok(Vec::new());
    }
    let overrides = zerotrain::config::Overrides { world_size: Some(ranks as usize), ..Default::default() };
    let (mut plan, settings) =
        keys::load(file, overrides).with_context(|| format!("{}: reading it for the LoRA estimate", file.display()))?;
    let Some(lora) = plan.lora.clone() else { return Ok(Vec::new()) };
    let sizes = match settings.hf {
        Some(source) => {
            let config = zerotrain_models::hf::HfConfig::read(&source.config_file())?;
            zerotrain_models::family::lora_sizes(&config, &lora.config)
        }
        None => zerotrain_models::gpt_lora_sizes(&settings.model, &lora.config),
    }
    .map_err(|e| anyhow::anyhow!("{}: {e}", file.display()))?;
    let stages = [ZeroStage::Disabled, ZeroStage::OptimizerStates, ZeroStage::Gradients, ZeroStage::Parameters];
    Ok(stages
        .into_iter()
        .map(|stage| {
            plan.zero.stage = stage;
            let total = |p: zerotrain::estimate::Placement| p.device + p.host + p.nvme;
            let trained = total(zerotrain::estimate::placement(&plan, sizes.trained));
            let frozen = total(zerotrain::estimate::frozen_placement(&plan, sizes.trained, &sizes.frozen));
            serde_json::json!({ "stage": stage.index(), "trained_params": sizes.trained,
                                "frozen_params": sizes.frozen.total(), "trained_bytes": trained,
                                "frozen_bytes": frozen, "nf4": stage == ZeroStage::Parameters && lora.quantize.is_some() })
        })
        .collect())
}

/// [`lora_rows`] as a table.
fn print_lora(rows: &[serde_json::Value]) {
    let Some(first) = rows.first() else { return };
    println!(
        "LoRA (the config's precision and tiers): {} trained parameters, {} frozen, bytes per rank:",
        first["trained_params"], first["frozen_params"]
    );
    println!("  {:>5} {:>16} {:>16}", "stage", "trained B", "frozen B");
    for row in rows {
        let nf4 = if row["nf4"] == true { " (NF4)" } else { "" };
        println!("  {:>5} {:>16} {:>16}{nf4}", row["stage"], row["trained_bytes"], row["frozen_bytes"]);
    }
}

/// The parameter count and the largest layer's (0: unknown), from `--params` and
/// `--largest-layer-params` or from a config's `model` section.
fn model_size(
    params: Option<f64>,
    largest_layer_params: Option<f64>,
    model_config: Option<&std::path::Path>,
) -> anyhow::Result<(u64, u64)> {
    let count = |v: f64, flag: &str| -> anyhow::Result<u64> {
        if v >= 1.0 && v.is_finite() { Ok(v as u64) } else { bail!("{flag} must be a positive number") }
    };
    Ok(match (params, model_config) {
        (_, Some(file)) if is_hf_config(file) => hf_model_size(&keys::HfSource::Config(file.to_path_buf()))?,
        (_, Some(file)) => {
            // Only the model section matters here (not, say, a schedule's "auto" length).
            let app = keys::load_keys(file)?;
            let folder = file.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(std::path::Path::new("."));
            if let Some(source) = app.resolve_in(folder)?.hf {
                return hf_model_size(&source);
            }
            let model = app.model.unwrap_or_default().shape();
            if model.vocab_size == 0 {
                bail!("{}: model.vocab_size must be set to estimate from the model section", file.display());
            }
            model.validate().map_err(anyhow::Error::msg)?;
            let (units, root) = model.unit_params();
            (model.num_params(), units.iter().map(|(_, n)| *n).max().unwrap_or(0).max(root))
        }
        (Some(p), None) => {
            let largest = largest_layer_params.map(|l| count(l, "--largest-layer-params")).transpose()?;
            (count(p, "--params")?, largest.unwrap_or(0))
        }
        (None, None) => bail!("--params must be a positive number"),
    })
}

/// Whether `file` is a Hugging Face `config.json` (it names a `model_type`) rather than a
/// training config; unreadable files are left to the training config's reader to report.
fn is_hf_config(file: &std::path::Path) -> bool {
    let parsed = zerotrain_models::file_error::read_file(file)
        .ok()
        .and_then(|b| serde_json::from_slice::<serde_json::Value>(&b).ok());
    parsed.is_some_and(|v| v.get("model_type").is_some())
}

/// The parameter count of a Hugging Face family's model and its largest layer (a block,
/// or an embedding or head), from its config.json.
fn hf_model_size(source: &keys::HfSource) -> anyhow::Result<(u64, u64)> {
    let file = source.config_file();
    let config = zerotrain_models::hf::HfConfig::read(&file)?;
    // From the shape alone: building even a lazy model of a config's millions of layers
    // would take the machine's memory.
    let size = zerotrain_models::hf::size::ModelSize::of(&config);
    if size.params == u64::MAX {
        bail!("{}: the model's parameter count passes 2^64: no machine holds it", file.display());
    }
    Ok((size.params, size.largest_layer))
}

/// DeepSpeed's ZeRO-3 rows: no offload; with `offload`, the optimizer, then the parameters
/// too. Each with zero_init (DeepSpeed's default) and without (zerotrain's case: every
/// process builds the whole model first). None without the largest layer.
fn zero3_rows(params: u64, largest: u64, ranks: u64, nodes: u64, offload: bool) -> Vec<serde_json::Value> {
    if largest == 0 {
        Vec::new()
    } else {
        [(false, false), (true, false), (true, true)]
            .into_iter()
            .filter(|&(o, _)| !o || offload)
            .map(|(o, p)| {
                let options =
                    |zero_init| zerotrain::estimate::Zero3Options { offload_optimizer: o, offload_param: p, zero_init };
                let (cpu_init, gpu) =
                    zerotrain::estimate::deepspeed_zero3(params, largest, ranks, nodes, options(true), 1.5);
                let (cpu, _) = zerotrain::estimate::deepspeed_zero3(params, largest, ranks, nodes, options(false), 1.5);
                serde_json::json!({ "offload_optimizer": o, "offload_param": p, "per_gpu_bytes": gpu,
                                    "per_cpu_bytes_zero_init": cpu_init, "per_cpu_bytes": cpu })
            })
            .collect()
    }
}

/// `--world-size` (total ranks), `--gpus-per-node` and `--nodes` -> (total ranks, ranks per
/// node), as DeepSpeed's `num_gpus_per_node` x `num_nodes`.
fn ranks_per_node(world_size: Option<u64>, gpus_per_node: Option<u64>, nodes: u64) -> anyhow::Result<(u64, u64)> {
    if nodes == 0 || world_size == Some(0) || gpus_per_node == Some(0) {
        bail!("--world-size, --gpus-per-node and --nodes must be at least 1");
    }
    if [Some(nodes), world_size, gpus_per_node].into_iter().flatten().any(|n| n > MAX_RANKS)
        || nodes.saturating_mul(gpus_per_node.unwrap_or(1)) > MAX_RANKS
    {
        bail!("--world-size, --gpus-per-node and --nodes may give at most {MAX_RANKS} ranks");
    }
    match (world_size, gpus_per_node) {
        (Some(total), Some(per_node)) if nodes.checked_mul(per_node) != Some(total) => {
            bail!("--world-size {total} is not --nodes {nodes} x --gpus-per-node {per_node}; give two of the three")
        }
        (Some(total), Some(per_node)) => Ok((total, per_node)),
        (Some(total), None) if total.is_multiple_of(nodes) => Ok((total, total / nodes)),
        (Some(total), None) => bail!("--world-size {total} does not divide over --nodes {nodes}"),
        (None, Some(per_node)) => {
            let total = nodes.checked_mul(per_node).context("--nodes x --gpus-per-node overflows")?;
            Ok((total, per_node))
        }
        (None, None) => bail!("give --world-size (total ranks) or --gpus-per-node"),
    }
}
