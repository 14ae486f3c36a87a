//! [`PeerExchange`]: a round's exchange among the ranks of one job. The ranks holding the same
//! shard in every group all-reduce their pseudo-gradients (`global - local`, in the round's
//! communication dtype), and each steps the outer optimizer on its own shard of the global
//! weights, so every peer ends with the same new global shard. Parameter servers, across
//! jobs, are to be the other form of the same exchange (push the pseudo-gradient, get the
//! new global shard back); [`LocalSgd`](super::LocalSgd) only asks for the new weights.

use std::sync::Arc;

use zerotrain_precision::{FlatBuf, Precision};
use zerotrain_zero::{Collective, ReduceOp};

use super::Round;
use super::outer::OuterState;
use crate::Result;
use crate::config::ReplicaPlan;

/// The global weights of this rank's shard, per unit, and the outer optimizer's state for
/// them; the peers to average with.
pub(super) struct PeerExchange {
    plan: ReplicaPlan,
    peers: Arc<dyn Collective>,
    global: Vec<Vec<f32>>,
    outer: Vec<OuterState>,
}

impl PeerExchange {
    /// Global weights from group 0's `start` (broadcast to every peer), a fresh outer
    /// optimizer. Every peer calls it at once.
    pub fn start(plan: ReplicaPlan, peers: Arc<dyn Collective>, mut start: Vec<Vec<f32>>) -> Result<Self> {
        let mut flat: Vec<f32> = start.concat();
        peers.broadcast((&mut flat).into(), 0)?;
        scatter(&flat, &mut start);
        let outer = vec![OuterState::default(); start.len()];
        Ok(Self { plan, peers, global: start, outer })
    }

    /// The global weights of this rank's shard, per unit.
    pub fn global(&self) -> &[Vec<f32>] {
        &self.global
    }

    /// A round: from this rank's `local` weights (as [`global`](Self::global) is laid out)
    /// to the new global ones; also how it went (every group is live; the round's number
    /// is [`LocalSgd`](super::LocalSgd)'s to fill).
    pub fn run(&mut self, local: &[Vec<f32>]) -> Result<(&[Vec<f32>], Round)> {
        let before = self.peers.stats();
        let mut delta = pseudo_gradient(&self.global, local);
        self.sum(&mut delta)?;
        let mut rest = delta.as_mut_slice();
        for (global, outer) in self.global.iter_mut().zip(&mut self.outer) {
            let (mine, more) = rest.split_at_mut(global.len());
            outer.step_mean(&self.plan.outer, global, mine, self.plan.groups);
            rest = more;
        }
        let bytes = self.peers.stats().since(&before).total_bytes();
        let live_groups = self.plan.groups;
        Ok((&self.global, Round { round: 0, bytes, live_groups, staleness: 0, rejoined: false, global_round: None }))
    }

    /// Sums `delta` over the peers (in rank order, which is group order), travelling in the
    /// round's communication dtype.
    fn sum(&self, delta: &mut [f32]) -> Result<()> {
        match self.plan.comm_dtype {
            Precision::Fp32 => self.peers.all_reduce(delta.into(), ReduceOp::Sum)?,
            dtype => {
                let mut wire = FlatBuf::from_f32(dtype, delta);
                self.peers.all_reduce(wire.as_mut(), ReduceOp::Sum)?;
                delta.copy_from_slice(&wire.into_f32());
            }
        }
        Ok(())
    }
}

/// `global - local`, unit after unit, as one flat vector (a round's message).
fn pseudo_gradient(global: &[Vec<f32>], local: &[Vec<f32>]) -> Vec<f32> {
    global.iter().zip(local).flat_map(|(g, l)| g.iter().zip(l).map(|(g, l)| g - l)).collect()
}

/// Copies `flat` back into `units`, unit after unit, as `concat` laid it out.
pub(super) fn scatter(flat: &[f32], units: &mut [Vec<f32>]) {
    let mut rest = flat;
    for unit in units {
        let (mine, more) = rest.split_at(unit.len());
        unit.copy_from_slice(mine);
        rest = more;
    }
}
