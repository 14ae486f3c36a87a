//! The model's buffers: its float tensors that are not trained (Burn's `RunningState`, such
//! as BatchNorm's running mean and variance, and frozen parameters).
//!
//! # Note: buffers
//! DDP broadcasts rank 0's buffers before every forward; zerotrain averages them over the
//! data-parallel ranks, so that running statistics see every rank's batches (the running
//! mean then equals single-process training's on the global batch). Running statistics are
//! an exponential average, linear in their inputs, so averaging once before they are read
//! equals averaging after every step; zerotrain therefore averages them when they are
//! *observed*: before evaluation (`evaluate`, `eval`), before a checkpoint is saved, before
//! the model is exported, and on [`Engine::sync_buffers`](super::Engine::sync_buffers) — not
//! every step, so that a frozen backbone costs no traffic per step. The average is rank 0's
//! value plus the mean of every rank's difference from it, so values equal on every rank (a
//! frozen parameter) stay bit for bit.
//!
//! Each rank's buffers are its own: building the engine copies them out of the caller's
//! model (Burn's `clone()` shares a `RunningState` between clones, which had thread ranks
//! train one shared object). Evaluation runs the model in inference mode, which reads
//! running statistics without updating them; a unit recomputed in backward (activation
//! checkpointing) runs its forward twice, and its buffers are put back after the second
//! run, so each micro-step updates them once.
//!
//! Buffers stay whole on every rank at every stage (they are not sharded) and are saved in
//! checkpoints and consolidated files by module path.
//!
//! The model's frozen parameters ([`UnitModel::frozen_parameters`](super::UnitModel::frozen_parameters):
//! a LoRA run's base) are buffers that nothing changes: they are put in place once, at the
//! build (broadcast, as every buffer), and never averaged, snapshotted or saved, so that a
//! step reads none of them to the host and a checkpoint holds only what trains.

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param};
use burn::tensor::{DType, FloatDType, Tensor, TensorData};
use zerotrain_precision::BufMut;
use zerotrain_zero::{Collective, ReduceOp};

use super::params::{for_each_float, initialise_lazy};
use crate::{Error, Result};

/// One buffer: its visit position among the model's float tensors, path and shape, and the
/// engine unit whose module holds it (`None`: a unit of another pipeline stage).
#[derive(Debug, Clone)]
pub(crate) struct BufferEntry {
    position: usize,
    pub path: String,
    pub shape: Vec<usize>,
    pub unit: Option<usize>,
    /// A frozen parameter (module note): never averaged, snapshotted or saved.
    pub frozen: bool,
    /// A frozen parameter sharded at stage 3 (`engine/frozen/`): its unit's frozen part
    /// holds it, and nothing here reads or writes it.
    pub sharded: bool,
}

impl BufferEntry {
    pub fn num_elems(&self) -> usize {
        self.shape.iter().product()
    }

    /// Its visit position among the model's float tensors.
    pub fn position(&self) -> usize {
        self.position
    }
}

/// The model's buffers, in visit order.
#[derive(Debug, Clone, Default)]
pub(crate) struct Buffers {
    entries: Vec<BufferEntry>,
    /// The run's seed: reading buffers gives every parameter still lazy its value, each
    /// under its own stream of it (`random.rs`' note on initialisation).
    seed: u64,
}

/// Buffer values of one unit, to put back.
pub(crate) struct Snapshot {
    unit: usize,
    values: Vec<f32>,
}

impl Buffers {
    /// Finds `model`'s buffers; `unit_of(path)` says which engine unit holds each, `frozen`
    /// the module paths of the frozen parameters among them. `seed` is the run's, for the
    /// parameters still lazy when buffers are read.
    pub fn scan<M: Module>(model: &M, seed: u64, unit_of: impl Fn(&str) -> Option<usize>, frozen: &[String]) -> Self {
        let (mut entries, mut position) = (Vec::new(), 0);
        for_each_float(model, |float| {
            if !float.trainable {
                let path = float.path.to_string();
                let frozen = frozen.iter().any(|f| super::model::under(f, &path));
                let shape = float.shape.to_vec();
                entries.push(BufferEntry { unit: unit_of(&path), position, path, shape, frozen, sharded: false });
            }
            position += 1;
        });
        Self { entries, seed }
    }

    /// The same buffers with each unit `u` renumbered `f(u)` (`None`: held by no unit here).
    pub fn map_units(mut self, f: impl Fn(usize) -> Option<usize>) -> Self {
        for e in &mut self.entries {
            e.unit = e.unit.and_then(&f);
        }
        self
    }

    /// The buffers, in visit order.
    pub fn entries(&self) -> &[BufferEntry] {
        &self.entries
    }

    /// Marks the frozen parameters held by one of the first `units` units as sharded
    /// (stage 3: their units keep them from now on, `engine/frozen/`) and returns them, in
    /// visit order.
    pub fn shard_frozen(&mut self, units: usize) -> Vec<BufferEntry> {
        let held = |e: &BufferEntry| e.frozen && e.unit.is_some_and(|u| u < units);
        self.entries
            .iter_mut()
            .filter(|e| held(e))
            .map(|e| {
                e.sharded = true;
                e.clone()
            })
            .collect()
    }

    /// `model` with its frozen parameters that stay whole (below stage 3) cast to `dtype`,
    /// the compute dtype: they meet the trained parameters' activations in every product,
    /// as under DeepSpeed, whose engine casts the whole module (the sharded ones are
    /// gathered in it).
    pub fn cast_frozen<M: Module>(&self, model: M, dtype: FloatDType) -> M {
        struct Cast<I: Iterator<Item = usize>> {
            frozen: std::iter::Peekable<I>,
            position: usize,
            dtype: FloatDType,
        }
        impl<I: Iterator<Item = usize>> ModuleMapper for Cast<I> {
            fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
                let position = self.position;
                self.position += 1;
                match self.frozen.next_if_eq(&position) {
                    Some(_) => param.map(|t| t.cast(self.dtype)),
                    None => param,
                }
            }
        }
        let frozen = self.entries.iter().filter(|e| e.frozen && !e.sharded).map(|e| e.position).peekable();
        model.map(&mut Cast { frozen, position: 0, dtype })
    }

    /// Bytes of the frozen parameters as the model holds them now (a released stage-3
    /// one is empty).
    pub fn frozen_bytes<M: Module>(&self, model: &M) -> u64 {
        if !self.entries.iter().any(|e| e.frozen) {
            return 0;
        }
        struct Count<I: Iterator<Item = usize>> {
            frozen: std::iter::Peekable<I>,
            position: usize,
            bytes: u64,
        }
        impl<I: Iterator<Item = usize>> ModuleVisitor for Count<I> {
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
                let position = self.position;
                self.position += 1;
                // A parameter still lazy holds nothing yet.
                if self.frozen.next_if_eq(&position).is_some() && param.is_initialized() {
                    let tensor = param.val();
                    self.bytes += (tensor.shape().num_elements() * tensor.dtype().size()) as u64;
                }
            }
        }
        let frozen = self.entries.iter().filter(|e| e.frozen).map(|e| e.position).peekable();
        let mut count = Count { frozen, position: 0, bytes: 0 };
        model.visit(&mut count);
        count.bytes
    }

    /// Applies Burn's pending running-state updates (a `RunningState` keeps the last update
    /// aside until it is next read), so that what is read or written next is current.
    /// `Module::valid` gives every parameter its value: the ones still lazy (while a model
    /// is built) first get theirs under their own streams, not in the walk's order.
    fn flush<M: Module>(&self, model: &M) {
        initialise_lazy(model, self.seed);
        drop(model.valid());
    }

    /// The buffers a checkpoint saves (all but the frozen parameters), in visit order.
    pub fn saved(&self) -> impl Iterator<Item = &BufferEntry> {
        self.entries.iter().filter(|e| !e.frozen)
    }

    /// The values of the buffers `pick` selects, in f32, back to back in visit order; the
    /// others read as zeros when `zeros_elsewhere`, else are skipped. Frozen parameters
    /// are neither read nor given zeros unless `pick` selects them.
    pub fn read<M: Module>(
        &self,
        model: &M,
        pick: impl Fn(&BufferEntry) -> bool,
        zeros_elsewhere: bool,
    ) -> Result<Vec<f32>> {
        self.read_among(model, |_| true, pick, zeros_elsewhere)
    }

    /// [`read`](Self::read) over the saved buffers alone (the zeros too).
    pub fn read_saved<M: Module>(
        &self,
        model: &M,
        pick: impl Fn(&BufferEntry) -> bool,
        zeros_elsewhere: bool,
    ) -> Result<Vec<f32>> {
        self.read_among(model, |e| !e.frozen, pick, zeros_elsewhere)
    }

    fn read_among<M: Module>(
        &self,
        model: &M,
        among: impl Fn(&BufferEntry) -> bool,
        pick: impl Fn(&BufferEntry) -> bool,
        zeros_elsewhere: bool,
    ) -> Result<Vec<f32>> {
        // A sharded frozen parameter is its unit's (`engine/frozen/`), never a buffer's.
        let among = |e: &BufferEntry| !e.sharded && among(e);
        let pick = |e: &BufferEntry| among(e) && pick(e);
        let zeros = |e: &BufferEntry| zeros_elsewhere && among(e);
        if !self.entries.iter().any(|e| pick(e) || zeros(e)) {
            return Ok(Vec::new()); // nothing to read, and no parameter to initialise
        }
        self.flush(model);
        struct Reader<'a, F, Z> {
            entries: std::iter::Peekable<std::slice::Iter<'a, BufferEntry>>,
            pick: F,
            zeros: Z,
            position: usize,
            out: Vec<f32>,
            error: Option<Error>,
        }
        impl<F: Fn(&BufferEntry) -> bool, Z: Fn(&BufferEntry) -> bool> ModuleVisitor for Reader<'_, F, Z> {
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
                let position = self.position;
                self.position += 1;
                let Some(entry) = self.entries.next_if(|e| e.position == position) else { return };
                if (self.pick)(entry) {
                    match super::readout::f32s(param.val(), &format!("buffer `{}`", entry.path)) {
                        Ok(values) if values.len() == entry.num_elems() => self.out.extend(values),
                        Err(e @ Error::Device { .. }) => {
                            self.error.get_or_insert(e);
                        }
                        _ => {
                            let what = format!("buffer `{}` is not the {:?} tensor it was", entry.path, entry.shape);
                            self.error.get_or_insert(Error::Model(what));
                        }
                    }
                } else if (self.zeros)(entry) {
                    self.out.resize(self.out.len() + entry.num_elems(), 0.0);
                }
            }
        }
        let mut reader =
            Reader { entries: self.entries.iter().peekable(), pick, zeros, position: 0, out: Vec::new(), error: None };
        model.visit(&mut reader);
        reader.error.map_or(Ok(reader.out), Err)
    }

    /// Writes `values` (as [`read`](Self::read) with the same `pick` gives them, without
    /// zeros) into the picked buffers, each in its own dtype.
    pub fn write<M: Module>(&self, model: M, values: &[f32], pick: impl Fn(&BufferEntry) -> bool) -> M {
        if self.entries.is_empty() {
            return model;
        }
        self.flush(&model);
        struct Writer<'a, F> {
            entries: std::iter::Peekable<std::slice::Iter<'a, BufferEntry>>,
            pick: F,
            position: usize,
            values: &'a [f32],
        }
        impl<F: Fn(&BufferEntry) -> bool> ModuleMapper for Writer<'_, F> {
            fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
                let position = self.position;
                self.position += 1;
                let Some(entry) = self.entries.next_if(|e| e.position == position) else { return param };
                if entry.sharded || !(self.pick)(entry) {
                    return param;
                }
                let (mine, rest) = self.values.split_at(entry.num_elems());
                self.values = rest;
                let shape: [usize; D] = entry.shape.as_slice().try_into().expect("scanned from this module");
                param.map(|old| {
                    // The f32 values go in as f32 and the tensor casts itself back to its
                    // dtype: no conversion here can fail.
                    let (device, dtype) = (old.device(), old.dtype());
                    let data = TensorData::new(mine.to_vec(), shape);
                    Tensor::<D>::from_data(data, (&device, DType::F32)).cast(dtype)
                })
            }
        }
        let mut writer = Writer { entries: self.entries.iter().peekable(), pick, position: 0, values };
        model.map(&mut writer)
    }

    /// Makes every rank's buffers the average over `group` (module note); frozen parameters
    /// are left as they are.
    pub fn average<M: Module>(&self, model: M, group: &dyn Collective) -> Result<M> {
        if self.saved().next().is_none() || group.world_size() == 1 {
            return Ok(model);
        }
        let mine = self.read_saved(&model, |_| true, false)?;
        let mut reference = mine.clone();
        group.broadcast((&mut reference).into(), 0)?;
        let mut deltas: Vec<f32> = mine.iter().zip(&reference).map(|(x, r)| x - r).collect();
        group.all_reduce(BufMut::F32(&mut deltas), ReduceOp::Sum)?;
        let n = group.world_size() as f32;
        let averaged: Vec<f32> = reference.iter().zip(&deltas).map(|(r, d)| r + d / n).collect();
        Ok(self.write(model, &averaged, |e| !e.frozen))
    }

    /// Unit `unit`'s buffer values (but its frozen parameters', which nothing changes), to
    /// put back with [`restore`](Self::restore); `None` for a unit without such buffers
    /// (nothing to put back).
    pub fn snapshot<M: Module>(&self, model: &M, unit: usize) -> Result<Option<Snapshot>> {
        let mine = |e: &BufferEntry| e.unit == Some(unit) && !e.frozen;
        if !self.entries.iter().any(mine) {
            return Ok(None);
        }
        let values = self.read(model, mine, false)?;
        Ok(Some(Snapshot { unit, values }))
    }

    /// Puts a unit's buffers back as `snapshot` found them.
    pub fn restore<M: Module>(&self, model: M, snapshot: Snapshot) -> M {
        self.write(model, &snapshot.values, |e| e.unit == Some(snapshot.unit) && !e.frozen)
    }
}
