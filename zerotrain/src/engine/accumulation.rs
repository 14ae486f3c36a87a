//! Gradient accumulation and reduction of one unit, by what the stage shards.
//!
//! # Note: why reduce-scatter per micro-step
//! Stages 0-1 keep a full-size accumulator per unit, add each micro-step's local gradients
//! into it and reduce once, at the accumulation boundary (the least communication). Stages
//! 2-3 keep only their shard: each micro-step's gradients are reduce-scattered in buckets
//! and added to the shard accumulator, so no full-size *accumulator* exists (the unit's
//! per-parameter gradients of one backward pass exist whole until they are copied into
//! buckets: Burn produces them per parameter). The two orders sum the same numbers
//! differently, so with accumulation > 1 stages 0-1 and 2-3 can differ in the last bits;
//! with accumulation 1 all four stages are bitwise identical.
//!
//! # Note: reductions in flight
//! A reduction starts as soon as backward has produced the unit's gradients and, with
//! `overlap_comm`, runs on the rank's communication thread while the next unit's backward
//! computes; its result is added to the accumulator when the engine *settles* the unit
//! (before the next unit's reduction starts, and at the step). Without `overlap_comm` every
//! reduction is settled as soon as it starts.
//!
//! # Note: the accumulator's states
//! [`GradState`]: `Accumulating` through the window (stages 2-3 with bucket reductions in
//! flight); stages 0-1 at the boundary hand the accumulator to its reduction
//! (`Reducing`), which settles into the optimizer range's reduced gradient (`Reduced`);
//! the step takes it and the unit is `Idle` until the next window's first reduction
//! allocates its accumulator. A backward pass after the boundary and before the step is an
//! error, not a lost gradient. A device-resident step (`engine/flat.rs`) keeps its
//! accumulator on the device (`OnDevice`) and reduces it there in the same order: one rank
//! has nothing to reduce (the accumulator is the reduced gradient at the step); with
//! several, stages 2-3 reduce-scatter each micro-step's gradients into the shard
//! accumulator, and stages 0-1 reduce the accumulator at the boundary (`DeviceReduced`).

use std::collections::VecDeque;
use std::ops::Range;

use burn::tensor::{Device, Tensor};
use zerotrain_precision::{BufMut, FlatBuf, Precision};
use zerotrain_zero::{Collective, DeviceOp, FlatLayout, Pending, ReduceOp, Request, ZeroStage};

use super::flat::{Flat, float_dtype, tensor, tensor_bytes, zeros};
use super::params::UnitGrads;
use super::report::PhaseTimes;
use super::shared::Shared;
use crate::{Error, Result};

/// Buckets of one unit in flight at once (stages 2-3): a larger unit waits for its oldest
/// bucket before starting another, so at most this many bucket buffers exist.
const MAX_BUCKETS_IN_FLIGHT: usize = 2;

/// How one backward pass's gradients of a unit are reduced.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ReduceOptions {
    /// Stage 1: reduce-scatter (true) or all-reduce (false) at the boundary.
    pub reduce_scatter: bool,
    /// The dtype gradients travel in.
    pub comm_dtype: Precision,
    /// Elements per reduce-scatter bucket over all ranks (stages 2-3).
    pub bucket_elems: u64,
    /// The first micro-step of the accumulation window: the accumulator is overwritten.
    pub first: bool,
    /// The last micro-step: stages 0-1 reduce their accumulators now.
    pub boundary: bool,
    /// Leave reductions in flight (`overlap_comm`) instead of settling them at once.
    pub overlap: bool,
}

/// A bucket's reduce-scatter in flight: its range of the shard, and whether its result is
/// added to the accumulator (false in the window's first micro-step).
#[derive(Debug)]
struct Bucket {
    range: Range<usize>,
    add: bool,
    pending: Pending,
}

/// Where a unit's gradient is (module note on the accumulator's states).
#[derive(Debug)]
#[allow(
    clippy::large_enum_variant,
    reason = "one per unit, replaced a few times per step; the sizes differ by backend"
)]
enum GradState {
    /// No accumulator yet this window: it is allocated by the window's first reduction,
    /// so that between the step and the next backward (and, during backward, for the units
    /// not reached yet) no unit holds one.
    Idle,
    /// The window's gradients, in the accumulation dtype (stage 0: `num_elems`; stage 1:
    /// `padded_elems`; stages 2-3: `shard_len`), with stages 2-3's buckets in flight.
    Accumulating { acc: FlatBuf, buckets: VecDeque<Bucket> },
    /// Stages 0-1 at the boundary: the accumulator's reduction in flight.
    Reducing(Pending),
    /// Stages 0-1: the reduced gradient of the optimizer range, for the step.
    Reduced(FlatBuf),
    /// A device-resident step: the window's gradients on the device, in the accumulation
    /// dtype (the length as in `Accumulating`).
    OnDevice(Tensor<1>),
    /// A device-resident step of several ranks, stages 0-1: the reduced gradient of the
    /// optimizer range, on the device, for the step.
    DeviceReduced(Tensor<1>),
}

/// One unit's gradient accumulator and the reductions in flight.
#[derive(Debug)]
pub(crate) struct UnitGrad {
    stage: ZeroStage,
    /// The accumulator's dtype and length.
    acc_dtype: Precision,
    acc_len: usize,
    /// This rank's shard of the unit's flat buffer.
    own: Range<usize>,
    /// The device of a device-resident step's accumulator.
    device: Option<Device>,
    /// The ranks the unit is sharded over.
    ranks: usize,
    state: GradState,
}

impl UnitGrad {
    /// An empty accumulator for `rank`'s part of a unit of `layout` at `stage`, in
    /// `accum_dtype`; on `device` for a device-resident step.
    pub fn new(
        stage: ZeroStage,
        layout: &FlatLayout,
        accum_dtype: Precision,
        rank: usize,
        device: Option<Device>,
    ) -> Self {
        let acc_len = match stage {
            ZeroStage::Disabled => layout.num_elems(),
            ZeroStage::OptimizerStates => layout.padded_elems(),
            ZeroStage::Gradients | ZeroStage::Parameters => layout.shard_len(),
        };
        let own = layout.shard_range(rank);
        let ranks = layout.world_size();
        Self { stage, acc_dtype: accum_dtype, acc_len, own, device, ranks, state: GradState::Idle }
    }

    /// Bytes of the accumulator while a window accumulates: what the rank holds for this
    /// unit's gradients during training (between the step and the next backward it holds
    /// none, and the accumulator is counted at the size the next window allocates).
    pub fn bytes(&self) -> u64 {
        match &self.state {
            GradState::Accumulating { acc, .. } => acc.bytes(),
            GradState::Idle => (self.acc_len * self.acc_dtype.bytes_per_elem()) as u64,
            GradState::Reducing(_) => 0,
            GradState::Reduced(reduced) => reduced.bytes(),
            GradState::OnDevice(t) | GradState::DeviceReduced(t) => tensor_bytes(t),
        }
    }

    /// Accumulates and (as the stage and `options` say) starts reducing one backward
    /// pass's gradients. Returns the transient bytes it used.
    pub fn reduce(
        &mut self,
        grads: UnitGrads,
        layout: &FlatLayout,
        shared: &Shared,
        options: ReduceOptions,
        times: &mut PhaseTimes,
    ) -> Result<u64> {
        if let Some(device) = self.device.clone() {
            return self.reduce_on_device(grads, layout, shared, options, &device);
        }
        let comm = shared.comm.as_ref();
        if let GradState::Idle = self.state {
            self.state = fresh(self.acc_dtype, self.acc_len);
        }
        let GradState::Accumulating { acc, buckets } = &mut self.state else {
            return Err(after_boundary());
        };
        let mut transient = grads.bytes();
        let grads: Vec<Option<FlatBuf>> = grads
            .entries
            .into_iter()
            .map(|g| g.map(|g| g.into_host("a gradient")).transpose())
            .collect::<Result<_>>()?;
        if self.stage.shards_gradients() {
            let n = layout.world_size();
            for range in layout.bucket_ranges(options.bucket_elems) {
                let mut input = FlatBuf::zeros(options.comm_dtype, n * range.len());
                for rank in 0..n {
                    let at = rank * range.len()..(rank + 1) * range.len();
                    fill(&grads, layout, layout.piece(rank, range.clone()), input.as_mut().slice(at), false);
                }
                let output = FlatBuf::zeros(options.comm_dtype, range.len());
                transient += input.bytes() + output.bytes();
                // Double buffering: one bucket in flight while the next is filled.
                while buckets.len() >= MAX_BUCKETS_IN_FLIGHT {
                    settle_oldest(acc, buckets, times)?;
                }
                let pending = comm.start(Request::ReduceScatter { input, output, op: ReduceOp::Sum });
                buckets.push_back(Bucket { range, add: !options.first, pending });
            }
        } else {
            let len = acc.len();
            fill(&grads, layout, 0..len, acc.as_mut(), !options.first);
            if options.boundary {
                transient += self.start_whole(layout, comm, options);
            }
        }
        drop(grads);
        if !options.overlap {
            self.settle(times)?;
        }
        Ok(transient)
    }

    /// [`reduce`](Self::reduce) in a device-resident step (module note on the states).
    fn reduce_on_device(
        &mut self,
        grads: UnitGrads,
        layout: &FlatLayout,
        shared: &Shared,
        options: ReduceOptions,
        device: &Device,
    ) -> Result<u64> {
        let previous = match std::mem::replace(&mut self.state, GradState::Idle) {
            GradState::OnDevice(acc) if !options.first => Some(acc),
            GradState::OnDevice(_) | GradState::Idle => None,
            other => {
                self.state = other;
                return Err(after_boundary());
            }
        };
        let add = |new: Tensor<1>| match previous {
            Some(acc) => acc + new,
            None => new,
        };
        if self.ranks > 1 && self.stage.shards_gradients() {
            let whole = flatten(grads, layout, options.comm_dtype, layout.padded_elems(), device);
            let shard = shared.on_device(DeviceOp::ReduceScatter(ReduceOp::Sum), &whole)?;
            let transient = tensor_bytes(&whole) + tensor_bytes(&shard);
            self.state = GradState::OnDevice(add(shard.cast(float_dtype(self.acc_dtype))));
            return Ok(transient);
        }
        let acc = add(flatten(grads, layout, self.acc_dtype, self.acc_len, device));
        if self.ranks == 1 || !options.boundary {
            self.state = GradState::OnDevice(acc);
            return Ok(0);
        }
        let buf = acc.cast(float_dtype(options.comm_dtype));
        let reduced = if self.stage == ZeroStage::OptimizerStates && options.reduce_scatter {
            shared.on_device(DeviceOp::ReduceScatter(ReduceOp::Sum), &buf)?
        } else {
            let whole = shared.on_device(DeviceOp::AllReduce(ReduceOp::Sum), &buf)?;
            // Stage 1 keeps its shard of the all-reduced buffer.
            match self.stage {
                ZeroStage::OptimizerStates => whole.slice(self.own.clone()),
                _ => whole,
            }
        };
        let transient = tensor_bytes(&buf) + tensor_bytes(&reduced);
        self.state = GradState::DeviceReduced(reduced);
        Ok(transient)
    }

    /// Stages 0-1 at the boundary: starts reducing the whole accumulator. Returns the
    /// transient bytes (a converted copy and the reduce-scatter's output).
    fn start_whole(&mut self, layout: &FlatLayout, comm: &dyn Collective, options: ReduceOptions) -> u64 {
        let placeholder = GradState::Reduced(FlatBuf::zeros(options.comm_dtype, 0));
        let GradState::Accumulating { acc, .. } = std::mem::replace(&mut self.state, placeholder) else {
            unreachable!("reduce checked the state")
        };
        let converted = acc.dtype() != options.comm_dtype;
        let buf = if converted { FlatBuf::from_f32(options.comm_dtype, &acc.into_f32()) } else { acc };
        let mut transient = if converted { buf.bytes() } else { 0 };
        let request = if self.stage == ZeroStage::OptimizerStates && options.reduce_scatter {
            let output = FlatBuf::zeros(options.comm_dtype, layout.shard_len());
            transient += output.bytes();
            Request::ReduceScatter { input: buf, output, op: ReduceOp::Sum }
        } else {
            Request::AllReduce { buf, op: ReduceOp::Sum }
        };
        self.state = GradState::Reducing(comm.start(request));
        transient
    }

    /// Waits for every reduction in flight and puts its result where it belongs.
    pub fn settle(&mut self, times: &mut PhaseTimes) -> Result<()> {
        match &mut self.state {
            GradState::Accumulating { acc, buckets } => {
                while !buckets.is_empty() {
                    settle_oldest(acc, buckets, times)?;
                }
            }
            GradState::Reducing(_) => {
                let placeholder = GradState::Reduced(FlatBuf::zeros(self.acc_dtype, 0));
                let GradState::Reducing(pending) = std::mem::replace(&mut self.state, placeholder) else {
                    unreachable!("matched above")
                };
                let reduced = times.wait_for(pending)?.output;
                // Stage 1 without reduce-scatter all-reduced the whole buffer: keep its shard.
                let reduced = if self.stage == ZeroStage::OptimizerStates && reduced.len() != self.own.len() {
                    FlatBuf::F32(reduced.as_ref().slice(self.own.clone()).to_f32())
                } else {
                    reduced
                };
                self.state = GradState::Reduced(reduced);
            }
            GradState::Idle | GradState::Reduced(_) | GradState::OnDevice(_) | GradState::DeviceReduced(_) => {}
        }
        Ok(())
    }

    /// At the step: the reduced gradient of the optimizer range (summed over the ranks,
    /// still scaled), in the dtype it was accumulated or reduced in: the step converts
    /// each unit's to f32 when it steps that unit, so the whole model's never exists in f32
    /// at once. The unit is idle until the next window's first reduction.
    pub fn take_reduced(&mut self, times: &mut PhaseTimes) -> Result<Flat> {
        self.settle(times)?;
        let state = std::mem::replace(&mut self.state, GradState::Idle);
        match state {
            // Several ranks reduce stages 0-1's accumulator at the boundary (below otherwise).
            GradState::OnDevice(acc) if self.acc_is_reduced() => Ok(Flat::Device(acc)),
            GradState::DeviceReduced(reduced) => Ok(Flat::Device(reduced)),
            GradState::Accumulating { acc, .. } if self.stage.shards_gradients() => Ok(Flat::Host(acc)),
            // A unit no backward reached this window (stages 2-3) has zero gradients.
            GradState::Idle if self.stage.shards_gradients() => Ok(match &self.device {
                Some(device) => Flat::Device(zeros(self.acc_dtype, self.acc_len, device)),
                None => Flat::Host(FlatBuf::zeros(self.acc_dtype, self.acc_len)),
            }),
            GradState::Reduced(reduced) => Ok(Flat::Host(reduced)),
            other => {
                self.state = other;
                Err(Error::Usage("the step found no reduced gradients: the last micro-step was not a boundary".into()))
            }
        }
    }

    /// What [`take_reduced`](Self::take_reduced) would return now, without waiting or
    /// taking anything, where that is a tensor on the device with nothing in flight: the
    /// window's gradients read once more before the step (its norm, in the micro-step's one
    /// read of the device). `None` where the step must settle, reduce or stage first.
    pub fn reduced_on_device(&self) -> Option<Tensor<1>> {
        match &self.state {
            GradState::OnDevice(acc) if self.acc_is_reduced() => Some(acc.clone()),
            GradState::DeviceReduced(reduced) => Some(reduced.clone()),
            _ => None,
        }
    }

    /// Whether a device accumulator holds the reduced gradient already: one rank has
    /// nothing to reduce with, and stages 2-3 reduce-scatter every micro-step into it.
    fn acc_is_reduced(&self) -> bool {
        self.ranks == 1 || self.stage.shards_gradients()
    }
}

/// One backward pass's gradients of a unit as one tensor of `len` elements in `dtype` on
/// `device`: the entries in layout order (zeros for a parameter without a gradient), then
/// zeros for the padding.
fn flatten(grads: UnitGrads, layout: &FlatLayout, dtype: Precision, len: usize, device: &Device) -> Tensor<1> {
    let cast = float_dtype(dtype);
    let pieces: Vec<(usize, Tensor<1>)> = layout
        .entries()
        .iter()
        .zip(grads.entries)
        .filter_map(|(entry, grad)| {
            let piece = match grad? {
                Flat::Device(t) => t.cast(cast),
                Flat::Host(values) => tensor(values, device).cast(cast),
            };
            Some((entry.offset, piece))
        })
        .collect();
    super::flat::lay_out(len, cast.into(), device, pieces)
}

/// A backward pass between the boundary's reduction and the step.
fn after_boundary() -> Error {
    Error::Usage("a backward pass after the accumulation boundary: call step() before the next micro-step".into())
}

/// A zeroed accumulator.
fn fresh(dtype: Precision, len: usize) -> GradState {
    GradState::Accumulating { acc: FlatBuf::zeros(dtype, len), buckets: VecDeque::new() }
}

/// Waits for the oldest bucket in flight and adds its result to the accumulator.
fn settle_oldest(acc: &mut FlatBuf, buckets: &mut VecDeque<Bucket>, times: &mut PhaseTimes) -> Result<()> {
    if let Some(bucket) = buckets.pop_front() {
        let output = times.wait_for(bucket.pending)?.output;
        acc.as_mut().slice(bucket.range).copy_from(output.as_ref(), bucket.add);
    }
    Ok(())
}

/// Copies (or with `add`, adds) the gradients in `range` of the unit's flat buffer into
/// `dst` (`range.len()` long); a parameter without a gradient counts as zeros.
fn fill(grads: &[Option<FlatBuf>], layout: &FlatLayout, range: Range<usize>, mut dst: BufMut<'_>, add: bool) {
    for (entry, grad) in layout.entries().iter().zip(grads) {
        let Some(segment) = entry.segment(range.clone()) else { continue };
        let at = segment.flat_range.start - range.start..segment.flat_range.end - range.start;
        let mut out = dst.reborrow().slice(at);
        match grad {
            Some(values) => out.copy_from(values.as_ref().slice(segment.param_range), add),
            None if !add => out.fill_zeros(),
            None => {}
        }
    }
}
