//! [`Span`]: where an engine's units sit in the job.
//!
//! # Note: one engine, any span
//! An [`Engine`](super::Engine) shards its units over a group of ranks and agrees on the
//! step with the whole job. Without a pipeline the group is the world and the units are all
//! of the model. A pipeline stage ([`Pipeline`](super::Pipeline)) is the same engine over a
//! contiguous run of the model's units, sharded over the stage's data-parallel group; what
//! changes is described here, as values, not as a mode the engine tests: which declared
//! unit comes first, which world rank each group rank is, whether this stage counts the
//! root (a replica of it lives on every stage, counted on the first) and reports the loss
//! (the last), and the ranks holding the same data index on the other stages, over which
//! the root's gradient and the model's values are summed. One stage is the degenerate
//! case: K = 1, no other stages, everything counted here.

use std::sync::Arc;

use zerotrain_precision::BufMut;
use zerotrain_zero::pipeline::Topology;
use zerotrain_zero::{Collective, CommStats, ReduceOp};

use crate::Result;

/// Where an engine's units sit in the job (module note).
pub(crate) struct Span {
    /// The job's ranks as `K` stages of `D` data-parallel ranks (`K` = 1 without a pipeline).
    pub topology: Topology,
    /// This rank's stage, `0..K`.
    pub stage: usize,
    /// The model's declared unit that the engine's unit 0 is.
    pub first_unit: usize,
    /// The ranks of this data index on every stage, ranked by stage; `None` with one stage.
    pub pipe: Option<Arc<dyn Collective>>,
}

impl Span {
    /// All of the model over `world_size` ranks.
    pub fn whole(world_size: usize) -> Self {
        let topology = Topology { stages: 1, data_parallel: world_size };
        Self { topology, stage: 0, first_unit: 0, pipe: None }
    }

    /// Whether the root's replica here counts (in the norm, in checkpoints, in the model's
    /// values): on the first stage.
    pub fn counts_root(&self) -> bool {
        self.stage == 0
    }

    /// Whether there is more than one stage.
    pub fn is_pipelined(&self) -> bool {
        self.topology.stages > 1
    }

    /// The world rank of the data-parallel group's rank `group_rank` on this stage.
    pub fn world_rank(&self, group_rank: usize) -> usize {
        self.topology.rank(self.stage, group_rank)
    }

    /// Sums `buf` over the stages of this data index (each stage adds what only it holds).
    pub fn sum_over_stages(&self, buf: BufMut<'_>) -> Result<()> {
        if let Some(pipe) = &self.pipe {
            pipe.all_reduce(buf, ReduceOp::Sum)?;
        }
        Ok(())
    }

    /// The traffic of every communicator the engine uses: the world's, and on a pipeline
    /// stage the data-parallel group's and the pipe's too (with one stage the group is the
    /// world).
    pub fn comm_stats(&self, world: &dyn Collective, group: &dyn Collective) -> CommStats {
        match &self.pipe {
            Some(pipe) => world.stats().plus(&group.stats()).plus(&pipe.stats()),
            None => world.stats(),
        }
    }
}
