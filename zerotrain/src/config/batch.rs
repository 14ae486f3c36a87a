//! Batch sizes: DeepSpeed's rule `train_batch_size = micro x accumulation x data-parallel
//! ranks`, any two giving the third.

use serde::Serialize;

use super::autos::{Autos, count};
use super::value::AutoOr;
use super::{Config, ConfigError};

/// Largest `train_micro_batch_size_per_gpu`: samples one rank holds at once; beyond a
/// million it is a typo, and a batch that size would fail to allocate rather than train.
pub const MAX_MICRO_BATCH: u64 = 1 << 20;
/// Largest `gradient_accumulation_steps`.
pub const MAX_ACCUMULATION_STEPS: u64 = 1 << 20;

/// Batch sizes after DeepSpeed's rule: `train_batch_size = micro x accumulation x world`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct BatchPlan {
    /// Samples per optimizer step over all ranks.
    pub train_batch_size: u64,
    /// Samples per rank per micro-step.
    pub micro_batch_per_rank: u64,
    /// Micro-steps per optimizer step.
    pub gradient_accumulation_steps: u64,
}

impl BatchPlan {
    /// Applies DeepSpeed's rule: any two of the three sizes give the third; all three must
    /// agree; with only one of train/micro, accumulation is 1. `None` means absent.
    pub fn derive(
        train: Option<u64>,
        micro: Option<u64>,
        gas: Option<u64>,
        world_size: u64,
    ) -> Result<Self, ConfigError> {
        let mismatch = || ConfigError::BatchMismatch {
            train_batch_size: train,
            micro_batch_per_rank: micro,
            gradient_accumulation_steps: gas,
            world_size,
        };
        if [train, micro, gas].contains(&Some(0)) {
            return Err(mismatch());
        }
        // Checked arithmetic throughout: a product beyond u64 is a mismatch, not a panic.
        let mul = |a: u64, b: u64| a.checked_mul(b).ok_or_else(mismatch);
        let divide = |num: u64, den: u64| num.is_multiple_of(den).then_some(num / den).ok_or_else(mismatch);
        let (t, m, g) = match (train, micro, gas) {
            (Some(t), Some(m), Some(g)) => (t, m, g),
            (Some(t), Some(m), None) => (t, m, divide(t, mul(m, world_size)?)?),
            (Some(t), None, Some(g)) => (t, divide(t, mul(g, world_size)?)?, g),
            (None, Some(m), Some(g)) => (mul(mul(m, g)?, world_size)?, m, g),
            (Some(t), None, None) => (t, divide(t, world_size)?, 1),
            (None, Some(m), None) => (mul(m, world_size)?, m, 1),
            (None, None, _) => return Err(ConfigError::MissingBatchSize),
        };
        if Some(t) != m.checked_mul(g).and_then(|mg| mg.checked_mul(world_size)) {
            return Err(mismatch());
        }
        for (key, value, limit) in [
            ("train_micro_batch_size_per_gpu", m, MAX_MICRO_BATCH),
            ("gradient_accumulation_steps", g, MAX_ACCUMULATION_STEPS),
        ] {
            if value > limit {
                return Err(ConfigError::InvalidValue {
                    origin: "config".into(),
                    key: key.into(),
                    message: format!("{value} is more than the {limit} zerotrain accepts"),
                });
            }
        }
        Ok(Self { train_batch_size: t, micro_batch_per_rank: m, gradient_accumulation_steps: g })
    }
}

/// The three batch keys over `data_parallel` ranks, each `"auto"` noted.
pub(super) fn resolve(config: &Config, data_parallel: u64, autos: &mut Autos) -> Result<BatchPlan, ConfigError> {
    let raw = &config.raw;
    let (t, m, g) = (raw.train_batch_size, raw.train_micro_batch_size_per_gpu, raw.gradient_accumulation_steps);
    let mut micro = count(m);
    // "auto" means "you decide": with no concrete train or micro size, micro defaults to 1.
    let all_auto_or_absent = count(t).is_none() && micro.is_none();
    if all_auto_or_absent && (t == Some(AutoOr::Auto) || m == Some(AutoOr::Auto)) {
        autos.note("train_micro_batch_size_per_gpu = 1 (no batch size given)".into());
        micro = Some(1);
    }
    let batch = BatchPlan::derive(count(t), micro, count(g), data_parallel)?;
    let derived = [
        ("train_batch_size", t, batch.train_batch_size),
        ("train_micro_batch_size_per_gpu", m, batch.micro_batch_per_rank),
        ("gradient_accumulation_steps", g, batch.gradient_accumulation_steps),
    ];
    for (key, v, got) in derived {
        if v == Some(AutoOr::Auto) {
            autos.note(format!("{key} = {got} (derived from the other batch sizes)"));
        }
    }
    Ok(batch)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn any_two_batch_sizes_give_the_third() {
        let p = |t, m, g| {
            BatchPlan::derive(t, m, g, 4)
                .map(|b| (b.train_batch_size, b.micro_batch_per_rank, b.gradient_accumulation_steps))
        };
        assert_eq!(p(Some(32), Some(2), None).unwrap(), (32, 2, 4));
        assert_eq!(p(Some(32), None, Some(2)).unwrap(), (32, 4, 2));
        assert_eq!(p(None, Some(2), Some(3)).unwrap(), (24, 2, 3));
        assert_eq!(p(Some(32), Some(2), Some(4)).unwrap(), (32, 2, 4));
        assert_eq!(p(Some(8), None, None).unwrap(), (8, 2, 1));
        assert_eq!(p(None, Some(3), None).unwrap(), (12, 3, 1));
    }

    #[test]
    fn inconsistent_batch_sizes_name_all_four_numbers() {
        let err = BatchPlan::derive(Some(32), Some(2), Some(3), 4).unwrap_err().to_string();
        for needle in [
            "train_batch_size (32)",
            "train_micro_batch_size_per_gpu (2)",
            "gradient_accumulation_steps (3)",
            "world size (4)",
        ] {
            assert!(err.contains(needle), "{err}");
        }
        let err = BatchPlan::derive(Some(30), Some(4), None, 4).unwrap_err().to_string();
        assert!(
            err.contains("train_batch_size (30)") && err.contains("gradient_accumulation_steps (not set)"),
            "{err}"
        );
        assert!(matches!(BatchPlan::derive(None, None, Some(2), 1), Err(ConfigError::MissingBatchSize)));
        assert!(BatchPlan::derive(Some(0), None, None, 1).is_err());
    }
}
