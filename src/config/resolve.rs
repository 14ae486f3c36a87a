//! [`Config`] -> [`Plan`]: each sub-plan by its own module, then the rules that cross them.

use super::value::{AutoOr, Count};
use super::{Config, ConfigError, Overrides, Plan, PlanNotes, batch, optim, parallel, precision, replicas, runtime};

/// Collects what resolution decided: how each `"auto"` was resolved, and which settings
/// have no effect.
#[derive(Default)]
pub(super) struct Autos(PlanNotes);

impl Autos {
    /// The value, or `default` (noted) when `"auto"`, or `default` silently when absent.
    pub(super) fn or<T: Copy + std::fmt::Debug>(
        &mut self,
        key: &str,
        v: Option<AutoOr<T>>,
        default: T,
        why: &str,
    ) -> T {
        match v {
            Some(AutoOr::Value(v)) => v,
            Some(AutoOr::Auto) => {
                self.note(format!("{key} = {default:?} ({why})"));
                default
            }
            None => default,
        }
    }

    /// Notes how an `"auto"` was resolved.
    pub(super) fn note(&mut self, resolution: String) {
        self.0.auto_resolved.push(resolution);
    }

    /// Notes a setting that has no effect (the key, and why in parentheses if not obvious).
    pub(super) fn no_effect(&mut self, key: String) {
        self.0.no_effect.push(key);
    }
}

/// A count's value, if concrete.
pub(super) fn count(v: Option<AutoOr<Count>>) -> Option<u64> {
    v.and_then(AutoOr::value).map(|c| c.0)
}

pub(super) fn invalid(key: &str, message: impl Into<String>) -> ConfigError {
    ConfigError::InvalidValue { origin: "config".into(), key: key.into(), message: message.into() }
}

pub(super) fn resolve(config: &Config, overrides: Overrides) -> Result<Plan, ConfigError> {
    let mut autos = Autos(PlanNotes { no_effect: config.not_implemented.clone(), ..PlanNotes::default() });
    let runtime = runtime::resolve(config, overrides, &mut autos)?;
    let pipeline = parallel::resolve_pipeline(config, runtime.world_size, &mut autos)?;
    let data_parallel = pipeline.map_or(runtime.world_size, |p| p.data_parallel(runtime.world_size));
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
    let optim = optim::resolve(config, overrides.total_steps, &mut autos)?;
    let replicas = replicas::resolve(config, &runtime, pipeline.is_some(), &mut autos)?;
    Ok(Plan { runtime, batch, zero, pipeline, replicas, precision, optim, activation_checkpointing, notes: autos.0 })
}
