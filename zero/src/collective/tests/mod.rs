//! Every collective against a host-computed answer, on the threads backend.

use std::time::Duration;

use zerotrain_precision::half::{bf16, f16};
use zerotrain_precision::{FlatBuf, Precision};

use super::*;

/// Runs `f` on `n` rank threads of a fresh world and returns each rank's result.
fn run_world<T: Send>(n: usize, timeout: Duration, f: impl Fn(&ThreadComm) -> T + Sync) -> Vec<T> {
    let world = ThreadWorld::new(n, timeout);
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..n)
            .map(|r| {
                let comm = world.communicator(r);
                let f = &f;
                s.spawn(move || f(&comm))
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// Rank r's input: distinct, non-integer values so that the summation order matters.
fn input(rank: usize, len: usize) -> Vec<f32> {
    (0..len).map(|i| ((rank * 7919 + i * 31) % 1000) as f32 * 0.013 - 3.1 + rank as f32 * 1e-3).collect()
}

fn host_reduce(n: usize, len: usize, op: ReduceOp) -> Vec<f32> {
    let mut acc = input(0, len);
    for r in 1..n {
        acc.iter_mut().zip(input(r, len)).for_each(|(a, b)| *a = op.apply(*a, b));
    }
    acc
}

const LENGTHS: [usize; 6] = [0, 1, 5, 7, 2049, 10_007];
const T: Duration = Duration::from_secs(20);

#[test]
fn all_reduce_matches_host_bitwise_and_counts_bus_bytes() {
    for n in 1..=5 {
        for len in LENGTHS {
            for op in [ReduceOp::Sum, ReduceOp::Max, ReduceOp::Min] {
                let out = run_world(n, T, |c| {
                    let mut buf = input(c.rank(), len);
                    c.all_reduce((&mut buf).into(), op).unwrap();
                    (buf, c.stats())
                });
                let expected = host_reduce(n, len, op);
                let total: u64 = out.iter().map(|(_, s)| s.all_reduce.bytes).sum();
                assert_eq!(total, (2 * (n - 1) * len * 4) as u64, "n={n} len={len}");
                for (buf, stats) in &out {
                    assert_eq!(buf, &expected, "n={n} len={len} {op:?}");
                    assert_eq!(stats.all_reduce.calls, 1);
                    if len % n == 0 {
                        assert_eq!(stats.all_reduce.bytes, (2 * (n - 1) * len / n * 4) as u64);
                    }
                }
            }
        }
    }
}

#[test]
fn reduce_scatter_matches_host_and_counts_bus_bytes() {
    for n in 1..=5 {
        for chunk in [0, 1, 3, 7, 1001] {
            let out = run_world(n, T, |c| {
                let mut shard = vec![f32::NAN; chunk];
                c.reduce_scatter((&input(c.rank(), chunk * n)).into(), (&mut shard).into(), ReduceOp::Sum).unwrap();
                (shard, c.stats())
            });
            let expected = host_reduce(n, chunk * n, ReduceOp::Sum);
            for (rank, (shard, stats)) in out.iter().enumerate() {
                assert_eq!(shard[..], expected[rank * chunk..(rank + 1) * chunk], "n={n} chunk={chunk}");
                assert_eq!(stats.reduce_scatter.bytes, ((n - 1) * chunk * 4) as u64);
            }
        }
    }
}

#[test]
fn all_gather_concatenates_in_rank_order_and_counts_bus_bytes() {
    for n in 1..=5 {
        for chunk in [0, 1, 3, 7, 1001] {
            let out = run_world(n, T, |c| {
                let mut full = vec![f32::NAN; chunk * n];
                c.all_gather((&input(c.rank(), chunk)).into(), (&mut full).into()).unwrap();
                (full, c.stats())
            });
            let expected: Vec<f32> = (0..n).flat_map(|r| input(r, chunk)).collect();
            for (full, stats) in &out {
                assert_eq!(full, &expected);
                assert_eq!(stats.all_gather.bytes, ((n - 1) * chunk * 4) as u64);
            }
        }
    }
}

#[test]
fn broadcast_copies_root_to_every_rank() {
    for n in 1..=5 {
        for root in 0..n {
            let out = run_world(n, T, |c| {
                let mut buf = input(c.rank(), 13);
                c.broadcast((&mut buf).into(), root).unwrap();
                c.barrier().unwrap();
                (buf, c.stats())
            });
            for (rank, (buf, stats)) in out.iter().enumerate() {
                assert_eq!(buf, &input(root, 13));
                assert_eq!(stats.broadcast.bytes, if rank == root { 0 } else { 13 * 4 });
                assert_eq!(stats.barrier_calls, 1);
            }
        }
    }
}

#[test]
fn wrong_lengths_are_errors_not_corruption() {
    let out = run_world(3, T, |c| {
        let mut out = vec![0.0; 2];
        c.reduce_scatter(BufRef::F32(&[0.0; 5]), (&mut out).into(), ReduceOp::Sum)
    });
    assert!(out.iter().all(|r| matches!(r, Err(ZeroError::BadBuffer { op: "reduce_scatter", .. }))));

    // One rank's bad buffer releases the peers already waiting, without the timeout.
    let out = run_world(3, Duration::from_secs(600), |c| {
        let len = if c.rank() == 1 { 5 } else { 6 };
        let mut out = vec![0.0; 2];
        c.reduce_scatter((&vec![0.0f32; len]).into(), (&mut out).into(), ReduceOp::Sum)
    });
    assert!(matches!(&out[1], Err(ZeroError::BadBuffer { rank: 1, .. })), "{:?}", out[1]);
    for r in [&out[0], &out[2]] {
        assert!(matches!(r, Err(ZeroError::Aborted { rank: 1, .. })), "{r:?}");
    }

    // Ranks disagreeing on the length: every rank gets a mismatch, no buffer is touched.
    let out = run_world(2, T, |c| {
        let mut buf = vec![1.0; 3 + c.rank()];
        let r = c.all_reduce((&mut buf).into(), ReduceOp::Sum);
        (r, buf)
    });
    for (r, buf) in out {
        assert!(matches!(r, Err(ZeroError::Mismatch { .. })), "{r:?}");
        assert!(buf.iter().all(|&x| x == 1.0));
    }
}

#[test]
fn an_aborting_rank_releases_every_waiting_rank() {
    let out = run_world(4, Duration::from_secs(600), |c| {
        if c.rank() == 2 {
            std::thread::sleep(Duration::from_millis(50));
            c.abort("rank 2 failed its forward pass");
            return Err(ZeroError::Aborted { rank: 2, reason: "self".into() });
        }
        let mut buf = vec![1.0; 8];
        c.all_reduce((&mut buf).into(), ReduceOp::Sum)?;
        Ok(())
    });
    for (rank, r) in out.iter().enumerate().filter(|(r, _)| *r != 2) {
        match r {
            Err(ZeroError::Aborted { rank: 2, reason }) => assert!(reason.contains("forward pass"), "rank {rank}"),
            other => panic!("rank {rank}: {other:?}"),
        }
    }
}

#[test]
fn a_missing_rank_times_out_and_poisons_the_world() {
    let out = run_world(3, Duration::from_millis(200), |c| {
        if c.rank() == 0 {
            return vec![];
        }
        let first = c.barrier();
        let second = c.barrier();
        vec![first, second]
    });
    // The first waiter to time out aborts the world; everyone else then sees that abort.
    let all: Vec<_> = out[1..].iter().flatten().collect();
    assert_eq!(all.len(), 4);
    let timeouts =
        all.iter().filter(|r| matches!(r, Err(ZeroError::Timeout { op: "barrier", timeout_ms: 200, .. }))).count();
    assert_eq!(timeouts, 1, "{all:?}");
    for r in all {
        match r {
            Err(ZeroError::Timeout { .. }) => {}
            Err(ZeroError::Aborted { reason, .. }) => assert!(reason.contains("timed out after 200 ms")),
            other => panic!("{other:?}"),
        }
    }
}

#[test]
fn convention_bytes_sum_to_ring_volume_for_uneven_all_reduce() {
    for n in 1..=6 {
        for len in [0, 1, 5, 13, 100] {
            let total: u64 = (0..n).map(|r| convention_bytes(OpKind::AllReduce, len, 4, n, r, 0)).sum();
            assert_eq!(total, (2 * (n - 1) * len * 4) as u64);
            let covered: usize = (0..n).map(|r| chunk_range(len, n, r).len()).sum();
            assert_eq!(covered, len);
        }
    }
}

/// Host answer for half precision: widen, combine in rank order in f32, round once.
fn host_reduce_half(n: usize, len: usize, dtype: Precision) -> FlatBuf {
    let widened: Vec<Vec<f32>> = (0..n).map(|r| FlatBuf::from_f32(dtype, &input(r, len)).into_f32()).collect();
    let sum: Vec<f32> = (0..len).map(|i| widened.iter().skip(1).fold(widened[0][i], |a, w| a + w[i])).collect();
    FlatBuf::from_f32(dtype, &sum)
}

#[test]
fn half_precision_reduces_in_f32_rounds_once_and_moves_half_the_bytes() {
    for dtype in [Precision::Fp16, Precision::Bf16] {
        for n in [2, 3, 5] {
            let len = 1003 * n;
            let out = run_world(n, T, |c| {
                let mut buf = FlatBuf::from_f32(dtype, &input(c.rank(), len));
                c.all_reduce(buf.as_mut(), ReduceOp::Sum).unwrap();
                let src = FlatBuf::from_f32(dtype, &input(c.rank(), len));
                let mut shard = FlatBuf::zeros(dtype, len / n);
                c.reduce_scatter(src.as_ref(), shard.as_mut(), ReduceOp::Sum).unwrap();
                let mut full = FlatBuf::zeros(dtype, len);
                c.all_gather(shard.as_ref(), full.as_mut()).unwrap();
                (buf, full, c.stats())
            });
            let expected = host_reduce_half(n, len, dtype);
            for (rank, (reduced, gathered, stats)) in out.iter().enumerate() {
                assert_eq!(reduced, &expected, "{dtype} n={n} rank {rank}");
                assert_eq!(gathered, &expected, "{dtype} n={n} rank {rank}");
                let f32_bytes = convention_bytes(OpKind::AllReduce, len, 4, n, rank, 0);
                assert_eq!(2 * stats.all_reduce.bytes, f32_bytes);
                assert_eq!(2 * stats.reduce_scatter.bytes, ((n - 1) * len / n * 4) as u64);
            }
        }
    }
}

#[test]
fn dtypes_must_agree_across_ranks_and_between_input_and_output() {
    let out = run_world(2, T, |c| {
        let mut buf =
            if c.rank() == 0 { FlatBuf::zeros(Precision::Fp16, 4) } else { FlatBuf::zeros(Precision::Bf16, 4) };
        c.all_reduce(buf.as_mut(), ReduceOp::Sum)
    });
    for r in &out {
        assert!(
            matches!(r, Err(ZeroError::Mismatch { detail, .. }) if detail.contains("fp16") && detail.contains("bf16")),
            "{r:?}"
        );
    }
    let out = run_world(1, T, |c| {
        let input = [f16::ONE; 2];
        let mut output = [bf16::ZERO; 2];
        c.reduce_scatter(BufRef::F16(&input), BufMut::Bf16(&mut output), ReduceOp::Sum)
    });
    assert!(
        matches!(&out[0], Err(ZeroError::BadBuffer { detail, .. }) if detail == "input is fp16, output is bf16"),
        "{:?}",
        out[0]
    );
}

/// Regression: a rank returning from a `barrier()` could publish its next collective before a
/// slower rank had read the barrier's slots, which then saw a spurious mismatch (found by
/// `zerotrain bench collectives`).
#[test]
fn a_barrier_followed_at_once_by_another_collective_is_not_a_mismatch() {
    for n in [2, 3, 4] {
        let out = run_world(n, T, |c| -> Result<(), ZeroError> {
            let mut full = vec![1.0f32; 8 * n];
            let mut shard = vec![0.0f32; 8];
            for _ in 0..2000 {
                c.barrier()?;
                c.reduce_scatter((&full).into(), (&mut shard).into(), ReduceOp::Sum)?;
                c.barrier()?;
                c.all_gather((&shard).into(), (&mut full).into())?;
            }
            Ok(())
        });
        assert!(out.iter().all(Result::is_ok), "{out:?}");
    }
}

mod all_to_all;
mod comm_thread;
mod p2p;
