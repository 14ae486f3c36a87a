//! Running a [`UnitModel`] one unit at a time: [`Engine::forward_backward`] and
//! [`Engine::evaluate`].
//!
//! # Note: the unit walk
//! Forward runs the units in order. At stage 3 each unit is gathered just before it runs
//! (the next one is prefetched meanwhile, within `stage3_prefetch_bucket_size` and
//! `stage3_max_live_parameters`) and the root is gathered for the whole pass. With
//! activation checkpointing a unit runs without an autodiff graph, only its input (the
//! boundary activation) is kept, and at stage 3 the unit is released at once; without it,
//! each unit runs on a detached copy of its input and keeps its graph (and its gathered
//! parameters, which the graph holds anyway) until its backward.
//!
//! Backward walks the units in reverse. With checkpointing a unit is gathered again,
//! recomputed from its boundary with gradient tracking, and back-propagated by seeding its
//! output with the next unit's input gradient, `sum(y * g)`; the gradient of its own input
//! seeds the unit before. As soon as a unit's backward is done its gradients are reduced
//! (overlapping the next unit's backward with `overlap_comm`) and, at stage 3, it is
//! released. The root's gradient contributions from every unit and the loss are summed and
//! reduced last. Traffic per micro-step at stage 3: the parameters are gathered twice with
//! checkpointing (forward and recompute), once without, and gradients reduce-scattered
//! once: 3Ψ or 2Ψ, DeepSpeed's and FSDP's volumes, the root counted once for its gather.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::time::Instant;

use burn::module::Module;
use burn::optim::GradientsParams;
use zerotrain_zero::Sharding;

use super::model::{Activation, UnitModel, group};
use super::params::{UnitGrads, take_grads};
use super::{ALIGN_ELEMS, Engine, Placement};
use crate::config::Plan;
use crate::context::RankContext;
use crate::{Error, Result};

/// What the forward pass keeps of unit `i` for its backward.
pub(super) enum Saved<H> {
    /// Checkpointed, first of its group: the unit's input (`None` for the model's first
    /// unit, which reads the batch).
    Boundary(Option<H>),
    /// Checkpointed inside a group (`activation_checkpoint_interval` > 1): nothing; it is
    /// recomputed from its group's boundary.
    Inside,
    /// Its input leaf and output, with the unit's graph.
    Graph(Option<H>, H),
    /// Its backward is done.
    Done,
}

/// What the forward half returns: each unit's [`Saved`] and the last unit's output.
pub(super) type Forward<H> = (Vec<Saved<H>>, H);

/// Which way the walk goes, for prefetching.
#[derive(Clone, Copy)]
pub(super) enum Direction {
    Forward,
    Backward,
}

impl<M: UnitModel> Engine<M> {
    /// Wraps `model` like [`Engine::new`], sharded per unit as [`UnitModel::units`]
    /// declares, for [`forward_backward`](Self::forward_backward); with pipeline stages in
    /// the plan, as this rank's stage of the pipeline, for
    /// [`train_batch`](Self::train_batch).
    pub fn with_units(model: M, plan: &Plan, ctx: &RankContext) -> Result<Self> {
        let (model, params, index) = Self::scan(model, ctx)?;
        let specs = model.units();
        let paths: Vec<String> = params.iter().map(|(path, _)| path.clone()).collect();
        let (unit_of, names) = group(&paths, &specs)?;
        if let Some(pipeline) = plan.pipeline {
            return Self::pipelined(model, plan, ctx, (params, index), (unit_of, names, specs.len()), pipeline);
        }
        let unit_of: Vec<Option<usize>> = unit_of.into_iter().map(Some).collect();
        let sharding = Sharding::new(params, &unit_of, names, plan.world_size, ALIGN_ELEMS)?;
        let num_declared = specs.len();
        let placement = Placement { comm: ctx.collective(), sharding, index, num_declared, stage: None };
        Self::build(model, plan, ctx, placement)
    }

    /// One micro-step of a unit model: forward through the units and the loss, backward
    /// through the units in reverse, each unit's gradients reduced as soon as they exist
    /// (see the module note). Returns the loss value. The loss is divided by the
    /// accumulation steps and scaled like [`backward`](Self::backward)'s. Every rank must
    /// call it.
    pub fn forward_backward(&mut self, batch: &M::Batch) -> Result<f32> {
        if self.num_declared == 0 || self.stage.is_some() {
            return Err(Error::Usage(
                "forward_backward needs an engine built with Engine::with_units and no pipeline (a pipelined \
                 engine trains with train_batch)"
                    .into(),
            ));
        }
        let root = self.root();
        if let Some(root) = root {
            self.gather(root)?;
        }
        let (saved, output) = self.forward_units(None, batch)?;
        let (value, upstream, root_grads) = self.loss_backward(output, batch)?;
        let (root_grads, _) = self.backward_units(saved, upstream, root_grads, batch)?;
        self.reduce_root(root_grads)?;
        Ok(self.end_micro_step(value))
    }

    /// The loss of the last unit's `output`, back-propagated (scaled): the loss value,
    /// the gradient of `output`, and the root's gradients from the loss.
    pub(super) fn loss_backward(
        &mut self,
        output: M::Hidden,
        batch: &M::Batch,
    ) -> Result<(f32, Option<M::Hidden>, Option<UnitGrads>)> {
        let start = Instant::now();
        let last = output.leaf();
        let loss = self.model.loss(last.clone(), batch);
        let (value, scaled) = self.scale_loss(loss)?;
        self.window.times.forward += start.elapsed().as_secs_f64();
        let start = Instant::now();
        let grads = scaled.backward();
        let upstream = last.grad(&grads);
        let root_grads = self.take(GradientsParams::from_grads(grads, &self.model), None)?.root;
        self.window.times.backward += start.elapsed().as_secs_f64();
        Ok((value, upstream, root_grads))
    }

    /// Reduces the root's gradients of one micro-step (after the last unit's) and, at
    /// stage 3, releases it.
    pub(super) fn reduce_root(&mut self, grads: Option<UnitGrads>) -> Result<()> {
        if let (Some(root), Some(grads)) = (self.root(), grads) {
            let start = Instant::now();
            self.reduce_unit(root, grads, Some(0))?;
            self.window.times.reduce += start.elapsed().as_secs_f64();
            self.release(root);
        }
        Ok(())
    }

    /// Recompute every this many units in backward (0: keep every unit's graph).
    fn checkpoint_interval(&self) -> usize {
        match self.shared.plan.pipeline {
            Some(pipeline) => pipeline.checkpoint_interval,
            None => usize::from(self.shared.plan.activation_checkpointing),
        }
    }

    /// The forward half of the walk from `input` (the previous stage's output, or `None`
    /// where the first unit reads the batch): every unit in order, with or without its
    /// graph as checkpointing says. Returns what backward needs of each unit and the last
    /// output.
    pub(super) fn forward_units(&mut self, input: Option<M::Hidden>, batch: &M::Batch) -> Result<Forward<M::Hidden>> {
        let interval = self.checkpoint_interval();
        let mut saved = Vec::with_capacity(self.num_declared);
        let mut hidden: Option<M::Hidden> = input;
        for i in 0..self.num_declared {
            self.enter(i, Direction::Forward)?;
            let start = Instant::now();
            let input = hidden.take();
            if interval > 0 {
                let output = self.run_unit(i, input.clone(), batch, false)?;
                saved.push(if i % interval == 0 { Saved::Boundary(input) } else { Saved::Inside });
                hidden = Some(output);
            } else {
                let input = input.map(Activation::leaf);
                let output = self.run_unit(i, input.clone(), batch, true)?;
                hidden = Some(output.clone().detached());
                saved.push(Saved::Graph(input, output));
            }
            self.window.times.forward += start.elapsed().as_secs_f64();
            if interval > 0 {
                self.release(i);
            }
        }
        Ok((saved, hidden.expect("at least one unit")))
    }

    /// Recomputes the checkpointed group that ends at unit `last`, from its boundary,
    /// with graphs (each unit on a leaf of its own input, so each backs up on its own).
    fn recompute_group(&mut self, last: usize, saved: &mut [Saved<M::Hidden>], batch: &M::Batch) -> Result<()> {
        let first = last - last % self.checkpoint_interval().max(1);
        let Saved::Boundary(mut input) = std::mem::replace(&mut saved[first], Saved::Done) else {
            unreachable!("a checkpointed group starts with its boundary")
        };
        for (i, slot) in saved.iter_mut().enumerate().take(last + 1).skip(first) {
            self.enter(i, Direction::Backward)?;
            let start = Instant::now();
            let leaf = input.take().map(Activation::leaf);
            let output = self.run_unit(i, leaf.clone(), batch, true)?;
            self.window.times.backward += start.elapsed().as_secs_f64();
            input = Some(output.clone().detached());
            *slot = Saved::Graph(leaf, output);
        }
        Ok(())
    }

    /// The backward half: the units in reverse, each (recomputed if checkpointed) seeded
    /// with `upstream`, the gradient of the next unit's input; each unit's gradients
    /// reduced and the unit released as soon as its backward is done. Returns the root's
    /// gradients, `root_grads` (the loss's) plus every unit's contribution, and the
    /// gradient of the first unit's input (`None` where it reads the batch).
    pub(super) fn backward_units(
        &mut self,
        mut saved: Vec<Saved<M::Hidden>>,
        mut upstream: Option<M::Hidden>,
        mut root_grads: Option<UnitGrads>,
        batch: &M::Batch,
    ) -> Result<(Option<UnitGrads>, Option<M::Hidden>)> {
        for i in (0..self.num_declared).rev() {
            if !matches!(saved[i], Saved::Graph(..)) {
                self.recompute_group(i, &mut saved, batch)?;
            }
            let Saved::Graph(input, output) = std::mem::replace(&mut saved[i], Saved::Done) else {
                unreachable!("recomputed above")
            };
            let start = Instant::now();
            // No upstream gradient: nothing downstream depends on this unit's output.
            let grads = upstream.take().map(|g| output.seed(g).backward());
            upstream = grads.as_ref().zip(input.as_ref()).and_then(|(grads, input)| input.grad(grads));
            drop(input);
            // Keyed by parameter id, the gradients no longer need the unit's tensors: it is
            // released before they are flattened, so the two never coexist.
            let grads = grads.map(|grads| GradientsParams::from_grads(grads, &self.model));
            self.release(i);
            let taken = match grads {
                Some(grads) => self.take(grads, Some(i))?,
                None => UnitTake::empty(self, i),
            };
            self.window.times.backward += start.elapsed().as_secs_f64();
            let start = Instant::now();
            if let (Some(mine), Some(root)) = (taken.root, root_grads.as_mut()) {
                root.add(mine);
            }
            self.reduce_unit(i, taken.unit.expect("asked for"), (i + 1 < self.num_declared).then_some(i + 1))?;
            self.window.times.reduce += start.elapsed().as_secs_f64();
        }
        Ok((root_grads, upstream))
    }

    /// The loss of `batch` without gradients, one unit at a time (stage 3: each unit
    /// gathered and released in turn). Every rank must call it at stage 3.
    pub fn evaluate(&mut self, batch: &M::Batch) -> Result<f32> {
        if self.num_declared == 0 {
            return Err(Error::Usage("evaluate needs an engine built with Engine::with_units".into()));
        }
        if self.stage.is_some() {
            return self.evaluate_pipelined(batch);
        }
        let root = self.root();
        let root_was_released = root.is_some_and(|r| !self.units[r].is_gathered());
        if let Some(root) = root {
            self.gather(root)?;
        }
        let mut hidden = None;
        for i in 0..self.num_declared {
            let was_released = !self.units[i].is_gathered();
            self.enter(i, Direction::Forward)?;
            hidden = Some(self.run_unit(i, hidden.take(), batch, false)?);
            if was_released {
                self.release(i);
            }
        }
        let output = hidden.expect("at least one unit").detached();
        let loss = self.model.loss(output, batch).into_scalar::<f32>();
        if root_was_released && let Some(root) = root {
            self.release(root);
        }
        Ok(loss)
    }

    /// Before unit `i` runs: gathers it (stage 3) and prefetches the next unit in
    /// `direction` if the bounds allow.
    pub(super) fn enter(&mut self, i: usize, direction: Direction) -> Result<()> {
        if !self.shared.plan.zero.stage.shards_parameters() {
            return Ok(());
        }
        self.gather(i)?;
        let next = match direction {
            Direction::Forward => i + 1,
            Direction::Backward => i.wrapping_sub(1),
        };
        if next >= self.num_declared || !self.may_prefetch(i, next) {
            return Ok(());
        }
        self.units[next].fetch(&self.shared)?;
        self.note_gathered(0);
        Ok(())
    }

    /// Whether unit `next` may be fetched while unit `current` is in use: it fits the
    /// prefetch bucket, and the gathered elements beyond the unit in use stay within
    /// `stage3_max_live_parameters`.
    fn may_prefetch(&self, current: usize, next: usize) -> bool {
        let zero = &self.shared.plan.zero;
        let size = self.units[next].gathered_elems(&self.shared);
        let beyond: u64 = (0..self.units.len())
            .filter(|&id| id != current && (self.units[id].is_gathered() || self.units[id].is_fetching()))
            .map(|id| self.units[id].gathered_elems(&self.shared))
            .sum();
        !self.units[next].is_gathered()
            && size <= zero.prefetch_bucket_size
            && beyond + size <= zero.max_live_parameters
    }

    /// Runs unit `i` with or without an autodiff graph. A panic inside the model's code
    /// becomes an error (at stage 3 the likely cause is a parameter of another unit, which
    /// is an empty tensor while that unit is released).
    pub(super) fn run_unit(
        &self,
        i: usize,
        input: Option<M::Hidden>,
        batch: &M::Batch,
        graph: bool,
    ) -> Result<M::Hidden> {
        // Without a graph, the unit still runs on the autodiff model (on a detached input,
        // its output detached at once, so the graph is dropped unit by unit): the inner
        // backend's kernels need not round like the autodiff ones, and the recomputation in
        // backward must reproduce the boundary activations bit for bit.
        let unit = self.first_unit() + i;
        let run = || {
            let output = self.model.forward_unit(unit, input.map(|x| if graph { x } else { x.detached() }), batch);
            if graph { output } else { output.detached() }
        };
        catch_unwind(AssertUnwindSafe(run)).map_err(|panic| {
            let message = panic
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_default();
            let name = &self.shared.sharding.units()[i].name;
            Error::Model(format!(
                "forward_unit({unit}) (unit `{name}`) panicked: {message}; a unit may use only its own parameters \
                 and the root's (at stage 3, and in other pipeline stages, the others are empty tensors)"
            ))
        })
    }

    /// Takes the gradients of unit `unit` (if any) and of the root out of one backward
    /// pass's `grads`; any other unit's gradient is an error.
    fn take(&self, mut grads: GradientsParams, unit: Option<usize>) -> Result<UnitTake> {
        let mut wanted = vec![false; self.units.len()];
        if let Some(unit) = unit {
            wanted[unit] = true;
        }
        let root = self.root();
        if let Some(root) = root {
            wanted[root] = true;
        }
        let (index, sharding) = (&self.shared.index, &self.shared.sharding);
        let mut taken = take_grads(&self.model, &mut grads, index, sharding, &wanted)?;
        Ok(UnitTake { unit: unit.and_then(|u| taken[u].take()), root: root.and_then(|r| taken[r].take()) })
    }
}

/// One backward pass's gradients of a unit and of the root.
struct UnitTake {
    unit: Option<UnitGrads>,
    root: Option<UnitGrads>,
}

impl UnitTake {
    /// No gradients (the unit's output fed nothing): zeros for unit `i`.
    fn empty<M: Module>(engine: &Engine<M>, i: usize) -> Self {
        let entries = engine.shared.layout(i).entries().len();
        Self { unit: Some(UnitGrads::empty(entries)), root: None }
    }
}
