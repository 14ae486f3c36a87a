//! The memory a parameter server gives to vectors being received ([`Budget`]): every join
//! and push allocates its vector before the first value arrives, so without a bound on all
//! of them together, many callers (or one with many streams) could each take up to the
//! per-call limit at once.
//!
//! # Note: the bound
//! In a round each group sends each place one vector, so a server in use holds at most
//! `groups` vectors per place in flight. The budget is `groups + 1` times the bytes of the
//! places it holds: a stream that would pass it waits (it is not refused) until others have
//! finished, so bursts queue and nothing a caller sends can grow the server past it. Before
//! any place exists the first stream is let through alone; its join fixes the length every
//! later place must have.

use std::sync::Mutex;

use tokio::sync::Notify;

/// Bytes of vectors in flight, and the waiters for room.
#[derive(Debug, Default)]
pub struct Budget {
    in_flight: Mutex<u64>,
    freed: Notify,
}

/// Bytes reserved for one vector, given back when dropped.
#[derive(Debug)]
pub struct Reserved<'a> {
    budget: &'a Budget,
    bytes: u64,
}

impl Drop for Reserved<'_> {
    fn drop(&mut self) {
        let mut in_flight = self.budget.in_flight.lock().unwrap_or_else(|e| e.into_inner());
        *in_flight = in_flight.saturating_sub(self.bytes);
        drop(in_flight);
        self.budget.freed.notify_waiters();
    }
}

impl Budget {
    /// Reserves `bytes`, waiting while they would pass `limit()` (asked again after every
    /// release: places may have been made meanwhile). A stream is always let through when
    /// nothing else is in flight.
    pub async fn reserve(&self, bytes: u64, limit: impl Fn() -> u64) -> Reserved<'_> {
        loop {
            let freed = self.freed.notified();
            {
                let mut in_flight = self.in_flight.lock().unwrap_or_else(|e| e.into_inner());
                if *in_flight == 0 || in_flight.saturating_add(bytes) <= limit() {
                    *in_flight += bytes;
                    return Reserved { budget: self, bytes };
                }
            }
            freed.await;
        }
    }

    /// Bytes in flight.
    #[cfg(test)]
    pub fn in_flight(&self) -> u64 {
        *self.in_flight.lock().unwrap_or_else(|e| e.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Reservations past the limit wait for a release and then go through; the first is let
    /// through alone whatever its size.
    #[test]
    fn a_reservation_past_the_limit_waits_for_room() {
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        runtime.block_on(async {
            let budget = Budget::default();
            let big = budget.reserve(1000, || 10).await;
            assert_eq!(budget.in_flight(), 1000);
            let second = budget.reserve(5, || 10);
            tokio::pin!(second);
            let waited = tokio::time::timeout(std::time::Duration::from_millis(50), &mut second).await;
            assert!(waited.is_err(), "room for 5 more past a limit of 10 with 1000 in flight");
            drop(big);
            let second = second.await;
            assert_eq!(budget.in_flight(), 5);
            let third = budget.reserve(5, || 10).await;
            assert_eq!(budget.in_flight(), 10);
            drop((second, third));
            assert_eq!(budget.in_flight(), 0);
        });
    }
}
