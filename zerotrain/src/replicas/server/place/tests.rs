//! The place's state machine, driven directly: quorums, timeouts, sessions, async
//! staleness, and joins at a later round.

use std::time::Duration;

use super::*;

const AVERAGE: OuterOptimizer = OuterOptimizer { lr: 1.0, momentum: 0.0, nesterov: false };
const SECOND: Duration = Duration::from_secs(1);

/// A fresh sync place of `groups` groups at round 0.
fn sync(global: Vec<f32>, groups: usize) -> Place {
    Place::new(ReplicaMode::Sync, global, ReplicaMode::Sync.fresh_outer(), 0, groups, Precision::Fp32)
}

fn ready(place: &mut Place, group: usize, session: u64, now: Instant) -> Option<Vec<f32>> {
    match place.pull(group, session, now).unwrap() {
        Pulled::Ready(w) => Some(w.to_vec()),
        Pulled::Wait => None,
    }
}

/// Sync: a round waits for every expected group; one that never pushes is dropped
/// once it has kept the others waiting past the timeout (not before), the round then
/// applies the mean of the pushes that came, and the dropped group's late push is
/// refused until it joins again, at the current round.
#[test]
fn a_sync_round_drops_the_group_that_keeps_it_waiting_and_applies_the_rest() {
    let t0 = Instant::now();
    let mut place = sync(vec![1.0, 1.0], 3);
    let (r0, _) = place.join(0, 10, t0, 0, &AVERAGE);
    let (r1, _) = place.join(1, 11, t0, 0, &AVERAGE);
    let (r2, _) = place.join(2, 12, t0, 0, &AVERAGE);
    assert_eq!((r0, r1, r2), (0, 0, 0));
    place.push(0, 10, 0, vec![0.5, 0.0], &AVERAGE).unwrap();
    place.push(1, 11, 0, vec![0.0, 0.5], &AVERAGE).unwrap();
    assert_eq!(ready(&mut place, 0, 10, t0), None, "group 2 has not pushed");
    assert!(place.expire(t0 + SECOND / 2, SECOND, &AVERAGE).is_empty(), "not yet past the timeout");
    assert_eq!(place.expire(t0 + SECOND * 2, SECOND, &AVERAGE), [2]);
    // [1, 1] - mean([0.5, 0], [0, 0.5]) = [0.75, 0.75].
    assert_eq!(ready(&mut place, 0, 10, t0).unwrap(), [0.75, 0.75]);
    assert_eq!((place.round, place.live()), (1, 2));
    let late = place.push(2, 12, 0, vec![9.0, 9.0], &AVERAGE).unwrap_err();
    assert!(matches!(&late, Refusal::NotMember(m) if m.contains("group 2 was dropped")), "{late:?}");
    let (round, status) = place.join(2, 13, t0, 0, &AVERAGE);
    assert_eq!((round, status.live), (1, 3), "it rejoins at the current round");
    assert_eq!(ready(&mut place, 2, 13, t0).unwrap(), [0.75, 0.75]);
    // A group that leaves (its job ended) is no longer waited for.
    place.push(0, 10, 1, vec![0.25, 0.25], &AVERAGE).unwrap();
    place.push(1, 11, 1, vec![0.25, 0.25], &AVERAGE).unwrap();
    assert_eq!(ready(&mut place, 0, 10, t0), None);
    assert_eq!(place.leave(2, 13, &AVERAGE).unwrap().live, 2);
    assert_eq!(ready(&mut place, 0, 10, t0).unwrap(), [0.5, 0.5]);
}

/// A group that joins again while another waits on the round it joins at answers only
/// for the wait since its join: it has the whole timeout for its window (not what was
/// left of the other's wait), then is dropped like any other.
#[test]
fn a_rejoined_group_has_the_whole_timeout_for_its_window() {
    let t0 = Instant::now();
    let mut place = sync(vec![1.0], 2);
    place.join(0, 1, t0, 0, &AVERAGE);
    place.join(1, 2, t0, 0, &AVERAGE);
    place.push(0, 1, 0, vec![1.0], &AVERAGE).unwrap();
    assert_eq!(ready(&mut place, 0, 1, t0), None);
    // Group 1's job restarts just before the timeout: its new session starts round 0.
    let (round, _) = place.join(1, 3, t0 + SECOND * 9 / 10, 0, &AVERAGE);
    assert_eq!(round, 0);
    assert!(place.expire(t0 + SECOND * 3 / 2, SECOND, &AVERAGE).is_empty(), "half a timeout since its join");
    place.push(1, 3, 0, vec![3.0], &AVERAGE).unwrap();
    assert_eq!(ready(&mut place, 0, 1, t0).unwrap(), [-1.0], "1 - mean(1, 3)");
    // Next round, it is late past a timeout of its own: dropped.
    place.push(0, 1, 1, vec![0.0], &AVERAGE).unwrap();
    let t1 = t0 + SECOND * 2;
    assert_eq!(ready(&mut place, 0, 1, t1), None);
    assert!(place.expire(t1 + SECOND / 2, SECOND, &AVERAGE).is_empty());
    assert_eq!(place.expire(t1 + SECOND, SECOND, &AVERAGE), [1]);
    assert_eq!((place.round, place.live()), (2, 1));
}

/// A group that joins again (a restarted job) ends its earlier session: the old job's
/// push is refused and cannot count twice; a push for another round is stale; a
/// retried push is acknowledged and not applied twice.
#[test]
fn an_old_session_and_a_wrong_round_are_refused() {
    let t0 = Instant::now();
    let mut place = sync(vec![0.0], 2);
    place.join(0, 1, t0, 0, &AVERAGE);
    place.join(0, 2, t0, 0, &AVERAGE);
    let old = place.push(0, 1, 0, vec![1.0], &AVERAGE).unwrap_err();
    assert!(matches!(&old, Refusal::NotMember(m) if m.contains("session is over")), "{old:?}");
    let stale = place.push(0, 2, 3, vec![1.0], &AVERAGE).unwrap_err();
    assert!(matches!(&stale, Refusal::Invalid(m) if m.contains("round 3") && m.contains("stale")), "{stale:?}");
    let unjoined = place.pull(1, 5, Instant::now()).unwrap_err();
    assert!(matches!(&unjoined, Refusal::NotMember(m) if m.contains("has not joined")), "{unjoined:?}");
    place.push(0, 2, 0, vec![1.0], &AVERAGE).unwrap();
    place.push(0, 2, 0, vec![1.0], &AVERAGE).unwrap();
    place.join(1, 3, t0, 0, &AVERAGE);
    place.push(1, 3, 0, vec![3.0], &AVERAGE).unwrap();
    assert_eq!((place.round, place.global.as_slice()), (1, &[-2.0][..]), "0 - mean(1, 3), the retry not counted");
    place.push(1, 3, 0, vec![3.0], &AVERAGE).unwrap();
    assert_eq!((place.round, place.global.as_slice()), (1, &[-2.0][..]), "a retry after the round applied");
    let layout = place.push(1, 3, 1, vec![3.0, 1.0], &AVERAGE).unwrap_err();
    assert!(matches!(&layout, Refusal::Invalid(m) if m.contains("another layout")), "{layout:?}");
}

/// Async: pushes apply as they arrive (each its share: lr g / live groups); a group
/// more than `max_staleness` rounds ahead of the slowest waits, and stops waiting when
/// the slowest pushes or, past the timeout, is dropped.
#[test]
fn async_pushes_apply_at_once_and_staleness_is_bounded() {
    let mode = ReplicaMode::Async { max_staleness: 1 };
    let t0 = Instant::now();
    let mut place = Place::new(mode, vec![0.0], mode.fresh_outer(), 0, 2, Precision::Fp32);
    place.join(0, 1, t0, 0, &AVERAGE);
    place.join(1, 2, t0, 0, &AVERAGE);
    let s = place.push(0, 1, 0, vec![1.0], &AVERAGE).unwrap();
    assert_eq!(*place.global, [-0.5], "its share, applied at once");
    assert_eq!((s.round, s.staleness), (1, 0), "pushed level with the slowest");
    assert!(ready(&mut place, 0, 1, t0).is_some(), "one round ahead is allowed");
    let s = place.push(0, 1, 1, vec![1.0], &AVERAGE).unwrap();
    assert_eq!((s.round, s.staleness), (2, 1), "pushed one round ahead");
    assert_eq!(ready(&mut place, 0, 1, t0), None, "two rounds ahead waits");
    place.push(1, 2, 0, vec![-1.0], &AVERAGE).unwrap();
    assert_eq!(ready(&mut place, 0, 1, t0).unwrap(), [-0.5], "the slowest pushed: one ahead again");
    assert!(place.expire(t0 + SECOND * 5, SECOND, &AVERAGE).is_empty(), "nobody waits: nobody is dropped");
    place.push(0, 1, 2, vec![0.0], &AVERAGE).unwrap();
    assert_eq!(ready(&mut place, 0, 1, t0), None);
    assert_eq!(place.expire(t0 + SECOND * 2, SECOND, &AVERAGE), [1], "the slowest is dropped");
    assert_eq!(ready(&mut place, 0, 1, t0).unwrap(), [-0.5]);
    assert_eq!(place.live(), 1);
}

/// Groups that never join are waited for (as at a job's start) and dropped past the
/// timeout like any other.
#[test]
fn expected_groups_hold_the_first_round_until_the_timeout() {
    let t0 = Instant::now();
    let mut place = sync(vec![2.0], 2);
    place.join(0, 7, t0, 0, &AVERAGE);
    place.push(0, 7, 0, vec![1.0], &AVERAGE).unwrap();
    assert_eq!(ready(&mut place, 0, 7, t0), None, "group 1 is expected");
    assert_eq!(place.expire(t0 + SECOND * 2, SECOND, &AVERAGE), [1]);
    assert_eq!(ready(&mut place, 0, 7, t0).unwrap(), [1.0]);
    // A pull whose caller went away (a killed job) stops waiting: it drops nobody.
    let mut place = sync(vec![2.0], 2);
    place.join(0, 1, t0, 0, &AVERAGE);
    place.join(1, 2, t0, 0, &AVERAGE);
    place.push(0, 1, 0, vec![1.0], &AVERAGE).unwrap();
    assert_eq!(ready(&mut place, 0, 1, t0), None);
    place.stop_waiting(0, 1);
    assert!(place.expire(t0 + SECOND * 5, SECOND, &AVERAGE).is_empty());
    assert_eq!(place.live(), 2);
}

/// Two places of one server list (A and B), two groups. At B both push round 0 and it
/// applies; A drops group 1 (its job claimed the group again, say) before group 0's push
/// of round 0 reaches A. Group 1's push of round 0 at A is refused and it joins again with
/// `at_least` 1: seated at round 1, not at A's open round 0, it neither holds round 0 up
/// nor counts in it, its pull waits for it, and from then on both groups push the same
/// window as the same round at both places. (Seated at round 0, as without `at_least`, it
/// would push its next window as round 0 at A and round 1 at B, for good.)
#[test]
fn a_group_refused_at_one_place_rejoins_it_at_the_round_after_its_push() {
    let t0 = Instant::now();
    let (mut a, mut b) = (sync(vec![1.0], 2), sync(vec![1.0], 2));
    for place in [&mut a, &mut b] {
        place.join(0, 1, t0, 0, &AVERAGE);
        place.join(1, 2, t0, 0, &AVERAGE);
    }
    b.push(0, 1, 0, vec![0.5], &AVERAGE).unwrap();
    b.push(1, 2, 0, vec![0.25], &AVERAGE).unwrap();
    assert_eq!(b.round, 1);
    assert_eq!(a.leave(1, 2, &AVERAGE).unwrap().live, 1);
    assert_eq!(a.round, 0, "group 0 has not pushed round 0 at A");
    assert!(matches!(a.push(1, 2, 0, vec![0.25], &AVERAGE), Err(Refusal::NotMember(_))));
    let (round, _) = a.join(1, 3, t0, 1, &AVERAGE);
    assert_eq!((round, a.round), (1, 0), "seated after the open round, which goes on");
    assert_eq!(ready(&mut a, 1, 3, t0), None, "its pull waits for round 0");
    a.push(0, 1, 0, vec![0.5], &AVERAGE).unwrap();
    assert_eq!(a.round, 1, "round 0 applied with group 0 alone");
    assert_eq!(ready(&mut a, 1, 3, t0).unwrap(), [0.5]);
    // Round 1: the same windows, as the same round, at both places.
    a.push(0, 1, 1, vec![0.25], &AVERAGE).unwrap();
    a.push(1, 3, 1, vec![0.125], &AVERAGE).unwrap();
    b.push(0, 1, 1, vec![0.25], &AVERAGE).unwrap();
    b.push(1, 2, 1, vec![0.125], &AVERAGE).unwrap();
    assert_eq!((a.round, b.round), (2, 2));
    // A: 0.5 - mean(0.25, 0.125); B: 1 - mean(0.5, 0.25) - mean(0.25, 0.125).
    assert_eq!((ready(&mut a, 0, 1, t0).unwrap(), ready(&mut b, 0, 1, t0).unwrap()), (vec![0.3125], vec![0.4375]));
}

/// A place that restarted from an older checkpoint (round 3) while the groups' other
/// places went on: the first group to join again with `at_least` 7 skips the place to
/// round 7 (no group is in its open round; the weights stay the checkpoint's), the next
/// is seated there too, and round 7 applies once both push it. A group seated a round
/// ahead drops only the group that keeps it waiting in the open round, which is then
/// skipped (nobody is left in it), and a fresh join takes the round after.
#[test]
fn a_restarted_place_skips_to_the_round_its_rejoining_groups_continue_from() {
    let t0 = Instant::now();
    let mut place = Place::new(ReplicaMode::Sync, vec![2.0], ReplicaMode::Sync.fresh_outer(), 3, 2, Precision::Fp32);
    let (round, _) = place.join(0, 1, t0, 7, &AVERAGE);
    assert_eq!((round, place.round), (7, 7));
    assert_eq!(ready(&mut place, 0, 1, t0).unwrap(), [2.0]);
    place.push(0, 1, 7, vec![1.0], &AVERAGE).unwrap();
    assert_eq!(place.join(1, 2, t0, 7, &AVERAGE).0, 7);
    assert_eq!(ready(&mut place, 0, 1, t0), None, "round 7 waits for group 1");
    place.push(1, 2, 7, vec![0.5], &AVERAGE).unwrap();
    assert_eq!((place.round, ready(&mut place, 1, 2, t0).unwrap()), (8, vec![1.25]));
    // Group 1 rejoins one round ahead while group 0 has not pushed round 8: group 1 waits,
    // and only group 0, which keeps it waiting in round 8, is a laggard.
    assert_eq!(place.join(1, 3, t0, 9, &AVERAGE).0, 9);
    assert_eq!(ready(&mut place, 1, 3, t0), None);
    assert_eq!(place.expire(t0 + SECOND * 2, SECOND, &AVERAGE), [0]);
    assert_eq!((place.round, place.live()), (9, 1), "round 8, which nobody is left in, is skipped");
    assert_eq!(ready(&mut place, 1, 3, t0).unwrap(), [1.25], "unmoved");
    assert_eq!(place.join(0, 4, t0 + SECOND * 2, 0, &AVERAGE).0, 9, "a fresh join takes the open round");
    place.push(0, 4, 9, vec![0.25], &AVERAGE).unwrap();
    place.push(1, 3, 9, vec![0.75], &AVERAGE).unwrap();
    assert_eq!((place.round, ready(&mut place, 1, 3, t0).unwrap()), (10, vec![0.75]));
}
