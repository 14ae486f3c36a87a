//! Gradient accumulation and reduction, by what the stage shards.
//!
//! # Note: why reduce-scatter per micro-step
//! Stages 0-1 keep a full-size accumulator, add each micro-step's local gradients into it
//! and reduce once at the accumulation boundary (the least communication). Stages 2-3 keep
//! only their shard: each micro-step's gradients are reduce-scattered at once and added to
//! the shard accumulator, so no full-size gradient buffer outlives the micro-step. The two
//! orders sum the same numbers differently, so with accumulation > 1 stages 0-1 and 2-3 can
//! differ in the last bits; with accumulation 1 all four stages are bitwise identical.

use burn::module::Module;
use burn::optim::GradientsParams;
use zerotrain_precision::{FlatBuf, Precision};
use zerotrain_zero::{Collective, FlatLayout, ReduceOp, ZeroStage};

use super::params::{ParamIndex, read_grads};
use crate::Result;

/// A rank's gradient accumulator for the current accumulation window.
pub(crate) struct GradAccumulator {
    stage: ZeroStage,
    reduce_scatter: bool,
    comm_dtype: Precision,
    /// In `grad_accum_dtype`. Stage 0: `num_elems`; stage 1: `padded_elems`; stages 2-3:
    /// `shard_len`.
    acc: FlatBuf,
    /// No micro-step has been added since the last reduction.
    empty: bool,
}

impl GradAccumulator {
    /// An empty accumulator in `accum_dtype` whose reductions run in `comm_dtype`.
    pub fn new(
        stage: ZeroStage,
        reduce_scatter: bool,
        layout: &FlatLayout,
        accum_dtype: Precision,
        comm_dtype: Precision,
    ) -> Self {
        let len = match stage {
            ZeroStage::Disabled => layout.num_elems(),
            ZeroStage::OptimizerStates => layout.padded_elems(),
            ZeroStage::Gradients | ZeroStage::Parameters => layout.shard_len(),
        };
        Self { stage, reduce_scatter, comm_dtype, acc: FlatBuf::zeros(accum_dtype, len), empty: true }
    }

    /// Bytes held between steps.
    pub fn bytes(&self) -> u64 {
        self.acc.bytes()
    }

    /// Adds one micro-step's gradients. Returns the bytes of transient buffers it used.
    pub fn accumulate<M: Module>(
        &mut self,
        model: &M,
        grads: &mut GradientsParams,
        index: &ParamIndex,
        layout: &FlatLayout,
        comm: &dyn Collective,
    ) -> Result<u64> {
        let first = std::mem::replace(&mut self.empty, false);
        if !self.stage.shards_gradients() {
            read_grads(model, grads, index, layout, self.acc.as_mut(), !first)?;
            return Ok(0);
        }
        let mut flat = FlatBuf::zeros(self.comm_dtype, layout.padded_elems());
        read_grads(model, grads, index, layout, flat.as_mut(), false)?;
        let mut transient = flat.bytes();
        if first && self.acc.dtype() == self.comm_dtype {
            comm.reduce_scatter(flat.as_ref(), self.acc.as_mut(), ReduceOp::Sum)?;
        } else {
            let mut shard = FlatBuf::zeros(self.comm_dtype, self.acc.len());
            comm.reduce_scatter(flat.as_ref(), shard.as_mut(), ReduceOp::Sum)?;
            self.acc.as_mut().copy_from(shard.as_ref(), !first);
            transient += shard.bytes();
        }
        Ok(transient)
    }

    /// At the boundary: the gradient summed over ranks, as f32, for the range the optimizer
    /// steps (all `num_elems` at stage 0, the rank's shard otherwise). Resets the accumulator.
    pub fn reduce(&mut self, layout: &FlatLayout, comm: &dyn Collective) -> Result<Vec<f32>> {
        self.empty = true;
        let fresh = FlatBuf::zeros(self.acc.dtype(), self.acc.len());
        let acc = std::mem::replace(&mut self.acc, fresh);
        if self.stage.shards_gradients() {
            return Ok(acc.into_f32());
        }
        let mut buf =
            if acc.dtype() == self.comm_dtype { acc } else { FlatBuf::from_f32(self.comm_dtype, &acc.into_f32()) };
        match self.stage {
            ZeroStage::OptimizerStates if self.reduce_scatter => {
                let mut shard = FlatBuf::zeros(self.comm_dtype, layout.shard_len());
                comm.reduce_scatter(buf.as_ref(), shard.as_mut(), ReduceOp::Sum)?;
                Ok(shard.into_f32())
            }
            ZeroStage::OptimizerStates => {
                comm.all_reduce(buf.as_mut(), ReduceOp::Sum)?;
                Ok(buf.as_ref().slice(layout.shard_range(comm.rank())).to_f32())
            }
            _ => {
                comm.all_reduce(buf.as_mut(), ReduceOp::Sum)?;
                Ok(buf.into_f32())
            }
        }
    }
}
