//! Pipeline parallelism over a [`UnitModel`]'s units: [`Pipeline`], one rank's stage.
//!
//! # Note: a pipeline stage
//! With `pipeline.stages = K`, the world's `N` ranks form `K` stages of `D = N / K`
//! data-parallel ranks ([`Topology`](zerotrain_zero::pipeline::Topology)). Each stage
//! holds a contiguous run of the model's declared units plus the root, and releases every
//! other parameter (`stage_values.rs`). A stage is an ordinary [`Engine`] over its units, sharded
//! over its `D` ranks exactly as a data-parallel engine is over the world (ZeRO stages
//! 0-2); what a stage adds is here: the schedule. Each micro-batch's activations pass
//! forward and its gradients back between neighbouring stages as point-to-point messages
//! (`wire.rs`: device tensors where the collectives read device memory); a stage runs its forwards and backwards in the order its schedule gives
//! (GPipe or 1F1B), recomputing units from their boundaries as
//! `activation_checkpoint_interval` says, and every stage steps at the flush after its
//! last backward.
//!
//! What is agreed across the whole world: the initial parameters (world rank 0's), the
//! gradient norm and overflow (every rank's shard of its units, the root counted on the
//! first stage only), the loss. The root's gradient, to which the first and last stages may
//! both contribute (a tied embedding), is summed over the stages at the flush, so every
//! stage steps its replica of it identically. Checkpoints record each unit once, in the one
//! global order, so they resume at any `K` and `D`, or without a pipeline.
//!
//! On a device mesh the pipeline's world is the job's ranks of one tensor index
//! (`mesh.rs`' note on pipelines): its `D` ranks per stage are the stage's data-parallel
//! and sequence ranks, each holding that tensor part of its units; the engine's tensor
//! share adds the tensor group.

mod stage_values;
mod wire;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use zerotrain_precision::Precision;
use zerotrain_zero::pipeline::{ScheduleKind, Work, schedule};
use zerotrain_zero::{Collective, CommStats, Sharding};

pub(super) use self::stage_values::place;
use self::wire::{Direction, Outgoing, Wire};
use super::model::{Activation, UnitModel};
use super::params::UnitGrads;
use super::report::LossValues;
use super::unit_walk::Saved;
use super::{Counters, Engine, LoadOptions, MemoryReport, StepReport};
use crate::config::{PipelinePlan, Plan};
use crate::context::RankContext;
use crate::{Error, Result};

/// One rank's stage of a pipeline (module note): an [`Engine`] over the stage's units and
/// the schedule that moves micro-batches through the stages. Build it with
/// [`Pipeline::new`] under a plan with a `pipeline` section.
pub struct Pipeline<M: UnitModel> {
    engine: Engine<M>,
    schedule: ScheduleKind,
    /// This data index's ranks on every stage, ranked by stage.
    pipe: Arc<dyn Collective>,
    /// The messages to the neighbouring stages.
    wire: Wire,
    /// Every stage's run of the model's declared units.
    parts: Vec<std::ops::Range<usize>>,
}

/// A micro-batch between its forward and its backward on this stage.
struct InFlight<M: UnitModel> {
    /// Its index in the step (which random streams its units draw from).
    micro: u64,
    batch: M::Batch,
    saved: Vec<Saved<M::Hidden>>,
    /// The last stage's output, for the loss.
    output: Option<M::Hidden>,
    /// The units' loss terms of its forward.
    terms: LossValues,
    /// The parts (dtype, shape) of the input received, to answer with zeros if no gradient
    /// reaches it.
    input: wire::Shapes,
}

impl<M: UnitModel> InFlight<M> {
    /// Bytes of the activations kept for the backward: the units' boundaries (inputs and
    /// outputs of those that keep a graph, not the graphs' insides) and the last output.
    fn kept_bytes(&self) -> u64 {
        let saved: u64 = self
            .saved
            .iter()
            .map(|s| match s {
                Saved::Boundary(input) => input.as_ref().map_or(0, Activation::num_bytes),
                Saved::Graph { input, output, .. } => {
                    input.as_ref().map_or(0, Activation::num_bytes) + output.num_bytes()
                }
                Saved::Inside | Saved::Done => 0,
            })
            .sum();
        saved + self.output.as_ref().map_or(0, Activation::num_bytes)
    }
}

impl<M: UnitModel> Pipeline<M> {
    /// This rank's stage of `model` under `plan`'s `pipeline` section: the stage's units,
    /// sharded over its data-parallel ranks, starting from world rank 0's values. Every
    /// rank must call it.
    pub fn new(model: M, plan: &Plan, ctx: &RankContext) -> Result<Self> {
        Engine::builder(model, plan, ctx).build_pipeline()
    }

    pub(super) fn from_engine(
        engine: Engine<M>,
        plan: PipelinePlan,
        parts: Vec<std::ops::Range<usize>>,
    ) -> Result<Self> {
        let pipe = engine.span.pipe.clone().ok_or_else(|| Error::Usage("a pipeline stage needs its pipe".into()))?;
        let wire = Wire::new(&pipe)?;
        Ok(Self { engine, schedule: plan.schedule, pipe, wire, parts })
    }

    /// This rank's stage, `0..num_stages()`.
    pub fn stage(&self) -> usize {
        self.engine.span.stage
    }

    /// Stages `K`.
    pub fn num_stages(&self) -> usize {
        self.engine.span.topology.stages
    }

    /// This rank's index among its stage's data-parallel ranks: which part of each batch
    /// its micro-batches are.
    pub fn data_parallel_rank(&self) -> usize {
        self.engine.data_parallel_rank()
    }

    /// Data-parallel ranks per stage `D` (on a mesh, the stage's data-parallel places).
    pub fn data_parallel_size(&self) -> usize {
        self.engine.data_parallel_size()
    }

    /// One optimizer step over `gradient_accumulation_steps` micro-batches, `batch(i)`
    /// giving micro-batch `i` of this rank's data index (every stage asks for it: the first
    /// reads its inputs, the last its targets). The stage runs its schedule and steps at
    /// the flush. Every rank must call it.
    pub fn train_batch(&mut self, mut batch: impl FnMut(usize) -> M::Batch) -> Result<StepReport> {
        self.engine.whole()?;
        if self.engine.window.micro_steps > 0 {
            return Err(Error::Usage("train_batch inside an accumulation window: call step() first".into()));
        }
        let micro_batches = self.engine.shared.plan.batch.gradient_accumulation_steps as usize;
        let (stage, stages) = (self.stage(), self.num_stages());
        let mut in_flight: HashMap<usize, InFlight<M>> = HashMap::new();
        let mut sends = Vec::new();
        for work in schedule(self.schedule, stage, stages, micro_batches) {
            match work {
                Work::Forward(i) => {
                    let flight = self.forward_micro_batch(i as u64, batch(i), &mut sends)?;
                    in_flight.insert(i, flight);
                    let kept: u64 = in_flight.values().map(InFlight::kept_bytes).sum();
                    self.engine.peaks.activations = self.engine.peaks.activations.max(kept);
                }
                Work::Backward(i) => {
                    let flight = in_flight.remove(&i).expect("a schedule runs each forward before its backward");
                    self.backward_micro_batch(flight, &mut sends)?;
                }
            }
        }
        for send in sends {
            send.wait()?;
        }
        self.engine.step()?.ok_or_else(|| Error::Usage("the last backward of a pipeline step was no boundary".into()))
    }

    /// Micro-batch `micro`'s forward on this stage: receive the input (but on the first
    /// stage), run the stage's units, send the output on (but from the last stage).
    fn forward_micro_batch(&mut self, micro: u64, batch: M::Batch, sends: &mut Vec<Outgoing>) -> Result<InFlight<M>> {
        let (first, last, stage) = (self.stage() == 0, self.stage() + 1 == self.num_stages(), self.stage());
        self.engine.check_batch_size(&batch);
        let (input, received) = if first {
            (None, Vec::new())
        } else {
            self.recv_activation(Direction::Forward).map(|(h, r)| (Some(h), r))?
        };
        let (saved, output, terms) = self.engine.forward_units(input, &batch, micro)?;
        let output = if last {
            Some(output)
        } else {
            let parts = self.wire.parts(output, &self.engine.shared.device)?;
            sends.extend(self.wire.send(parts, Direction::Forward, stage + 1)?);
            None
        };
        Ok(InFlight { micro, batch, saved, output, terms, input: received })
    }

    /// One micro-batch's backward on this stage: the loss (on the last stage) or the
    /// gradient received from the next stage, back through the stage's units, the input's
    /// gradient sent back (but from the first stage).
    fn backward_micro_batch(&mut self, flight: InFlight<M>, sends: &mut Vec<Outgoing>) -> Result<()> {
        let (first, stage) = (self.stage() == 0, self.stage());
        let (value, upstream, root_grads) = match flight.output {
            Some(output) => self.engine.loss_backward(output, &flight.batch, flight.micro)?,
            None => {
                // The root's gradient starts at zero here; the stage's units may add to it.
                let engine = &self.engine;
                let root = engine.granularity.root().map(|r| UnitGrads::empty(engine.shared.layout(r).entries().len()));
                (LossValues::default(), Some(self.recv_activation(Direction::Backward)?.0), root)
            }
        };
        let engine = &mut self.engine;
        let (root_grads, input_grad) =
            engine.backward_units(flight.saved, upstream, root_grads, &flight.batch, flight.micro)?;
        engine.reduce_root(root_grads)?;
        if !first {
            let device = &engine.shared.device;
            let parts = match input_grad {
                Some(grad) => self.wire.parts(grad, device)?,
                // Nothing this stage computed depends on its input: its gradient is zero.
                None => self.wire.zeros(flight.input, device),
            };
            sends.extend(self.wire.send(parts, Direction::Backward, stage - 1)?);
        }
        let value = value.read_with(flight.terms, |tensors| engine.shared.read_values(tensors, "the loss"))?;
        engine.end_micro_step(value);
        Ok(())
    }

    /// Receives an activation from the stage before (`Forward`) or its gradient from the
    /// stage after (`Backward`), counting the wait; returns it and its parts' dtypes and
    /// shapes.
    fn recv_activation(&mut self, direction: Direction) -> Result<(M::Hidden, wire::Shapes)> {
        let start = Instant::now();
        let from = match direction {
            Direction::Forward => self.stage() - 1,
            Direction::Backward => self.stage() + 1,
        };
        let received = self.wire.recv(direction, from, &self.engine.shared.device)?;
        self.engine.window.times.pipe_wait += start.elapsed().as_secs_f64();
        Ok(received)
    }

    /// The bytes of activations and gradients this stage has sent, by the way they went:
    /// as device tensors where the pipe's collectives read device memory (NCCL's), else
    /// through host memory.
    pub fn activation_traffic(&self) -> crate::nn::parallel::GroupTraffic {
        self.wire.traffic()
    }

    /// The loss of `batch` without gradients, through the stages in inference mode (each
    /// stage runs its units and passes the activation on), as
    /// [`Engine::evaluate`] computes it; the last stage's loss is broadcast to the whole
    /// pipeline. No rank holds more than its stage. Every rank must call it.
    pub fn evaluate(&mut self, batch: &M::Batch) -> Result<f32> {
        let paused = self.engine.window.pause(self.engine.traffic());
        let loss = self.engine.sync_buffers().and_then(|()| self.evaluate_stages(batch));
        self.engine.window.resume(paused, self.engine.traffic());
        loss
    }

    /// [`evaluate`](Self::evaluate) of each of `batches`, one by one through the stages.
    pub fn evaluate_many(&mut self, batches: &[M::Batch]) -> Result<Vec<f32>> {
        batches.iter().map(|batch| self.evaluate(batch)).collect()
    }

    fn evaluate_stages(&mut self, batch: &M::Batch) -> Result<f32> {
        let (first, last, stage) = (self.stage() == 0, self.stage() + 1 == self.num_stages(), self.stage());
        let input = if first { None } else { Some(self.recv_activation(Direction::Forward)?.0) };
        let output = self.engine.infer_units(input, batch)?;
        let mut loss = [0.0f32];
        if last {
            let value = self.engine.model.valid().output_loss(output, batch);
            loss[0] = crate::engine::readout::read_scalar(value, "the evaluation loss")?;
            self.engine.sequence_mean(&mut loss)?;
        } else {
            let parts = self.wire.parts(output, &self.engine.shared.device)?;
            for send in self.wire.send(parts, Direction::Forward, stage + 1)? {
                send.wait()?;
            }
        }
        self.pipe.broadcast((&mut loss[..]).into(), self.num_stages() - 1)?;
        Ok(loss[0])
    }

    /// Saves a checkpoint ([`Engine::save_checkpoint`]): each unit once, from the stage that
    /// holds it. Every rank must call it.
    pub fn save_checkpoint(
        &mut self,
        dir: impl AsRef<Path>,
        tag: Option<&str>,
        client_state: serde_json::Value,
    ) -> Result<PathBuf> {
        self.engine.save_checkpoint(dir, tag, client_state)
    }

    /// Loads a checkpoint saved at any shape, pipelined or not ([`Engine::load_checkpoint`]).
    pub fn load_checkpoint(
        &mut self,
        dir: impl AsRef<Path>,
        tag: Option<&str>,
        options: LoadOptions,
    ) -> Result<serde_json::Value> {
        self.engine.load_checkpoint(dir, tag, options)
    }

    /// The whole model's fp32 master weights in the global order, every stage contributing
    /// its units ([`Engine::master_params`]); every rank gets them all. Every rank must call
    /// it.
    pub fn master_params(&self) -> Result<Vec<f32>> {
        self.engine.master_params()
    }

    /// The whole model on world rank `root` only (`None` elsewhere): each stage's first
    /// data-parallel rank sends its units' parameters there (the root's from the first
    /// stage), with the buffers. Every rank must call it.
    pub fn gather_model(&mut self, root: usize) -> Result<Option<M>> {
        stage_values::gather_model(self, root)
    }

    /// Writes the whole model to one safetensors file from world rank 0
    /// ([`Engine::save_model`]). Every rank must call it.
    pub fn save_model(&mut self, path: impl AsRef<Path>, dtype: Precision) -> Result<()> {
        let written = match self.gather_model(0)? {
            Some(model) => super::export::write_safetensors(&model, path.as_ref(), dtype),
            None => Ok(()),
        };
        self.engine.agree(written, "writing the model")
    }

    /// Averages the buffers over the stage's data-parallel ranks ([`Engine::sync_buffers`]).
    pub fn sync_buffers(&mut self) -> Result<()> {
        self.engine.sync_buffers()
    }

    /// Step counters.
    pub fn counters(&self) -> Counters {
        self.engine.counters()
    }

    /// This rank's model-state bytes, with the activations the schedule kept.
    pub fn memory_report(&self) -> MemoryReport {
        self.engine.memory_report()
    }

    /// This rank's traffic: the world's, its data-parallel group's and its pipe's.
    pub fn comm_stats(&self) -> CommStats {
        self.engine.comm_stats()
    }

    /// The learning rate the next step will use ([`Engine::get_lr`]).
    pub fn get_lr(&self) -> f64 {
        self.engine.get_lr()
    }

    /// Sets the learning rate by hand ([`Engine::set_lr`]).
    pub fn set_lr(&mut self, lr: Option<f64>) {
        self.engine.set_lr(lr);
    }

    /// The report of the last step.
    pub fn last_step(&self) -> Option<StepReport> {
        self.engine.last_step()
    }

    /// The stage's units and their layouts over its data-parallel ranks.
    pub fn sharding(&self) -> &Sharding {
        self.engine.sharding()
    }

    /// The model's trainable elements Ψ (all stages).
    pub fn num_params(&self) -> usize {
        self.engine.num_params()
    }

    /// The plan.
    pub fn plan(&self) -> &Plan {
        self.engine.plan()
    }

    /// The model as this rank holds it: other stages' parameters are empty tensors.
    pub fn module(&self) -> &M {
        self.engine.module()
    }

    /// One-time warnings the stage gave ([`Engine::notices`]).
    pub fn notices(&self) -> &[String] {
        self.engine.notices()
    }
}
