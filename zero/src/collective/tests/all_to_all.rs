//! The uneven all-to-all against parts laid out by hand, on the threads backend (directly
//! and through a communication thread), with the counts exchanged first.

use super::*;

/// How many elements rank `from` sends rank `to`: uneven, zero for some pairs.
fn count(from: usize, to: usize) -> usize {
    (from * 3 + to * 5) % 4
}

/// Element `k` of what rank `from` sends rank `to`.
fn value(from: usize, to: usize, k: usize) -> f32 {
    (from * 100 + to * 10 + k) as f32 + 0.5
}

/// Rank `me`'s input: its parts for ranks 0..n, packed in rank order.
fn parts(me: usize, n: usize) -> (Vec<f32>, Vec<usize>) {
    let counts: Vec<usize> = (0..n).map(|to| count(me, to)).collect();
    let values = (0..n).flat_map(|to| (0..count(me, to)).map(move |k| value(me, to, k))).collect();
    (values, counts)
}

#[test]
fn uneven_parts_reach_their_ranks_in_rank_order_with_their_counts() {
    for n in 1..=4 {
        for dtype in [Precision::Fp32, Precision::Bf16] {
            for threaded in [false, true] {
                let body = |c: &dyn Collective| {
                    let (values, counts) = parts(c.rank(), n);
                    let input = FlatBuf::from_f32(dtype, &values);
                    (exchange(c, input.as_ref(), &counts).unwrap(), c.stats())
                };
                let out = match threaded {
                    false => run_world(n, T, |c| body(c)),
                    true => {
                        let world = ThreadWorld::new(n, T);
                        std::thread::scope(|s| {
                            let ranks: Vec<_> = (0..n)
                                .map(|r| {
                                    let comm = CommThread::new(world.communicator(r)).unwrap();
                                    s.spawn(move || body(&comm))
                                })
                                .collect();
                            ranks.into_iter().map(|h| h.join().unwrap()).collect()
                        })
                    }
                };
                for (me, ((got, recv_counts), stats)) in out.into_iter().enumerate() {
                    let what = format!("n={n} {dtype:?} threaded={threaded} rank {me}");
                    let want: Vec<f32> =
                        (0..n).flat_map(|from| (0..count(from, me)).map(move |k| value(from, me, k))).collect();
                    assert_eq!(recv_counts, (0..n).map(|from| count(from, me)).collect::<Vec<_>>(), "{what}");
                    assert_eq!(got.dtype(), dtype, "{what}");
                    assert_eq!(got.into_f32(), FlatBuf::from_f32(dtype, &want).into_f32(), "{what}");
                    // Counted as the messages to and from the other ranks.
                    let elem = dtype.bytes_per_elem();
                    let sent: usize = (0..n).filter(|&to| to != me).map(|to| count(me, to)).sum();
                    let received: usize = (0..n).filter(|&from| from != me).map(|from| count(from, me)).sum();
                    assert_eq!(
                        (stats.send.bytes, stats.recv.bytes),
                        ((sent * elem) as u64, (received * elem) as u64),
                        "{what}"
                    );
                }
            }
        }
    }
}

#[test]
fn counts_past_32_bits_arrive_whole() {
    let out = run_world(3, T, |c| {
        let counts: Vec<usize> = (0..3).map(|to| ((to + 1) << 33) | (c.rank() * 7 + to)).collect();
        c.all_to_all_counts(&counts).unwrap()
    });
    for (me, got) in out.into_iter().enumerate() {
        assert_eq!(got, (0..3).map(|from| ((me + 1) << 33) | (from * 7 + me)).collect::<Vec<_>>(), "rank {me}");
    }
}

#[test]
fn bad_counts_are_refused_naming_the_call_and_a_mismatch_fails_without_hanging() {
    let out = run_world(2, T, |c| {
        let input = [1.0f32, 2.0, 3.0];
        let mut output = [0.0f32; 3];
        let short = c.all_to_all(BufRef::F32(&input), &[3], BufMut::F32(&mut output), &[1, 2]);
        let unequal = c.all_to_all(BufRef::F32(&input), &[1, 1], BufMut::F32(&mut output), &[1, 2]);
        let mut bf = FlatBuf::zeros(Precision::Bf16, 3);
        let dtypes = c.all_to_all(BufRef::F32(&input), &[1, 2], bf.as_mut(), &[1, 2]);
        // Rank 0 sends rank 1 two elements, rank 1 sends rank 0 one; each expects the other's.
        let mismatch = c.all_to_all(BufRef::F32(&input), &[1, 2], BufMut::F32(&mut output), &[1, 2]);
        (short.unwrap_err(), unequal.unwrap_err(), dtypes.unwrap_err(), mismatch)
    });
    for (short, unequal, dtypes, _) in &out {
        assert!(short.to_string().contains("1 send counts for 2 ranks"), "{short}");
        assert!(unequal.to_string().contains("do not add up to the buffer's 3 elements"), "{unequal}");
        assert!(dtypes.to_string().contains("all_to_all") && dtypes.to_string().contains("Bf16"), "{dtypes}");
    }
    for (rank, (.., mismatch)) in out.iter().enumerate() {
        assert!(mismatch.is_err(), "rank {rank}: a count mismatch went unnoticed");
    }
}

#[test]
fn a_rank_whose_own_counts_disagree_fails_alone_and_the_others_get_their_parts() {
    let out = run_world(2, T, |c| {
        let input = [1.0f32, 2.0, 3.0];
        // Rank 0 sends itself 1 element but expects 2; rank 1 still gets its part at once.
        let (send, recv, len) = if c.rank() == 0 { ([1, 2], [2, 1], 3) } else { ([1, 1], [2, 1], 2) };
        let mut out = [0.0f32; 3];
        let own = c.all_to_all(BufRef::F32(&input[..len]), &send, BufMut::F32(&mut out), &recv);
        (own, out)
    });
    let err = out[0].0.as_ref().unwrap_err();
    assert!(err.to_string().contains("sends itself 1 elements but expects 2"), "{err}");
    // Rank 1 got rank 0's two elements and kept its own one.
    assert_eq!(out[1].0, Ok(()));
    assert_eq!(out[1].1, [2.0, 3.0, 2.0]);
}

/// An all-to-all of equal parts: a part per rank of one length, the output as long.
#[test]
fn equal_parts_divide_the_buffer_and_fill_the_output() {
    assert_eq!(equal_counts(0, 3, 12, 12).unwrap(), vec![4, 4, 4]);
    assert_eq!(equal_counts(1, 2, 0, 0).unwrap(), vec![0, 0]);
    let err = equal_counts(2, 4, 10, 10).unwrap_err();
    assert!(matches!(err, ZeroError::BadBuffer { rank: 2, op: "all_to_all", .. }), "{err}");
    assert!(err.to_string().contains("10 elements are not 4 equal parts"), "{err}");
    assert!(equal_counts(0, 2, 8, 6).unwrap_err().to_string().contains("output of 6 elements"));
}
