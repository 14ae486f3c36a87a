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
use zerotrain_zero::{Collective, FlatLayout, ReduceOp, ZeroStage};

use super::params::{ParamIndex, read_grads};
use crate::Result;

/// A rank's gradient accumulator for the current accumulation window.
pub(crate) struct GradAccumulator {
    stage: ZeroStage,
    reduce_scatter: bool,
    /// Stage 0: `num_elems`; stage 1: `padded_elems`; stages 2-3: `shard_len`.
    acc: Vec<f32>,
    /// No micro-step has been added since the last reduction.
    empty: bool,
}

impl GradAccumulator {
    pub fn new(stage: ZeroStage, reduce_scatter: bool, layout: &FlatLayout) -> Self {
        let len = match stage {
            ZeroStage::Disabled => layout.num_elems(),
            ZeroStage::OptimizerStates => layout.padded_elems(),
            ZeroStage::Gradients | ZeroStage::Parameters => layout.shard_len(),
        };
        Self { stage, reduce_scatter, acc: vec![0.0; len], empty: true }
    }

    /// Bytes held between steps.
    pub fn bytes(&self) -> u64 {
        (self.acc.len() * size_of::<f32>()) as u64
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
            read_grads(model, grads, index, layout, &mut self.acc, !first)?;
            return Ok(0);
        }
        let mut flat = vec![0.0; layout.padded_elems()];
        read_grads(model, grads, index, layout, &mut flat, false)?;
        let mut transient = flat.len();
        if first {
            comm.reduce_scatter(&flat, &mut self.acc, ReduceOp::Sum)?;
        } else {
            let mut shard = vec![0.0; self.acc.len()];
            comm.reduce_scatter(&flat, &mut shard, ReduceOp::Sum)?;
            self.acc.iter_mut().zip(&shard).for_each(|(a, g)| *a += g);
            transient += shard.len();
        }
        Ok((transient * size_of::<f32>()) as u64)
    }

    /// At the boundary: the gradient summed over ranks for the range the optimizer steps
    /// (all `num_elems` at stage 0, the rank's shard otherwise). Resets the accumulator.
    pub fn reduce(&mut self, layout: &FlatLayout, comm: &dyn Collective) -> Result<Vec<f32>> {
        self.empty = true;
        let fresh = vec![0.0; self.acc.len()];
        match self.stage {
            ZeroStage::Disabled => {
                comm.all_reduce(&mut self.acc, ReduceOp::Sum)?;
                Ok(std::mem::replace(&mut self.acc, fresh))
            }
            ZeroStage::OptimizerStates if self.reduce_scatter => {
                let mut shard = vec![0.0; layout.shard_len()];
                comm.reduce_scatter(&self.acc, &mut shard, ReduceOp::Sum)?;
                self.acc = fresh;
                Ok(shard)
            }
            ZeroStage::OptimizerStates => {
                comm.all_reduce(&mut self.acc, ReduceOp::Sum)?;
                let shard = self.acc[layout.shard_range(comm.rank())].to_vec();
                self.acc = fresh;
                Ok(shard)
            }
            ZeroStage::Gradients | ZeroStage::Parameters => Ok(std::mem::replace(&mut self.acc, fresh)),
        }
    }
}
