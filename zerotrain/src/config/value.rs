//! Value types DeepSpeed configs use: `"auto"` placeholders and integers written as floats.

use serde::de::{DeserializeOwned, Error as _};
use serde::{Deserialize, Deserializer, Serialize};

/// A value that may be the string `"auto"` (HF Trainer and LLaMA-Factory configs use it):
/// zerotrain derives it from other values or uses the documented default, and says so in
/// the resolved plan.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
#[serde(untagged)]
pub enum AutoOr<T> {
    /// `"auto"`.
    Auto,
    /// A concrete value.
    Value(T),
}

impl<T> AutoOr<T> {
    /// The concrete value, if any.
    pub fn value(self) -> Option<T> {
        match self {
            Self::Auto => None,
            Self::Value(v) => Some(v),
        }
    }
}

impl<'de, T: DeserializeOwned> Deserialize<'de> for AutoOr<T> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let v = serde_json::Value::deserialize(d)?;
        if v.as_str() == Some("auto") {
            return Ok(Self::Auto);
        }
        T::deserialize(v).map(Self::Value).map_err(D::Error::custom)
    }
}

/// A non-negative integer that may be written as a float (`5e8`, `2.0`), as DeepSpeed
/// configs often do for bucket sizes.
#[derive(Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(transparent)]
pub struct Count(pub u64);

/// The number alone, as the plan's notes show it (`= 500000000`, not `= Count(500000000)`).
impl std::fmt::Debug for Count {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.0)
    }
}

impl<'de> Deserialize<'de> for Count {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl serde::de::Visitor<'_> for V {
            type Value = Count;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a non-negative integer")
            }
            fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<Count, E> {
                Ok(Count(v))
            }
            fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<Count, E> {
                u64::try_from(v).map(Count).map_err(|_| E::invalid_value(serde::de::Unexpected::Signed(v), &self))
            }
            fn visit_f64<E: serde::de::Error>(self, v: f64) -> Result<Count, E> {
                if v >= 0.0 && v.fract() == 0.0 && v <= 9.007_199_254_740_992e15 {
                    Ok(Count(v as u64))
                } else {
                    Err(E::invalid_value(serde::de::Unexpected::Float(v), &self))
                }
            }
        }
        d.deserialize_any(V)
    }
}
