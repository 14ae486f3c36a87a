//! Optimizers over flat shards: the public [`ShardOptimizer`] trait, Burn's optimizers as
//! its built-in implementations, and a unit's parameter groups.
//!
//! # Note: flat shards
//! A rank's optimizer steps one unit's range of the unit's flat buffer (the unit's
//! parameters in visit order, concatenated): all of it at stage 0, the rank's shard at
//! stages 1-3, which may begin and end inside a parameter. An element-wise optimizer
//! (Adam, AdamW, SGD, Lion, ...) steps such a range exactly as it would step each
//! parameter tensor: Burn's `Optimizer::step` is generic over the rank, so stepping one 1-D
//! tensor gives the same bits. An optimizer that needs whole tensors (Adafactor's factored
//! moments, Muon's orthogonalisation) sees, in [`ShardSegment`]s, which piece of which
//! parameter each part of its range is, and must handle a parameter split between ranks.
//!
//! # Note: parameter groups
//! With `zerotrain.param_groups` a unit's range holds elements of several groups. Each group
//! present in the range gets its own optimizer over its elements, gathered into one
//! contiguous tensor, stepped at the group's lr and weight decay, and put back in place.
//! For an element-wise optimizer that equals stepping each parameter with its group's
//! settings. A range wholly in one group (the common case, and always without groups) is
//! stepped in place, with no gather.

use std::ops::Range;
use std::sync::Arc;

use burn::tensor::{Device, Tensor};
use burn_pack::Scalar;

use super::flat::{join, lay_out};
use crate::config::{OptimPlan, OptimizerPlan, ParamGroupPlan};
use crate::{Error, Result};

/// Optimizer state as named flat vectors (each the stepped range's length) and named
/// scalars (step counts).
pub type ExportedState = (Vec<(String, Vec<f32>)>, Vec<(String, Scalar)>);

/// An optimizer state's tensor names and its scalars, without the tensors' values.
pub(crate) type StateLayout = (Vec<String>, Vec<(String, Scalar)>);

/// An optimizer with its state for one flat range of one rank (module note).
///
/// ```
/// use burn::tensor::{Device, Tensor};
/// use zerotrain::engine::optimizer::{ExportedState, ShardOptimizer};
///
/// /// Sign descent: p -= lr * sign(g), stateless.
/// struct SignSgd;
///
/// impl ShardOptimizer for SignSgd {
///     fn step(&mut self, lr: f64, params: Tensor<1>, grads: Tensor<1>) -> zerotrain::Result<Tensor<1>> {
///         Ok(params - grads.sign().mul_scalar(lr))
///     }
///     fn state_bytes(&self) -> u64 {
///         0
///     }
///     fn export(&self) -> ExportedState {
///         (Vec::new(), Vec::new())
///     }
///     fn import(&mut self, _: ExportedState, _: &Device) -> zerotrain::Result<()> {
///         Ok(())
///     }
/// }
/// ```
pub trait ShardOptimizer: Send {
    /// Steps `params` (a 1-D f32 tensor on the rank's device, without autodiff) with
    /// `grads` (same length and device: averaged over the ranks, unscaled, clipped) at
    /// `lr` (the schedule's, times the parameter group's scale). Returns the new values.
    fn step(&mut self, lr: f64, params: Tensor<1>, grads: Tensor<1>) -> Result<Tensor<1>>;
    /// Bytes of state held.
    fn state_bytes(&self) -> u64;
    /// The state, for checkpoints; empty before the first step.
    fn export(&self) -> ExportedState;
    /// The state, moved out (the optimizer is left without state): what the NVMe tier
    /// writes to its swap files after each tile. The default exports and then clears.
    fn take_state(&mut self) -> ExportedState {
        let state = self.export();
        // An optimizer that cannot clear keeps its state; the tier overwrites it at the
        // next import.
        let _ = self.import((Vec::new(), Vec::new()), &Device::flex());
        state
    }
    /// Replaces the state with one [`export`](Self::export) gave (for a range of the same
    /// length; checkpoints re-slice the vectors when the world size changes). Empty: no
    /// state yet.
    fn import(&mut self, state: ExportedState, device: &Device) -> Result<()>;
}

/// One piece of a parameter inside the range an optimizer steps.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShardSegment {
    /// The parameter's module path.
    pub path: String,
    /// Its shape.
    pub shape: Vec<usize>,
    /// Which of its elements (row-major) this piece is.
    pub param_range: Range<usize>,
    /// Where they are in the tensors the optimizer steps.
    pub range: Range<usize>,
}

/// What a [`OptimizerFactory`] builds an optimizer for: one parameter group's elements in
/// one unit's range on this rank.
#[derive(Debug, Clone)]
pub struct ShardGroup<'a> {
    /// The config's optimizer with this group's weight decay.
    pub optimizer: OptimizerPlan,
    /// The group (`None`: the default group).
    pub group: Option<&'a ParamGroupPlan>,
    /// The pieces of parameters the optimizer will step, in order.
    pub segments: &'a [ShardSegment],
    /// Whether the optimizer steps host memory (a CPU rank, or `offload_optimizer`): its
    /// tensors are on Burn's CPU backend.
    pub on_host: bool,
}

/// Builds a rank's optimizers, one per parameter group per unit range
/// ([`EngineBuilder::optimizer`](super::build::EngineBuilder::optimizer)).
pub type OptimizerFactory = Arc<dyn Fn(&ShardGroup<'_>) -> Box<dyn ShardOptimizer> + Send + Sync>;

pub(crate) use super::builtin::built_in;

/// One parameter group's elements of a unit's range and their optimizer.
struct GroupPart {
    /// The group's pieces of the range, in order (relative to the range's start).
    ranges: Vec<Range<usize>>,
    lr_scale: f64,
    optimizer: Box<dyn ShardOptimizer>,
    /// How errors name the optimizer: its type in the config, and its group.
    label: String,
}

impl GroupPart {
    /// Elements the part's optimizer steps.
    fn elems(&self) -> usize {
        self.ranges.iter().map(Range::len).sum()
    }

    /// `state` the part's optimizer gave, refused unless every tensor holds one value per
    /// element it steps (a wrong length would overwrite its neighbours' values).
    fn checked(&self, state: ExportedState) -> Result<ExportedState> {
        let elems = self.elems();
        match state.0.iter().find(|(_, values)| values.len() != elems) {
            Some((name, values)) => Err(Error::Model(format!(
                "{} gave optimizer state `{name}` of {} values for the {elems} elements it steps: a \
                 ShardOptimizer's export holds one value per element",
                self.label,
                values.len()
            ))),
            None => Ok(state),
        }
    }
}

/// A unit's optimizers: one per parameter group present in the rank's range of the unit
/// (module note on parameter groups).
pub(crate) struct UnitOptimizer {
    len: usize,
    parts: Vec<GroupPart>,
}

impl UnitOptimizer {
    /// The optimizers of a range of `len` elements whose pieces are `segments` (padding
    /// has none), as `optim` groups them, built by `factory`.
    pub fn new(
        len: usize,
        segments: &[ShardSegment],
        optim: &OptimPlan,
        factory: &OptimizerFactory,
        on_host: bool,
    ) -> Self {
        // Group of each segment: the first whose pattern matches, else the default (last).
        let default = optim.param_groups.len();
        let group_of = |s: &ShardSegment| optim.param_groups.iter().position(|g| g.matches(&s.path)).unwrap_or(default);
        let mut parts = Vec::new();
        for g in 0..=default {
            let mine: Vec<ShardSegment> = segments.iter().filter(|s| group_of(s) == g).cloned().collect();
            // The default group also takes the range's padding, so that one group covers
            // a range it wholly owns in one piece.
            let owns_all = mine.len() == segments.len();
            if mine.is_empty() && !(g == default && segments.is_empty()) {
                continue;
            }
            let group = optim.param_groups.get(g);
            let weight_decay = group.map(|g| g.weight_decay);
            let plan = weight_decay.map_or(optim.optimizer, |wd| optim.optimizer.with_weight_decay(wd));
            let optimizer = factory(&ShardGroup { optimizer: plan, group, segments: &mine, on_host });
            let ranges = if owns_all { whole(len) } else { merge(mine.iter().map(|s| s.range.clone())) };
            let kind = format!("{plan:?}");
            let kind = kind.split([' ', '{']).next().unwrap_or_default();
            let label = match group {
                Some(_) => format!("the optimizer ({kind}, optimizer.type) of parameter group {g}"),
                None => format!("the optimizer ({kind}, optimizer.type)"),
            };
            parts.push(GroupPart { ranges, lr_scale: group.map_or(1.0, |g| g.lr_scale), optimizer, label });
        }
        Self { len, parts }
    }

    /// Steps `params` (the range's values) with `grads` at `lr`; see the module note.
    pub fn step(&mut self, lr: f64, params: Tensor<1>, grads: Tensor<1>) -> Result<Tensor<1>> {
        let (n, g) = (params.dims()[0], grads.dims()[0]);
        if g != n || n != self.len {
            return Err(Error::Model(format!("{g} gradients for an optimizer range of {n} ({})", self.len)));
        }
        if let [part] = self.parts.as_mut_slice()
            && part.ranges == whole(n)
        {
            return part.optimizer.step(lr * part.lr_scale, params, grads);
        }
        let mut pieces: Vec<(usize, Tensor<1>)> = Vec::new();
        for part in &mut self.parts {
            let gather = |t: &Tensor<1>| join(part.ranges.iter().map(|r| t.clone().slice(r.clone())).collect());
            let (values, g) = (gather(&params), gather(&grads));
            let mut stepped = part.optimizer.step(lr * part.lr_scale, values, g)?;
            for r in &part.ranges {
                let (piece, rest) = split_front(stepped, r.len());
                pieces.push((r.start, piece));
                stepped = rest;
            }
        }
        let (dtype, device) = (params.dtype(), params.device());
        // Elements of no group (padding between groups) keep their values.
        let mut covered: Vec<Range<usize>> = self.parts.iter().flat_map(|p| p.ranges.iter().cloned()).collect();
        covered.sort_by_key(|r| r.start);
        let mut at = 0;
        for r in covered {
            if r.start > at {
                pieces.push((at, params.clone().slice(at..r.start)));
            }
            at = r.end;
        }
        if at < n {
            pieces.push((at, params.slice(at..n)));
        }
        Ok(lay_out(n, dtype, &device, pieces))
    }

    /// Bytes of state held.
    pub fn state_bytes(&self) -> u64 {
        self.parts.iter().map(|p| p.optimizer.state_bytes()).sum()
    }

    /// The state over the whole range: each group's vectors put back at its elements (the
    /// rest 0), and the first group's scalars (every group steps together). An error if an
    /// optimizer's state is not one value per element it steps.
    pub fn export(&self) -> Result<ExportedState> {
        self.gather(self.parts.iter().map(|part| part.optimizer.export()).collect())
    }

    /// Every part's state (`states`, in order) over the whole range (see `export`).
    fn gather(&self, states: Vec<ExportedState>) -> Result<ExportedState> {
        let len = self.len;
        if let [part] = self.parts.as_slice()
            && part.ranges == whole(len)
        {
            return part.checked(states.into_iter().next().unwrap_or_default());
        }
        let mut tensors: Vec<(String, Vec<f32>)> = Vec::new();
        let mut scalars = Vec::new();
        for (part, exported) in self.parts.iter().zip(states) {
            let (state, part_scalars) = part.checked(exported)?;
            if scalars.is_empty() {
                scalars = part_scalars;
            }
            for (name, values) in state {
                let slot = match tensors.iter().position(|(n, _)| *n == name) {
                    Some(i) => i,
                    None => {
                        tensors.push((name, vec![0.0; len]));
                        tensors.len() - 1
                    }
                };
                let mut at = 0;
                for r in &part.ranges {
                    tensors[slot].1[r.clone()].copy_from_slice(&values[at..at + r.len()]);
                    at += r.len();
                }
            }
        }
        Ok((tensors, scalars))
    }

    /// The state over the whole range, moved out of the optimizers (see
    /// [`ShardOptimizer::take_state`]); checked as [`export`](Self::export)'s.
    pub fn take_state(&mut self) -> Result<ExportedState> {
        let states = self.parts.iter_mut().map(|part| part.optimizer.take_state()).collect();
        self.gather(states)
    }

    /// Replaces the state with vectors over the whole range and shared scalars.
    pub fn import(&mut self, (tensors, scalars): ExportedState, device: &Device) -> Result<()> {
        let len = self.len;
        if let [part] = self.parts.as_mut_slice()
            && part.ranges == whole(len)
        {
            return part.optimizer.import((tensors, scalars), device);
        }
        if let Some((name, values)) = tensors.iter().find(|(_, v)| v.len() != len) {
            return Err(Error::Model(format!(
                "optimizer state `{name}` has {} values for a range of {len}",
                values.len()
            )));
        }
        for part in &mut self.parts {
            let mine = tensors
                .iter()
                .map(|(name, values)| {
                    let picked = part.ranges.iter().flat_map(|r| values[r.clone()].iter().copied()).collect();
                    (name.clone(), picked)
                })
                .collect();
            part.optimizer.import((mine, scalars.clone()), device)?;
        }
        Ok(())
    }

    /// Replaces every group's optimizer (tests inject failures).
    #[cfg(test)]
    pub fn replace(&mut self, make: impl Fn() -> Box<dyn ShardOptimizer>) {
        for part in &mut self.parts {
            part.optimizer = make();
        }
    }
}

/// `ranges` in order, adjacent ones merged.
fn merge(ranges: impl Iterator<Item = Range<usize>>) -> Vec<Range<usize>> {
    let mut merged: Vec<Range<usize>> = Vec::new();
    for r in ranges {
        match merged.last_mut() {
            Some(last) if last.end == r.start => last.end = r.end,
            _ => merged.push(r),
        }
    }
    merged
}

/// The first `n` elements of `t` and the rest.
fn split_front(t: Tensor<1>, n: usize) -> (Tensor<1>, Tensor<1>) {
    let len = t.dims()[0];
    (t.clone().slice(0..n), t.slice(n..len))
}

/// The one range `0..len`: a group part that covers a shard whole.
fn whole(len: usize) -> Vec<Range<usize>> {
    std::iter::once(0..len).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn adjacent_ranges_merge_and_others_stay_apart() {
        assert_eq!(merge([0..2, 2..5, 7..9, 9..10].into_iter()), vec![0..5, 7..10]);
        assert_eq!(merge(std::iter::empty()), Vec::<Range<usize>>::new());
    }
}
