//! The TCP world over loopback, each rank a thread standing in for a process (what a rank
//! sends and receives is the same bytes either way): results equal the threads backend's
//! bit for bit, and the rendezvous's failures name the rank or key at fault.

use std::net::{TcpListener, TcpStream};
use std::sync::Arc;
use std::time::{Duration, Instant};

use zerotrain_precision::{BufMut, BufRef, FlatBuf, Precision};

use super::secret::{self, JobSecret};
use super::wire::{Opening, read_frame, write_frame};
use super::{Join, join, serve};
use crate::ZeroError;
use crate::collective::nccl::{ID_BYTES, share_id};
use crate::collective::{Collective, ReduceOp, ThreadWorld};

/// The secret the tests' jobs share.
fn job() -> JobSecret {
    JobSecret::new("the-tests-job-secret-0123456789").unwrap()
}

fn fingerprint(lr: &str) -> Vec<(String, String)> {
    vec![("optimizer.params.lr".into(), lr.into()), ("zero_optimization.stage".into(), "2".into())]
}

/// Runs `body` on every rank of a world of `n` over loopback (rank `r` joining with
/// `prints[r]`), each on a thread of its own; returns each rank's result.
fn world<T: Send>(
    n: usize,
    timeout: Duration,
    prints: Vec<Vec<(String, String)>>,
    body: impl Fn(Arc<dyn Collective>) -> T + Sync,
) -> Vec<Result<T, ZeroError>> {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let joins: Vec<Join> = prints
        .into_iter()
        .enumerate()
        .map(|(rank, fingerprint)| Join {
            rank,
            world_size: n,
            addr: addr.clone(),
            timeout,
            fingerprint,
            secret: job(),
        })
        .collect();
    let mut listener = Some(listener);
    std::thread::scope(|s| {
        let body = &body;
        let handles: Vec<_> = joins
            .into_iter()
            .map(|j| {
                let listener = if j.rank == 0 { listener.take() } else { None };
                s.spawn(move || {
                    let comm = match listener {
                        Some(listener) => serve(listener, &j),
                        None => join(&j),
                    }?;
                    Ok(body(comm))
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// Every collective, on three ranks, against the same calls on thread ranks.
fn collectives(comm: &dyn Collective) -> Result<Vec<FlatBuf>, ZeroError> {
    let (rank, n) = (comm.rank(), comm.world_size());
    let values: Vec<f32> = (0..6).map(|i| 0.1 * (i as f32 + 1.0) * (rank as f32 + 1.3)).collect();
    let mut sum = values.clone();
    comm.all_reduce(BufMut::F32(&mut sum), ReduceOp::Sum)?;
    let mut max = FlatBuf::from_f32(Precision::Bf16, &values);
    comm.all_reduce(max.as_mut(), ReduceOp::Max)?;
    let mut scattered = vec![0.0f32; 6 / n];
    comm.reduce_scatter(BufRef::F32(&values), BufMut::F32(&mut scattered), ReduceOp::Sum)?;
    let mut gathered = vec![0.0f32; 2 * n];
    comm.all_gather(BufRef::F32(&values[..2]), BufMut::F32(&mut gathered))?;
    let mut root = if rank == 1 { values.clone() } else { vec![0.0; 6] };
    comm.broadcast(BufMut::F32(&mut root), 1)?;
    comm.barrier()?;
    // A ring of buffered sends, then the receives.
    comm.send(BufRef::F32(&values[..3]), (rank + 1) % n)?;
    let mut got = vec![0.0f32; 3];
    comm.recv(BufMut::F32(&mut got), (rank + n - 1) % n)?;
    // The odd and even ranks in groups of their own, the key reversing their order.
    let group = comm.split(rank % 2, n - rank)?;
    let mut in_group = vec![rank as f32 + 0.25];
    group.all_reduce(BufMut::F32(&mut in_group), ReduceOp::Sum)?;
    let place = vec![group.rank() as f32, group.world_size() as f32];
    // Uneven parts: rank r sends rank j (r + j) % 3 elements, none for some pairs.
    let counts: Vec<usize> = (0..n).map(|j| (rank + j) % 3).collect();
    let parts: Vec<f32> = (0..counts.iter().sum::<usize>()).map(|k| values[k % 6] + k as f32).collect();
    let (exchanged, _) = crate::collective::exchange(comm, BufRef::F32(&parts), &counts)?;
    Ok([sum, scattered, gathered, root, got, in_group, place]
        .into_iter()
        .map(FlatBuf::F32)
        .chain([max, exchanged])
        .collect())
}

#[test]
fn three_processes_get_what_three_thread_ranks_get_bit_for_bit() {
    let timeout = Duration::from_secs(60);
    let tcp = world(3, timeout, vec![fingerprint("0.1"); 3], |comm| {
        let results = collectives(&*comm);
        (results, comm.stats())
    });
    let threads = ThreadWorld::new(3, timeout);
    let expected: Vec<_> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..3)
            .map(|r| {
                let comm = threads.communicator(r);
                s.spawn(move || (collectives(&comm), comm.stats()))
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (rank, (got, want)) in tcp.into_iter().zip(expected).enumerate() {
        let (got, stats) = got.unwrap();
        assert_eq!(got.unwrap(), want.0.unwrap(), "rank {rank}");
        // Bytes counted under the same convention as the threads backend's.
        assert_eq!(stats, want.1, "rank {rank}");
    }
}

#[test]
fn nccl_s_unique_id_reaches_every_process() {
    let made: [u8; ID_BYTES] = std::array::from_fn(|i| (i * 53 + 7) as u8);
    let ids = world(2, Duration::from_secs(60), vec![fingerprint("0.1"); 2], |comm| share_id(&*comm, || Ok(made)));
    for id in ids {
        assert_eq!(id.unwrap().unwrap(), made);
    }
}

#[test]
fn a_rank_that_never_arrives_fails_the_others_within_the_timeout_naming_it() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let timeout = Duration::from_secs(2);
    let join_as = |rank| Join {
        rank,
        world_size: 3,
        addr: addr.clone(),
        timeout,
        fingerprint: fingerprint("0.1"),
        secret: job(),
    };
    let (zero, one) = std::thread::scope(|s| {
        let zero = s.spawn(|| serve(listener, &join_as(0)).err().unwrap());
        let one = s.spawn(|| join(&join_as(1)).err().unwrap());
        (zero.join().unwrap(), one.join().unwrap())
    });
    for err in [zero, one] {
        let err = err.to_string();
        assert!(err.contains("rank 2 did not arrive at the rendezvous") && err.contains("within 2 s"), "{err}");
    }
}

#[test]
fn a_rank_with_another_config_is_refused_naming_the_key() {
    let prints = vec![fingerprint("0.1"), fingerprint("0.1"), fingerprint("0.01")];
    let results = world(3, Duration::from_secs(60), prints, |_| ());
    for result in results {
        let err = result.err().unwrap().to_string();
        assert!(err.contains("rank 2 does not run rank 0's job"), "{err}");
        assert!(err.contains("`optimizer.params.lr` is 0.1 on rank 0 and 0.01 there"), "{err}");
    }
}

#[test]
fn a_process_that_dies_fails_the_others_naming_its_rank() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let timeout = Duration::from_secs(600);
    let j = |rank| Join {
        rank,
        world_size: 3,
        addr: addr.to_string(),
        timeout,
        fingerprint: fingerprint("0.1"),
        secret: job(),
    };
    let errors = std::thread::scope(|s| {
        let zero = s.spawn(|| {
            let comm = serve(listener, &j(0)).unwrap();
            comm.all_reduce(BufMut::F32(&mut [1.0]), ReduceOp::Sum).err().unwrap()
        });
        let one = s.spawn(|| {
            let comm = join(&j(1)).unwrap();
            comm.all_reduce(BufMut::F32(&mut [1.0]), ReduceOp::Sum).err().unwrap()
        });
        // Rank 2 joins by hand, is welcomed, and its "process" ends without a goodbye.
        let mut stream = TcpStream::connect(addr).unwrap();
        secret::connect(&mut stream, &job(), Instant::now() + Duration::from_secs(10)).unwrap();
        let hello = Opening::Hello { rank: 2, world_size: 3, fingerprint: fingerprint("0.1") };
        write_frame(&mut stream, &hello.encode()).unwrap();
        read_frame(&mut stream, 1 << 20).unwrap();
        drop(stream);
        [zero.join().unwrap(), one.join().unwrap()]
    });
    for err in errors {
        assert!(matches!(&err, ZeroError::Aborted { rank: 2, .. }), "{err}");
        assert!(err.to_string().contains("connection to the rendezvous on rank 0 ended"), "{err}");
    }
    // Through the abort, long before the 600 s timeout.
}

#[test]
fn an_abort_reaches_a_rank_waiting_in_a_collective_and_a_timeout_names_the_late_rank() {
    let results = world(3, Duration::from_secs(2), vec![fingerprint("0.1"); 3], |comm| {
        match comm.rank() {
            // Rank 2 never calls the all-reduce: the others time out naming it.
            2 => None,
            _ => Some(comm.all_reduce(BufMut::F32(&mut [1.0]), ReduceOp::Sum).err().unwrap()),
        }
    });
    // The rank that gives up first aborts the job with its timeout, as thread ranks do.
    for err in results.into_iter().filter_map(|r| r.unwrap()) {
        let timed_out = matches!(&err, ZeroError::Timeout { missing, .. } if missing == &[2]);
        let told = matches!(&err, ZeroError::Aborted { reason, .. } if reason.contains("waiting for rank 2"));
        assert!(timed_out || told, "{err}");
    }
    let results = world(2, Duration::from_secs(600), vec![fingerprint("0.1"); 2], |comm| {
        if comm.rank() == 1 {
            comm.abort("its data loader failed");
            return None;
        }
        Some(comm.barrier().err().unwrap())
    });
    let err = results.into_iter().find_map(|r| r.unwrap()).unwrap();
    assert!(matches!(&err, ZeroError::Aborted { rank: 1, reason } if reason == "its data loader failed"), "{err}");
}

/// One rank of [`a_finished_world_ends_cleanly_with_every_reply_delivered`], as a process
/// of its own: this test binary run again with the rank's place in the environment.
#[test]
#[ignore = "one rank's process of a_finished_world_ends_cleanly_with_every_reply_delivered, which starts it"]
fn one_rank_of_a_world_of_processes() {
    let var = |name: &str| std::env::var(name).unwrap();
    let (rank, addr) = (var("ZT_TEST_RANK").parse().unwrap(), var("ZT_TEST_ADDR"));
    let j = Join {
        rank,
        world_size: 2,
        addr,
        timeout: Duration::from_secs(60),
        fingerprint: fingerprint("0.1"),
        secret: job(),
    };
    let comm = join(&j).unwrap();
    // The last call's reply is large: rank 0's relay is still writing it when rank 0's own
    // call has returned.
    let mut buf = vec![0.5f32; 8 << 20];
    comm.all_reduce(BufMut::F32(&mut buf), ReduceOp::Sum).unwrap();
    assert!(buf.iter().all(|&v| v == 1.0));
    drop(comm);
    // Rank 0's process ends here, as a trainer's does after its last collective.
}

/// A world of two processes that finishes ends with both exiting cleanly: rank 0's process
/// does not end before its relay has written rank 1's last reply and heard its goodbye
/// (rank 1 would take that for rank 0's death). Three worlds, each ending on a 32 MiB
/// all-reduce.
#[test]
fn a_finished_world_ends_cleanly_with_every_reply_delivered() {
    for _ in 0..3 {
        let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let ranks: Vec<_> = (0..2)
            .map(|rank| {
                std::process::Command::new(std::env::current_exe().unwrap())
                    .args(["--exact", "collective::tcp::tests::one_rank_of_a_world_of_processes", "--ignored"])
                    .env("ZT_TEST_RANK", rank.to_string())
                    .env("ZT_TEST_ADDR", format!("127.0.0.1:{port}"))
                    .stdout(std::process::Stdio::piped())
                    .stderr(std::process::Stdio::piped())
                    .spawn()
                    .unwrap()
            })
            .collect();
        for (rank, child) in ranks.into_iter().enumerate() {
            let out = child.wait_with_output().unwrap();
            let said = String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
            assert!(out.status.success() && said.contains("1 passed"), "rank {rank}: {said}");
        }
    }
}
