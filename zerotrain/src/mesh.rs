//! The device mesh: the world split into a rank's tensor-parallel, sequence-parallel and
//! data-parallel groups, each a communicator split from the world as replica groups are.
//!
//! ```text
//! world rank r = ((stage * dp + d) * sp + s) * tp + t      (a tensor group: tp consecutive ranks)
//! ```
//!
//! A program builds its model for [`MeshRank::groups`] (the Hugging Face families:
//! `zerotrain_models::family::fresh_split` or `import_split`; the built-in GPT:
//! `Gpt::new_split`) and its trainer with [`MeshRank::trainer`] (or an engine with
//! [`MeshRank::ctx`] and [`MeshRank::plan`]): ZeRO shards each tensor rank's slice over its
//! data-parallel group, and every rank of a tensor group reads the same samples. With
//! replica groups (`local_sgd`) each group is a mesh of its own, and the trainer meets the
//! other groups.
//!
//! # Note: a mesh in a pipeline
//! With pipeline stages, each stage's ranks are a mesh of their own (the stage's ranks
//! consecutive, as without a mesh). The context [`split`] gives is the job's ranks of this
//! rank's tensor index, in world order: to the pipeline they are an ordinary pipeline of
//! `dp * sp` data-parallel ranks per stage, every one of them holding tensor part `t` of
//! its stage's units. So what a pipeline exchanges (activations between neighbouring
//! stages, the root's gradient over the stages, world rank 0's first values for every
//! stage) passes between ranks of the same tensor part, and the engine adds the tensor
//! dimension on top of it (the norm over the tensor group, the checkpoint in the whole
//! model's order), as it does without a pipeline.

use crate::config::MeshPlan;
use crate::engine::UnitModel;
use crate::nn::parallel::{ParallelGroup, ParallelGroups};
use crate::replicas::{LocalSgd, Replicas};
use crate::{Error, Plan, RankContext, Result, Trainer};

pub use crate::context::MeshPlace;

/// What [`split`] gives a rank: the context and plan its engine is built with (the context
/// carries its [`MeshPlace`]), and its tensor- and sequence-parallel groups.
pub struct MeshRank {
    /// The ranks ZeRO shards this rank's part of the model over: its data-parallel places'
    /// ranks of its sequence group too (DeepSpeed's sequence-data-parallel group: the
    /// sequence ranks hold the same parameters), reading its data-parallel place's part of
    /// every batch.
    pub ctx: RankContext,
    /// The plan over that group (its world size the group's, its mesh in the context).
    pub plan: Plan,
    /// The ranks that split each layer with this one (build the model for it).
    pub tensor: ParallelGroup,
    /// The ranks that split each sequence with this one.
    pub sequence: ParallelGroup,
    /// Its replica groups (`local_sgd`), where each group is a mesh of its own.
    pub replicas: Option<Replicas>,
}

/// Splits `ctx`'s world into `plan`'s mesh (`plan.mesh`): with replica groups
/// (`local_sgd`), each group's ranks into a mesh of their own. Every rank calls it at once.
/// An error where the plan has no mesh, or is for another world size.
pub fn split(ctx: &RankContext, plan: &Plan) -> Result<MeshRank> {
    let mesh = plan.mesh;
    if mesh.is_trivial() {
        return Err(Error::Usage("mesh::split: the plan has no tensor or sequence parallelism".into()));
    }
    if plan.replicas.is_some() {
        // The group's mesh; the rounds pass between the ranks at the same place of every
        // group, so of the same tensor part and shard.
        let (group_ctx, group_plan, replicas) = crate::replicas::split(ctx, plan)?;
        let mut rank = split(&group_ctx, &group_plan)?;
        let replicas = replicas.on_mesh(rank.ctx.data_parallel_rank(), rank.ctx.data_parallel_size());
        let (index, parts) = replicas.data_position();
        rank.ctx = rank.ctx.with_data_position(index, parts).in_replica_group(replicas.group());
        rank.replicas = Some(replicas);
        return Ok(rank);
    }
    let world = ctx.collective();
    if world.world_size() != plan.world_size() {
        let (planned, actual) = (plan.world_size(), world.world_size());
        return Err(Error::Usage(format!("mesh::split: the plan is for {planned} ranks, the world has {actual}")));
    }
    let dp = plan.data_parallel_size();
    let stages = plan.pipeline.map_or(1, |p| p.stages);
    let stage_ranks = dp * mesh.model_parallel();
    let (stage, (d, s, t)) = (world.rank() / stage_ranks, mesh.coordinates(world.rank() % stage_ranks));
    // Colors: the other coordinates; keys: the group's own. The engine's ranks: this
    // tensor index's, in world order (module note).
    let tensor = world.split((stage * dp + d) * mesh.sp + s, t)?;
    let sequence = world.split((stage * dp + d) * mesh.tp + t, s)?;
    let shards = world.split(t, (stage * dp + d) * mesh.sp + s)?;
    let (tensor, sequence) = (ParallelGroup::new(tensor), ParallelGroup::new(sequence));
    let place =
        MeshPlace { plan: mesh, coordinates: (d, s, t), tensor: tensor.clone(), sequence: sequence.clone(), world };
    let ctx =
        RankContext::new(shards, ctx.device().clone()).with_stages(stages)?.with_data_position(d, dp).in_mesh(place);
    let mut group_plan = plan.clone();
    group_plan.runtime.world_size = stages * dp * mesh.sp;
    group_plan.mesh = MeshPlan::default();
    Ok(MeshRank { ctx, plan: group_plan, tensor, sequence, replicas: None })
}

impl MeshRank {
    /// The groups to build this rank's part of the model for.
    pub fn groups(&self) -> ParallelGroups {
        ParallelGroups { tensor: self.tensor.clone(), sequence: self.sequence.clone() }
    }

    /// This rank's trainer of `model` (its part, built for [`groups`](Self::groups)): as
    /// [`crate::trainer`] builds it, over the mesh's context and plan, meeting the other
    /// replica groups where the plan has them.
    pub fn trainer<M: UnitModel + 'static>(&self, model: M) -> Result<Box<dyn Trainer<M>>> {
        match &self.replicas {
            Some(replicas) => {
                let engine = crate::Engine::with_units(model, &self.plan, &self.ctx)?;
                Ok(Box::new(LocalSgd::new(engine, replicas.clone())?))
            }
            None => crate::trainer(model, &self.plan, &self.ctx),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use burn::tensor::Device;
    use zerotrain_precision::{BufMut, BufRef};
    use zerotrain_zero::{Collective, ThreadWorld};

    use super::*;
    use crate::config::{Config, Overrides};

    /// Every rank's groups hold the world ranks the mesh's order says, in order: at dp 2 x
    /// sp 2 x tp 2, rank 5 = (1, 0, 1) has tensor group {4, 5}, sequence group {5, 7}, and
    /// shards its part over {1, 3, 5, 7} (its tensor rank's every data and sequence rank);
    /// that plan's world is 4, its batch the whole job's, and the data split over dp 2.
    #[test]
    fn each_rank_gets_the_groups_of_its_coordinates() {
        let json = r#"{"train_micro_batch_size_per_gpu": 1, "zerotrain": {"mesh": {"tp": 2, "sp": 2}}}"#;
        let plan = Config::parse(json, "t.json")
            .unwrap()
            .resolve(Overrides { world_size: Some(8), ..Default::default() })
            .unwrap();
        let world = ThreadWorld::new(8, Duration::from_secs(30));
        let got: Vec<_> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..8)
                .map(|r| {
                    let (world, plan) = (&world, &plan);
                    s.spawn(move || {
                        let ctx = RankContext::new(Arc::new(world.communicator(r)), Device::flex());
                        let m = split(&ctx, plan).unwrap();
                        let members = |comm: &Arc<dyn Collective>| {
                            let mut all = vec![0f32; comm.world_size()];
                            comm.all_gather(BufRef::F32(&[r as f32]), BufMut::F32(&mut all)).unwrap();
                            all.into_iter().map(|x| x as usize).collect::<Vec<_>>()
                        };
                        let place = m.ctx.mesh().unwrap().coordinates;
                        let dp = (m.ctx.data_parallel_rank(), m.ctx.data_parallel_size(), m.plan.world_size());
                        (
                            place,
                            members(m.tensor.collective()),
                            members(m.sequence.collective()),
                            members(&m.ctx.collective()),
                            dp,
                            m.plan.batch.train_batch_size,
                        )
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let (place, tensor, sequence, data, dp, batch) = &got[5];
        assert_eq!(
            (*place, tensor.as_slice(), sequence.as_slice(), data.as_slice()),
            ((1, 0, 1), &[4, 5][..], &[5, 7][..], &[1, 3, 5, 7][..])
        );
        assert_eq!((*dp, *batch), ((1, 2, 4), 2));
        for (r, (place, tensor, sequence, data, _, _)) in got.iter().enumerate() {
            assert_eq!(plan.mesh.coordinates(r), *place);
            assert!(tensor.contains(&r) && sequence.contains(&r) && data.contains(&r), "rank {r}");
            assert_eq!((tensor.len(), sequence.len(), data.len()), (2, 2, 4), "rank {r}");
        }
    }
}
