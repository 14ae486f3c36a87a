//! Engine behaviour that needs its internals: a failing optimizer step.

use std::sync::Arc;
use std::time::Duration;

use burn::module::Module;
use burn::nn::{Linear, LinearConfig};
use burn::tensor::{Device, FloatDType, Tensor, TensorData};
use zerotrain_zero::ThreadWorld;

use super::optimizer::{ExportedState, ShardOptimizer};
use crate::nn::parallel::{ParallelGroup, Split, split_module};
use crate::{Config, Engine, Error, Overrides, RankContext};

#[derive(Module, Debug)]
struct Net {
    layer: Linear,
}

/// An optimizer whose step fails, as a step may (a conversion error, a device error).
struct Failing;

impl ShardOptimizer for Failing {
    fn step(&mut self, _: f64, _: Tensor<1>, _: Tensor<1>) -> crate::Result<Tensor<1>> {
        Err(Error::Model("injected optimizer failure".into()))
    }
    fn state_bytes(&self) -> u64 {
        0
    }
    fn export(&self) -> ExportedState {
        (Vec::new(), Vec::new())
    }
    fn import(&mut self, _: ExportedState, _: &Device) -> crate::Result<()> {
        Ok(())
    }
}

/// Regression: a failed optimizer step left the rank's only fp32 copy (mixed precision,
/// stage 3) moved out; a later save then panicked on the empty shard. Now every later use
/// is an error that says what happened: the rank is torn (`step.rs`'s note), which comes
/// before the unit's own finding that its masters are gone.
#[test]
fn a_failed_optimizer_step_makes_later_uses_errors_not_panics_or_empty_checkpoints() {
    for (stage, bf16) in [(3, false), (2, true), (0, true)] {
        let json = format!(
            r#"{{"train_micro_batch_size_per_gpu": 2, "zero_optimization": {{"stage": {stage}}},
                "bf16": {{"enabled": {bf16}}}}}"#
        );
        let plan = Config::parse(&json, "t").unwrap().resolve(Overrides::default()).unwrap();
        let world = ThreadWorld::new(1, Duration::from_secs(10));
        let device = Device::flex().autodiff();
        let ctx = RankContext::new(Arc::new(world.communicator(0)), device.clone());
        let net = Net { layer: LinearConfig::new(3, 2).init(&device) };
        let mut engine = Engine::new(net, &plan, &ctx).unwrap();
        for unit in &mut engine.units {
            unit.replace_optimizers(|| Box::new(Failing));
        }
        let dtype = if bf16 { FloatDType::BF16 } else { FloatDType::F32 };
        let x = Tensor::<2>::from_data(TensorData::new(vec![0.5f32; 6], [2, 3]), &device).cast(dtype);
        let loss = engine.forward(|n| n.layer.forward(x.clone()).powi_scalar(2).mean()).unwrap();
        engine.backward(loss).unwrap();
        let err = engine.step().unwrap_err().to_string();
        assert!(err.contains("injected optimizer failure"), "{err}");
        let dir = std::env::temp_dir().join(format!("zerotrain-lost-{}-{stage}", std::process::id()));
        let torn = |err: &str| err.contains("failed part-way") && err.contains("load a checkpoint");
        let err = engine.save_checkpoint(&dir, None, serde_json::Value::Null).unwrap_err().to_string();
        assert!(torn(&err), "stage {stage}: {err}");
        assert!(!dir.join("latest").exists(), "nothing committed");
        let err = engine.master_params().unwrap_err().to_string();
        assert!(torn(&err), "stage {stage}: {err}");
        let err = engine.forward(|n| n.layer.forward(x.clone()).mean()).unwrap_err().to_string();
        assert!(torn(&err), "stage {stage}: {err}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}

/// `f(group)` on each of `n` thread ranks of one world, in rank order.
fn on_ranks<T: Send>(n: usize, f: impl Fn(ParallelGroup) -> T + Sync) -> Vec<T> {
    let world = ThreadWorld::new(n, Duration::from_secs(30));
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..n)
            .map(|r| {
                let (comm, f) = (Arc::new(world.communicator(r)), &f);
                s.spawn(move || f(ParallelGroup::new(comm)))
            })
            .collect();
        handles.into_iter().map(|h| h.join().expect("a rank panicked")).collect()
    })
}

fn values<const D: usize>(t: Tensor<D>) -> Vec<f32> {
    t.into_data().iter::<f32>().collect()
}

/// Two lazy `Linear`s (`[4, 6]` with a bias, `[6, 4]`) for `split_module`.
#[derive(burn::module::Module, Debug)]
struct Pair {
    up: burn::nn::Linear,
    down: burn::nn::Linear,
}

fn pair() -> Pair {
    let device = Device::flex().autodiff();
    let linear = |d_in, d_out| burn::nn::LinearConfig::new(d_in, d_out).init(&device);
    Pair { up: linear(4, 6), down: linear(6, 4) }
}

/// `split_module` (`nn::parallel`) cuts what the plan names from the values the engine
/// would give the whole model in a run of the same seed (the two ranks' parts side by side
/// are the whole values the engine's own initialisation draws), leaves the rest lazy, and refuses a path the
/// model lacks and a cut that does not divide, each by name.
#[test]
fn a_module_is_cut_from_the_values_the_whole_model_starts_from() {
    let plan = std::collections::BTreeMap::from([
        ("up.weight".to_string(), Split::Even { dim: 1, blocks: 1 }),
        ("up.bias".to_string(), Split::Even { dim: 0, blocks: 1 }),
        ("down.weight".to_string(), Split::Even { dim: 0, blocks: 1 }),
    ]);
    let parts = on_ranks(2, |group| {
        let part = split_module(pair(), &plan, &group, 7).unwrap();
        assert!(!part.down.bias.as_ref().unwrap().is_initialized(), "a whole parameter stays lazy");
        (values(part.up.weight.val()), values(part.up.bias.unwrap().val()), values(part.down.weight.val()))
    });
    let whole = pair();
    super::params::initialise_lazy(&whole, 7);
    let up = values(whole.up.weight.val());
    let joined: Vec<f32> = (0..4)
        .flat_map(|row| [&parts[0].0[row * 3..row * 3 + 3], &parts[1].0[row * 3..row * 3 + 3]].concat())
        .collect();
    assert_eq!(joined, up, "up.weight: columns 0..3 on rank 0, 3..6 on rank 1");
    assert_eq!([parts[0].1.clone(), parts[1].1.clone()].concat(), values(whole.up.bias.unwrap().val()));
    assert_eq!([parts[0].2.clone(), parts[1].2.clone()].concat(), values(whole.down.weight.val()));
    assert_ne!(parts[0].0, parts[1].0, "the ranks hold different columns");
    let errors = on_ranks(4, |group| {
        let mut missing = plan.clone();
        missing.insert("up.gate".to_string(), Split::Whole);
        let missing = split_module(pair(), &missing, &ParallelGroup::alone(), 7).err().unwrap().to_string();
        let undivided = split_module(pair(), &plan, &group, 7).err().unwrap().to_string();
        (missing, undivided)
    });
    let (missing, undivided) = &errors[0];
    assert!(missing.contains("`up.gate`") && missing.contains("no float parameter"), "{missing}");
    assert!(undivided.contains("`up.weight`") && undivided.contains("size 4"), "{undivided}");
}
