//! What travels between a rank and the relay, after the handshake ([`super::secret`]):
//! length-prefixed frames of a small binary encoding (little-endian integers,
//! length-prefixed strings and buffers). A frame longer than its context allows is refused
//! before anything is allocated for it, and a frame's buffer grows with the bytes that
//! arrive, so a length prefix alone allocates nothing.

use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::time::Instant;

use zerotrain_precision::{BufRef, FlatBuf, Precision};

use super::secret::read_by;
use crate::ZeroError;
use crate::collective::{OpKind, ReduceOp};

/// The longest opening (hello, attach, abort) a connection may send: its fingerprint is a
/// config's keys, well under this.
pub(super) const MAX_OPENING: u64 = 4 << 20;
/// The longest call or reply: the host relay carries control messages and what stays on
/// the host (NCCL's ids, pipeline activations), far below this.
pub(super) const MAX_CALL: u64 = 16 << 30;

/// Writes one frame.
pub(super) fn write_frame(stream: &mut impl Write, payload: &[u8]) -> io::Result<()> {
    stream.write_all(&(payload.len() as u64).to_le_bytes())?;
    stream.write_all(payload)?;
    stream.flush()
}

/// Reads one frame of at most `max` bytes. Memory follows the bytes that arrive, not the
/// length announced: a frame that announces gigabytes and sends a few costs a few.
pub(super) fn read_frame(stream: &mut impl Read, max: u64) -> io::Result<Vec<u8>> {
    let mut len = [0u8; 8];
    stream.read_exact(&mut len)?;
    read_payload(stream, u64::from_le_bytes(len), max)
}

/// [`read_frame`] by `deadline` (the whole frame, however it is spread over reads).
pub(super) fn read_frame_by(stream: &mut TcpStream, max: u64, deadline: Instant) -> io::Result<Vec<u8>> {
    let mut len = [0u8; 8];
    read_by(stream, &mut len, deadline)?;
    let len = checked_len(u64::from_le_bytes(len), max)?;
    let mut payload = vec![0u8; len];
    read_by(stream, &mut payload, deadline)?;
    Ok(payload)
}

/// Bytes read into a frame at a time past the first: a frame's buffer grows by this much
/// once its bytes are there.
const GROWTH: usize = 64 << 20;

fn read_payload(stream: &mut impl Read, len: u64, max: u64) -> io::Result<Vec<u8>> {
    let len = checked_len(len, max)?;
    let mut payload = Vec::new();
    while payload.len() < len {
        let at = payload.len();
        let more = (len - at).min(GROWTH);
        payload.resize(at + more, 0);
        stream.read_exact(&mut payload[at..])?;
    }
    Ok(payload)
}

fn checked_len(len: u64, max: u64) -> io::Result<usize> {
    if len > max {
        return Err(io::Error::new(io::ErrorKind::InvalidData, format!("a frame of {len} bytes (at most {max})")));
    }
    usize::try_from(len).map_err(|_| io::Error::new(io::ErrorKind::InvalidData, "a frame past this machine's word"))
}

/// Builds a payload.
#[derive(Default)]
pub(super) struct Writer(pub(super) Vec<u8>);

impl Writer {
    pub(super) fn u8(&mut self, v: u8) -> &mut Self {
        self.0.push(v);
        self
    }

    pub(super) fn u64(&mut self, v: u64) -> &mut Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }

    pub(super) fn str(&mut self, v: &str) -> &mut Self {
        self.u64(v.len() as u64);
        self.0.extend_from_slice(v.as_bytes());
        self
    }

    pub(super) fn buf(&mut self, v: BufRef<'_>) -> &mut Self {
        let dtype = v.dtype();
        self.u8(dtype_tag(dtype)).u64(v.len() as u64);
        let at = self.0.len();
        self.0.resize(at + v.len() * dtype.bytes_per_elem(), 0);
        v.write_le_bytes(&mut self.0[at..]);
        self
    }
}

/// Reads a payload; every read checks the bytes are there.
pub(super) struct Reader<'a> {
    bytes: &'a [u8],
}

impl<'a> Reader<'a> {
    pub(super) fn new(bytes: &'a [u8]) -> Self {
        Self { bytes }
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], String> {
        if self.bytes.len() < n {
            return Err(format!("a message ends {} bytes early", n - self.bytes.len()));
        }
        let (head, rest) = self.bytes.split_at(n);
        self.bytes = rest;
        Ok(head)
    }

    pub(super) fn u8(&mut self) -> Result<u8, String> {
        Ok(self.take(1)?[0])
    }

    pub(super) fn u64(&mut self) -> Result<u64, String> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into().expect("8 bytes")))
    }

    pub(super) fn usize(&mut self) -> Result<usize, String> {
        usize::try_from(self.u64()?).map_err(|_| "a count past this machine's word".to_string())
    }

    pub(super) fn str(&mut self) -> Result<String, String> {
        let n = self.usize()?;
        String::from_utf8(self.take(n)?.to_vec()).map_err(|_| "a string that is not UTF-8".to_string())
    }

    pub(super) fn dtype(&mut self) -> Result<Precision, String> {
        match self.u8()? {
            0 => Ok(Precision::Fp32),
            1 => Ok(Precision::Fp16),
            2 => Ok(Precision::Bf16),
            other => Err(format!("unknown dtype tag {other}")),
        }
    }

    pub(super) fn buf(&mut self) -> Result<FlatBuf, String> {
        let dtype = self.dtype()?;
        let len = self.usize()?;
        let bytes = self.take(len.checked_mul(dtype.bytes_per_elem()).ok_or("a buffer past this machine's word")?)?;
        let mut buf = FlatBuf::zeros(dtype, len);
        dtype.read_le_bytes(bytes, buf.as_mut());
        Ok(buf)
    }
}

fn dtype_tag(dtype: Precision) -> u8 {
    match dtype {
        Precision::Fp32 => 0,
        Precision::Fp16 => 1,
        Precision::Bf16 => 2,
    }
}

fn op_tag(op: ReduceOp) -> u8 {
    match op {
        ReduceOp::Sum => 0,
        ReduceOp::Max => 1,
        ReduceOp::Min => 2,
    }
}

fn op_of(tag: u8) -> Result<ReduceOp, String> {
    match tag {
        0 => Ok(ReduceOp::Sum),
        1 => Ok(ReduceOp::Max),
        2 => Ok(ReduceOp::Min),
        other => Err(format!("unknown reduction tag {other}")),
    }
}

/// What a connection says first.
#[derive(Debug, PartialEq)]
pub(super) enum Opening {
    /// A rank joins the world: its place and its fingerprint (key, value pairs).
    Hello { rank: usize, world_size: usize, fingerprint: Vec<(String, String)> },
    /// A rank's connection for a communicator split from the world (the relay's id for it).
    Attach { id: u64 },
    /// A rank failed: abort the job.
    Abort { rank: usize, reason: String },
}

impl Opening {
    pub(super) fn encode(&self) -> Vec<u8> {
        let mut w = Writer::default();
        match self {
            Self::Hello { rank, world_size, fingerprint } => {
                w.u8(0).u64(*rank as u64).u64(*world_size as u64).u64(fingerprint.len() as u64);
                for (key, value) in fingerprint {
                    w.str(key).str(value);
                }
            }
            Self::Attach { id } => {
                w.u8(1).u64(*id);
            }
            Self::Abort { rank, reason } => {
                w.u8(2).u64(*rank as u64).str(reason);
            }
        }
        w.0
    }

    pub(super) fn decode(bytes: &[u8]) -> Result<Self, String> {
        let mut r = Reader::new(bytes);
        match r.u8()? {
            0 => {
                let (rank, world_size, n) = (r.usize()?, r.usize()?, r.usize()?);
                let fingerprint = (0..n).map(|_| Ok((r.str()?, r.str()?))).collect::<Result<_, String>>()?;
                Ok(Self::Hello { rank, world_size, fingerprint })
            }
            1 => Ok(Self::Attach { id: r.u64()? }),
            2 => Ok(Self::Abort { rank: r.usize()?, reason: r.str()? }),
            other => Err(format!("unknown opening tag {other}")),
        }
    }
}

/// A collective a rank asks the relay to run for it.
#[derive(Debug, PartialEq)]
pub(super) enum Call {
    AllReduce {
        op: ReduceOp,
        buf: FlatBuf,
    },
    ReduceScatter {
        op: ReduceOp,
        input: FlatBuf,
        out_len: usize,
    },
    AllGather {
        input: FlatBuf,
        out_len: usize,
    },
    Broadcast {
        root: usize,
        buf: FlatBuf,
    },
    Barrier,
    Send {
        to: usize,
        buf: FlatBuf,
    },
    Recv {
        from: usize,
        dtype: Precision,
        len: usize,
    },
    Split {
        color: usize,
        key: usize,
    },
    /// The rank is done with this communicator: its connection closing is not a failure.
    Goodbye,
}

impl Call {
    pub(super) fn encode(&self) -> Vec<u8> {
        let mut w = Writer::default();
        match self {
            Self::AllReduce { op, buf } => w.u8(0).u8(op_tag(*op)).buf(buf.as_ref()),
            Self::ReduceScatter { op, input, out_len } => {
                w.u8(1).u8(op_tag(*op)).buf(input.as_ref()).u64(*out_len as u64)
            }
            Self::AllGather { input, out_len } => w.u8(2).buf(input.as_ref()).u64(*out_len as u64),
            Self::Broadcast { root, buf } => w.u8(3).u64(*root as u64).buf(buf.as_ref()),
            Self::Barrier => w.u8(4),
            Self::Send { to, buf } => w.u8(5).u64(*to as u64).buf(buf.as_ref()),
            Self::Recv { from, dtype, len } => w.u8(6).u64(*from as u64).u8(dtype_tag(*dtype)).u64(*len as u64),
            Self::Split { color, key } => w.u8(7).u64(*color as u64).u64(*key as u64),
            Self::Goodbye => w.u8(8),
        };
        w.0
    }

    pub(super) fn decode(bytes: &[u8]) -> Result<Self, String> {
        let mut r = Reader::new(bytes);
        Ok(match r.u8()? {
            0 => Self::AllReduce { op: op_of(r.u8()?)?, buf: r.buf()? },
            1 => Self::ReduceScatter { op: op_of(r.u8()?)?, input: r.buf()?, out_len: r.usize()? },
            2 => Self::AllGather { input: r.buf()?, out_len: r.usize()? },
            3 => Self::Broadcast { root: r.usize()?, buf: r.buf()? },
            4 => Self::Barrier,
            5 => Self::Send { to: r.usize()?, buf: r.buf()? },
            6 => Self::Recv { from: r.usize()?, dtype: r.dtype()?, len: r.usize()? },
            7 => Self::Split { color: r.usize()?, key: r.usize()? },
            8 => Self::Goodbye,
            other => return Err(format!("unknown call tag {other}")),
        })
    }
}

/// The relay's answer to a call or an opening.
#[derive(Debug, PartialEq)]
pub(super) enum Reply {
    /// Done; the call's result where it has one.
    Done(Option<FlatBuf>),
    /// A split's communicator: the relay's id for it, this rank's place and its size.
    Split {
        id: u64,
        rank: usize,
        size: usize,
    },
    Failed(ZeroError),
}

impl Reply {
    pub(super) fn encode(&self) -> Vec<u8> {
        let mut w = Writer::default();
        match self {
            Self::Done(None) => w.u8(0),
            Self::Done(Some(buf)) => w.u8(1).buf(buf.as_ref()),
            Self::Split { id, rank, size } => w.u8(2).u64(*id).u64(*rank as u64).u64(*size as u64),
            Self::Failed(error) => encode_error(w.u8(3), error),
        };
        w.0
    }

    pub(super) fn decode(bytes: &[u8]) -> Result<Self, String> {
        let mut r = Reader::new(bytes);
        Ok(match r.u8()? {
            0 => Self::Done(None),
            1 => Self::Done(Some(r.buf()?)),
            2 => Self::Split { id: r.u64()?, rank: r.usize()?, size: r.usize()? },
            3 => Self::Failed(decode_error(&mut r)?),
            other => return Err(format!("unknown reply tag {other}")),
        })
    }
}

/// The errors a collective of the relay's returns keep their kind across the wire, so a
/// rank's caller sees the timeout (and the missing ranks) or the abort (and who failed) that
/// happened; any other arrives as a rendezvous error with its message.
fn encode_error<'w>(w: &'w mut Writer, error: &ZeroError) -> &'w mut Writer {
    match error {
        ZeroError::Aborted { rank, reason } => w.u8(0).u64(*rank as u64).str(reason),
        ZeroError::Timeout { rank, op, timeout_ms, missing } => {
            w.u8(1).u64(*rank as u64).str(op).u64(*timeout_ms).u64(missing.len() as u64);
            missing.iter().for_each(|m| {
                w.u64(*m as u64);
            });
            w
        }
        ZeroError::Mismatch { rank, detail } => w.u8(2).u64(*rank as u64).str(detail),
        ZeroError::BadBuffer { rank, op, detail } => w.u8(3).u64(*rank as u64).str(op).str(detail),
        other => w.u8(4).str(&other.to_string()),
    }
}

fn decode_error(r: &mut Reader<'_>) -> Result<ZeroError, String> {
    Ok(match r.u8()? {
        0 => ZeroError::Aborted { rank: r.usize()?, reason: r.str()? },
        1 => {
            let (rank, op, timeout_ms, n) = (r.usize()?, op_name(&r.str()?), r.u64()?, r.usize()?);
            let missing = (0..n).map(|_| r.usize()).collect::<Result<_, _>>()?;
            ZeroError::Timeout { rank, op, timeout_ms, missing }
        }
        2 => ZeroError::Mismatch { rank: r.usize()?, detail: r.str()? },
        3 => ZeroError::BadBuffer { rank: r.usize()?, op: op_name(&r.str()?), detail: r.str()? },
        4 => ZeroError::Rendezvous(r.str()?),
        other => return Err(format!("unknown error tag {other}")),
    })
}

/// A collective's name as the static string errors hold.
fn op_name(name: &str) -> &'static str {
    use OpKind::*;
    [AllReduce, ReduceScatter, AllGather, Broadcast, Barrier, Send, Recv, Split]
        .into_iter()
        .map(OpKind::name)
        .find(|n| *n == name)
        .unwrap_or("collective")
}

#[cfg(test)]
mod tests {
    use super::*;
    use zerotrain_precision::half::bf16;

    #[test]
    fn calls_replies_and_openings_arrive_as_they_were_sent() {
        let calls = [
            Call::AllReduce { op: ReduceOp::Max, buf: FlatBuf::F32(vec![1.5, -0.0, f32::INFINITY]) },
            Call::ReduceScatter { op: ReduceOp::Sum, input: FlatBuf::Bf16(vec![bf16::from_f32(3.0); 4]), out_len: 2 },
            Call::Recv { from: 3, dtype: Precision::Fp16, len: 7 },
            Call::Split { color: 2, key: 9 },
            Call::Goodbye,
        ];
        for call in calls {
            assert_eq!(Call::decode(&call.encode()).unwrap(), call);
        }
        let timeout = ZeroError::Timeout { rank: 1, op: "all_gather", timeout_ms: 5, missing: vec![0, 2] };
        for reply in [Reply::Failed(timeout), Reply::Split { id: 4, rank: 1, size: 2 }, Reply::Done(None)] {
            assert_eq!(Reply::decode(&reply.encode()).unwrap(), reply);
        }
        let hello = Opening::Hello { rank: 1, world_size: 2, fingerprint: vec![("a.b".into(), "1".into())] };
        assert_eq!(Opening::decode(&hello.encode()).unwrap(), hello);
    }

    #[test]
    fn a_truncated_or_oversized_message_is_refused_not_trusted() {
        let bytes = Call::AllReduce { op: ReduceOp::Sum, buf: FlatBuf::F32(vec![1.0; 4]) }.encode();
        let err = Call::decode(&bytes[..bytes.len() - 1]).unwrap_err();
        assert!(err.contains("ends 1 bytes early"), "{err}");
        // A length prefix of 2^40 is refused before any allocation.
        let mut frame = (1u64 << 40).to_le_bytes().to_vec();
        frame.extend_from_slice(&[0; 16]);
        let err = read_frame(&mut frame.as_slice(), MAX_OPENING).unwrap_err();
        assert!(err.to_string().contains("at most"), "{err}");
    }
}
