//! Whether a run's model states fit this machine before they are allocated.

use anyhow::bail;

use zerotrain::Plan;
use zerotrain_models::hf::size::available_memory;

/// Refuses a model whose model states would not fit this machine's available memory,
/// before allocating them: a failed allocation aborts the process without a message.
/// Counts the ranks in this process (all of them under threads, one under mpirun) at
/// the stage's ZeRO formula, plus the initial copy of the model.
pub(super) fn check_memory(plan: &Plan, params: u64) -> anyhow::Result<()> {
    use zerotrain_zero::memory::{BytesPerParam, model_state_bytes};
    let ranks_here = if crate::processes::place().is_some() { 1 } else { plan.world_size() as u64 };
    let cost = match plan.precision.compute {
        zerotrain_precision::Precision::Fp32 => BytesPerParam::FP32_ADAM,
        _ => BytesPerParam::MIXED_ADAM,
    };
    let shard = params.div_ceil(plan.world_size() as u64);
    let per_rank = model_state_bytes(plan.zero.stage, params, shard, cost).total();
    let needed = per_rank.saturating_mul(ranks_here).saturating_add(params.saturating_mul(4));
    let available = available_memory();
    let gib = |bytes: u64| bytes as f64 / (1u64 << 30) as f64;
    match available {
        Some(available) if needed > available => bail!(
            "a GPT of {params} parameters needs about {:.1} GiB of model states in this process ({ranks_here} \
             rank(s), {}), but only {:.1} GiB of memory is available: shrink the model section, or use a higher \
             ZeRO stage or more processes",
            gib(needed),
            plan.zero.stage,
            gib(available)
        ),
        _ => Ok(()),
    }
}

/// Refuses a model whose weights alone would not fit this machine's available memory for
/// scoring or sampling (`what`: the command), before allocating them: each rank here holds
/// them in the compute dtype (its shard at stage 3), plus the initial copy in f32.
pub(crate) fn check_inference_memory(plan: &Plan, params: u64, what: &str) -> anyhow::Result<()> {
    let ranks_here = if crate::processes::place().is_some() { 1 } else { plan.world_size() as u64 };
    let held = match plan.zero.stage.shards_parameters() {
        true => params.div_ceil(plan.world_size() as u64),
        false => params,
    };
    let bytes = held.saturating_mul(plan.precision.compute.bytes_per_elem() as u64);
    let needed = bytes.saturating_mul(ranks_here).saturating_add(params.saturating_mul(4));
    let gib = |bytes: u64| bytes as f64 / (1u64 << 30) as f64;
    match available_memory() {
        Some(available) if needed > available => bail!(
            "{what}: a model of {params} parameters needs about {:.1} GiB in this process ({ranks_here} rank(s), \
             {}), but only {:.1} GiB of memory is available: use ZeRO stage 3 over more ranks or processes, or a \
             smaller model",
            gib(needed),
            plan.zero.stage,
            gib(available)
        ),
        _ => Ok(()),
    }
}
