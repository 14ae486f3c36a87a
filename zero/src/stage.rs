//! What each ZeRO stage partitions. Code asks these questions instead of comparing stage
//! numbers, so optimizer state, gradients and parameters each have one place that decides.

/// A ZeRO stage (DeepSpeed's `zero_optimization.stage`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum ZeroStage {
    /// Plain data parallelism: everything replicated, gradients all-reduced.
    Disabled,
    /// ZeRO-1: optimizer state (and master weights) partitioned.
    OptimizerStates,
    /// ZeRO-2: optimizer state and gradients partitioned.
    Gradients,
    /// ZeRO-3: optimizer state, gradients and parameters partitioned.
    Parameters,
}

impl ZeroStage {
    /// All stages, in order.
    pub const ALL: [ZeroStage; 4] = [Self::Disabled, Self::OptimizerStates, Self::Gradients, Self::Parameters];

    /// The stage for DeepSpeed's numeric `stage`, if it is 0..=3.
    pub fn from_index(stage: u64) -> Option<Self> {
        Self::ALL.get(usize::try_from(stage).ok()?).copied()
    }

    /// DeepSpeed's numeric stage.
    pub fn index(self) -> u8 {
        self as u8
    }

    /// Each rank keeps optimizer state (and master weights) for its shard only.
    pub fn shards_optimizer_states(self) -> bool {
        self >= Self::OptimizerStates
    }

    /// Each rank keeps the reduced gradient for its shard only, reduce-scattered every
    /// micro-step.
    pub fn shards_gradients(self) -> bool {
        self >= Self::Gradients
    }

    /// Each rank keeps only its parameter shard between steps.
    pub fn shards_parameters(self) -> bool {
        self >= Self::Parameters
    }
}

impl std::fmt::Display for ZeroStage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let what = match self {
            Self::Disabled => "data parallel, nothing sharded",
            Self::OptimizerStates => "optimizer states sharded",
            Self::Gradients => "optimizer states and gradients sharded",
            Self::Parameters => "optimizer states, gradients and parameters sharded",
        };
        write!(f, "stage {} ({what})", self.index())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_stage_shards_what_the_paper_says() {
        let table: Vec<_> = ZeroStage::ALL
            .iter()
            .map(|s| (s.shards_optimizer_states(), s.shards_gradients(), s.shards_parameters()))
            .collect();
        assert_eq!(table, [(false, false, false), (true, false, false), (true, true, false), (true, true, true)]);
        assert_eq!(ZeroStage::from_index(2), Some(ZeroStage::Gradients));
        assert_eq!(ZeroStage::from_index(4), None);
    }
}
