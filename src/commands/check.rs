//! `zerotrain config check`: the resolved plan, and what it means on this machine for the
//! built-in GPT or the Hugging Face family's model the config names.

use std::path::Path;

use super::overrides;
use crate::keys;

/// `zerotrain config check`.
pub fn config_check(file: &Path, world_size: Option<usize>, steps: Option<u64>, json: bool) -> anyhow::Result<()> {
    let (plan, settings) = keys::load(file, overrides(world_size, steps)?)?;
    if json {
        println!("{}", serde_json::to_string_pretty(&plan)?);
    } else {
        println!("{} resolves to:\n{plan}", file.display());
        if let Some(source) = &settings.hf {
            print_hf_placement(&plan, source, settings.block_size)?;
            print_collectives(&plan);
            return Ok(());
        }
        // What `train` refuses, refused here too.
        with_vocabulary(&settings.model).check_mesh(plan.mesh.tp, plan.mesh.sp).map_err(anyhow::Error::msg)?;
        print_placement(&plan, &settings.model)?;
        print_collectives(&plan);
        print_replicas(&plan, &settings.model);
        if let Some(pipeline) = plan.pipeline {
            print_stages(&settings.model, pipeline)?;
        }
    }
    Ok(())
}

/// On CUDA, whether NCCL can run on this machine (what `zerotrain.collectives: "auto"`
/// would find in its libraries; a launch also checks the GPUs).
fn print_collectives(plan: &zerotrain::Plan) {
    use zerotrain::config::{Collectives, ComputeDevice};
    if plan.runtime.device != ComputeDevice::Cuda || plan.runtime.collectives == Collectives::Host {
        return;
    }
    match zerotrain_zero::collective::nccl::available() {
        Ok(()) => println!("collectives here    NCCL loads on this machine"),
        Err(reason) => println!("collectives here    NCCL cannot run on this machine: {reason}"),
    }
}

/// Replica groups: each rank's bytes per round against synchronous data parallelism's over
/// as many steps, for the built-in GPT (the bus-bandwidth convention: an all-reduce moves
/// 2(n-1)/n of its buffer).
fn print_replicas(plan: &zerotrain::Plan, model: &zerotrain_models::GptConfig) {
    let Some(r) = &plan.replicas else { return };
    let model = with_vocabulary(model);
    let psi = model.num_params() as f64;
    let (job, g) = (plan.world_size() as f64, r.groups as f64);
    let bytes = r.comm_dtype.bytes_per_elem() as f64;
    // In one job a group is `job / g` ranks and a round all-reduces each rank's shard among
    // its peers; through servers the job is one group, pushing its shard (in the wire dtype)
    // and pulling it back (f32).
    let (n, group_size, round, how) = match r.servers.is_empty() {
        true => (job, job / g, 2.0 * (g - 1.0) / g * bytes, "across groups"),
        false => (job * g, job, bytes + 4.0, "to and from the servers"),
    };
    let shard = if plan.zero.stage.shards_optimizer_states() { psi / group_size } else { psi };
    let round = round * shard;
    let per_step = if plan.zero.stage.shards_parameters() { 3.0 } else { 2.0 } * (n - 1.0) / n
        * psi
        * plan.precision.comm.bytes_per_elem() as f64;
    let dp = per_step * r.sync_every as f64;
    println!(
        "  per round         {:.1} MiB per rank {how}, against {:.1} MiB of synchronous data parallelism on all {n} ranks over {} steps ({:.0}x less)",
        round / (1 << 20) as f64,
        dp / (1 << 20) as f64,
        r.sync_every,
        dp / round
    );
}

/// The built-in GPT `model` describes, its vocabulary the generated corpus's when the
/// config leaves it to the data.
fn with_vocabulary(model: &zerotrain_models::GptConfig) -> zerotrain_models::GptConfig {
    let mut model = *model;
    if model.vocab_size == 0 {
        model.vocab_size = zerotrain_models::data::Corpus::arithmetic(1000, 1).vocab.len();
    }
    model
}

/// Where each rank's model states live, by tier, for the built-in GPT the config describes
/// (with `zerotrain.lora`, its adapters and its frozen base: the model built with them,
/// its parameters left undrawn, to count them).
fn print_placement(plan: &zerotrain::Plan, model: &zerotrain_models::GptConfig) -> anyhow::Result<()> {
    let model = with_vocabulary(model);
    let psi = model.num_params();
    if let Some(lora) = &plan.lora {
        let sizes = zerotrain_models::gpt_lora_sizes(&model, &lora.config).map_err(anyhow::Error::msg)?;
        print_lora_placement(plan, lora, "the GPT", &sizes);
        return Ok(());
    }
    let p = zerotrain::estimate::placement(plan, psi);
    println!(
        "model states        per rank for the GPT of {psi} parameters: device {}, host memory {}, NVMe {}",
        mib(p.device),
        mib(p.host),
        mib(p.nvme)
    );
    Ok(())
}

/// `bytes` in MiB, one decimal.
fn mib(bytes: u64) -> String {
    format!("{:.1} MiB", bytes as f64 / (1u64 << 20) as f64)
}

/// Where each rank holds a LoRA run's trained parameters (the adapters and
/// `modules_to_save`) and its frozen base, of `sizes`, for the model named `what`.
fn print_lora_placement(
    plan: &zerotrain::Plan,
    lora: &zerotrain::config::LoraPlan,
    what: &str,
    sizes: &zerotrain_models::family::LoraSizes,
) {
    let (trained, frozen) = (sizes.trained, &sizes.frozen);
    let p = zerotrain::estimate::placement(plan, trained);
    let f = zerotrain::estimate::frozen_placement(plan, trained, frozen);
    let held = match (plan.zero.stage.shards_parameters(), lora.quantize) {
        (false, _) => format!("whole on every rank in {}", plan.precision.compute),
        (true, None) => format!("its shard in {}", plan.precision.compute),
        (true, Some(q)) => format!("its shard, the layers' matrices in {}", q.key().to_uppercase()),
    };
    println!(
        "model states        per rank for {what} with LoRA: {trained} trained parameters (adapters{}): device {}, \
         host memory {}, NVMe {}; {} frozen parameters ({held}): device {}, host memory {}, NVMe {} ({} bytes a rank)",
        if lora.config.modules_to_save.is_empty() { "" } else { " and modules_to_save" },
        mib(p.device),
        mib(p.host),
        mib(p.nvme),
        frozen.total(),
        mib(f.device),
        mib(f.host),
        mib(f.nvme),
        f.device + f.host + f.nvme,
    );
}

/// Where each rank's model states live for a Hugging Face family's model (its size from
/// its config.json). What `train` refuses before it trains is refused here too: a config
/// that cannot be read (a missing `hf_dir`), a model that cannot be built, one whose heads
/// or widths do not split over the mesh, a context (`block_size`, else the default) that
/// does not split over its sequence ranks.
fn print_hf_placement(
    plan: &zerotrain::Plan,
    source: &keys::HfSource,
    block_size: Option<usize>,
) -> anyhow::Result<()> {
    use zerotrain_models::family::load::{DEFAULT_TRAINING_CONTEXT, check_buildable};
    let file = source.config_file();
    let config = zerotrain_models::hf::HfConfig::read(&file)?;
    let psi = zerotrain_models::hf::size::ModelSize::of(&config).params;
    if psi > 1 << 50 {
        anyhow::bail!("{}: {psi} parameters, more than any machine holds", file.display());
    }
    check_buildable(&config, &file)?;
    let (tp, sp) = (plan.mesh.tp, plan.mesh.sp);
    zerotrain_models::family::check_split(&config, tp, sp).map_err(|e| anyhow::anyhow!("{}: {e}", file.display()))?;
    let context = block_size.unwrap_or_else(|| config.exact_context().0.min(DEFAULT_TRAINING_CONTEXT));
    if !context.is_multiple_of(sp) {
        anyhow::bail!(
            "a context of {context} tokens does not divide by zerotrain.mesh.sp {sp}: each sequence rank holds an \
             equal part of every sequence; set model.block_size to a multiple of {sp}"
        );
    }
    if let Some(lora) = &plan.lora {
        let sizes = zerotrain_models::family::lora_sizes(&config, &lora.config)
            .map_err(|e| anyhow::anyhow!("{}: {e}", file.display()))?;
        print_lora_placement(plan, lora, &file.display().to_string(), &sizes);
        return Ok(());
    }
    let p = zerotrain::estimate::placement(plan, psi);
    println!(
        "model states        per rank for {} ({} parameters): device {}, host memory {}, NVMe {}",
        file.display(),
        psi,
        mib(p.device),
        mib(p.host),
        mib(p.nvme)
    );
    Ok(())
}

/// Which of the built-in GPT's units each pipeline stage holds (vocabulary from the
/// generated corpus when the config leaves it to the data).
fn print_stages(model: &zerotrain_models::GptConfig, pipeline: zerotrain::config::PipelinePlan) -> anyhow::Result<()> {
    let model = with_vocabulary(model);
    let (units, root) = model.unit_params();
    let weights: Vec<u64> = units.iter().map(|(_, n)| *n).collect();
    let parts = zerotrain_zero::pipeline::partition(&weights, pipeline.stages, pipeline.partition)
        .map_err(|_| anyhow::anyhow!("pipeline.stages is {} but the GPT has {} units", pipeline.stages, units.len()))?;
    for (stage, range) in parts.into_iter().enumerate() {
        let names: Vec<&str> = units[range.clone()].iter().map(|(name, _)| name.as_str()).collect();
        let params: u64 = weights[range].iter().sum();
        println!("  {:<17} {} ({params} parameters)", format!("stage {stage}"), names.join(", "));
    }
    if root > 0 {
        println!("  every stage       the root: the tied token embedding ({root} parameters), summed over the stages");
    }
    Ok(())
}
