//! Where and how the ranks run: `zerotrain.backend`, `device`, `world_size`,
//! `comm_timeout_s`, retention, and the logging keys.

use std::time::Duration;

use super::autos::{Autos, invalid};
use super::plan::MAX_THREAD_RANKS;
use super::raw::ZerotrainConfig;
use super::value::Count;
use super::{Backend, Collectives, ComputeDevice, Config, ConfigError, Overrides, RuntimePlan};

pub(super) fn resolve(config: &Config, overrides: Overrides, autos: &mut Autos) -> Result<RuntimePlan, ConfigError> {
    let raw = &config.raw;
    let zt = raw.zerotrain.clone().unwrap_or_default();
    let device = device(&zt, overrides)?;
    let backend = backend(&zt, overrides)?;
    let timeout_s = zt.comm_timeout_s.unwrap_or(300.0);
    if !(timeout_s > 0.0 && timeout_s <= 1e7) {
        let message = format!("must be a positive number of seconds, got {timeout_s}");
        return Err(invalid("zerotrain.comm_timeout_s", message));
    }
    let keep_last_n_checkpoints = match zt.keep_last_n_checkpoints {
        Some(Count(0)) => return Err(invalid("zerotrain.keep_last_n_checkpoints", "must be at least 1")),
        Some(Count(n)) => Some(usize::try_from(n).unwrap_or(usize::MAX)),
        None => None,
    };
    Ok(RuntimePlan {
        world_size: world_size(&zt, backend, overrides)?,
        backend,
        device,
        collectives: collectives(&zt, device)?,
        comm_timeout: Duration::from_secs_f64(timeout_s),
        seed: raw.seed.map_or(42, |c| c.0),
        steps_per_print: autos.or("steps_per_print", raw.steps_per_print, Count(10), "default").0.max(1),
        wall_clock_breakdown: raw.wall_clock_breakdown.unwrap_or(false),
        keep_last_n_checkpoints,
    })
}

/// `zerotrain.backend`. Inside a job of several processes (under `mpirun`, or started by a
/// launcher) only their own backend trains one job: threads would train an independent copy
/// in every process, all writing one run folder, so an explicit `threads` there is an error.
/// A launcher's processes join through rank 0's relay ([`zerotrain_zero::collective::tcp`]):
/// on CUDA their collectives then run over NCCL, on the CPU (as torchrun's gloo jobs do)
/// through the relay itself.
pub(super) fn backend(zt: &ZerotrainConfig, overrides: Overrides) -> Result<Backend, ConfigError> {
    let mpirun = overrides.mpirun.map(|m| ("mpirun", m.world_size, "mpi"));
    let launcher = overrides.launcher.map(|l| ("a launcher (RANK, WORLD_SIZE)", l.world_size, "launcher"));
    let backend = match (zt.backend.as_deref().unwrap_or("auto"), mpirun.or(launcher)) {
        ("auto", Some((_, _, "mpi"))) | ("mpi", _) => Backend::Mpi,
        ("auto", Some(_)) | ("launcher", _) => Backend::Launcher,
        ("auto", None) => Backend::Auto,
        ("threads", Some((by, processes, name))) if processes > 1 => {
            return Err(ConfigError::Unsupported {
                key: "zerotrain.backend".into(),
                message: format!(
                    "is \"threads\" but {by} started {processes} processes: each would train its own copy of the \
                     job into the same folder. Remove the key (\"auto\" uses their backend) or set it to \"{name}\""
                ),
            });
        }
        ("threads", _) => Backend::Threads,
        (other, _) => {
            let message = format!("unknown backend `{other}`; available: auto, threads, mpi, launcher");
            return Err(invalid("zerotrain.backend", message));
        }
    };
    Ok(backend)
}

fn device(zt: &ZerotrainConfig, overrides: Overrides) -> Result<ComputeDevice, ConfigError> {
    let device = match (overrides.device, zt.device.as_deref()) {
        (Some(device), _) => device,
        (None, None) => ComputeDevice::Cpu,
        (None, Some(name)) => name.parse().map_err(|e: String| invalid("zerotrain.device", e))?,
    };
    if !device.is_built() {
        let key = if overrides.device.is_some() { "--device" } else { "zerotrain.device" };
        let name = device.name();
        return Err(ConfigError::Unsupported {
            key: key.into(),
            message: format!("this build has no `{name}` support: rebuild with `--features {name}` (see docs/gpus.md)"),
        });
    }
    Ok(device)
}

/// `zerotrain.collectives`: NCCL needs CUDA devices (and, for `auto`, nothing else here:
/// whether NCCL can run is found out at launch).
fn collectives(zt: &ZerotrainConfig, device: ComputeDevice) -> Result<Collectives, ConfigError> {
    let key = "zerotrain.collectives";
    let choice: Collectives = match zt.collectives.as_deref() {
        None => Collectives::Auto,
        Some(name) => name.parse().map_err(|e: String| invalid(key, e))?,
    };
    if choice == Collectives::Nccl && device != ComputeDevice::Cuda {
        let message = format!(
            "is \"nccl\" but the ranks compute on {}: NCCL runs on CUDA devices (set zerotrain.device to \"cuda\")",
            device.name()
        );
        return Err(ConfigError::Unsupported { key: key.into(), message });
    }
    Ok(choice)
}

/// Under mpirun or a launcher the process count decides; `zerotrain.world_size` is the
/// threads default.
pub(super) fn world_size(zt: &ZerotrainConfig, backend: Backend, overrides: Overrides) -> Result<usize, ConfigError> {
    let started = match backend {
        Backend::Mpi => overrides.mpirun.map(|m| (m.world_size, "mpirun")),
        Backend::Launcher => overrides.launcher.map(|l| (l.world_size, "the launcher")),
        _ => None,
    };
    let world_size = match (started, overrides.world_size) {
        (Some((size, by)), Some(n)) if n != size => {
            return Err(invalid("--world-size", format!("is {n} but {by} started {size} processes")));
        }
        (Some((size, _)), _) => size,
        (None, Some(n)) => n,
        (None, None) => match zt.world_size {
            Some(Count(n)) => usize::try_from(n).map_err(|_| invalid("zerotrain.world_size", "too large"))?,
            None => 1,
        },
    };
    if world_size == 0 {
        return Err(invalid("zerotrain.world_size", "must be at least 1"));
    }
    if matches!(backend, Backend::Auto | Backend::Threads) && world_size > MAX_THREAD_RANKS {
        let key = if overrides.world_size.is_some() { "--world-size" } else { "zerotrain.world_size" };
        let message = format!("{world_size} thread ranks is more than the {MAX_THREAD_RANKS} one process runs");
        return Err(invalid(key, message));
    }
    Ok(world_size)
}
