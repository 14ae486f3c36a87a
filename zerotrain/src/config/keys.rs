//! Key-level rules that run on the raw JSON before typed parsing: legacy forms, known
//! DeepSpeed keys that zerotrain does not implement, and DeepSpeed switches for behaviour
//! zerotrain fixes one way.

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
    "compression_training",
    "sparse_attention",
    "eigenvalue",
    "progressive_layer_drop",
    "quantize_training",
    "timers",
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

/// Whether a config value asks for what zerotrain does anyway.
pub type ValueCheck = fn(&Value) -> bool;

/// DeepSpeed keys for behaviour zerotrain fixes one way: (dotted path, whether a value
/// asks for what zerotrain does anyway, why any other value has no effect). A value that
/// matches is accepted quietly; any other is reported with the reason.
pub const FIXED_BEHAVIOUR: &[(&str, ValueCheck, &str)] = &[
    ("zero_optimization.allgather_bucket_size", any_value_differs, "parameters are all-gathered one unit per call"),
    ("zero_optimization.contiguous_gradients", is_true, "gradients are always reduced from one flat buffer per bucket"),
    ("zero_optimization.allgather_partitions", is_true, "parameters are always all-gathered as partitions"),
    ("zero_optimization.stage3_max_reuse_distance", any_value_differs, "a unit is released after each use"),
    (
        "zero_optimization.stage3_gather_16bit_weights_on_model_save",
        is_false,
        "save the whole model with Engine::save_model or `zerotrain consolidate`",
    ),
    (
        "zero_optimization.stage3_gather_fp16_weights_on_model_save",
        is_false,
        "save the whole model with Engine::save_model or `zerotrain consolidate`",
    ),
    ("bf16.immediate_grad_update", is_false, "the optimizer steps at the accumulation boundary"),
    ("bfloat16.immediate_grad_update", is_false, "the optimizer steps at the accumulation boundary"),
    ("optimizer.params.torch_adam", any_value_differs, "Burn's Adam steps every shard"),
    ("pipeline.pipe_partitioned", is_false, "there is no tensor parallelism to partition over"),
    ("pipeline.grad_partitioned", is_false, "there is no tensor parallelism to partition over"),
];

fn is_true(v: &Value) -> bool {
    matches!(v, Value::Bool(true) | Value::Null)
}

fn is_false(v: &Value) -> bool {
    matches!(v, Value::Bool(false) | Value::Null)
}

fn any_value_differs(v: &Value) -> bool {
    v.is_null()
}

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

/// Removes every [`NOT_IMPLEMENTED`] and [`FIXED_BEHAVIOUR`] key from `root`, returning
/// those set to something that would matter: a not-implemented key set to anything but
/// `false`, `null`, `{"enabled": false}` or `{"device": "none"}` (its path), and a
/// fixed-behaviour key set to what zerotrain does not do (its path and why).
pub fn take_not_implemented(root: &mut Value) -> Vec<String> {
    let mut active = Vec::new();
    for path in NOT_IMPLEMENTED {
        if take(root, path).is_some_and(|value| !is_inert(&value)) {
            active.push((*path).to_string());
        }
    }
    for (path, matches, why) in FIXED_BEHAVIOUR {
        if take(root, path).is_some_and(|value| !matches(&value)) {
            active.push(format!("{path} ({why})"));
        }
    }
    active
}

/// Removes the value at the dotted `path` (nested at most once: `section.key` or
/// `section.sub.key`).
fn take(root: &mut Value, path: &str) -> Option<Value> {
    let (parent, key) = path.rsplit_once('.').unwrap_or(("", path));
    let mut object = &mut *root;
    for segment in parent.split('.').filter(|s| !s.is_empty()) {
        object = object.get_mut(segment)?;
    }
    object.as_object_mut()?.remove(key)
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
            "zero_optimization": {"stage": 2, "cpu_offload": false, "round_robin_gradients": true}
        });
        let active = take_not_implemented(&mut v);
        assert_eq!(active, ["flops_profiler", "zero_optimization.round_robin_gradients"]);
        assert_eq!(v, serde_json::json!({"zero_optimization": {"stage": 2}}));
    }

    /// Regression: these keys were accepted without a word although they change nothing.
    #[test]
    fn switches_for_fixed_behaviour_are_quiet_only_when_they_ask_for_it() {
        let mut v = serde_json::json!({
            "zero_optimization": {"contiguous_gradients": true, "allgather_partitions": false,
                                  "allgather_bucket_size": 5e8, "stage3_gather_16bit_weights_on_model_save": false},
            "optimizer": {"type": "Adam", "params": {"torch_adam": false}},
            "bfloat16": {"enabled": true, "immediate_grad_update": true},
            "pipeline": {"pipe_partitioned": false, "grad_partitioned": true}
        });
        let active = take_not_implemented(&mut v);
        let keys: Vec<&str> = active.iter().map(|a| a.split(' ').next().unwrap()).collect();
        assert_eq!(
            keys,
            [
                "zero_optimization.allgather_bucket_size",
                "zero_optimization.allgather_partitions",
                "bfloat16.immediate_grad_update",
                "optimizer.params.torch_adam",
                "pipeline.grad_partitioned"
            ]
        );
        assert!(active[1].contains("always all-gathered as partitions"), "{active:?}");
        assert_eq!(
            v,
            serde_json::json!({"zero_optimization": {}, "optimizer": {"type": "Adam", "params": {}},
                               "bfloat16": {"enabled": true}, "pipeline": {}})
        );
    }

    #[test]
    fn legacy_boolean_zero_optimization_means_stage_one() {
        let mut v = serde_json::json!({"zero_optimization": true});
        normalize_legacy(&mut v);
        assert_eq!(v, serde_json::json!({"zero_optimization": {"stage": 1}}));
    }
}
