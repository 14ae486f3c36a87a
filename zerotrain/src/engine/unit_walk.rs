//! Training a [`UnitModel`] one unit at a time: [`Engine::forward_backward`] (the
//! inference walk, [`Engine::evaluate`], is in `infer`).
//!
//! # Note: the unit walk
//! Forward runs the units in order. At stage 3 each unit is gathered just before it runs
//! (the next one is prefetched meanwhile, within `stage3_prefetch_bucket_size` and
//! `stage3_max_live_parameters`) and the root is gathered for the whole pass. With
//! activation checkpointing a unit runs without an autodiff graph, only its input (the
//! boundary activation) is kept, and at stage 3 the unit is released at once; without it,
//! each unit runs on a detached copy of its input and keeps its graph (and its gathered
//! parameters, which the graph holds anyway) until its backward. `recompute_units`
//! checkpoints only the first units and keeps the rest's graphs: the forward that
//! recomputation repeats shrinks with the units recomputed, and the memory kept grows with
//! the units not.
//!
//! Backward walks the units in reverse. With checkpointing a unit is gathered again,
//! recomputed from its boundary with gradient tracking, and back-propagated by seeding its
//! output with the next unit's input gradient, `sum(y * g)`, plus its own loss term if it
//! has one; the gradient of its own input seeds the unit before. As soon as a unit's
//! backward is done its gradients are reduced (overlapping the next unit's backward with
//! `overlap_comm`) and, at stage 3, it is released. The root's gradient contributions from
//! every unit and the loss are summed and reduced last. Traffic per micro-step at stage 3:
//! the parameters are gathered twice with checkpointing (forward and recompute), once
//! without, and gradients reduce-scattered once: 3Ψ or 2Ψ, DeepSpeed's and FSDP's volumes,
//! the root counted once for its gather.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::time::Instant;

use burn::module::Module;
use burn::optim::GradientsParams;
use burn::tensor::{FloatDType, Tensor};

use super::gathering::Direction;
use super::model::{Activation, UnitModel};
use super::params::UnitGrads;
use super::report::LossValues;
use super::{Engine, Granularity};
use crate::error::panic_message;
use crate::random;
use crate::{Error, Result};

/// What the forward pass keeps of unit `i` for its backward.
#[allow(clippy::large_enum_variant, reason = "one per unit, alive for a step: boxing would allocate per unit")]
pub(super) enum Saved<H> {
    /// Checkpointed, first of its group: the unit's input (`None` for the model's first
    /// unit, which reads the batch).
    Boundary(Option<H>),
    /// Checkpointed inside a group (`activation_checkpoint_interval` > 1): nothing; it is
    /// recomputed from its group's boundary.
    Inside,
    /// Its input leaf, output and loss term, with the unit's graph.
    Graph { input: Option<H>, output: H, term: Option<Tensor<1>> },
    /// Its backward is done.
    Done,
}

/// What the forward half returns: each unit's [`Saved`], the last unit's output, and the
/// units' loss terms (read once the micro-step is queued).
pub(super) type Forward<H> = (Vec<Saved<H>>, H, LossValues);

/// How a unit runs: in training, drawing from micro-batch `micro`'s streams (see
/// [`crate::random`]), with or without an autodiff `graph`; or in inference mode.
#[derive(Clone, Copy)]
pub(super) enum Pass {
    Train { micro: u64, graph: bool },
    Infer,
}

impl<M: UnitModel> Engine<M> {
    /// One micro-step of a unit model: forward through the units and the loss, backward
    /// through the units in reverse, each unit's gradients reduced as soon as they exist
    /// (see the module note). Returns the loss value (with the units' loss terms). The loss
    /// is divided by the accumulation steps and scaled like [`backward`](Self::backward)'s.
    /// Every rank must call it.
    pub fn forward_backward(&mut self, batch: &M::Batch) -> Result<f32> {
        if !matches!(self.granularity, Granularity::Declared { .. }) {
            return Err(Error::Usage(
                "forward_backward needs an engine built with Engine::with_units (Engine::new runs the model as \
                 one unit: use forward and backward)"
                    .into(),
            ));
        }
        self.whole()?;
        self.check_batch_size(batch);
        if let Some(root) = self.granularity.root() {
            self.gather(root)?;
        }
        let micro = self.window.micro_steps;
        let (saved, output, terms) = self.forward_units(None, batch, micro)?;
        let (value, upstream, root_grads) = self.loss_backward(output, batch, micro)?;
        let (root_grads, _) = self.backward_units(saved, upstream, root_grads, batch, micro)?;
        self.reduce_root(root_grads)?;
        let value = self.read_micro_step(value, terms)?;
        Ok(self.end_micro_step(value))
    }

    /// One optimizer step: [`forward_backward`](Self::forward_backward) on each of the
    /// `gradient_accumulation_steps` micro-batches `batch(i)`, then [`step`](Self::step)
    /// (a [`Pipeline`](super::Pipeline) stage's `train_batch` runs its schedule instead).
    /// Every rank must call it.
    pub fn train_batch(&mut self, mut batch: impl FnMut(usize) -> M::Batch) -> Result<super::StepReport> {
        if self.window.micro_steps > 0 {
            return Err(Error::Usage("train_batch inside an accumulation window: call step() first".into()));
        }
        for i in 0..self.shared.plan.batch.gradient_accumulation_steps as usize {
            self.forward_backward(&batch(i))?;
        }
        self.step()?.ok_or_else(|| {
            Error::Usage("train_batch's last micro-step was no boundary (set_gradient_accumulation_boundary?)".into())
        })
    }

    /// Warns once when `batch` is not the configured micro-batch size (if the model says).
    pub(super) fn check_batch_size(&mut self, batch: &M::Batch) {
        let expected = self.shared.plan.batch.micro_batch_per_rank;
        if let Some(n) = self.model.batch_size(batch).filter(|&n| n as u64 != expected) {
            self.notices.warn(format!(
                "a micro-batch of {n} samples where train_micro_batch_size_per_gpu is {expected}: its mean loss \
                 weighs like a full micro-batch's"
            ));
        }
    }

    /// The loss of the last unit's `output` for micro-batch `micro`, back-propagated
    /// (scaled): the loss value, the gradient of `output`, and the root's gradients from the
    /// loss.
    pub(super) fn loss_backward(
        &mut self,
        output: M::Hidden,
        batch: &M::Batch,
        micro: u64,
    ) -> Result<(LossValues, Option<M::Hidden>, Option<UnitGrads>)> {
        let start = Instant::now();
        let last = output.leaf();
        let draw = self.draw(micro, random::LOSS);
        let loss = self.shared.streams.run(&self.shared.device, draw, || self.model.output_loss(last.clone(), batch));
        let (value, scaled) = self.scale_loss(loss)?;
        self.window.times.forward += self.shared.phase_seconds(start);
        let start = Instant::now();
        let grads = scaled.backward();
        let upstream = last.grad(&grads);
        let root_grads = self.take(GradientsParams::from_grads(grads, &self.model), None)?.root;
        self.window.times.backward += self.shared.phase_seconds(start);
        Ok((LossValues::of(value), upstream, root_grads))
    }

    /// Reduces the root's gradients of one micro-step (after the last unit's) and, at
    /// stage 3, releases it.
    pub(super) fn reduce_root(&mut self, grads: Option<UnitGrads>) -> Result<()> {
        if let (Some(root), Some(grads)) = (self.granularity.root(), grads) {
            let start = Instant::now();
            self.reduce_unit(root, grads, Some(0))?;
            self.window.times.reduce += self.shared.phase_seconds(start);
            self.release(root);
        }
        Ok(())
    }

    /// The declared units and the recomputation interval (0: keep every unit's graph).
    pub(super) fn walk(&self) -> (usize, usize) {
        match self.granularity {
            Granularity::Declared { declared, recompute_every, .. } => (declared, recompute_every),
            Granularity::WholeModel => unreachable!("the unit walk runs declared units"),
        }
    }

    /// The forward half of the walk of micro-batch `micro` from `input` (the previous
    /// stage's output, or `None` where the first unit reads the batch): every unit in
    /// order, with or without its graph as checkpointing says. Returns what backward needs
    /// of each unit, the last output and the units' loss terms' sum.
    pub(super) fn forward_units(
        &mut self,
        input: Option<M::Hidden>,
        batch: &M::Batch,
        micro: u64,
    ) -> Result<Forward<M::Hidden>> {
        let (declared, interval) = self.walk();
        let (mut saved, mut terms) = (Vec::with_capacity(declared), LossValues::default());
        let mut hidden: Option<M::Hidden> = input;
        for i in 0..declared {
            self.enter(i, Direction::Forward)?;
            let start = Instant::now();
            let input = hidden.take();
            let checkpointed = self.granularity.recomputes(i);
            if checkpointed {
                let (output, term) = self.run_unit(i, input.clone(), batch, Pass::Train { micro, graph: false })?;
                if let Some(term) = &term {
                    terms.push(term.clone());
                }
                saved.push(if i % interval == 0 { Saved::Boundary(input) } else { Saved::Inside });
                hidden = Some(output);
            } else {
                let input = input.map(Activation::leaf);
                let (output, term) = self.run_unit(i, input.clone(), batch, Pass::Train { micro, graph: true })?;
                if let Some(term) = &term {
                    terms.push(term.clone());
                }
                hidden = Some(output.clone().detached());
                saved.push(Saved::Graph { input, output, term });
            }
            self.window.times.forward += self.shared.phase_seconds(start);
            if checkpointed {
                self.release(i);
            }
        }
        Ok((saved, hidden.expect("at least one unit"), terms))
    }

    /// Recomputes the checkpointed group that ends at unit `last`, from its boundary,
    /// with graphs (each unit on a leaf of its own input, so each backs up on its own),
    /// drawing what micro-batch `micro`'s forward drew. Each unit's buffers are put back
    /// after its second forward (note in `buffers.rs`).
    fn recompute_group(
        &mut self,
        last: usize,
        saved: &mut [Saved<M::Hidden>],
        batch: &M::Batch,
        micro: u64,
    ) -> Result<()> {
        let first = last - last % self.walk().1.max(1);
        let Saved::Boundary(mut input) = std::mem::replace(&mut saved[first], Saved::Done) else {
            unreachable!("a checkpointed group starts with its boundary")
        };
        for (i, slot) in saved.iter_mut().enumerate().take(last + 1).skip(first) {
            self.enter(i, Direction::Backward)?;
            let start = Instant::now();
            let leaf = input.take().map(Activation::leaf);
            let before = self.buffers.snapshot(&self.model, i)?;
            let (output, term) = self.run_unit(i, leaf.clone(), batch, Pass::Train { micro, graph: true })?;
            if let Some(before) = before {
                let model = self.model.clone();
                self.model = self.buffers.restore(model, before);
            }
            self.window.times.backward += self.shared.phase_seconds(start);
            input = Some(output.clone().detached());
            *slot = Saved::Graph { input: leaf, output, term };
        }
        Ok(())
    }

    /// The backward half of micro-batch `micro`: the units in reverse, each (recomputed if
    /// checkpointed) seeded with `upstream`, the gradient of the next unit's input, and its
    /// own loss term; each unit's gradients reduced and the unit released as soon as its
    /// backward is done. Returns the root's gradients, `root_grads` (the loss's) plus every
    /// unit's contribution, and the gradient of the first unit's input (`None` where it
    /// reads the batch).
    pub(super) fn backward_units(
        &mut self,
        mut saved: Vec<Saved<M::Hidden>>,
        mut upstream: Option<M::Hidden>,
        mut root_grads: Option<UnitGrads>,
        batch: &M::Batch,
        micro: u64,
    ) -> Result<(Option<UnitGrads>, Option<M::Hidden>)> {
        let declared = self.walk().0;
        for i in (0..declared).rev() {
            if !matches!(saved[i], Saved::Graph { .. }) {
                self.recompute_group(i, &mut saved, batch, micro)?;
            }
            let Saved::Graph { input, output, term } = std::mem::replace(&mut saved[i], Saved::Done) else {
                unreachable!("recomputed above")
            };
            let start = Instant::now();
            let seed = match (upstream.take(), term.map(|t| self.scaled(t.cast(FloatDType::F32)))) {
                (Some(g), None) => Some(output.seed(g)),
                (Some(g), Some(term)) => Some(output.seed(g).cast(FloatDType::F32) + term),
                (None, term) => term,
            };
            // No seed: nothing downstream depends on this unit's output. An untracked seed:
            // nothing that trains fed the unit (frozen layers reading the batch).
            let grads = seed.filter(Tensor::is_tracked).map(|seed| seed.backward());
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
            self.window.times.backward += self.shared.phase_seconds(start);
            let start = Instant::now();
            if let (Some(mine), Some(root)) = (taken.root, root_grads.as_mut()) {
                root.add(mine)?;
            }
            let unit = taken.unit.unwrap_or_else(|| UnitGrads::empty(self.shared.layout(i).entries().len()));
            self.reduce_unit(i, unit, (i + 1 < declared).then_some(i + 1))?;
            self.window.times.reduce += self.shared.phase_seconds(start);
        }
        Ok((root_grads, upstream))
    }

    /// Runs unit `i` as `pass` says: in training on the training model, drawing from the
    /// unit's stream of the micro-batch; in inference mode on the valid model. Returns its
    /// output and loss term. A panic inside the model's code becomes an error (at stage 3
    /// the likely cause is a parameter of another unit, which is an empty tensor while that
    /// unit is released).
    pub(super) fn run_unit(
        &self,
        i: usize,
        input: Option<M::Hidden>,
        batch: &M::Batch,
        pass: Pass,
    ) -> Result<(M::Hidden, Option<Tensor<1>>)> {
        // Without a graph, a training run still uses the autodiff model (on a detached
        // input, its output detached at once): the inner backend's kernels need not round
        // like the autodiff ones, and the recomputation in backward must reproduce the
        // boundary activations bit for bit. Its parameters are untracked for the pass
        // (`no_grad`), so nothing is recorded at all: Burn's autodiff frees a graph only at
        // a backward through it, and one recorded here would keep every weight the unit's
        // products saved for backward (at stage 3, the gathered unit's) until then.
        let unit = self.span.first_unit + i;
        let run = || match pass {
            Pass::Train { micro, graph } => {
                let input = input.map(|x| if graph { x } else { x.detached() });
                let draw = self.draw(micro, unit as u64);
                let untracked = (!graph).then(|| self.model.clone().no_grad());
                let model = untracked.as_ref().unwrap_or(&self.model);
                let forward = || model.forward_unit_with_loss(unit, input, batch);
                let (output, term) = self.shared.streams.run(&self.shared.device, draw, forward);
                if graph { (output, term) } else { (output.detached(), term.map(|t| t.detach())) }
            }
            Pass::Infer => {
                let output = self.model.valid().forward_unit(unit, input.map(Activation::detached), batch);
                (output.detached(), None)
            }
        };
        catch_unwind(AssertUnwindSafe(run)).map_err(|panic| {
            let name = &self.shared.sharding.units()[i].name;
            Error::Model(format!(
                "forward_unit({unit}) (unit `{name}`) panicked: {}; a unit may use only its own parameters and the \
                 root's (at stage 3, and in other pipeline stages, the others are empty tensors)",
                panic_message(panic.as_ref())
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
        let root = self.granularity.root();
        if let Some(root) = root {
            wanted[root] = true;
        }
        let mut taken = self.shared.take_grads(&self.model, &mut grads, &wanted)?;
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
