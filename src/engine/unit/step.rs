//! A unit's optimizer step: the new values of its range, and where they go.
//!
//! # Note: fp32 on a GPU
//! In fp32 the parameters are their own master weights (`Master::InModel`). On a GPU the
//! step cuts the unit's range out of the model on the device and, at stage 0, writes the
//! stepped values straight back, so the only bytes crossing to the host are those the host
//! collectives need (the step report counts them).

use std::time::Instant;

use burn::module::Module;
use zerotrain_precision::Precision;
use zerotrain_zero::ZeroStage;

use super::{PhaseTimes, Shared, Unit, in_model, read};
use crate::Result;
use crate::engine::home::{Home, Master, lost};
use crate::engine::master::Values;
use crate::engine::params::{read_range, write_unit};

impl Unit {
    /// Steps the optimizer over the unit's range with the final gradients `grads` at `lr`
    /// and puts the new values where the stage keeps parameters (stage 1-2: all-gathered
    /// into the model). Returns the transient bytes it used.
    pub fn step<M: Module>(
        &mut self,
        model: M,
        lr: f64,
        grads: Vec<f32>,
        shared: &Shared,
        times: &mut PhaseTimes,
    ) -> Result<(M, u64)> {
        let range = shared.optimizer_range(self.id);
        let start = Instant::now();
        let transient = (2 * range.len() * size_of::<f32>()) as u64;
        if let Home::Swapped(_) = &self.home {
            let masters = self.fp32_masters(&model, shared)?;
            let Home::Swapped(swapped) = &mut self.home else { unreachable!("matched above") };
            let new = swapped.step(lr, &grads, masters, shared.dtype(), &shared.state_device())?;
            times.optimizer += start.elapsed().as_secs_f64();
            let start = Instant::now();
            let (model, published) = self.publish(model, || Ok(new), shared, times)?;
            times.gather += start.elapsed().as_secs_f64();
            return Ok((model, transient + published));
        }
        let Home::Resident { master, optimizer } = &mut self.home else { unreachable!("swapped returned above") };
        let states_on_gpu = !shared.states_on_host();
        let values = match master {
            // On a GPU the parameters' range is cut out on the device, not copied around.
            Master::InModel if states_on_gpu => {
                let (index, sharding, device) = (&shared.index, &shared.sharding, &shared.state_device());
                Values::Device(read_range(&model, index, sharding, self.id, range.clone(), device))
            }
            Master::InModel => Values::Host(in_model(&model, shared, self.id)?),
            Master::Held(held) => held.take().filter(|v| v.len() == range.len()).ok_or_else(lost)?,
        };
        if !values.on_device() {
            shared.crossed_to_state_device((values.len() * size_of::<f32>()) as u64);
        }
        shared.crossed_to_state_device((grads.len() * size_of::<f32>()) as u64);
        let values = values.into_tensor(&shared.state_device());
        let updated = Values::from_tensor(optimizer.step(lr, values, grads)?, shared.states_on_host())?;
        times.optimizer += start.elapsed().as_secs_f64();
        let start = Instant::now();
        let (model, published) = if matches!(master, Master::InModel)
            && shared.stage() == ZeroStage::Disabled
            && let Values::Device(values) = updated
        {
            // Stage 0 keeps every parameter: the stepped range goes straight back in.
            let model = write_unit(model, &shared.index, &shared.sharding, self.id, values);
            (model, 0)
        } else if matches!(master, Master::InModel) {
            // The model's parameters are the masters: the new values go there, moved, not
            // copied (f32 in, f32 out).
            let on_device = updated.on_device();
            let host = || {
                let buf = updated.into_host(Precision::Fp32)?;
                if on_device {
                    shared.crossed(false, buf.bytes());
                }
                Ok(buf)
            };
            self.publish(model, host, shared, times)?
        } else {
            let dtype = shared.dtype();
            let published = self.publish(model, || read(&updated, dtype, shared), shared, times)?;
            if let Home::Resident { master, .. } = &mut self.home {
                *master = Master::Held(Some(updated));
            }
            published
        };
        times.gather += start.elapsed().as_secs_f64();
        Ok((model, transient + published))
    }
}
