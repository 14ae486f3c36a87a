//! What every rank does however it was started (a thread, or a process under `mpirun` or a
//! launcher): its collectives decided, its closure run with failures turned into an abort.

use std::panic::{AssertUnwindSafe, catch_unwind};

use crate::collectives::{self, Machine};
use crate::config::Plan;
use crate::error::{error_chain, panic_message};
use crate::{Error, RankContext, Result};

/// `ctx` with its collectives on the library `zerotrain.collectives` comes to (module
/// `collectives`); every rank calls it at once, `ordinal` being its CUDA device's.
pub(super) fn with_collectives(ctx: RankContext, plan: &Plan, machine: Machine, ordinal: usize) -> Result<RankContext> {
    let host = ctx.collective();
    let obstacle = || collectives::obstacle(machine, collectives::Nccl::here());
    let library = collectives::decide(plan.runtime.collectives, plan.runtime.device, obstacle, &*host)?;
    let comm = collectives::connect(&library, host, ordinal, plan.runtime.comm_timeout)?;
    let notice = match library {
        collectives::Library::Host { notice } => notice,
        collectives::Library::Nccl => None,
    };
    Ok(ctx.with_collective(comm, notice))
}

/// The plan's pipeline stages (1 without a pipeline).
pub(super) fn stages(plan: &Plan) -> usize {
    plan.pipeline.map_or(1, |p| p.stages)
}

/// Runs one rank's closure; on failure aborts the world and returns the error and whether
/// it is only a consequence of another rank's failure.
pub(super) fn run_rank<T, E>(
    rank: usize,
    abort: &dyn Fn(&str),
    f: impl FnOnce() -> std::result::Result<T, E>,
) -> Result<T, (Error, bool)>
where
    E: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let outcome = catch_unwind(AssertUnwindSafe(f));
    let mut consequence = false;
    let error = match outcome {
        Ok(Ok(value)) => return Ok(value),
        Ok(Err(e)) => {
            let e: Box<dyn std::error::Error + Send + Sync> = e.into();
            consequence = e.downcast_ref::<Error>().is_some_and(Error::is_consequence);
            Error::Rank { rank, message: error_chain(e.as_ref()) }
        }
        Err(panic) => Error::RankPanicked { rank, message: panic_message(panic.as_ref()) },
    };
    abort(&error.to_string());
    Err((error, consequence))
}
