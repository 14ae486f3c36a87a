//! Loss scaling for fp16 training, as DeepSpeed 0.19.8's `DynamicLossScaler` does it.
//!
//! A pure state machine: [`LossScaler::update`] takes whether this step's gradients
//! overflowed (agreed by all ranks) and returns a [`ScaleDecision`]; it does no I/O, and the
//! engine logs the decision. On overflow the step must be skipped.
//!
//! # Note: DeepSpeed's dynamic rule
//! State: `scale`, `iter` (updates so far), `last_overflow_iter` (-1 at start) and
//! `hysteresis_left`. On overflow: if the configured hysteresis is 1 or none is left, the
//! scale halves (not below the minimum; already at the minimum is an error or, if so
//! configured, stays with a warning), else one hysteresis is used up; either way
//! `last_overflow_iter = iter`. Without overflow: with `consecutive_hysteresis` the
//! hysteresis refills; `stable = iter - last_overflow_iter - 1`, and when `stable > 0` and
//! `stable % window == 0` the scale doubles (refilling the hysteresis if not consecutive).
//! `iter` then advances in both cases.

/// What to do when an overflow happens at the minimum scale.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AtMinimum {
    /// Stop with [`ScaleError::AtMinimum`] (DeepSpeed's behaviour).
    Error,
    /// Keep the minimum scale, skip the step, and report it for a warning.
    Stay,
}

/// Dynamic loss-scaling settings (DeepSpeed's `fp16` keys, `loss_scale: 0`).
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct DynamicScaleConfig {
    /// The scale starts at `2^initial_scale_power` (DeepSpeed default 16).
    pub initial_scale_power: u32,
    /// Overflow-free updates between doublings (`loss_scale_window`, default 1000).
    pub window: u64,
    /// Overflows tolerated before the scale halves (`hysteresis`, default 2).
    pub hysteresis: u32,
    /// Refill the hysteresis after every overflow-free update (default false).
    pub consecutive_hysteresis: bool,
    /// The smallest scale (`min_loss_scale`, default 1).
    pub min_scale: f64,
    /// What an overflow at the minimum does.
    pub at_minimum: AtMinimum,
}

impl Default for DynamicScaleConfig {
    fn default() -> Self {
        Self {
            initial_scale_power: 16,
            window: 1000,
            hysteresis: 2,
            consecutive_hysteresis: false,
            min_scale: 1.0,
            at_minimum: AtMinimum::Error,
        }
    }
}

/// Errors from loss scaling.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum ScaleError {
    /// Gradients overflowed with the scale already at its minimum.
    #[error(
        "gradients overflowed at update {iteration} with the loss scale already at its minimum ({scale}); \
         the run is diverging (a scaler configured with AtMinimum::Stay keeps going instead)"
    )]
    AtMinimum {
        /// The scale.
        scale: f64,
        /// The update at which it happened.
        iteration: u64,
    },
}

/// The outcome of one [`LossScaler::update`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ScaleDecision {
    /// The step's gradients overflowed: skip the optimizer step and the lr schedule.
    pub skip_step: bool,
    /// The scale before the update.
    pub old_scale: f64,
    /// The scale for the next step.
    pub new_scale: f64,
    /// An overflow happened at the minimum scale in [`AtMinimum::Stay`] mode.
    pub overflow_at_minimum: bool,
}

/// The scaler's state, as saved in checkpoints.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct ScalerState {
    /// Current scale.
    pub scale: f64,
    /// Updates so far.
    pub iter: u64,
    /// The update of the last overflow, -1 if none.
    pub last_overflow_iter: i64,
    /// Overflows left before the scale halves.
    pub hysteresis_left: u32,
}

/// A loss scaler: static (fixed scale) or DeepSpeed's dynamic rule.
#[derive(Debug, Clone, PartialEq)]
pub enum LossScaler {
    /// A fixed scale; overflows still skip the step.
    Static {
        /// The scale.
        scale: f64,
    },
    /// DeepSpeed's dynamic loss scaling.
    Dynamic {
        /// Settings.
        config: DynamicScaleConfig,
        /// State.
        state: ScalerState,
    },
}

impl LossScaler {
    /// A dynamic scaler at its initial state.
    pub fn dynamic(config: DynamicScaleConfig) -> Self {
        let state = ScalerState {
            scale: 2f64.powi(config.initial_scale_power as i32),
            iter: 0,
            last_overflow_iter: -1,
            hysteresis_left: config.hysteresis,
        };
        Self::Dynamic { config, state }
    }

    /// The current scale.
    pub fn scale(&self) -> f64 {
        match self {
            Self::Static { scale } => *scale,
            Self::Dynamic { state, .. } => state.scale,
        }
    }

    /// Records whether this step's gradients overflowed and decides what happens next.
    pub fn update(&mut self, overflow: bool) -> Result<ScaleDecision, ScaleError> {
        let (config, state) = match self {
            Self::Static { scale } => {
                return Ok(ScaleDecision {
                    skip_step: overflow,
                    old_scale: *scale,
                    new_scale: *scale,
                    overflow_at_minimum: false,
                });
            }
            Self::Dynamic { config, state } => (*config, state),
        };
        let old_scale = state.scale;
        let mut overflow_at_minimum = false;
        if overflow {
            if config.hysteresis == 1 || state.hysteresis_left == 1 {
                if state.scale == config.min_scale {
                    match config.at_minimum {
                        AtMinimum::Error => {
                            return Err(ScaleError::AtMinimum { scale: state.scale, iteration: state.iter });
                        }
                        AtMinimum::Stay => overflow_at_minimum = true,
                    }
                }
                state.scale = (state.scale / 2.0).max(config.min_scale);
            } else {
                state.hysteresis_left -= 1;
            }
            state.last_overflow_iter = state.iter as i64;
        } else {
            if config.consecutive_hysteresis {
                state.hysteresis_left = config.hysteresis;
            }
            let stable = state.iter as i64 - state.last_overflow_iter - 1;
            if stable > 0 && (stable as u64).is_multiple_of(config.window) {
                if !config.consecutive_hysteresis {
                    state.hysteresis_left = config.hysteresis;
                }
                state.scale *= 2.0;
            }
        }
        state.iter += 1;
        Ok(ScaleDecision { skip_step: overflow, old_scale, new_scale: state.scale, overflow_at_minimum })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scaler(power: u32, window: u64, hysteresis: u32, consecutive: bool) -> LossScaler {
        LossScaler::dynamic(DynamicScaleConfig {
            initial_scale_power: power,
            window,
            hysteresis,
            consecutive_hysteresis: consecutive,
            ..DynamicScaleConfig::default()
        })
    }

    fn hysteresis_left(s: &LossScaler) -> u32 {
        match s {
            LossScaler::Dynamic { state, .. } => state.hysteresis_left,
            LossScaler::Static { .. } => unreachable!(),
        }
    }

    /// DeepSpeed 0.19.8's `DynamicLossScaler` run on overflow patterns by
    /// `bench/reference/deepspeed_traces.py` (its source, from PyPI, with its checksum):
    /// one `(scale, hysteresis left)` row per update, or the error it raises.
    fn deepspeed_trace(name: &str) -> Vec<serde_json::Value> {
        let text = include_str!(concat!(env!("CARGO_MANIFEST_DIR"), "/../bench/reference/deepspeed_traces.json"));
        let all: serde_json::Value = serde_json::from_str(text).expect("the committed traces parse");
        all["loss_scaler"][name].as_array().expect("a trace").clone()
    }

    /// Replays DeepSpeed's trace `name` (updates whose index is in `overflows` overflow).
    fn replay(name: &str, mut s: LossScaler, overflows: &[usize]) {
        let trace = deepspeed_trace(name);
        assert!(!trace.is_empty(), "{name}");
        for (update, row) in trace.iter().enumerate() {
            let overflow = overflows.contains(&update);
            match (s.update(overflow), row.get("error")) {
                (Err(e), Some(_)) => assert!(matches!(e, ScaleError::AtMinimum { .. }), "{name} {update}: {e}"),
                (Ok(d), None) => {
                    assert_eq!(d.skip_step, overflow, "{name}: update {update}");
                    let want = (row["scale"].as_f64().unwrap(), row["hysteresis"].as_u64().unwrap() as u32);
                    assert_eq!((d.new_scale, hysteresis_left(&s)), want, "{name}: update {update}");
                }
                (got, want) => panic!("{name}: update {update}: zerotrain {got:?}, DeepSpeed {want:?}"),
            }
        }
    }

    /// Init 2^16, window 4, hysteresis 2, min 1: overflows at updates 4, 6, 7, 12, 15.
    #[test]
    fn reproduces_the_golden_trace() {
        replay("golden", scaler(16, 4, 2, false), &[4, 6, 7, 12, 15]);
    }

    #[test]
    fn without_overflow_the_scale_doubles_after_updates_4_8_12() {
        replay("no_overflow", scaler(16, 4, 2, false), &[]);
    }

    /// Overflow, good, overflow, overflow, good: with consecutive hysteresis the good update
    /// refills it, without it the hysteresis used at update 0 is not given back.
    #[test]
    fn consecutive_hysteresis_refills_after_every_good_update() {
        replay("consecutive", scaler(16, 1000, 2, true), &[0, 2, 3]);
        replay("not_consecutive", scaler(16, 1000, 2, false), &[0, 2, 3]);
    }

    #[test]
    fn overflow_at_the_minimum_is_an_error_or_stays_as_configured() {
        replay("at_minimum", scaler(2, 1000, 1, false), &[0, 1, 2, 3]);
        let mut s = scaler(2, 1000, 1, false);
        assert_eq!(s.update(true).unwrap().new_scale, 2.0);
        assert_eq!(s.update(true).unwrap().new_scale, 1.0);
        assert_eq!(s.update(true), Err(ScaleError::AtMinimum { scale: 1.0, iteration: 2 }));

        let mut s = LossScaler::dynamic(DynamicScaleConfig {
            initial_scale_power: 2,
            hysteresis: 1,
            at_minimum: AtMinimum::Stay,
            ..DynamicScaleConfig::default()
        });
        let scales: Vec<(f64, bool)> =
            (0..4).map(|_| s.update(true).unwrap()).map(|d| (d.new_scale, d.overflow_at_minimum)).collect();
        assert_eq!(scales, [(2.0, false), (1.0, false), (1.0, true), (1.0, true)]);
    }

    #[test]
    fn a_static_scale_never_changes_but_overflows_skip() {
        let mut s = LossScaler::Static { scale: 128.0 };
        let d = s.update(true).unwrap();
        assert!(d.skip_step);
        assert_eq!((d.old_scale, d.new_scale), (128.0, 128.0));
        assert!(!s.update(false).unwrap().skip_step);
    }
}
