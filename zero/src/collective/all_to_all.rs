//! The uneven all-to-all ([`Collective::all_to_all`]): every rank sends a part of its buffer
//! to every rank, parts of any length, and receives one part from each in rank order (MPI's
//! `MPI_Alltoallv` with the parts packed back to back). Ulysses' exchange of sequence parts
//! for head parts is its even case; routing tokens to experts its uneven one.
//!
//! # Note: counts, then payloads
//! A receiver must know how much each rank sends it before it can hold the parts. Where it
//! does not (tokens routed to experts), [`exchange`] first exchanges the counts
//! ([`Collective::all_to_all_counts`]: one all-gather of every rank's counts), then the
//! payloads. The counts travel as the bit patterns of f32 words, two per count (low and high
//! 32 bits): the collectives copy them and do no arithmetic on them, so every bit arrives.
//!
//! # Note: the host backends' all-to-all
//! The default runs as point-to-point messages: every part for another rank sent (sends are
//! buffered, so none waits for its receive), this rank's own part copied, then every part
//! for this rank received in rank order. It is counted as those sends and receives. NCCL's
//! runs as one group of `ncclSend`/`ncclRecv` on the GPU.

use std::ops::Range;

use zerotrain_precision::{BufMut, BufRef, FlatBuf};

use super::{Collective, OpKind};
use crate::ZeroError;

/// The element ranges of consecutive parts of `counts[j]` elements each.
pub fn part_ranges(counts: &[usize]) -> Vec<Range<usize>> {
    let mut start = 0;
    counts
        .iter()
        .map(|&c| {
            let range = start..start + c;
            start += c;
            range
        })
        .collect()
}

/// Checks one rank's arguments of an all-to-all over `world_size` ranks: a count per rank on
/// each side, counts that add up to the buffers' lengths, one dtype.
pub fn check(
    rank: usize,
    world_size: usize,
    input: &BufRef<'_>,
    send_counts: &[usize],
    output: &BufMut<'_>,
    recv_counts: &[usize],
) -> Result<(), ZeroError> {
    let bad = |detail: String| ZeroError::BadBuffer { rank, op: OpKind::AllToAll.name(), detail };
    for (side, counts) in [("send", send_counts), ("receive", recv_counts)] {
        if counts.len() != world_size {
            return Err(bad(format!("{} {side} counts for {world_size} ranks", counts.len())));
        }
    }
    let total = |counts: &[usize]| counts.iter().try_fold(0usize, |sum, &c| sum.checked_add(c));
    for (side, counts, len) in [("send", send_counts, input.len()), ("receive", recv_counts, output.len())] {
        if total(counts) != Some(len) {
            return Err(bad(format!("the {side} counts {counts:?} do not add up to the buffer's {len} elements")));
        }
    }
    if input.dtype() != output.dtype() {
        return Err(bad(format!("input is {:?}, output {:?}", input.dtype(), output.dtype())));
    }
    Ok(())
}

/// The counts of an all-to-all of equal parts ([`DeviceOp::AllToAll`](super::DeviceOp)):
/// `input_len` elements in `world_size` parts of one length, the output as long.
pub fn equal_counts(
    rank: usize,
    world_size: usize,
    input_len: usize,
    output_len: usize,
) -> Result<Vec<usize>, ZeroError> {
    let bad = |detail: String| ZeroError::BadBuffer { rank, op: OpKind::AllToAll.name(), detail };
    if !input_len.is_multiple_of(world_size) {
        return Err(bad(format!("{input_len} elements are not {world_size} equal parts")));
    }
    if output_len != input_len {
        return Err(bad(format!("an output of {output_len} elements for equal parts of {input_len}")));
    }
    Ok(vec![input_len / world_size; world_size])
}

/// The default [`Collective::all_to_all`]: point-to-point messages (module note).
pub(crate) fn through_messages<C: Collective + ?Sized>(
    comm: &C,
    input: BufRef<'_>,
    send_counts: &[usize],
    mut output: BufMut<'_>,
    recv_counts: &[usize],
) -> Result<(), ZeroError> {
    let (me, n) = (comm.rank(), comm.world_size());
    check(me, n, &input, send_counts, &output, recv_counts)?;
    let (sends, recvs) = (part_ranges(send_counts), part_ranges(recv_counts));
    for j in (0..n).filter(|&j| j != me && send_counts[j] > 0) {
        comm.send(input.slice(sends[j].clone()), j)?;
    }
    // Checked after the sends, so that the other ranks get their parts and do not wait.
    if send_counts[me] != recv_counts[me] {
        let detail = format!("sends itself {} elements but expects {}", send_counts[me], recv_counts[me]);
        return Err(ZeroError::BadBuffer { rank: me, op: OpKind::AllToAll.name(), detail });
    }
    output.reborrow().slice(recvs[me].clone()).copy_from(input.slice(sends[me].clone()), false);
    for i in (0..n).filter(|&i| i != me && recv_counts[i] > 0) {
        comm.recv(output.reborrow().slice(recvs[i].clone()), i)?;
    }
    Ok(())
}

/// The default [`Collective::all_to_all_counts`]: one all-gather of every rank's counts
/// (module note).
pub(crate) fn counts_by_all_gather<C: Collective + ?Sized>(
    comm: &C,
    send_counts: &[usize],
) -> Result<Vec<usize>, ZeroError> {
    let (me, n) = (comm.rank(), comm.world_size());
    if send_counts.len() != n {
        let detail = format!("{} send counts for {n} ranks", send_counts.len());
        return Err(ZeroError::BadBuffer { rank: me, op: OpKind::AllToAll.name(), detail });
    }
    let words: Vec<f32> = send_counts
        .iter()
        .flat_map(|&c| {
            let c = c as u64;
            [f32::from_bits(c as u32), f32::from_bits((c >> 32) as u32)]
        })
        .collect();
    let mut all = vec![0f32; words.len() * n];
    comm.all_gather(BufRef::F32(&words), BufMut::F32(&mut all))?;
    // Rank i's row holds what it sends to each rank; this rank's count is column `me`.
    Ok((0..n)
        .map(|i| {
            let at = (i * n + me) * 2;
            (u64::from(all[at].to_bits()) | u64::from(all[at + 1].to_bits()) << 32) as usize
        })
        .collect())
}

/// Counts, then payloads (module note): sends `send_counts[j]` elements of `input` (packed in
/// rank order) to each rank `j` and returns what every rank sent this one, in rank order,
/// with how many elements came from each.
pub fn exchange(
    comm: &dyn Collective,
    input: BufRef<'_>,
    send_counts: &[usize],
) -> Result<(FlatBuf, Vec<usize>), ZeroError> {
    let recv_counts = comm.all_to_all_counts(send_counts)?;
    let total = recv_counts.iter().try_fold(0usize, |sum, &c| sum.checked_add(c)).ok_or_else(|| {
        let detail = format!("the counts received, {recv_counts:?}, overflow");
        ZeroError::BadBuffer { rank: comm.rank(), op: OpKind::AllToAll.name(), detail }
    })?;
    let mut output = FlatBuf::zeros(input.dtype(), total);
    comm.all_to_all(input, send_counts, output.as_mut(), &recv_counts)?;
    Ok((output, recv_counts))
}
