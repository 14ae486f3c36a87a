//! The rendezvous protocol under the threads backend: a generation-counting barrier whose
//! first phase publishes each rank's buffers ([`Slot`]) and checks that every rank called the
//! same collective, and whose later phases cannot fail (see the threads backend's note).

use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use zerotrain_precision::{FlatElem, Precision};

use super::{OpKind, ReduceOp};
use crate::ZeroError;

#[derive(Debug)]
pub(super) struct Hub {
    pub(super) world_size: usize,
    timeout: Duration,
    state: Mutex<State>,
    cv: Condvar,
}

#[derive(Debug)]
struct State {
    /// Completed barriers; a waiter is released when this moves on.
    generation: u64,
    arrived: usize,
    /// Which ranks wait at the barrier in progress (to name the missing ones on a timeout).
    present: Vec<bool>,
    aborted: Option<(usize, String)>,
    /// What each rank published for the barrier in progress.
    slots: Vec<Slot>,
    /// The slots as they were when the last barrier completed: what its waiters read. A
    /// fast rank may publish its next slot before a slow one wakes (a plain `barrier()` has
    /// no exit barrier to hold it back), so waiters must not read `slots` (regression test
    /// `a_barrier_followed_at_once_by_another_collective_is_not_a_mismatch`).
    completed: Vec<Slot>,
}

/// What a rank publishes at the rendezvous.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct Slot {
    pub(super) op: Option<OpKind>,
    pub(super) reduce: Option<ReduceOp>,
    pub(super) dtype: Precision,
    pub(super) root: usize,
    pub(super) src: *const u8,
    pub(super) src_len: usize,
    pub(super) dst: *mut u8,
    pub(super) dst_len: usize,
}

// SAFETY: a Slot is only an address book. The pointers are dereferenced only between the
// rendezvous and the exit barrier of the call that published them, while the publishing
// rank is blocked inside that same call holding the borrow of its buffers (module note).
unsafe impl Send for Slot {}

impl Slot {
    const EMPTY: Slot = Slot {
        op: None,
        reduce: None,
        dtype: Precision::Fp32,
        root: 0,
        src: std::ptr::null(),
        src_len: 0,
        dst: std::ptr::null_mut(),
        dst_len: 0,
    };

    pub(super) fn new<E: FlatElem>(
        op: OpKind,
        reduce: Option<ReduceOp>,
        root: usize,
        src: (*const E, usize),
        dst: (*mut E, usize),
    ) -> Self {
        let (src, src_len, dst, dst_len) = (src.0.cast(), src.1, dst.0.cast(), dst.1);
        Slot { op: Some(op), reduce, dtype: E::DTYPE, root, src, src_len, dst, dst_len }
    }
}

impl Hub {
    /// A hub for `world_size` ranks whose rendezvous gives up after `timeout`.
    pub(super) fn new(world_size: usize, timeout: Duration) -> Self {
        let slots = vec![Slot::EMPTY; world_size];
        let present = vec![false; world_size];
        let state = State { generation: 0, arrived: 0, present, aborted: None, completed: slots.clone(), slots };
        Self { world_size, timeout, state: Mutex::new(state), cv: Condvar::new() }
    }

    /// The first abort, if any: the failing rank and its reason.
    pub(super) fn aborted(&self) -> Option<(usize, String)> {
        self.lock().aborted.clone()
    }

    /// Rendezvous for `slot.op`, checking that every rank called the same thing.
    pub(super) fn rendezvous(&self, rank: usize, slot: Slot) -> Result<Vec<Slot>, ZeroError> {
        let slots = self.sync(rank, Some(slot))?;
        let mine = &slots[rank];
        let differs = |s: &Slot| {
            s.op != mine.op
                || s.dtype != mine.dtype
                || s.reduce != mine.reduce
                || s.root != mine.root
                || s.src_len != mine.src_len
                || s.dst_len != mine.dst_len
        };
        if let Some(other) = slots.iter().position(differs) {
            // Every rank sees the same slots, so every rank takes this branch; nobody has
            // touched a peer's buffer yet, so returning here is safe.
            let detail = format!(
                "rank {} called {:?}/{:?} with {}->{} {} elements (root {}), rank {other} called {:?}/{:?} with {}->{} {} (root {})",
                rank,
                mine.op,
                mine.reduce,
                mine.src_len,
                mine.dst_len,
                mine.dtype,
                mine.root,
                slots[other].op,
                slots[other].reduce,
                slots[other].src_len,
                slots[other].dst_len,
                slots[other].dtype,
                slots[other].root,
            );
            self.abort(rank, &detail);
            return Err(ZeroError::Mismatch { rank, detail });
        }
        Ok(slots)
    }

    /// A barrier after the rendezvous. It cannot fail: see the threads backend's note on why
    /// later barriers are unconditional.
    pub(super) fn exit_barrier(&self, rank: usize) {
        let _ = self.sync(rank, None);
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // A poisoned lock only means a rank panicked while holding it; the state itself is
        // plain data that every transition leaves consistent.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(super) fn abort(&self, rank: usize, reason: &str) {
        let mut state = self.lock();
        if state.aborted.is_none() {
            state.aborted = Some((rank, reason.to_string()));
        }
        self.cv.notify_all();
    }

    /// Waits for every rank. With `publish`, this is a rendezvous: it fails on abort or
    /// timeout and returns the slots every rank published. Without, it waits unconditionally.
    fn sync(&self, rank: usize, publish: Option<Slot>) -> Result<Vec<Slot>, ZeroError> {
        let mut state = self.lock();
        let abortable = publish.is_some();
        if abortable && let Some((by, reason)) = &state.aborted {
            return Err(ZeroError::Aborted { rank: *by, reason: reason.clone() });
        }
        if let Some(slot) = publish {
            state.slots[rank] = slot;
        }
        let generation = state.generation;
        state.arrived += 1;
        state.present[rank] = true;
        if state.arrived == self.world_size {
            state.arrived = 0;
            state.present.fill(false);
            state.generation += 1;
            self.cv.notify_all();
            state.completed = state.slots.clone();
            return Ok(state.completed.clone());
        }
        let deadline = Instant::now() + self.timeout;
        loop {
            let wait = if abortable { deadline.saturating_duration_since(Instant::now()) } else { self.timeout };
            state = self.cv.wait_timeout(state, wait).unwrap_or_else(|e| e.into_inner()).0;
            if state.generation != generation {
                return Ok(state.completed.clone());
            }
            if !abortable {
                continue;
            }
            if let Some((by, reason)) = state.aborted.clone() {
                state.arrived -= 1;
                state.present[rank] = false;
                return Err(ZeroError::Aborted { rank: by, reason });
            }
            if Instant::now() >= deadline {
                let missing: Vec<usize> = (0..self.world_size).filter(|&r| !state.present[r]).collect();
                state.arrived -= 1;
                state.present[rank] = false;
                let op = publish.and_then(|s| s.op).map_or("barrier", OpKind::name);
                let timeout_ms = self.timeout.as_millis() as u64;
                let error = ZeroError::Timeout { rank, op, timeout_ms, missing };
                state.aborted.get_or_insert((rank, error.to_string()));
                self.cv.notify_all();
                return Err(error);
            }
        }
    }
}
