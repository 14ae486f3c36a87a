//! How the model is divided between the ranks: ZeRO (`zero_optimization`), activation
//! checkpointing, pipeline stages (`pipeline`, `zerotrain.schedule`).

use zerotrain_zero::ZeroStage;
use zerotrain_zero::pipeline::{PartitionMethod, ScheduleKind};

use super::autos::{Autos, invalid};
use super::value::Count;
use super::{ComputeDevice, Config, ConfigError, PipelinePlan, ZeroPlan};

/// DeepSpeed's default bucket sizes (elements).
const DEFAULT_BUCKET_ELEMS: u64 = 500_000_000;
/// DeepSpeed's default `stage3_param_persistence_threshold`.
const DEFAULT_PERSISTENCE_THRESHOLD: u64 = 100_000;
/// DeepSpeed's default `stage3_prefetch_bucket_size`.
const DEFAULT_PREFETCH_ELEMS: u64 = 50_000_000;
/// DeepSpeed's default `stage3_max_live_parameters`.
const DEFAULT_MAX_LIVE_ELEMS: u64 = 1_000_000_000;

pub(super) fn resolve_zero(config: &Config, device: ComputeDevice, autos: &mut Autos) -> Result<ZeroPlan, ConfigError> {
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
        offload: super::offload::resolve(config, stage, device, autos)?,
    })
}

/// Whether `activation_checkpointing` is on (the section is present), noting its
/// DeepSpeed tuning keys that are set, which have no effect here.
pub(super) fn resolve_checkpointing(config: &Config, autos: &mut Autos) -> bool {
    let Some(s) = &config.raw.activation_checkpointing else { return false };
    let set = [
        ("partition_activations", s.partition_activations == Some(true)),
        ("cpu_checkpointing", s.cpu_checkpointing == Some(true)),
        ("contiguous_memory_optimization", s.contiguous_memory_optimization == Some(true)),
        ("number_checkpoints", s.number_checkpoints.is_some()),
        ("synchronize_checkpoint_boundary", s.synchronize_checkpoint_boundary == Some(true)),
        ("profile", s.profile == Some(true)),
    ];
    for (key, _) in set.iter().filter(|(_, on)| *on) {
        autos.no_effect(format!("activation_checkpointing.{key}"));
    }
    true
}

/// `zerotrain.recompute_units`, an error where nothing is recomputed (`recomputes`: an
/// `activation_checkpointing` section, or a pipeline's checkpoint interval above 0).
pub(super) fn resolve_recompute_units(config: &Config, recomputes: bool) -> Result<Option<usize>, ConfigError> {
    let Some(Count(units)) = config.raw.zerotrain.as_ref().and_then(|z| z.recompute_units) else { return Ok(None) };
    if !recomputes {
        return Err(invalid(
            "zerotrain.recompute_units",
            "says how many units activation checkpointing recomputes, but nothing is recomputed: add an \
             activation_checkpointing section (or a pipeline.activation_checkpoint_interval above 0)",
        ));
    }
    usize::try_from(units).map(Some).map_err(|_| invalid("zerotrain.recompute_units", "too large"))
}

/// The `pipeline` section and `zerotrain.schedule`; `None` for one stage.
pub(super) fn resolve_pipeline(
    config: &Config,
    world_size: usize,
    autos: &mut Autos,
) -> Result<Option<PipelinePlan>, ConfigError> {
    let zt = config.raw.zerotrain.as_ref();
    let schedule = match zt.and_then(|z| z.schedule.as_deref()).unwrap_or("1f1b") {
        "1f1b" => ScheduleKind::OneFOneB,
        "gpipe" => ScheduleKind::GPipe,
        other => return Err(invalid("zerotrain.schedule", format!("must be `1f1b` or `gpipe`, got `{other}`"))),
    };
    let Some(p) = &config.raw.pipeline else { return Ok(None) };
    if p.seed_layers == Some(true) {
        autos.no_effect("pipeline.seed_layers (layers are seeded by the model's own construction)".into());
    }
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

#[cfg(test)]
mod tests {
    use super::super::tests::{parse, plan};
    use super::super::*;
    use zerotrain_zero::pipeline::{PartitionMethod, ScheduleKind};

    /// The per-unit keys: DeepSpeed's defaults (overlap on at stage 3 only), explicit values,
    /// the activation checkpointing section (present means on; its DeepSpeed tuning keys are
    /// listed as no-ops when set), and a zero bucket refused by name.
    #[test]
    fn unit_keys_resolve_with_deepspeeds_defaults_and_checkpointing_is_the_sections_presence() {
        let zero = |stage: u8, extra: &str| {
            plan(&format!(r#"{{"train_batch_size": 4, "zero_optimization": {{"stage": {stage} {extra}}}}}"#))
                .unwrap()
                .zero
        };
        for stage in 0..=3 {
            let z = zero(stage, "");
            assert_eq!(z.overlap_comm, stage == 3, "stage {stage}");
            assert_eq!(
                (z.reduce_bucket_size, z.prefetch_bucket_size, z.max_live_parameters),
                (500_000_000, 50_000_000, 1_000_000_000)
            );
        }
        let z = zero(
            3,
            r#", "overlap_comm": false, "reduce_bucket_size": 1000, "stage3_prefetch_bucket_size": 0, "stage3_max_live_parameters": "auto""#,
        );
        assert_eq!(
            (z.overlap_comm, z.reduce_bucket_size, z.prefetch_bucket_size, z.max_live_parameters),
            (false, 1000, 0, 1_000_000_000)
        );
        assert!(zero(1, r#", "overlap_comm": true"#).overlap_comm);

        let on = plan(r#"{"train_batch_size": 4, "activation_checkpointing": {}}"#).unwrap();
        assert!(on.activation_checkpointing && on.warning().is_none());
        assert!(!plan(r#"{"train_batch_size": 4}"#).unwrap().activation_checkpointing);
        let tuned = plan(
            r#"{"train_batch_size": 4, "activation_checkpointing": {"partition_activations": true, "cpu_checkpointing": false,
                "contiguous_memory_optimization": true, "number_checkpoints": 4, "synchronize_checkpoint_boundary": false, "profile": false}}"#,
        )
        .unwrap();
        assert!(tuned.activation_checkpointing);
        assert_eq!(
            tuned.notes.no_effect,
            [
                "activation_checkpointing.partition_activations",
                "activation_checkpointing.contiguous_memory_optimization",
                "activation_checkpointing.number_checkpoints"
            ]
        );
        let err = parse(r#"{"activation_checkpointing": {"partition_activation": true}}"#).unwrap_err().to_string();
        assert_eq!(
            err,
            "test.json: unknown key `activation_checkpointing.partition_activation` (did you mean `partition_activations`?)"
        );
        let err =
            plan(r#"{"train_batch_size": 4, "zero_optimization": {"stage": 2, "reduce_bucket_size": 0}}"#).unwrap_err();
        assert_eq!(err.to_string(), "config: `zero_optimization.reduce_bucket_size`: must be at least 1 element");
    }

    /// `zerotrain.recompute_units` counts the units recomputed wherever something is (the
    /// section, or a pipeline's interval) and is an error naming it where nothing is.
    #[test]
    fn recompute_units_need_recomputation_and_say_how_many() {
        let units = |json: &str| plan(json).map(|p| p.recompute_units);
        let section = r#""train_batch_size": 4, "activation_checkpointing": {}"#;
        assert_eq!(units(&format!("{{{section}}}")).unwrap(), None);
        assert_eq!(units(&format!(r#"{{{section}, "zerotrain": {{"recompute_units": 3}}}}"#)).unwrap(), Some(3));
        assert_eq!(units(&format!(r#"{{{section}, "zerotrain": {{"recompute_units": 0}}}}"#)).unwrap(), Some(0));
        let piped = |interval: u8, n: usize| {
            parse(&format!(
                r#"{{"train_micro_batch_size_per_gpu": 1, "pipeline": {{"stages": 2, "activation_checkpoint_interval": {interval}}},
                    "zerotrain": {{"recompute_units": 2}}}}"#
            ))?
            .resolve(Overrides { world_size: Some(n), ..Overrides::default() })
        };
        assert_eq!(piped(1, 2).unwrap().recompute_units, Some(2));
        for err in [
            units(r#"{"train_batch_size": 4, "zerotrain": {"recompute_units": 2}}"#).unwrap_err(),
            piped(0, 2).unwrap_err(),
        ] {
            let err = err.to_string();
            assert!(
                err.starts_with("config: `zerotrain.recompute_units`: says how many units activation checkpointing"),
                "{err}"
            );
        }
        let err = parse(r#"{"zerotrain": {"recompute_units": -1}}"#).unwrap_err().to_string();
        assert!(err.contains("zerotrain.recompute_units"), "{err}");
    }

    /// The pipeline section: stages dividing the world, the batch derived over the
    /// data-parallel ranks, DeepSpeed's partition names, the schedule, and refusals by key.
    #[test]
    fn pipeline_keys_resolve_over_the_data_parallel_ranks_and_bad_ones_name_their_key() {
        let at = |json: &str, n: usize| parse(json)?.resolve(Overrides { world_size: Some(n), ..Overrides::default() });
        let plan = at(
            r#"{"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4,
                "pipeline": {"stages": 2, "partition_method": "uniform", "activation_checkpoint_interval": 2},
                "zerotrain": {"schedule": "gpipe"}}"#,
            6,
        )
        .unwrap();
        let p = plan.pipeline.unwrap();
        assert_eq!((p.stages, p.data_parallel(6), p.checkpoint_interval), (2, 3, 2));
        assert_eq!((p.partition, p.schedule), (PartitionMethod::Uniform, ScheduleKind::GPipe));
        assert_eq!(plan.batch.train_batch_size, 2 * 4 * 3, "micro x accumulation x data-parallel ranks");
        let defaults = at(
            r#"{"train_batch_size": 4, "pipeline": {"stages": 2, "partition": "best"}, "activation_checkpointing": {}}"#,
            2,
        )
        .unwrap()
        .pipeline
        .unwrap();
        assert_eq!(
            (defaults.partition, defaults.schedule, defaults.checkpoint_interval),
            (PartitionMethod::Parameters, ScheduleKind::OneFOneB, 1)
        );
        assert!(at(r#"{"train_batch_size": 4, "pipeline": {"stages": "auto"}}"#, 2).unwrap().pipeline.is_none());
        assert!(at(r#"{"train_batch_size": 4, "pipeline": {"stages": 1}}"#, 2).unwrap().pipeline.is_none());
        let warned = at(
            r#"{"train_batch_size": 4, "pipeline": {"stages": 2, "seed_layers": true, "pipe_partitioned": true}}"#,
            2,
        );
        let warned: Vec<String> =
            warned.unwrap().notes.no_effect.iter().map(|k| k.split(' ').next().unwrap().into()).collect();
        assert_eq!(warned, ["pipeline.pipe_partitioned", "pipeline.seed_layers"]);

        let err = |json: &str, n: usize| at(json, n).unwrap_err().to_string();
        assert!(
            err(r#"{"train_batch_size": 4, "pipeline": {"stages": 4}}"#, 6)
                .contains("`pipeline.stages`: must divide the world size (6)")
        );
        assert!(
            err(r#"{"train_batch_size": 4, "pipeline": {"stages": 2, "partition": "type:Block"}}"#, 2)
                .contains("pipeline.partition")
        );
        assert!(
            err(r#"{"train_batch_size": 4, "zerotrain": {"schedule": "interleaved"}}"#, 2)
                .contains("`zerotrain.schedule`: must be `1f1b` or `gpipe`")
        );
        let stage3 = err(r#"{"train_batch_size": 4, "zero_optimization": {"stage": 3}, "pipeline": {"stages": 2}}"#, 2);
        assert!(stage3.contains("stage 3 with pipeline.stages > 1 is not supported"), "{stage3}");
        let unknown = parse(r#"{"pipeline": {"stage": 2}}"#).unwrap_err().to_string();
        assert_eq!(unknown, "test.json: unknown key `pipeline.stage` (did you mean `stages`?)");
    }
}
