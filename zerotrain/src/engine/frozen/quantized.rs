//! A unit's frozen tensors stored with some of them in NF4 (`zerotrain.lora.quantize`):
//! the words its shards cut, encoded once from the values and decoded after each gather.
//!
//! # Note: the stored words
//! The unit's frozen tensors follow each other as words (f32 bit patterns, which the
//! collectives and swap files copy unchanged): a tensor kept as it is takes its compute-dtype
//! values (half types two to a word, as `swap::pack` lays them), an NF4 tensor its codes
//! (eight to a word) then its absmaxes. The words are padded to a multiple of the ranks and
//! cut evenly, so a shard boundary may fall inside a tensor or a block: a block is whole
//! again once gathered, and its values are defined by the whole tensor, never by a shard.
//! An NF4 tensor's blocks run along PyTorch's flat order of a linear weight, `[out, in]`
//! (Burn holds it `[in, out]`), as bitsandbytes quantises it, so a block here is the block
//! bitsandbytes would make of the same weight.

use std::ops::Range;

use zerotrain_precision::{BufRef, FlatBuf, Precision};
use zerotrain_zero::FlatLayout;

use super::nf4;
use crate::swap::{pack, unpack, words};

/// One frozen tensor's place among the words.
#[derive(Debug, Clone)]
struct Piece {
    /// Its range in the unit's flat (element) layout.
    elems: Range<usize>,
    /// Its first word.
    start: usize,
    /// `Some([rows, cols])`, as Burn holds it: in NF4; `None`: in the compute dtype.
    nf4: Option<[usize; 2]>,
}

/// How one unit's frozen tensors are stored (module note).
#[derive(Debug, Clone)]
pub(crate) struct QuantizedUnit {
    pieces: Vec<Piece>,
    /// Words of the pieces, unpadded.
    words: usize,
    world_size: usize,
    dtype: Precision,
}

impl QuantizedUnit {
    /// The storage of `layout`'s tensors over `world_size` ranks: those `nf4` marks in NF4,
    /// the others in `dtype`. `None` when none is marked.
    pub fn new(layout: &FlatLayout, nf4: &[bool], world_size: usize, dtype: Precision) -> Option<Self> {
        if !nf4.iter().any(|q| *q) {
            return None;
        }
        let mut start = 0;
        let pieces = (layout.entries().iter().zip(nf4))
            .map(|(e, &q)| {
                let n = e.num_elems;
                let nf4 = q.then(|| [e.shape[0], e.shape[1]]);
                let len = if q { nf4::code_words(n) + nf4::blocks(n) } else { words(dtype, n) };
                let piece = Piece { elems: e.flat_range(), start, nf4 };
                start += len;
                piece
            })
            .collect();
        Some(Self { pieces, words: start, world_size, dtype })
    }

    /// Words of the whole unit, padded to a multiple of the ranks.
    pub fn padded_words(&self) -> usize {
        self.words.div_ceil(self.world_size) * self.world_size
    }

    /// Words of one rank's shard.
    pub fn shard_words(&self) -> usize {
        self.padded_words() / self.world_size
    }

    /// Rank `rank`'s words.
    pub fn shard_range(&self, rank: usize) -> Range<usize> {
        let len = self.shard_words();
        rank * len..(rank + 1) * len
    }

    /// The words of `values`, the unit's frozen tensors in their flat layout (padded).
    pub fn encode(&self, values: BufRef<'_>) -> FlatBuf {
        let mut out = vec![0.0f32; self.padded_words()];
        for piece in &self.pieces {
            let part = values.slice(piece.elems.clone());
            match piece.nf4 {
                None => {
                    let packed = pack(part);
                    out[piece.start..piece.start + packed.as_slice().len()].copy_from_slice(packed.as_slice());
                }
                Some(dims) => {
                    let flat = torch_order(&part.to_f32(), dims);
                    let n = flat.len();
                    let (mut codes, mut absmax) = (vec![0u32; nf4::code_words(n)], vec![0.0f32; nf4::blocks(n)]);
                    nf4::quantize(&flat, &mut codes, &mut absmax);
                    let words = codes.iter().map(|c| f32::from_bits(*c)).chain(absmax);
                    out[piece.start..].iter_mut().zip(words).for_each(|(o, w)| *o = w);
                }
            }
        }
        FlatBuf::F32(out)
    }

    /// The unit's frozen tensors in the compute dtype (`padded_elems` of them, padding
    /// zero) from the gathered `words`.
    pub fn decode(&self, words_in: &[f32], padded_elems: usize) -> FlatBuf {
        let mut out = FlatBuf::zeros(self.dtype, padded_elems);
        for piece in &self.pieces {
            let n = piece.elems.len();
            let at = &words_in[piece.start..];
            let dst = out.as_mut().slice(piece.elems.clone());
            match piece.nf4 {
                None => {
                    let mut dst = dst;
                    dst.copy_from(unpack(&at[..words(self.dtype, n)], self.dtype, n).as_ref(), false);
                }
                Some([rows, cols]) => {
                    // Straight into Burn's order: element (i, o) is PyTorch's (o, i).
                    let (c, b) = (nf4::code_words(n), nf4::blocks(n));
                    let (codes, absmax) = (&at[..c], &at[c..c + b]);
                    let values: Vec<f32> = (0..n)
                        .map(|k| nf4::value(|w| codes[w].to_bits(), absmax, (k % cols) * rows + k / cols))
                        .collect();
                    let mut dst = dst;
                    dst.copy_from(BufRef::F32(&values), false);
                }
            }
        }
        out
    }
}

/// `values` of a `[rows, cols]` tensor in Burn's row-major order, read in PyTorch's order of
/// the same weight: `[cols, rows]` row-major (the transpose).
fn torch_order(values: &[f32], [rows, cols]: [usize; 2]) -> Vec<f32> {
    (0..rows * cols).map(|k| values[(k % rows) * cols + k / rows]).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A unit of a 3 x 70 weight (NF4, a partial block) beside a bias of 5 (bf16): each
    /// weight dequantises to its level times the absmax of its PyTorch-order block, the bias
    /// keeps its bits, and the words cut into two shards hold the whole again.
    #[test]
    fn words_hold_the_nf4_weight_and_the_plain_bias() {
        let layout = FlatLayout::new([("w".to_string(), vec![3, 70]), ("b".to_string(), vec![5])], 2, 16).unwrap();
        let unit = QuantizedUnit::new(&layout, &[true, false], 2, Precision::Bf16).unwrap();
        let values: Vec<f32> = (0..layout.padded_elems()).map(|i| ((i * 37 % 101) as f32 - 50.0) / 7.0).collect();
        let values = FlatBuf::from_f32(Precision::Bf16, &values);
        let words = unit.encode(values.as_ref());
        assert_eq!(words.len(), unit.padded_words());
        let shards: Vec<f32> = (0..2).flat_map(|r| words.as_ref().slice(unit.shard_range(r)).to_f32()).collect();
        let decoded = unit.decode(&shards, layout.padded_elems()).into_f32();
        let held = values.as_ref().to_f32();
        // The weight's PyTorch order: element (o, i) of [70, 3] is Burn's (i, o).
        let torch: Vec<f32> = (0..210).map(|k| held[(k % 3) * 70 + k / 3]).collect();
        for k in 0..210 {
            let block = &torch[k / 64 * 64..(k / 64 * 64 + 64).min(210)];
            let absmax = block.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            let nearest = (nf4::LEVELS.iter())
                .min_by(|a, b| (*a * absmax - torch[k]).abs().total_cmp(&(*b * absmax - torch[k]).abs()))
                .unwrap();
            let want = half::bf16::from_f32(nearest * absmax).to_f32();
            assert_eq!(decoded[(k % 3) * 70 + k / 3], want, "weight element {k} in PyTorch's order");
        }
        let bias = layout.entries()[1].flat_range();
        assert_eq!(decoded[bias.clone()], held[bias]);
    }
}
