//! [`Config`] -> [`Plan`]: defaults, `"auto"`, cross-field rules.

use std::time::Duration;

use super::parallel::{checkpointing_no_ops, resolve_pipeline, resolve_zero};
use super::raw::{OptimizerParams, SchedulerConfig};
use super::value::{AutoOr, Count};
use super::{Backend, BatchPlan, ComputeDevice, Config, ConfigError, OptimizerPlan, Overrides, Plan};
use crate::schedule::{LrSchedule, WarmupType};

/// Collects how each `"auto"` was resolved.
#[derive(Default)]
pub(super) struct Autos(pub(super) Vec<String>);

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
                self.0.push(format!("{key} = {default:?} ({why})"));
                default
            }
            None => default,
        }
    }
}

fn count(v: Option<AutoOr<Count>>) -> Option<u64> {
    v.and_then(AutoOr::value).map(|c| c.0)
}

pub(super) fn invalid(key: &str, message: impl Into<String>) -> ConfigError {
    ConfigError::InvalidValue { origin: "config".into(), key: key.into(), message: message.into() }
}

pub(super) fn resolve(config: &Config, overrides: Overrides) -> Result<Plan, ConfigError> {
    let raw = &config.raw;
    let mut autos = Autos::default();
    let zt = raw.zerotrain.clone().unwrap_or_default();

    let mpirun = overrides.mpirun.map(|m| m.world_size);
    let backend = match (zt.backend.as_deref().unwrap_or("auto"), mpirun) {
        ("auto", Some(_)) | ("mpi", _) => Backend::Mpi,
        ("auto", None) => Backend::Auto,
        ("threads", _) => Backend::Threads,
        (other, _) => {
            return Err(invalid(
                "zerotrain.backend",
                format!("unknown backend `{other}`; available: auto, threads, mpi"),
            ));
        }
    };
    let device = match (overrides.device, zt.device.as_deref()) {
        (Some(device), _) => device,
        (None, None) => ComputeDevice::Cpu,
        (None, Some(name)) => name.parse().map_err(|e: String| invalid("zerotrain.device", e))?,
    };
    if !device.is_built() {
        let key = if overrides.device.is_some() { "--device" } else { "zerotrain.device" };
        let name = device.name();
        return Err(ConfigError::Unsupported {
            key: key.into(),
            message: format!("this build has no `{name}` support: rebuild with `--features {name}` (see the README)"),
        });
    }
    // Under mpirun the process count decides; `zerotrain.world_size` is the threads default.
    let world_size = match (backend, mpirun, overrides.world_size) {
        (Backend::Mpi, Some(size), Some(n)) if n != size => {
            return Err(invalid("--world-size", format!("is {n} but mpirun started {size} processes")));
        }
        (Backend::Mpi, Some(size), _) => size,
        (_, _, Some(n)) => n,
        (_, _, None) => match zt.world_size {
            Some(Count(n)) => usize::try_from(n).map_err(|_| invalid("zerotrain.world_size", "too large"))?,
            None => 1,
        },
    };
    if world_size == 0 {
        return Err(invalid("zerotrain.world_size", "must be at least 1"));
    }
    if backend != Backend::Mpi && world_size > super::plan::MAX_THREAD_RANKS {
        let key = if overrides.world_size.is_some() { "--world-size" } else { "zerotrain.world_size" };
        let max = super::plan::MAX_THREAD_RANKS;
        return Err(invalid(key, format!("{world_size} thread ranks is more than the {max} one process runs")));
    }
    let timeout_s = zt.comm_timeout_s.unwrap_or(300.0);
    if !(timeout_s > 0.0 && timeout_s <= 1e7) {
        return Err(invalid(
            "zerotrain.comm_timeout_s",
            format!("must be a positive number of seconds, got {timeout_s}"),
        ));
    }

    let pipeline = resolve_pipeline(config, world_size, &zt, &mut autos)?;
    let data_parallel = pipeline.map_or(world_size, |p| p.data_parallel(world_size));
    let batch = resolve_batch(config, data_parallel as u64, &mut autos)?;
    let dtypes = super::precision::resolve(config, &mut autos.0)?;
    let zero = resolve_zero(config, &mut autos)?;
    if pipeline.is_some() && zero.stage.shards_parameters() {
        return Err(ConfigError::Unsupported {
            key: "zero_optimization.stage".into(),
            message: "stage 3 with pipeline.stages > 1 is not supported (as in DeepSpeed's pipeline engine): use \
                      stage 0, 1 or 2"
                .into(),
        });
    }

    let gradient_clipping = autos.or("gradient_clipping", raw.gradient_clipping, 0.0, "DeepSpeed default: off");
    if !(gradient_clipping >= 0.0 && gradient_clipping.is_finite()) {
        return Err(invalid("gradient_clipping", format!("must be >= 0, got {gradient_clipping}")));
    }
    let steps_per_print = autos.or("steps_per_print", raw.steps_per_print, Count(10), "default").0.max(1);
    let optimizer = resolve_optimizer(config, &mut autos)?;
    let schedule = match &raw.scheduler {
        None => LrSchedule::Constant { lr: optimizer.lr() },
        Some(s) => resolve_schedule(s, optimizer.lr(), overrides.total_steps, &mut autos)?,
    };

    Ok(Plan {
        world_size,
        backend,
        device,
        comm_timeout: Duration::from_secs_f64(timeout_s),
        batch,
        zero,
        precision: dtypes.precision,
        comm_dtype: dtypes.comm,
        grad_accum_dtype: dtypes.grad_accum,
        loss_scale: dtypes.loss_scale,
        gradient_clipping,
        activation_checkpointing: raw.activation_checkpointing.is_some(),
        pipeline,
        check_grad_overflow: zt.check_grad_overflow.unwrap_or(true),
        steps_per_print,
        wall_clock_breakdown: raw.wall_clock_breakdown.unwrap_or(false),
        seed: raw.seed.map_or(42, |c| c.0),
        optimizer,
        schedule,
        keep_last_n_checkpoints: match zt.keep_last_n_checkpoints {
            Some(Count(0)) => return Err(invalid("zerotrain.keep_last_n_checkpoints", "must be at least 1")),
            Some(Count(n)) => Some(usize::try_from(n).unwrap_or(usize::MAX)),
            None => None,
        },
        auto_resolved: autos.0,
        not_implemented: config
            .not_implemented
            .iter()
            .cloned()
            .chain(dtypes.not_implemented)
            .chain(checkpointing_no_ops(raw.activation_checkpointing.as_ref()))
            .chain(raw.pipeline.as_ref().filter(|p| p.seed_layers == Some(true)).map(|_| "pipeline.seed_layers".into()))
            .collect(),
    })
}

fn resolve_batch(config: &Config, world_size: u64, autos: &mut Autos) -> Result<BatchPlan, ConfigError> {
    let raw = &config.raw;
    let (t, m, g) = (raw.train_batch_size, raw.train_micro_batch_size_per_gpu, raw.gradient_accumulation_steps);
    let mut micro = count(m);
    // "auto" means "you decide": with no concrete train or micro size, micro defaults to 1.
    let all_auto_or_absent = count(t).is_none() && micro.is_none();
    if all_auto_or_absent && (t == Some(AutoOr::Auto) || m == Some(AutoOr::Auto)) {
        autos.0.push("train_micro_batch_size_per_gpu = 1 (no batch size given)".into());
        micro = Some(1);
    }
    let batch = BatchPlan::derive(count(t), micro, count(g), world_size)?;
    for (key, v) in [("train_batch_size", t), ("train_micro_batch_size_per_gpu", m), ("gradient_accumulation_steps", g)]
    {
        if v == Some(AutoOr::Auto) {
            let got = match key {
                "train_batch_size" => batch.train_batch_size,
                "train_micro_batch_size_per_gpu" => batch.micro_batch_per_rank,
                _ => batch.gradient_accumulation_steps,
            };
            autos.0.push(format!("{key} = {got} (derived from the other batch sizes)"));
        }
    }
    Ok(batch)
}

fn resolve_optimizer(config: &Config, autos: &mut Autos) -> Result<OptimizerPlan, ConfigError> {
    let (kind, p) = match &config.raw.optimizer {
        Some(o) => (o.kind.to_ascii_lowercase(), o.params.clone()),
        None => ("adam".to_string(), OptimizerParams::default()),
    };
    let lr = autos.or("optimizer.params.lr", p.lr, 1e-3, "DeepSpeed/torch default");
    let weight_decay = autos.or("optimizer.params.weight_decay", p.weight_decay, 0.0, "default");
    if !(lr >= 0.0 && lr.is_finite()) {
        return Err(invalid("optimizer.params.lr", format!("must be a finite number >= 0, got {lr}")));
    }
    if !(weight_decay >= 0.0 && weight_decay.is_finite()) {
        return Err(invalid("optimizer.params.weight_decay", format!("must be >= 0, got {weight_decay}")));
    }
    let refuse = |names: &[(&str, bool)], kind: &str| -> Result<(), ConfigError> {
        match names.iter().find(|(_, present)| *present) {
            Some((name, _)) => Err(invalid(&format!("optimizer.params.{name}"), format!("does not apply to {kind}"))),
            None => Ok(()),
        }
    };
    match kind.as_str() {
        "adam" | "adamw" => {
            refuse(
                &[
                    ("momentum", p.momentum.is_some()),
                    ("dampening", p.dampening.is_some()),
                    ("nesterov", p.nesterov.is_some()),
                ],
                "Adam",
            )?;
            if p.bias_correction == Some(false) {
                return Err(ConfigError::Unsupported {
                    key: "optimizer.params.bias_correction".into(),
                    message: "Adam without bias correction is not supported".into(),
                });
            }
            let betas = autos.or("optimizer.params.betas", p.betas, [0.9, 0.999], "default");
            let eps = autos.or("optimizer.params.eps", p.eps, 1e-8, "default");
            if !betas.iter().all(|b| (0.0..1.0).contains(b)) {
                return Err(invalid("optimizer.params.betas", format!("each beta must be in [0, 1), got {betas:?}")));
            }
            if !eps.is_finite() || eps <= 0.0 {
                return Err(invalid("optimizer.params.eps", format!("must be > 0, got {eps}")));
            }
            let decoupled = kind == "adamw" || p.adam_w_mode.unwrap_or(true);
            if kind == "adamw" && p.adam_w_mode == Some(false) {
                return Err(invalid(
                    "optimizer.params.adam_w_mode",
                    "AdamW always decouples weight decay; use type Adam",
                ));
            }
            Ok(OptimizerPlan::Adam {
                lr,
                betas,
                eps,
                weight_decay,
                decoupled_weight_decay: decoupled,
                amsgrad: p.amsgrad.unwrap_or(false),
            })
        }
        "sgd" => {
            let adam_only = [
                ("betas", p.betas.is_some()),
                ("eps", p.eps.is_some()),
                ("adam_w_mode", p.adam_w_mode.is_some()),
                ("amsgrad", p.amsgrad.is_some()),
                ("bias_correction", p.bias_correction.is_some()),
            ];
            refuse(&adam_only, "SGD")?;
            let momentum = p.momentum.unwrap_or(0.0);
            let dampening = p.dampening.unwrap_or(0.0);
            let nesterov = p.nesterov.unwrap_or(false);
            if !(0.0..1.0).contains(&momentum) || !(0.0..=1.0).contains(&dampening) {
                return Err(invalid(
                    "optimizer.params.momentum",
                    format!("momentum must be in [0, 1) and dampening in [0, 1], got {momentum} and {dampening}"),
                ));
            }
            if nesterov && (momentum == 0.0 || dampening != 0.0) {
                return Err(invalid(
                    "optimizer.params.nesterov",
                    "Nesterov momentum needs momentum > 0 and zero dampening (as in PyTorch)",
                ));
            }
            Ok(OptimizerPlan::Sgd { lr, momentum, dampening, nesterov, weight_decay })
        }
        other => Err(ConfigError::Unsupported {
            key: "optimizer.type".into(),
            message: format!("`{other}` is not supported; use Adam, AdamW or SGD (flat-shard-safe optimizers)"),
        }),
    }
}

fn resolve_schedule(
    s: &SchedulerConfig,
    base_lr: f64,
    total_steps: Option<u64>,
    autos: &mut Autos,
) -> Result<LrSchedule, ConfigError> {
    let p = &s.params;
    let key = |name: &str| format!("scheduler.params.{name}");
    if p.last_batch_iteration.is_some_and(|i| i != -1) {
        return Err(ConfigError::Unsupported {
            key: key("last_batch_iteration"),
            message: "only -1 (start) is supported; resume the schedule from a checkpoint instead".into(),
        });
    }
    let warmup_type = match p.warmup_type.as_deref().unwrap_or("log") {
        "log" => WarmupType::Log,
        "linear" => WarmupType::Linear,
        other => return Err(invalid(&key("warmup_type"), format!("must be `log` or `linear`, got `{other}`"))),
    };
    let warmup_num_steps = autos.or(&key("warmup_num_steps"), p.warmup_num_steps, Count(1000), "DeepSpeed default").0;
    if warmup_num_steps == 0 {
        return Err(invalid(&key("warmup_num_steps"), "must be a positive integer"));
    }
    let warmup_num_steps = warmup_num_steps.max(2);
    let min_lr = autos.or(&key("warmup_min_lr"), p.warmup_min_lr, 0.0, "DeepSpeed default");
    let mut total = || -> Result<u64, ConfigError> {
        match p.total_num_steps {
            Some(AutoOr::Value(Count(n))) => Ok(n),
            Some(AutoOr::Auto) => {
                let n = total_steps.ok_or_else(|| ConfigError::UnresolvableAuto {
                    key: key("total_num_steps"),
                    why: "no total step count is known; give a number or run with --steps".into(),
                })?;
                autos.0.push(format!("{} = {n} (the run's --steps)", key("total_num_steps")));
                Ok(n)
            }
            None => Err(invalid(&key("total_num_steps"), format!("is required by {}", s.kind))),
        }
    };
    match s.kind.as_str() {
        "WarmupLR" => {
            let max_lr = autos.or(&key("warmup_max_lr"), p.warmup_max_lr, base_lr, "the optimizer's lr");
            Ok(LrSchedule::WarmupLR { min_lr, max_lr, warmup_num_steps, warmup_type })
        }
        "WarmupDecayLR" => {
            let total_num_steps = total()?;
            let max_lr = autos.or(&key("warmup_max_lr"), p.warmup_max_lr, 1e-3, "DeepSpeed default");
            Ok(LrSchedule::WarmupDecayLR { min_lr, max_lr, warmup_num_steps, warmup_type, total_num_steps })
        }
        "WarmupCosineLR" => Ok(LrSchedule::WarmupCosineLR {
            base_lr,
            warmup_min_ratio: p.warmup_min_ratio.unwrap_or(0.0),
            warmup_num_steps,
            cos_min_ratio: p.cos_min_ratio.unwrap_or(1e-4),
            warmup_type,
            total_num_steps: total()?,
        }),
        "OneCycle" => {
            let need = |v: Option<f64>, name: &str| v.ok_or_else(|| invalid(&key(name), "is required by OneCycle"));
            if p.cycle_momentum != Some(false) {
                autos.0.push(format!(
                    "{} = false (momentum cycling is not implemented; betas stay fixed)",
                    key("cycle_momentum")
                ));
            }
            let first = p.cycle_first_step_size.map_or(2000, |c| c.0);
            let first_stairs = p.cycle_first_stair_count.map_or(0, |c| c.0);
            if first == 0 {
                return Err(invalid(&key("cycle_first_step_size"), "must be at least 1"));
            }
            Ok(LrSchedule::OneCycle {
                cycle_min_lr: need(p.cycle_min_lr, "cycle_min_lr")?,
                cycle_max_lr: need(p.cycle_max_lr, "cycle_max_lr")?,
                decay_lr_rate: p.decay_lr_rate.unwrap_or(0.0),
                cycle_first_step_size: first,
                cycle_second_step_size: p.cycle_second_step_size.map_or(first, |c| c.0).max(1),
                cycle_first_stair_count: first_stairs,
                cycle_second_stair_count: p.cycle_second_stair_count.map_or(first_stairs, |c| c.0),
                decay_step_size: p.decay_step_size.map_or(0, |c| c.0),
            })
        }
        other => Err(ConfigError::Unsupported {
            key: "scheduler.type".into(),
            message: format!("`{other}` is not supported; use WarmupLR, WarmupDecayLR, WarmupCosineLR or OneCycle"),
        }),
    }
}
