//! The built-in optimizers: Burn's own, each stepping a flat range, and AdamW on host
//! memory as one fused pass with Burn's bits (`host_adam.rs`).

use std::collections::BTreeMap;
use std::sync::Arc;

use burn::optim::decay::WeightDecayConfig;
use burn::optim::momentum::MomentumConfig;
use burn::optim::{AdamConfig, AdamWConfig, Optimizer, RecordState, SgdConfig, StateSink, StateSource};
use burn::tensor::{Device, Tensor, TensorData};

use super::host_adam::{AdamW, HostAdamW};
use super::optimizer::{ExportedState, OptimizerFactory, ShardGroup, ShardOptimizer};
use crate::config::OptimizerPlan;
use crate::{Error, Result};

/// The factory of the built-in optimizers: Burn's, configured from the plan, and AdamW
/// on host memory as one fused pass with Burn's bits (`host_adam.rs`).
pub(crate) fn built_in() -> OptimizerFactory {
    Arc::new(|group: &ShardGroup<'_>| match group.optimizer {
        OptimizerPlan::Adam { betas, eps, weight_decay, decoupled_weight_decay: true, amsgrad: false, .. }
            if group.on_host =>
        {
            Box::new(HostAdamW::new(AdamW {
                beta_1: betas[0] as f32,
                beta_2: betas[1] as f32,
                epsilon: eps as f32,
                weight_decay: weight_decay as f32,
            }))
        }
        _ => build(&group.optimizer),
    })
}

/// One of Burn's optimizers stepping a flat range.
struct BurnOptimizer<O: Optimizer> {
    optim: O,
    state: Option<O::State<1>>,
}

impl<O: Optimizer> ShardOptimizer for BurnOptimizer<O> {
    fn step(&mut self, lr: f64, params: Tensor<1>, grads: Tensor<1>) -> Result<Tensor<1>> {
        let (params, state) = self.optim.step(lr, params, grads, self.state.take());
        self.state = state;
        Ok(params)
    }

    fn state_bytes(&self) -> u64 {
        let Some(state) = &self.state else { return 0 };
        let mut sink = StateSink::default();
        state.state_flatten("", &mut sink);
        sink.tensors.iter().map(|(_, data)| data.as_bytes().len() as u64).sum()
    }

    fn export(&self) -> ExportedState {
        let Some(state) = &self.state else { return (Vec::new(), Vec::new()) };
        let mut sink = StateSink::default();
        state.state_flatten("", &mut sink);
        let tensors = sink
            .tensors
            .into_iter()
            .map(|(name, data)| {
                let values = data.try_into_vec::<f32>().expect("optimizer state of a flat f32 range is f32");
                (name, values)
            })
            .collect();
        (tensors, sink.scalars)
    }

    fn import(&mut self, (tensors, scalars): ExportedState, device: &Device) -> Result<()> {
        if tensors.is_empty() && scalars.is_empty() {
            self.state = None;
            return Ok(());
        }
        let names: Vec<String> = tensors.iter().map(|(n, _)| n.clone()).collect();
        let mut source = StateSource::new(scalars.into_iter().collect::<BTreeMap<_, _>>());
        for (name, values) in tensors {
            let n = values.len();
            source.insert_tensor(name, TensorData::new(values, [n]));
        }
        let state = O::State::<1>::state_unflatten("", &mut source, device).ok_or_else(|| {
            Error::Model(format!(
                "the checkpoint's optimizer state ({}) does not fit the configured optimizer",
                names.join(", ")
            ))
        })?;
        self.state = Some(state);
        Ok(())
    }
}

/// Builds the Burn optimizer for `plan`, with every hyper-parameter set explicitly (Burn's
/// defaults differ from DeepSpeed's: Adam eps 1e-5, SGD dampening 0.1).
pub(crate) fn build(plan: &OptimizerPlan) -> Box<dyn ShardOptimizer> {
    match *plan {
        OptimizerPlan::Adam { betas, eps, weight_decay, decoupled_weight_decay: true, amsgrad, .. } => {
            let optim = AdamWConfig::new()
                .with_beta_1(betas[0] as f32)
                .with_beta_2(betas[1] as f32)
                .with_epsilon(eps as f32)
                .with_weight_decay(weight_decay as f32)
                .with_amsgrad(amsgrad)
                .build();
            Box::new(BurnOptimizer { optim, state: None })
        }
        OptimizerPlan::Adam { betas, eps, weight_decay, decoupled_weight_decay: false, amsgrad, .. } => {
            let optim = AdamConfig::new()
                .with_beta_1(betas[0] as f32)
                .with_beta_2(betas[1] as f32)
                .with_epsilon(eps as f32)
                .with_amsgrad(amsgrad)
                .with_weight_decay((weight_decay > 0.0).then(|| WeightDecayConfig::new(weight_decay as f32)))
                .build();
            Box::new(BurnOptimizer { optim, state: None })
        }
        OptimizerPlan::Sgd { momentum, dampening, nesterov, weight_decay, .. } => {
            let momentum = (momentum > 0.0).then_some(MomentumConfig { momentum, dampening, nesterov });
            let optim = SgdConfig::new()
                .with_momentum(momentum)
                .with_weight_decay((weight_decay > 0.0).then(|| WeightDecayConfig::new(weight_decay as f32)))
                .build();
            Box::new(BurnOptimizer { optim, state: None })
        }
    }
}
