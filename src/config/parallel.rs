//! How the model is divided between the ranks: ZeRO (`zero_optimization`), activation
//! checkpointing, pipeline stages (`pipeline`, `zerotrain.schedule`).

use zerotrain_zero::ZeroStage;
use zerotrain_zero::pipeline::{PartitionMethod, ScheduleKind};

use super::raw::{ActivationCheckpointingConfig, ZerotrainConfig};
use super::resolve::{Autos, invalid};
use super::value::Count;
use super::{Config, ConfigError, PipelinePlan, ZeroPlan};

/// DeepSpeed's default bucket sizes (elements).
const DEFAULT_BUCKET_ELEMS: u64 = 500_000_000;
/// DeepSpeed's default `stage3_param_persistence_threshold`.
const DEFAULT_PERSISTENCE_THRESHOLD: u64 = 100_000;
/// DeepSpeed's default `stage3_prefetch_bucket_size`.
const DEFAULT_PREFETCH_ELEMS: u64 = 50_000_000;
/// DeepSpeed's default `stage3_max_live_parameters`.
const DEFAULT_MAX_LIVE_ELEMS: u64 = 1_000_000_000;

pub(super) fn resolve_zero(config: &Config, autos: &mut Autos) -> Result<ZeroPlan, ConfigError> {
    let z = config.raw.zero_optimization.clone().unwrap_or_default();
    let stage_index = z.stage.map_or(0, |c| c.0);
    let stage = ZeroStage::from_index(stage_index)
        .ok_or_else(|| invalid("zero_optimization.stage", format!("must be 0, 1, 2 or 3, got {stage_index}")))?;
    let mut elems = |key: &str, v, default: u64| {
        autos.or(&format!("zero_optimization.{key}"), v, Count(default), "DeepSpeed default").0
    };
    let reduce_bucket_size = elems("reduce_bucket_size", z.reduce_bucket_size, DEFAULT_BUCKET_ELEMS);
    if reduce_bucket_size == 0 {
        return Err(invalid("zero_optimization.reduce_bucket_size", "must be at least 1 element"));
    }
    Ok(ZeroPlan {
        stage,
        reduce_scatter: z.reduce_scatter.unwrap_or(true),
        reduce_bucket_size,
        allgather_bucket_size: elems("allgather_bucket_size", z.allgather_bucket_size, DEFAULT_BUCKET_ELEMS),
        overlap_comm: z.overlap_comm.unwrap_or(stage.shards_parameters()),
        param_persistence_threshold: elems(
            "stage3_param_persistence_threshold",
            z.stage3_param_persistence_threshold,
            DEFAULT_PERSISTENCE_THRESHOLD,
        ),
        prefetch_bucket_size: elems(
            "stage3_prefetch_bucket_size",
            z.stage3_prefetch_bucket_size,
            DEFAULT_PREFETCH_ELEMS,
        ),
        max_live_parameters: elems("stage3_max_live_parameters", z.stage3_max_live_parameters, DEFAULT_MAX_LIVE_ELEMS),
    })
}

/// The `activation_checkpointing` keys set to something that would matter in DeepSpeed,
/// which have no effect here.
pub(super) fn checkpointing_no_ops(section: Option<&ActivationCheckpointingConfig>) -> Vec<String> {
    let Some(s) = section else { return Vec::new() };
    let set = [
        ("partition_activations", s.partition_activations == Some(true)),
        ("cpu_checkpointing", s.cpu_checkpointing == Some(true)),
        ("contiguous_memory_optimization", s.contiguous_memory_optimization == Some(true)),
        ("number_checkpoints", s.number_checkpoints.is_some()),
        ("synchronize_checkpoint_boundary", s.synchronize_checkpoint_boundary == Some(true)),
        ("profile", s.profile == Some(true)),
    ];
    set.iter().filter(|(_, on)| *on).map(|(key, _)| format!("activation_checkpointing.{key}")).collect()
}

/// The `pipeline` section and `zerotrain.schedule`; `None` for one stage.
pub(super) fn resolve_pipeline(
    config: &Config,
    world_size: usize,
    zt: &ZerotrainConfig,
    autos: &mut Autos,
) -> Result<Option<PipelinePlan>, ConfigError> {
    let schedule = match zt.schedule.as_deref().unwrap_or("1f1b") {
        "1f1b" => ScheduleKind::OneFOneB,
        "gpipe" => ScheduleKind::GPipe,
        other => return Err(invalid("zerotrain.schedule", format!("must be `1f1b` or `gpipe`, got `{other}`"))),
    };
    let Some(p) = &config.raw.pipeline else { return Ok(None) };
    let stages = autos.or("pipeline.stages", p.stages, Count(1), "no pipeline").0;
    let stages = usize::try_from(stages).map_err(|_| invalid("pipeline.stages", "too large"))?;
    if stages == 0 || !world_size.is_multiple_of(stages) {
        return Err(invalid(
            "pipeline.stages",
            format!("must divide the world size ({world_size}) into equal data-parallel groups, got {stages}"),
        ));
    }
    let partition = match p.partition.as_deref().unwrap_or("parameters") {
        "parameters" | "best" => PartitionMethod::Parameters,
        "uniform" => PartitionMethod::Uniform,
        other => {
            return Err(ConfigError::Unsupported {
                key: "pipeline.partition".into(),
                message: format!("`{other}` is not supported; use `parameters` or `uniform`"),
            });
        }
    };
    let default_interval = u64::from(config.raw.activation_checkpointing.is_some());
    let interval = p.activation_checkpoint_interval.map_or(default_interval, |c| c.0);
    let checkpoint_interval =
        usize::try_from(interval).map_err(|_| invalid("pipeline.activation_checkpoint_interval", "too large"))?;
    Ok((stages > 1).then_some(PipelinePlan { stages, partition, schedule, checkpoint_interval }))
}
