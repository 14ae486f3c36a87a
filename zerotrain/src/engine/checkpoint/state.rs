//! What a manifest carries beside the weights: the engine's counters, schedule position,
//! loss scaler and optimizer scalars, checked on the way in; and the load options.

use burn_pack::Scalar;
use serde::{Deserialize, Serialize};
use zerotrain_checkpoint::{Checkpoint, CheckpointError};
use zerotrain_precision::ScalerState;

use crate::Result;
use crate::engine::Counters;

/// DeepSpeed's `load_checkpoint` options.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LoadOptions {
    /// Restore the optimizer state (default true); false starts it fresh.
    pub load_optimizer_states: bool,
    /// Restore the lr schedule's position (default true).
    pub load_lr_scheduler_states: bool,
    /// Restore only the parameters: no optimizer, schedule, counters or loss scale.
    pub load_module_only: bool,
}

impl Default for LoadOptions {
    fn default() -> Self {
        Self { load_optimizer_states: true, load_lr_scheduler_states: true, load_module_only: false }
    }
}

impl LoadOptions {
    /// The weights alone (`load_module_only`): what inference needs. The optimizer's state
    /// is neither read nor checked against the config's optimizer.
    pub fn module_only() -> Self {
        Self { load_module_only: true, ..Self::default() }
    }
}

/// The engine state a manifest carries.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(super) struct EngineState {
    pub(super) counters: Counters,
    pub(super) lr_iteration: i64,
    pub(super) loss_scaler: Option<ScalerState>,
    pub(super) optimizer: String,
    pub(super) optimizer_scalars: Vec<(String, Scalar)>,
    /// A learning rate set by hand ([`Engine::set_lr`]); absent in older checkpoints.
    #[serde(default)]
    pub(super) lr_override: Option<f64>,
}

/// Largest counter, lr position or optimizer step count a manifest may hold (exact in f64).
const MAX_COUNT: u64 = 1 << 53;

impl EngineState {
    /// The engine state of `ckpt`'s manifest, checked: the checksum only proves the file is
    /// what was written, not that it was written by zerotrain, and extreme values would
    /// panic or poison training after a resume.
    pub(super) fn read(ckpt: &Checkpoint) -> Result<Self> {
        let invalid = |reason: String| CheckpointError::InvalidManifest {
            path: ckpt.dir().join("manifest.json"),
            reason: format!("engine state: {reason}"),
        };
        let state: Self = serde_json::from_value(ckpt.manifest().engine.clone()).map_err(|e| invalid(e.to_string()))?;
        state.validate().map_err(invalid)?;
        Ok(state)
    }

    fn validate(&self) -> std::result::Result<(), String> {
        let c = &self.counters;
        for (name, value) in [
            ("global_steps", c.global_steps),
            ("micro_steps", c.micro_steps),
            ("skipped_steps", c.skipped_steps),
            ("global_samples", c.global_samples),
        ] {
            if value > MAX_COUNT {
                return Err(format!("counter {name} is {value}, beyond {MAX_COUNT}"));
            }
        }
        if c.skipped_steps > c.global_steps {
            return Err(format!("{} skipped steps of {} steps", c.skipped_steps, c.global_steps));
        }
        if !(-1..=MAX_COUNT as i64).contains(&self.lr_iteration) {
            return Err(format!("lr schedule position {} is out of range", self.lr_iteration));
        }
        if self.lr_override.is_some_and(|lr| !(lr.is_finite() && lr >= 0.0)) {
            return Err(format!("learning rate {:?} set by hand is not a finite number >= 0", self.lr_override));
        }
        if let Some(s) = &self.loss_scaler {
            // The largest scale DeepSpeed's config allows is 2^64 (initial_scale_power <= 64).
            if !(s.scale.is_finite() && s.scale > 0.0 && s.scale <= 2f64.powi(64)) {
                return Err(format!("loss scale {} is not in (0, 2^64]", s.scale));
            }
            if s.iter > MAX_COUNT || s.last_overflow_iter < -1 || s.last_overflow_iter > s.iter as i64 {
                return Err(format!("loss scaler iteration {} / last overflow {}", s.iter, s.last_overflow_iter));
            }
        }
        for (name, scalar) in &self.optimizer_scalars {
            let ok = match *scalar {
                Scalar::Int(v) => (0..=i64::from(i32::MAX)).contains(&v),
                Scalar::UInt(v) => v <= i32::MAX as u64,
                Scalar::Float(v) => v.is_finite(),
                Scalar::Bool(_) => true,
            };
            if !ok {
                return Err(format!("optimizer scalar {name} = {scalar:?} is out of range"));
            }
        }
        Ok(())
    }
}
