//! [`RankContext`]: what one rank trains with. It sits below the engine and the launcher:
//! [`launch`](crate::launch) makes one per rank, [`Engine`](crate::Engine) reads it, and a
//! program with its own launcher (or a test) can build one from any [`Collective`].

use std::sync::Arc;

use burn::tensor::Device;
use zerotrain_zero::Collective;
use zerotrain_zero::pipeline::Topology;

use crate::Result;
use crate::config::MeshPlan;
use crate::nn::parallel::ParallelGroup;

/// One rank's view of the world: its rank, the world size, its device, its collective, and
/// its place among the pipeline stages and data-parallel ranks.
#[derive(Clone)]
pub struct RankContext {
    rank: usize,
    world_size: usize,
    device: Device,
    comm: Arc<dyn Collective>,
    topology: Topology,
    notices: Vec<String>,
    /// Which part of a global batch this rank reads, where that is not its place in the
    /// topology (a rank of a replica group reads by its place in the whole world).
    data_position: Option<(usize, usize)>,
    /// The replica group this rank trains in (`local_sgd`), if any.
    replica_group: Option<usize>,
    /// Its place in a device mesh, where its collective is the mesh's data-parallel group.
    mesh: Option<MeshPlace>,
}

impl RankContext {
    /// A context on `comm`'s rank, training on `device` (an autodiff device), without a
    /// pipeline (every rank is a data-parallel rank).
    pub fn new(comm: Arc<dyn Collective>, device: Device) -> Self {
        let (rank, world_size) = (comm.rank(), comm.world_size());
        let topology = Topology { stages: 1, data_parallel: world_size };
        let (notices, data_position, replica_group, mesh) = Default::default();
        Self { rank, world_size, device, comm, topology, notices, data_position, replica_group, mesh }
    }

    /// The same rank with its collectives on `comm` (the same ranks, another library), and
    /// `notice` for the engine to give, if any.
    pub(crate) fn with_collective(mut self, comm: Arc<dyn Collective>, notice: Option<String>) -> Self {
        debug_assert_eq!((comm.rank(), comm.world_size()), (self.rank, self.world_size));
        self.comm = comm;
        self.notices.extend(notice);
        self
    }

    /// The same rank reading part `index` of `parts` of each global batch.
    pub(crate) fn with_data_position(mut self, index: usize, parts: usize) -> Self {
        self.data_position = Some((index, parts));
        self
    }

    /// The same rank as one of replica group `group`'s ([`split`](crate::replicas::split)).
    pub(crate) fn in_replica_group(mut self, group: usize) -> Self {
        self.replica_group = Some(group);
        self
    }

    /// The same rank as the data-parallel rank of a device mesh ([`crate::mesh::split`]).
    pub(crate) fn in_mesh(mut self, place: MeshPlace) -> Self {
        self.mesh = Some(place);
        self
    }

    /// This rank's place in a device mesh, if its context is a mesh's data-parallel group.
    pub fn mesh(&self) -> Option<&MeshPlace> {
        self.mesh.as_ref()
    }

    /// The replica group this rank trains in, if it is one's (`local_sgd`).
    pub fn replica_group(&self) -> Option<usize> {
        self.replica_group
    }

    /// What the launcher has to say about how this rank runs (where `zerotrain.collectives:
    /// "auto"` fell back to the host backend, say); the engine gives each as a notice.
    pub fn notices(&self) -> &[String] {
        &self.notices
    }

    /// The same rank in a job of `stages` pipeline stages (DeepSpeed's order: rank `r` is
    /// stage `r / D`, data-parallel rank `r % D`); an error unless `stages` divides the
    /// world size. [`launch`](crate::launch) sets it from the plan.
    pub fn with_stages(mut self, stages: usize) -> Result<Self> {
        self.topology = Topology::new(self.world_size, stages)?;
        Ok(self)
    }

    /// This rank, `0..world_size`.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Number of ranks.
    pub fn world_size(&self) -> usize {
        self.world_size
    }

    /// This rank's pipeline stage (0 without a pipeline).
    pub fn stage(&self) -> usize {
        self.topology.stage(self.rank)
    }

    /// Pipeline stages (1 without a pipeline).
    pub fn num_stages(&self) -> usize {
        self.topology.stages
    }

    /// This rank's index among the ranks that split each batch (its stage's data-parallel
    /// ranks; without a pipeline, its rank): which part of a global batch it reads.
    pub fn data_parallel_rank(&self) -> usize {
        self.data_position.map_or_else(|| self.topology.data_index(self.rank), |(index, _)| index)
    }

    /// Ranks that split each batch (per stage).
    pub fn data_parallel_size(&self) -> usize {
        self.data_position.map_or(self.topology.data_parallel, |(_, parts)| parts)
    }

    /// The device to build the model and batches on (autodiff enabled).
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// The rank's collective.
    pub fn collective(&self) -> Arc<dyn Collective> {
        Arc::clone(&self.comm)
    }
}

/// A rank's place in the mesh: its coordinates and groups, carried by the data-parallel
/// context an engine is built with.
#[derive(Clone)]
pub struct MeshPlace {
    /// The mesh's sizes.
    pub plan: MeshPlan,
    /// (data-parallel, sequence, tensor) index of this rank (within its pipeline stage).
    pub coordinates: (usize, usize, usize),
    /// The ranks that split each layer with this one.
    pub tensor: ParallelGroup,
    /// The ranks that split each sequence with this one.
    pub sequence: ParallelGroup,
    /// Every rank of the job (every stage's).
    pub world: Arc<dyn Collective>,
}

impl std::fmt::Debug for MeshPlace {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (d, s, t) = self.coordinates;
        write!(f, "MeshPlace(dp {d}, sp {s} of {}, tp {t} of {})", self.plan.sp, self.plan.tp)
    }
}
