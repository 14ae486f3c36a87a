//! [`Shared`]: what every unit of a rank works with.

use std::ops::Range;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use burn::tensor::{Device, Tensor};
use zerotrain_precision::Precision;
use zerotrain_zero::{Collective, DeviceOp, FlatLayout, ReduceOp, Sharding, ZeroStage};

use super::flat::tensor_bytes;
use super::frozen::FrozenLayout;
use super::on_device;
use super::optimizer::ShardSegment;
use super::params::ParamIndex;
use super::report::HostDeviceBytes;
use super::tensor::TensorPart;
use crate::config::{ComputeDevice, Plan, Tier};
use crate::random::Streams;
use crate::swap::SwapDir;
use crate::{Error, Result};

/// The rank's swap folders, one per NVMe tier in use.
#[derive(Default)]
pub(crate) struct SwapFolders {
    /// Master weights and optimizer state (`offload_optimizer.device: "nvme"`).
    pub optimizer: Option<Arc<SwapDir>>,
    /// Stage 3 parameter shards (`offload_param.device: "nvme"`).
    pub param: Option<Arc<SwapDir>>,
}

impl SwapFolders {
    /// The rank's swap folders for the plan's NVMe tiers, agreed over the world: if any rank
    /// cannot open its folder (unwritable, or in use by another job), every rank fails at
    /// once, the failing one naming the path, instead of the others waiting at the next
    /// collective. Each folder is named by `owner`: the rank, and its replica group or
    /// tensor rank where it has one (their ranks count from 0 in every group).
    pub fn open(plan: &Plan, world: &dyn zerotrain_zero::Collective, owner: &str) -> Result<Self> {
        let offload = &plan.zero.offload;
        let open = |tier: &Tier, name: &str| -> Result<Option<Arc<SwapDir>>> {
            tier.nvme_path().map(|path| SwapDir::open(path, name, owner, offload.aio).map(Arc::new)).transpose()
        };
        let opened = open(&offload.optimizer, "optimizer")
            .and_then(|optimizer| Ok(Self { optimizer, param: open(&offload.param, "param")? }));
        agree(world, opened, "opening their NVMe swap folders")
    }
}

/// All ranks of `comm` agree on whether `result` succeeded everywhere: a failing rank
/// returns its own error, the others [`Error::PeerFailed`] naming the failed ranks. The
/// ranks stay usable, so a caller may catch the failure and go on.
pub(crate) fn agree<T>(comm: &dyn Collective, result: Result<T>, phase: &str) -> Result<T> {
    let mut failed = vec![0.0f32; comm.world_size()];
    failed[comm.rank()] = if result.is_ok() { 0.0 } else { 1.0 };
    comm.all_reduce((&mut failed).into(), ReduceOp::Max)?;
    let ranks: Vec<usize> = failed.iter().enumerate().filter(|(_, f)| **f > 0.0).map(|(r, _)| r).collect();
    match result {
        Err(e) => Err(e),
        Ok(_) if !ranks.is_empty() => Err(Error::PeerFailed { ranks, phase: phase.to_string() }),
        Ok(v) => Ok(v),
    }
}

/// What every unit works with: the rank's collectives and device, the plan, the units'
/// layouts and the index of the model's parameters.
pub(crate) struct Shared {
    /// The ranks the units are sharded over: the engine's ranks, or a pipeline stage's
    /// data-parallel group.
    pub comm: Arc<dyn Collective>,
    /// The ranks the engine was built over (its context's collective): the job's, a
    /// replica group's, or a mesh's data-parallel group of one tensor index. The gradient
    /// norm, the loss and checkpoints agree over them (over the tensor group too, on a mesh).
    pub ranks: Arc<dyn Collective>,
    pub device: Device,
    pub plan: Plan,
    pub sharding: Sharding,
    pub index: ParamIndex,
    /// Stage 3: the units' frozen parameters, sharded like the trained ones (`frozen/`).
    pub frozen: Option<FrozenLayout>,
    /// The swap folders of the NVMe tiers.
    pub swaps: SwapFolders,
    /// Bytes copied between host memory and the device (see [`crossed`](Self::crossed)).
    pub crossings: Crossings,
    /// The random streams the rank's forward passes draw from.
    pub streams: Streams,
    /// Whether the step stays on the device: gradients, their norm, the optimizer and the
    /// new parameters (the note in `engine/flat.rs`).
    pub device_step: bool,
    /// How the units are split over a tensor-parallel group, if they are (`tensor.rs`).
    pub tensor: Option<TensorPart>,
    /// On a mesh, this rank's data-parallel place and the places' count: the ranks of a
    /// sequence group shard one model but read the same samples.
    pub data_place: Option<(usize, usize)>,
    /// On a mesh, its tensor and sequence groups' collectives, whose traffic (the model's
    /// own collectives, in its forward and backward) the engine counts with its own.
    pub mesh_groups: Vec<Arc<dyn Collective>>,
}

/// Model-state bytes a rank copied between host memory and its device, each way.
#[derive(Debug, Default)]
pub(crate) struct Crossings {
    to_device: AtomicU64,
    to_host: AtomicU64,
    /// Reads of the loss or the gradient norm ([`Shared::read_values`]).
    reads: AtomicU64,
}

impl Shared {
    /// The pieces of unit `unit`'s flat range `range` and their places in the checkpoint's
    /// global order: the whole model's for a tensor-parallel rank (`tensor.rs`), where
    /// `saving` leaves out what another tensor rank writes.
    pub fn checkpoint_segments(
        &self,
        unit: usize,
        range: Range<usize>,
        saving: bool,
    ) -> Vec<(Range<usize>, Range<usize>)> {
        match &self.tensor {
            Some(tensor) => tensor.segments(&self.sharding, unit, range, saving),
            None => self.sharding.global_segments(unit, range),
        }
    }

    /// The ranks that write and agree on a checkpoint: the engine's, or every rank of its
    /// mesh.
    pub fn checkpoint_ranks(&self) -> &Arc<dyn Collective> {
        self.tensor.as_ref().map_or(&self.ranks, |t| &t.mesh)
    }

    /// Seconds since `start`, for a phase of the step's report. With `wall_clock_breakdown`
    /// on a device that queues its work (wgpu, CUDA) the device first finishes what was
    /// queued, as DeepSpeed's synchronised timers do, so that the phases split the step (at
    /// the price of those waits); otherwise a phase is the host's time queueing it.
    pub fn phase_seconds(&self, start: Instant) -> f64 {
        if self.plan.runtime.wall_clock_breakdown && self.plan.runtime.device != ComputeDevice::Cpu {
            // A device that failed says so at the step's next read of a value.
            let _ = self.device.sync();
        }
        start.elapsed().as_secs_f64()
    }

    /// Unit `unit`'s flat layout.
    pub fn layout(&self, unit: usize) -> &FlatLayout {
        &self.sharding.units()[unit].layout
    }

    pub fn stage(&self) -> ZeroStage {
        self.plan.zero.stage
    }

    /// Where master weights and optimizer state live and are stepped: the rank's device
    /// without autodiff, or the CPU when `offload_optimizer` puts them in host memory.
    pub fn state_device(&self) -> Device {
        if self.states_on_host() && self.plan.runtime.device != ComputeDevice::Cpu {
            Device::flex()
        } else {
            self.device.clone().without_autodiff()
        }
    }

    /// Counts `bytes` of model state copied from host memory into a tensor on the rank's
    /// device (`to_device`) or out of one (`!to_device`). Nothing crosses on a CPU rank,
    /// whose tensors are host memory.
    pub fn crossed(&self, to_device: bool, bytes: u64) {
        if self.plan.runtime.device == ComputeDevice::Cpu {
            return;
        }
        let counter = if to_device { &self.crossings.to_device } else { &self.crossings.to_host };
        counter.fetch_add(bytes, Ordering::Relaxed);
    }

    /// The gradients of the units `wanted` marks, taken out of `grads`
    /// ([`take_grads`](super::params::take_grads)): left on the device for a
    /// [`device_step`](Self::device_step), else counted as leaving it.
    pub fn take_grads<M: burn::module::Module>(
        &self,
        model: &M,
        grads: &mut burn::optim::GradientsParams,
        wanted: &[bool],
    ) -> Result<Vec<Option<super::params::UnitGrads>>> {
        let taken = super::params::take_grads(model, grads, &self.index, &self.sharding, wanted, self.device_step)?;
        self.crossed(false, taken.iter().flatten().map(super::params::UnitGrads::host_bytes).sum());
        Ok(taken)
    }

    /// `op` over the group's ranks of `tensor`, on the rank's device
    /// ([`on_device`](super::on_device)), counting what crosses where the collective stages
    /// it through host memory.
    pub fn on_device(&self, op: DeviceOp, tensor: &Tensor<1>) -> Result<Tensor<1>> {
        let comm = self.comm.as_ref();
        let output = on_device::run(comm, op, tensor)?;
        if !on_device::stays_on_device(comm, &tensor.device()) {
            self.crossed(false, tensor_bytes(tensor));
            self.crossed(true, tensor_bytes(&output));
        }
        Ok(output)
    }

    /// `flat` in f32 on the host, counting what leaves the device.
    pub fn to_host(&self, flat: super::flat::Flat) -> Result<Vec<f32>> {
        let on_device = matches!(flat, super::flat::Flat::Device(_));
        let values = flat.into_host("a gradient")?;
        if on_device {
            self.crossed(false, values.bytes());
        }
        Ok(values.into_f32())
    }

    /// [`crossed`](Self::crossed) for a copy into the device master weights and optimizer
    /// state live on (host memory with `offload_optimizer`: then nothing crosses).
    pub fn crossed_to_state_device(&self, bytes: u64) {
        if !self.states_on_host() {
            self.crossed(true, bytes);
        }
    }

    /// The values of one-element f32 tensors (losses, norm partials: `what`), in one read
    /// of the device, counted as one wait of the host for it (on a CPU rank nothing is
    /// queued, so nothing is waited for; reading nothing waits for nothing).
    pub fn read_values(&self, tensors: Vec<Tensor<1>>, what: &str) -> Result<Vec<f32>> {
        if tensors.is_empty() {
            return Ok(Vec::new());
        }
        if self.plan.runtime.device != ComputeDevice::Cpu {
            self.crossings.reads.fetch_add(1, Ordering::Relaxed);
        }
        super::readout::f32s(Tensor::cat(tensors, 0), what)
    }

    /// The reads [`read_values`](Self::read_values) counted.
    pub fn device_reads(&self) -> u64 {
        self.crossings.reads.load(Ordering::Relaxed)
    }

    /// The bytes counted so far.
    pub fn crossings(&self) -> HostDeviceBytes {
        let c = &self.crossings;
        HostDeviceBytes { to_device: c.to_device.load(Ordering::Relaxed), to_host: c.to_host.load(Ordering::Relaxed) }
    }

    /// Whether master weights and optimizer state are host vectors (see
    /// [`Values`](super::master::Values)): on a CPU rank, and with CPU or NVMe offload.
    pub fn states_on_host(&self) -> bool {
        !matches!(self.plan.zero.offload.optimizer, Tier::Device) || self.plan.runtime.device == ComputeDevice::Cpu
    }

    /// The compute dtype.
    pub fn dtype(&self) -> Precision {
        self.plan.precision.compute
    }

    /// The pieces of parameters in unit `unit`'s optimizer range, placed relative to it.
    pub fn optimizer_segments(&self, unit: usize) -> Vec<ShardSegment> {
        let range = self.optimizer_range(unit);
        let entries = self.layout(unit).entries().iter();
        entries
            .filter_map(|e| {
                let s = e.segment(range.clone())?;
                let at = s.flat_range.start - range.start..s.flat_range.end - range.start;
                Some(ShardSegment {
                    path: e.path.clone(),
                    shape: e.shape.clone(),
                    param_range: s.param_range,
                    range: at,
                })
            })
            .collect()
    }

    /// The range of unit `unit`'s flat buffer this rank's optimizer steps: all of its
    /// parameters at stage 0, its shard (padding included) otherwise.
    pub fn optimizer_range(&self, unit: usize) -> Range<usize> {
        let layout = self.layout(unit);
        match self.stage() {
            ZeroStage::Disabled => 0..layout.num_elems(),
            _ => layout.shard_range(self.comm.rank()),
        }
    }

    /// The part of [`optimizer_range`](Self::optimizer_range) that holds parameters.
    pub fn optimizer_real_range(&self, unit: usize) -> Range<usize> {
        match self.stage() {
            ZeroStage::Disabled => self.optimizer_range(unit),
            _ => self.layout(unit).shard_real_range(self.comm.rank()),
        }
    }
}
