//! The rendezvous protocol under the threads backend: a generation-counting barrier whose
//! first phase publishes each rank's buffers ([`Slot`]) and checks that every rank called the
//! same collective, and whose later phases cannot fail (see the threads backend's note).
//! Beside it, each hub keeps the mailboxes of its point-to-point messages, and belongs to a
//! [`Family`]: the world's hub and the hubs of groups split from it, so that an abort
//! reaches every one.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, Weak};
use std::time::{Duration, Instant};

use zerotrain_precision::{FlatBuf, FlatElem, Precision};

use super::{OpKind, ReduceOp};
use crate::ZeroError;

#[derive(Debug)]
pub(super) struct Hub {
    pub(super) world_size: usize,
    timeout: Duration,
    state: Mutex<State>,
    cv: Condvar,
    /// The world rank of each of this hub's ranks (errors name world ranks).
    world_ranks: Vec<usize>,
    family: Arc<Family>,
}

/// A world's hub and the hubs of every group split from it.
#[derive(Debug, Default)]
pub(super) struct Family {
    hubs: Mutex<Vec<Weak<Hub>>>,
    /// Groups by (parent hub, split number on it, color).
    groups: Mutex<HashMap<(usize, u64, usize), Arc<Hub>>>,
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
    /// Point-to-point messages not yet received, by (from, to).
    mailboxes: HashMap<(usize, usize), VecDeque<FlatBuf>>,
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
    /// A world's hub, for `world_size` ranks whose rendezvous gives up after `timeout`.
    pub(super) fn new(world_size: usize, timeout: Duration) -> Arc<Self> {
        Self::create((0..world_size).collect(), timeout, Arc::new(Family::default()))
    }

    /// A hub in `family` for the world ranks `world_ranks`, registered so that aborts reach it.
    fn create(world_ranks: Vec<usize>, timeout: Duration, family: Arc<Family>) -> Arc<Self> {
        let world_size = world_ranks.len();
        let slots = vec![Slot::EMPTY; world_size];
        let present = vec![false; world_size];
        let state = State {
            generation: 0,
            arrived: 0,
            present,
            aborted: None,
            completed: slots.clone(),
            slots,
            mailboxes: HashMap::new(),
        };
        let hub =
            Arc::new(Self { world_size, timeout, state: Mutex::new(state), cv: Condvar::new(), world_ranks, family });
        lock(&hub.family.hubs).push(Arc::downgrade(&hub));
        hub
    }

    /// The world rank of this hub's rank `rank`.
    pub(super) fn world_rank(&self, rank: usize) -> usize {
        self.world_ranks[rank]
    }

    /// The hub of the group `members` (ranks of this hub, in their new order) that the
    /// `split`-th split of this hub gives `color`: created by the first member to ask.
    pub(super) fn group(self: &Arc<Self>, split: u64, color: usize, members: &[usize]) -> Arc<Hub> {
        let key = (Arc::as_ptr(self) as usize, split, color);
        let mut groups = lock(&self.family.groups);
        let hub = groups.entry(key).or_insert_with(|| {
            let world_ranks = members.iter().map(|&r| self.world_ranks[r]).collect();
            Self::create(world_ranks, self.timeout, Arc::clone(&self.family))
        });
        Arc::clone(hub)
    }

    /// The first abort, if any: the failing rank and its reason.
    pub(super) fn aborted(&self) -> Option<(usize, String)> {
        self.lock().aborted.clone()
    }

    /// Rendezvous for `slot.op`, checking that every rank called the same thing.
    pub(super) fn rendezvous(&self, rank: usize, slot: Slot) -> Result<Vec<Slot>, ZeroError> {
        let slots = self.sync(rank, Some(slot))?;
        let mine = &slots[rank];
        // A split's root and length are each rank's own color and key.
        let split = mine.op == Some(OpKind::Split);
        let differs = |s: &Slot| {
            s.op != mine.op
                || s.dtype != mine.dtype
                || s.reduce != mine.reduce
                || (!split && (s.root != mine.root || s.src_len != mine.src_len))
                || s.dst_len != mine.dst_len
        };
        if let Some(other) = slots.iter().position(differs) {
            // Every rank sees the same slots, so every rank takes this branch; nobody has
            // touched a peer's buffer yet, so returning here is safe.
            let detail = format!(
                "rank {} called {:?}/{:?} with {}->{} {} elements (root {}), rank {} called {:?}/{:?} with {}->{} {} (root {})",
                self.world_rank(rank),
                mine.op,
                mine.reduce,
                mine.src_len,
                mine.dst_len,
                mine.dtype,
                mine.root,
                self.world_rank(other),
                slots[other].op,
                slots[other].reduce,
                slots[other].src_len,
                slots[other].dst_len,
                slots[other].dtype,
                slots[other].root,
            );
            self.abort(rank, &detail);
            return Err(ZeroError::Mismatch { rank: self.world_rank(rank), detail });
        }
        Ok(slots)
    }

    /// A barrier after the rendezvous. It cannot fail: see the threads backend's note on why
    /// later barriers are unconditional.
    pub(super) fn exit_barrier(&self, rank: usize) {
        let _ = self.sync(rank, None);
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        lock(&self.state)
    }

    /// Aborts the whole family on behalf of this hub's rank `rank`.
    pub(super) fn abort(&self, rank: usize, reason: &str) {
        let by = self.world_rank(rank);
        let hubs: Vec<Arc<Hub>> = lock(&self.family.hubs).iter().filter_map(Weak::upgrade).collect();
        for hub in hubs {
            let mut state = hub.lock();
            if state.aborted.is_none() {
                state.aborted = Some((by, reason.to_string()));
            }
            hub.cv.notify_all();
        }
    }

    /// Posts a message from `from` to `to` (this hub's ranks).
    pub(super) fn post(&self, from: usize, to: usize, message: FlatBuf) {
        self.lock().mailboxes.entry((from, to)).or_default().push_back(message);
        self.cv.notify_all();
    }

    /// The next message from `from` to `to`, waiting up to the timeout. A timeout aborts
    /// the family, like a rendezvous.
    pub(super) fn take(&self, from: usize, to: usize) -> Result<FlatBuf, ZeroError> {
        let deadline = Instant::now() + self.timeout;
        let mut state = self.lock();
        loop {
            if let Some((by, reason)) = &state.aborted {
                return Err(ZeroError::Aborted { rank: *by, reason: reason.clone() });
            }
            if let Some(message) = state.mailboxes.get_mut(&(from, to)).and_then(VecDeque::pop_front) {
                return Ok(message);
            }
            let now = Instant::now();
            if now >= deadline {
                let timeout_ms = self.timeout.as_millis() as u64;
                let rank = self.world_rank(to);
                let error = ZeroError::Timeout { rank, op: "recv", timeout_ms, missing: vec![self.world_rank(from)] };
                state.aborted.get_or_insert((rank, error.to_string()));
                self.cv.notify_all();
                drop(state);
                self.abort(to, &error.to_string());
                return Err(error);
            }
            state = self.cv.wait_timeout(state, deadline - now).unwrap_or_else(|e| e.into_inner()).0;
        }
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
                let missing: Vec<usize> =
                    (0..self.world_size).filter(|&r| !state.present[r]).map(|r| self.world_rank(r)).collect();
                state.arrived -= 1;
                state.present[rank] = false;
                let op = publish.and_then(|s| s.op).map_or("barrier", OpKind::name);
                let timeout_ms = self.timeout.as_millis() as u64;
                let error = ZeroError::Timeout { rank: self.world_rank(rank), op, timeout_ms, missing };
                // Aborted here under the lock, so that no other waiter of this hub times out
                // too, then in the rest of the family.
                state.aborted.get_or_insert((self.world_rank(rank), error.to_string()));
                self.cv.notify_all();
                drop(state);
                self.abort(rank, &error.to_string());
                return Err(error);
            }
        }
    }
}

/// Locks `mutex`. A poisoned lock only means a rank panicked while holding it; the data is
/// plain state that every transition leaves consistent.
fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|e| e.into_inner())
}
