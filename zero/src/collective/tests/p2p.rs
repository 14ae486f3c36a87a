//! Point-to-point messages and groups split from a world.

use super::*;

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
    // Rank 1 calls nothing until rank 0's receive has timed out (no race on who times out
    // first), then finds the world aborted.
    let timed_out = std::sync::atomic::AtomicBool::new(false);
    let out = run_world(2, Duration::from_millis(300), |c| {
        let mut buf = [0.0f32; 2];
        if c.rank() == 0 {
            let result = c.recv((&mut buf[..]).into(), 1);
            timed_out.store(true, std::sync::atomic::Ordering::SeqCst);
            result
        } else {
            while !timed_out.load(std::sync::atomic::Ordering::SeqCst) {
                std::thread::yield_now();
            }
            c.barrier()
        }
    });
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
