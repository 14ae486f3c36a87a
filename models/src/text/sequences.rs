//! A token file of fine-tuning sequences (`tokenize` of conversations or prompt/completion
//! rows) as training rows, one sequence to a row or several packed ([`SequenceRows`]).
//!
//! # Note: a row is one sequence, or several packed
//! Each sequence is first cut to its first `context + 1` tokens (a longer one truncated
//! keeping its start, as TRL truncates). With [`Packing::None`] a row holds one sequence,
//! then padding (TRL's `packing=False`): a causal model's position `t` sees positions
//! `..= t` only, so the padding changes none of its losses. With [`Packing::Bfd`] the
//! sequences are packed once into rows of `context + 1` tokens by best-fit decreasing
//! (TRL's `packing_strategy="bfd"`: longest first, each into the row it leaves least room
//! in), the held-out ones apart; each row carries every input's sequence start
//! ([`LmBatch::with_starts`]), so positions restart at each sequence and attention stays
//! inside it. Either way row `k` of a run is row `perm_e(k mod n)` of epoch `e = k / n`
//! (the shuffle of [`TokenSampler`](super::sampler::TokenSampler), over rows), and target
//! `t` of a row (token `t + 1`) counts where the file's mask marks that token and it lies
//! in the same sequence as token `t`; padding never counts.

use std::ops::Range;
use std::sync::Arc;

use burn::tensor::{Device, Int, Tensor, TensorData};

use super::sampler::{Shuffle, VALIDATION_WINDOWS};
use super::tokens::TokenFile;
use crate::LmBatch;

/// The id a row is padded with (never a counted target, and after every token of the
/// sequence: no position of the sequence sees it).
pub const PAD: i64 = 0;

/// How sequences go into rows (module note).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Packing {
    /// One sequence to a row, padded.
    None,
    /// Several to a row, best-fit decreasing, kept apart.
    Bfd,
}

/// Training and validation rows of a file of fine-tuning sequences (module note).
#[derive(Debug)]
pub struct SequenceRows {
    file: Arc<TokenFile>,
    context: usize,
    packing: Packing,
    /// Each row's sequences (each cut to a row's length).
    train: Vec<Vec<Range<usize>>>,
    held: Vec<Vec<Range<usize>>>,
    /// Training sequences, and those longer than a row.
    sequences: (usize, usize),
    order: Shuffle,
}

impl SequenceRows {
    /// Rows of `context + 1` tokens of `file`'s sequences, packed as `packing` says; an
    /// error naming the file where it holds no sequences, or either split none.
    pub fn new(file: Arc<TokenFile>, context: usize, seed: u64, packing: Packing) -> Result<Self, String> {
        let name = file.path().display().to_string();
        if !file.sequences() {
            return Err(format!("{name}: it holds documents, not fine-tuning sequences"));
        }
        let (train, held): (Vec<_>, Vec<_>) = file.document_ranges().partition(|r| r.end <= file.train_tokens());
        if train.is_empty() {
            return Err(format!("{name}: its training split holds no sequence"));
        }
        if held.is_empty() {
            return Err(format!(
                "{name}: its held-out split holds no sequence: tokenize it with `zerotrain tokenize --valid-fraction F` \
                 (F > 0)"
            ));
        }
        if train.len() > u32::MAX as usize {
            return Err(format!("{name}: more than 2^32 sequences"));
        }
        let len = context + 1;
        let sequences = (train.len(), train.iter().filter(|r| r.len() > len).count());
        let pack = |split: Vec<Range<usize>>| {
            let cut: Vec<Range<usize>> = split.into_iter().map(|r| r.start..r.end.min(r.start + len)).collect();
            match packing {
                Packing::None => cut.into_iter().map(|r| vec![r]).collect(),
                Packing::Bfd => best_fit_decreasing(cut, len),
            }
        };
        let (train, held): (Vec<_>, Vec<_>) = (pack(train), pack(held));
        let order = Shuffle::new(train.len(), seed);
        Ok(Self { file, context, packing, train, held, sequences, order })
    }

    /// The model's context (rows are one token longer).
    pub fn context(&self) -> usize {
        self.context
    }

    /// Training sequences.
    pub fn sequences(&self) -> usize {
        self.sequences.0
    }

    /// Training sequences longer than a row, which rows truncate.
    pub fn truncated(&self) -> usize {
        self.sequences.1
    }

    /// Training rows (per epoch).
    pub fn rows(&self) -> usize {
        self.train.len()
    }

    /// The share of the training rows' tokens that is padding.
    pub fn padding(&self) -> f64 {
        let used: usize = self.train.iter().flatten().map(Range::len).sum();
        1.0 - used as f64 / (self.train.len() * (self.context + 1)) as f64
    }

    /// Counted targets of rows `first..first + count` of the run.
    pub fn counted(&self, first: u64, count: u64) -> u64 {
        let row = |k: u64| &self.train[self.order.item(k)];
        (first..first + count).flat_map(row).map(|s| self.file.counted_in(s.start + 1..s.end) as u64).sum()
    }

    /// Rows `first..first + count` as a batch `[count, context + 1]`, their counted
    /// targets' loss divided by `divisor`.
    pub fn batch(&self, first: u64, count: u64, divisor: f64, device: &Device) -> LmBatch {
        let picked: Vec<&[Range<usize>]> =
            (first..first + count).map(|k| &self.train[self.order.item(k)][..]).collect();
        rows(&self.file, &picked, (self.context + 1, self.packing), device).0.divided_by(divisor)
    }

    /// The held-out rows (at most [`VALIDATION_WINDOWS`]) as one batch, the loss the mean
    /// over their counted targets.
    pub fn validation(&self, device: &Device) -> LmBatch {
        let held: Vec<&[Range<usize>]> = self.held.iter().take(VALIDATION_WINDOWS).map(Vec::as_slice).collect();
        let (batch, counted) = rows(&self.file, &held, (self.context + 1, self.packing), device);
        batch.divided_by(counted.max(1) as f64)
    }
}

/// `sequences` (each at most `len` tokens) packed into rows of `len` by best-fit decreasing:
/// longest first (ties in file order), each into the row with the least room that holds it.
fn best_fit_decreasing(mut sequences: Vec<Range<usize>>, len: usize) -> Vec<Vec<Range<usize>>> {
    sequences.sort_by_key(|r| (std::cmp::Reverse(r.len()), r.start));
    let mut rows: Vec<Vec<Range<usize>>> = Vec::new();
    // Every row by the room it has left: (room, row).
    let mut room = std::collections::BTreeSet::new();
    for s in sequences {
        let n = s.len();
        match room.range((n, 0)..).next().copied() {
            Some((left, i)) => {
                room.remove(&(left, i));
                rows[i].push(s);
                room.insert((left - n, i));
            }
            None => {
                room.insert((len - n, rows.len()));
                rows.push(vec![s]);
            }
        }
    }
    rows
}

/// A batch before its divisor is known: the rows' tokens, their targets' weights, and
/// where rows pack sequences, each input's sequence start.
pub struct Rows {
    tokens: Tensor<2, Int>,
    weights: Tensor<2>,
    starts: Option<Tensor<2, Int>>,
}

impl Rows {
    /// The batch, its counted targets' summed loss divided by `divisor` (at least 1: a
    /// batch with nothing counted has a loss of 0).
    pub fn divided_by(self, divisor: f64) -> LmBatch {
        let batch = LmBatch::counted(self.tokens, self.weights, divisor.max(1.0));
        match self.starts {
            Some(starts) => batch.with_starts(starts),
            None => batch,
        }
    }
}

/// Rows of `len` tokens, each its sequences of `file` in turn (cut to `len` together), then
/// padding, and how many of their targets count (module note); with [`Packing::Bfd`], each
/// input's sequence start too (a pad starts its own).
pub fn rows(
    file: &TokenFile,
    rows: &[&[Range<usize>]],
    (len, packing): (usize, Packing),
    device: &Device,
) -> (Rows, usize) {
    let n = rows.len();
    let (mut tokens, mut weights, mut starts) = (Vec::with_capacity(n * len), Vec::new(), Vec::new());
    let mut counted = 0;
    for row in rows {
        let mut at = 0;
        for sequence in row.iter() {
            let end = sequence.end.min(sequence.start + len - at);
            file.extend(sequence.start..end, &mut tokens);
            for i in sequence.start..end {
                // Input `i`'s target is token `i + 1`, inside this sequence only.
                let count = i + 1 < end && file.counted(i + 1);
                counted += usize::from(count);
                weights.push(if count { 1.0f32 } else { 0.0 });
                starts.push(at as i64);
            }
            at += end - sequence.start;
        }
        tokens.extend(std::iter::repeat_n(PAD, len - at));
        for pad in at..len {
            weights.push(0.0);
            starts.push(pad as i64);
        }
        // A row has `len - 1` inputs: its last token is a target only.
        weights.pop();
        starts.pop();
    }
    let tokens = Tensor::from_data(TensorData::new(tokens, [n, len]), device);
    let weights = Tensor::from_data(TensorData::new(weights, [n, len - 1]), device);
    let starts = (packing == Packing::Bfd).then(|| Tensor::from_data(TensorData::new(starts, [n, len - 1]), device));
    (Rows { tokens, weights, starts }, counted)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::text::tokens::TokenFileWriter;

    fn values(t: Tensor<2>) -> Vec<f64> {
        t.into_data().convert::<f64>().try_into_vec::<f64>().unwrap()
    }

    fn ids(t: Tensor<2, burn::tensor::Int>) -> Vec<f64> {
        t.into_data().convert::<f64>().try_into_vec::<f64>().unwrap()
    }

    /// Sequences of lengths 3, 9 (longer than a row of 6), 5 and 4 (held out), ids `100 *
    /// sequence + position`, the mask on every odd position.
    fn file(name: &str) -> Arc<TokenFile> {
        let dir = std::env::temp_dir().join(format!("zerotrain-sequences-{}-{name}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let mut writer = TokenFileWriter::create(&dir.join("s.tokens"), 1000, 999, 1).unwrap();
        for (s, n) in [3u32, 9, 5, 4].into_iter().enumerate() {
            let ids: Vec<u32> = (0..n).map(|i| 100 * s as u32 + i).collect();
            let mask: Vec<bool> = (0..n).map(|i| i % 2 == 1).collect();
            writer.sequence(&ids, &mask).unwrap();
        }
        Arc::new(writer.finish(4.0 / 21.0).unwrap())
    }

    /// A row is its sequence's first tokens, then padding; its weights mark the masked
    /// targets inside the sequence only; an epoch draws every training sequence once; the
    /// step's count is the rows' weights' sum; the held-out sequence validates.
    #[test]
    fn a_row_is_one_sequence_truncated_or_padded_and_only_its_masked_targets_count() {
        let rows = SequenceRows::new(file("rows"), 5, 3, Packing::None).unwrap();
        assert_eq!((rows.sequences(), rows.truncated()), (3, 1));
        let device = Device::flex();
        let batch = rows.batch(0, 3, 2.0, &device);
        let tokens = ids(batch.tokens.clone());
        let counted = batch.counted.clone().unwrap();
        let weights = values(counted.weights);
        assert_eq!(counted.divisor, 2.0);
        let mut seen = Vec::new();
        for r in 0..3 {
            let row = &tokens[r * 6..(r + 1) * 6];
            let s = (row[0] / 100.0) as usize;
            seen.push(s);
            let n = [3, 9, 5][s];
            for (t, &got) in row.iter().enumerate() {
                let want = if t < n { (100 * s + t) as f64 } else { PAD as f64 };
                assert_eq!(got, want, "sequence {s}, token {t}");
            }
            for t in 0..5 {
                let want = t + 1 < n && (t + 1) % 2 == 1;
                assert_eq!(weights[r * 5 + t] == 1.0, want, "sequence {s}, target {t}");
            }
        }
        seen.sort_unstable();
        assert_eq!(seen, [0, 1, 2], "one epoch, every sequence once");
        let sum: f64 = weights.iter().sum();
        assert_eq!(rows.counted(0, 3) as f64, sum);
        assert_eq!(rows.counted(3, 3), rows.counted(0, 3), "the next epoch holds the same sequences");
        let held = rows.validation(&device);
        assert_eq!(ids(held.tokens.clone())[..4], [300.0, 301.0, 302.0, 303.0]);
        assert_eq!(held.counted.unwrap().divisor, 2.0, "targets 1 and 3 of the held-out sequence");
        let shared = rows.batch(0, 3, 12.0, &device).shared_by(4);
        assert_eq!(shared.counted.unwrap().divisor, 3.0);
    }

    /// Best-fit decreasing: every training sequence (cut to a row) in exactly one row, none
    /// fuller than a row, as few rows as the lengths allow here (3, 9 cut to 6, and 5 into
    /// rows of 6: 3 rows, where 9 would be one alone and 5 and 3 cannot share); each input's
    /// start is its sequence's first position in the row, and no target across a boundary
    /// or in the padding counts.
    #[test]
    fn packed_rows_hold_every_sequence_once_and_count_within_each() {
        let rows = SequenceRows::new(file("bfd"), 5, 3, Packing::Bfd).unwrap();
        assert_eq!((rows.sequences(), rows.truncated(), rows.rows()), (3, 1, 3));
        let len = 6;
        let batch = rows.batch(0, 3, 1.0, &Device::flex());
        let tokens = ids(batch.tokens.clone());
        let weights = values(batch.counted.clone().unwrap().weights);
        let starts = ids(batch.packed.clone().unwrap().starts);
        let mut placed = Vec::new();
        for r in 0..3 {
            let row = &tokens[r * len..(r + 1) * len];
            // Sequence s's token p is 100 s + p; a sequence starts where its token 1 follows.
            let (s_of, p_of) = (|t: usize| row[t] as usize / 100, |t: usize| row[t] as usize % 100);
            for t in 0..len - 1 {
                let (s, p) = (s_of(t), p_of(t));
                let follows = s_of(t + 1) == s && p_of(t + 1) == p + 1;
                if p == 0 && follows {
                    placed.push(s);
                    assert_eq!(starts[r * (len - 1) + t] as usize, t, "row {r}: a sequence starts at {t}");
                }
                if p > 0 {
                    assert_eq!(starts[r * (len - 1) + t] as usize, t - p, "row {r}, input {t}");
                }
                let counted = weights[r * (len - 1) + t] == 1.0;
                assert_eq!(counted, follows && (p + 1) % 2 == 1, "row {r}, target {t}");
            }
        }
        placed.sort_unstable();
        assert_eq!(placed, [0, 1, 2], "every training sequence once");
        assert!(rows.padding() > 0.0 && rows.padding() < 1.0);
    }

    /// A corpus file, or one without a held-out sequence, is refused naming the file.
    #[test]
    fn files_without_sequences_or_a_held_out_one_are_refused() {
        let dir = std::env::temp_dir().join(format!("zerotrain-sequences-{}-refused", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let mut writer = TokenFileWriter::create(&dir.join("d.tokens"), 1000, 999, 1).unwrap();
        writer.document(&[1, 2, 3]).unwrap();
        let err = SequenceRows::new(Arc::new(writer.finish(0.3).unwrap()), 4, 1, Packing::Bfd).unwrap_err();
        assert!(err.contains("d.tokens") && err.contains("not fine-tuning sequences"), "{err}");
        let mut writer = TokenFileWriter::create(&dir.join("s.tokens"), 1000, 999, 1).unwrap();
        writer.sequence(&[1, 2, 3], &[false, true, true]).unwrap();
        writer.sequence(&[4, 5], &[false, true]).unwrap();
        let err = SequenceRows::new(Arc::new(writer.finish(0.0).unwrap()), 4, 1, Packing::Bfd).unwrap_err();
        assert!(err.contains("s.tokens") && err.contains("held-out split holds no sequence"), "{err}");
    }
}
