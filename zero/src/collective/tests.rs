//! Every collective against a host-computed answer, on the threads backend.

use std::time::{Duration, Instant};

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
    let start = Instant::now();
    let out = run_world(3, Duration::from_secs(600), |c| {
        let len = if c.rank() == 1 { 5 } else { 6 };
        let mut out = vec![0.0; 2];
        c.reduce_scatter((&vec![0.0f32; len]).into(), (&mut out).into(), ReduceOp::Sum)
    });
    assert!(start.elapsed() < Duration::from_secs(10));
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
    let start = Instant::now();
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
    assert!(start.elapsed() < Duration::from_secs(10), "abort must not wait for the timeout");
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

/// Through a communication thread, started requests complete in issue order and give the
/// host answer, blocking calls interleave with them in that same order, and the caller
/// gets control back before a started collective finishes.
#[test]
fn a_comm_thread_runs_requests_in_issue_order_and_returns_at_once() {
    let n = 3;
    let world = ThreadWorld::new(n, T);
    let out: Vec<_> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..n)
            .map(|r| {
                let comm = CommThread::new(world.communicator(r)).unwrap();
                s.spawn(move || {
                    let len = 3 * 1001;
                    // Rank 2 arrives late: the others must get their Pending back at once.
                    if r == 2 {
                        std::thread::sleep(Duration::from_millis(300));
                    }
                    let t = Instant::now();
                    let rs = comm.start(Request::ReduceScatter {
                        input: FlatBuf::F32(input(r, len)),
                        output: FlatBuf::zeros(Precision::Fp32, len / n),
                        op: ReduceOp::Sum,
                    });
                    let mut ag = comm.start(Request::AllGather {
                        input: FlatBuf::F32(vec![r as f32; 2]),
                        output: FlatBuf::zeros(Precision::Fp32, 2 * n),
                    });
                    let issued = t.elapsed();
                    let not_done_yet = r != 2 && !ag.is_done();
                    // A blocking call after them runs after them.
                    let mut flag = [r as f32];
                    comm.all_reduce((&mut flag[..]).into(), ReduceOp::Max).unwrap();
                    let rs = rs.wait().unwrap();
                    let ag = ag.wait().unwrap();
                    (issued, not_done_yet, rs.output, ag.output, flag[0], comm.stats())
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let expected = host_reduce(n, 3 * 1001, ReduceOp::Sum);
    for (r, (issued, not_done_yet, rs, ag, flag, stats)) in out.into_iter().enumerate() {
        assert!(issued < Duration::from_millis(100), "rank {r} waited {issued:?} to issue");
        if r != 2 {
            assert!(not_done_yet, "rank {r}: the all-gather cannot finish before rank 2 arrives");
        }
        assert_eq!(rs, FlatBuf::F32(expected[r * 1001..(r + 1) * 1001].to_vec()));
        assert_eq!(ag, FlatBuf::F32(vec![0.0, 0.0, 1.0, 1.0, 2.0, 2.0]));
        assert_eq!(flag, 2.0);
        assert_eq!((stats.reduce_scatter.calls, stats.all_gather.calls, stats.all_reduce.calls), (1, 1, 1));
    }
}

/// A collective created on the thread (as MPI must be) and a failure to create one.
#[test]
fn a_comm_thread_creates_its_collective_on_its_own_thread() {
    let world = ThreadWorld::new(1, T);
    let comm = world.communicator(0);
    let main = std::thread::current().id();
    let (tx, rx) = std::sync::mpsc::channel();
    let thread = CommThread::spawn("zerotrain-comm-test".into(), move || {
        tx.send(std::thread::current().id()).unwrap();
        Ok(comm)
    })
    .unwrap();
    assert_ne!(rx.recv().unwrap(), main);
    assert_eq!((thread.rank(), thread.world_size()), (0, 1));
    let err = CommThread::spawn::<ThreadComm, _>("t".into(), || Err(ZeroError::MpiInit("no MPI here".into())));
    assert_eq!(err.unwrap_err(), ZeroError::MpiInit("no MPI here".into()));
}

/// An aborted world fails a request that waits inside the thread, from another thread.
#[test]
fn aborting_releases_a_request_waiting_on_the_comm_thread() {
    let world = ThreadWorld::new(2, Duration::from_secs(60));
    let comm = CommThread::new(world.communicator(0)).unwrap();
    let pending = comm.start(Request::AllReduce { buf: FlatBuf::F32(vec![1.0; 4]), op: ReduceOp::Sum });
    let t = Instant::now();
    std::thread::sleep(Duration::from_millis(50));
    comm.abort("rank 0 gives up");
    let err = pending.wait().unwrap_err();
    assert!(matches!(err, ZeroError::Aborted { rank: 0, .. }), "{err}");
    assert!(t.elapsed() < Duration::from_secs(5));
    // Later calls fail the same way, without hanging.
    assert!(comm.barrier().is_err());
}

/// Point-to-point: messages arrive in order, sends never wait for their receives (every
/// rank sends to every other before receiving anything), and bytes count on both sides.
#[test]
fn sends_are_buffered_and_arrive_in_order() {
    for n in 1..=4 {
        let out = run_world(n, T, |c| {
            let r = c.rank();
            for to in (0..n).filter(|&to| to != r) {
                for k in 0..3 {
                    c.send(BufRef::F32(&[r as f32, to as f32, k as f32]), to).unwrap();
                }
            }
            let mut got = Vec::new();
            for from in (0..n).filter(|&from| from != r) {
                for _ in 0..3 {
                    let mut buf = [0.0f32; 3];
                    c.recv((&mut buf[..]).into(), from).unwrap();
                    got.push(buf);
                }
            }
            (got, c.stats())
        });
        for (r, (got, stats)) in out.into_iter().enumerate() {
            let expected: Vec<[f32; 3]> = (0..n)
                .filter(|&from| from != r)
                .flat_map(|from| (0..3).map(move |k| [from as f32, r as f32, k as f32]))
                .collect();
            assert_eq!(got, expected, "n={n} rank {r}");
            assert_eq!((stats.send.calls, stats.recv.calls), (3 * (n as u64 - 1), 3 * (n as u64 - 1)));
            assert_eq!((stats.send.bytes, stats.recv.bytes), (36 * (n as u64 - 1), 36 * (n as u64 - 1)));
        }
    }
}

/// A receive whose sender never sends times out naming it and aborts the world; a message
/// of another length is an error, not a truncation; a rank out of range is an error.
#[test]
fn a_missing_message_times_out_naming_its_sender() {
    let start = Instant::now();
    let out = run_world(2, Duration::from_millis(300), |c| {
        let mut buf = [0.0f32; 2];
        if c.rank() == 0 {
            c.recv((&mut buf[..]).into(), 1)
        } else {
            // Enters the barrier later than rank 0 its receive, so rank 0 times out first.
            std::thread::sleep(Duration::from_millis(100));
            c.barrier()
        }
    });
    assert!(start.elapsed() < Duration::from_secs(5));
    let err = out[0].as_ref().unwrap_err().to_string();
    assert!(err.contains("recv timed out after 300 ms waiting for rank 1"), "{err}");
    assert!(matches!(out[1], Err(ZeroError::Aborted { rank: 0, .. })), "{:?}", out[1]);

    let out = run_world(2, T, |c| {
        if c.rank() == 0 {
            c.send(BufRef::F32(&[1.0; 3]), 1).and(c.send(BufRef::F32(&[1.0]), 5))
        } else {
            c.recv((&mut [0.0f32; 2][..]).into(), 0)
        }
    });
    assert!(matches!(&out[0], Err(ZeroError::BadBuffer { op: "send", .. })), "{:?}", out[0]);
    let err = out[1].as_ref().unwrap_err().to_string();
    assert!(err.contains("has 3 fp32 elements, the buffer 2 fp32") || err.contains("aborted"), "{err}");
}

/// Groups split from a world: each computes its own collectives with its own ranks
/// (ordered by key), and an abort in the world releases a rank waiting in a group.
#[test]
fn split_groups_reduce_among_their_members_and_share_the_worlds_abort() {
    // Six ranks as two pipeline stages of three: colors by stage, keys reversed.
    let out = run_world(6, T, |c| {
        let stage = c.rank() / 3;
        let group = c.split(stage, 10 - c.rank()).unwrap();
        let mut buf = vec![c.rank() as f32];
        group.all_reduce((&mut buf).into(), ReduceOp::Sum).unwrap();
        let mut gathered = vec![0.0f32; 3];
        group.all_gather(BufRef::F32(&[c.rank() as f32]), (&mut gathered).into()).unwrap();
        (group.rank(), group.world_size(), buf[0], gathered)
    });
    for (r, (rank, size, sum, gathered)) in out.into_iter().enumerate() {
        let stage = r / 3;
        assert_eq!(size, 3);
        assert_eq!(rank, 2 - r % 3, "keys reverse the order");
        assert_eq!(sum, if stage == 0 { 3.0 } else { 12.0 });
        let members: Vec<f32> = (0..3).rev().map(|k| (stage * 3 + k) as f32).collect();
        assert_eq!(gathered, members);
    }

    let start = Instant::now();
    let out = run_world(4, Duration::from_secs(600), |c| {
        let group = c.split(c.rank() % 2, c.rank()).unwrap();
        if c.rank() == 3 {
            std::thread::sleep(Duration::from_millis(50));
            c.abort("rank 3 failed");
            return Err(ZeroError::Aborted { rank: 3, reason: "self".into() });
        }
        // Ranks 1 waits in its group for rank 3, the others in the world.
        if c.rank() == 1 { group.barrier() } else { c.barrier() }
    });
    assert!(start.elapsed() < Duration::from_secs(10));
    for r in [0, 1, 2] {
        assert!(matches!(&out[r], Err(ZeroError::Aborted { rank: 3, .. })), "rank {r}: {:?}", out[r]);
    }
}

/// Through a communication thread: a group split from it runs on the same thread, and
/// started receives and sends complete like direct ones.
#[test]
fn a_comm_thread_splits_and_passes_messages() {
    let world = ThreadWorld::new(4, T);
    let out: Vec<_> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..4)
            .map(|r| {
                let comm = CommThread::new(world.communicator(r)).unwrap();
                s.spawn(move || {
                    let group = comm.split(r % 2, r).unwrap();
                    let mut sum = [1.0f32];
                    group.all_reduce((&mut sum[..]).into(), ReduceOp::Sum).unwrap();
                    let next = (r + 1) % 4;
                    let previous = (r + 3) % 4;
                    let sent = comm.start(Request::Send { buf: FlatBuf::F32(vec![r as f32; 5]), to: next });
                    let got = comm.start(Request::Recv { buf: FlatBuf::zeros(Precision::Fp32, 5), from: previous });
                    sent.wait().unwrap();
                    (group.rank(), sum[0], got.wait().unwrap().output)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (r, (group_rank, sum, got)) in out.into_iter().enumerate() {
        assert_eq!((group_rank, sum), (r / 2, 2.0));
        assert_eq!(got, FlatBuf::F32(vec![((r + 3) % 4) as f32; 5]));
    }
}
