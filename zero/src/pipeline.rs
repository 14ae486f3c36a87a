//! Pipeline parallelism's pure parts: where the ranks sit ([`Topology`]), which contiguous
//! units each stage holds ([`partition`]), and in what order each stage runs its
//! micro-batches' forward and backward passes ([`schedule`]).
//!
//! # Note: the topology
//! `N = K x D` ranks form `K` pipeline stages of `D` data-parallel ranks each, as
//! DeepSpeed's `PipeDataParallelTopology` orders them: rank `r` is stage `r / D`, data
//! index `r % D`. The `D` ranks of a stage shard that stage's units between them (ZeRO);
//! the `K` ranks with one data index form one pipeline, passing activations forward and
//! gradients back.
//!
//! # Note: schedules
//! GPipe runs every micro-batch's forward, then every backward (the last micro-batch
//! first), so a stage holds all `M` micro-batches' activations. 1F1B (PipeDream-flush)
//! starts `K - s - 1` forwards on stage `s`, then alternates one forward and one backward,
//! then drains the backwards: the same bubble, `(K - 1) / (M + K - 1)` of the time when
//! every stage takes as long, with at most `K - s` micro-batches in flight on stage `s`.
//! Both end with a flush: every stage steps its optimizer after its last backward.

use std::ops::Range;

use crate::ZeroError;

/// Where a rank sits: its stage and its index among the stage's data-parallel ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Topology {
    /// Pipeline stages `K`.
    pub stages: usize,
    /// Data-parallel ranks per stage `D`.
    pub data_parallel: usize,
}

impl Topology {
    /// `world_size` ranks in `stages` stages; an error unless `stages` divides it.
    pub fn new(world_size: usize, stages: usize) -> Result<Self, ZeroError> {
        if stages == 0 || world_size == 0 || !world_size.is_multiple_of(stages) {
            return Err(ZeroError::InvalidLayout(format!(
                "{world_size} ranks cannot form {stages} pipeline stages of equal size"
            )));
        }
        Ok(Self { stages, data_parallel: world_size / stages })
    }

    /// The stage of `rank`.
    pub fn stage(&self, rank: usize) -> usize {
        rank / self.data_parallel
    }

    /// The data-parallel index of `rank` within its stage.
    pub fn data_index(&self, rank: usize) -> usize {
        rank % self.data_parallel
    }

    /// The rank at `stage` and data index `data_index`.
    pub fn rank(&self, stage: usize, data_index: usize) -> usize {
        stage * self.data_parallel + data_index
    }
}

/// How units are divided between the stages (DeepSpeed's `partition_method`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum PartitionMethod {
    /// As many units per stage as possible (the first stages get one more).
    Uniform,
    /// Contiguous runs of units whose largest parameter count is as small as possible.
    Parameters,
}

/// The contiguous runs of units (by index) each of `stages` stages holds, for units of
/// `weights` parameters each. Every stage gets at least one unit.
pub fn partition(weights: &[u64], stages: usize, method: PartitionMethod) -> Result<Vec<Range<usize>>, ZeroError> {
    let n = weights.len();
    if stages == 0 || stages > n {
        return Err(ZeroError::InvalidLayout(format!("{n} units cannot fill {stages} pipeline stages")));
    }
    let counts: Vec<usize> = match method {
        PartitionMethod::Uniform => (0..stages).map(|s| n / stages + usize::from(s < n % stages)).collect(),
        PartitionMethod::Parameters => balanced_counts(weights, stages),
    };
    let mut start = 0;
    Ok(counts
        .into_iter()
        .map(|count| {
            start += count;
            start - count..start
        })
        .collect())
}

/// Unit counts per stage minimising the largest stage's weight: the smallest feasible
/// bound by binary search, then cut greedily (each stage takes units while it stays within
/// the bound and enough units remain for the stages after it).
fn balanced_counts(weights: &[u64], stages: usize) -> Vec<usize> {
    let fits = |bound: u64| greedy_counts(weights, stages, bound).is_some();
    let (mut low, mut high) = (weights.iter().copied().max().unwrap_or(0), weights.iter().sum::<u64>());
    while low < high {
        let mid = low + (high - low) / 2;
        if fits(mid) { high = mid } else { low = mid + 1 }
    }
    greedy_counts(weights, stages, low).expect("the total always fits")
}

/// Each stage in turn takes units while it stays within `bound` and leaves one unit for
/// each stage after it; `None` if the units do not fit.
fn greedy_counts(weights: &[u64], stages: usize, bound: u64) -> Option<Vec<usize>> {
    let mut counts = Vec::with_capacity(stages);
    let mut next = 0;
    for stage in 0..stages {
        let available = weights.len() - next - (stages - stage - 1);
        let (mut sum, mut count) = (0u64, 0usize);
        while count < available && sum + weights[next + count] <= bound {
            sum += weights[next + count];
            count += 1;
        }
        if count == 0 {
            return None;
        }
        counts.push(count);
        next += count;
    }
    (next == weights.len()).then_some(counts)
}

/// A pipeline schedule (zerotrain's `schedule` key).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ScheduleKind {
    /// All forwards, then all backwards.
    #[serde(rename = "gpipe")]
    GPipe,
    /// One forward, one backward (PipeDream-flush).
    #[serde(rename = "1f1b")]
    OneFOneB,
}

/// One step of a stage's work: micro-batch `m`'s forward or backward pass.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Work {
    /// The forward pass of micro-batch `m`.
    Forward(usize),
    /// The backward pass of micro-batch `m`.
    Backward(usize),
}

/// Stage `stage`'s work, in order, for `micro_batches` micro-batches on `stages` stages.
pub fn schedule(kind: ScheduleKind, stage: usize, stages: usize, micro_batches: usize) -> Vec<Work> {
    let m = micro_batches;
    match kind {
        ScheduleKind::GPipe => (0..m).map(Work::Forward).chain((0..m).rev().map(Work::Backward)).collect(),
        ScheduleKind::OneFOneB => {
            let warmup = (stages - stage - 1).min(m);
            let mut work: Vec<Work> = (0..warmup).map(Work::Forward).collect();
            for i in 0..m - warmup {
                work.push(Work::Forward(warmup + i));
                work.push(Work::Backward(i));
            }
            work.extend((m - warmup..m).map(Work::Backward));
            work
        }
    }
}

/// GPipe's bubble: the fraction of a step each stage idles when every stage takes as long,
/// `(K - 1) / (M + K - 1)`.
pub fn bubble_fraction(stages: usize, micro_batches: usize) -> f64 {
    (stages - 1) as f64 / (micro_batches + stages - 1) as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs every stage's schedule with unit-time forwards and `backward`-time backwards,
    /// each waiting for its inputs (the previous stage's forward, the next stage's
    /// backward), and returns each stage's idle fraction of the whole span, and the most
    /// micro-batches each stage held at once. Panics on a deadlock.
    fn simulate(kind: ScheduleKind, stages: usize, m: usize, backward: u64) -> (Vec<f64>, Vec<usize>) {
        let work: Vec<Vec<Work>> = (0..stages).map(|s| schedule(kind, s, stages, m)).collect();
        let mut done = std::collections::HashMap::<(usize, Work), u64>::new();
        let (mut next, mut clock) = (vec![0usize; stages], vec![0u64; stages]);
        let (mut held, mut most) = (vec![0usize; stages], vec![0usize; stages]);
        while next.iter().zip(&work).any(|(n, w)| *n < w.len()) {
            let mut progressed = false;
            for s in 0..stages {
                let Some(&item) = work[s].get(next[s]) else { continue };
                let ready = match item {
                    Work::Forward(i) if s > 0 => done.get(&(s - 1, Work::Forward(i))).copied(),
                    Work::Backward(i) if s + 1 < stages => done.get(&(s + 1, Work::Backward(i))).copied(),
                    _ => Some(0),
                };
                let Some(ready) = ready else { continue };
                let cost = if matches!(item, Work::Forward(_)) { 1 } else { backward };
                clock[s] = clock[s].max(ready) + cost;
                done.insert((s, item), clock[s]);
                next[s] += 1;
                progressed = true;
                if matches!(item, Work::Forward(_)) {
                    held[s] += 1
                } else {
                    held[s] -= 1
                }
                most[s] = most[s].max(held[s]);
            }
            assert!(progressed, "{kind:?} K={stages} M={m} deadlocks");
        }
        let span = *clock.iter().max().unwrap();
        let busy = m as u64 * (1 + backward);
        ((0..stages).map(|_| (span - busy) as f64 / span as f64).collect(), most)
    }

    #[test]
    fn schedules_run_every_pass_once_in_dependency_order_with_gpipes_bubble() {
        for kind in [ScheduleKind::GPipe, ScheduleKind::OneFOneB] {
            for stages in 1..=5 {
                for m in 1..=9 {
                    for s in 0..stages {
                        let work = schedule(kind, s, stages, m);
                        assert_eq!(work.len(), 2 * m);
                        for i in 0..m {
                            let f = work.iter().position(|w| *w == Work::Forward(i)).unwrap();
                            let b = work.iter().position(|w| *w == Work::Backward(i)).unwrap();
                            assert!(f < b, "{kind:?} stage {s}: backward {i} before its forward");
                        }
                    }
                    let (idle, most) = simulate(kind, stages, m, 2);
                    for (s, fraction) in idle.iter().enumerate() {
                        let formula = bubble_fraction(stages, m);
                        assert!(
                            (fraction - formula).abs() < 1e-9,
                            "{kind:?} K={stages} M={m} stage {s}: {fraction} vs {formula}"
                        );
                        let bound = if kind == ScheduleKind::GPipe { m } else { (stages - s).min(m) };
                        assert_eq!(most[s], bound, "{kind:?} K={stages} M={m} stage {s}");
                    }
                }
            }
        }
    }

    #[test]
    fn partitions_are_contiguous_cover_every_unit_and_balance_parameters() {
        let weights = [10, 1, 1, 1, 10, 1, 1, 1, 10, 30];
        assert_eq!(partition(&weights, 3, PartitionMethod::Uniform).unwrap(), vec![0..4, 4..7, 7..10]);
        let balanced = partition(&weights, 3, PartitionMethod::Parameters).unwrap();
        let sums: Vec<u64> = balanced.iter().map(|r| weights[r.clone()].iter().sum()).collect();
        assert_eq!(*sums.iter().max().unwrap(), 30, "{balanced:?} {sums:?}");
        // Exhaustive on small cases: the balanced maximum is the true optimum.
        let mut state = 0x9E37_79B9_7F4A_7C15u64;
        for _ in 0..400 {
            state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            let n = 1 + (state >> 33) as usize % 7;
            let weights: Vec<u64> = (0..n).map(|i| 1 + (state >> (i * 4)) % 13).collect();
            for stages in 1..=n {
                for method in [PartitionMethod::Uniform, PartitionMethod::Parameters] {
                    let parts = partition(&weights, stages, method).unwrap();
                    assert_eq!(parts.len(), stages);
                    assert_eq!(parts[0].start, 0);
                    assert_eq!(parts.last().unwrap().end, n);
                    assert!(parts.windows(2).all(|w| w[0].end == w[1].start) && parts.iter().all(|r| !r.is_empty()));
                }
                let best = partition(&weights, stages, PartitionMethod::Parameters).unwrap();
                let max = |parts: &[Range<usize>]| {
                    parts.iter().map(|r| weights[r.clone()].iter().sum::<u64>()).max().unwrap()
                };
                assert_eq!(max(&best), optimum(&weights, stages), "{weights:?} into {stages}");
            }
        }
        assert!(partition(&[1, 2], 3, PartitionMethod::Uniform).is_err());
    }

    /// The least possible largest stage, by trying every cut.
    fn optimum(weights: &[u64], stages: usize) -> u64 {
        if stages == 1 {
            return weights.iter().sum();
        }
        (1..=weights.len() - (stages - 1))
            .map(|first| weights[..first].iter().sum::<u64>().max(optimum(&weights[first..], stages - 1)))
            .min()
            .unwrap()
    }

    #[test]
    fn the_topology_orders_ranks_by_stage_then_data_index() {
        let t = Topology::new(6, 3).unwrap();
        assert_eq!(t.data_parallel, 2);
        assert_eq!((t.stage(5), t.data_index(5), t.rank(2, 1)), (2, 1, 5));
        assert!(Topology::new(6, 4).is_err());
    }
}
