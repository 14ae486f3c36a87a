//! Bytes communicated per step equal the stage's theoretical volume exactly.

use zerotrain::{Engine, Error, launch};
use zerotrain_models::Mlp;

use crate::common::*;

#[test]
fn bytes_per_step_equal_each_stages_collectives() {
    for world_size in [2, 3] {
        for gas in [1u64, 3] {
            for stage in 0..=3u8 {
                let plan = plan(&recipe(stage, 2, gas, 0.0), world_size);
                let per_rank = launch(&plan, |ctx| {
                    let mut engine = Engine::new(fresh(|d| Mlp::new(&[6, 24, 24, 6], d)), &plan, &ctx)?;
                    let mut bytes = Vec::new();
                    for step in 0..2 {
                        for micro in 0..gas {
                            let batch = TASK.batch(rank_indices(&plan, step, micro, ctx.rank()), ctx.device());
                            let loss = engine.forward(|m| m.loss(&batch))?;
                            engine.backward(loss)?;
                            if let Some(r) = engine.step()? {
                                bytes.push(r.comm_bytes);
                            }
                        }
                    }
                    Ok::<_, Error>((bytes, engine.sharding().units()[0].layout.clone()))
                })
                .unwrap();
                for (rank, (bytes, layout)) in per_rank.iter().enumerate() {
                    let (n, psi, padded) = (world_size, layout.num_elems(), layout.padded_elems());
                    // The ring algorithms' per-rank volumes, written from their definition:
                    // reduce-scatter and all-gather of P padded elements receive P (N-1)/N;
                    // an all-reduce of L elements reduces this rank's chunk from N-1 peers
                    // and fetches the other chunks (the first L % N chunks one longer).
                    let ring = |elems: usize| (elems / n * (n - 1) * 4) as u64;
                    let all_reduce = |len: usize| {
                        let own = len / n + usize::from(rank < len % n);
                        ((len - own + (n - 1) * own) * 4) as u64
                    };
                    let (rs, ag) = (ring(padded), ring(padded));
                    let metrics = all_reduce(n + 1);
                    let expected = metrics
                        + match stage {
                            0 => all_reduce(psi),
                            1 => rs + ag,
                            2 => gas * rs + ag,
                            _ => gas * (ag + rs),
                        };
                    assert_eq!(bytes, &vec![expected; 2], "world {n} stage {stage} gas {gas} rank {rank}");
                    // The data volume itself is the ZeRO paper's: 2Ψ per step (stage 3: per micro-step).
                    let two_psi = 2 * (padded * 4 * (n - 1) / n) as u64;
                    let data = expected - metrics;
                    match stage {
                        0 => assert!(data.abs_diff(two_psi) <= 2 * 4 * 16 * n as u64),
                        1 => assert_eq!(data, two_psi),
                        2 => assert_eq!(data, (gas + 1) * two_psi / 2),
                        _ => assert_eq!(data, gas * two_psi),
                    }
                }
            }
        }
    }
}
