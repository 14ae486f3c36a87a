//! The engine's counters, boundaries, lr sequence and usage errors.

use zerotrain::{Engine, Error, launch};
use zerotrain_models::Mlp;

use crate::common::*;

#[test]
fn step_acts_only_at_accumulation_boundaries_and_counts_like_deepspeed() {
    let plan = plan(&recipe(2, 2, 3, 0.0), 2);
    let lrs = launch(&plan, |ctx| {
        let mut engine = Engine::new(fresh(|d| Mlp::new(&[6, 8, 6], d)), &plan, &ctx)?;
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
                assert_eq!(report.device_reads, 0, "the CPU queues nothing to wait for");
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
        let mut engine = Engine::new(fresh(|d| Mlp::new(&[6, 8, 6], d)), &plan, &ctx)?;
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
        launch(&plan, |ctx| Engine::new(fresh(|d| Mlp::new(&[6, 8, 6], d)), &wrong, &ctx).map(|_| ())).unwrap_err();
    assert!(err.to_string().contains("plan is for 2 ranks, the communicator has 1"), "{err}");
}

#[test]
fn eval_at_stage3_gathers_for_the_call_and_releases_after_it() {
    let plan = plan(&recipe(3, 2, 1, 0.0), 2);
    launch(&plan, |ctx| {
        let mut engine = Engine::new(fresh(|d| Mlp::new(&[6, 8, 6], d)), &plan, &ctx)?;
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
    let init = seeded(9, |d| Mlp::new(&[6, 16, 6], d));
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

/// What the engine does otherwise than a user may believe, it says once, on rank 0's
/// standard error and in `notices()`: each of these ran silently before (issue 22).
#[test]
fn settings_the_chosen_path_ignores_and_surprising_layouts_are_noticed_once() {
    use zerotrain_models::{Gpt, GptConfig};
    let gpt = fresh(|device| {
        Gpt::new(&GptConfig { n_layer: 1, n_head: 2, n_embd: 8, block_size: 4, vocab_size: 7, tied_head: true }, device)
    });
    let json = |stage: u8, checkpointing: bool| {
        let section = if checkpointing { r#""activation_checkpointing": {},"# } else { "" };
        format!(r#"{{ {section} "train_micro_batch_size_per_gpu": 2, "zero_optimization": {{"stage": {stage}}}}}"#)
    };
    let notices = |stage: u8, checkpointing: bool, units: bool, micro: usize| {
        let plan = plan(&json(stage, checkpointing), 1);
        launch(&plan, |ctx| {
            let mut engine = if units {
                Engine::with_units(gpt.clone(), &plan, &ctx)?
            } else {
                Engine::new(gpt.clone(), &plan, &ctx)?
            };
            let tokens: zerotrain_models::LmBatch =
                burn::tensor::Tensor::<2, burn::tensor::Int>::zeros([micro, 5], ctx.device()).into();
            if units {
                engine.forward_backward(&tokens)?;
                engine.step()?;
                engine.forward_backward(&tokens)?;
            }
            Ok::<_, Error>(engine.notices().to_vec())
        })
        .unwrap()
        .swap_remove(0)
    };
    let has = |list: &[String], needle: &str| list.iter().filter(|n| n.contains(needle)).count();
    // activation_checkpointing with Engine::new: ignored, and said so.
    let one_unit = notices(0, true, false, 2);
    assert_eq!(has(&one_unit, "activation_checkpointing is set, but Engine::new"), 1, "{one_unit:?}");
    // Stage 3 in units without checkpointing keeps each unit gathered until its backward.
    let kept = notices(3, false, true, 2);
    assert_eq!(has(&kept, "stage 3 without activation_checkpointing"), 1, "{kept:?}");
    assert_eq!(has(&notices(3, true, true, 2), "stage 3 without"), 0);
    // The tied embedding joins the root on purpose (the GPT lists it as shared): no warning.
    assert_eq!(has(&kept, "no declared unit claims"), 0, "{kept:?}");
    // A micro-batch smaller than the config's, once however often it happens.
    let short = notices(0, false, true, 1);
    assert_eq!(has(&short, "a micro-batch of 1 samples where train_micro_batch_size_per_gpu is 2"), 1, "{short:?}");
    assert_eq!(has(&notices(0, false, true, 2), "a micro-batch of"), 0);
}

/// Regression: a model built without `.autodiff()` was reported only as "no trainable
/// parameters". Such a model now trains (its parameters are configured to train, a setting
/// Burn keeps, and the engine forks them onto the rank's autodiff device); a frozen model's
/// error says why, and a context without autodiff is refused by name.
#[test]
fn a_model_without_gradient_tracking_is_an_error_that_says_why() {
    use burn::nn::LinearConfig;
    let plan = plan(&recipe(0, 2, 1, 0.0), 1);
    let frozen = burn::module::Module::no_grad(fresh(|d| Mlp::new(&[6, 8, 6], d)));
    let err = launch(&plan, |ctx| Engine::new(frozen.clone(), &plan, &ctx).map(|_| ())).unwrap_err().to_string();
    assert!(err.contains("none of its 4 float tensors is set to train (frozen"), "{err}");
    let plain = burn::tensor::Device::flex();
    let layer = fresh(|_| LinearConfig::new(3, 2).init(&plain));
    let trained = launch(&plan, |ctx| Engine::new(layer.clone(), &plan, &ctx).map(|e| e.num_params())).unwrap();
    assert_eq!(trained, vec![3 * 2 + 2], "built on a plain device, configured to train");
    let wrong_ctx = zerotrain::RankContext::new(
        std::sync::Arc::new(zerotrain_zero::ThreadWorld::new(1, std::time::Duration::from_secs(5)).communicator(0)),
        plain.clone(),
    );
    let err = Engine::new(layer, &plan, &wrong_ctx).map(|_| ()).unwrap_err().to_string();
    assert!(err.contains("the rank's device has no autodiff"), "{err}");
}

/// A user's model that declares no tensor-parallel plan (`UnitModel::model_split`) is
/// refused on a mesh, naming the key and what it lacks, rather than trained whole on every
/// tensor rank.
#[test]
fn a_model_without_a_split_is_refused_on_a_mesh() {
    let plan = plan(r#"{"train_batch_size": 2, "tensor_parallel": {"autotp_size": 2}}"#, 2);
    let errors = launch(&plan, |ctx| {
        let mesh = zerotrain::mesh::split(&ctx, &plan)?;
        let model = fresh(|d| Mlp::new(&[6, 8, 6], d));
        Ok::<_, Error>(Engine::with_units(model, &mesh.plan, &mesh.ctx).err().map(|e| e.to_string()))
    })
    .unwrap();
    for error in errors {
        let error = error.expect("the engine trained a model without a split on a tensor-parallel mesh");
        assert!(
            error.contains("no tensor- or sequence-parallel plan") && error.contains("autotp_size is 2"),
            "{error}"
        );
    }
}
