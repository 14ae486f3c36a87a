//! A unit's optimizer step: the new values of its range, and where they go.
//!
//! # Note: fp32 on a GPU
//! In fp32 the parameters are their own master weights (`Master::InModel`). On a GPU the
//! step cuts the unit's range out of the model on the device and, at stage 0 or in a
//! device-resident step (`engine/flat.rs`), writes the stepped values straight back, so the
//! only bytes crossing to the host are those the host collectives need (the step report
//! counts them).

use std::time::Instant;

use burn::module::Module;
use zerotrain_precision::Precision;
use zerotrain_zero::ZeroStage;

use super::{Unit, in_model, read};
use crate::Result;
use crate::engine::master::Values;
use crate::engine::params::read_range;
use crate::engine::report::PhaseTimes;
use crate::engine::shared::Shared;
use crate::engine::tier::{Home, Master, lost};

impl Unit {
    /// Steps the optimizer over the unit's range with the final gradients `grads` (fp32,
    /// averaged, unscaled, clipped) at `lr` and puts the new values where the stage keeps
    /// parameters (stage 1-2: all-gathered into the model). Returns the transient bytes it
    /// used.
    pub fn step<M: Module>(
        &mut self,
        model: M,
        lr: f64,
        grads: Values,
        shared: &Shared,
        times: &mut PhaseTimes,
    ) -> Result<(M, u64)> {
        let range = shared.optimizer_range(self.id);
        let start = Instant::now();
        let transient = (2 * range.len() * size_of::<f32>()) as u64;
        if let Home::Nvme(_) = &self.home {
            let masters = self.given_masters(&model, shared)?;
            let grads = grads.into_host(Precision::Fp32)?.into_f32();
            let Home::Nvme(swapped) = &mut self.home else { unreachable!("matched above") };
            let new = swapped.step(lr, &grads, masters, shared.dtype(), &shared.state_device())?;
            times.optimizer += shared.phase_seconds(start);
            let start = Instant::now();
            let (model, published) = self.publish(model, || Ok(new), shared, times)?;
            times.gather += shared.phase_seconds(start);
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
        for crossing in [&values, &grads].into_iter().filter(|v| !v.on_device()) {
            shared.crossed_to_state_device((crossing.len() * size_of::<f32>()) as u64);
        }
        let device = shared.state_device();
        let stepped = optimizer.step(lr, values.into_tensor(&device), grads.into_tensor(&device))?;
        let updated = Values::from_tensor(stepped, shared.states_on_host())?;
        times.optimizer += shared.phase_seconds(start);
        let start = Instant::now();
        let in_model = matches!(master, Master::InModel);
        let (model, published, updated) = match updated {
            // Nothing on the host needs the new values (a device-resident step, or stage 0's
            // parameters, which are the masters): they go into the model on the device.
            Values::Device(values) if shared.device_step || (in_model && shared.stage() == ZeroStage::Disabled) => {
                let model = self.publish_on_device(model, &values, shared)?;
                (model, 0, Values::Device(values))
            }
            // The model's parameters are the masters: the new values go there, moved, not
            // copied (f32 in, f32 out).
            updated if in_model => {
                let on_device = updated.on_device();
                let host = || {
                    let buf = updated.into_host(Precision::Fp32)?;
                    if on_device {
                        shared.crossed(false, buf.bytes());
                    }
                    Ok(buf)
                };
                let (model, published) = self.publish(model, host, shared, times)?;
                times.gather += shared.phase_seconds(start);
                return Ok((model, transient + published));
            }
            updated => {
                let dtype = shared.dtype();
                let (model, published) = self.publish(model, || read(&updated, dtype, shared), shared, times)?;
                (model, published, updated)
            }
        };
        if let Home::Resident { master: master @ Master::Held(_), .. } = &mut self.home {
            *master = Master::Held(Some(updated));
        }
        times.gather += shared.phase_seconds(start);
        Ok((model, transient + published))
    }
}
