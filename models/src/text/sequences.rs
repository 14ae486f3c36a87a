//! A token file of fine-tuning sequences (`tokenize` of conversations or prompt/completion
//! rows) as training rows: one sequence to a row, in the sampler's order
//! ([`SequenceRows`]).
//!
//! # Note: a row is one sequence
//! Row `k` of a run holds training sequence `perm_e(k mod n)` of epoch `e = k / n` (the
//! shuffle of [`TokenSampler`](super::sampler::TokenSampler), over sequences instead of
//! windows): its first `context + 1` tokens (a longer one is truncated keeping its start,
//! as TRL truncates), then padding. Target `t` of the row (token `t + 1`) counts where the
//! file's mask marks that token and it lies inside the sequence; padding never counts. A
//! causal model's position `t` sees positions `..= t` only, so the padding after a
//! sequence changes none of its losses: a row scores its sequence as it would alone
//! (TRL's `packing=False`).

use std::ops::Range;
use std::sync::Arc;

use burn::tensor::{Device, Tensor, TensorData};

use super::sampler::{Shuffle, VALIDATION_WINDOWS};
use super::tokens::TokenFile;
use crate::LmBatch;

/// The id a row is padded with (never a counted target, and after every token of the
/// sequence: no position of the sequence sees it).
pub const PAD: i64 = 0;

/// Training and validation rows of a file of fine-tuning sequences (module note).
#[derive(Debug)]
pub struct SequenceRows {
    file: Arc<TokenFile>,
    context: usize,
    train: Vec<Range<usize>>,
    held: Vec<Range<usize>>,
    order: Shuffle,
}

impl SequenceRows {
    /// Rows of `context + 1` tokens of `file`'s sequences; an error naming the file where
    /// it holds no sequences, or either split none.
    pub fn new(file: Arc<TokenFile>, context: usize, seed: u64) -> Result<Self, String> {
        let name = file.path().display().to_string();
        if !file.sequences() {
            return Err(format!("{name}: it holds documents, not fine-tuning sequences"));
        }
        let (mut train, mut held, mut start) = (Vec::new(), Vec::new(), 0);
        for end in file.document_ends() {
            let range = start..end as usize;
            start = end as usize;
            match range.end <= file.train_tokens() {
                true => train.push(range),
                false => held.push(range),
            }
        }
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
        let order = Shuffle::new(train.len(), seed);
        Ok(Self { file, context, train, held, order })
    }

    /// The model's context (rows are one token longer).
    pub fn context(&self) -> usize {
        self.context
    }

    /// Training sequences (rows per epoch).
    pub fn sequences(&self) -> usize {
        self.train.len()
    }

    /// Training sequences longer than a row, which rows truncate.
    pub fn truncated(&self) -> usize {
        self.train.iter().filter(|r| r.len() > self.context + 1).count()
    }

    /// Counted targets of rows `first..first + count` of the run.
    pub fn counted(&self, first: u64, count: u64) -> u64 {
        (first..first + count).map(|k| self.counted_of(&self.train[self.order.item(k)]) as u64).sum()
    }

    /// Rows `first..first + count` as a batch `[count, context + 1]`, their counted
    /// targets' loss divided by `divisor`.
    pub fn batch(&self, first: u64, count: u64, divisor: f64, device: &Device) -> LmBatch {
        let sequences: Vec<Range<usize>> =
            (first..first + count).map(|k| self.train[self.order.item(k)].clone()).collect();
        rows(&self.file, &sequences, self.context + 1, device).0.divided_by(divisor)
    }

    /// The held-out sequences (at most [`VALIDATION_WINDOWS`]) as one batch, the loss the
    /// mean over their counted targets.
    pub fn validation(&self, device: &Device) -> LmBatch {
        let held = &self.held[..self.held.len().min(VALIDATION_WINDOWS)];
        let (batch, counted) = rows(&self.file, held, self.context + 1, device);
        batch.divided_by(counted.max(1) as f64)
    }

    /// Counted targets of `sequence`'s row.
    fn counted_of(&self, sequence: &Range<usize>) -> usize {
        let end = sequence.end.min(sequence.start + self.context + 1);
        self.file.counted_in(sequence.start + 1..end)
    }
}

/// A batch before its divisor is known: the rows' tokens and their targets' weights.
pub struct Rows {
    tokens: Tensor<2, burn::tensor::Int>,
    weights: Tensor<2>,
}

impl Rows {
    /// The batch, its counted targets' summed loss divided by `divisor` (at least 1: a
    /// batch with nothing counted has a loss of 0).
    pub fn divided_by(self, divisor: f64) -> LmBatch {
        LmBatch::counted(self.tokens, self.weights, divisor.max(1.0))
    }
}

/// `sequences` of `file` as rows of `len` tokens (each truncated or padded to it), and how
/// many of their targets count (module note).
pub fn rows(file: &TokenFile, sequences: &[Range<usize>], len: usize, device: &Device) -> (Rows, usize) {
    let (mut tokens, mut weights) = (Vec::with_capacity(sequences.len() * len), Vec::new());
    let mut counted = 0;
    for sequence in sequences {
        let end = sequence.end.min(sequence.start + len);
        file.extend(sequence.start..end, &mut tokens);
        tokens.extend(std::iter::repeat_n(PAD, len - (end - sequence.start)));
        for t in 1..len {
            let i = sequence.start + t;
            let count = i < end && file.counted(i);
            counted += usize::from(count);
            weights.push(if count { 1.0f32 } else { 0.0 });
        }
    }
    let n = sequences.len();
    let tokens = Tensor::from_data(TensorData::new(tokens, [n, len]), device);
    let weights = Tensor::from_data(TensorData::new(weights, [n, len - 1]), device);
    (Rows { tokens, weights }, counted)
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
        let rows = SequenceRows::new(file("rows"), 5, 3).unwrap();
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
            for t in 0..6 {
                let want = if t < n { (100 * s + t) as f64 } else { PAD as f64 };
                assert_eq!(row[t], want, "sequence {s}, token {t}");
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

    /// A corpus file, or one without a held-out sequence, is refused naming the file.
    #[test]
    fn files_without_sequences_or_a_held_out_one_are_refused() {
        let dir = std::env::temp_dir().join(format!("zerotrain-sequences-{}-refused", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let mut writer = TokenFileWriter::create(&dir.join("d.tokens"), 1000, 999, 1).unwrap();
        writer.document(&[1, 2, 3]).unwrap();
        let err = SequenceRows::new(Arc::new(writer.finish(0.3).unwrap()), 4, 1).unwrap_err();
        assert!(err.contains("d.tokens") && err.contains("not fine-tuning sequences"), "{err}");
        let mut writer = TokenFileWriter::create(&dir.join("s.tokens"), 1000, 999, 1).unwrap();
        writer.sequence(&[1, 2, 3], &[false, true, true]).unwrap();
        writer.sequence(&[4, 5], &[false, true]).unwrap();
        let err = SequenceRows::new(Arc::new(writer.finish(0.0).unwrap()), 4, 1).unwrap_err();
        assert!(err.contains("s.tokens") && err.contains("held-out split holds no sequence"), "{err}");
    }
}
