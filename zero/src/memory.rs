//! Model-state memory per rank, by the ZeRO paper's formulas.
//!
//! With Ψ parameters over N ranks and per-parameter byte costs for parameters, gradients,
//! master weights and optimizer state, each stage keeps the sharded kinds for Ψ/N elements
//! and the rest for Ψ. Mixed-precision Adam (2, 2, 4, 8 bytes): DP 16Ψ, stage 1 4Ψ+12Ψ/N,
//! stage 2 2Ψ+14Ψ/N, stage 3 16Ψ/N. fp32 Adam, whose parameters are their own master
//! (4, 4, 0, 8): 16Ψ, 8Ψ+8Ψ/N, 4Ψ+12Ψ/N, 16Ψ/N.

use crate::ZeroStage;

/// Bytes per parameter of each kind of model state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BytesPerParam {
    /// The parameter as the model computes with it.
    pub param: u64,
    /// Its gradient.
    pub grad: u64,
    /// A separate fp32 master copy (0 when the parameters are fp32).
    pub master: u64,
    /// Optimizer state (Adam: 8, SGD with momentum: 4).
    pub optimizer: u64,
}

impl BytesPerParam {
    /// fp32 training with Adam.
    pub const FP32_ADAM: Self = Self { param: 4, grad: 4, master: 0, optimizer: 8 };
    /// fp16/bf16 training with Adam (the paper's K = 12).
    pub const MIXED_ADAM: Self = Self { param: 2, grad: 2, master: 4, optimizer: 8 };
}

/// Model-state bytes held by one rank, by kind.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ModelStateBytes {
    /// Parameters.
    pub params: u64,
    /// Gradients (accumulators).
    pub grads: u64,
    /// fp32 master weights.
    pub master: u64,
    /// Optimizer state.
    pub optimizer: u64,
}

impl ModelStateBytes {
    /// All kinds together.
    pub fn total(&self) -> u64 {
        self.params + self.grads + self.master + self.optimizer
    }
}

/// Bytes one rank holds at `stage` for `full_elems` parameters whose shard is `shard_elems`
/// (Ψ/N rounded up, or the padded shard length).
pub fn model_state_bytes(stage: ZeroStage, full_elems: u64, shard_elems: u64, cost: BytesPerParam) -> ModelStateBytes {
    let pick = |sharded: bool| if sharded { shard_elems } else { full_elems };
    ModelStateBytes {
        params: cost.param * pick(stage.shards_parameters()),
        grads: cost.grad * pick(stage.shards_gradients()),
        master: cost.master * pick(stage.shards_optimizer_states()),
        optimizer: cost.optimizer * pick(stage.shards_optimizer_states()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The ZeRO paper's Table 1 row: Ψ = 7.5B, N = 64, mixed-precision Adam.
    #[test]
    fn reproduces_the_papers_table_1_row() {
        let psi = 7_500_000_000u64;
        let gb: Vec<f64> = ZeroStage::ALL
            .iter()
            .map(|&s| model_state_bytes(s, psi, psi / 64, BytesPerParam::MIXED_ADAM).total() as f64 / 1e9)
            .collect();
        let expected = [120.0, 31.4, 16.6, 1.88];
        for (got, want) in gb.iter().zip(expected) {
            assert!((got - want).abs() / want < 0.01, "{gb:?}");
        }
    }

    #[test]
    fn fp32_adam_formulas() {
        let (psi, n) = (1200u64, 4u64);
        let totals: Vec<u64> = ZeroStage::ALL
            .iter()
            .map(|&s| model_state_bytes(s, psi, psi / n, BytesPerParam::FP32_ADAM).total())
            .collect();
        assert_eq!(totals, [16 * psi, 8 * psi + 8 * psi / n, 4 * psi + 12 * psi / n, 16 * psi / n]);
    }
}
