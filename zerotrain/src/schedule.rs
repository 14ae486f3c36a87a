//! DeepSpeed's learning-rate schedules, value for value.
//!
//! # Note: the iteration convention
//! DeepSpeed constructs a scheduler with `last_batch_iteration = -1`, which already sets the
//! optimizer's lr, and calls `scheduler.step()` after every optimizer step. So optimizer step
//! `k` (0-based) runs with `lr(k - 1)`: the first step uses the schedule's value at -1
//! (`warmup_min_lr` for the warmup schedules, 0 for WarmupCosineLR, `cycle_min_lr` for
//! OneCycle). [`LrSchedule::lr`] takes that `last_batch_iteration`, and the engine keeps it.
//! A step skipped for overflow does not advance it.

use std::f64::consts::PI;

/// How the warmup phase rises.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum WarmupType {
    /// `log(i + 1) / log(warmup_num_steps)` (DeepSpeed's default).
    Log,
    /// `i / warmup_num_steps`.
    Linear,
}

impl WarmupType {
    /// The warmup fraction at iteration `i` (`0 <= i < steps`), `steps >= 2`.
    fn gamma(self, i: i64, steps: u64) -> f64 {
        match self {
            Self::Log => (1.0 / (steps as f64).ln()) * ((i + 1) as f64).ln(),
            Self::Linear => i as f64 / steps as f64,
        }
    }
}

/// A resolved learning-rate schedule (DeepSpeed's `scheduler` section).
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
#[serde(tag = "type")]
pub enum LrSchedule {
    /// No scheduler: the optimizer's `lr` throughout.
    Constant {
        /// The learning rate.
        lr: f64,
    },
    /// Warm up from `min_lr` to `max_lr` over `warmup_num_steps`, then hold.
    WarmupLR {
        /// `warmup_min_lr`.
        min_lr: f64,
        /// `warmup_max_lr`.
        max_lr: f64,
        /// `warmup_num_steps`, at least 2 (DeepSpeed raises smaller values to 2).
        warmup_num_steps: u64,
        /// `warmup_type`.
        warmup_type: WarmupType,
    },
    /// WarmupLR, then linear decay to 0 at `total_num_steps`.
    WarmupDecayLR {
        /// `warmup_min_lr`.
        min_lr: f64,
        /// `warmup_max_lr`.
        max_lr: f64,
        /// `warmup_num_steps`, at least 2.
        warmup_num_steps: u64,
        /// `warmup_type`.
        warmup_type: WarmupType,
        /// `total_num_steps`.
        total_num_steps: u64,
    },
    /// Warm up the ratio from `warmup_min_ratio` to 1, then cosine-decay to `cos_min_ratio`;
    /// the lr is the optimizer's `lr` times the ratio.
    WarmupCosineLR {
        /// The optimizer's lr.
        base_lr: f64,
        /// `warmup_min_ratio`.
        warmup_min_ratio: f64,
        /// `warmup_num_steps`, at least 2.
        warmup_num_steps: u64,
        /// `cos_min_ratio`.
        cos_min_ratio: f64,
        /// `warmup_type`.
        warmup_type: WarmupType,
        /// `total_num_steps`.
        total_num_steps: u64,
    },
    /// The 1cycle policy: up from `cycle_min_lr` to `cycle_max_lr` and back, then decay.
    OneCycle {
        /// `cycle_min_lr`.
        cycle_min_lr: f64,
        /// `cycle_max_lr`.
        cycle_max_lr: f64,
        /// `decay_lr_rate` (0: hold `cycle_min_lr` after the cycle).
        decay_lr_rate: f64,
        /// `cycle_first_step_size`.
        cycle_first_step_size: u64,
        /// `cycle_second_step_size` (defaults to the first).
        cycle_second_step_size: u64,
        /// `cycle_first_stair_count` (0: continuous).
        cycle_first_stair_count: u64,
        /// `cycle_second_stair_count` (defaults to the first).
        cycle_second_stair_count: u64,
        /// `decay_step_size` (0: no decay).
        decay_step_size: u64,
    },
}

impl LrSchedule {
    /// The learning rate DeepSpeed sets after `scheduler.step()` has brought
    /// `last_batch_iteration` to `iteration` (see the module note; -1 is the initial value).
    pub fn lr(&self, iteration: i64) -> f64 {
        match *self {
            Self::Constant { lr } => lr,
            Self::WarmupLR { min_lr, max_lr, warmup_num_steps, warmup_type } => {
                if iteration < 0 {
                    return min_lr;
                }
                let gamma = if iteration < warmup_num_steps as i64 {
                    warmup_type.gamma(iteration, warmup_num_steps)
                } else {
                    1.0
                };
                min_lr + (max_lr - min_lr) * gamma
            }
            Self::WarmupDecayLR { min_lr, max_lr, warmup_num_steps, warmup_type, total_num_steps } => {
                if iteration < 0 {
                    return min_lr;
                }
                let gamma = if iteration < warmup_num_steps as i64 {
                    warmup_type.gamma(iteration, warmup_num_steps)
                } else {
                    let span = (total_num_steps as f64 - warmup_num_steps as f64).max(1.0);
                    ((total_num_steps as f64 - iteration as f64) / span).max(0.0)
                };
                min_lr + (max_lr - min_lr) * gamma
            }
            Self::WarmupCosineLR {
                base_lr,
                warmup_min_ratio,
                warmup_num_steps,
                cos_min_ratio,
                warmup_type,
                total_num_steps,
            } => {
                base_lr
                    * cosine_ratio(
                        iteration,
                        warmup_min_ratio,
                        warmup_num_steps,
                        cos_min_ratio,
                        warmup_type,
                        total_num_steps,
                    )
            }
            Self::OneCycle { .. } => self.one_cycle_lr(iteration),
        }
    }

    fn one_cycle_lr(&self, iteration: i64) -> f64 {
        let Self::OneCycle {
            cycle_min_lr,
            cycle_max_lr,
            decay_lr_rate,
            cycle_first_step_size,
            cycle_second_step_size,
            cycle_first_stair_count,
            cycle_second_stair_count,
            decay_step_size,
        } = *self
        else {
            unreachable!("one_cycle_lr is only called on OneCycle")
        };
        if iteration < 0 {
            return cycle_min_lr;
        }
        let first = cycle_first_step_size as f64;
        let total = first + cycle_second_step_size as f64;
        if (iteration as f64) < total {
            let batch = (iteration + 1) as f64;
            let step_ratio = first / total;
            let cycle = (1.0 + batch / total).floor();
            let x = 1.0 + batch / total - cycle;
            let (mut scale, stairs) = if x <= step_ratio {
                (x / step_ratio, cycle_first_stair_count)
            } else {
                ((x - 1.0) / (step_ratio - 1.0), cycle_second_stair_count)
            };
            if stairs > 0 {
                let in_cycle = batch % total;
                let position = if in_cycle <= first {
                    in_cycle * stairs as f64 / first
                } else {
                    (total - in_cycle) * stairs as f64 / cycle_second_step_size as f64
                };
                scale = position.floor() / stairs as f64;
            }
            return cycle_min_lr + (cycle_max_lr - cycle_min_lr) * scale;
        }
        if decay_step_size == 0 || decay_lr_rate == 0.0 {
            return cycle_min_lr;
        }
        let decay_iteration = (iteration as f64) - total + 1.0;
        cycle_min_lr / (1.0 + decay_lr_rate * decay_iteration / decay_step_size as f64)
    }
}

fn cosine_ratio(
    iteration: i64,
    warmup_min_ratio: f64,
    warmup_num_steps: u64,
    cos_min_ratio: f64,
    warmup_type: WarmupType,
    total_num_steps: u64,
) -> f64 {
    if iteration < 0 {
        return 0.0;
    }
    if iteration < warmup_num_steps as i64 {
        let ratio = warmup_type.gamma(iteration, warmup_num_steps);
        return warmup_min_ratio + ratio * (1.0 - warmup_min_ratio);
    }
    let done = (iteration - warmup_num_steps as i64 + 1) as f64;
    let span = total_num_steps.saturating_sub(warmup_num_steps).max(1) as f64;
    let progress = (done / span).min(1.0);
    let ratio = (1.0 + (PI * progress).cos()) / 2.0;
    (cos_min_ratio + (1.0 - cos_min_ratio) * ratio).max(0.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Expected values are DeepSpeed 0.19.8's own `lr_schedules.py` run by
    /// `bench/reference/deepspeed_traces.py` (the source from PyPI, checked by its sha256):
    /// the lr each schedule leaves in the optimizer at iterations -1, 0, 1, 2, 5, 9, 10, 15.
    fn check(s: &LrSchedule, name: &str) {
        let text = include_str!("../../bench/reference/deepspeed_traces.json");
        let all: serde_json::Value = serde_json::from_str(text).expect("the committed traces parse");
        let iters = all["iterations"].as_array().expect("iterations");
        let values = all["schedules"][name].as_array().unwrap_or_else(|| panic!("no trace {name}"));
        assert_eq!(iters.len(), values.len());
        for (i, want) in iters.iter().zip(values) {
            let (i, want) = (i.as_i64().unwrap(), want.as_f64().unwrap());
            let got = s.lr(i);
            assert!((got - want).abs() <= 1e-12 * want.abs().max(1e-3), "{name} at {i}: {got} != DeepSpeed's {want}");
        }
    }

    #[test]
    fn warmup_lr_log_and_linear() {
        let log =
            LrSchedule::WarmupLR { min_lr: 1e-4, max_lr: 1e-2, warmup_num_steps: 10, warmup_type: WarmupType::Log };
        check(&log, "warmup_log");
        let lin =
            LrSchedule::WarmupLR { min_lr: 0.0, max_lr: 1.0, warmup_num_steps: 10, warmup_type: WarmupType::Linear };
        check(&lin, "warmup_linear");
    }

    #[test]
    fn warmup_decay_lr_decays_linearly_to_zero() {
        let s = LrSchedule::WarmupDecayLR {
            min_lr: 0.0,
            max_lr: 1.0,
            warmup_num_steps: 4,
            warmup_type: WarmupType::Linear,
            total_num_steps: 12,
        };
        check(&s, "warmup_decay");
    }

    #[test]
    fn warmup_cosine_lr() {
        let s = LrSchedule::WarmupCosineLR {
            base_lr: 0.5,
            warmup_min_ratio: 0.1,
            warmup_num_steps: 4,
            cos_min_ratio: 0.01,
            warmup_type: WarmupType::Linear,
            total_num_steps: 12,
        };
        check(&s, "warmup_cosine");
    }

    #[test]
    fn one_cycle_with_and_without_stairs_and_decay() {
        let cycle = |first_stairs, second_stairs, decay_step_size| LrSchedule::OneCycle {
            cycle_min_lr: 0.1,
            cycle_max_lr: 1.0,
            decay_lr_rate: 0.5,
            cycle_first_step_size: 4,
            cycle_second_step_size: 6,
            cycle_first_stair_count: first_stairs,
            cycle_second_stair_count: second_stairs,
            decay_step_size,
        };
        check(&cycle(0, 0, 2), "one_cycle_smooth");
        check(&cycle(2, 3, 0), "one_cycle_stairs");
    }
}
