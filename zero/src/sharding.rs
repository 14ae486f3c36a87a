//! Per-unit sharding: a model's trainable parameters grouped into *units*, each unit with
//! its own [`FlatLayout`] sharded over the data-parallel ranks, and where a rank keeps its
//! pieces.
//!
//! # Note: units
//! A unit is the granule of gathering and reduction: a transformer block, the embeddings,
//! or a whole model that declares nothing. Every one of the `N` ranks that share the units
//! (the world, or in a pipeline the ranks of one stage) owns `1/N` of every unit (the unit's
//! [`FlatLayout::shard_range`]), so gathering one unit is one all-gather of that unit and no
//! rank holds a whole unit between uses. A rank keeps its shards of all units back to back
//! in one *local* buffer (unit 0's shard, then unit 1's, ...), which is what its optimizer
//! state, master weights and gradient shard cover; [`Sharding::local_range`] says where each
//! unit's shard sits in it. The length of every unit's shard is the same on every rank, so
//! so is the local layout.
//!
//! # Note: the global order
//! Checkpoints name parameters by module path and place them in one *global* order (the
//! model's visit order, unpadded), independent of the grouping into units, the world size
//! and the stage. [`Sharding::global_segments`] maps any range of a unit's flat buffer onto
//! that order, so a checkpoint written with one grouping is read back with any other by
//! re-slicing alone.
//!
//! # Note: buckets
//! A unit's gradients are reduce-scattered in buckets: bucket `k` is the same sub-range of
//! every rank's shard ([`FlatLayout::bucket_ranges`]), so its input holds `N` pieces, one
//! per rank ([`FlatLayout::piece`]), and each rank receives exactly the part of its own
//! shard that the bucket covers. The reduction stages no buffer larger than a bucket (the
//! per-parameter gradients Burn's autodiff produces are whole tensors until reduced).

use std::ops::Range;

use crate::{FlatLayout, ZeroError};

/// One unit: its name and its own flat layout over the ranks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShardedUnit {
    /// The unit's name (for messages and reports), e.g. `blocks.3`.
    pub name: String,
    /// The unit's parameters in global order, padded and sharded over the ranks.
    pub layout: FlatLayout,
    /// For each entry of `layout`, the index of the same parameter in the global layout.
    pub global_entries: Vec<usize>,
}

/// Every unit's flat layout over `world_size` ranks, and the global order they map onto.
///
/// The global order may hold parameters in no unit here: a pipeline stage's sharding has
/// its own units only, but places them in the whole model's order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sharding {
    global: FlatLayout,
    units: Vec<ShardedUnit>,
    /// `(unit, entry within the unit)` of each global entry held here.
    location: Vec<Option<(usize, usize)>>,
    /// Start of each unit's shard in the local buffer, then the local buffer's length.
    local_starts: Vec<usize>,
}

impl Sharding {
    /// Groups `params` (path, shape), given in global order, into units: parameter `i`
    /// belongs to unit `unit_of[i]` (`None`: to no unit here), and unit `u` is called
    /// `names[u]`. Each unit is padded to a multiple of `world_size * align_elems`.
    ///
    /// Errors on a unit index out of range, a unit without parameters, and whatever
    /// [`FlatLayout::new`] refuses.
    pub fn new(
        params: Vec<(String, Vec<usize>)>,
        unit_of: &[Option<usize>],
        names: Vec<String>,
        world_size: usize,
        align_elems: usize,
    ) -> Result<Self, ZeroError> {
        if unit_of.len() != params.len() {
            return Err(ZeroError::InvalidLayout(format!(
                "{} unit assignments for {} parameters",
                unit_of.len(),
                params.len()
            )));
        }
        if let Some(bad) = unit_of.iter().flatten().find(|&&u| u >= names.len()) {
            return Err(ZeroError::InvalidLayout(format!("unit {bad} of {} units", names.len())));
        }
        let global = FlatLayout::new(params.clone(), 1, 1)?;
        let mut members: Vec<Vec<usize>> = vec![Vec::new(); names.len()];
        let mut location = Vec::with_capacity(params.len());
        for (i, unit) in unit_of.iter().enumerate() {
            location.push(unit.map(|u| (u, members[u].len())));
            if let Some(u) = *unit {
                members[u].push(i);
            }
        }
        let mut units = Vec::with_capacity(names.len());
        let mut local_starts: Vec<usize> = vec![0];
        for (name, global_entries) in names.into_iter().zip(members) {
            let entries = global_entries.iter().map(|&i| params[i].clone());
            let layout = FlatLayout::new(entries, world_size, align_elems)?;
            let end = local_starts.last().copied().unwrap_or(0).checked_add(layout.shard_len());
            local_starts.push(end.ok_or_else(|| ZeroError::InvalidLayout("local buffer overflows usize".into()))?);
            units.push(ShardedUnit { name, layout, global_entries });
        }
        Ok(Self { global, units, location, local_starts })
    }

    /// Every parameter in one unit: the grouping of a model that declares none.
    pub fn single(params: Vec<(String, Vec<usize>)>, world_size: usize, align_elems: usize) -> Result<Self, ZeroError> {
        let unit_of = vec![Some(0); params.len()];
        Self::new(params, &unit_of, vec!["model".into()], world_size, align_elems)
    }

    /// The global order (visit order, unpadded, one rank): what checkpoints record.
    pub fn global(&self) -> &FlatLayout {
        &self.global
    }

    /// The units, in execution order.
    pub fn units(&self) -> &[ShardedUnit] {
        &self.units
    }

    /// Number of ranks every unit is sharded over.
    pub fn world_size(&self) -> usize {
        self.units[0].layout.world_size()
    }

    /// `(unit, entry within the unit)` of global parameter `global_entry`, if a unit here
    /// holds it.
    pub fn location(&self, global_entry: usize) -> Option<(usize, usize)> {
        self.location[global_entry]
    }

    /// Where unit `unit`'s shard sits in a rank's local buffer.
    pub fn local_range(&self, unit: usize) -> Range<usize> {
        self.local_starts[unit]..self.local_starts[unit + 1]
    }

    /// Length of a rank's local buffer: its shards of every unit.
    pub fn local_len(&self) -> usize {
        self.local_starts.last().copied().unwrap_or(0)
    }

    /// The parts of `range` (a range of unit `unit`'s flat buffer) that hold parameters, as
    /// `(range in the unit's buffer, range in the global order)` pairs in the unit's order,
    /// adjacent pieces merged. Padding maps to nothing.
    pub fn global_segments(&self, unit: usize, range: Range<usize>) -> Vec<(Range<usize>, Range<usize>)> {
        let u = &self.units[unit];
        let mut out: Vec<(Range<usize>, Range<usize>)> = Vec::new();
        for (entry, &g) in u.layout.entries().iter().zip(&u.global_entries) {
            let Some(segment) = entry.segment(range.clone()) else { continue };
            let global_start = self.global.entries()[g].offset + segment.param_range.start;
            let global = global_start..global_start + segment.param_range.len();
            match out.last_mut() {
                Some((unit_range, last)) if unit_range.end == segment.flat_range.start && last.end == global.start => {
                    unit_range.end = segment.flat_range.end;
                    last.end = global.end;
                }
                _ => out.push((segment.flat_range, global)),
            }
        }
        out
    }
}

impl FlatLayout {
    /// Splits the shard offsets `0..shard_len` into buckets of at most `bucket_elems / N`
    /// elements each (rounded down to the alignment, at least one alignment quantum), so
    /// that one bucket over all ranks holds at most `bucket_elems` elements (or `N` quanta).
    /// See the module note on buckets.
    pub fn bucket_ranges(&self, bucket_elems: u64) -> Vec<Range<usize>> {
        let align = self.align_elems();
        let per_rank = usize::try_from(bucket_elems / self.world_size() as u64).unwrap_or(usize::MAX);
        let chunk = (per_rank / align * align).max(align);
        let len = self.shard_len();
        (0..len.div_ceil(chunk)).map(|k| k * chunk..((k + 1) * chunk).min(len)).collect()
    }

    /// The piece of a bucket that rank `rank` owns: `shard_range` (offsets inside a shard)
    /// as a range of the flat buffer.
    pub fn piece(&self, rank: usize, shard_range: Range<usize>) -> Range<usize> {
        let start = self.shard_range(rank).start;
        start + shard_range.start..start + shard_range.end
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sharding(sizes: &[usize], unit_of: &[usize], units: usize, world_size: usize, align: usize) -> Sharding {
        let params = sizes.iter().enumerate().map(|(i, &n)| (format!("p{i}"), vec![n])).collect();
        let names = (0..units).map(|u| format!("u{u}")).collect();
        let unit_of: Vec<Option<usize>> = unit_of.iter().map(|&u| Some(u)).collect();
        Sharding::new(params, &unit_of, names, world_size, align).unwrap()
    }

    /// Deterministic pseudo-random groupings: a parameter may go to any unit, units may
    /// interleave in the global order (as a tied embedding does).
    fn cases() -> Vec<(Vec<usize>, Vec<usize>, usize)> {
        let mut state = 0x2545_F491_4F6C_DD1Du64;
        let mut next = move |m: usize| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state % m as u64) as usize
        };
        let mut cases = Vec::new();
        for _ in 0..300 {
            let num_params = 1 + next(9);
            let units = 1 + next(num_params.min(4));
            let sizes: Vec<usize> = (0..num_params).map(|_| 1 + next(40)).collect();
            // Every unit gets at least one parameter; the rest land anywhere.
            let mut unit_of: Vec<usize> = (0..num_params).map(|i| if i < units { i } else { next(units) }).collect();
            for i in (1..num_params).rev() {
                unit_of.swap(i, next(i + 1));
            }
            cases.push((sizes, unit_of, units));
        }
        cases
    }

    /// The global segments of every rank's shards tile the global buffer exactly once, and
    /// map each element to the same parameter element in both orders.
    #[test]
    fn every_ranks_shards_tile_the_global_order_exactly_once() {
        for (sizes, unit_of, units) in cases() {
            for world_size in [1, 2, 3, 5] {
                for align in [1, 4] {
                    let s = sharding(&sizes, &unit_of, units, world_size, align);
                    let total: usize = sizes.iter().sum();
                    assert_eq!(s.global().num_elems(), total);
                    let mut covered = vec![0u8; total];
                    for rank in 0..world_size {
                        for (u, unit) in s.units().iter().enumerate() {
                            let shard = unit.layout.shard_range(rank);
                            for (unit_range, global) in s.global_segments(u, shard.clone()) {
                                assert_eq!(unit_range.len(), global.len());
                                assert!(unit_range.start >= shard.start && unit_range.end <= shard.end);
                                for (x, g) in unit_range.zip(global) {
                                    covered[g] += 1;
                                    // Same parameter, same element, in both orders.
                                    let entry = unit.layout.entries().iter().position(|e| e.flat_range().contains(&x));
                                    let entry = entry.expect("a segment lies inside a parameter");
                                    let global_entry = &s.global().entries()[unit.global_entries[entry]];
                                    assert_eq!(x - unit.layout.entries()[entry].offset, g - global_entry.offset);
                                }
                            }
                        }
                    }
                    assert!(covered.iter().all(|&c| c == 1), "{sizes:?} {unit_of:?} N={world_size}");
                }
            }
        }
    }

    #[test]
    fn the_local_buffer_holds_each_units_shard_back_to_back() {
        let s = sharding(&[10, 3, 7], &[1, 0, 1], 2, 2, 4);
        // Unit 0: p1 (3) padded to 8, shard 4; unit 1: p0, p2 (17) padded to 24, shard 12.
        assert_eq!(s.local_range(0), 0..4);
        assert_eq!(s.local_range(1), 4..16);
        assert_eq!(s.local_len(), 16);
        assert_eq!(s.location(2), Some((1, 1)));
        assert_eq!(s.units()[1].global_entries, vec![0, 2]);
        // Unit 1's buffer is p0 then p2; p2 starts at global 13. Rank 1 owns 12..24: p2's
        // elements 2..7, then padding.
        assert_eq!(s.global_segments(1, 12..24), vec![(12..17, 15..20)]);
        // Adjacent parameters that are also adjacent globally merge into one segment.
        let t = sharding(&[4, 4, 4], &[0, 0, 0], 1, 1, 1);
        assert_eq!(t.global_segments(0, 2..10), vec![(2..10, 2..10)]);
    }

    #[test]
    fn buckets_tile_each_shard_and_their_pieces_tile_the_unit() {
        for (sizes, unit_of, units) in cases().into_iter().take(60) {
            for world_size in [1, 2, 3] {
                let s = sharding(&sizes, &unit_of, units, world_size, 4);
                for unit in s.units() {
                    let l = &unit.layout;
                    for bucket_elems in [1, 7, 16, 50, 1 << 40] {
                        let buckets = l.bucket_ranges(bucket_elems);
                        let mut next = 0;
                        for b in &buckets {
                            assert_eq!(b.start, next);
                            assert!(b.len() * world_size <= (bucket_elems as usize).max(4 * world_size));
                            next = b.end;
                        }
                        assert_eq!(next, l.shard_len());
                        let mut covered = vec![0u8; l.padded_elems()];
                        for b in &buckets {
                            for rank in 0..world_size {
                                l.piece(rank, b.clone()).for_each(|i| covered[i] += 1);
                            }
                        }
                        assert!(covered.iter().all(|&c| c == 1));
                    }
                }
            }
        }
    }

    /// A stage's sharding: parameters of other stages have no unit here but keep their
    /// place in the global order.
    #[test]
    fn parameters_in_no_unit_keep_their_global_place() {
        let params = vec![("a".to_string(), vec![4]), ("b".to_string(), vec![3]), ("c".to_string(), vec![5])];
        let s = Sharding::new(params, &[None, Some(0), None], vec!["mine".into()], 2, 1).unwrap();
        assert_eq!((s.global().num_elems(), s.location(0), s.location(1)), (12, None, Some((0, 0))));
        assert_eq!(s.units()[0].layout.num_elems(), 3);
        assert_eq!(s.global_segments(0, 0..4), vec![(0..3, 4..7)]);
    }

    #[test]
    fn bad_groupings_are_errors() {
        let params = || vec![("a".to_string(), vec![2]), ("b".to_string(), vec![3])];
        let names = || vec!["x".to_string(), "y".to_string()];
        // A unit may hold nothing (a frozen layer): an empty layout, shards of 0 elements.
        let s = Sharding::new(params(), &[Some(0), Some(0)], names(), 2, 1).unwrap();
        assert_eq!((s.units()[1].layout.padded_elems(), s.units()[1].layout.shard_len()), (0, 0));
        assert_eq!(s.local_range(1), s.local_range(0).end..s.local_range(0).end);
        assert!(Sharding::new(params(), &[Some(0), Some(2)], names(), 2, 1).is_err());
        assert!(Sharding::new(params(), &[Some(0)], names(), 2, 1).is_err());
        assert_eq!(Sharding::single(params(), 3, 2).unwrap().units().len(), 1);
    }
}
