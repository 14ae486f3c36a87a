//! The job secret, and the handshake that proves it on every connection to the rendezvous.
//!
//! # Note: the handshake
//! Whoever reaches rank 0's port could otherwise join as a missing rank, abort the job or
//! learn the plan's values from a refusal. So every connection (a rank's hello, a split's
//! attach, an abort) opens with a challenge and response keyed by the job's secret, before
//! rank 0 reads anything else from it or answers with anything but the challenge:
//!
//! 1. rank 0 sends `MAGIC` and a fresh random nonce `s` (32 bytes);
//! 2. the connecting rank sends a fresh nonce `c` and `HMAC-SHA256(K, "client" | s | c)`;
//! 3. rank 0 checks the tag in constant time and answers a refusal, or acceptance and
//!    `HMAC-SHA256(K, "server" | c | s)`, which the connecting rank checks in turn: a
//!    process posing as rank 0 without the secret is found out before a rank reads its
//!    first frame.
//!
//! `K` is the secret's bytes. The secret itself never travels, and each tag covers both
//! fresh nonces, so a recorded handshake replays nowhere. Each step has fixed sizes, read
//! against one deadline for the whole handshake (not per read: a peer trickling a byte at
//! a time cannot hold rank 0's thread). What follows the handshake is neither encrypted nor
//! signed: the rendezvous belongs on the cluster's private network.

use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use ring::hmac;
use ring::rand::{SecureRandom, SystemRandom};

use crate::ZeroError;

/// What rank 0 says first: "zerotrain rendezvous, handshake 1".
pub(super) const MAGIC: [u8; 8] = *b"ztrdv\x00\x01\x00";
/// The nonces' and tags' length.
const NONCE: usize = 32;
/// How long a connection has to complete the handshake and say what it wants.
pub(super) const HANDSHAKE_TIME: Duration = Duration::from_secs(10);

/// The variable every rank of a job reads its secret from.
pub const JOB_SECRET_VARIABLE: &str = "ZEROTRAIN_JOB_SECRET";

/// The secret a job's ranks share, which proves a connection to the rendezvous is one of
/// theirs (see the module's note). Its value is never printed, not even by `Debug`.
#[derive(Clone)]
pub struct JobSecret {
    key: hmac::Key,
}

impl std::fmt::Debug for JobSecret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("JobSecret(hidden)")
    }
}

impl JobSecret {
    /// The shortest secret accepted, in bytes.
    pub const MIN_BYTES: usize = 16;

    /// A secret from its text (at least [`MIN_BYTES`](Self::MIN_BYTES) bytes).
    pub fn new(secret: &str) -> Result<Self, ZeroError> {
        if secret.len() < Self::MIN_BYTES {
            return Err(ZeroError::Rendezvous(format!(
                "{JOB_SECRET_VARIABLE} has {} bytes, fewer than the {} a job secret needs (make one with \
                 `openssl rand -hex 32`)",
                secret.len(),
                Self::MIN_BYTES
            )));
        }
        Ok(Self { key: hmac::Key::new(hmac::HMAC_SHA256, secret.as_bytes()) })
    }

    /// The secret in [`JOB_SECRET_VARIABLE`], or `None` where it is not set.
    pub fn from_env() -> Result<Option<Self>, ZeroError> {
        match std::env::var(JOB_SECRET_VARIABLE) {
            Ok(value) => Self::new(&value).map(Some),
            Err(std::env::VarError::NotPresent) => Ok(None),
            Err(std::env::VarError::NotUnicode(_)) => {
                Err(ZeroError::Rendezvous(format!("{JOB_SECRET_VARIABLE} is not UTF-8 text")))
            }
        }
    }

    /// A fresh random secret's text (64 hex digits, from the system's random source), for a
    /// launcher to give its ranks.
    pub fn generate() -> Result<String, ZeroError> {
        let bytes = random::<32>()?;
        Ok(bytes.iter().map(|b| format!("{b:02x}")).collect())
    }

    fn tag(&self, side: &[u8], first: &[u8; NONCE], second: &[u8; NONCE]) -> hmac::Tag {
        let mut context = hmac::Context::with_key(&self.key);
        context.update(side);
        context.update(first);
        context.update(second);
        context.sign()
    }

    fn verify(&self, side: &[u8], first: &[u8; NONCE], second: &[u8; NONCE], tag: &[u8]) -> bool {
        let mut message = Vec::with_capacity(side.len() + 2 * NONCE);
        message.extend_from_slice(side);
        message.extend_from_slice(first);
        message.extend_from_slice(second);
        hmac::verify(&self.key, &message, tag).is_ok()
    }
}

fn random<const N: usize>() -> Result<[u8; N], ZeroError> {
    let mut bytes = [0u8; N];
    SystemRandom::new()
        .fill(&mut bytes)
        .map_err(|_| ZeroError::Rendezvous("the system's random source failed".into()))?;
    Ok(bytes)
}

/// How rank 0's side of a handshake ended.
#[derive(Debug)]
pub(super) enum Refused {
    /// The peer's tag was wrong: it does not hold the job's secret.
    WrongSecret,
    /// The peer went away, sent something else, or ran past the deadline.
    Failed(io::Error),
}

/// Rank 0's side: challenges the connection and checks its answer, by `deadline`.
pub(super) fn accept(stream: &mut TcpStream, secret: &JobSecret, deadline: Instant) -> Result<(), Refused> {
    let server = random::<NONCE>().map_err(|e| Refused::Failed(io::Error::other(e.to_string())))?;
    let mut challenge = MAGIC.to_vec();
    challenge.extend_from_slice(&server);
    write_by(stream, &challenge, deadline).map_err(Refused::Failed)?;
    let mut answer = [0u8; 2 * NONCE];
    read_by(stream, &mut answer, deadline).map_err(Refused::Failed)?;
    let client: [u8; NONCE] = answer[..NONCE].try_into().expect("32 bytes");
    if !secret.verify(b"client", &server, &client, &answer[NONCE..]) {
        let _ = write_by(stream, &[0], deadline);
        return Err(Refused::WrongSecret);
    }
    let mut accepted = vec![1u8];
    accepted.extend_from_slice(secret.tag(b"server", &client, &server).as_ref());
    write_by(stream, &accepted, deadline).map_err(Refused::Failed)
}

/// How a connecting rank's side of a handshake ended.
#[derive(Debug)]
pub(super) enum Unproved {
    /// Rank 0 said the secret is not the job's.
    Refused,
    /// The other end is not a zerotrain rendezvous, or could not prove the secret.
    NotRankZero(String),
    /// The connection failed before the handshake ended (rank 0 may have shed it).
    Failed(io::Error),
}

/// The connecting side: answers rank 0's challenge and checks its proof, by `deadline`.
pub(super) fn connect(stream: &mut TcpStream, secret: &JobSecret, deadline: Instant) -> Result<(), Unproved> {
    let mut magic = [0u8; MAGIC.len()];
    read_by(stream, &mut magic, deadline).map_err(Unproved::Failed)?;
    if magic != MAGIC {
        return Err(Unproved::NotRankZero("it does not speak zerotrain's rendezvous".into()));
    }
    let mut server = [0u8; NONCE];
    read_by(stream, &mut server, deadline).map_err(Unproved::Failed)?;
    let client = random::<NONCE>().map_err(|e| Unproved::Failed(io::Error::other(e.to_string())))?;
    let mut answer = client.to_vec();
    answer.extend_from_slice(secret.tag(b"client", &server, &client).as_ref());
    write_by(stream, &answer, deadline).map_err(Unproved::Failed)?;
    let mut verdict = [0u8; 1];
    read_by(stream, &mut verdict, deadline).map_err(Unproved::Failed)?;
    if verdict[0] != 1 {
        return Err(Unproved::Refused);
    }
    let mut proof = [0u8; NONCE];
    read_by(stream, &mut proof, deadline).map_err(Unproved::Failed)?;
    if !secret.verify(b"server", &client, &server, &proof) {
        return Err(Unproved::NotRankZero("it did not prove the job's secret".into()));
    }
    Ok(())
}

/// The time left until `deadline`, or a timeout error once it has passed.
fn left(deadline: Instant) -> io::Result<Duration> {
    let left = deadline.saturating_duration_since(Instant::now());
    if left.is_zero() {
        return Err(io::Error::new(io::ErrorKind::TimedOut, "the handshake's deadline passed"));
    }
    Ok(left)
}

/// Fills `buf` from `stream` by `deadline`, however the bytes are spread over reads.
pub(super) fn read_by(stream: &mut TcpStream, mut buf: &mut [u8], deadline: Instant) -> io::Result<()> {
    while !buf.is_empty() {
        stream.set_read_timeout(Some(left(deadline)?))?;
        match stream.read(buf) {
            Ok(0) => return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "the connection closed")),
            Ok(n) => buf = &mut buf[n..],
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) if matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut) => {
                return Err(io::Error::new(io::ErrorKind::TimedOut, "the handshake's deadline passed"));
            }
            Err(e) => return Err(e),
        }
    }
    stream.set_read_timeout(None)
}

/// Writes `bytes` to `stream` by `deadline`.
fn write_by(stream: &mut TcpStream, bytes: &[u8], deadline: Instant) -> io::Result<()> {
    stream.set_write_timeout(Some(left(deadline)?))?;
    stream.write_all(bytes)?;
    stream.set_write_timeout(None)
}

#[cfg(test)]
mod tests {
    use std::net::TcpListener;

    use super::*;

    fn pair() -> (TcpStream, TcpStream) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let client = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        (listener.accept().unwrap().0, client)
    }

    fn secret(text: &str) -> JobSecret {
        JobSecret::new(text).unwrap()
    }

    /// The same secret on both sides proves both; a different one is refused by rank 0 and
    /// told so, and a rank 0 that does not hold the connecting rank's secret cannot pass
    /// for it (it never learns a tag it could answer with).
    #[test]
    fn the_handshake_proves_the_secret_both_ways() {
        let deadline = || Instant::now() + Duration::from_secs(10);
        let job = secret("0123456789abcdef-job");
        let (mut server, mut client) = pair();
        let (ours, theirs) = std::thread::scope(|s| {
            let job = &job;
            let zero = s.spawn(move || accept(&mut server, job, deadline()));
            let theirs = connect(&mut client, job, deadline());
            (zero.join().unwrap(), theirs)
        });
        assert!(ours.is_ok() && theirs.is_ok(), "{ours:?} {theirs:?}");

        let (mut server, mut client) = pair();
        let (ours, theirs) = std::thread::scope(|s| {
            let zero = s.spawn(|| accept(&mut server, &job, deadline()));
            let other = secret("0123456789abcdef-other");
            let theirs = connect(&mut client, &other, deadline());
            (zero.join().unwrap(), theirs)
        });
        assert!(matches!(ours, Err(Refused::WrongSecret)), "{ours:?}");
        assert!(matches!(theirs, Err(Unproved::Refused)), "{theirs:?}");

        // A fake rank 0 that accepts any answer but signs with another key.
        let (mut server, mut client) = pair();
        let theirs = std::thread::scope(|s| {
            s.spawn(move || {
                let fake = secret("not-the-job-secret-at-all");
                let mut challenge = MAGIC.to_vec();
                challenge.extend_from_slice(&[7u8; NONCE]);
                server.write_all(&challenge).unwrap();
                let mut answer = [0u8; 2 * NONCE];
                server.read_exact(&mut answer).unwrap();
                let client: [u8; NONCE] = answer[..NONCE].try_into().unwrap();
                let mut accepted = vec![1u8];
                accepted.extend_from_slice(fake.tag(b"server", &client, &[7u8; NONCE]).as_ref());
                server.write_all(&accepted).unwrap();
            });
            connect(&mut client, &job, deadline())
        });
        assert!(matches!(&theirs, Err(Unproved::NotRankZero(why)) if why.contains("did not prove")), "{theirs:?}");
    }

    /// A peer that sends one byte at a time, each within any per-read timeout, still runs
    /// out of the handshake's one deadline.
    #[test]
    fn a_trickling_peer_runs_out_of_the_one_deadline() {
        let (mut server, mut client) = pair();
        let started = Instant::now();
        let deadline = started + Duration::from_millis(600);
        let ours = std::thread::scope(move |s| {
            s.spawn(move || {
                let mut challenge = [0u8; MAGIC.len() + NONCE];
                let _ = client.read_exact(&mut challenge);
                // One byte every 100 ms: 64 bytes would take 6.4 s.
                for _ in 0..2 * NONCE {
                    if client.write_all(&[0]).is_err() {
                        return;
                    }
                    std::thread::sleep(Duration::from_millis(100));
                }
            });
            let ours = accept(&mut server, &job_secret(), deadline);
            // Closed: the trickler's next write fails and it ends.
            drop(server);
            ours
        });
        assert!(matches!(&ours, Err(Refused::Failed(e)) if e.kind() == io::ErrorKind::TimedOut), "{ours:?}");
    }

    fn job_secret() -> JobSecret {
        secret("0123456789abcdef-job")
    }

    #[test]
    fn a_short_secret_is_refused_and_none_is_ever_printed() {
        let err = JobSecret::new("short").unwrap_err().to_string();
        assert!(err.contains("ZEROTRAIN_JOB_SECRET has 5 bytes, fewer than the 16"), "{err}");
        assert!(!err.contains("short"), "{err}");
        let made = JobSecret::generate().unwrap();
        assert_eq!(made.len(), 64);
        assert_ne!(made, JobSecret::generate().unwrap());
        assert_eq!(format!("{:?}", secret(&made)), "JobSecret(hidden)");
    }
}
