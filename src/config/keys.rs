//! Key-level rules that run on the raw JSON before typed parsing: legacy forms, and known
//! DeepSpeed keys that zerotrain does not implement.

use serde_json::Value;

/// DeepSpeed keys that zerotrain accepts but does not implement (dotted paths). A present,
/// active one is reported once in the plan's warnings; the rest of the config still loads.
pub const NOT_IMPLEMENTED: &[&str] = &[
    "prescale_gradients",
    "gradient_predivide_factor",
    "sparse_gradients",
    "memory_breakdown",
    "dump_state",
    "zero_allow_untested_optimizer",
    "zero_force_ds_cpu_optimizer",
    "amp",
    "flops_profiler",
    "tensorboard",
    "wandb",
    "csv_monitor",
    "comet",
    "comms_logger",
    "autotuning",
    "elasticity",
    "data_efficiency",
    "curriculum_learning",
    "checkpoint",
    "aio",
    "compression_training",
    "sparse_attention",
    "eigenvalue",
    "progressive_layer_drop",
    "quantize_training",
    "timers",
    "zero_optimization.offload_optimizer",
    "zero_optimization.offload_param",
    "zero_optimization.sub_group_size",
    "zero_optimization.round_robin_gradients",
    "zero_optimization.elastic_checkpoint",
    "zero_optimization.load_from_fp32_weights",
    "zero_optimization.ignore_unused_parameters",
    "zero_optimization.legacy_stage1",
    "zero_optimization.cpu_offload",
    "zero_optimization.cpu_offload_params",
    "zero_optimization.cpu_offload_use_pin_memory",
    "zero_optimization.zero_hpz_partition_size",
    "zero_optimization.zero_quantized_weights",
    "zero_optimization.zero_quantized_gradients",
    "zero_optimization.mics_shard_size",
    "zero_optimization.stage3_module_granularity_threshold",
    "zero_optimization.memory_efficient_linear",
];

/// Rewrites legacy forms in place: `"zero_optimization": true|false` and
/// `"stage": true|false` become stage 1|0 (DeepSpeed's reading).
pub fn normalize_legacy(root: &mut Value) {
    let Some(obj) = root.as_object_mut() else { return };
    if let Some(Value::Bool(on)) = obj.get("zero_optimization") {
        let stage = u64::from(*on);
        obj.insert("zero_optimization".into(), serde_json::json!({ "stage": stage }));
    }
    if let Some(Value::Object(zero)) = obj.get_mut("zero_optimization")
        && let Some(Value::Bool(on)) = zero.get("stage")
    {
        let stage = u64::from(*on);
        zero.insert("stage".into(), stage.into());
    }
}

/// Removes every [`NOT_IMPLEMENTED`] key from `root`, returning the paths of those that were
/// set to something active (not `false`, `null`, `{"enabled": false}` or `{"device": "none"}`).
pub fn take_not_implemented(root: &mut Value) -> Vec<String> {
    let mut active = Vec::new();
    for path in NOT_IMPLEMENTED {
        let (parent, key) = match path.rsplit_once('.') {
            Some((parent, key)) => (root.get_mut(parent), key),
            None => (Some(&mut *root), *path),
        };
        let Some(Value::Object(map)) = parent else { continue };
        if let Some(value) = map.remove(key)
            && !is_inert(&value)
        {
            active.push((*path).to_string());
        }
    }
    active
}

fn is_inert(value: &Value) -> bool {
    match value {
        Value::Null | Value::Bool(false) => true,
        Value::Object(map) => {
            map.get("enabled") == Some(&Value::Bool(false)) || map.get("device").and_then(Value::as_str) == Some("none")
        }
        _ => false,
    }
}

/// Joins a dotted parent path and a key.
pub fn join(parent: &str, key: &str) -> String {
    if parent.is_empty() { key.to_string() } else { format!("{parent}.{key}") }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn suggestions_come_from_expected_and_not_implemented_keys() {
        let err = crate::Config::parse(r#"{"zero_optimization": {"offload_optimiser": {}}}"#, "t").unwrap_err();
        assert_eq!(
            err.to_string(),
            "t: unknown key `zero_optimization.offload_optimiser` (did you mean `offload_optimizer`?)"
        );
        let err = crate::Config::parse(r#"{"zero_optimization": {"banana": 1}}"#, "t").unwrap_err();
        assert_eq!(err.to_string(), "t: unknown key `zero_optimization.banana`");
    }

    #[test]
    fn inert_not_implemented_keys_give_no_warning() {
        let mut v = serde_json::json!({
            "memory_breakdown": false,
            "tensorboard": {"enabled": false},
            "flops_profiler": {"enabled": true},
            "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "none"}, "round_robin_gradients": true}
        });
        let active = take_not_implemented(&mut v);
        assert_eq!(active, ["flops_profiler", "zero_optimization.round_robin_gradients"]);
        assert_eq!(v, serde_json::json!({"zero_optimization": {"stage": 2}}));
    }

    #[test]
    fn legacy_boolean_zero_optimization_means_stage_one() {
        let mut v = serde_json::json!({"zero_optimization": true});
        normalize_legacy(&mut v);
        assert_eq!(v, serde_json::json!({"zero_optimization": {"stage": 1}}));
    }
}
