//! Each rank's compute device (`zerotrain.device`): which [`Device`] a rank builds its
//! model and batches on.
//!
//! Ranks are numbered per machine (the *local rank*: the thread index for thread ranks, the
//! launcher's local rank under `mpirun`) and take the machine's GPUs round-robin, so one
//! binary places one rank per GPU on every node, and several thread ranks share a GPU when
//! there are more ranks than GPUs. With the threads or MPI backend a rank's flat buffers
//! cross to the host for the collectives, and the optimizer steps its shard on the device;
//! a rank with nothing to reduce with, or whose collectives are NCCL's, steps entirely on
//! the device (the note in `engine/flat.rs`).

use std::panic::{AssertUnwindSafe, catch_unwind};

use burn::tensor::{DType, Device};

use crate::config::{ComputeDevice, ConfigError};
use crate::error::panic_message;
use crate::{Error, Result};
use zerotrain_precision::Precision;

/// The devices ranks of this machine are placed on, in local-rank order (round-robin).
pub(crate) struct Placement {
    devices: Vec<Device>,
}

impl Placement {
    /// Finds the devices of `kind` (opening each once).
    ///
    /// - `cpu`: Burn's Flex backend, one device every rank shares.
    /// - `wgpu`: every GPU wgpu reaches, in its enumeration order (a software adapter such as
    ///   lavapipe is no GPU); on a machine with none, wgpu's default adapter (which
    ///   `CUBECL_WGPU_DEFAULT_DEVICE` overrides), so that the wgpu path runs anywhere.
    /// - `cuda`: every CUDA device; an error if there is none.
    pub(crate) fn find(kind: ComputeDevice) -> Result<Self> {
        if !kind.is_built() {
            let name = kind.name();
            return Err(Error::Launch(format!(
                "zerotrain.device is \"{name}\" but this build has no {name} support: rebuild with `--features {name}`"
            )));
        }
        let devices = match kind {
            ComputeDevice::Cpu => vec![Device::flex()],
            ComputeDevice::Wgpu => guarded(kind, wgpu_devices)?,
            ComputeDevice::Cuda => guarded(kind, || Ok(cuda_devices()))?,
        };
        if devices.is_empty() {
            return Err(Error::Launch(format!(
                "zerotrain.device is \"{}\" but this machine has no such device (no driver, or no GPU)",
                kind.name()
            )));
        }
        Ok(Self { devices: devices.into_iter().map(Device::autodiff).collect() })
    }

    /// How many devices ranks are placed on.
    pub(crate) fn len(&self) -> usize {
        self.devices.len()
    }

    /// The index, among this kind's devices, of local rank `local_rank`'s device (the CUDA
    /// ordinal on `cuda`).
    pub(crate) fn ordinal(&self, local_rank: usize) -> usize {
        local_rank % self.devices.len()
    }

    /// The device of local rank `local_rank` (autodiff enabled).
    pub(crate) fn device(&self, local_rank: usize) -> Device {
        self.devices[self.ordinal(local_rank)].clone()
    }
}

/// Runs a backend's device discovery, turning what it reports missing, or a panic in it (a
/// missing driver library, say), into an error that names the setting.
fn guarded(
    kind: ComputeDevice,
    find: impl FnOnce() -> std::result::Result<Vec<Device>, String>,
) -> Result<Vec<Device>> {
    let failed = |reason: String| {
        Error::Launch(format!("zerotrain.device is \"{}\" but its runtime failed to start: {reason}", kind.name()))
    };
    match catch_unwind(AssertUnwindSafe(find)) {
        Ok(found) => found.map_err(failed),
        Err(panic) => Err(failed(panic_message(panic.as_ref()))),
    }
}

#[cfg(feature = "wgpu")]
fn wgpu_devices() -> std::result::Result<Vec<Device>, String> {
    use burn::tensor::{DeviceKind, DeviceType, Tensor};
    let adapters = Device::enumerate(DeviceType::Wgpu);
    if adapters.is_empty() {
        // Acquiring the default adapter now would panic on cubecl's device thread, whose
        // message this thread never sees.
        return Err("wgpu finds no adapter here: no Vulkan loader (libvulkan.so.1), no Vulkan driver for this \
                    machine's GPU (an ICD file under /usr/share/vulkan/icd.d, or VK_DRIVER_FILES naming one), or a \
                    driver whose library does not load (NVIDIA's needs libGLdispatch.so.0, from libglvnd; \
                    VK_LOADER_DEBUG=error says why)"
            .into());
    }
    let gpus: Vec<Device> =
        adapters.into_iter().filter(|d| d.identity().is_some_and(|identity| identity.physical.is_some())).collect();
    if !gpus.is_empty() {
        return Ok(gpus);
    }
    // wgpu's default adapter is acquired at its first use: use it here, so that one that
    // cannot start fails now, in `guarded`, with the setting's name, instead of inside a
    // rank's first operation.
    let default = Device::wgpu(DeviceKind::DefaultDevice);
    drop(Tensor::<1>::zeros([1], &default).into_data());
    Ok(vec![default])
}

#[cfg(not(feature = "wgpu"))]
fn wgpu_devices() -> std::result::Result<Vec<Device>, String> {
    Ok(Vec::new())
}

#[cfg(feature = "cuda")]
fn cuda_devices() -> Vec<Device> {
    Device::enumerate(burn::tensor::DeviceType::Cuda).into_iter().collect()
}

#[cfg(not(feature = "cuda"))]
fn cuda_devices() -> Vec<Device> {
    Vec::new()
}

/// How many processes `mpirun` (or Slurm) started on this machine; `None` outside such a
/// launcher.
#[cfg(feature = "mpi")]
pub(crate) fn mpi_local_size() -> Option<usize> {
    ["OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "PMIX_LOCAL_SIZE", "PMI_LOCAL_SIZE", "SLURM_NTASKS_PER_NODE"]
        .iter()
        .find_map(|name| std::env::var(name).ok()?.parse().ok())
}

/// This process's rank among the processes `mpirun` (or Slurm) started on this machine;
/// `None` outside such a launcher.
#[cfg(feature = "mpi")]
pub(crate) fn mpi_local_rank() -> Option<usize> {
    ["OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "PMIX_LOCAL_RANK", "PMI_LOCAL_RANK", "SLURM_LOCALID"]
        .iter()
        .find_map(|name| std::env::var(name).ok()?.parse().ok())
}
/// An error naming the config key if `device` (the plan's `kind`) cannot compute in
/// `precision` (wgpu has no bf16, and f16 only where the adapter offers it).
pub(crate) fn check_dtype(precision: Precision, kind: ComputeDevice, device: &Device) -> Result<()> {
    let (dtype, key) = match precision {
        Precision::Fp32 => return Ok(()),
        Precision::Fp16 => (DType::F16, "fp16.enabled"),
        Precision::Bf16 => (DType::BF16, "bf16.enabled"),
    };
    if device.supports_dtype(dtype) {
        return Ok(());
    }
    Err(Error::Config(ConfigError::Unsupported {
        key: key.into(),
        message: format!(
            "this rank's {} device cannot compute in {precision}: train in a dtype it has (fp32 always works)",
            kind.name()
        ),
    }))
}
