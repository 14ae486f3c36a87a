//! [`Config`] -> [`Plan`]: each sub-plan by its own module, then the rules that cross them.

use super::autos::Autos;
use super::{
    Config, ConfigError, Overrides, Plan, PlanNotes, batch, lora, mesh, optim, parallel, precision, replicas, runtime,
};

pub(super) fn resolve(config: &Config, overrides: Overrides) -> Result<Plan, ConfigError> {
    let mut autos = Autos(PlanNotes { no_effect: config.not_implemented.clone(), ..PlanNotes::default() });
    let runtime = runtime::resolve(config, overrides, &mut autos)?;
    let pipeline = parallel::resolve_pipeline(config, runtime.world_size, &mut autos)?;
    let stage_ranks = pipeline.map_or(runtime.world_size, |p| p.data_parallel(runtime.world_size));
    let mesh = mesh::resolve(config, stage_ranks)?;
    let replicas = replicas::resolve(config, &runtime, pipeline.is_some(), &mut autos)?;
    // In one job each replica group is a mesh of its own (with servers the job is one).
    let group_ranks = replicas.as_ref().filter(|r| r.group.is_none()).map(|r| r.group_size(runtime.world_size));
    if let Some(ranks) = group_ranks.filter(|r| !r.is_multiple_of(mesh.model_parallel())) {
        let message = format!(
            "tp {} x sp {} = {} must divide the {ranks} ranks of a local_sgd group into data-parallel places",
            mesh.tp,
            mesh.sp,
            mesh.model_parallel()
        );
        return Err(super::autos::invalid(mesh::key(config), message));
    }
    let data_parallel = stage_ranks / mesh.model_parallel();
    let batch = batch::resolve(config, data_parallel as u64, &mut autos)?;
    let precision = precision::resolve(config, &mut autos)?;
    let zero = parallel::resolve_zero(config, runtime.device, &mut autos)?;
    if pipeline.is_some() && zero.stage.shards_parameters() {
        return Err(ConfigError::Unsupported {
            key: "zero_optimization.stage".into(),
            message: "stage 3 with pipeline.stages > 1 is not supported (as in DeepSpeed's pipeline engine): use \
                      stage 0, 1 or 2"
                .into(),
        });
    }
    let activation_checkpointing = parallel::resolve_checkpointing(config, &mut autos);
    let recomputes = pipeline.map_or(activation_checkpointing, |p| p.checkpoint_interval > 0);
    let recompute_units = parallel::resolve_recompute_units(config, recomputes)?;
    let optim = optim::resolve(config, overrides.total_steps, &mut autos)?;
    let lora = lora::resolve(config)?;
    lora::check_quantize(&lora, zero.stage.shards_parameters())?;
    Ok(Plan {
        runtime,
        batch,
        zero,
        pipeline,
        replicas,
        mesh,
        precision,
        optim,
        activation_checkpointing,
        recompute_units,
        lora,
        notes: autos.0,
        agreed: Default::default(),
    })
}
