//! The communication thread: order, hand-off, creation on its own thread, abort.

use super::*;

/// Through a communication thread, started requests complete in issue order and give the
/// host answer, blocking calls interleave with them in that same order, and the caller
/// gets control back before a started collective finishes: rank 2 starts only once ranks
/// 0 and 1 have started both requests and seen the all-gather unfinished, which they could
/// not if starting waited for it (they would never signal, and the world would time out).
#[test]
fn a_comm_thread_runs_requests_in_issue_order_and_returns_at_once() {
    let n = 3;
    let world = ThreadWorld::new(n, T);
    let (issued_tx, issued_rx) = std::sync::mpsc::channel::<usize>();
    let issued_rx = std::sync::Mutex::new(issued_rx);
    let out: Vec<_> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..n)
            .map(|r| {
                let comm = CommThread::new(world.communicator(r)).unwrap();
                let (issued_tx, issued_rx) = (issued_tx.clone(), &issued_rx);
                s.spawn(move || {
                    let len = 3 * 1001;
                    if r == 2 {
                        let rx = issued_rx.lock().unwrap();
                        for _ in 0..2 {
                            rx.recv_timeout(Duration::from_secs(10)).expect("ranks 0 and 1 issued without waiting");
                        }
                    }
                    let rs = comm.start(Request::ReduceScatter {
                        input: FlatBuf::F32(input(r, len)),
                        output: FlatBuf::zeros(Precision::Fp32, len / n),
                        op: ReduceOp::Sum,
                    });
                    let mut ag = comm.start(Request::AllGather {
                        input: FlatBuf::F32(vec![r as f32; 2]),
                        output: FlatBuf::zeros(Precision::Fp32, 2 * n),
                    });
                    let not_done_yet = r != 2 && !ag.is_done();
                    if r != 2 {
                        issued_tx.send(r).unwrap();
                    }
                    // A blocking call after them runs after them.
                    let mut flag = [r as f32];
                    comm.all_reduce((&mut flag[..]).into(), ReduceOp::Max).unwrap();
                    let rs = rs.wait().unwrap();
                    let ag = ag.wait().unwrap();
                    (not_done_yet, rs.output, ag.output, flag[0], comm.stats())
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let expected = host_reduce(n, 3 * 1001, ReduceOp::Sum);
    for (r, (not_done_yet, rs, ag, flag, stats)) in out.into_iter().enumerate() {
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
