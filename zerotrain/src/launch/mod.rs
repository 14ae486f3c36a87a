//! Running ranks: [`launch`] starts one thread per rank (or runs this process's rank under
//! `mpirun` or a launcher: `processes.rs`), hands each a [`RankContext`], and turns a
//! failure on any rank into an error on every rank and one error for the caller. Finding out
//! whether this process runs under `mpirun` ([`detect_mpirun`]) or a launcher
//! ([`detect_launcher`]) belongs here, not to the config.

use std::sync::Arc;
use std::sync::mpsc::{self, Receiver, RecvTimeoutError};
use std::time::{Duration, Instant};

use zerotrain_zero::{CommThread, ThreadWorld};

use crate::collectives::Machine;
use crate::config::{Backend, Plan};
use crate::device::Placement;

mod processes;
mod rank;

use rank::{run_rank, stages, with_collectives};

use crate::{Error, RankContext, Result};
pub use processes::{detect_launcher, detect_mpirun};

/// Runs `f` once per rank of `plan` and returns each rank's result, in rank order.
///
/// If a rank returns an error or panics, every other rank's pending and later collectives
/// fail at once, and `launch` returns the failing rank's error (not the others' consequent
/// "aborted" errors).
///
/// Under `mpirun` (backend `mpi`) this process is one rank: `f` runs once, on the calling
/// thread, the result holds this process's value only, and a failure ends the whole job
/// after printing it. MPI starts and stops inside the call, so under MPI a process may
/// call `launch` once.
///
/// Each rank computes on its device of `plan.device` (see [`zerotrain.device`](crate::config::ComputeDevice)):
/// thread ranks take the machine's devices round-robin by rank, MPI processes by their
/// local rank on the node.
///
/// Each rank's collectives run on a communication thread of its own
/// ([`CommThread`](zerotrain_zero::CommThread)), so that reductions and prefetches overlap
/// computation; under MPI that thread initialises, uses and finalises MPI.
pub fn launch<T, E, F>(plan: &Plan, f: F) -> Result<Vec<T>>
where
    T: Send,
    E: Into<Box<dyn std::error::Error + Send + Sync>>,
    F: Fn(RankContext) -> std::result::Result<T, E> + Sync,
{
    let launcher = detect_launcher()?;
    match (plan.runtime.backend, detect_mpirun(), launcher) {
        (Backend::Threads, Some(mpirun), _) if mpirun.world_size > 1 => Err(Error::Launch(format!(
            "zerotrain.backend is \"threads\" but mpirun started {} processes: each would train its own copy of the \
             job; resolve the config with `Overrides {{ mpirun: zerotrain::detect_mpirun(), .. }}` and leave the \
             backend \"auto\" (or set \"mpi\")",
            mpirun.world_size
        ))),
        (Backend::Threads, None, Some(launched)) if launched.world_size > 1 => Err(Error::Launch(format!(
            "zerotrain.backend is \"threads\" but a launcher started {} processes (RANK, WORLD_SIZE): each would \
             train its own copy of the job; resolve the config with `Overrides {{ launcher: \
             zerotrain::detect_launcher()?, .. }}` and leave the backend \"auto\"",
            launched.world_size
        ))),
        (Backend::Threads, _, _) | (Backend::Auto, None, None) => launch_threads(plan, f),
        (Backend::Mpi, _, _) => processes::launch_mpi(plan, f),
        (Backend::Launcher, _, _) => processes::launch_launched(plan, f),
        (Backend::Auto, Some(mpirun), _) if mpirun.world_size == plan.world_size() => processes::launch_mpi(plan, f),
        (Backend::Auto, Some(mpirun), _) => Err(Error::Launch(format!(
            "mpirun started {} processes but the plan was resolved for {} ranks: resolve the config with \
             `Overrides {{ mpirun: zerotrain::detect_mpirun(), .. }}`",
            mpirun.world_size,
            plan.world_size()
        ))),
        (Backend::Auto, None, Some(launched)) => Err(Error::Launch(format!(
            "a launcher started this process as rank {} of {} (RANK, WORLD_SIZE) but the plan was resolved without \
             it: resolve the config with `Overrides {{ launcher: zerotrain::detect_launcher()?, .. }}`",
            launched.rank, launched.world_size
        ))),
    }
}

fn launch_threads<T, E, F>(plan: &Plan, f: F) -> Result<Vec<T>>
where
    T: Send,
    E: Into<Box<dyn std::error::Error + Send + Sync>>,
    F: Fn(RankContext) -> std::result::Result<T, E> + Sync,
{
    let placement = Placement::find(plan.runtime.device)?;
    let world = ThreadWorld::new(plan.world_size(), plan.runtime.comm_timeout);
    let (done, finished) = mpsc::channel::<usize>();
    let results: Vec<Result<T, (Error, bool)>> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..plan.world_size())
            .map(|rank| {
                let not_started = |what: &str, e: &dyn std::fmt::Display| {
                    let error = Error::Rank { rank, message: format!("could not start its {what}: {e}") };
                    world.abort(rank, &error.to_string());
                    (error, false)
                };
                let comm =
                    CommThread::new(world.communicator(rank)).map_err(|e| not_started("communication thread", &e))?;
                let ctx = RankContext::new(Arc::new(comm), placement.device(rank))
                    .with_stages(stages(plan))
                    .map_err(|e| not_started("context", &e))?;
                let (world, f, done, placement) = (&world, &f, done.clone(), &placement);
                std::thread::Builder::new()
                    .name(format!("zerotrain-rank-{rank}"))
                    .spawn_scoped(scope, move || {
                        let machine = Machine { ranks: plan.world_size(), gpus: placement.len() };
                        type Failure = Box<dyn std::error::Error + Send + Sync>;
                        let result = run_rank(
                            rank,
                            &|reason| world.abort(rank, reason),
                            || -> std::result::Result<T, Failure> {
                                let ctx = with_collectives(ctx, plan, machine, placement.ordinal(rank))?;
                                f(ctx).map_err(Into::into)
                            },
                        );
                        let _ = done.send(rank);
                        result
                    })
                    .map_err(|e| not_started("thread", &e))
            })
            .collect();
        let running: Vec<bool> = handles.iter().map(Result::is_ok).collect();
        watch_for_stalls(&world, &finished, running, stall_grace(plan));
        handles
            .into_iter()
            .map(|h| h.and_then(|h| h.join().unwrap_or_else(|_| unreachable!("run_rank catches panics"))))
            .collect()
    });
    let mut values = Vec::with_capacity(results.len());
    let mut errors: Vec<(usize, Error, bool)> = Vec::new();
    for (rank, result) in results.into_iter().enumerate() {
        match result {
            Ok(v) => values.push(v),
            Err((e, consequence)) => errors.push((rank, e, consequence)),
        }
    }
    if errors.is_empty() {
        return Ok(values);
    }
    // The root cause: the first rank whose error is its own, else the first rank to abort.
    let first_abort = world.aborted().map(|(rank, _)| rank);
    let root = errors
        .iter()
        .position(|(_, _, consequence)| !consequence)
        .or_else(|| errors.iter().position(|(rank, _, _)| Some(*rank) == first_abort))
        .unwrap_or(0);
    Err(errors.swap_remove(root).1)
}

/// How long rank threads get to finish once the job has failed: the collective timeout,
/// at most 10 s (a failed job's ranks unwind in milliseconds; one still computing by then
/// is stalled).
fn stall_grace(plan: &Plan) -> Duration {
    plan.runtime.comm_timeout.min(Duration::from_secs(10))
}

/// Waits until the `running` rank threads have reported on `finished`. Once the job has failed,
/// the others get `grace` to finish; a rank thread still running after that (stalled in its
/// own code, outside any collective) can be neither stopped nor abandoned, since it borrows
/// the caller's data, so the process prints the failure and the stalled ranks and exits
/// with code 1: a failed job ends, as NCCL's watchdog ends it, rather than hang.
///
/// Note: a rank still running after every other rank returned *successfully* is not a
/// failure (rank 0 may have more work, such as writing a report), so it is waited for.
fn watch_for_stalls(world: &ThreadWorld, finished: &Receiver<usize>, mut running: Vec<bool>, grace: Duration) {
    let mut left = running.iter().filter(|&&r| r).count();
    let mut deadline: Option<Instant> = None;
    while left > 0 {
        match finished.recv_timeout(Duration::from_millis(50)) {
            Ok(rank) => {
                running[rank] = false;
                left -= 1;
            }
            Err(RecvTimeoutError::Timeout) => {}
            Err(RecvTimeoutError::Disconnected) => return,
        }
        let Some((by, reason)) = world.aborted() else { continue };
        let deadline = *deadline.get_or_insert_with(|| Instant::now() + grace);
        if left > 0 && Instant::now() >= deadline {
            let stalled: Vec<usize> = (0..running.len()).filter(|&r| running[r]).collect();
            eprintln!(
                "error: rank {by} failed: {reason}\nerror: rank(s) {stalled:?} stalled: still running {:.1} s after \
                 the job failed, outside any collective; a thread cannot be stopped, so the process exits now",
                grace.as_secs_f64()
            );
            std::process::exit(1);
        }
    }
}
