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
use crate::nn::parallel::Split;
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

/// Whether a rank's part `[rows, cols]` (Burn's `[in, out]`) of a weight cut by `split`
/// over `n` ranks quantises to the whole weight's values: each block of the whole, along
/// PyTorch's `[out, in]` order, lies within one rank's part and starts a block of it. A
/// cut of the inputs (a row-parallel layer) gives each rank a run of `in / n` of every
/// output's inputs (one run per fused block), which must hold whole blocks; a cut of the
/// outputs (column-parallel) gives it runs of whole outputs, whose `in` values each must
/// make whole blocks together. The error says which tensor and what must divide.
pub(super) fn check_cut(path: &str, [rows, cols]: [usize; 2], split: Split, n: usize) -> Result<(), String> {
    let block = nf4::BLOCK;
    match split {
        _ if n == 1 => Ok(()),
        Split::Whole => Ok(()),
        Split::Even { dim: 0, blocks } => {
            let run = rows / blocks.max(1);
            match run.is_multiple_of(block) {
                true => Ok(()),
                false => Err(format!(
                    "{path}'s inputs are cut over {n} ranks into runs of {run}, and NF4's blocks of {block} run \
                     along each output's inputs: each rank's run must be a multiple of {block}"
                )),
            }
        }
        Split::Even { dim: 1, blocks } => {
            let run = cols / blocks.max(1) * rows;
            match run.is_multiple_of(block) {
                true => Ok(()),
                false => Err(format!(
                    "{path}'s outputs are cut over {n} ranks into runs of {} outputs of {rows} inputs, {run} values, \
                     and NF4's blocks of {block} run along the whole tensor: each run must be a multiple of {block}",
                    cols / blocks.max(1)
                )),
            }
        }
        Split::Even { dim, .. } | Split::Uneven { dim } => {
            Err(format!("{path} is cut on its dimension {dim} ({split:?}), which NF4's blocks are not laid along"))
        }
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

    /// Rank `r`'s part of a `[rows, cols]` weight (Burn's order) cut by `split` over `n`
    /// ranks, read off `Split`'s meaning: on dimension `dim`, `blocks` blocks side by side,
    /// the rank holding its `1/n` of each, in block order.
    fn part(w: &[f32], [rows, cols]: [usize; 2], split: Split, r: usize, n: usize) -> (Vec<f32>, [usize; 2]) {
        let Split::Even { dim, blocks } = split else { unreachable!("the test cuts evenly") };
        let len = [rows, cols][dim];
        let keep: Vec<usize> = (0..blocks)
            .flat_map(|b| (0..len / blocks / n).map(move |k| b * len / blocks + r * len / blocks / n + k))
            .collect();
        match dim {
            0 => (keep.iter().flat_map(|&i| w[i * cols..(i + 1) * cols].to_vec()).collect(), [keep.len(), cols]),
            _ => ((0..rows).flat_map(|i| keep.iter().map(move |&j| w[i * cols + j])).collect(), [rows, keep.len()]),
        }
    }

    /// `w` (`[rows, cols]`) through NF4 and back.
    fn round_trip(w: &[f32], [rows, cols]: [usize; 2]) -> Vec<f32> {
        let layout = FlatLayout::new([("w".to_string(), vec![rows, cols])], 1, 16).unwrap();
        let unit = QuantizedUnit::new(&layout, &[true], 1, Precision::Fp32).unwrap();
        let mut values = w.to_vec();
        values.resize(layout.padded_elems(), 0.0);
        let words = unit.encode(BufRef::F32(&values)).into_f32();
        unit.decode(&words, layout.padded_elems()).into_f32()[..rows * cols].to_vec()
    }

    /// Where `check_cut` accepts a cut, each rank's part quantises to the whole weight's
    /// NF4 values at its positions (so tensor-parallel ranks hold what one rank would);
    /// where it refuses one, the parts' values differ from the whole's.
    #[test]
    fn parts_quantise_as_the_whole_exactly_where_the_cut_is_accepted() {
        let cases = [
            ([128, 6], Split::Even { dim: 0, blocks: 1 }, true),
            ([256, 5], Split::Even { dim: 0, blocks: 2 }, true),
            ([16, 24], Split::Even { dim: 1, blocks: 3 }, true),
            ([32, 8], Split::Even { dim: 1, blocks: 1 }, true),
            ([96, 6], Split::Even { dim: 0, blocks: 1 }, false),
            ([16, 6], Split::Even { dim: 1, blocks: 1 }, false),
            ([16, 24], Split::Even { dim: 1, blocks: 2 }, false),
        ];
        for (shape, split, fits) in cases {
            let w: Vec<f32> = (0..shape[0] * shape[1]).map(|i| ((i * 7919 % 1013) as f32 - 506.0) / 97.0).collect();
            let whole = round_trip(&w, shape);
            let mut same = true;
            for r in 0..2 {
                let (values, dims) = part(&w, shape, split, r, 2);
                let (expected, _) = part(&whole, shape, split, r, 2);
                same &= round_trip(&values, dims) == expected;
                assert_eq!(check_cut("w", dims, split, 2).is_ok(), fits, "{shape:?} {split:?}");
            }
            assert_eq!(same, fits, "{shape:?} cut by {split:?}: the parts quantise as the whole: {same}");
        }
        assert!(check_cut("w", [1, 1], Split::Uneven { dim: 1 }, 2).unwrap_err().contains("w is cut"));
        assert!(check_cut("w", [1, 1], Split::Uneven { dim: 1 }, 1).is_ok());
    }
}
