//! Pipeline parallelism over a [`UnitModel`]'s units: [`Engine::train_batch`].
//!
//! # Note: a pipeline stage
//! With `pipeline.stages = K`, the world's `N` ranks form `K` stages of `D = N / K`
//! data-parallel ranks ([`Topology`]). Each stage holds a contiguous run of the model's
//! declared units ([`partition`]) plus the root, and releases every other parameter: its
//! engine shards only its units, over its `D` ranks, exactly as a non-pipelined engine
//! does over the world (ZeRO stages 0-2). Each micro-batch's activations pass forward and
//! its gradients back between neighbouring stages as point-to-point messages; a stage runs
//! its forwards and backwards in the order its schedule gives (GPipe or 1F1B), recomputing
//! units from their boundaries as `activation_checkpoint_interval` says, and every stage
//! steps at the flush after its last backward.
//!
//! What is agreed across the whole world: the initial parameters (world rank 0's), the
//! gradient norm and overflow (every rank's shard of its units, the root counted on the
//! first stage only), the loss (the last stage's). The root's gradient, to which the
//! first and last stages may both contribute (a tied embedding), is summed over the stages
//! at the flush, so every stage steps its replica of it identically. Checkpoints record
//! each unit once, in the one global order, so they resume at any `K` and `D`, or without a
//! pipeline.

use std::collections::HashMap;
use std::ops::Range;
use std::sync::Arc;
use std::time::Instant;

use burn::module::Module;
use zerotrain_precision::{FlatBuf, Precision};
use zerotrain_zero::pipeline::{Topology, Work, partition, schedule};
use zerotrain_zero::{Collective, Pending, ReduceOp, Request, Sharding};

use super::exec::Saved;
use super::model::{Activation, UnitModel};
use super::params::{ParamIndex, ParamShapes, UnitGrads, agree_initial_values, release_unheld};
use super::{ALIGN_ELEMS, Engine, Placement, StepReport};
use crate::config::{PipelinePlan, Plan};
use crate::context::RankContext;
use crate::{Error, Result};

/// Where this rank sits in the pipeline.
pub(crate) struct Stage {
    /// This stage's index, `0..K`.
    pub index: usize,
    pub topology: Topology,
    /// The model's declared units this stage runs.
    pub units: Range<usize>,
    /// This rank's pipeline: one rank per stage (ranked by stage), the same data index.
    pub pipe: Arc<dyn Collective>,
}

impl Stage {
    fn is_last(&self) -> bool {
        self.index + 1 == self.topology.stages
    }
}

/// A micro-batch between its forward and its backward on this stage.
struct InFlight<M: UnitModel> {
    batch: M::Batch,
    saved: Vec<Saved<M::Hidden>>,
    /// The last stage's output, for the loss.
    output: Option<M::Hidden>,
    /// The shape and dtype of the input received, to answer with zeros if no gradient
    /// reaches it.
    input: Option<(Vec<usize>, Precision)>,
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
                Saved::Graph(input, output) => input.as_ref().map_or(0, Activation::num_bytes) + output.num_bytes(),
                Saved::Inside | Saved::Done => 0,
            })
            .sum();
        saved + self.output.as_ref().map_or(0, Activation::num_bytes)
    }
}

/// Floats in an activation's header: dtype code, rank, up to 7 dimensions.
const HEADER_LEN: usize = 9;

impl<M: UnitModel> Engine<M> {
    /// Builds this rank's pipeline stage (see the module note): the topology, the groups,
    /// the partition of the declared units, the initial values agreed over the world, and
    /// the stage's own sharding over its data-parallel group.
    pub(super) fn pipelined(
        model: M,
        plan: &Plan,
        ctx: &RankContext,
        (params, index): (ParamShapes, ParamIndex),
        (unit_of, names, declared): (Vec<usize>, Vec<String>, usize),
        pipeline: PipelinePlan,
    ) -> Result<Self> {
        let world = ctx.collective();
        let topology = Topology::new(world.world_size(), pipeline.stages)?;
        let (stage, data) = (topology.stage(world.rank()), topology.data_index(world.rank()));
        let weights: Vec<u64> = (0..declared)
            .map(|u| {
                let sizes = params.iter().zip(&unit_of).filter(|(_, owner)| **owner == u);
                sizes.map(|((_, shape), _)| shape.iter().product::<usize>() as u64).sum()
            })
            .collect();
        let parts = partition(&weights, pipeline.stages, pipeline.partition).map_err(|_| {
            Error::Model(format!(
                "pipeline.stages is {} but the model declares {declared} units: each stage needs at least one",
                pipeline.stages
            ))
        })?;
        let everything: Vec<Option<usize>> = unit_of.iter().map(|&u| Some(u)).collect();
        let full = Sharding::new(params.clone(), &everything, names.clone(), 1, 1)?;
        let model = agree_initial_values(model, world.as_ref(), &index, &full, ctx.device())?;
        let units = parts[stage].clone();
        let local: Vec<Option<usize>> = unit_of
            .iter()
            .map(|&u| if u < declared { units.contains(&u).then(|| u - units.start) } else { Some(units.len()) })
            .collect();
        let mut local_names = names[units.clone()].to_vec();
        local_names.extend(names.get(declared).cloned());
        let data_group = world.split(stage, data)?;
        let pipe = world.split(data, stage)?;
        let sharding = Sharding::new(params, &local, local_names, topology.data_parallel, ALIGN_ELEMS)?;
        let model = release_unheld(model, &index, &sharding, ctx.device());
        let num_declared = units.len();
        let stage = Some(Stage { index: stage, topology, units, pipe });
        Self::build(model, plan, ctx, Placement { comm: data_group, sharding, index, num_declared, stage })
    }

    /// One optimizer step over `gradient_accumulation_steps` micro-batches, `batch(i)`
    /// giving micro-batch `i` of this rank's data index (every stage asks for it: the first
    /// reads its inputs, the last its targets). Pipelined, the stage runs its schedule and
    /// steps at the flush; otherwise this is `forward_backward` on each micro-batch, then
    /// `step`. Every rank must call it.
    pub fn train_batch(&mut self, mut batch: impl FnMut(usize) -> M::Batch) -> Result<StepReport> {
        if self.window.micro_steps > 0 {
            return Err(Error::Usage("train_batch inside an accumulation window: call step() first".into()));
        }
        let micro_batches = self.shared.plan.batch.gradient_accumulation_steps as usize;
        let Some(pipeline) = self.shared.plan.pipeline.filter(|_| self.stage.is_some()) else {
            for i in 0..micro_batches {
                self.forward_backward(&batch(i))?;
            }
            return Ok(self.step()?.expect("the last micro-step is a boundary"));
        };
        let (index, stages) = self.stage.as_ref().map(|s| (s.index, s.topology.stages)).expect("pipelined");
        let mut in_flight: HashMap<usize, InFlight<M>> = HashMap::new();
        let mut sends = Vec::new();
        for work in schedule(pipeline.schedule, index, stages, micro_batches) {
            match work {
                Work::Forward(i) => {
                    let flight = self.forward_micro_batch(batch(i), &mut sends)?;
                    in_flight.insert(i, flight);
                    let kept: u64 = in_flight.values().map(InFlight::kept_bytes).sum();
                    self.peaks.activations = self.peaks.activations.max(kept);
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
        Ok(self.step()?.expect("the last backward is a boundary"))
    }

    /// One micro-batch's forward on this stage: receive the input (but on the first stage),
    /// run the stage's units, send the output on (but from the last stage).
    fn forward_micro_batch(&mut self, batch: M::Batch, sends: &mut Vec<Pending>) -> Result<InFlight<M>> {
        let stage = self.stage.as_ref().expect("pipelined");
        let (first, last, index) = (stage.index == 0, stage.is_last(), stage.index);
        let (input, received) = if first {
            (None, None)
        } else {
            let (hidden, shape, dtype) = self.recv_activation(index - 1)?;
            (Some(hidden), Some((shape, dtype)))
        };
        let (saved, output) = self.forward_units(input, &batch)?;
        let output = if last {
            Some(output)
        } else {
            sends.extend(self.send_activation(output, index + 1)?);
            None
        };
        Ok(InFlight { batch, saved, output, input: received })
    }

    /// One micro-batch's backward on this stage: the loss (on the last stage) or the
    /// gradient received from the next stage, back through the stage's units, the input's
    /// gradient sent back (but from the first stage).
    fn backward_micro_batch(&mut self, flight: InFlight<M>, sends: &mut Vec<Pending>) -> Result<()> {
        let stage = self.stage.as_ref().expect("pipelined");
        let (first, index) = (stage.index == 0, stage.index);
        let (value, upstream, root_grads) = match flight.output {
            Some(output) => self.loss_backward(output, &flight.batch)?,
            None => {
                // The root's gradient starts at zero here; the stage's units may add to it.
                let root = self.root().map(|r| UnitGrads::empty(self.shared.layout(r).entries().len()));
                (0.0, Some(self.recv_activation(index + 1)?.0), root)
            }
        };
        let (root_grads, input_grad) = self.backward_units(flight.saved, upstream, root_grads, &flight.batch)?;
        self.reduce_root(root_grads)?;
        if !first {
            let grad = match (input_grad, flight.input) {
                (Some(grad), _) => grad,
                // Nothing this stage computed depends on its input: its gradient is zero.
                (None, Some((shape, dtype))) => {
                    let zeros = FlatBuf::zeros(dtype, shape.iter().product());
                    M::Hidden::from_flat(zeros, &shape, &self.shared.device)?
                }
                (None, None) => unreachable!("every stage but the first receives its input"),
            };
            sends.extend(self.send_activation(grad, index - 1)?);
        }
        self.end_micro_step(value);
        Ok(())
    }

    /// Sends `hidden` to stage `to`: a header (dtype, shape), then the values. Returns the
    /// sends in flight.
    fn send_activation(&self, hidden: M::Hidden, to: usize) -> Result<[Pending; 2]> {
        let (values, shape) = hidden.into_flat()?;
        if shape.len() > HEADER_LEN - 2 {
            return Err(Error::Model(format!("activations of rank {} cannot pass between stages", shape.len())));
        }
        let mut header = vec![0.0f32; HEADER_LEN];
        header[0] = match values.dtype() {
            Precision::Fp32 => 0.0,
            Precision::Fp16 => 1.0,
            Precision::Bf16 => 2.0,
        };
        header[1] = shape.len() as f32;
        header[2..2 + shape.len()].iter_mut().zip(&shape).for_each(|(h, &d)| *h = d as f32);
        let pipe = &self.stage.as_ref().expect("pipelined").pipe;
        Ok([pipe.start(Request::Send { buf: FlatBuf::F32(header), to }), pipe.start(Request::Send { buf: values, to })])
    }

    /// Receives an activation (or gradient) from stage `from`, counting the wait.
    fn recv_activation(&mut self, from: usize) -> Result<(M::Hidden, Vec<usize>, Precision)> {
        let start = Instant::now();
        let pipe = Arc::clone(&self.stage.as_ref().expect("pipelined").pipe);
        let mut header = vec![0.0f32; HEADER_LEN];
        pipe.recv((&mut header).into(), from)?;
        let dtype = match header[0] as u32 {
            0 => Precision::Fp32,
            1 => Precision::Fp16,
            _ => Precision::Bf16,
        };
        let rank = (header[1] as usize).min(HEADER_LEN - 2);
        let shape: Vec<usize> = header[2..2 + rank].iter().map(|&d| d as usize).collect();
        let mut values = FlatBuf::zeros(dtype, shape.iter().product());
        pipe.recv(values.as_mut(), from)?;
        self.window.times.pipe_wait += start.elapsed().as_secs_f64();
        let hidden = M::Hidden::from_flat(values, &shape, &self.shared.device)?;
        Ok((hidden, shape, dtype))
    }

    /// `evaluate` through the pipeline: each stage runs its units without gradients,
    /// passing activations on; the last stage's loss is broadcast to the whole pipeline.
    pub(super) fn evaluate_pipelined(&mut self, batch: &M::Batch) -> Result<f32> {
        let stage = self.stage.as_ref().expect("pipelined");
        let (first, last, index, stages) = (stage.index == 0, stage.is_last(), stage.index, stage.topology.stages);
        let mut hidden = if first { None } else { Some(self.recv_activation(index - 1)?.0) };
        for i in 0..self.num_declared {
            hidden = Some(self.run_unit(i, hidden.take(), batch, false)?);
        }
        let output = hidden.expect("at least one unit");
        let mut loss = [0.0f32];
        if last {
            loss[0] = self.model.loss(output.detached(), batch).into_scalar::<f32>();
        } else {
            for send in self.send_activation(output, index + 1)? {
                send.wait()?;
            }
        }
        let pipe = &self.stage.as_ref().expect("pipelined").pipe;
        pipe.broadcast((&mut loss[..]).into(), stages - 1)?;
        Ok(loss[0])
    }
}

impl<M: Module> Engine<M> {
    /// Sums the root's reduced gradient over the pipeline's stages (module note).
    pub(super) fn sum_root_over_stages(&self, grads: &mut [f32]) -> Result<()> {
        if let Some(stage) = &self.stage {
            stage.pipe.all_reduce(grads.into(), ReduceOp::Sum)?;
        }
        Ok(())
    }

    /// The model's declared unit that this engine's unit 0 is (0 unless pipelined).
    pub(super) fn first_unit(&self) -> usize {
        self.stage.as_ref().map_or(0, |s| s.units.start)
    }
}
