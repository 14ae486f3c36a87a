//! Tensor parallelism's building blocks, as Megatron-LM defines them: a [`ParallelGroup`]
//! of ranks that split each layer between them, its two operations (`f`,
//! [`ParallelGroup::copy_to`]: the identity forward, a sum over the group backward; `g`,
//! [`ParallelGroup::reduce_from`]: the sum forward, the identity backward), the rules the
//! models' layers are made of ([`row_parallel_linear`], [`vocab_parallel_lookup`]; a
//! column-parallel layer is `linear` after `copy_to`), how a parameter is cut ([`Split`],
//! [`split_module`]), and Ulysses' exchange ([`ParallelGroup::all_to_all`]). The loss over a
//! vocabulary split across the group, no rank forming the whole logits, is
//! [`LinearCrossEntropy::forward_parallel`](crate::nn::LinearCrossEntropy::forward_parallel).
//!
//! The operations are Burn autodiff operations over zerotrain's
//! [`Collective`], so they run over threads, MPI and NCCL alike. Every rank of a group calls
//! them in the same order on tensors of the same shape, as every collective is called.
//!
//! # Note: which gradients are whole
//! A layer pair `copy_to -> column-parallel -> ... -> row-parallel -> reduce_from` computes
//! what the unsplit pair does: each rank holds a slice of the weights, the sum restores the
//! whole output, and the copy's backward sums the slices' contributions to the input's
//! gradient. Everything outside the pair (norms, residuals, the loss) computes the same
//! values on every rank of the group, so the gradients of parameters every rank holds
//! (norms, the row-parallel bias) come out equal on all of them, and each slice's gradient
//! is the unsplit layer's gradient of that slice.

mod exchange;
mod gather;
mod linear;
mod module_split;
mod ops;
mod split;

use std::collections::BTreeMap;
use std::fmt;
use std::ops::Range;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use burn::tensor::Tensor;
use zerotrain_zero::{Collective, ReduceOp, ThreadWorld};

pub(crate) use linear::local_ids;
pub use linear::{row_parallel_linear, vocab_parallel_lookup};
pub use module_split::split_module;
pub use split::{Split, within};

/// The ranks that split each layer between them (a tensor-parallel group): a handle on their
/// collective, cheap to clone into every layer that needs it.
#[derive(Clone)]
pub struct ParallelGroup {
    comm: Arc<dyn Collective>,
    /// What its operations sent, by way (shared by every clone).
    traffic: Arc<[AtomicU64; 2]>,
}

/// Activation bytes a rank handed to its collectives, by the way they went: as device
/// tensors to a collective that reads device memory (NCCL's, through
/// [`engine::on_device`](crate::engine::on_device): on a CUDA device they never reach the
/// host), or read into host memory for a host collective (there, from a GPU tensor, they
/// cross to the host and the result back). A [`ParallelGroup`]'s operations count their
/// inputs ([`ParallelGroup::traffic`]), a pipeline stage its sends
/// ([`Pipeline::activation_traffic`](crate::Pipeline::activation_traffic)).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct GroupTraffic {
    /// Handed to the collective on the device.
    pub on_device: u64,
    /// Read into host memory for the collective.
    pub through_host: u64,
}

impl fmt::Debug for ParallelGroup {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ParallelGroup(rank {} of {})", self.rank(), self.size())
    }
}

impl ParallelGroup {
    /// The group of `comm`'s ranks (a communicator split from the world for this purpose:
    /// every rank of it holds a slice of the same layers).
    pub fn new(comm: Arc<dyn Collective>) -> Self {
        Self { comm, traffic: Arc::default() }
    }

    /// A group of one rank: every operation is the identity and nothing is split.
    pub fn alone() -> Self {
        Self::new(Arc::new(ThreadWorld::new(1, Duration::from_secs(1)).communicator(0)))
    }

    /// This rank's place in the group, `0..size`.
    pub fn rank(&self) -> usize {
        self.comm.rank()
    }

    /// Ranks in the group.
    pub fn size(&self) -> usize {
        self.comm.world_size()
    }

    /// The group's collective.
    pub fn collective(&self) -> &Arc<dyn Collective> {
        &self.comm
    }

    /// The bytes the group's operations have sent so far, on this rank, by way.
    pub fn traffic(&self) -> GroupTraffic {
        let [on_device, through_host] = &*self.traffic;
        GroupTraffic {
            on_device: on_device.load(Ordering::Relaxed),
            through_host: through_host.load(Ordering::Relaxed),
        }
    }

    /// Counts `bytes` an operation sent, on the device or through the host.
    fn counted(&self, on_device: bool, bytes: u64) {
        self.traffic[usize::from(!on_device)].fetch_add(bytes, Ordering::Relaxed);
    }

    /// This rank's part of `len` items that need not divide over the group (a
    /// vocabulary): cut at `floor(r * len / size)`, so parts differ by at most one.
    pub fn part(&self, len: usize) -> Range<usize> {
        split::uneven(len, self.rank(), self.size())
    }

    /// Megatron's `f`: `x` unchanged, its gradient summed over the group. It enters a
    /// region the ranks compute a slice each of (a column-parallel layer's input).
    pub fn copy_to<const D: usize>(&self, x: Tensor<D>) -> Tensor<D> {
        if self.size() == 1 {
            return x;
        }
        Tensor::from_dispatch(ops::copy(x.into_dispatch(), self.clone()))
    }

    /// Megatron's `g`: `x` summed over the group (every rank receiving the sum), its
    /// gradient passed through unchanged. It leaves a region the ranks computed a part
    /// each of ([`row_parallel_linear`] calls it). Half precision is summed in f32 and
    /// rounded once.
    pub fn reduce_from<const D: usize>(&self, x: Tensor<D>) -> Tensor<D> {
        if self.size() == 1 {
            return x;
        }
        Tensor::from_dispatch(ops::reduce(x.into_dispatch(), self.clone(), ReduceOp::Sum))
    }

    /// DeepSpeed-Ulysses' exchange: `x` cut along dimension `scatter` into a part per rank,
    /// part `j` sent to rank `j`, the parts received joined along dimension `gather` in
    /// rank order (sequence parts for head parts before attention, and back after it). Its
    /// gradient is the inverse exchange. Dimension `scatter` must divide by the group's
    /// size (a panic naming it otherwise, after aborting the job).
    pub fn all_to_all<const D: usize>(&self, x: Tensor<D>, scatter: usize, gather: usize) -> Tensor<D> {
        if self.size() == 1 {
            return x;
        }
        Tensor::from_dispatch(ops::all_to_all(x.into_dispatch(), self.clone(), [scatter, gather]))
    }

    /// The element-wise maximum of `x` over the group; no gradient flows through it.
    pub fn max<const D: usize>(&self, x: Tensor<D>) -> Tensor<D> {
        if self.size() == 1 {
            return x.detach();
        }
        Tensor::from_dispatch(ops::reduce(x.detach().into_dispatch(), self.clone(), ReduceOp::Max))
    }
}

/// A model's split over a device mesh, as an engine needs to know it: the tensor group and
/// how each split parameter is cut, by module path (every other parameter is whole on every
/// rank of the group, with equal values and equal gradients), and the sequence group whose
/// ranks each run a part of every sequence through the model's units.
#[derive(Debug, Clone)]
pub struct ModelSplit {
    /// The ranks that split the model's layers (tensor parallelism).
    pub tensor: ParallelGroup,
    /// Each split parameter's cut, by module path.
    pub splits: BTreeMap<String, Split>,
    /// The ranks that split each sequence (a group of one: none).
    pub sequence: ParallelGroup,
}

/// The groups a rank's part of a model is built for: the ranks that split its layers and
/// those that split each sequence.
#[derive(Debug, Clone)]
pub struct ParallelGroups {
    /// Tensor parallelism's group.
    pub tensor: ParallelGroup,
    /// Sequence parallelism's group.
    pub sequence: ParallelGroup,
}

impl ParallelGroups {
    /// Groups of one rank each: nothing split.
    pub fn alone() -> Self {
        Self { tensor: ParallelGroup::alone(), sequence: ParallelGroup::alone() }
    }
}

#[cfg(test)]
pub(crate) mod tests;
