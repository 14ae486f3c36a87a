//! Who a place's rounds wait for: the groups' seats, joins, leaves and drops.
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

use std::time::{Duration, Instant};

use super::{Outer, Place, Refusal, Status};
use crate::config::OuterOptimizer;

/// A group's seat at a place.
#[derive(Debug, Clone)]
pub(super) enum Seat {
    /// Not joined yet; rounds wait for it (until the group timeout).
    Expected,
    /// Joined: see [`Member`].
    Live(Member),
    /// Dropped from the quorum; a join brings it back.
    Dropped,
}

/// A live group at a place.
#[derive(Debug, Clone)]
pub(super) struct Member {
    /// The session its join got.
    pub(super) session: u64,
    /// The round its next push belongs to.
    pub(super) round: u64,
    /// Sync: its push of the round, until the round applies.
    pub(super) push: Option<Vec<f32>>,
    /// Since when its pull waits for other groups (none: it does not wait).
    pub(super) waiting: Option<Instant>,
    /// When it joined: it never answers for a wait that began before.
    pub(super) joined: Instant,
}

impl Place {
    /// Live groups.
    pub fn live(&self) -> usize {
        self.seats.iter().filter(|s| matches!(s, Seat::Live(_))).count()
    }

    /// Groups a round waits for: live and expected ones.
    pub(super) fn counted(&self) -> impl Iterator<Item = (usize, &Seat)> {
        self.seats.iter().enumerate().filter(|(_, s)| !matches!(s, Seat::Dropped))
    }

    /// The round of the slowest counted group (async; expected groups count as at the
    /// earliest round a live one is at).
    pub(super) fn slowest(&self) -> Option<u64> {
        let live = self.members().map(|m| m.round);
        let min_live = live.min();
        match self.seats.iter().any(|s| matches!(s, Seat::Expected)) {
            true => Some(min_live.unwrap_or(0).min(self.first_round())),
            false => min_live,
        }
    }

    /// The round an expected or rejoining group starts at.
    pub(super) fn first_round(&self) -> u64 {
        match self.outer {
            Outer::Sync(_) => self.round,
            Outer::Async(_) => self.members().map(|m| m.round).max().unwrap_or(0),
        }
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
    pub(super) fn seat(&mut self, group: usize, session: u64) -> Result<&mut Member, Refusal> {
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

    /// `group`'s pull (under `session`) ended without an answer (its caller went away):
    /// it no longer waits.
    pub fn stop_waiting(&mut self, group: usize, session: u64) {
        if let Ok(member) = self.seat(group, session) {
            member.waiting = None;
        }
    }

    /// The live groups.
    pub(super) fn members(&self) -> impl Iterator<Item = &Member> {
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
