//! Ending a rank whose launcher died.
//!
//! # Note: a dead launcher
//! A rank whose launcher died (`mpirun` SIGKILLed, its node daemon lost) would train on
//! alone and go on writing checkpoints for a job nobody runs. Every collective checks
//! first, and while it waits, that the process that started the rank is still its parent
//! (an orphan is re-parented), so no collective completes after `mpirun` died; a save
//! needs several, so at most a commit already in flight can still land. A watchdog thread
//! also ends an idle rank within 20 ms (a 20 ms window alone let a loaded machine commit
//! two more checkpoints). `PR_SET_PDEATHSIG` is not used: it fires when the *thread* of
//! `mpirun` that forked the rank exits, which OpenMPI's shutdown on SIGINT does before the
//! ranks have saved. Both end the process with `_exit`: `exit` would run MPI's exit handlers, which
//! wait a second for the dead runtime while the rank thread trains on. Ending a rank at
//! any moment, a checkpoint save included, is safe: the commit protocol leaves the
//! previous checkpoint and `latest` intact.

use std::time::Duration;

/// The exit status of a rank that ended because its launcher died (`EX_TEMPFAIL`), so
/// that whoever reaps it can tell this watchdog from any other end.
pub const LAUNCHER_GONE_EXIT_CODE: i32 = 75;

/// Ends the process at once if `launcher` is no longer its parent (module note "a dead
/// launcher").
pub(super) fn exit_if_orphaned(launcher: u32) {
    if std::os::unix::process::parent_id() != launcher {
        // stderr was a pipe to the dead launcher: writing to it raises SIGPIPE, which (the
        // `zerotrain` command restores its default) would end the process before it exits
        // with its own status. Ignore it for this last write.
        // SAFETY: setting a signal's disposition to SIG_IGN takes plain integers.
        unsafe { libc::signal(libc::SIGPIPE, libc::SIG_IGN) };
        // Not eprintln!: a failed write must not panic before the process ends.
        let message = format!("zerotrain: this rank's launcher (process {launcher}) is gone; the rank stops\n");
        let _ = std::io::Write::write_all(&mut std::io::stderr(), message.as_bytes());
        // SAFETY: `_exit` takes no pointers and is always sound to call; it ends the
        // process at once without running exit handlers or destructors, as intended.
        unsafe { libc::_exit(LAUNCHER_GONE_EXIT_CODE) };
    }
}

/// The watchdog of the module note "a dead launcher", for a rank between collectives.
pub(super) fn exit_when_the_launcher_dies(launcher: u32) {
    let watch = move || {
        loop {
            std::thread::sleep(Duration::from_millis(20));
            exit_if_orphaned(launcher);
        }
    };
    if let Err(e) = std::thread::Builder::new().name("zerotrain-launcher-watch".into()).spawn(watch) {
        eprintln!("zerotrain: warning: cannot watch the launcher ({e}); if mpirun dies this rank runs on");
    }
}
