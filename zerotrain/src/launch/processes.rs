//! One process per rank: this process's rank under `mpirun` (MPI), or under a launcher
//! (`zerotrain launch`, torchrun, a cluster's operator), whose processes join over TCP
//! through rank 0 ([`zerotrain_zero::collective::tcp`]) and run their collectives over
//! NCCL. Either way the process runs its one rank as [`run_process`] does.

use std::sync::Arc;

use zerotrain_zero::Collective;
use zerotrain_zero::collective::tcp;

use super::rank::{run_rank, stages, with_collectives};
use crate::collectives::Machine;
use crate::config::{LauncherEnvironment, MpirunEnvironment, Plan};
use crate::device::Placement;
#[cfg(feature = "mpi")]
use crate::device::{mpi_local_rank, mpi_local_size};
use crate::{Error, RankContext, Result};

/// This process's place in an `mpirun` job (OpenMPI's, MPICH's or PMIx's environment
/// variables), or `None` when no MPI launcher started it. Pass it to
/// [`Config::resolve`](crate::Config::resolve) in [`Overrides`](crate::Overrides).
pub fn detect_mpirun() -> Option<MpirunEnvironment> {
    zerotrain_zero::collective::mpi_environment().map(|(rank, world_size)| MpirunEnvironment { rank, world_size })
}

/// What a launcher tells its processes, as torchrun does: `RANK`, `WORLD_SIZE`,
/// `LOCAL_RANK`, `LOCAL_WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`. Under Slurm's `srun`
/// without them, `SLURM_PROCID`, `SLURM_NTASKS` and `SLURM_LOCALID` stand in for the first
/// three where the job script sets `MASTER_ADDR` and `MASTER_PORT`.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Launched {
    rank: usize,
    world_size: usize,
    local_rank: usize,
    /// Processes on this node, where the launcher says.
    local_world_size: Option<usize>,
    /// Rank 0's rendezvous, `MASTER_ADDR:MASTER_PORT`.
    addr: String,
}

impl Launched {
    /// Reads the environment through `var`; `None` when no launcher started this process
    /// (or `mpirun` did: MPI is then its backend).
    fn read(var: impl Fn(&str) -> Option<String>) -> Result<Option<Self>> {
        let mpirun = ["OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK"].iter().any(|v| var(v).is_some());
        let master = (var("MASTER_ADDR"), var("MASTER_PORT"));
        let (rank_var, size_var, local_var) = match (var("RANK"), var("SLURM_PROCID"), &master) {
            _ if mpirun => return Ok(None),
            (Some(_), _, _) => ("RANK", "WORLD_SIZE", "LOCAL_RANK"),
            (None, Some(_), (Some(_), Some(_))) => ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"),
            _ => return Ok(None),
        };
        let number = |name: &str| -> Result<Option<usize>> {
            var(name)
                .map(|v| {
                    v.trim().parse::<usize>().map_err(|_| {
                        Error::Launch(format!("{name}={v:?} (set by the launcher) is not a non-negative integer"))
                    })
                })
                .transpose()
        };
        let required = |name: &str| -> Result<usize> {
            number(name)?
                .ok_or_else(|| Error::Launch(format!("{rank_var} is set but {name} is not: is this a launcher?")))
        };
        let (rank, world_size) = (required(rank_var)?, required(size_var)?);
        if world_size == 0 || rank >= world_size {
            return Err(Error::Launch(format!("{rank_var}={rank} is not a rank of {size_var}={world_size}")));
        }
        let (Some(host), Some(port)) = master else {
            return Err(Error::Launch(format!(
                "{rank_var} and {size_var} are set but MASTER_ADDR and MASTER_PORT are not: they say where rank 0 \
                 serves the rendezvous"
            )));
        };
        let port: u16 =
            port.trim().parse().map_err(|_| Error::Launch(format!("MASTER_PORT={port:?} is not a port")))?;
        let addr = if host.contains(':') && !host.starts_with('[') {
            format!("[{host}]:{port}")
        } else {
            format!("{host}:{port}")
        };
        Ok(Some(Self {
            rank,
            world_size,
            local_rank: number(local_var)?.unwrap_or(rank),
            local_world_size: number("LOCAL_WORLD_SIZE")?,
            addr,
        }))
    }
}

impl Launched {
    /// Refuses a mesh whose tensor-parallel groups would span nodes, where the launcher
    /// says how many processes a node runs: a group's ranks are consecutive
    /// (`tensor_parallel.autotp_size` of them, from a multiple of it) and a node's are
    /// `LOCAL_WORLD_SIZE` consecutive ranks, so every group lies on one node exactly when
    /// that divides by the tensor-parallel size. Megatron's four all-reduces per layer
    /// would otherwise cross the network inside every forward. Sequence groups (strided by
    /// the tensor size) may span nodes: DeepSpeed-Ulysses' all-to-all does across nodes.
    fn check_tensor_groups(&self, plan: &Plan) -> Result<()> {
        let (tp, Some(local)) = (plan.mesh.tp, self.local_world_size) else { return Ok(()) };
        if local.is_multiple_of(tp) {
            return Ok(());
        }
        Err(Error::Usage(format!(
            "tensor_parallel.autotp_size is {tp}, but a node runs {local} ranks (LOCAL_WORLD_SIZE): a tensor-parallel \
             group would span nodes; use a size that divides {local} (ranks of one group sit on one node, \
             consecutive)"
        )))
    }
}

/// This process's place in a job whose processes a launcher started (`zerotrain launch`,
/// torchrun, a Kubernetes training operator, SageMaker, Slurm with `MASTER_ADDR` and
/// `MASTER_PORT` set), or `None` when none did (or `mpirun` did). A variable set to
/// something that is not a rank is an error naming it. Pass it to
/// [`Config::resolve`](crate::Config::resolve) in [`Overrides`](crate::Overrides).
pub fn detect_launcher() -> Result<Option<LauncherEnvironment>> {
    let launched = Launched::read(|name| std::env::var(name).ok())?;
    Ok(launched.map(|l| LauncherEnvironment { rank: l.rank, world_size: l.world_size }))
}

/// What every rank must agree on before training: the resolved plan, key by key (its
/// JSON, flattened to dotted paths). The device and collectives a rank found are its own.
fn fingerprint(plan: &Plan) -> Vec<(String, String)> {
    fn flatten(prefix: String, value: &serde_json::Value, out: &mut Vec<(String, String)>) {
        match value {
            serde_json::Value::Object(map) => {
                for (key, value) in map {
                    let path = if prefix.is_empty() { key.clone() } else { format!("{prefix}.{key}") };
                    flatten(path, value, out);
                }
            }
            other => out.push((prefix, other.to_string())),
        }
    }
    let mut out = Vec::new();
    let json = serde_json::to_value(plan).unwrap_or(serde_json::Value::Null);
    flatten(String::new(), &json, &mut out);
    out
}

/// The secret the job's ranks prove to each other (`ZEROTRAIN_JOB_SECRET`: `zerotrain
/// launch` makes one for the ranks of one node; ranks started otherwise, or on several
/// nodes, are each given the same). A job of one rank makes its own: nobody connects.
fn job_secret(world_size: usize) -> Result<tcp::JobSecret> {
    let variable = tcp::JOB_SECRET_VARIABLE;
    match tcp::JobSecret::from_env()? {
        Some(secret) => Ok(secret),
        None if world_size == 1 => Ok(tcp::JobSecret::new(&tcp::JobSecret::generate()?)?),
        None => Err(Error::Launch(format!(
            "{variable} is not set: the ranks of a launched job prove to each other that they belong to it with a \
             secret they share (anyone who reaches rank 0's port could otherwise join or abort the job). \
             `zerotrain launch` on one node makes one; otherwise set the same value on every rank, e.g. \
             `export {variable}=$(openssl rand -hex 32)` before starting them"
        ))),
    }
}

/// Runs this process's rank of a launched job: joins the world at `MASTER_ADDR:MASTER_PORT`
/// (rank 0 serves it), agreeing on the plan, then trains over NCCL.
pub(super) fn launch_launched<T, E, F>(plan: &Plan, f: F) -> Result<Vec<T>>
where
    E: Into<Box<dyn std::error::Error + Send + Sync>>,
    F: Fn(RankContext) -> std::result::Result<T, E>,
{
    let Some(launched) = Launched::read(|name| std::env::var(name).ok())? else {
        return Err(Error::Launch(
            "zerotrain.backend is \"launcher\" but no launcher started this process (RANK, WORLD_SIZE, MASTER_ADDR, \
             MASTER_PORT are not set): start it with `zerotrain launch --nproc-per-node N -- train ...`"
                .into(),
        ));
    };
    if launched.world_size != plan.world_size() {
        return Err(Error::Launch(format!(
            "the plan is for {} ranks but the launcher started {} (WORLD_SIZE)",
            plan.world_size(),
            launched.world_size
        )));
    }
    launched.check_tensor_groups(plan)?;
    let join = tcp::Join {
        rank: launched.rank,
        world_size: launched.world_size,
        addr: launched.addr.clone(),
        timeout: plan.runtime.comm_timeout,
        fingerprint: fingerprint(plan),
        secret: job_secret(launched.world_size)?,
    };
    let comm = tcp::join(&join)?;
    // NCCL tells hosts apart by NCCL_HOSTID where it is set: processes given one each (as
    // `zerotrain launch --ranks-share-gpu` does) are each a host of one rank to it.
    let ranks_here = match std::env::var_os("NCCL_HOSTID") {
        Some(_) => 1,
        None => launched.local_world_size.unwrap_or(1),
    };
    run_process(plan, comm, launched.local_rank, ranks_here, f)
}

/// Runs this process's one rank on `comm`: its device by `local_rank`, NCCL where it can
/// (`ranks_here` ranks sharing this machine's GPUs), and `f`; a failure before `f` runs
/// aborts the job so that no other rank waits for this one.
fn run_process<T, E, F>(
    plan: &Plan,
    comm: Arc<dyn Collective>,
    local_rank: usize,
    ranks_here: usize,
    f: F,
) -> Result<Vec<T>>
where
    E: Into<Box<dyn std::error::Error + Send + Sync>>,
    F: Fn(RankContext) -> std::result::Result<T, E>,
{
    let rank = comm.rank();
    let ctx = Placement::find(plan.runtime.device).and_then(|placement| {
        let ctx = RankContext::new(Arc::clone(&comm), placement.device(local_rank)).with_stages(stages(plan))?;
        let machine = Machine { ranks: ranks_here, gpus: placement.len() };
        with_collectives(ctx, plan, machine, placement.ordinal(local_rank))
    });
    let ctx = match ctx {
        Ok(ctx) => ctx,
        Err(e) => {
            comm.abort(&e.to_string());
            return Err(e);
        }
    };
    match run_rank(rank, &|reason| comm.abort(reason), || f(ctx)) {
        Ok(value) => Ok(vec![value]),
        Err((error, _)) => Err(error),
    }
}

#[cfg(feature = "mpi")]
pub(super) fn launch_mpi<T, E, F>(plan: &Plan, f: F) -> Result<Vec<T>>
where
    E: Into<Box<dyn std::error::Error + Send + Sync>>,
    F: Fn(RankContext) -> std::result::Result<T, E>,
{
    use zerotrain_zero::CommThread;
    use zerotrain_zero::collective::MpiComm;
    let timeout = plan.runtime.comm_timeout;
    let comm = CommThread::spawn("zerotrain-comm".into(), move || MpiComm::init(timeout))?;
    if comm.world_size() != plan.world_size() {
        let n = comm.world_size();
        return Err(Error::Launch(format!("the plan is for {} ranks but mpirun started {n}", plan.world_size())));
    }
    let local_rank = mpi_local_rank().unwrap_or(comm.rank());
    run_process(plan, Arc::new(comm), local_rank, mpi_local_size().unwrap_or(1), f)
}

#[cfg(not(feature = "mpi"))]
pub(super) fn launch_mpi<T, E, F>(_plan: &Plan, _f: F) -> Result<Vec<T>>
where
    F: Fn(RankContext) -> std::result::Result<T, E>,
{
    Err(Error::Launch(
        "this process was started by mpirun (or zerotrain.backend is \"mpi\"), but this build has no MPI support: \
         rebuild with `--features mpi` (see docs/mpi.md), or run without mpirun"
            .into(),
    ))
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    fn read(vars: &[(&str, &str)]) -> Result<Option<Launched>> {
        let vars: HashMap<String, String> = vars.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        Launched::read(|name| vars.get(name).cloned())
    }

    #[test]
    fn torchrun_s_variables_place_the_process() {
        let env = [("RANK", "3"), ("WORLD_SIZE", "8"), ("LOCAL_RANK", "1"), ("LOCAL_WORLD_SIZE", "2")];
        let got = read(&[&env[..], &[("MASTER_ADDR", "node-0"), ("MASTER_PORT", "29500")]].concat()).unwrap();
        let want =
            Launched { rank: 3, world_size: 8, local_rank: 1, local_world_size: Some(2), addr: "node-0:29500".into() };
        assert_eq!(got, Some(want));
        let v6 = read(&[("RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "::1"), ("MASTER_PORT", "1")]).unwrap();
        assert_eq!(v6.unwrap().addr, "[::1]:1");
    }

    #[test]
    fn slurm_places_it_where_the_script_names_rank_zero_and_mpirun_wins() {
        let slurm = [("SLURM_PROCID", "5"), ("SLURM_NTASKS", "6"), ("SLURM_LOCALID", "1")];
        assert_eq!(read(&slurm).unwrap(), None, "srun alone is not a launcher without MASTER_ADDR");
        let got = read(&[&slurm[..], &[("MASTER_ADDR", "n0"), ("MASTER_PORT", "6000")]].concat()).unwrap().unwrap();
        assert_eq!((got.rank, got.world_size, got.local_rank), (5, 6, 1));
        let under_mpirun = [("OMPI_COMM_WORLD_RANK", "0"), ("RANK", "0"), ("WORLD_SIZE", "2")];
        assert_eq!(read(&under_mpirun).unwrap(), None);
        assert_eq!(read(&[]).unwrap(), None);
    }

    /// A tensor group must lie on one node: tp 4 over nodes of 2 (larger) or of 6 (the
    /// second group would take ranks 4..8 of nodes 0 and 1) is refused naming the key and
    /// LOCAL_WORLD_SIZE; tp 2 over nodes of 6, or with no node size given, is not.
    #[test]
    fn a_tensor_group_that_would_span_nodes_is_refused() {
        let plan = |tp: usize| {
            let json =
                format!(r#"{{"train_micro_batch_size_per_gpu": 1, "tensor_parallel": {{"autotp_size": {tp}}}}}"#);
            let overrides = crate::Overrides { world_size: Some(12), ..Default::default() };
            crate::Config::parse(&json, "t.json").unwrap().resolve(overrides).unwrap()
        };
        let node =
            |local| Launched { rank: 0, world_size: 12, local_rank: 0, local_world_size: local, addr: "a:1".into() };
        for local in [2, 6] {
            let err = node(Some(local)).check_tensor_groups(&plan(4)).unwrap_err().to_string();
            let said = format!("autotp_size is 4, but a node runs {local} ranks (LOCAL_WORLD_SIZE)");
            assert!(err.contains(&said), "{err}");
        }
        assert!(node(Some(6)).check_tensor_groups(&plan(2)).is_ok());
        assert!(node(None).check_tensor_groups(&plan(4)).is_ok());
    }

    #[test]
    fn a_variable_that_is_not_a_place_is_refused_by_name() {
        let cases: [(&[(&str, &str)], &str); 4] = [
            (&[("RANK", "one"), ("WORLD_SIZE", "2")], "RANK=\"one\""),
            (&[("RANK", "2"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "a"), ("MASTER_PORT", "1")], "RANK=2 is not a rank"),
            (&[("RANK", "0")], "WORLD_SIZE is not"),
            (&[("RANK", "0"), ("WORLD_SIZE", "2")], "MASTER_ADDR and MASTER_PORT are not"),
        ];
        for (vars, said) in cases {
            let err = read(vars).unwrap_err().to_string();
            assert!(err.contains(said), "{vars:?}: {err}");
        }
        let err = read(&[("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "a"), ("MASTER_PORT", "70000")]);
        assert!(err.unwrap_err().to_string().contains("MASTER_PORT=\"70000\" is not a port"));
    }
}
