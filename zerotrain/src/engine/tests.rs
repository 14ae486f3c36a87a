//! Engine behaviour that needs its internals: a failing optimizer step.

use std::sync::Arc;
use std::time::Duration;

use burn::module::Module;
use burn::nn::{Linear, LinearConfig};
use burn::tensor::{Device, FloatDType, Tensor, TensorData};
use zerotrain_zero::ThreadWorld;

use super::optimizer::{ExportedState, ShardOptimizer};
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
