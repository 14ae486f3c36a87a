//! Waiting on NCCL without a bound of its own and without a busy core: [`poll`] looks at
//! work in flight until it is done, the timeout passes or the job is aborted, sleeping
//! between looks (a few microseconds at first, at most [`MAX_NAP`]); [`bounded`] runs a
//! call that cannot be interrupted (`ncclCommInitRank`) on a thread of its own and waits
//! for it the same way. Pure and always built, so that the timeout and abort paths are
//! tested without a GPU.

use std::sync::mpsc;
use std::time::{Duration, Instant};

/// The longest sleep between two looks: what a wait may add to a collective's latency.
pub const MAX_NAP: Duration = Duration::from_micros(500);

/// Why a wait ended before its work was done.
#[derive(Debug, PartialEq, Eq)]
pub enum Stopped<E> {
    /// The timeout passed.
    TimedOut,
    /// The job was aborted, for this reason.
    Aborted(String),
    /// A look failed.
    Failed(E),
}

/// Looks with `look` until it says done, sleeping between looks (doubling from 2 µs to
/// [`MAX_NAP`]); stops when `timeout` passes or `aborted` gives a reason.
pub fn poll<E>(
    timeout: Duration,
    mut look: impl FnMut() -> Result<bool, E>,
    aborted: impl Fn() -> Option<String>,
) -> Result<(), Stopped<E>> {
    let start = Instant::now();
    let mut nap = Duration::from_micros(2);
    loop {
        if look().map_err(Stopped::Failed)? {
            return Ok(());
        }
        if let Some(reason) = aborted() {
            return Err(Stopped::Aborted(reason));
        }
        if start.elapsed() >= timeout {
            return Err(Stopped::TimedOut);
        }
        std::thread::sleep(nap);
        nap = (nap * 2).min(MAX_NAP);
    }
}

/// Runs `call` on a thread of its own and waits for its result as [`poll`] does. A call
/// that does not return in time is left on its thread (it cannot be interrupted; the job is
/// failing anyway) and its result, if it ever comes, is dropped there.
pub fn bounded<T: Send + 'static>(
    name: &str,
    timeout: Duration,
    call: impl FnOnce() -> T + Send + 'static,
    aborted: impl Fn() -> Option<String>,
) -> Result<T, Stopped<std::io::Error>> {
    let (tx, rx) = mpsc::sync_channel(1);
    std::thread::Builder::new()
        .name(name.to_owned())
        .spawn(move || {
            let _ = tx.send(call());
        })
        .map_err(Stopped::Failed)?;
    let mut out = None;
    poll(
        timeout,
        || match rx.try_recv() {
            Ok(value) => {
                out = Some(value);
                Ok(true)
            }
            Err(mpsc::TryRecvError::Empty) => Ok(false),
            Err(mpsc::TryRecvError::Disconnected) => Err(std::io::Error::other(format!("{name} panicked"))),
        },
        aborted,
    )?;
    Ok(out.expect("polled until it came"))
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};

    use super::*;

    /// CPU seconds this thread has used.
    fn thread_cpu() -> f64 {
        let mut t = libc::timespec { tv_sec: 0, tv_nsec: 0 };
        // SAFETY: a valid timespec for the call to fill.
        unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut t) };
        t.tv_sec as f64 + t.tv_nsec as f64 * 1e-9
    }

    /// Work that never finishes times out after the timeout and not long after, having used
    /// a small part of a core while it waited (it sleeps between looks).
    #[test]
    fn a_wait_times_out_without_spinning_a_core() {
        let (wall, cpu) = (Instant::now(), thread_cpu());
        let out = poll(Duration::from_millis(300), || Ok::<_, ()>(false), || None);
        let (wall, cpu) = (wall.elapsed(), thread_cpu() - cpu);
        assert_eq!(out, Err(Stopped::TimedOut));
        assert!(wall >= Duration::from_millis(300) && wall < Duration::from_millis(300) + 20 * MAX_NAP, "{wall:?}");
        assert!(cpu < 0.25 * wall.as_secs_f64(), "{cpu} s of CPU over {wall:?}");
    }

    /// An abort ends a wait at its next look; a failed look ends it with the failure; work
    /// that finishes ends it at once.
    #[test]
    fn a_wait_ends_at_an_abort_a_failure_or_the_work_done() {
        let flag = Arc::new(AtomicBool::new(false));
        let setter = Arc::clone(&flag);
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(50));
            setter.store(true, Ordering::SeqCst);
        });
        let aborted = || flag.load(Ordering::SeqCst).then(|| "rank 1 failed".to_string());
        let out = poll(Duration::from_secs(30), || Ok::<_, ()>(false), aborted);
        assert_eq!(out, Err(Stopped::Aborted("rank 1 failed".into())));
        assert_eq!(poll(Duration::from_secs(30), || Err::<bool, _>("lost"), || None), Err(Stopped::Failed("lost")));
        let mut looks = 0;
        assert_eq!(
            poll(
                Duration::from_secs(30),
                || Ok::<_, ()>({
                    looks += 1;
                    looks == 3
                }),
                || None
            ),
            Ok(())
        );
    }

    /// A call that never returns (as `ncclCommInitRank` when a peer died after the id was
    /// shared) is waited for only until the timeout or an abort; one that returns gives its
    /// value.
    #[test]
    fn a_call_that_never_returns_is_waited_for_only_until_the_timeout_or_an_abort() {
        let never = || {
            let (_tx, rx) = mpsc::channel::<()>();
            let _ = rx.recv_timeout(Duration::from_secs(3600));
        };
        assert!(matches!(bounded("test-init", Duration::from_millis(200), never, || None), Err(Stopped::TimedOut)));
        let out = bounded("test-init", Duration::from_secs(30), never, || Some("peer 3 failed".into()));
        assert!(matches!(out, Err(Stopped::Aborted(reason)) if reason == "peer 3 failed"));
        assert_eq!(bounded("test-init", Duration::from_secs(30), || 42, || None).unwrap(), 42);
        assert!(matches!(
            bounded("test-init", Duration::from_secs(30), || panic!("boom"), || None),
            Err(Stopped::Failed(_))
        ));
    }
}
