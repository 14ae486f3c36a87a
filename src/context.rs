//! [`RankContext`]: what one rank trains with. It sits below the engine and the launcher:
//! [`launch`](crate::launch) makes one per rank, [`Engine`](crate::Engine) reads it, and a
//! program with its own launcher (or a test) can build one from any [`Collective`].

use std::sync::Arc;

use burn::tensor::Device;
use zerotrain_zero::Collective;

/// One rank's view of the world: its rank, the world size, its device and its collective.
#[derive(Clone)]
pub struct RankContext {
    rank: usize,
    world_size: usize,
    device: Device,
    comm: Arc<dyn Collective>,
}

impl RankContext {
    /// A context on `comm`'s rank, training on `device` (an autodiff device).
    pub fn new(comm: Arc<dyn Collective>, device: Device) -> Self {
        Self { rank: comm.rank(), world_size: comm.world_size(), device, comm }
    }

    /// This rank, `0..world_size`.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Number of ranks.
    pub fn world_size(&self) -> usize {
        self.world_size
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
