//! Activations and their gradients between pipeline stages: one header message, then each
//! part's values in its own dtype.
//!
//! # Note: the header
//! A header is integers: a magic word, then per part the dtype code, the rank and each
//! dimension as two 32-bit words (low, high), `MAX_DIMS` dimensions reserved. The
//! collectives move f32 buffers, so each word travels as the f32 with its bit pattern
//! (`f32::from_bits`); nothing on the way does arithmetic on them, so every bit arrives.
//! The receiver knows how many parts its activation type has, so the header's length is
//! known before it arrives.
//!
//! # Note: on the device
//! Where the pipe's collectives read device memory (NCCL's), the messages are device
//! tensors (`engine::on_device::send` and `recv`: `ncclSend`/`ncclRecv` on Burn's buffers,
//! ordered after the work that made them), the header too; only the header's few words are
//! read back to the host, to know what comes next. A send does not wait for its receiver,
//! and each direction has a communicator of its own: NCCL runs a communicator's messages in
//! order on one stream, so a stage's receive of a gradient queued behind its send of an
//! activation would wait for the next stage, which may be waiting to send that gradient.
//! Elsewhere the parts are read into host memory and sent by the host collective (its
//! sends buffered). [`Wire::traffic`] counts the parts' bytes by the way they went.

use std::sync::Arc;

use burn::tensor::{Device, Tensor, TensorData};
use zerotrain_precision::{FlatBuf, Precision};
use zerotrain_zero::{Collective, Pending, Request};

use crate::engine::flat;
use crate::engine::model::Activation;
use crate::engine::on_device::{self, Sending};
use crate::engine::readout;
use crate::nn::parallel::GroupTraffic;
use crate::{Error, Result};

/// Dimensions a part may have.
const MAX_DIMS: usize = 8;
/// Header words per part: dtype, rank, and two words per dimension.
const PART_WORDS: usize = 2 + 2 * MAX_DIMS;
/// The first header word.
const MAGIC: u32 = 0x7A70_6970; // "zpip"
/// Most elements one part may claim (a garbled header must not allocate without bound).
const MAX_PART_ELEMS: u64 = 1 << 40;

/// The parts of an activation as they travel: each part's dtype and shape.
pub(super) type Shapes = Vec<(Precision, Vec<usize>)>;

/// Header words for `parts` parts.
pub(super) fn header_len(parts: usize) -> usize {
    1 + parts * PART_WORDS
}

fn code(dtype: Precision) -> u32 {
    match dtype {
        Precision::Fp32 => 0,
        Precision::Fp16 => 1,
        Precision::Bf16 => 2,
    }
}

/// The header describing parts of these dtypes and shapes.
fn encode(parts: &Shapes) -> Result<Vec<f32>> {
    let mut words = vec![MAGIC];
    for (dtype, shape) in parts {
        if shape.len() > MAX_DIMS {
            return Err(Error::Model(format!("activations of rank {} cannot pass between stages", shape.len())));
        }
        let mut part = vec![0u32; PART_WORDS];
        part[0] = code(*dtype);
        part[1] = shape.len() as u32;
        for (d, &dim) in shape.iter().enumerate() {
            let dim = dim as u64;
            (part[2 + 2 * d], part[3 + 2 * d]) = (dim as u32, (dim >> 32) as u32);
        }
        words.extend(part);
    }
    Ok(words.into_iter().map(f32::from_bits).collect())
}

/// Each part's (dtype, shape) from a header, checked.
fn decode(header: &[f32], from: usize) -> Result<Shapes> {
    let words: Vec<u32> = header.iter().map(|w| w.to_bits()).collect();
    let garbled = |what: String| Error::Model(format!("a garbled activation header from stage {from}: {what}"));
    if words.first() != Some(&MAGIC) {
        return Err(garbled("no magic word".into()));
    }
    words[1..]
        .chunks_exact(PART_WORDS)
        .map(|part| {
            let dtype = match part[0] {
                0 => Precision::Fp32,
                1 => Precision::Fp16,
                2 => Precision::Bf16,
                other => return Err(garbled(format!("dtype code {other}"))),
            };
            let rank = part[1] as usize;
            if rank > MAX_DIMS {
                return Err(garbled(format!("rank {rank}")));
            }
            let dims: Vec<u64> =
                (0..rank).map(|d| u64::from(part[2 + 2 * d]) | u64::from(part[3 + 2 * d]) << 32).collect();
            let elems = dims.iter().try_fold(1u64, |n, &d| n.checked_mul(d)).filter(|&n| n <= MAX_PART_ELEMS);
            elems.ok_or_else(|| garbled(format!("shape {dims:?}")))?;
            Ok((dtype, dims.into_iter().map(|d| d as usize).collect()))
        })
        .collect()
}

/// Which way a message goes: an activation to the next stage, or a gradient to the one
/// before.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Direction {
    Forward,
    Backward,
}

/// An activation's parts as they leave: host buffers or device tensors (module note), each
/// with its shape.
pub(super) enum Parts {
    Host(Vec<(FlatBuf, Vec<usize>)>),
    Device(Vec<(Tensor<1>, Vec<usize>)>),
}

/// A message on its way.
pub(super) enum Outgoing {
    Host(Pending),
    Device(Sending),
}

impl Outgoing {
    /// Waits until it has left.
    pub fn wait(self) -> Result<()> {
        match self {
            Self::Host(pending) => pending.wait().map(drop).map_err(Error::from),
            Self::Device(sending) => sending.wait(),
        }
    }
}

/// A stage's messages to its neighbours (module notes).
pub(super) struct Wire {
    /// Activations (one communicator with gradients, unless on the device).
    forward: Arc<dyn Collective>,
    /// Gradients.
    backward: Arc<dyn Collective>,
    /// The parts' bytes sent, by way (headers not counted).
    traffic: GroupTraffic,
}

impl Wire {
    /// The wire over `pipe` (every rank of it calls this at once: on the device each
    /// direction is split from it).
    pub fn new(pipe: &Arc<dyn Collective>) -> Result<Self> {
        let (forward, backward) = match pipe.reads_device_memory() {
            true => (pipe.split(0, pipe.rank())?, pipe.split(0, pipe.rank())?),
            false => (Arc::clone(pipe), Arc::clone(pipe)),
        };
        Ok(Self { forward, backward, traffic: GroupTraffic::default() })
    }

    /// Whether the parts travel as device tensors (module note).
    fn on_device(&self) -> bool {
        self.forward.reads_device_memory()
    }

    /// The parts' bytes sent so far, by way.
    pub fn traffic(&self) -> GroupTraffic {
        self.traffic
    }

    fn comm(&self, direction: Direction) -> Arc<dyn Collective> {
        Arc::clone(match direction {
            Direction::Forward => &self.forward,
            Direction::Backward => &self.backward,
        })
    }

    /// `activation`'s parts, the way this wire sends them.
    pub fn parts<A: Activation>(&self, activation: A, device: &Device) -> Result<Parts> {
        match self.on_device() {
            true => activation.into_tensors(device).map(Parts::Device),
            false => activation.into_parts().map(Parts::Host),
        }
    }

    /// Zeros of these dtypes and shapes, the way this wire sends them (made on `device`
    /// where they are tensors).
    pub fn zeros(&self, shapes: Shapes, device: &Device) -> Parts {
        let device = device.clone().without_autodiff();
        let parts = shapes.into_iter().map(|(dtype, shape)| (dtype, shape.iter().product::<usize>(), shape));
        match self.on_device() {
            true => Parts::Device(parts.map(|(dtype, n, shape)| (flat::zeros(dtype, n, &device), shape)).collect()),
            false => Parts::Host(parts.map(|(dtype, n, shape)| (FlatBuf::zeros(dtype, n), shape)).collect()),
        }
    }

    /// Sends `parts` to rank `to` of the `direction`'s communicator; returns the sends in
    /// flight.
    pub fn send(&mut self, parts: Parts, direction: Direction, to: usize) -> Result<Vec<Outgoing>> {
        let comm = self.comm(direction);
        let comm = comm.as_ref();
        match parts {
            Parts::Host(parts) => {
                let shapes: Shapes = parts.iter().map(|(v, shape)| (v.dtype(), shape.clone())).collect();
                let mut sends = vec![comm.start(Request::Send { buf: FlatBuf::F32(encode(&shapes)?), to })];
                self.traffic.through_host += parts.iter().map(|(v, _)| v.bytes()).sum::<u64>();
                sends.extend(parts.into_iter().map(|(buf, _)| comm.start(Request::Send { buf, to })));
                Ok(sends.into_iter().map(Outgoing::Host).collect())
            }
            Parts::Device(parts) => {
                let shapes = parts
                    .iter()
                    .map(|(t, shape)| Ok((on_device::precision(t.dtype())?, shape.clone())))
                    .collect::<Result<Shapes>>()?;
                let Some((first, _)) = parts.first() else { return Ok(Vec::new()) };
                let words = encode(&shapes)?;
                let len = words.len();
                let header = Tensor::<1>::from_data(TensorData::new(words, [len]), &first.device());
                let mut sends = vec![Outgoing::Device(on_device::send(comm, &header, to)?)];
                for (tensor, _) in &parts {
                    self.traffic.on_device += flat::tensor_bytes(tensor);
                    sends.push(Outgoing::Device(on_device::send(comm, tensor, to)?));
                }
                Ok(sends)
            }
        }
    }

    /// Receives an activation of `A` from rank `from` of the `direction`'s communicator, on
    /// `device`; returns it and its parts' dtypes and shapes.
    pub fn recv<A: Activation>(&self, direction: Direction, from: usize, device: &Device) -> Result<(A, Shapes)> {
        let comm = self.comm(direction);
        let comm = comm.as_ref();
        let mut header = vec![0.0f32; header_len(A::PARTS)];
        if self.on_device() {
            let words = on_device::recv(comm, from, header.len(), Precision::Fp32, device)?;
            header = readout::f32s(words, "an activation's header")?;
        } else {
            comm.recv((&mut header).into(), from)?;
        }
        let shapes = decode(&header, from)?;
        let activation = if self.on_device() {
            let mut parts = Vec::with_capacity(shapes.len());
            for (dtype, shape) in &shapes {
                parts.push((on_device::recv(comm, from, shape.iter().product(), *dtype, device)?, shape.clone()));
            }
            A::from_tensors(&mut parts.into_iter(), device)?
        } else {
            let mut parts = Vec::with_capacity(shapes.len());
            for (dtype, shape) in &shapes {
                let mut values = FlatBuf::zeros(*dtype, shape.iter().product());
                comm.recv(values.as_mut(), from)?;
                parts.push((values, shape.clone()));
            }
            A::from_parts(&mut parts.into_iter(), device)?
        };
        Ok((activation, shapes))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_carry_shapes_beyond_f32s_exact_integers_and_refuse_garbage() {
        let big = (1usize << 24) + 1; // not an f32 integer
        let parts = vec![(Precision::Bf16, vec![3, big, 0]), (Precision::Fp32, vec![])];
        let header = encode(&parts).unwrap();
        assert_eq!(header.len(), header_len(2));
        let decoded = decode(&header, 1).unwrap();
        assert_eq!(decoded, vec![(Precision::Bf16, vec![3, big, 0]), (Precision::Fp32, vec![])]);
        let mut bad = header.clone();
        bad[0] = 1.0;
        assert!(decode(&bad, 1).unwrap_err().to_string().contains("from stage 1: no magic word"));
        let mut huge = header;
        huge[1 + 2] = f32::from_bits(u32::MAX);
        huge[1 + 3] = f32::from_bits(u32::MAX);
        assert!(decode(&huge, 2).unwrap_err().to_string().contains("shape"));
        let deep = vec![(Precision::Fp32, vec![1; MAX_DIMS + 1])];
        assert!(encode(&deep).is_err());
    }
}
