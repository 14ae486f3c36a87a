//! Model-state memory per rank before training: the ZeRO paper's formulas and DeepSpeed's
//! own estimator, side by side (`zerotrain estimate`).

use serde::Serialize;
use zerotrain_zero::ZeroStage;
use zerotrain_zero::memory::{BytesPerParam, model_state_bytes};

/// One stage's per-rank bytes under the ZeRO paper's mixed-precision Adam (K = 12).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct PaperRow {
    /// The stage.
    pub stage: u8,
    /// 16-bit parameters.
    pub params: u64,
    /// 16-bit gradients.
    pub grads: u64,
    /// fp32 master weights and Adam's two moments.
    pub optimizer: u64,
    /// All of it.
    pub total: u64,
}

/// The paper's per-rank model states for `params` over `ranks`, stages 0-3.
pub fn paper(params: u64, ranks: u64) -> Vec<PaperRow> {
    let shard = params.div_ceil(ranks.max(1));
    ZeroStage::ALL
        .iter()
        .map(|&stage| {
            let b = model_state_bytes(stage, params, shard, BytesPerParam::MIXED_ADAM);
            PaperRow {
                stage: stage.index(),
                params: b.params,
                grads: b.grads,
                optimizer: b.master + b.optimizer,
                total: b.total(),
            }
        })
        .collect()
}

/// DeepSpeed's `estimate_zero2_model_states_mem_needs` (deepspeed/runtime/zero/
/// stage_1_and_2.py), reproduced: (per-CPU bytes, per-GPU bytes).
///
/// Without offload each GPU holds 2Ψ (16-bit parameters) + 18Ψ/N (16-bit and 32-bit
/// gradients, 32-bit parameters, Adam's moments); with optimizer offload 2Ψ, and the CPU
/// holds the rest, times `additional_buffer_factor` (1.5 in DeepSpeed).
pub fn deepspeed_zero2(
    params: u64,
    gpus_per_node: u64,
    nodes: u64,
    cpu_offload: bool,
    buffer_factor: f64,
) -> (u64, u64) {
    let gpus = gpus_per_node * nodes;
    let p = params as f64;
    if cpu_offload {
        let cpu = p * (4 * gpus).max(16) as f64 * buffer_factor;
        (cpu as u64, 2 * params)
    } else {
        let cpu = p * 4.0 * gpus_per_node as f64 * buffer_factor;
        (cpu as u64, 2 * params + (18.0 * p / gpus as f64) as u64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reproduces_the_papers_table_1_row() {
        let gb: Vec<f64> = paper(7_500_000_000, 64).iter().map(|r| r.total as f64 / 1e9).collect();
        for (got, want) in gb.iter().zip([120.0, 31.4, 16.6, 1.88]) {
            assert!((got - want).abs() <= 0.005 * want, "{gb:?}");
        }
    }

    /// Against DeepSpeed 0.19.8's own function, run by `bench/reference/deepspeed_traces.py`.
    #[test]
    fn reproduces_deepspeeds_zero2_estimator() {
        let text = include_str!("../bench/reference/deepspeed_traces.json");
        let all: serde_json::Value = serde_json::from_str(text).expect("the committed traces parse");
        let cases = all["zero2_estimates"].as_array().expect("estimates");
        assert!(cases.len() >= 6);
        for case in cases {
            let n = |key: &str| case[key].as_u64().unwrap();
            let got = deepspeed_zero2(n("params"), n("gpus_per_node"), n("nodes"), case["offload"] == true, 1.5);
            assert_eq!(got, (n("cpu_bytes"), n("gpu_bytes")), "{case}");
        }
    }
}
