//! `memory_report()` holds exactly what the ZeRO formulas say, plus padding.

use zerotrain::{Engine, MemoryReport, launch};
use zerotrain_models::Mlp;
use zerotrain_zero::memory::{BytesPerParam, model_state_bytes};
use zerotrain_zero::{FlatLayout, ZeroStage};

use crate::common::*;

const DIMS: [usize; 4] = [6, 24, 24, 6];

/// Each rank's report after one full step, and the layout.
fn report_after_one_step(json: &str, world_size: usize) -> Vec<(MemoryReport, FlatLayout)> {
    let plan = plan(json, world_size);
    launch(&plan, |ctx| {
        let mut engine = Engine::new(fresh(|d| Mlp::new(&DIMS, d)), &plan, &ctx)?;
        let batch = TASK.batch(rank_indices(&plan, 0, 0, ctx.rank()), ctx.device());
        let loss = engine.forward(|m| m.loss(&batch))?;
        engine.backward(loss)?;
        engine.step()?;
        Ok::<_, zerotrain::Error>((engine.memory_report(), engine.sharding().units()[0].layout.clone()))
    })
    .unwrap()
}

#[test]
fn memory_report_equals_the_fp32_adam_formula_plus_padding() {
    for world_size in 1..=4 {
        for stage_index in 0..=3u8 {
            let stage = ZeroStage::from_index(stage_index.into()).unwrap();
            for (rank, (report, layout)) in
                report_after_one_step(&recipe(stage_index, 2, 1, 0.0), world_size).into_iter().enumerate()
            {
                let what = format!("world {world_size} stage {stage_index} rank {rank}");
                let (psi, padded, shard) =
                    (layout.num_elems() as u64, layout.padded_elems() as u64, layout.shard_len() as u64);
                let formula = model_state_bytes(stage, psi, shard, BytesPerParam::FP32_ADAM);
                // Stage 1 reduces its full-size accumulator with reduce-scatter, which needs
                // the padded length; every other kind matches the formula exactly.
                let grads = if stage == ZeroStage::OptimizerStates { 4 * padded } else { formula.grads };
                assert_eq!(report.params, formula.params, "{what}: params");
                assert_eq!(report.grads, grads, "{what}: grads");
                assert_eq!(report.master, 0, "{what}: fp32 parameters are their own master");
                assert_eq!(report.optimizer, formula.optimizer, "{what}: optimizer");
                assert!(padded - psi < 16 * world_size as u64, "{what}: padding beyond one alignment quantum");
                assert_eq!(report.peak_transient, transient_peak(stage_index, psi, padded, shard), "{what}");
            }
        }
    }
}

/// The largest set of transient buffers one fp32 step of one unit holds at once, from the
/// rule (bytes; `psi` elements, `padded` with padding, `shard` per rank, one bucket):
/// - building: the broadcast values and their compute-dtype copy, `8 padded`;
/// - backward: Burn's per-parameter gradients (`4 psi`), plus at stage 1 the
///   reduce-scatter's output shard, at stages 2-3 the bucket (`4 padded`) and its shard;
/// - the step: the optimizer's range in and out (`8 range`), plus the parameters it
///   publishes (stage 0: all `psi`; stages 1-2: the all-gathered `padded`; stage 3: none);
/// - stage 3's gather of the unit (`4 padded`).
fn transient_peak(stage: u8, psi: u64, padded: u64, shard: u64) -> u64 {
    let build = 8 * padded;
    let backward = 4 * psi + [0, 4 * shard, 4 * padded + 4 * shard, 4 * padded + 4 * shard][stage as usize];
    let step = match stage {
        0 => 8 * psi + 4 * psi,
        1 | 2 => 8 * shard + 4 * padded,
        _ => 8 * shard,
    };
    let gather = if stage == 3 { 4 * padded } else { 0 };
    build.max(backward).max(step).max(gather)
}

#[test]
fn stage3_keeps_parameters_under_the_persistence_threshold_resident() {
    let json = recipe(3, 2, 1, 0.0)
        .replace("\"stage3_param_persistence_threshold\": 0", "\"stage3_param_persistence_threshold\": 24");
    for (report, layout) in report_after_one_step(&json, 2) {
        let resident: u64 = layout.entries().iter().filter(|e| e.num_elems <= 24).map(|e| e.num_elems as u64).sum();
        assert_eq!(resident, 24 + 24 + 6, "the three biases");
        assert_eq!(report.params, 4 * layout.shard_len() as u64 + 4 * resident);
    }
}

#[test]
fn stage3_memory_falls_as_one_over_world_size() {
    let per_rank: Vec<u64> =
        (1..=4).map(|n| report_after_one_step(&recipe(3, 2, 1, 0.0), n)[0].0.model_states()).collect();
    // 16 bytes per element of a shard; shards differ from Ψ/N only by padding (< 16 elems).
    for (i, bytes) in per_rank.iter().enumerate() {
        let n = (i + 1) as u64;
        let ideal = per_rank[0] / n;
        assert!(bytes.abs_diff(ideal) < 16 * 16, "world {n}: {bytes} bytes vs {ideal} ideal");
    }
}
