//! A rank that fails makes every other rank fail promptly: no test here may hang.

use std::time::{Duration, Instant};

use zerotrain::app::models::Mlp;
use zerotrain::{Engine, Error, Plan, launch};

use crate::common::*;

/// Trains `steps` steps; `fault(rank, step)` may inject a failure before a step's forward.
fn train_with_fault(
    plan: &Plan,
    steps: u64,
    fault: impl Fn(usize, u64) -> Result<(), String> + Sync,
) -> Result<Vec<()>, Error> {
    launch(plan, |ctx| {
        let mut engine = Engine::new(Mlp::new(&[6, 8, 6], ctx.device()), plan, &ctx)?;
        for step in 0..steps {
            if let Err(message) = fault(ctx.rank(), step) {
                return Err(Box::<dyn std::error::Error + Send + Sync>::from(message));
            }
            let batch = TASK.batch(rank_indices(plan, step, 0, ctx.rank()), ctx.device());
            let loss = engine.forward(|m| m.loss(&batch))?;
            engine.backward(loss)?;
            engine.step()?;
        }
        Ok(())
    })
}

/// A plan whose collectives would wait 10 minutes: only abort propagation can end the test
/// quickly.
fn patient_plan(stage: u8) -> Plan {
    plan(&recipe(stage, 2, 1, 0.0).replace("\"comm_timeout_s\": 60", "\"comm_timeout_s\": 600"), 3)
}

#[test]
fn a_rank_returning_an_error_mid_training_fails_every_rank_at_once() {
    for stage in 0..=3 {
        let start = Instant::now();
        let result = train_with_fault(&patient_plan(stage), 5, |rank, step| {
            if rank == 1 && step == 2 { Err("injected data error".into()) } else { Ok(()) }
        });
        match result {
            Err(Error::Rank { rank: 1, message }) => assert!(message.contains("injected data error"), "{message}"),
            other => panic!("stage {stage}: {other:?}"),
        }
        assert!(start.elapsed() < Duration::from_secs(30), "stage {stage}: took {:?}", start.elapsed());
    }
}

#[test]
fn a_panicking_rank_fails_every_rank_at_once() {
    let start = Instant::now();
    let result = train_with_fault(&patient_plan(2), 5, |rank, step| {
        assert!(!(rank == 2 && step == 1), "injected panic in rank 2");
        Ok(())
    });
    match result {
        Err(Error::RankPanicked { rank: 2, message }) => assert!(message.contains("injected panic"), "{message}"),
        other => panic!("{other:?}"),
    }
    assert!(start.elapsed() < Duration::from_secs(30));
}

#[test]
fn a_rank_that_stops_calling_collectives_times_the_others_out() {
    let json = recipe(1, 2, 1, 0.0).replace("\"comm_timeout_s\": 60", "\"comm_timeout_s\": 0.5");
    let start = Instant::now();
    let plan = plan(&json, 3);
    let result = launch(&plan, |ctx| {
        let mut engine = Engine::new(Mlp::new(&[6, 8, 6], ctx.device()), &plan, &ctx)?;
        if ctx.rank() == 0 {
            return Ok(()); // leaves without training: a hung or vanished rank
        }
        let batch = TASK.batch(rank_indices(&plan, 0, 0, ctx.rank()), ctx.device());
        let loss = engine.forward(|m| m.loss(&batch))?;
        engine.backward(loss)?;
        engine.step()?;
        Ok::<_, Error>(())
    });
    match result {
        Err(Error::Rank { message, .. }) => assert!(message.contains("timed out after 500 ms"), "{message}"),
        other => panic!("{other:?}"),
    }
    assert!(start.elapsed() < Duration::from_secs(20));
}
