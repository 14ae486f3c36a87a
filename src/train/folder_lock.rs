//! The run folder's lock, so that two trainers never write one folder, and the lock files
//! other writers of a run's files take ([`open_lock_file`]).

use std::path::Path;

use anyhow::{Context, bail};

/// The run folder's lock file: held for the whole run, so two trainers cannot write one
/// folder. Under mpirun (or a launcher) every process holds one, `.zerotrain.lock` for rank 0 and
/// `.zerotrain.rank<r>.lock` for rank `r`: a second job in the same folder fails on the
/// first rank the two share (rank 0 at least), and no process writes a folder it has not
/// locked.
pub const LOCK_FILE: &str = ".zerotrain.lock";

/// The lock file of this process: [`LOCK_FILE`], or rank `r`'s in a job of processes.
pub fn lock_file_name() -> String {
    match crate::processes::place() {
        Some((rank, _)) if rank != 0 => format!(".zerotrain.rank{rank}.lock"),
        _ => LOCK_FILE.to_string(),
    }
}

/// Takes this process's exclusive lock of the run folder (released when the returned file
/// is dropped, or by the OS when the process dies).
pub(super) fn lock_run_folder(out: &Path) -> anyhow::Result<std::fs::File> {
    let path = out.join(lock_file_name());
    let file = open_lock_file(&path)?;
    match file.try_lock() {
        Ok(()) => Ok(file),
        Err(std::fs::TryLockError::WouldBlock) => {
            bail!("{} is in use by another zerotrain run (its lock {} is held)", out.display(), path.display())
        }
        Err(std::fs::TryLockError::Error(e)) => Err(e).with_context(|| format!("cannot lock {}", path.display())),
    }
}

/// The lock file `path`, created if missing and never truncated (its holder's lock is what
/// matters, not its contents).
pub(crate) fn open_lock_file(path: &Path) -> anyhow::Result<std::fs::File> {
    std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(path)
        .with_context(|| format!("cannot create {}", path.display()))
}
