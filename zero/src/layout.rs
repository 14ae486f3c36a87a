//! The flat layout: where every trainable parameter of one unit (see `sharding`) lives in
//! one padded flat buffer, and which contiguous range of that buffer each rank owns.
//!
//! # Note: padding
//! The flat buffer holds the parameters in visit order, back to back, then zeros up to a
//! multiple of `world_size * align_elems` (`world_size` here is the number of ranks that
//! share the unit: the data-parallel ranks, a pipeline stage's group in a pipeline). Every
//! rank owns an equal shard `[rank * shard_len, (rank + 1) * shard_len)`, so collectives
//! with equal chunk sizes (a ring reduce-scatter, NCCL's) work directly on it. The padding
//! always lands in the last shard(s); with fewer elements than ranks, whole shards are
//! padding. A parameter may straddle two or more shards. This module is the only place that
//! does this arithmetic: the engine, the checkpoint writer and the resharding reader all
//! ask it.

use std::ops::Range;

use crate::ZeroError;

/// One trainable parameter's place in the flat buffer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FlatEntry {
    /// Module path, e.g. `blocks.0.attn.query.weight`: the stable key (ParamIds are random).
    pub path: String,
    /// The parameter's shape.
    pub shape: Vec<usize>,
    /// First element of the parameter in the flat buffer.
    pub offset: usize,
    /// Number of elements (product of `shape`).
    pub num_elems: usize,
}

impl FlatEntry {
    /// The parameter's range in the flat buffer.
    pub fn flat_range(&self) -> Range<usize> {
        self.offset..self.offset + self.num_elems
    }

    /// The part of this parameter that falls inside `range` of the flat buffer, if any
    /// (padding belongs to no parameter, so a range of padding yields none).
    pub fn segment(&self, range: Range<usize>) -> Option<Segment> {
        let start = self.offset.max(range.start);
        let end = (self.offset + self.num_elems).min(range.end);
        (start < end).then(|| Segment { param_range: start - self.offset..end - self.offset, flat_range: start..end })
    }
}

/// A piece of one parameter that falls inside a flat range (see [`FlatEntry::segment`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Segment {
    /// Element range inside the parameter (row-major, flattened).
    pub param_range: Range<usize>,
    /// The same elements' range in the flat buffer.
    pub flat_range: Range<usize>,
}

/// The flat layout of a model's trainable parameters over `world_size` ranks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FlatLayout {
    entries: Vec<FlatEntry>,
    num_elems: usize,
    padded_elems: usize,
    world_size: usize,
    align_elems: usize,
}

impl FlatLayout {
    /// Lays out `params` (path, shape) in the given order over `world_size` ranks, padding
    /// the total to a multiple of `world_size * align_elems`.
    ///
    /// Errors on a zero world size or alignment, a duplicate path, or sizes that overflow.
    pub fn new<I>(params: I, world_size: usize, align_elems: usize) -> Result<Self, ZeroError>
    where
        I: IntoIterator<Item = (String, Vec<usize>)>,
    {
        if world_size == 0 || align_elems == 0 {
            return Err(ZeroError::InvalidLayout(format!(
                "world_size ({world_size}) and align_elems ({align_elems}) must be at least 1"
            )));
        }
        let mut entries: Vec<FlatEntry> = Vec::new();
        let mut seen = std::collections::HashSet::new();
        let mut offset = 0usize;
        for (path, shape) in params {
            if !seen.insert(path.clone()) {
                return Err(ZeroError::InvalidLayout(format!("duplicate parameter path `{path}`")));
            }
            let num_elems =
                shape.iter().try_fold(1usize, |acc, &d| acc.checked_mul(d)).ok_or_else(|| overflow(&path))?;
            let next = offset.checked_add(num_elems).ok_or_else(|| overflow(&path))?;
            entries.push(FlatEntry { path, shape, offset, num_elems });
            offset = next;
        }
        let quantum = world_size.checked_mul(align_elems).ok_or_else(|| overflow("world_size * align_elems"))?;
        let padded_elems = offset.div_ceil(quantum).checked_mul(quantum).ok_or_else(|| overflow("padded size"))?;
        Ok(Self { entries, num_elems: offset, padded_elems, world_size, align_elems })
    }

    /// The parameters in flat order.
    pub fn entries(&self) -> &[FlatEntry] {
        &self.entries
    }

    /// Number of real (unpadded) elements: the model's Ψ.
    pub fn num_elems(&self) -> usize {
        self.num_elems
    }

    /// Length of the padded flat buffer (`world_size * shard_len`).
    pub fn padded_elems(&self) -> usize {
        self.padded_elems
    }

    /// Number of ranks the buffer is split over.
    pub fn world_size(&self) -> usize {
        self.world_size
    }

    /// Shards are a multiple of this many elements.
    pub fn align_elems(&self) -> usize {
        self.align_elems
    }

    /// Elements per shard (equal for every rank, padding included).
    pub fn shard_len(&self) -> usize {
        self.padded_elems / self.world_size
    }

    /// The flat range owned by `rank`.
    ///
    /// # Panics
    /// If `rank >= world_size` (a programmer error: ranks come from the communicator).
    pub fn shard_range(&self, rank: usize) -> Range<usize> {
        assert!(rank < self.world_size, "rank {rank} out of range for world size {}", self.world_size);
        let len = self.shard_len();
        rank * len..(rank + 1) * len
    }

    /// The part of `rank`'s shard that holds real parameters (the rest is padding).
    pub fn shard_real_range(&self, rank: usize) -> Range<usize> {
        let range = self.shard_range(rank);
        range.start..self.num_elems.clamp(range.start, range.end)
    }

    /// The index of the parameter at `path`, if any.
    pub fn position(&self, path: &str) -> Option<usize> {
        self.entries.iter().position(|e| e.path == path)
    }
}

fn overflow(what: &str) -> ZeroError {
    ZeroError::InvalidLayout(format!("size of `{what}` overflows usize"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout(sizes: &[usize], world_size: usize, align: usize) -> FlatLayout {
        let params = sizes.iter().enumerate().map(|(i, &n)| (format!("p{i}"), vec![n]));
        FlatLayout::new(params, world_size, align).unwrap()
    }

    /// Exhaustive over small cases: shards are disjoint, cover the padded buffer, and the
    /// parameters' segments in all shards together cover every element exactly once.
    #[test]
    fn shards_are_disjoint_covering_and_segments_tile_every_parameter() {
        let size_sets: &[&[usize]] = &[
            &[],
            &[0],
            &[1],
            &[3],
            &[0, 5, 0],
            &[7, 1, 13],
            &[2, 2, 2, 2],
            &[17],
            &[1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1],
            &[100, 3, 64, 9],
        ];
        for sizes in size_sets {
            for world_size in 1..=9 {
                for align in [1, 2, 4, 8] {
                    check_layout(&layout(sizes, world_size, align), sizes, align);
                }
            }
        }
    }

    fn check_layout(l: &FlatLayout, sizes: &[usize], align: usize) {
        let total: usize = sizes.iter().sum();
        assert_eq!(l.num_elems(), total);
        assert_eq!(l.padded_elems() % (l.world_size() * align), 0);
        assert!(l.padded_elems() >= total && l.padded_elems() - total < l.world_size() * align);
        let mut next = 0;
        let mut covered = vec![0u8; total];
        for rank in 0..l.world_size() {
            let r = l.shard_range(rank);
            assert_eq!(r.start, next, "shards must be contiguous and disjoint");
            assert_eq!(r.len() % align, 0);
            next = r.end;
            let real = l.shard_real_range(rank);
            assert!(real.start >= r.start && real.end <= r.end);
            for (e, s) in l.entries().iter().filter_map(|e| Some((e, e.segment(r.clone())?))) {
                assert_eq!(s.flat_range.len(), s.param_range.len());
                assert_eq!(s.flat_range.start, e.offset + s.param_range.start);
                assert!(s.flat_range.start >= r.start && s.flat_range.end <= r.end);
                for i in s.flat_range.clone() {
                    covered[i] += 1;
                }
            }
        }
        assert_eq!(next, l.padded_elems(), "shards must cover the padded buffer");
        assert!(covered.iter().all(|&c| c == 1), "every element in exactly one shard");
    }

    #[test]
    fn fewer_elements_than_ranks_pads_whole_shards() {
        let l = layout(&[3], 5, 1);
        assert_eq!(l.padded_elems(), 5);
        assert_eq!(l.shard_len(), 1);
        assert_eq!(l.shard_real_range(3), 3..3);
        assert_eq!(l.entries()[0].segment(l.shard_range(4)), None);
        assert_eq!(l.entries()[0].segment(l.shard_range(2)).unwrap().param_range, 2..3);
    }

    #[test]
    fn a_parameter_straddles_shards() {
        // p0 has 10 elements over 4 ranks with shard_len 3: it spans ranks 0..=3.
        let l = layout(&[10, 2], 4, 1);
        assert_eq!(l.shard_len(), 3);
        let seg: Vec<_> = l.entries().iter().filter_map(|e| e.segment(l.shard_range(3))).collect();
        assert_eq!(seg.len(), 2);
        assert_eq!((seg[0].param_range.clone(), seg[0].flat_range.clone()), (9..10, 9..10));
        assert_eq!((seg[1].param_range.clone(), seg[1].flat_range.clone()), (0..2, 10..12));
    }

    #[test]
    fn invalid_inputs_are_errors() {
        assert!(FlatLayout::new(Vec::new(), 0, 1).is_err());
        assert!(FlatLayout::new(Vec::new(), 1, 0).is_err());
        let dup = vec![("a".to_string(), vec![1]), ("a".to_string(), vec![2])];
        assert!(matches!(FlatLayout::new(dup, 1, 1), Err(ZeroError::InvalidLayout(m)) if m.contains("`a`")));
        let huge = vec![("big".to_string(), vec![usize::MAX, 2])];
        assert!(FlatLayout::new(huge, 1, 1).is_err());
    }
}
