//! Burn's optimizers stepping a flat shard.
//!
//! Adam, AdamW and SGD are element-wise, so stepping one 1-D tensor that holds a rank's
//! shard of the flat buffer gives exactly the values of stepping each parameter tensor
//! (Burn's `Optimizer::step` is generic over the rank). The range's values and the state
//! tensors are Burn tensors on the rank's device: only the reduced gradient arrives from
//! the host.

use burn::optim::decay::WeightDecayConfig;
use burn::optim::momentum::MomentumConfig;
use std::collections::BTreeMap;

use burn::optim::{AdamConfig, AdamWConfig, Optimizer, RecordState, SgdConfig, StateSink, StateSource};
use burn::tensor::{Device, Tensor, TensorData};
use burn_pack::Scalar;

use crate::config::OptimizerPlan;
use crate::{Error, Result};

/// Optimizer state as named flat tensors and named scalars.
pub(crate) type ExportedState = (Vec<(String, Vec<f32>)>, Vec<(String, Scalar)>);

/// An optimizer with its state for one flat range.
pub(crate) trait FlatOptimizer: Send {
    /// Steps `params` (a 1-D f32 tensor on the rank's device, without autodiff) with
    /// `grads` (same length) at `lr`, returning the new values on the same device.
    fn step(&mut self, lr: f64, params: Tensor<1>, grads: Vec<f32>) -> Result<Tensor<1>>;
    /// Bytes held by the optimizer state.
    fn state_bytes(&self) -> u64;
    /// The state as named flat tensors (each the range's length) and scalars; empty before
    /// the first step.
    fn export(&self) -> ExportedState;
    /// Replaces the state with tensors and scalars from [`export`](Self::export) (of any
    /// range of the same length as the one stepped next); empty means no state yet.
    fn import(
        &mut self,
        tensors: Vec<(String, Vec<f32>)>,
        scalars: Vec<(String, Scalar)>,
        device: &Device,
    ) -> Result<()>;
}

struct Flat<O: Optimizer> {
    optim: O,
    state: Option<O::State<1>>,
}

impl<O: Optimizer> FlatOptimizer for Flat<O> {
    fn step(&mut self, lr: f64, params: Tensor<1>, grads: Vec<f32>) -> Result<Tensor<1>> {
        let n = params.dims()[0];
        if grads.len() != n {
            return Err(Error::Model(format!("{} gradients for an optimizer range of {n}", grads.len())));
        }
        let grads = Tensor::<1>::from_data(TensorData::new(grads, [n]), &params.device());
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

    fn import(
        &mut self,
        tensors: Vec<(String, Vec<f32>)>,
        scalars: Vec<(String, Scalar)>,
        device: &Device,
    ) -> Result<()> {
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
pub(crate) fn build(plan: &OptimizerPlan) -> Box<dyn FlatOptimizer> {
    match *plan {
        OptimizerPlan::Adam { betas, eps, weight_decay, decoupled_weight_decay: true, amsgrad, .. } => {
            let optim = AdamWConfig::new()
                .with_beta_1(betas[0] as f32)
                .with_beta_2(betas[1] as f32)
                .with_epsilon(eps as f32)
                .with_weight_decay(weight_decay as f32)
                .with_amsgrad(amsgrad)
                .build();
            Box::new(Flat { optim, state: None })
        }
        OptimizerPlan::Adam { betas, eps, weight_decay, decoupled_weight_decay: false, amsgrad, .. } => {
            let optim = AdamConfig::new()
                .with_beta_1(betas[0] as f32)
                .with_beta_2(betas[1] as f32)
                .with_epsilon(eps as f32)
                .with_amsgrad(amsgrad)
                .with_weight_decay((weight_decay > 0.0).then(|| WeightDecayConfig::new(weight_decay as f32)))
                .build();
            Box::new(Flat { optim, state: None })
        }
        OptimizerPlan::Sgd { momentum, dampening, nesterov, weight_decay, .. } => {
            let momentum = (momentum > 0.0).then_some(MomentumConfig { momentum, dampening, nesterov });
            let optim = SgdConfig::new()
                .with_momentum(momentum)
                .with_weight_decay((weight_decay > 0.0).then(|| WeightDecayConfig::new(weight_decay as f32)))
                .build();
            Box::new(Flat { optim, state: None })
        }
    }
}
