//! Gradient accumulation and reduction of one unit, by what the stage shards.
//!
//! # Note: why reduce-scatter per micro-step
//! Stages 0-1 keep a full-size accumulator per unit, add each micro-step's local gradients
//! into it and reduce once, at the accumulation boundary (the least communication). Stages
//! 2-3 keep only their shard: each micro-step's gradients are reduce-scattered in buckets
//! and added to the shard accumulator, so no full-size gradient buffer exists. The two
//! orders sum the same numbers differently, so with accumulation > 1 stages 0-1 and 2-3 can
//! differ in the last bits; with accumulation 1 all four stages are bitwise identical.
//!
//! # Note: reductions in flight
//! A reduction starts as soon as backward has produced the unit's gradients and, with
//! `overlap_comm`, runs on the rank's communication thread while the next unit's backward
//! computes; its result is added to the accumulator when the engine *settles* the unit
//! (before the next unit's reduction starts, and at the step). Without `overlap_comm` every
//! reduction is settled as soon as it starts.

use std::collections::VecDeque;
use std::ops::Range;

use zerotrain_precision::{BufMut, FlatBuf, Precision};
use zerotrain_zero::{Collective, FlatLayout, Pending, ReduceOp, Request, ZeroStage};

use super::PhaseTimes;
use super::params::UnitGrads;
use super::unit::finish;
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

/// One unit's gradient accumulator and the reductions in flight.
#[derive(Debug)]
pub(crate) struct UnitGrad {
    stage: ZeroStage,
    /// In `grad_accum_dtype`. Stage 0: `num_elems`; stage 1: `padded_elems`; stages 2-3:
    /// `shard_len`. Empty while a stage 0-1 reduction holds it.
    acc: FlatBuf,
    /// Its length, to renew it.
    acc_len: usize,
    /// This rank's shard of the unit's flat buffer.
    own: Range<usize>,
    /// Stages 0-1: the boundary reduction of the accumulator, in flight.
    whole: Option<Pending>,
    /// Stages 0-1: the reduced gradient of the optimizer range, once `whole` finished.
    reduced: Option<FlatBuf>,
    /// Stages 2-3: bucket reductions in flight, oldest first.
    buckets: VecDeque<Bucket>,
}

impl UnitGrad {
    /// An empty accumulator for `rank`'s part of a unit of `layout` at `stage`, in
    /// `accum_dtype`.
    pub fn new(stage: ZeroStage, layout: &FlatLayout, accum_dtype: Precision, rank: usize) -> Self {
        let acc_len = match stage {
            ZeroStage::Disabled => layout.num_elems(),
            ZeroStage::OptimizerStates => layout.padded_elems(),
            ZeroStage::Gradients | ZeroStage::Parameters => layout.shard_len(),
        };
        let acc = FlatBuf::zeros(accum_dtype, acc_len);
        let own = layout.shard_range(rank);
        Self { stage, acc, acc_len, own, whole: None, reduced: None, buckets: VecDeque::new() }
    }

    /// Bytes held between steps.
    pub fn bytes(&self) -> u64 {
        self.acc.bytes()
    }

    /// Accumulates and (as the stage and `options` say) starts reducing one backward
    /// pass's gradients. Returns the transient bytes it used.
    pub fn reduce(
        &mut self,
        grads: UnitGrads,
        layout: &FlatLayout,
        comm: &dyn Collective,
        options: ReduceOptions,
        times: &mut PhaseTimes,
    ) -> Result<u64> {
        let mut transient = grads.bytes();
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
                while self.buckets.len() >= MAX_BUCKETS_IN_FLIGHT {
                    self.settle_oldest(times)?;
                }
                let pending = comm.start(Request::ReduceScatter { input, output, op: ReduceOp::Sum });
                self.buckets.push_back(Bucket { range, add: !options.first, pending });
            }
        } else {
            let len = self.acc.len();
            fill(&grads, layout, 0..len, self.acc.as_mut(), !options.first);
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

    /// Stages 0-1 at the boundary: starts reducing the whole accumulator. Returns the
    /// transient bytes (a converted copy and the reduce-scatter's output).
    fn start_whole(&mut self, layout: &FlatLayout, comm: &dyn Collective, options: ReduceOptions) -> u64 {
        let acc = std::mem::replace(&mut self.acc, FlatBuf::zeros(options.comm_dtype, 0));
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
        self.whole = Some(comm.start(request));
        transient
    }

    /// Waits for the oldest bucket in flight and adds its result to the accumulator.
    fn settle_oldest(&mut self, times: &mut PhaseTimes) -> Result<()> {
        if let Some(bucket) = self.buckets.pop_front() {
            let output = finish(bucket.pending, times)?.output;
            self.acc.as_mut().slice(bucket.range).copy_from(output.as_ref(), bucket.add);
        }
        Ok(())
    }

    /// Waits for every reduction in flight and adds its result where it belongs.
    pub fn settle(&mut self, times: &mut PhaseTimes) -> Result<()> {
        while !self.buckets.is_empty() {
            self.settle_oldest(times)?;
        }
        let Some(pending) = self.whole.take() else { return Ok(()) };
        let reduced = finish(pending, times)?.output;
        // Stage 1 without reduce-scatter all-reduced the whole buffer: keep its shard.
        let reduced = if self.stage == ZeroStage::OptimizerStates && reduced.len() != self.own.len() {
            FlatBuf::F32(reduced.as_ref().slice(self.own.clone()).to_f32())
        } else {
            reduced
        };
        self.reduced = Some(reduced);
        Ok(())
    }

    /// At the step: the reduced gradient of the optimizer range, in f32. Renews the
    /// accumulator.
    pub fn take_reduced(&mut self, times: &mut PhaseTimes) -> Result<Vec<f32>> {
        self.settle(times)?;
        let fresh = FlatBuf::zeros(self.acc.dtype(), self.acc_len);
        let acc = std::mem::replace(&mut self.acc, fresh);
        if self.stage.shards_gradients() {
            return Ok(acc.into_f32());
        }
        let reduced = self.reduced.take().ok_or_else(|| {
            Error::Usage("the step found no reduced gradients: the last micro-step was not a boundary".into())
        })?;
        Ok(reduced.into_f32())
    }
}

/// Copies (or with `add`, adds) the gradients in `range` of the unit's flat buffer into
/// `dst` (`range.len()` long); a parameter without a gradient counts as zeros.
fn fill(grads: &UnitGrads, layout: &FlatLayout, range: Range<usize>, mut dst: BufMut<'_>, add: bool) {
    for (entry, grad) in layout.entries().iter().zip(&grads.entries) {
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
