//! JSON text -> typed sections, checked key by key.
//!
//! Unknown keys are found by `serde_ignored` (every key a section's struct has no field
//! for), not by reading serde's error text; the closest known key comes from the fields the
//! structs declare (`serde_aux`'s introspection) and `strsim`'s edit distance. Wrong types
//! name their key path through `serde_path_to_error`. The raw structs therefore do not use
//! `deny_unknown_fields`: the check happens here, once, for the library's sections and for
//! a program's [`ConfigExtension`] alike.

use std::path::Path;

use serde::de::DeserializeOwned;
use serde_aux::serde_introspection::serde_introspect;
use serde_json::{Map, Value};

use super::raw::{
    ActivationCheckpointingConfig, AioConfig, Bf16Config, DataTypesConfig, DeepSpeedConfig, Fp16Config, MeshConfig,
    OffloadOptimizerConfig, OffloadParamConfig, OptimizerConfig, OptimizerParams, ParamGroupConfig, PipelineConfig,
    SchedulerConfig, SchedulerParams, TensorParallelConfig, ZeroConfig, ZerotrainConfig,
};
use super::{ConfigError, keys};

/// Largest config file read, in bytes: far beyond any real config, small enough that
/// `config check /dev/zero` fails at once instead of filling memory.
pub const MAX_CONFIG_BYTES: u64 = 16 << 20;
/// Longest key quoted in an error, in characters; longer keys are cut (and get no
/// suggestion), so a hostile file cannot make the message huge or the search slow.
const MAX_KEY_CHARS: usize = 80;

/// Keys a program adds to the config file beside DeepSpeed's and the `zerotrain` section,
/// read from the same file by [`Config::parse_with`](super::Config::parse_with).
///
/// The library removes the paths in [`KEYS`](Self::KEYS) before checking its own keys, so
/// they are not "unknown"; the program's type then gets them at the same paths (a key
/// `"zerotrain.eval_every"` arrives as `{"zerotrain": {"eval_every": ...}}`), checked the
/// same way: an unknown key names its path and the closest key of
/// [`known_keys`](Self::known_keys).
pub trait ConfigExtension: DeserializeOwned {
    /// Dotted paths of the keys the program owns, e.g. `["model", "zerotrain.eval_every"]`.
    const KEYS: &'static [&'static str];

    /// The keys the program's type accepts inside the object at `parent` (a dotted path),
    /// for "did you mean" suggestions. Default: none.
    fn known_keys(parent: &str) -> Vec<&'static str> {
        let _ = parent;
        Vec::new()
    }
}

/// Reads a config file of at most [`MAX_CONFIG_BYTES`].
pub fn read_file(path: &Path) -> Result<String, ConfigError> {
    let io = |source| ConfigError::Io { path: path.to_path_buf(), cause: source };
    // A FIFO or a device (a symlink to /dev/zero) is refused before it is read.
    let bytes = zerotrain_checkpoint::read_bounded(path, MAX_CONFIG_BYTES).map_err(|e| match e.kind() {
        std::io::ErrorKind::FileTooLarge => ConfigError::TooLarge { path: path.to_path_buf(), limit: MAX_CONFIG_BYTES },
        _ => io(e),
    })?;
    String::from_utf8(bytes).map_err(|e| io(std::io::Error::new(std::io::ErrorKind::InvalidData, e)))
}

/// Parses JSON text into a value (`null` and `{}` alike mean an empty config). An object
/// with a repeated key is an error: `serde_json::Value` would keep the last silently, and
/// DeepSpeed's own loader rejects duplicates.
pub fn json(text: &str, origin: &str) -> Result<Value, ConfigError> {
    let value: Value = serde_json::from_str::<Strict>(text).map(|s| s.0).map_err(|e| ConfigError::Json {
        origin: origin.to_string(),
        line: e.line(),
        column: e.column(),
        message: e.to_string(),
    })?;
    Ok(if value.is_null() { Value::Object(Map::new()) } else { value })
}

/// A JSON value whose objects have no repeated key.
struct Strict(Value);

impl<'de> serde::Deserialize<'de> for Strict {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(StrictVisitor).map(Strict)
    }
}

struct StrictVisitor;

impl<'de> serde::de::Visitor<'de> for StrictVisitor {
    type Value = Value;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("any JSON value")
    }
    fn visit_bool<E>(self, v: bool) -> Result<Value, E> {
        Ok(Value::Bool(v))
    }
    fn visit_i64<E>(self, v: i64) -> Result<Value, E> {
        Ok(v.into())
    }
    fn visit_u64<E>(self, v: u64) -> Result<Value, E> {
        Ok(v.into())
    }
    fn visit_f64<E>(self, v: f64) -> Result<Value, E> {
        Ok(serde_json::Number::from_f64(v).map_or(Value::Null, Value::Number))
    }
    fn visit_str<E>(self, v: &str) -> Result<Value, E> {
        Ok(Value::String(v.to_string()))
    }
    fn visit_string<E>(self, v: String) -> Result<Value, E> {
        Ok(Value::String(v))
    }
    fn visit_unit<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }
    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<Value, A::Error> {
        let mut items = Vec::new();
        while let Some(Strict(v)) = seq.next_element()? {
            items.push(v);
        }
        Ok(Value::Array(items))
    }
    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<Value, A::Error> {
        let mut object = Map::new();
        while let Some(key) = map.next_key::<String>()? {
            if object.contains_key(&key) {
                let shown: String = key.chars().take(MAX_KEY_CHARS).collect();
                return Err(serde::de::Error::custom(format!("duplicate key `{shown}`")));
            }
            let Strict(value) = map.next_value()?;
            object.insert(key, value);
        }
        Ok(Value::Object(object))
    }
}

/// Moves the dotted `paths` out of `root` into a new object, at the same paths.
pub fn split_off(root: &mut Value, paths: &[&str]) -> Value {
    let mut taken = Value::Object(Map::new());
    for path in paths {
        let (parent, key) = path.rsplit_once('.').unwrap_or(("", path));
        let source = if parent.is_empty() { Some(&mut *root) } else { root.get_mut(parent) };
        let Some(value) = source.and_then(Value::as_object_mut).and_then(|map| map.remove(key)) else { continue };
        let mut target = &mut taken;
        for segment in parent.split('.').filter(|s| !s.is_empty()) {
            target = target
                .as_object_mut()
                .expect("built as objects")
                .entry(segment)
                .or_insert_with(|| Value::Object(Map::new()));
        }
        target.as_object_mut().expect("built as objects").insert(key.to_string(), value);
    }
    taken
}

/// Deserialises `value` into `T`, failing on the first key `T` does not know (with the
/// closest of `known(parent)`) or on the first value of the wrong type (with its path).
pub fn typed<T: DeserializeOwned>(
    value: Value,
    origin: &str,
    known: &dyn Fn(&str) -> Vec<&'static str>,
) -> Result<T, ConfigError> {
    let mut unknown: Option<Vec<String>> = None;
    let mut note = |path: serde_ignored::Path| {
        unknown.get_or_insert_with(|| key_path(&path));
    };
    let parsed = serde_path_to_error::deserialize(serde_ignored::Deserializer::new(value, &mut note));
    if let Some(path) = unknown {
        let (key, parent) = path.split_last().expect("an ignored key has a name");
        let parent = parent.join(".");
        if !parent.is_empty() && known("").contains(&key.as_str()) {
            // A top-level section nested in another, as Hugging Face's NVMe example nests
            // `aio` in `zero_optimization`.
            let suggestion = Some(format!("{key}` at the top level, not in `{parent}"));
            return Err(ConfigError::UnknownKey {
                origin: origin.to_string(),
                key: keys::join(&parent, key),
                suggestion,
            });
        }
        return Err(unknown_key(origin, &parent, key, &known(&parent)));
    }
    parsed.map_err(|e| {
        let path = e.path().to_string();
        ConfigError::InvalidValue {
            origin: origin.to_string(),
            key: if path == "." { String::new() } else { path },
            message: e.into_inner().to_string(),
        }
    })
}

/// The map keys along an ignored path (`Some` and newtype levels carry no name).
fn key_path(path: &serde_ignored::Path) -> Vec<String> {
    use serde_ignored::Path;
    match path {
        Path::Root => Vec::new(),
        Path::Seq { parent, index } => [key_path(parent), vec![index.to_string()]].concat(),
        Path::Map { parent, key } => [key_path(parent), vec![key.clone()]].concat(),
        Path::Some { parent } | Path::NewtypeStruct { parent } | Path::NewtypeVariant { parent } => key_path(parent),
    }
}

fn unknown_key(origin: &str, parent: &str, key: &str, candidates: &[&str]) -> ConfigError {
    let short = key.chars().count() <= MAX_KEY_CHARS;
    let suggestion = short.then(|| closest(key, candidates)).flatten().map(str::to_string);
    let shown =
        if short { key.to_string() } else { format!("{}...", key.chars().take(MAX_KEY_CHARS).collect::<String>()) };
    ConfigError::UnknownKey { origin: origin.to_string(), key: keys::join(parent, &shown), suggestion }
}

/// The candidate within a third of its length (at least 2) edits of `key`, if any.
fn closest<'a>(key: &str, candidates: &[&'a str]) -> Option<&'a str> {
    candidates
        .iter()
        .map(|&c| (strsim::levenshtein(key, c), c))
        .filter(|&(d, c)| d <= (c.len() / 3).max(2))
        .min()
        .map(|(_, c)| c)
}

/// The keys the library's sections accept inside the object at `parent`, plus the
/// not-implemented DeepSpeed keys there and the `extension` keys there.
pub fn library_keys(parent: &str, extension: &[&'static str]) -> Vec<&'static str> {
    let fields: &[&str] = match parent {
        "" => serde_introspect::<DeepSpeedConfig>(),
        "optimizer" => serde_introspect::<OptimizerConfig>(),
        "optimizer.params" => serde_introspect::<OptimizerParams>(),
        "scheduler" => serde_introspect::<SchedulerConfig>(),
        "scheduler.params" => serde_introspect::<SchedulerParams>(),
        "zero_optimization" => serde_introspect::<ZeroConfig>(),
        "zero_optimization.offload_optimizer" => serde_introspect::<OffloadOptimizerConfig>(),
        "zero_optimization.offload_param" => serde_introspect::<OffloadParamConfig>(),
        "aio" => serde_introspect::<AioConfig>(),
        "fp16" => serde_introspect::<Fp16Config>(),
        "bf16" | "bfloat16" => serde_introspect::<Bf16Config>(),
        "data_types" => serde_introspect::<DataTypesConfig>(),
        "activation_checkpointing" => serde_introspect::<ActivationCheckpointingConfig>(),
        "pipeline" => serde_introspect::<PipelineConfig>(),
        "tensor_parallel" => serde_introspect::<TensorParallelConfig>(),
        "zerotrain" => serde_introspect::<ZerotrainConfig>(),
        "zerotrain.mesh" => serde_introspect::<MeshConfig>(),
        group if group.starts_with("zerotrain.param_groups.") => serde_introspect::<ParamGroupConfig>(),
        _ => &[],
    };
    let below = |paths: &[&'static str]| -> Vec<&'static str> {
        paths
            .iter()
            .filter_map(|p| match p.rsplit_once('.') {
                Some((par, k)) if par == parent => Some(k),
                None if parent.is_empty() => Some(*p),
                _ => None,
            })
            .collect()
    };
    let fixed: Vec<&'static str> = keys::FIXED_BEHAVIOUR.iter().map(|(path, _, _)| *path).collect();
    fields.iter().copied().chain(below(keys::NOT_IMPLEMENTED)).chain(below(&fixed)).chain(below(extension)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_off_moves_nested_paths_and_leaves_the_rest() {
        let mut v = serde_json::json!({"a": 1, "model": {"n": 2}, "zerotrain": {"world_size": 2, "every": 3}});
        let taken = split_off(&mut v, &["model", "zerotrain.every", "missing", "zerotrain.missing"]);
        assert_eq!(taken, serde_json::json!({"model": {"n": 2}, "zerotrain": {"every": 3}}));
        assert_eq!(v, serde_json::json!({"a": 1, "zerotrain": {"world_size": 2}}));
    }

    #[test]
    fn repeated_keys_are_errors_at_any_depth() {
        let err = json(r#"{"a": 1, "b": {"c": 2, "c": 3}}"#, "f.json").unwrap_err().to_string();
        assert!(err.starts_with("f.json: invalid JSON at line 1") && err.contains("duplicate key `c`"), "{err}");
        assert!(json(r#"{"train_batch_size": 8, "train_batch_size": 16}"#, "f").is_err());
        let v = json(r#"{"a": [1, -2, 2.5, "x", null, true, {"b": {}}], "c": 18446744073709551615}"#, "f").unwrap();
        assert_eq!(v, serde_json::json!({"a": [1, -2, 2.5, "x", null, true, {"b": {}}], "c": u64::MAX}));
    }

    #[test]
    fn closest_keeps_only_near_candidates() {
        assert_eq!(closest("reduce_bucket_sise", &["stage", "reduce_bucket_size"]), Some("reduce_bucket_size"));
        assert_eq!(closest("banana", &["stage"]), None);
        assert_eq!(closest("ab", &["abc", "xy"]), Some("abc"));
    }

    #[test]
    fn a_huge_unknown_key_is_cut_and_gets_no_suggestion() {
        let key = "x".repeat(1 << 20);
        let err = unknown_key("f.json", "zero_optimization", &key, &["stage"]);
        let text = err.to_string();
        assert!(text.len() < 200, "{}", text.len());
        assert!(text.starts_with("f.json: unknown key `zero_optimization.xxx") && text.ends_with("...`"), "{text}");
    }

    #[test]
    fn library_keys_include_fields_not_implemented_and_extension_keys() {
        let top = library_keys("", &["model", "zerotrain.eval_every"]);
        assert!(top.contains(&"train_batch_size") && top.contains(&"amp") && top.contains(&"model"), "{top:?}");
        let zt = library_keys("zerotrain", &["model", "zerotrain.eval_every"]);
        assert!(zt.contains(&"world_size") && zt.contains(&"eval_every") && !zt.contains(&"model"), "{zt:?}");
        assert!(library_keys("zero_optimization", &[]).contains(&"offload_optimizer"));
    }
}
