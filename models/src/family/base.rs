//! The frozen base of a LoRA run, fingerprinted: a checkpoint keeps only what trains, so
//! resuming, or merging, must find the very base the adapters were trained on. The
//! fingerprint is the CRC-32 of each frozen tensor's bytes in the base's files (a model
//! from `hf_dir`), or the seed a fresh one (`hf_config`) is drawn from; every checkpoint
//! records it in its client state ([`KEY`]), and a base that differs is refused naming
//! the first tensor that does.

use std::collections::BTreeMap;
use std::path::Path;

use serde_json::{Value, json};

use crate::hf::files::TensorFiles;

/// The key of a checkpoint's client state under which the fingerprint is recorded.
pub const KEY: &str = "base";

/// The fingerprint of the frozen tensors `frozen` (module paths) of a model read from
/// `dir`'s files (`alias`: GPT-2's names without `transformer.`), or drawn from `seed`
/// where `dir` is `None`.
pub fn fingerprint(
    dir: Option<&Path>,
    frozen: &[String],
    alias: fn(&str) -> Option<String>,
    seed: u64,
) -> anyhow::Result<Value> {
    let Some(dir) = dir else { return Ok(json!({ "seed": seed })) };
    let files = TensorFiles::open(dir)?;
    let mut tensors = BTreeMap::new();
    for name in frozen {
        let entry = files.get(name).or_else(|| alias(name).and_then(|a| files.get(&a)));
        let entry = entry.ok_or_else(|| anyhow::anyhow!("{}: no tensor `{name}`", dir.display()))?;
        tensors.insert(name.clone(), Value::from(files.crc32(entry)));
    }
    Ok(json!({ "tensors": tensors }))
}

/// Checks the base fingerprinted `now` against the one a checkpoint recorded (`then`;
/// nothing to check where it recorded none): an error naming the first tensor that
/// differs, or the seed.
pub fn check(then: &Value, now: &Value) -> Result<(), String> {
    if then.is_null() || then == now {
        return Ok(());
    }
    if let (Some(a), Some(b)) = (then["tensors"].as_object(), now["tensors"].as_object()) {
        for (name, crc) in a {
            match b.get(name) {
                Some(other) if other == crc => {}
                Some(other) => {
                    return Err(format!(
                        "the frozen base differs from the one the checkpoint was trained on: tensor `{name}` has CRC-32 \
                         {other} now, {crc} then"
                    ));
                }
                None => return Err(format!("the frozen base has no tensor `{name}`, which the checkpoint's had")),
            }
        }
        if let Some(name) = b.keys().find(|n| !a.contains_key(*n)) {
            return Err(format!("the frozen base has tensor `{name}`, which the checkpoint's had not"));
        }
        return Ok(());
    }
    Err(format!("the frozen base is not the one the checkpoint was trained on ({then} then, {now} now)"))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The first differing tensor is named; a checkpoint without a record is not checked.
    #[test]
    fn a_differing_base_is_named_by_its_first_differing_tensor() {
        let then = json!({"tensors": {"a.weight": 1, "b.weight": 2}});
        assert!(check(&then, &then.clone()).is_ok());
        assert!(check(&Value::Null, &then).is_ok());
        let e = check(&then, &json!({"tensors": {"a.weight": 1, "b.weight": 3}})).unwrap_err();
        assert!(e.contains("`b.weight`") && e.contains("3 now, 2 then"), "{e}");
        let e = check(&then, &json!({"tensors": {"a.weight": 1}})).unwrap_err();
        assert!(e.contains("no tensor `b.weight`"), "{e}");
        let e = check(&json!({"seed": 1}), &json!({"seed": 2})).unwrap_err();
        assert!(e.contains("not the one"), "{e}");
    }
}
