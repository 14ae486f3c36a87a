//! The engine's counters, boundaries, lr sequence and usage errors.

use zerotrain::app::models::Mlp;
use zerotrain::{Engine, Error, launch};

use crate::common::*;

#[test]
fn step_acts_only_at_accumulation_boundaries_and_counts_like_deepspeed() {
    let plan = plan(&recipe(2, 2, 3, 0.0), 2);
    let lrs = launch(&plan, |ctx| {
        let mut engine = Engine::new(Mlp::new(&[6, 8, 6], ctx.device()), &plan, &ctx)?;
        assert_eq!(engine.get_global_grad_norm(), None);
        let mut lrs = vec![engine.get_lr()];
        for micro in 0..9u64 {
            let batch = TASK.batch(rank_indices(&plan, micro / 3, micro % 3, ctx.rank()), ctx.device());
            let loss = engine.forward(|m| m.loss(&batch))?;
            engine.backward(loss)?;
            let boundary = engine.is_gradient_accumulation_boundary();
            let report = engine.step()?;
            assert_eq!(report.is_some(), boundary);
            assert_eq!(boundary, micro % 3 == 2, "micro-step {micro}");
            if let Some(report) = report {
                assert_eq!(report.lr, *lrs.last().unwrap(), "a step runs at the lr get_lr() announced");
                assert!(report.loss.is_finite() && report.grad_norm > 0.0);
                assert_eq!(engine.get_global_grad_norm(), Some(report.grad_norm));
                assert_eq!(engine.last_step(), Some(report));
                lrs.push(engine.get_lr());
            }
        }
        let c = engine.counters();
        assert_eq!((c.global_steps, c.micro_steps, c.skipped_steps, c.global_samples), (3, 9, 0, 3 * 12));
        Ok::<_, Error>(lrs)
    })
    .unwrap();
    // WarmupLR linear, min 0.001, max 0.01 over 3 steps; DeepSpeed's iteration -1 first.
    let expected = [0.001, 0.001, 0.004, 0.007];
    for (got, want) in lrs[0].iter().zip(expected) {
        assert!((got - want).abs() < 1e-12, "{:?}", lrs[0]);
    }
}

#[test]
fn usage_errors_are_errors_not_panics() {
    let plan = plan(&recipe(0, 2, 1, 0.0), 1);
    launch(&plan, |ctx| {
        let mut engine = Engine::new(Mlp::new(&[6, 8, 6], ctx.device()), &plan, &ctx)?;
        assert!(matches!(engine.step(), Err(Error::Usage(m)) if m.contains("without a backward")));
        let batch = TASK.batch(0..2, ctx.device());
        let per_sample =
            engine.forward(|m| m.forward(batch.input.clone().reshape([10, 6])).sum_dim(1).reshape([10]))?;
        assert!(matches!(engine.backward(per_sample), Err(Error::Usage(m)) if m.contains("one-element loss")));
        Ok::<_, Error>(())
    })
    .unwrap();
    let wrong = super::common::plan(&recipe(0, 2, 1, 0.0), 2);
    let err =
        launch(&plan, |ctx| Engine::new(Mlp::new(&[6, 8, 6], ctx.device()), &wrong, &ctx).map(|_| ())).unwrap_err();
    assert!(err.to_string().contains("plan is for 2 ranks, the communicator has 1"), "{err}");
}

#[test]
fn eval_at_stage3_gathers_for_the_call_and_releases_after_it() {
    let plan = plan(&recipe(3, 2, 1, 0.0), 2);
    launch(&plan, |ctx| {
        let mut engine = Engine::new(Mlp::new(&[6, 8, 6], ctx.device()), &plan, &ctx)?;
        let released = engine.memory_report().params;
        assert_eq!(released, 4 * engine.sharding().units()[0].layout.shard_len() as u64);
        let batch = TASK.batch(0..4, ctx.device());
        let evaluated = engine.eval(|m| m.loss(&batch).into_scalar::<f32>())?;
        assert_eq!(engine.memory_report().params, released, "eval must release what it gathered");
        let trained = engine.forward(|m| m.loss(&batch))?;
        assert_eq!(trained.clone().into_scalar::<f32>(), evaluated);
        assert_eq!(
            engine.memory_report().params,
            released + 4 * engine.sharding().units()[0].layout.num_elems() as u64,
            "forward keeps the model for backward"
        );
        engine.backward(trained)?;
        assert_eq!(engine.memory_report().params, released, "backward releases");
        Ok::<_, Error>(())
    })
    .unwrap();
}

/// Regression: at stage 3, a forward between the last backward and `step` gathered the
/// pre-step weights, and they stayed gathered: the next step's forward trained on them.
#[test]
fn a_forward_before_step_does_not_leave_stale_weights_at_stage_3() {
    let plan = plan(&recipe(3, 2, 1, 0.0), 2);
    let device = burn::tensor::Device::flex().autodiff();
    device.seed(9);
    let init = Mlp::new(&[6, 16, 6], &device);
    let run = |extra_forward: bool| {
        launch(&plan, |ctx| {
            let mut engine = Engine::new(init.clone(), &plan, &ctx)?;
            let mut losses = Vec::new();
            for step in 0..4 {
                let batch = TASK.batch(rank_indices(&plan, step, 0, ctx.rank()), ctx.device());
                let loss = engine.forward(|m| m.loss(&batch))?;
                engine.backward(loss)?;
                if extra_forward {
                    engine.forward(|m| m.loss(&batch))?; // e.g. logging, discarded
                }
                losses.push(engine.step()?.expect("boundary").loss);
            }
            Ok::<_, Error>((losses, engine.master_params()?))
        })
        .unwrap()
        .swap_remove(0)
    };
    assert_eq!(run(true), run(false), "losses and masters equal the run without the extra forward");
}
