//! [`Place`]: one place's global weights on a server, its quorum of groups (`quorum.rs`:
//! who a round waits for, joins, drops) and its rounds (here: pushes, how a round applies,
//! pulls), as a state machine without transport (the gRPC service drives it; tests drive
//! it directly).

use std::sync::Arc;
use std::time::Instant;

use zerotrain_precision::Precision;

use self::quorum::{Member, Seat};
use crate::config::{OuterOptimizer, ReplicaMode};
use crate::replicas::outer::{Delayed, OuterState};

mod quorum;

/// Why a call was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Refusal {
    /// The group is not (or no longer, under this session) in the quorum: join again.
    NotMember(String),
    /// A protocol error: a stale round, another layout, a second push.
    Invalid(String),
}

/// What a pull gets.
#[derive(Debug, PartialEq)]
pub(super) enum Pulled {
    /// The global weights, for the round the group is at.
    Ready(Arc<Vec<f32>>),
    /// Not yet: other groups must push first.
    Wait,
}

/// What the place says after a push or join: its round (sync: rounds applied; async:
/// pushes applied), its live groups, and how many rounds the caller is ahead of the
/// slowest counted group (after an async push: how far ahead it was when it pushed).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Status {
    pub round: u64,
    pub live: usize,
    pub staleness: u64,
}

/// The outer optimizer's state, by mode.
#[derive(Debug, Clone)]
pub(super) enum Outer {
    Sync(OuterState),
    Async(Delayed),
}

/// One place: global weights, outer state, quorum.
#[derive(Debug)]
pub(super) struct Place {
    /// Shared with the pulls streaming it (a round that applies meanwhile copies it first).
    pub global: Arc<Vec<f32>>,
    pub outer: Outer,
    /// Sync: rounds applied. Async: pushes applied.
    pub round: u64,
    /// Which part of a rank's shard the place holds, as its first joiner said (none: a
    /// checkpoint of a server that did not record it; the next joiner's is taken).
    pub part: Option<super::Part>,
    /// Sync: the dtype a round's sum is rounded to (`communication_data_type`), as the
    /// in-job all-reduce rounds it, so that both train alike bit for bit.
    wire: Precision,
    seats: Vec<Seat>,
    /// Async: rounds a group may run ahead of the slowest counted one.
    max_staleness: u64,
    /// Pushes' buffers, spent, for the next pushes to fill (their pages stay mapped).
    spare: Vec<Vec<f32>>,
}

impl Place {
    /// A place of `mode` with `global` weights and `outer` state at `round`, every one of
    /// `groups` groups expected, its sync rounds' sums rounded to `wire`.
    pub fn new(mode: ReplicaMode, global: Vec<f32>, outer: Outer, round: u64, groups: usize, wire: Precision) -> Self {
        let max_staleness = match mode {
            ReplicaMode::Sync => 0,
            ReplicaMode::Async { max_staleness } => max_staleness,
        };
        Self {
            global: Arc::new(global),
            outer,
            round,
            part: None,
            wire,
            seats: vec![Seat::Expected; groups],
            max_staleness,
            spare: Vec::new(),
        }
    }

    /// What a checkpoint saves of the place, taken at once: its weights (shared, not
    /// copied), outer state and round; no quorum, pushes or buffers.
    pub fn snapshot(&self) -> Self {
        Self {
            global: Arc::clone(&self.global),
            outer: self.outer.clone(),
            round: self.round,
            part: self.part,
            wire: self.wire,
            seats: Vec::new(),
            max_staleness: self.max_staleness,
            spare: Vec::new(),
        }
    }

    /// A spent push buffer of this place's length, if one is kept.
    pub fn take_spare(&mut self) -> Option<Vec<f32>> {
        self.spare.pop()
    }

    /// Keeps `buffer` for a later push (as many as there are groups).
    fn recycle(&mut self, buffer: Vec<f32>) {
        if self.spare.len() < self.seats.len() && buffer.len() == self.global.len() {
            self.spare.push(buffer);
        }
    }

    fn status(&self, group: usize) -> Status {
        let round = match &self.seats[group] {
            Seat::Live(m) => m.round,
            _ => self.round,
        };
        let staleness = round.saturating_sub(self.slowest().unwrap_or(round));
        Status { round: self.round, live: self.live(), staleness }
    }

    /// `group`'s pseudo-gradient for `round`: stored until the round completes (sync) or
    /// applied at once (async).
    pub fn push(
        &mut self,
        group: usize,
        session: u64,
        round: u64,
        delta: Vec<f32>,
        opt: &OuterOptimizer,
    ) -> Result<Status, Refusal> {
        let len = self.global.len();
        let sync = matches!(self.outer, Outer::Sync(_));
        let member = self.seat(group, session)?;
        member.waiting = None;
        let at = member.round;
        // A retried push (its answer lost with a connection) is acknowledged, not applied
        // twice.
        if round + 1 == at || (round == at && member.push.is_some()) {
            return Ok(self.status(group));
        }
        if round != at {
            let message =
                format!("push from group {group} for round {round}, which it is not at (it is at round {at}): stale");
            return Err(Refusal::Invalid(message));
        }
        if delta.len() != len {
            let message =
                format!("group {group} pushed {} values for round {round} of {len}: another layout", delta.len());
            return Err(Refusal::Invalid(message));
        }
        if sync {
            member.push = Some(delta);
            self.complete(opt);
        } else {
            // Staleness of the push: how far ahead of the slowest counted group it was made.
            let staleness = at.saturating_sub(self.slowest().unwrap_or(at));
            let groups = self.seats.len();
            let member = self.seat(group, session)?;
            member.round += 1;
            if let Outer::Async(delayed) = &mut self.outer {
                delayed.push(opt, Arc::<Vec<f32>>::make_mut(&mut self.global), &delta, groups);
            }
            self.recycle(delta);
            self.round += 1;
            return Ok(Status { staleness, ..self.status(group) });
        }
        Ok(self.status(group))
    }

    /// Sync: applies the round once every counted group has pushed it (the mean, summed in
    /// group order in f32 and rounded once to the wire dtype, as the in-job all-reduce sums).
    fn complete(&mut self, opt: &OuterOptimizer) {
        // A round no live group is in (the others seated later, with `at_least`) is
        // skipped: nobody has a window for it.
        if !self.members().any(|m| m.round == self.round)
            && let Some(next) = self.members().map(|m| m.round).min()
        {
            self.round = next;
            return;
        }
        // Groups seated at a later round neither hold the open one up nor count in it.
        let open = self.round;
        let all_in = self.counted().all(|(_, s)| matches!(s, Seat::Live(m) if m.push.is_some() || m.round > open));
        if !all_in || !self.members().any(|m| m.round == open) {
            return;
        }
        // The first push is the sum's start (no buffer to allocate and zero).
        let mut sum: Option<Vec<f32>> = None;
        let mut spent = Vec::new();
        for seat in &mut self.seats {
            if let Seat::Live(Member { round, push, .. }) = seat
                && *round == open
            {
                let delta = push.take().expect("every counted group pushed");
                match &mut sum {
                    None => sum = Some(delta),
                    Some(sum) => {
                        sum.iter_mut().zip(&delta).for_each(|(s, d)| *s += d);
                        spent.push(delta);
                    }
                }
                *round += 1;
            }
        }
        let mut sum = sum.expect("a live group pushed");
        zerotrain_precision::round_to(self.wire, &mut sum);
        let Outer::Sync(state) = &mut self.outer else { unreachable!("sync rounds complete") };
        state.step_mean(opt, Arc::<Vec<f32>>::make_mut(&mut self.global), &mut sum, spent.len() + 1);
        self.round += 1;
        spent.push(sum);
        spent.into_iter().for_each(|b| self.recycle(b));
    }

    /// A pull by `group` (under `session`) of the weights it continues from: ready unless
    /// it must wait for other groups (sync: the round's other pushes; async: it is more
    /// than `max_staleness` rounds ahead of the slowest counted group).
    pub fn pull(&mut self, group: usize, session: u64, now: Instant) -> Result<Pulled, Refusal> {
        let member = self.seat(group, session)?;
        let (round, pending) = (member.round, member.push.is_some());
        let ready = match self.outer {
            Outer::Sync(_) => !pending && round == self.round,
            Outer::Async(_) => round <= self.slowest().unwrap_or(round) + self.max_staleness,
        };
        let member = self.seat(group, session)?;
        if ready {
            member.waiting = None;
            return Ok(Pulled::Ready(Arc::clone(&self.global)));
        }
        member.waiting.get_or_insert(now);
        Ok(Pulled::Wait)
    }
}

impl ReplicaMode {
    /// The outer state a new place of this mode starts with.
    pub(super) fn fresh_outer(self) -> Outer {
        match self {
            Self::Sync => Outer::Sync(OuterState::default()),
            Self::Async { .. } => Outer::Async(Delayed::default()),
        }
    }
}

#[cfg(test)]
mod tests;
