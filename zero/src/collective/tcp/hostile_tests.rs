//! The rendezvous against whoever else reaches its port: strangers without the job's
//! secret, a peer that proved it but asks for absurd lengths, a process posing as rank 0.

use std::io::{ErrorKind, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};

use zerotrain_precision::{BufMut, BufRef, FlatBuf, Precision};

use super::relay::MAX_PENDING;
use super::secret::{self, JobSecret};
use super::wire::{Call, Opening, Reply, read_frame, write_frame};
use super::{Join, join, serve};
use crate::ZeroError;
use crate::collective::{Collective, ReduceOp};

fn job() -> JobSecret {
    JobSecret::new("the-hostile-tests-job-secret").unwrap()
}

fn fingerprint() -> Vec<(String, String)> {
    vec![("model.n_layer".into(), "12".into())]
}

fn join_as(rank: usize, addr: &str, timeout: Duration, secret: JobSecret) -> Join {
    Join { rank, world_size: 2, addr: addr.into(), timeout, fingerprint: fingerprint(), secret }
}

/// Opens a connection and reads until rank 0 closes it: by then rank 0 has done all it
/// will with what was sent. Returns every byte rank 0 sent.
fn send_and_read_to_end(addr: &str, bytes: &[u8]) -> Vec<u8> {
    let mut stream = TcpStream::connect(addr).unwrap();
    stream.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    let _ = stream.write_all(bytes);
    let mut got = Vec::new();
    let _ = stream.read_to_end(&mut got);
    got
}

/// A stranger's abort frame and a stranger's hello (with the plan's key at another value)
/// are dropped unread: the job's collectives go on, and nothing the stranger gets back says
/// anything of the plan.
#[test]
fn a_stranger_can_neither_abort_the_job_nor_learn_its_plan() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let timeout = Duration::from_secs(60);
    let results = std::thread::scope(|s| {
        let zero = s.spawn(|| {
            let comm = serve(listener, &join_as(0, &addr, timeout, job()))?;
            let mut v = [1.0f32];
            comm.all_reduce(BufMut::F32(&mut v), ReduceOp::Sum)?;
            Ok::<_, ZeroError>(v[0])
        });
        let one = s.spawn(|| {
            let comm = join(&join_as(1, &addr, timeout, job()))?;
            // The strangers, once the world has formed and before its first collective.
            let abort = Opening::Abort { rank: 0, reason: "a stranger's words".into() }.encode();
            let mut framed = (abort.len() as u64).to_le_bytes().to_vec();
            framed.extend_from_slice(&abort);
            // As long as a handshake's answer, so that rank 0 judges it at once.
            framed.resize(framed.len().max(64), 0);
            let told = send_and_read_to_end(&addr, &framed);
            let hello =
                Opening::Hello { rank: 1, world_size: 2, fingerprint: vec![("model.n_layer".into(), "1".into())] };
            let mut framed = (hello.encode().len() as u64).to_le_bytes().to_vec();
            framed.extend_from_slice(&hello.encode());
            let told_hello = send_and_read_to_end(&addr, &[vec![0u8; 64], framed].concat());
            for got in [&told, &told_hello] {
                // The challenge (8 + 32 bytes), and a refusal byte where an answer came.
                assert!(got.len() <= 41, "a stranger was told {} bytes", got.len());
                assert!(!String::from_utf8_lossy(got).contains("n_layer"));
            }
            let mut v = [2.0f32];
            comm.all_reduce(BufMut::F32(&mut v), ReduceOp::Sum)?;
            Ok(v[0])
        });
        [zero.join().unwrap(), one.join().unwrap()]
    });
    for result in results {
        assert_eq!(result.unwrap(), 3.0, "the job was not aborted by the stranger");
    }
}

/// A rank given another secret is refused, told so, and named by rank 0's timeout (with
/// the address it came from), never let in.
#[test]
fn a_rank_with_another_secret_is_refused_and_rank_0_says_why_it_did_not_arrive() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let timeout = Duration::from_secs(3);
    let other = JobSecret::new("another-job-s-secret-entirely").unwrap();
    let (zero, one) = std::thread::scope(|s| {
        let zero = s.spawn(|| serve(listener, &join_as(0, &addr, timeout, job())).err().unwrap());
        let one = join(&join_as(1, &addr, timeout, other)).err().unwrap();
        (zero.join().unwrap().to_string(), one.to_string())
    });
    assert!(one.contains("refused this process's ZEROTRAIN_JOB_SECRET"), "{one}");
    assert!(zero.contains("rank 1 did not arrive"), "{zero}");
    assert!(zero.contains("1 connection(s) from 127.0.0.1 did not prove the job's secret"), "{zero}");
    for said in [&zero, &one] {
        assert!(!said.contains("another-job") && !said.contains("hostile-tests"), "a secret was printed: {said}");
    }
}

/// Idle connections past the cap are shed, oldest first, as new ones arrive: 300 strangers
/// that never answer the challenge leave at most the cap open, and the rank that arrives
/// after them joins.
#[test]
fn idle_connections_are_shed_and_do_not_keep_a_rank_out() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let timeout = Duration::from_secs(60);
    std::thread::scope(|s| {
        let zero = s.spawn(|| serve(listener, &join_as(0, &addr, timeout, job())).map(|_| ()));
        let idle: Vec<TcpStream> = (0..300).map(|_| TcpStream::connect(&addr).unwrap()).collect();
        let one = join(&join_as(1, &addr, timeout, job()));
        assert!(one.is_ok(), "{:?}", one.err());
        // Rank 0's communicator, dropped, waits for rank 1's goodbye.
        drop(one);
        zero.join().unwrap().unwrap();
        // Each idle connection got the challenge; the shed ones then the end of the stream.
        let deadline = Instant::now() + Duration::from_secs(20);
        let mut ended = vec![false; idle.len()];
        while ended.iter().filter(|e| !**e).count() > MAX_PENDING {
            assert!(Instant::now() < deadline, "{} idle connections still open", ended.iter().filter(|e| !**e).count());
            for (stream, ended) in idle.iter().zip(&mut ended).filter(|(_, e)| !**e) {
                stream.set_nonblocking(true).unwrap();
                let mut buf = [0u8; 64];
                loop {
                    match (&*stream).read(&mut buf) {
                        Ok(0) => break *ended = true,
                        Ok(_) => continue,
                        Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                        Err(_) => break *ended = true,
                    }
                }
            }
            std::thread::yield_now();
        }
    });
}

/// Forms a world of 2 whose rank 1 is driven by hand (handshake, hello), runs `first` on
/// rank 0's communicator beside it, then sends `call` as rank 1 and returns the reply.
fn reply_to(call: Call, first: impl FnOnce(&dyn Collective) + Send) -> Reply {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let timeout = Duration::from_secs(60);
    std::thread::scope(|s| {
        let zero = s.spawn(|| {
            let comm = serve(listener, &join_as(0, &addr.to_string(), timeout, job())).unwrap();
            first(&*comm);
            // Rank 0 joins the call rank 1 makes; its error, if any, is not under test.
            let mut out = vec![0.0f32; 2];
            let _ = comm.all_gather(BufRef::F32(&[0.0]), BufMut::F32(&mut out));
            comm
        });
        let mut stream = TcpStream::connect(addr).unwrap();
        secret::connect(&mut stream, &job(), Instant::now() + Duration::from_secs(10)).unwrap();
        let hello = Opening::Hello { rank: 1, world_size: 2, fingerprint: fingerprint() };
        write_frame(&mut stream, &hello.encode()).unwrap();
        assert_eq!(Reply::decode(&read_frame(&mut stream, 1 << 20).unwrap()).unwrap(), Reply::Done(None));
        write_frame(&mut stream, &call.encode()).unwrap();
        let reply = Reply::decode(&read_frame(&mut stream, 1 << 20).unwrap()).unwrap();
        write_frame(&mut stream, &Call::Goodbye.encode()).unwrap();
        drop(zero.join().unwrap());
        reply
    })
}

/// A peer that proved the secret still cannot make rank 0 allocate a length it asks for
/// beyond what the call's buffers and the group make: 2^40 elements of a reduce-scatter's
/// or an all-gather's output, or of a receive, are refused naming the length.
#[test]
fn absurd_lengths_from_a_joined_peer_are_refused_before_anything_is_allocated() {
    let huge = 1usize << 40;
    let calls = [
        Call::ReduceScatter { op: ReduceOp::Sum, input: FlatBuf::F32(vec![1.0; 4]), out_len: huge },
        Call::AllGather { input: FlatBuf::F32(vec![1.0]), out_len: huge },
        Call::Recv { from: 0, dtype: Precision::Fp32, len: huge },
    ];
    for call in calls {
        let reply = reply_to(call, |comm| comm.send(BufRef::F32(&[1.0, 2.0, 3.0]), 1).unwrap());
        match reply {
            Reply::Failed(ZeroError::BadBuffer { detail, .. }) => {
                assert!(detail.contains(&format!("asked for {huge} elements")), "{detail}")
            }
            other => panic!("{other:?}"),
        }
    }
}

/// A reader that hands out `len` bytes of a frame that announced far more, and records the
/// largest buffer it was asked to fill.
struct Trickle {
    header: Vec<u8>,
    left: usize,
    largest: usize,
}

impl Read for Trickle {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        if !self.header.is_empty() {
            let n = buf.len().min(self.header.len());
            buf[..n].copy_from_slice(&self.header[..n]);
            self.header.drain(..n);
            return Ok(n);
        }
        self.largest = self.largest.max(buf.len());
        let n = buf.len().min(self.left);
        buf[..n].fill(0);
        self.left -= n;
        Ok(n)
    }
}

/// A frame's buffer grows with its bytes: one announcing 8 GiB that sends 10 bytes and
/// ends is never given more than a first step of buffer.
#[test]
fn a_frame_announcing_gigabytes_costs_what_arrives() {
    let mut reader = Trickle { header: (8u64 << 30).to_le_bytes().to_vec(), left: 10, largest: 0 };
    let err = read_frame(&mut reader, 16 << 30).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::UnexpectedEof);
    assert!(reader.largest <= 64 << 20, "a buffer of {} bytes for 10 that came", reader.largest);
}

/// A process posing as rank 0 that announces a 16 GiB answer, without the secret, is found
/// out before the joining rank reads a frame from it.
#[test]
fn a_rank_never_trusts_a_rank_0_that_cannot_prove_the_secret() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let err = std::thread::scope(|s| {
        s.spawn(move || {
            let (mut stream, _) = listener.accept().unwrap();
            let _ = stream.write_all(&(16u64 << 30).to_le_bytes());
            let mut sink = Vec::new();
            let _ = stream.read_to_end(&mut sink);
        });
        join(&join_as(1, &addr, Duration::from_secs(20), job())).err().unwrap().to_string()
    });
    assert!(err.contains("is not this job's rank 0: it does not speak zerotrain's rendezvous"), "{err}");
}
