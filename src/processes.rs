//! This process's place in a job whose ranks are processes (under `mpirun`, or started by a
//! launcher: `zerotrain launch`, torchrun, Slurm with `MASTER_ADDR`), for what the command
//! does once per process rather than once per rank: speak, lock the run folder, hand over
//! the model, count the memory the ranks here need.

/// `(rank, world size)` of this process in a job of processes; `None` when the job's ranks
/// are threads of this process. A launcher's malformed variables read as none here: the
/// command resolves its config first (`commands::overrides`), which reports them.
pub fn place() -> Option<(usize, usize)> {
    zerotrain::detect_mpirun()
        .map(|m| (m.rank, m.world_size))
        .or_else(|| zerotrain::detect_launcher().ok().flatten().map(|l| (l.rank, l.world_size)))
}
