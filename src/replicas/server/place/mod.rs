//! [`Place`]: one place's global weights on a server, its quorum of groups and its rounds,
//! as a state machine without transport (the gRPC service drives it; tests drive it
//! directly).
//!
//! # Note: the quorum
//! Every group of `0..groups` starts *expected*: a round waits for it as for a live one,
//! so groups started together take their first round together. A group becomes live when
//! it joins (each join gets a new session; a push or pull under an older session is
//! refused, so two jobs claiming one group never both count). A group is *dropped* when it
//! has kept another group waiting for longer than the group timeout ([`Place::expire`]):
//! in sync mode the groups that have not pushed the round the others wait on, in async
//! mode the slowest groups that hold a faster one back; a group answers only for the part
//! of a wait since it joined, so one that joins again mid-round has a whole timeout for its
//! window. A dropped group's unfinished window is discarded (its push never applied); it
//! may join again at any time and starts from the current global weights. Rounds apply
//! among the groups live at that moment.
//!
//! # Note: rejoining one place of several
//! A group's rank pushes each window to every server (each holding a part of its shard)
//! as the same round at each, and every group does: so each place averages the same
//! windows. If one place refuses a group's push of round k (it dropped the group, or
//! restarted) while the others apply it, a group that joined that place again at its open
//! round could be seated at k there (the other groups had not pushed k yet) and at k + 1
//! elsewhere, and push every later window as different rounds at different places, for
//! good. So a join after a refused push of round k asks for a seat at k + 1 at least
//! (`at_least`): a sync place seats it there, and until the place reaches that round the
//! group's pull waits, neither holding up nor counting in the rounds before. A round no
//! live group is in is skipped, the weights unmoved: a place restarted from an older
//! checkpoint moves to the round its rejoining groups continue from.

use std::sync::Arc;
use std::time::{Duration, Instant};

use zerotrain_precision::Precision;

use crate::config::{OuterOptimizer, ReplicaMode};
use crate::replicas::outer::{Delayed, OuterState};

/// A group's seat at a place.
#[derive(Debug, Clone)]
enum Seat {
    /// Not joined yet; rounds wait for it (until the group timeout).
    Expected,
    /// Joined: see [`Member`].
    Live(Member),
    /// Dropped from the quorum; a join brings it back.
    Dropped,
}

/// A live group at a place.
#[derive(Debug, Clone)]
struct Member {
    /// The session its join got.
    session: u64,
    /// The round its next push belongs to.
    round: u64,
    /// Sync: its push of the round, until the round applies.
    push: Option<Vec<f32>>,
    /// Since when its pull waits for other groups (none: it does not wait).
    waiting: Option<Instant>,
    /// When it joined: it never answers for a wait that began before.
    joined: Instant,
}

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

    /// Live groups.
    pub fn live(&self) -> usize {
        self.seats.iter().filter(|s| matches!(s, Seat::Live(_))).count()
    }

    /// Groups a round waits for: live and expected ones.
    fn counted(&self) -> impl Iterator<Item = (usize, &Seat)> {
        self.seats.iter().enumerate().filter(|(_, s)| !matches!(s, Seat::Dropped))
    }

    /// The round of the slowest counted group (async; expected groups count as at the
    /// earliest round a live one is at).
    fn slowest(&self) -> Option<u64> {
        let live = self.members().map(|m| m.round);
        let min_live = live.min();
        match self.seats.iter().any(|s| matches!(s, Seat::Expected)) {
            true => Some(min_live.unwrap_or(0).min(self.first_round())),
            false => min_live,
        }
    }

    /// The round an expected or rejoining group starts at.
    fn first_round(&self) -> u64 {
        match self.outer {
            Outer::Sync(_) => self.round,
            Outer::Async(_) => self.members().map(|m| m.round).max().unwrap_or(0),
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

    /// `group` joins under `session` at `now` (any earlier session of it ends, its pending
    /// push discarded). Returns the round it starts at.
    ///
    /// Sync: not below `at_least` (the note "rejoining one place of several"): seated at a
    /// later round, its pull waits for the rounds before it, which it neither holds up nor
    /// counts in (a round nobody is in is skipped, the weights unmoved).
    pub fn join(
        &mut self,
        group: usize,
        session: u64,
        now: Instant,
        at_least: u64,
        opt: &OuterOptimizer,
    ) -> (u64, Status) {
        self.seats[group] = Seat::Dropped;
        let round = match self.outer {
            Outer::Sync(_) => self.round.max(at_least),
            Outer::Async(_) => self.first_round(),
        };
        self.seats[group] = Seat::Live(Member { session, round, push: None, waiting: None, joined: now });
        if let Outer::Sync(_) = self.outer {
            self.complete(opt);
        }
        (round, self.status(group))
    }

    /// `group` (under `session`) leaves: rounds stop waiting for it (a round it held up
    /// applies now).
    pub fn leave(&mut self, group: usize, session: u64, opt: &OuterOptimizer) -> Result<Status, Refusal> {
        self.seat(group, session)?;
        self.seats[group] = Seat::Dropped;
        if let Outer::Sync(_) = self.outer {
            self.complete(opt);
        }
        Ok(self.status(group))
    }

    /// The live seat of `group` under `session`, or why not.
    fn seat(&mut self, group: usize, session: u64) -> Result<&mut Member, Refusal> {
        match &mut self.seats[group] {
            Seat::Live(m) if m.session == session => Ok(m),
            Seat::Live(_) => Err(Refusal::NotMember(format!(
                "group {group} joined again from another job since this one did: this job's session is over"
            ))),
            Seat::Dropped => Err(Refusal::NotMember(format!(
                "group {group} was dropped from the quorum (it kept the others waiting past the group timeout)"
            ))),
            Seat::Expected => Err(Refusal::NotMember(format!("group {group} has not joined"))),
        }
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

    /// `group`'s pull (under `session`) ended without an answer (its caller went away):
    /// it no longer waits.
    pub fn stop_waiting(&mut self, group: usize, session: u64) {
        if let Ok(member) = self.seat(group, session) {
            member.waiting = None;
        }
    }

    /// The live groups.
    fn members(&self) -> impl Iterator<Item = &Member> {
        self.seats.iter().filter_map(|s| match s {
            Seat::Live(m) => Some(m),
            _ => None,
        })
    }

    /// Drops the groups that have kept another waiting for longer than `timeout` (module
    /// note), and applies the round they held up. Returns the groups dropped.
    ///
    /// A group answers only for the wait since it joined: one that joins again while the
    /// others wait (its round began without it) gets the whole timeout for its window, so a
    /// slow group is not dropped again at once, round after round.
    pub fn expire(&mut self, now: Instant, timeout: Duration, opt: &OuterOptimizer) -> Vec<usize> {
        let Some(since) = self.members().filter_map(|m| m.waiting).min() else { return Vec::new() };
        if now.duration_since(since) < timeout {
            return Vec::new();
        }
        let slowest = self.slowest();
        let overdue = |m: &Member| now.duration_since(since.max(m.joined)) >= timeout;
        let laggard = |seat: &Seat, first: u64| match (seat, &self.outer) {
            (Seat::Expected, _) => true,
            (Seat::Live(m), Outer::Sync(_)) => m.push.is_none() && m.round == self.round && overdue(m),
            (Seat::Live(m), Outer::Async(_)) => Some(m.round) == slowest.or(Some(first)) && overdue(m),
            (Seat::Dropped, _) => false,
        };
        let first = self.first_round();
        let dropped: Vec<usize> =
            self.seats.iter().enumerate().filter(|(_, s)| laggard(s, first)).map(|(g, _)| g).collect();
        // The waiting group has pushed (sync) or is ahead of the slowest (async): it is never
        // among the laggards.
        debug_assert!(dropped.len() < self.counted().count(), "a waiting group is not a laggard");
        for &g in &dropped {
            self.seats[g] = Seat::Dropped;
        }
        if let Outer::Sync(_) = self.outer {
            self.complete(opt);
        }
        dropped
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
