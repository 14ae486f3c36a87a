//! Resolving `fp16`, `bf16`, `communication_data_type`, `data_types`, the loss scaler and
//! the non-finite gradient check.

use zerotrain_precision::{AtMinimum, DynamicScaleConfig, Precision};

use super::autos::{Autos, invalid};
use super::raw::Fp16Config;
use super::value::{AutoOr, Count};
use super::{Config, ConfigError, LossScalePlan, PrecisionPlan};

fn dtype(key: &str, name: &str) -> Result<Precision, ConfigError> {
    match name {
        "fp32" | "float32" => Ok(Precision::Fp32),
        "fp16" | "float16" => Ok(Precision::Fp16),
        "bf16" | "bfloat16" => Ok(Precision::Bf16),
        other => Err(invalid(key, format!("must be fp32, fp16 or bf16, got `{other}`"))),
    }
}

pub(super) fn resolve(config: &Config, autos: &mut Autos) -> Result<PrecisionPlan, ConfigError> {
    let raw = &config.raw;
    let on = |v: Option<AutoOr<bool>>| v.and_then(AutoOr::value).unwrap_or(false);
    let fp16 = on(raw.fp16.as_ref().and_then(|f| f.enabled));
    let bf16 = on(raw.bf16.as_ref().and_then(|b| b.enabled));
    let compute = match (fp16, bf16) {
        (true, true) => {
            return Err(ConfigError::Unsupported {
                key: "fp16.enabled, bf16.enabled".into(),
                message: "fp16 and bf16 are both enabled; enable at most one".into(),
            });
        }
        (true, false) => Precision::Fp16,
        (false, true) => Precision::Bf16,
        (false, false) => Precision::Fp32,
    };
    let comm = match &raw.communication_data_type {
        Some(AutoOr::Value(name)) => dtype("communication_data_type", name)?,
        Some(AutoOr::Auto) => {
            autos.note(format!("communication_data_type = {compute} (the compute dtype)"));
            compute
        }
        None => compute,
    };
    let grad_accum = match raw.data_types.as_ref().and_then(|d| d.grad_accum_dtype.as_deref()) {
        Some(name) => dtype("data_types.grad_accum_dtype", name)?,
        None => compute,
    };
    let zt = raw.zerotrain.as_ref();
    let loss_scale = match raw.fp16.as_ref().filter(|_| fp16) {
        Some(section) => Some(fp16_scaling(section, config, autos)?),
        None => {
            if zt.is_some_and(|z| z.loss_scale_at_minimum.is_some()) {
                autos.no_effect("zerotrain.loss_scale_at_minimum (fp16 is off)".into());
            }
            None
        }
    };
    let check_grad_overflow = zt.and_then(|z| z.check_grad_overflow).unwrap_or(true);
    Ok(PrecisionPlan { compute, comm, grad_accum, loss_scale, check_grad_overflow })
}

fn fp16_scaling(f: &Fp16Config, config: &Config, autos: &mut Autos) -> Result<LossScalePlan, ConfigError> {
    if f.fp16_master_weights_and_grads == Some(true) {
        return Err(ConfigError::Unsupported {
            key: "fp16.fp16_master_weights_and_grads".into(),
            message: "master weights and optimizer gradients are always fp32 here; remove the key".into(),
        });
    }
    if f.auto_cast.and_then(AutoOr::value) == Some(true) {
        autos.no_effect("fp16.auto_cast (build inputs in the compute dtype, or cast them in the model)".into());
    }
    let loss_scale = match f.loss_scale {
        Some(AutoOr::Value(s)) => s,
        Some(AutoOr::Auto) => {
            autos.note("fp16.loss_scale = 0 (dynamic)".into());
            0.0
        }
        None => 0.0,
    };
    if !(loss_scale.is_finite() && loss_scale >= 0.0) {
        return Err(invalid("fp16.loss_scale", format!("must be 0 (dynamic) or a positive scale, got {loss_scale}")));
    }
    if loss_scale > 0.0 {
        return Ok(LossScalePlan::Static { scale: loss_scale });
    }
    dynamic_scaling(f, config, autos).map(LossScalePlan::Dynamic)
}

/// DeepSpeed's dynamic scaler's keys, with its defaults.
fn dynamic_scaling(f: &Fp16Config, config: &Config, autos: &mut Autos) -> Result<DynamicScaleConfig, ConfigError> {
    let mut count = |key: &str, v: Option<AutoOr<Count>>, default: u64| {
        autos.or(&format!("fp16.{key}"), v, Count(default), "DeepSpeed default").0
    };
    let initial_scale_power = count("initial_scale_power", f.initial_scale_power, 16);
    let window = count("loss_scale_window", f.loss_scale_window, 1000);
    let hysteresis = count("hysteresis", f.hysteresis, 2);
    let min_scale = autos.or("fp16.min_loss_scale", f.min_loss_scale, 1.0, "DeepSpeed default");
    if initial_scale_power > 64 {
        return Err(invalid("fp16.initial_scale_power", format!("must be at most 64, got {initial_scale_power}")));
    }
    if window == 0 {
        return Err(invalid("fp16.loss_scale_window", "must be at least 1"));
    }
    if hysteresis == 0 || hysteresis > u64::from(u32::MAX) {
        return Err(invalid("fp16.hysteresis", format!("must be at least 1, got {hysteresis}")));
    }
    if !(min_scale.is_finite() && min_scale > 0.0) || min_scale > 2f64.powi(initial_scale_power as i32) {
        let message = format!("must be > 0 and at most 2^initial_scale_power, got {min_scale}");
        return Err(invalid("fp16.min_loss_scale", message));
    }
    let at_minimum = match config.raw.zerotrain.as_ref().and_then(|z| z.loss_scale_at_minimum.as_deref()) {
        None | Some("error") => AtMinimum::Error,
        Some("stay") => AtMinimum::Stay,
        Some(other) => {
            let message = format!("must be `error` or `stay`, got `{other}`");
            return Err(invalid("zerotrain.loss_scale_at_minimum", message));
        }
    };
    Ok(DynamicScaleConfig {
        initial_scale_power: initial_scale_power as u32,
        window,
        hysteresis: hysteresis as u32,
        consecutive_hysteresis: f.consecutive_hysteresis.unwrap_or(false),
        min_scale,
        at_minimum,
    })
}
