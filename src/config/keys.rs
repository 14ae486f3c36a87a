//! Key-level checks that run on the raw JSON before typed parsing: legacy forms, known
//! DeepSpeed keys that zerotrain does not implement, and "did you mean" for unknown keys.

use serde_json::{Map, Value};

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
    "activation_checkpointing",
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
    "pipeline",
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

/// If `message` is serde's unknown-field error, returns the unknown key and the closest of
/// the expected keys and the not-implemented keys at `parent` (a dotted path, "" for the top).
pub fn unknown_field(message: &str, parent: &str) -> Option<(String, Option<String>)> {
    let rest = message.strip_prefix("unknown field `")?;
    let (key, expected) = rest.split_once('`')?;
    // serde lists the expected names in backticks: "expected one of `a`, `b`" / "expected `a`".
    let mut candidates: Vec<&str> = expected.split('`').skip(1).step_by(2).collect();
    candidates.extend(NOT_IMPLEMENTED.iter().filter_map(|p| match p.rsplit_once('.') {
        Some((par, k)) if par == parent => Some(k),
        None if parent.is_empty() => Some(*p),
        _ => None,
    }));
    let best =
        candidates.into_iter().map(|c| (edit_distance(key, c), c)).filter(|&(d, c)| d <= (c.len() / 3).max(2)).min();
    Some((key.to_string(), best.map(|(_, c)| c.to_string())))
}

/// Levenshtein distance over bytes (keys are ASCII).
fn edit_distance(a: &str, b: &str) -> usize {
    let (a, b) = (a.as_bytes(), b.as_bytes());
    let mut prev: Vec<usize> = (0..=b.len()).collect();
    for (i, &ca) in a.iter().enumerate() {
        let mut cur = vec![i + 1; b.len() + 1];
        for (j, &cb) in b.iter().enumerate() {
            cur[j + 1] = (prev[j] + usize::from(ca != cb)).min(prev[j + 1] + 1).min(cur[j] + 1);
        }
        prev = cur;
    }
    prev[b.len()]
}

/// Joins a dotted parent path and a key.
pub fn join(parent: &str, key: &str) -> String {
    if parent.is_empty() { key.to_string() } else { format!("{parent}.{key}") }
}

/// An empty JSON object, for configs given as `{}`.
pub fn empty() -> Value {
    Value::Object(Map::new())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn suggestions_come_from_expected_and_not_implemented_keys() {
        let msg = "unknown field `reduce_bucket_sise`, expected one of `stage`, `reduce_bucket_size`";
        assert_eq!(
            unknown_field(msg, "zero_optimization"),
            Some(("reduce_bucket_sise".into(), Some("reduce_bucket_size".into())))
        );
        let msg = "unknown field `offload_optimiser`, expected `stage`";
        assert_eq!(unknown_field(msg, "zero_optimization").unwrap().1.as_deref(), Some("offload_optimizer"));
        let msg = "unknown field `banana`, expected `stage`";
        assert_eq!(unknown_field(msg, "zero_optimization"), Some(("banana".into(), None)));
        assert_eq!(unknown_field("invalid type: string", ""), None);
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
