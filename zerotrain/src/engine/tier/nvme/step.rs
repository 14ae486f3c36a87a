//! A swapped optimizer's step, tile by tile (the parent's note on tiles): each tile's
//! masters and moments read (the next while this one steps, with `pipeline_read`), stepped,
//! and written back (finishing while the next one steps, with `pipeline_write`).

use burn::tensor::{Device, Tensor, TensorData};
use zerotrain_precision::{BufRef, FlatBuf, Precision};

use super::NvmeOptimizer;
use crate::engine::optimizer::ExportedState;
use crate::swap::{AlignedBuf, Ticket, wait};
use crate::{Error, Result};

/// A tile's tensors read from the swap, in flight or arrived.
struct Loading {
    master: Option<Ticket>,
    states: Vec<Ticket>,
}

/// A tile's values once read: its masters (if swapped) and each state's values.
type Arrived = (Option<Vec<f32>>, Vec<Vec<f32>>);

/// A tile's write-back in flight.
struct Writing(Vec<Ticket>);

impl Writing {
    fn finish(self) -> Result<()> {
        self.0.into_iter().try_for_each(|t| wait(t).map(drop))
    }
}

impl NvmeOptimizer {
    /// Tiles alive at once as `buffer_count` allows: (read ahead, write behind). Before the
    /// optimizer's state tensors are known (its first step) nothing is pipelined: a tile's
    /// write may hold more buffers than its read did.
    fn pipelining(&self) -> (bool, bool) {
        if !self.states_known {
            return (false, false);
        }
        let per_tile = 1 + self.states.len() as u64;
        let tiles = (self.buffer_count / per_tile).max(1);
        let read = self.pipeline_read && tiles >= 2;
        let write = self.pipeline_write && tiles >= 2 + u64::from(read);
        (read, write)
    }

    fn start_read(&self, t: usize) -> Result<Loading> {
        let range = self.tiles[t].range.clone();
        let master = self.written_masters().map(|f| f.read(range.clone())).transpose()?;
        let states = match self.tiles[t].has_state {
            true => self.states.iter().map(|(_, f)| f.read(range.clone())).collect::<Result<_>>()?,
            false => Vec::new(),
        };
        Ok(Loading { master, states })
    }

    /// Steps the range with the final gradients `grads` at `lr`; `masters` are the masters
    /// when the swap does not hold them (fp32, or mixed precision before the first step:
    /// the module notes), else `None`. Returns the new values in `dtype` (the caller
    /// publishes them), having written the swapped ones back.
    pub fn step(
        &mut self,
        lr: f64,
        grads: &[f32],
        masters: Option<Vec<f32>>,
        dtype: Precision,
        device: &Device,
    ) -> Result<FlatBuf> {
        if grads.len() != self.len || masters.as_ref().is_some_and(|m| m.len() != self.len) {
            return Err(Error::Model(format!("unit {}: gradients for a range of {} elements", self.unit, self.len)));
        }
        self.check()?;
        if masters.is_none() && !self.masters_written {
            return Err(Error::Model(format!(
                "unit {}: its masters are the parameters, and none were given",
                self.unit
            )));
        }
        self.torn = true;
        let out = self.step_tiles(lr, grads, masters, dtype, device)?;
        self.torn = false;
        // Every tile's masters are in the file now (mixed precision).
        self.masters_written = self.master.is_some();
        Ok(out)
    }

    fn step_tiles(
        &mut self,
        lr: f64,
        grads: &[f32],
        mut masters: Option<Vec<f32>>,
        dtype: Precision,
        device: &Device,
    ) -> Result<FlatBuf> {
        let (read_ahead, write_behind) = self.pipelining();
        // In mixed precision the new values go out in the compute dtype.
        let mut out = (dtype != Precision::Fp32).then(|| FlatBuf::zeros(dtype, self.len));
        // Every tile starts from the state before this step (its step counts included).
        let before = self.scalars.clone();
        let mut next = Some(self.start_read(0)?);
        let mut writing: Option<Writing> = None;
        for t in 0..self.tiles.len() {
            let loading = next.take().expect("each tile's read is started before its turn");
            let (tile_master, states) = self.arrive(loading)?;
            if read_ahead && t + 1 < self.tiles.len() {
                next = Some(self.start_read(t + 1)?);
            }
            let range = self.tiles[t].range.clone();
            let values = match (&masters, tile_master) {
                (Some(all), _) => all[range.clone()].to_vec(),
                (None, Some(values)) => values,
                (None, None) => unreachable!("masters are passed in unless the file holds them"),
            };
            // A tile read before the first state was written has none (nor step counts).
            let scalars = if states.is_empty() { Vec::new() } else { before.clone() };
            let state = (self.states.iter().map(|(n, _)| n.clone()).zip(states).collect(), scalars);
            let tile = &mut self.tiles[t];
            tile.optimizer.import(state, device)?;
            let params = Tensor::<1>::from_data(TensorData::new(values, [range.len()]), device);
            let grads = Tensor::<1>::from_data(TensorData::new(grads[range.clone()].to_vec(), [range.len()]), device);
            let stepped = tile.optimizer.step(lr, params, grads)?;
            let exported = tile.optimizer.take_state()?;
            let new = crate::engine::readout::f32s(stepped, "master weights")?;
            if let Some(prev) = writing.take() {
                prev.finish()?;
            }
            let write = self.write_tile(t, &new, exported)?;
            if let Some(out) = &mut out {
                out.as_mut().slice(range.clone()).copy_from(BufRef::F32(&new), false);
            }
            if let Some(all) = &mut masters {
                all[range].copy_from_slice(&new);
            }
            if write_behind {
                writing = Some(write);
            } else {
                write.finish()?;
            }
            if !read_ahead && t + 1 < self.tiles.len() {
                next = Some(self.start_read(t + 1)?);
            }
        }
        if let Some(last) = writing {
            last.finish()?;
        }
        Ok(match (out, masters) {
            (Some(out), _) => out,
            (None, all) => FlatBuf::F32(all.expect("fp32 passes its masters in")),
        })
    }

    /// A tile's values once read: (masters, each state's values).
    fn arrive(&self, loading: Loading) -> Result<Arrived> {
        let master = loading.master.map(|t| wait(t).map(|b| b.as_slice().to_vec())).transpose()?;
        let states =
            loading.states.into_iter().map(|t| wait(t).map(|b| b.as_slice().to_vec())).collect::<Result<_>>()?;
        Ok((master, states))
    }

    /// Starts writing tile `t`'s new masters (if swapped) and state; the first state of
    /// the run creates the state files.
    fn write_tile(&mut self, t: usize, masters: &[f32], (tensors, scalars): ExportedState) -> Result<Writing> {
        if self.states.is_empty() && !tensors.is_empty() {
            self.create_state_files(tensors.iter().map(|(n, _)| n.as_str()))?;
        }
        let names: Vec<&str> = self.states.iter().map(|(n, _)| n.as_str()).collect();
        if tensors.iter().map(|(n, _)| n.as_str()).ne(names.iter().copied()) {
            return Err(Error::Model(format!(
                "unit {}: the optimizer's state changed shape between tiles or steps ({names:?})",
                self.unit
            )));
        }
        self.scalars = scalars;
        self.states_known = true;
        self.tiles[t].has_state = !tensors.is_empty();
        let start = self.tiles[t].range.start;
        let mut tickets = Vec::with_capacity(1 + tensors.len());
        if let Some(file) = &self.master {
            tickets.push(file.write(start, AlignedBuf::from_slice(masters))?);
        }
        for ((_, file), (_, values)) in self.states.iter().zip(&tensors) {
            tickets.push(file.write(start, AlignedBuf::from_slice(values))?);
        }
        Ok(Writing(tickets))
    }
}
