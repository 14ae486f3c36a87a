//! What every resolver of a sub-plan shares, and nothing else: the notes resolution
//! collects ([`Autos`]) and how a bad value is reported ([`invalid`]). A leaf: it imports
//! no resolver, so that the resolvers and `resolve.rs`, which calls them, form no circle.

use super::value::{AutoOr, Count};
use super::{ConfigError, PlanNotes};

/// Collects what resolution decided: how each `"auto"` was resolved, and which settings
/// have no effect.
#[derive(Default)]
pub(super) struct Autos(pub(super) PlanNotes);

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
                self.note(format!("{key} = {default:?} ({why})"));
                default
            }
            None => default,
        }
    }

    /// Notes how an `"auto"` was resolved.
    pub(super) fn note(&mut self, resolution: String) {
        self.0.auto_resolved.push(resolution);
    }

    /// Notes a setting that has no effect (the key, and why in parentheses if not obvious).
    pub(super) fn no_effect(&mut self, key: String) {
        self.0.no_effect.push(key);
    }
}

/// A count's value, if concrete.
pub(super) fn count(v: Option<AutoOr<Count>>) -> Option<u64> {
    v.and_then(AutoOr::value).map(|c| c.0)
}

pub(super) fn invalid(key: &str, message: impl Into<String>) -> ConfigError {
    ConfigError::InvalidValue { origin: "config".into(), key: key.into(), message: message.into() }
}
