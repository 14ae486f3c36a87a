//! A step whose gradients are not finite is skipped on every rank and leaves no trace.

use zerotrain::{Counters, Engine, Error, Plan, launch};
use zerotrain_models::Mlp;

use crate::common::*;

/// Rank 0's counters, per-step skipped flags and final parameters.
type Outcome = (Counters, Vec<bool>, Vec<(String, Vec<f32>)>);

/// Trains on the steps in `data_steps`; at step `poison` (if any) the last rank's loss is
/// multiplied by infinity. Returns rank 0's counters, skipped flags and final parameters.
fn run(plan: &Plan, init: &Mlp, data_steps: &[u64], poison: Option<u64>) -> Outcome {
    let out = launch(plan, |ctx| {
        let mut engine = Engine::new(init.clone(), plan, &ctx)?;
        let mut skipped = Vec::new();
        for &step in data_steps {
            let batch = TASK.batch(rank_indices(plan, step, 0, ctx.rank()), ctx.device());
            let poisoned = poison == Some(step) && ctx.rank() == plan.world_size() - 1;
            let loss = engine.forward(|m| m.loss(&batch))?;
            let loss = if poisoned { loss.mul_scalar(f32::INFINITY) } else { loss };
            engine.backward(loss)?;
            skipped.push(engine.step()?.expect("accumulation 1").skipped);
        }
        Ok::<_, Error>((engine.counters(), skipped, params_by_path(&engine.full_model()?)))
    })
    .unwrap();
    out.into_iter().next().unwrap()
}

#[test]
fn an_overflowing_step_is_skipped_everywhere_and_changes_nothing() {
    let init = seeded(3, |d| Mlp::new(&[6, 16, 6], d));
    for world_size in [2, 3] {
        for stage in 0..=3 {
            let what = format!("world {world_size} stage {stage}");
            let plan = plan(&recipe(stage, 2, 1, 0.05), world_size);
            let (counters, skipped, poisoned) = run(&plan, &init, &[0, 1, 2, 3, 4], Some(2));
            assert_eq!(skipped, [false, false, true, false, false], "{what}");
            assert_eq!((counters.global_steps, counters.skipped_steps), (5, 1), "{what}");
            // The same run without step 2's data: bitwise the same parameters, so neither
            // the parameters, the optimizer state nor the lr schedule saw the bad step.
            let (clean_counters, _, clean) = run(&plan, &init, &[0, 1, 3, 4], None);
            assert_eq!((clean_counters.global_steps, clean_counters.skipped_steps), (4, 0));
            assert!(poisoned == clean, "{what}: the skipped step left a trace");
            assert!(poisoned.iter().all(|(_, v)| v.iter().all(|x| x.is_finite())), "{what}");
        }
    }
}

#[test]
fn with_the_check_off_a_non_finite_step_is_applied() {
    let init = seeded(3, |d| Mlp::new(&[6, 16, 6], d));
    let json = recipe(2, 2, 1, 0.0)
        .replace("\"comm_timeout_s\": 60", "\"comm_timeout_s\": 60, \"check_grad_overflow\": false");
    let plan = plan(&json, 2);
    let (counters, skipped, params) = run(&plan, &init, &[0, 1, 2], Some(1));
    assert_eq!((counters.skipped_steps, skipped), (0, vec![false; 3]));
    assert!(params.iter().any(|(_, v)| v.iter().any(|x| !x.is_finite())), "NaN/inf reached the parameters");
}
