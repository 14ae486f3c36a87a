//! The rotary settings of a LLaMA-family `config.json`, in either of the layouts
//! `transformers` has written.
//!
//! # Note: two layouts
//!
//! Up to version 4, `transformers` wrote the rotary base as `rope_theta` and the stretch as
//! `rope_scaling` (`{"rope_type": "llama3", "factor": 8.0, ...}`). Version 5 writes one
//! object, `rope_parameters`, holding both (`{"rope_type": "llama3", "rope_theta": 500000.0,
//! "factor": 8.0, ...}`), and no `rope_theta`. A reader that knows only the first layout
//! reads a version-5 file as base 10000 without scaling: a different model that loads,
//! trains and scores without an error. So both are read; where a file has both (some
//! tools write the two), they must say the same, and a setting the models do not build
//! (a rotation of part of each head, scaling per layer type) is refused by name.

use serde_json::Value;

use super::fields::{field, positive, required};

/// `rope_scaling` (or `rope_parameters`' scaling): how rotary frequencies are stretched for
/// long contexts.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum RopeScaling {
    /// None (absent, null, or `rope_type: "default"`).
    None,
    /// Positions divided by `factor` (`rope_type: "linear"`).
    Linear {
        /// `factor`.
        factor: f64,
    },
    /// Llama 3.1's frequency-dependent scaling (`rope_type: "llama3"`).
    Llama3 {
        /// `factor`: how much longer the context is than the original's.
        factor: f64,
        /// `low_freq_factor`: wavelengths beyond `original / low_freq_factor` are scaled fully.
        low_freq_factor: f64,
        /// `high_freq_factor`: wavelengths below `original / high_freq_factor` are kept.
        high_freq_factor: f64,
        /// `original_max_position_embeddings`.
        original_max_position_embeddings: f64,
    },
}

/// The rotary base and scaling a LLaMA-family config describes (base 10000, no scaling,
/// where it says nothing), or what is wrong, naming the field.
pub fn rotary(json: &Value) -> Result<(f64, RopeScaling), String> {
    let parameters = parameters(json)?;
    let old_scaling = json.get("rope_scaling").filter(|v| !v.is_null());
    let new_theta = match parameters {
        Some(p) => field::<f64>(p, "rope_theta")?,
        None => None,
    };
    let theta = match (field::<f64>(json, "rope_theta")?, new_theta) {
        (Some(old), Some(new)) if old != new => {
            return Err(format!("rope_theta ({old}) and rope_parameters.rope_theta ({new}) disagree"));
        }
        (_, Some(new)) => positive(new, "rope_parameters.rope_theta")?,
        (Some(old), None) => positive(old, "rope_theta")?,
        (None, None) => 10000.0,
    };
    let old = old_scaling.map(|s| scaling(s, "rope_scaling")).transpose()?;
    let new = parameters.map(|p| scaling(p, "rope_parameters")).transpose()?;
    let scaling = match (old, new) {
        (Some(old), Some(new)) if old != new => {
            return Err(format!("rope_scaling ({old:?}) and rope_parameters ({new:?}) disagree"));
        }
        (old, new) => new.or(old).unwrap_or(RopeScaling::None),
    };
    let places = [(Some(json), ""), (parameters, "rope_parameters."), (old_scaling, "rope_scaling.")];
    for (object, prefix) in places.into_iter().filter_map(|(o, prefix)| Some((o?, prefix))) {
        if let Some(f) = field::<f64>(object, "partial_rotary_factor")?.filter(|&f| f != 1.0) {
            return Err(format!("{prefix}partial_rotary_factor is {f}: rotating part of each head is not built"));
        }
    }
    Ok((theta, scaling))
}

/// `rope_parameters`, if the file has it: one object, or one per layer type of which only
/// `full_attention` is built.
fn parameters(json: &Value) -> Result<Option<&Value>, String> {
    let Some(p) = json.get("rope_parameters").filter(|v| !v.is_null()) else { return Ok(None) };
    let Some(object) = p.as_object() else { return Err(format!("rope_parameters must be an object, not {p}")) };
    let per_layer_type = !object.is_empty() && object.values().all(Value::is_object);
    if !per_layer_type {
        return Ok(Some(p));
    }
    match object.keys().find(|k| *k != "full_attention") {
        None => Ok(object.get("full_attention")),
        Some(other) => Err(format!("rope_parameters.{other}: rotary settings per layer type are not built")),
    }
}

/// The scaling `object` (named `name`) describes.
fn scaling(object: &Value, name: &str) -> Result<RopeScaling, String> {
    let kind: Option<String> = field(object, "rope_type")?.or(field(object, "type")?);
    let number = |key: &str| -> Result<f64, String> {
        let v: f64 = required(object, key).map_err(|e| format!("{name}: {e}"))?;
        positive(v, &format!("{name}.{key}"))
    };
    match kind.as_deref() {
        None | Some("default") => Ok(RopeScaling::None),
        Some("linear") => Ok(RopeScaling::Linear { factor: number("factor")? }),
        Some("llama3") => {
            let (low, high) = (number("low_freq_factor")?, number("high_freq_factor")?);
            if high <= low {
                return Err(format!("{name}.high_freq_factor ({high}) must exceed low_freq_factor ({low})"));
            }
            Ok(RopeScaling::Llama3 {
                factor: number("factor")?,
                low_freq_factor: low,
                high_freq_factor: high,
                original_max_position_embeddings: number("original_max_position_embeddings")?,
            })
        }
        Some(other) => Err(format!(
            "{name}.rope_type `{other}` is not built: default, linear and llama3 are (dynamic, yarn and longrope are \
             not)"
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    const LLAMA3: f64 = 8.0;

    fn llama3() -> RopeScaling {
        RopeScaling::Llama3 {
            factor: LLAMA3,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 8192.0,
        }
    }

    #[test]
    fn either_layout_reads_as_the_same_rotation() {
        let scaling = json!({"rope_type": "llama3", "factor": LLAMA3, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192});
        let old = json!({"rope_theta": 500000.0, "rope_scaling": scaling.clone()});
        let mut inside = scaling.clone();
        inside["rope_theta"] = json!(500000.0);
        let new = json!({"rope_parameters": inside.clone()});
        let both = json!({"rope_theta": 500000.0, "rope_scaling": scaling, "rope_parameters": inside.clone()});
        let per_type = json!({"rope_parameters": {"full_attention": inside}});
        for config in [old, new, both, per_type] {
            assert_eq!(rotary(&config), Ok((500000.0, llama3())), "{config}");
        }
        assert_eq!(rotary(&json!({})), Ok((10000.0, RopeScaling::None)));
        let default = json!({"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}});
        assert_eq!(rotary(&default), Ok((1e6, RopeScaling::None)));
        let legacy_type = json!({"rope_scaling": {"type": "linear", "factor": 2.0}});
        assert_eq!(rotary(&legacy_type), Ok((10000.0, RopeScaling::Linear { factor: 2.0 })));
    }

    #[test]
    fn what_the_layouts_disagree_on_or_the_models_lack_is_refused_by_field() {
        let err = |v: Value| rotary(&v).unwrap_err();
        let theta = err(json!({"rope_theta": 10000.0, "rope_parameters": {"rope_theta": 500000.0}}));
        assert!(theta.contains("rope_theta (10000) and rope_parameters.rope_theta (500000)"), "{theta}");
        let stretch = err(json!({"rope_scaling": {"rope_type": "linear", "factor": 2.0},
            "rope_parameters": {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}}));
        assert!(stretch.starts_with("rope_scaling (Linear { factor: 2.0 }) and rope_parameters"), "{stretch}");
        let yarn = err(json!({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6}}));
        assert!(yarn.starts_with("rope_parameters.rope_type `yarn`"), "{yarn}");
        let partial = err(json!({"rope_parameters": {"rope_theta": 1e6, "partial_rotary_factor": 0.5}}));
        assert!(partial.starts_with("rope_parameters.partial_rotary_factor is 0.5"), "{partial}");
        assert!(err(json!({"partial_rotary_factor": 0.25})).starts_with("partial_rotary_factor is 0.25"));
        let sliding = err(json!({"rope_parameters": {"full_attention": {"rope_theta": 1e6},
            "sliding_attention": {"rope_theta": 1e4}}}));
        assert!(sliding.starts_with("rope_parameters.sliding_attention"), "{sliding}");
        assert!(err(json!({"rope_parameters": {"rope_theta": -1.0}})).contains("rope_parameters.rope_theta is -1"));
        assert!(err(json!({"rope_parameters": 3})).contains("rope_parameters must be an object"));
        let missing = err(json!({"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4}}));
        assert!(missing.contains("rope_parameters: has no factor"), "{missing}");
        assert!(rotary(&json!({"rope_parameters": {"rope_theta": 1e4, "partial_rotary_factor": 1.0}})).is_ok());
    }
}
