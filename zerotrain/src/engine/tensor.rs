//! The engine of one tensor-parallel rank: its model is the rank's part of the whole
//! (`UnitModel::model_split`), ZeRO shards that part over the mesh's data-parallel
//! group, and the step's global metrics are the whole model's: the squared norm adds the
//! split parameters of every tensor rank and the parameters every rank holds whole once
//! (tensor rank 0's), and the loss is counted once per data-parallel place.
//!
//! # Note: checkpoints in the whole model's order
//! A tensor rank's checkpoint segments are placed in the whole model's global order: each
//! split parameter has its whole shape in the manifest, and a rank's slice of it is the
//! runs `Split::runs` gives. Every rank of the mesh writes a shard; the parameters every
//! tensor rank holds are written by tensor rank 0's. So the checkpoint is the one an
//! unsplit run writes: it resumes at any tensor-parallel size (each rank reads its own
//! slice's runs) and `consolidate` and the exports read it unchanged.

use std::ops::Range;
use std::sync::Arc;

use zerotrain_checkpoint::LayoutEntry;
use zerotrain_precision::BufMut;
use zerotrain_zero::{Collective, ReduceOp, Sharding};

use super::model::UnitModel;
use crate::config::Plan;
use crate::nn::parallel::{Split, within};
use crate::{Error, RankContext, Result};

/// How this rank's units are split over its tensor group, for the metrics.
pub(crate) struct TensorPart {
    /// The tensor group.
    pub comm: Arc<dyn Collective>,
    /// Each unit's flat ranges of parameters held whole on every tensor rank, in order.
    whole: Vec<Vec<Range<usize>>>,
    /// Every rank of the mesh (checkpoints are written and agreed over it).
    pub mesh: Arc<dyn Collective>,
    /// Each parameter of the global order as the whole model has it.
    layout: Vec<WholeEntry>,
}

/// A parameter of the whole model: how this rank's is cut from it, its whole shape, and
/// its offset in the whole model's global order.
struct WholeEntry {
    split: Split,
    shape: Vec<usize>,
    offset: usize,
}

impl TensorPart {
    /// This rank's place in its tensor group and the group's size.
    pub fn place(&self) -> (usize, usize) {
        (self.comm.rank(), self.comm.world_size())
    }

    /// The parts of unit `unit`'s flat range `range` this rank counts in the norm: all of
    /// it on tensor rank 0; elsewhere only its split parameters' parts.
    pub fn counted(&self, unit: usize, range: Range<usize>) -> Vec<Range<usize>> {
        if self.comm.rank() == 0 {
            return vec![range];
        }
        let mut parts = Vec::new();
        let mut at = range.start;
        for whole in &self.whole[unit] {
            if whole.end <= at || whole.start >= range.end {
                continue;
            }
            if whole.start > at {
                parts.push(at..whole.start);
            }
            at = at.max(whole.end);
        }
        if at < range.end {
            parts.push(at..range.end);
        }
        parts
    }

    /// Makes unit `unit`'s parameters that every tensor rank holds whole (norms, the biases
    /// added after a row-parallel sum) the same on all of them: tensor rank 0's first
    /// values in `values` (the unit's flat buffer on this rank), broadcast over the tensor
    /// group, replace the others'. Their gradients are then the same on every tensor rank
    /// (each computes them from the same whole activations), so they stay equal, and the
    /// checkpoint's copy (tensor rank 0's) is every rank's: a model whose ranks drew them
    /// differently (a user's model built per rank) cannot diverge silently.
    pub fn agree_whole(&self, unit: usize, mut values: BufMut<'_>) -> Result<()> {
        for range in &self.whole[unit] {
            self.comm.broadcast(values.reborrow().slice(range.clone()), 0)?;
        }
        Ok(())
    }

    /// The whole model's global order, as a manifest records it (paths from `sharding`).
    pub fn manifest_layout(&self, sharding: &Sharding) -> Vec<LayoutEntry> {
        let paths = sharding.global().entries().iter().map(|e| &e.path);
        paths
            .zip(&self.layout)
            .map(|(path, w)| LayoutEntry {
                path: path.clone(),
                shape: w.shape.iter().map(|&d| d as u64).collect(),
                offset: w.offset as u64,
            })
            .collect()
    }

    /// The pieces of unit `unit`'s flat range `range` and where each lies in the whole
    /// model's global order (the note on checkpoints), as `Sharding::global_segments` gives
    /// them for an unsplit model; `saving` leaves out, on tensor ranks other than the
    /// first, the parameters every tensor rank holds.
    pub fn segments(
        &self,
        sharding: &Sharding,
        unit: usize,
        range: Range<usize>,
        saving: bool,
    ) -> Vec<(Range<usize>, Range<usize>)> {
        let (t, tp) = self.place();
        let u = &sharding.units()[unit];
        let mut out: Vec<(Range<usize>, Range<usize>)> = Vec::new();
        for (entry, &g) in u.layout.entries().iter().zip(&u.global_entries) {
            let Some(segment) = entry.segment(range.clone()) else { continue };
            let whole = &self.layout[g];
            if saving && t != 0 && whole.split == Split::Whole {
                continue;
            }
            let runs = whole.split.runs(&whole.shape, t, tp, &entry.path).expect("checked when the engine was built");
            for (global, local) in within(&runs, segment.param_range) {
                let flat = entry.offset + local.start..entry.offset + local.end;
                let global = whole.offset + global.start..whole.offset + global.end;
                match out.last_mut() {
                    Some((f, g)) if f.end == flat.start && g.end == global.start => {
                        f.end = flat.end;
                        g.end = global.end;
                    }
                    _ => out.push((flat, global)),
                }
            }
        }
        out
    }
}

/// The tensor-parallel share of an engine for `model` under `plan` on `ctx`: `None`
/// without a tensor-parallel mesh (sequence parallelism alone needs none: every rank holds
/// the whole model). An error naming the key where the plan has a mesh and the context is
/// not one `mesh::split` gave, where the model has no plan for it or was built for other
/// groups, and where a split model meets a plan without a mesh.
pub(super) fn tensor_part<M: UnitModel>(
    model: &M,
    plan: &Plan,
    ctx: &RankContext,
    sharding: &Sharding,
) -> Result<Option<TensorPart>> {
    let place = ctx.mesh();
    let mesh = place.map_or(plan.mesh, |p| p.plan);
    let split = model.model_split();
    let (tp, sp) = split.as_ref().map_or((1, 1), |s| (s.tensor.size(), s.sequence.size()));
    if mesh.is_trivial() {
        if (tp, sp) == (1, 1) {
            return Ok(None);
        }
        return Err(Error::Usage(format!(
            "the model is split over {tp} tensor and {sp} sequence ranks, but the plan has no mesh: set \
             tensor_parallel.autotp_size to {tp} and zerotrain.mesh.sp to {sp}"
        )));
    }
    let place = place.ok_or_else(|| {
        Error::Usage(
            "the plan has a tensor- or sequence-parallel mesh (tensor_parallel.autotp_size, zerotrain.mesh): build \
             the engine with the context and plan zerotrain::mesh::split gives, and the model for its groups"
                .into(),
        )
    })?;
    let Some(split) = split.filter(|_| (tp, sp) != (1, 1)) else {
        return Err(Error::Usage(format!(
            "the mesh has tp {} and sp {}, but the model has no tensor- or sequence-parallel plan \
             (UnitModel::model_split): build it for the mesh's groups (the Hugging Face families: \
             zerotrain_models::family::fresh_split or import_split); a model is never trained whole on every rank \
             (tensor_parallel.autotp_size is {})",
            mesh.tp, mesh.sp, mesh.tp
        )));
    };
    let (s, sp_mesh) = (place.coordinates.1, mesh.sp);
    if (split.sequence.rank(), sp) != (s, sp_mesh) {
        return Err(Error::Usage(format!(
            "the model runs sequence rank {} of {sp}, but this rank is sequence rank {s} of {sp_mesh}: build it for \
             the mesh's sequence group",
            split.sequence.rank()
        )));
    }
    let (t, tp) = (place.coordinates.2, mesh.tp);
    if (split.tensor.rank(), split.tensor.size()) != (t, tp) {
        return Err(Error::Usage(format!(
            "the model is rank {} of {} tensor-parallel ranks, but this rank is tensor rank {t} of {tp}: build it \
             for the mesh's tensor group",
            split.tensor.rank(),
            split.tensor.size()
        )));
    }
    if tp == 1 {
        return Ok(None); // sequence parallelism alone: every rank holds the whole model
    }
    let whole = sharding
        .units()
        .iter()
        .map(|unit| {
            let entries = unit.layout.entries().iter();
            entries.filter(|e| !split.splits.contains_key(&e.path)).map(|e| e.flat_range()).collect()
        })
        .collect();
    let comm = Arc::clone(place.tensor.collective());
    let layout = whole_layout(sharding, &split.splits, comm.as_ref())?;
    Ok(Some(TensorPart { comm, whole, mesh: Arc::clone(&place.world), layout }))
}

/// The whole model's global order: each split parameter's whole length along its cut is
/// the sum of the tensor ranks' (one all-reduce over the tensor group).
fn whole_layout(
    sharding: &Sharding,
    splits: &std::collections::BTreeMap<String, Split>,
    comm: &dyn Collective,
) -> Result<Vec<WholeEntry>> {
    let entries = sharding.global().entries();
    let cut = |path: &str| splits.get(path).copied().unwrap_or(Split::Whole);
    let mut lengths: Vec<f32> = entries.iter().map(|e| cut(&e.path).dim().map_or(0.0, |d| e.shape[d] as f32)).collect();
    if let Some(e) = entries.iter().find(|e| cut(&e.path).dim().is_some_and(|d| e.shape[d] >= 1 << 24)) {
        return Err(Error::Model(format!(
            "`{}` has {:?}: a cut dimension over 2^24 is not supported",
            e.path, e.shape
        )));
    }
    comm.all_reduce((&mut lengths).into(), ReduceOp::Sum)?;
    let mut offset = 0;
    let layout = entries
        .iter()
        .zip(lengths)
        .map(|(e, whole)| {
            let split = cut(&e.path);
            let mut shape = e.shape.clone();
            if let Some(d) = split.dim() {
                shape[d] = whole as usize;
            }
            let entry = WholeEntry { split, offset, shape };
            offset += entry.shape.iter().product::<usize>();
            entry
        })
        .collect();
    Ok(layout)
}

#[cfg(test)]
mod tests {
    use super::*;
    use zerotrain_zero::ThreadWorld;

    /// Tensor rank 0 counts a range whole; another rank skips the parameters every rank
    /// holds, where they overlap the range.
    #[test]
    fn only_the_first_tensor_rank_counts_what_every_rank_holds() {
        let world = ThreadWorld::new(2, std::time::Duration::from_secs(5));
        let whole = vec![vec![0..4, 10..12, 20..30]];
        let share = |r: usize| TensorPart {
            comm: Arc::new(world.communicator(r)),
            whole: whole.clone(),
            mesh: Arc::new(world.communicator(r)),
            layout: Vec::new(),
        };
        assert_eq!(share(0).counted(0, 2..25), vec![2..25]);
        assert_eq!(share(1).counted(0, 2..25), vec![4..10, 12..20]);
        assert_eq!(share(1).counted(0, 12..20), vec![12..20]);
        assert_eq!(share(1).counted(0, 21..29), Vec::<Range<usize>>::new());
        assert_eq!(share(1).counted(0, 28..40), vec![30..40]);
    }
}
