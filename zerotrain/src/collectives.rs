//! Which library runs a rank's reductions and gathers (`zerotrain.collectives`), decided at
//! launch, once the devices are known.
//!
//! The host backend (threads or MPI) is always there. NCCL runs where every rank computes on
//! a CUDA device, the driver and `libnccl` load, and no two ranks of a machine share a GPU
//! (NCCL refuses that, but from 2.30.3 where `NCCL_MULTI_RANK_GPU_ENABLE=1` is set). Every rank must use the same library, so the ranks agree over the
//! host backend: NCCL only if every rank can run it. Under `auto` a job that cannot falls
//! back to the host backend with one notice saying why; under `nccl` it is an error naming
//! the key.

use std::sync::Arc;
use std::time::Duration;

use zerotrain_zero::collective::BufMut;
use zerotrain_zero::{Collective, ReduceOp};

use crate::config::{Collectives, ComputeDevice};
use crate::{Error, Result};

/// What a rank's collectives run on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Library {
    /// The host backend; with a notice where `auto` fell back from NCCL.
    Host { notice: Option<String> },
    /// NCCL.
    Nccl,
}

/// Where this rank stands: how many ranks of its machine share how many GPUs.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Machine {
    /// Ranks on this machine (thread ranks, or mpirun's processes on this node).
    pub ranks: usize,
    /// CUDA devices this machine has.
    pub gpus: usize,
}

/// The first NCCL that runs several ranks on one GPU (2.30.3, with
/// `NCCL_MULTI_RANK_GPU_ENABLE=1`), in NCCL's version code.
const MULTI_RANK_NCCL: u32 = 23003;

/// What this rank's NCCL is: whether its libraries load, its version code, and whether
/// `NCCL_MULTI_RANK_GPU_ENABLE` is `1` in the environment it will read.
pub(crate) struct Nccl<L, V> {
    pub loads: L,
    pub version: V,
    pub multi_rank: bool,
}

impl Nccl<fn() -> std::result::Result<(), String>, fn() -> Option<u32>> {
    /// This process's NCCL.
    pub(crate) fn here() -> Self {
        Self {
            loads: zerotrain_zero::collective::nccl::available,
            version: zerotrain_zero::collective::nccl::version,
            multi_rank: std::env::var("NCCL_MULTI_RANK_GPU_ENABLE").is_ok_and(|v| v.trim() == "1"),
        }
    }
}

/// Why NCCL cannot run on this CUDA rank, or `None` if it can: its libraries must load, and
/// ranks that share a GPU need NCCL 2.30.3 or later with `NCCL_MULTI_RANK_GPU_ENABLE=1`
/// (which this does not set for the user: the variable also changes how NCCL builds its
/// rings, and it is read when NCCL starts, from an environment other threads may read).
pub(crate) fn obstacle<L, V>(machine: Machine, nccl: Nccl<L, V>) -> Option<String>
where
    L: FnOnce() -> std::result::Result<(), String>,
    V: FnOnce() -> Option<u32>,
{
    if let Err(missing) = (nccl.loads)() {
        return Some(missing);
    }
    if machine.ranks <= machine.gpus {
        return None;
    }
    let shared = format!("{} ranks share this machine's {} GPU(s)", machine.ranks, machine.gpus);
    match (nccl.version)() {
        Some(v) if v >= MULTI_RANK_NCCL && nccl.multi_rank => None,
        Some(v) if v >= MULTI_RANK_NCCL => Some(format!(
            "{shared}, which NCCL {} runs only with NCCL_MULTI_RANK_GPU_ENABLE=1 in the environment (and \
             NCCL_NVLS_ENABLE=0)",
            version_name(v)
        )),
        version => Some(format!(
            "{shared}, and NCCL {} takes one rank per GPU (2.30.3 and later run several with \
             NCCL_MULTI_RANK_GPU_ENABLE=1)",
            version.map_or("of unknown version".into(), version_name)
        )),
    }
}

/// NCCL's version code as `major.minor.patch`.
fn version_name(code: u32) -> String {
    format!("{}.{}.{}", code / 10000, code / 100 % 100, code % 100)
}

/// The library every rank uses, from `setting`, the ranks' `device` and, on CUDA, each
/// rank's `obstacle` (agreed over `host`: NCCL only if no rank has one).
pub(crate) fn decide(
    setting: Collectives,
    device: ComputeDevice,
    obstacle: impl FnOnce() -> Option<String>,
    host: &dyn Collective,
) -> Result<Library> {
    // Every rank has the same device kind, so these need no agreement (and the config
    // refuses `nccl` off CUDA).
    if setting == Collectives::Host || device != ComputeDevice::Cuda {
        return Ok(Library::Host { notice: None });
    }
    let obstacle = obstacle();
    if setting == Collectives::Nccl
        && let Some(reason) = &obstacle
    {
        let error = Error::Launch(format!("zerotrain.collectives is \"nccl\" but {reason}"));
        host.abort(&error.to_string());
        return Err(error);
    }
    let mut can = [if obstacle.is_none() { 1.0f32 } else { 0.0 }];
    host.all_reduce(BufMut::F32(&mut can), ReduceOp::Min)?;
    if can[0] == 1.0 {
        return Ok(Library::Nccl);
    }
    let reason = obstacle.unwrap_or_else(|| "another rank cannot run NCCL (its notice says why)".into());
    let notice = format!("zerotrain.collectives is \"auto\": using the host backend, because {reason}");
    Ok(Library::Host { notice: Some(notice) })
}

/// `host`, or an NCCL communicator over it on CUDA device `ordinal`, on a communication
/// thread of its own; every rank calls it at once.
pub(crate) fn connect(
    library: &Library,
    host: Arc<dyn Collective>,
    ordinal: usize,
    timeout: Duration,
) -> Result<Arc<dyn Collective>> {
    match library {
        Library::Host { .. } => Ok(host),
        Library::Nccl => nccl(host, ordinal, timeout),
    }
}

#[cfg(feature = "cuda")]
fn nccl(host: Arc<dyn Collective>, ordinal: usize, timeout: Duration) -> Result<Arc<dyn Collective>> {
    use zerotrain_zero::CommThread;
    use zerotrain_zero::collective::nccl::NcclComm;
    let name = format!("zerotrain-nccl-{}", host.rank());
    let comm = CommThread::spawn(name, move || NcclComm::new(host, ordinal, timeout))?;
    Ok(Arc::new(comm))
}

#[cfg(not(feature = "cuda"))]
fn nccl(_host: Arc<dyn Collective>, _ordinal: usize, _timeout: Duration) -> Result<Arc<dyn Collective>> {
    Err(Error::Launch("this build has no NCCL support: rebuild with `--features cuda`".into()))
}

#[cfg(test)]
mod tests {
    use zerotrain_zero::ThreadWorld;

    use super::*;

    const ONE_GPU_EACH: Machine = Machine { ranks: 2, gpus: 2 };

    /// An NCCL that loads, of version code `version`, with or without the multi-rank
    /// variable.
    fn nccl(
        version: Option<u32>,
        multi_rank: bool,
    ) -> Nccl<impl FnOnce() -> std::result::Result<(), String>, impl FnOnce() -> Option<u32>> {
        Nccl { loads: || Ok(()), version: move || version, multi_rank }
    }

    #[test]
    fn obstacles_name_what_stops_nccl() {
        assert_eq!(obstacle(ONE_GPU_EACH, nccl(Some(22803), false)), None);
        let shared = obstacle(Machine { ranks: 2, gpus: 1 }, nccl(Some(22803), false)).unwrap();
        assert!(shared.contains("2 ranks share") && shared.contains("1 GPU"), "{shared}");
        assert!(shared.contains("NCCL 2.28.3 takes one rank per GPU") && shared.contains("2.30.3"), "{shared}");
        let missing = Nccl { loads: || Err("libnccl.so does not load".into()), version: || None, multi_rank: true };
        assert_eq!(obstacle(ONE_GPU_EACH, missing).as_deref(), Some("libnccl.so does not load"));
    }

    /// Ranks sharing a GPU run NCCL from 2.30.3 with NCCL_MULTI_RANK_GPU_ENABLE=1; a new
    /// enough NCCL without the variable is told to set it; one too old is told which is
    /// needed.
    #[test]
    fn ranks_sharing_a_gpu_need_nccl_2_30_3_and_its_variable() {
        let shared = Machine { ranks: 4, gpus: 1 };
        assert_eq!(obstacle(shared, nccl(Some(23003), true)), None);
        assert_eq!(obstacle(shared, nccl(Some(23101), true)), None);
        let unset = obstacle(shared, nccl(Some(23003), false)).unwrap();
        assert!(unset.contains("NCCL 2.30.3 runs only with NCCL_MULTI_RANK_GPU_ENABLE=1"), "{unset}");
        let old = obstacle(shared, nccl(Some(23002), true)).unwrap();
        assert!(old.contains("NCCL 2.30.2 takes one rank per GPU"), "{old}");
    }

    /// Runs `decide` for CUDA ranks on every rank of a thread world, rank `r` with
    /// `obstacles[r]`.
    fn decide_all(setting: Collectives, obstacles: Vec<Option<String>>) -> Vec<Result<Library>> {
        let world = ThreadWorld::new(obstacles.len(), Duration::from_secs(600));
        std::thread::scope(|s| {
            let handles: Vec<_> = obstacles
                .into_iter()
                .enumerate()
                .map(|(rank, obstacle)| {
                    let comm = world.communicator(rank);
                    s.spawn(move || decide(setting, ComputeDevice::Cuda, || obstacle, &comm))
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    #[test]
    fn auto_uses_nccl_only_where_every_rank_can() {
        let all = decide_all(Collectives::Auto, vec![None, None]);
        assert!(all.iter().all(|l| matches!(l, Ok(Library::Nccl))), "{all:?}");
        // One rank without libnccl: every rank falls back, each with a notice.
        let one = decide_all(Collectives::Auto, vec![None, Some("libnccl.so does not load".into())]);
        let notices: Vec<String> = one
            .into_iter()
            .map(|l| match l {
                Ok(Library::Host { notice: Some(n) }) => n,
                other => panic!("expected the host backend with a notice, got {other:?}"),
            })
            .collect();
        assert!(notices[0].contains("another rank cannot run NCCL"), "{}", notices[0]);
        assert!(notices[1].contains("libnccl.so does not load") && notices[1].contains("\"auto\""), "{}", notices[1]);
        // CPU ranks: host, silently, without asking anything or running a collective (a
        // world whose only other rank never calls would time out).
        let world = ThreadWorld::new(2, Duration::from_secs(600));
        let cpu = decide(Collectives::Auto, ComputeDevice::Cpu, || unreachable!(), &world.communicator(0));
        assert!(matches!(cpu, Ok(Library::Host { notice: None })));
        let host = decide_all(Collectives::Host, vec![None, None]);
        assert!(host.iter().all(|l| matches!(l, Ok(Library::Host { notice: None }))));
    }

    #[test]
    fn nccl_where_it_cannot_run_is_an_error_naming_the_key_on_every_rank() {
        let results = decide_all(Collectives::Nccl, vec![None, Some("libnccl.so does not load".into())]);
        let own = results[1].as_ref().unwrap_err().to_string();
        assert!(own.contains("zerotrain.collectives is \"nccl\" but libnccl.so does not load"), "{own}");
        let other = results[0].as_ref().unwrap_err().to_string();
        assert!(other.contains("zerotrain.collectives"), "{other}");
    }

    #[cfg(not(feature = "cuda"))]
    #[test]
    fn a_build_without_cuda_refuses_nccl_by_feature() {
        let world = ThreadWorld::new(1, Duration::from_secs(10));
        let Err(err) = connect(&Library::Nccl, Arc::new(world.communicator(0)), 0, Duration::from_secs(1)) else {
            panic!("a build without CUDA connected NCCL");
        };
        assert!(err.to_string().contains("--features cuda"), "{err}");
    }
}
