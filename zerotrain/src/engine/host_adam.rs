//! AdamW on host vectors in one fused, multi-threaded pass: the built-in optimizer wherever
//! master weights and optimizer state live in host memory (CPU ranks, `offload_optimizer`).
//!
//! # Note: why a kernel of our own, and why it gives Burn's bits
//! Burn's AdamW on Flex runs each line of the algorithm as its own tensor operation: about
//! fifteen passes over memory per step, each allocating a shard-sized temporary. The offload
//! tiers step every byte of the optimizer on the host, so that step is the tier's cost
//! (DeepSpeed wrote its CPU Adam for the same reason). Here one pass reads the parameter,
//! gradient and both moments and writes three of them back (28 bytes per element), split
//! over the rayon pool. Each element goes through exactly Burn's operations in Burn's order
//! (`m*b1 + g*(1-b1)`, `v*b2 + (g*g)*(1-b2)`, `m/(1-b1^t)`, `v/(1-b2^t)`,
//! `mc/(sqrt(vc)+eps)`, `p*(1-lr*wd) - delta*lr`, every scalar rounded to f32 as Flex rounds
//! it), and each of them is one correctly rounded IEEE operation whatever the vector width,
//! so the result equals Burn's AdamW bit for bit (tested here and by the plain-Burn
//! equivalence tests, which step Burn's own optimizer). The state is exported and imported
//! through Burn's own `AdamWState`, so checkpoints do not know which one stepped.

use std::collections::BTreeMap;

use burn::optim::{AdamWState, AdaptiveMomentumState, RecordState, StateSink, StateSource};
use burn::tensor::{Device, Tensor, TensorData};
use rayon::prelude::*;

use super::optimizer::{ExportedState, ShardOptimizer};
use crate::{Error, Result};

/// Elements per task of the pass (large enough to amortise scheduling, small enough to
/// balance two to a few dozen threads).
const CHUNK: usize = 1 << 16;

/// AdamW's hyper-parameters (decoupled weight decay, no AMSGrad).
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct AdamW {
    pub beta_1: f32,
    pub beta_2: f32,
    pub epsilon: f32,
    pub weight_decay: f32,
}

/// The moments and step count of one range.
struct Moments {
    time: usize,
    m: Vec<f32>,
    v: Vec<f32>,
}

/// [`AdamW`] stepping host vectors (module note).
pub(crate) struct HostAdamW {
    hyper: AdamW,
    state: Option<Moments>,
}

impl HostAdamW {
    pub fn new(hyper: AdamW) -> Self {
        Self { hyper, state: None }
    }

    /// One step of `p` with `g` at `lr`, in place.
    pub fn step_slices(&mut self, lr: f64, p: &mut [f32], g: &[f32]) {
        let n = p.len();
        let first = self.state.is_none();
        let state = self.state.get_or_insert_with(|| Moments { time: 0, m: vec![0.0; n], v: vec![0.0; n] });
        state.time += 1;
        let h = self.hyper;
        let time = state.time as i32;
        let decay_rate = lr * f64::from(h.weight_decay);
        let c = Coefs {
            b1: h.beta_1,
            b2: h.beta_2,
            f1: 1.0 - h.beta_1,
            f2: 1.0 - h.beta_2,
            bc1: 1f32 - h.beta_1.powi(time),
            bc2: 1f32 - h.beta_2.powi(time),
            eps: h.epsilon,
            keep: (decay_rate != 0.0).then_some((1.0 - decay_rate) as f32),
            lr: lr as f32,
            first,
        };
        p.par_chunks_mut(CHUNK)
            .zip(g.par_chunks(CHUNK))
            .zip(state.m.par_chunks_mut(CHUNK))
            .zip(state.v.par_chunks_mut(CHUNK))
            .for_each(|(((p, g), m), v)| c.apply(p, g, m, v));
    }
}

/// One step's per-element constants, each the f32 Flex computes with.
#[derive(Clone, Copy)]
struct Coefs {
    b1: f32,
    b2: f32,
    f1: f32,
    f2: f32,
    bc1: f32,
    bc2: f32,
    eps: f32,
    /// `1 - lr * weight_decay`, if there is decay.
    keep: Option<f32>,
    lr: f32,
    /// No moments yet: they start from the gradient alone.
    first: bool,
}

impl Coefs {
    fn apply(&self, p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32]) {
        for (((p, &g), m), v) in p.iter_mut().zip(g).zip(m.iter_mut()).zip(v.iter_mut()) {
            let g2 = g * g;
            let (mi, vi) = if self.first {
                (g * self.f1, g2 * self.f2)
            } else {
                (*m * self.b1 + g * self.f1, *v * self.b2 + g2 * self.f2)
            };
            *m = mi;
            *v = vi;
            let delta = (mi / self.bc1) / ((vi / self.bc2).sqrt() + self.eps);
            let decayed = match self.keep {
                Some(keep) => *p * keep,
                None => *p,
            };
            *p = decayed - delta * self.lr;
        }
    }
}

impl ShardOptimizer for HostAdamW {
    fn step(&mut self, lr: f64, params: Tensor<1>, grads: Tensor<1>) -> Result<Tensor<1>> {
        let device = params.device();
        let mut p = host_vec(params, "parameters")?;
        let g = host_vec(grads, "gradients")?;
        if p.len() != g.len() || self.state.as_ref().is_some_and(|s| s.m.len() != p.len()) {
            return Err(Error::Model(format!("AdamW: {} gradients for {} parameters", g.len(), p.len())));
        }
        self.step_slices(lr, &mut p, &g);
        let n = p.len();
        Ok(Tensor::from_data(TensorData::new(p, [n]), &device))
    }

    fn state_bytes(&self) -> u64 {
        self.state.as_ref().map_or(0, |s| ((s.m.len() + s.v.len()) * size_of::<f32>()) as u64)
    }

    fn export(&self) -> ExportedState {
        let Some(s) = &self.state else { return (Vec::new(), Vec::new()) };
        named(s.time, s.m.clone(), s.v.clone())
    }

    fn take_state(&mut self) -> ExportedState {
        match self.state.take() {
            Some(s) => named(s.time, s.m, s.v),
            None => (Vec::new(), Vec::new()),
        }
    }

    fn import(&mut self, (tensors, scalars): ExportedState, _: &Device) -> Result<()> {
        if tensors.is_empty() && scalars.is_empty() {
            self.state = None;
            return Ok(());
        }
        let names: Vec<String> = tensors.iter().map(|(n, _)| n.clone()).collect();
        let misfit = || {
            Error::Model(format!(
                "the checkpoint's optimizer state ({}) does not fit the configured optimizer (AdamW)",
                names.join(", ")
            ))
        };
        // Burn's own state type checks the names and reads the step count, on one-element
        // stand-ins (the vectors themselves are moved in below, not copied).
        let mut source = StateSource::new(scalars.into_iter().collect::<BTreeMap<_, _>>());
        for name in &names {
            source.insert_tensor(name.clone(), TensorData::new(vec![0.0f32], [1]));
        }
        let state = AdamWState::<1>::state_unflatten("", &mut source, &Device::flex()).ok_or_else(misfit)?;
        if state.momentum.max_moment_2.is_some() || names.len() != 2 {
            return Err(misfit());
        }
        let len = tensors[0].1.len();
        let (mut m, mut v) = (None, None);
        for (name, values) in tensors {
            if values.len() != len {
                return Err(misfit());
            }
            match name.rsplit('.').next() {
                Some("moment_1") => m = Some(values),
                Some("moment_2") => v = Some(values),
                _ => return Err(misfit()),
            }
        }
        let (Some(m), Some(v)) = (m, v) else { return Err(misfit()) };
        self.state = Some(Moments { time: state.momentum.time, m, v });
        Ok(())
    }
}

/// The state as Burn's AdamW names it: Burn's own state type, flattened over one-element
/// stand-ins, gives the names and the step count's scalar; the vectors take their places.
fn named(time: usize, m: Vec<f32>, v: Vec<f32>) -> ExportedState {
    let device = Device::flex();
    let one = || Tensor::<1>::from_data(TensorData::new(vec![0.0f32], [1]), &device);
    let mut sink = StateSink::default();
    AdamWState::new(AdaptiveMomentumState::new(time, one(), one())).state_flatten("", &mut sink);
    let (mut m, mut v) = (Some(m), Some(v));
    let tensors = sink
        .tensors
        .into_iter()
        .map(|(name, _)| {
            let values = if name.ends_with("moment_1") { m.take() } else { v.take() };
            (name, values.unwrap_or_default())
        })
        .collect();
    (tensors, sink.scalars)
}

/// A 1-D f32 tensor's values (moved out without a copy when nothing else holds it).
fn host_vec(t: Tensor<1>, what: &str) -> Result<Vec<f32>> {
    super::readout::f32s(t, &format!("AdamW {what}"))
}

#[cfg(test)]
mod tests {
    use burn::optim::{AdamWConfig, Optimizer};

    use super::*;

    /// The fused pass gives Burn's AdamW's bits over several steps, with and without
    /// weight decay, on values spanning many magnitudes (zeros included), and its exported
    /// state loads into a fresh optimizer that goes on with the same bits.
    #[test]
    fn equals_burns_adamw_bit_for_bit() {
        let n = 3 * CHUNK + 123;
        let device = Device::flex();
        let values = |seed: u32| -> Vec<f32> {
            (0..n as u32)
                .map(|i| {
                    let x = (i.wrapping_mul(2_654_435_761) ^ seed) as f32 / u32::MAX as f32 - 0.5;
                    if i % 97 == 0 { 0.0 } else { x * 10f32.powi((i % 9) as i32 - 4) }
                })
                .collect()
        };
        for weight_decay in [0.0f32, 0.1] {
            let hyper = AdamW { beta_1: 0.9, beta_2: 0.99, epsilon: 1e-8, weight_decay };
            let burn = AdamWConfig::new()
                .with_beta_1(0.9)
                .with_beta_2(0.99)
                .with_epsilon(1e-8)
                .with_weight_decay(weight_decay)
                .build();
            let (mut ours, mut state) = (HostAdamW::new(hyper), None);
            let mut want = Tensor::<1>::from_data(TensorData::new(values(1), [n]), &device);
            let mut got = want.clone();
            for step in 0..4u32 {
                if step == 2 {
                    // A checkpoint round trip half-way.
                    let mut resumed = HostAdamW::new(hyper);
                    resumed.import(ours.export(), &device).unwrap();
                    ours = resumed;
                }
                let grads = Tensor::<1>::from_data(TensorData::new(values(step + 7), [n]), &device);
                let lr = 0.01 * f64::from(step + 1);
                let (next, s) = burn.step(lr, want, grads.clone(), state.take());
                (want, state) = (next, s);
                got = ours.step(lr, got, grads).unwrap();
                let (w, g) = (
                    want.clone().into_data().try_to_vec::<f32>().unwrap(),
                    got.clone().into_data().try_to_vec::<f32>().unwrap(),
                );
                let differ = w.iter().zip(&g).filter(|(a, b)| a.to_bits() != b.to_bits()).count();
                assert_eq!(differ, 0, "weight decay {weight_decay}, step {step}: {differ} of {n} elements differ");
            }
        }
    }
}
