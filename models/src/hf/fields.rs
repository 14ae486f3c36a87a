//! Fields of a `config.json`, read one at a time and named in the error: what
//! [`config`](super::config) and [`rope`](super::rope) both read with.

use serde::Deserialize;
use serde_json::Value;

/// One field, deserialized, named in the error; `None` where absent or null.
pub fn field<T: for<'de> Deserialize<'de>>(json: &Value, name: &str) -> Result<Option<T>, String> {
    match json.get(name) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => T::deserialize(v).map(Some).map_err(|e| format!("{name}: {e}")),
    }
}

/// One field the file must have.
pub fn required<T: for<'de> Deserialize<'de>>(json: &Value, name: &str) -> Result<T, String> {
    field(json, name)?.ok_or_else(|| format!("has no {name}"))
}

/// `value` of field `name`, if it is a positive number.
pub fn positive(value: f64, name: &str) -> Result<f64, String> {
    if !(value > 0.0 && value.is_finite()) {
        return Err(format!("{name} is {value}: it must be a positive number"));
    }
    Ok(value)
}
