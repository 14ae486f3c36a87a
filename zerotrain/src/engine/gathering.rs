//! Stage 3's gathering of units: every unit for a whole-model call, one unit (and a
//! prefetched neighbour within `stage3_prefetch_bucket_size` and
//! `stage3_max_live_parameters`) as the unit walk enters it, release, and the gathered
//! peak the memory report gives.

use std::time::Instant;

use burn::module::Module;

use super::Engine;
use super::model::UnitModel;
use crate::Result;

/// Which way the walk goes, for prefetching.
#[derive(Clone, Copy)]
pub(super) enum Direction {
    Forward,
    Backward,
}

impl<M: Module> Engine<M> {
    /// Stage 3: gathers every unit into the model (each fetch started before the previous
    /// unit is written, so transfers overlap writes). Nothing to do at stages 0-2.
    pub(super) fn gather_all(&mut self) -> Result<()> {
        if !self.shared.plan.zero.stage.shards_parameters() {
            return Ok(());
        }
        for id in 0..self.units.len() {
            if let Some(next) = self.units.get_mut(id + 1) {
                next.fetch(&self.shared)?;
            }
            self.gather(id)?;
        }
        Ok(())
    }

    /// Makes unit `id` present in the model (stage 3) and records the gathered peak and
    /// the time.
    pub(super) fn gather(&mut self, id: usize) -> Result<()> {
        let start = Instant::now();
        let model = self.model.clone();
        let (model, bytes) = self.units[id].gather(model, &self.shared, &mut self.window.times)?;
        self.model = model;
        self.note_gathered(bytes);
        self.window.times.gather += self.shared.phase_seconds(start);
        Ok(())
    }

    /// Stage 3: releases unit `id` from the model.
    pub(super) fn release(&mut self, id: usize) {
        if self.shared.plan.zero.stage.shards_parameters()
            && (self.units[id].is_gathered() || self.units[id].is_fetching())
        {
            let model = self.model.clone();
            self.model = self.units[id].release(model, &self.shared);
        }
    }

    /// Updates the peaks after a gather whose buffer held `buffer_bytes`: the gathered
    /// units and fetches in flight now.
    pub(super) fn note_gathered(&mut self, buffer_bytes: u64) {
        let elem_bytes = self.shared.dtype().bytes_per_elem() as u64;
        let live: u64 = self
            .units
            .iter()
            .filter(|u| u.is_gathered() || u.is_fetching())
            .map(|u| u.gathered_elems(&self.shared))
            .sum();
        self.peaks.gathered = self.peaks.gathered.max(live * elem_bytes);
        self.peaks.transient = self.peaks.transient.max(buffer_bytes);
    }
}

impl<M: UnitModel> Engine<M> {
    /// Before unit `i` runs: gathers it (stage 3) and prefetches the next unit in
    /// `direction` if the bounds allow.
    pub(super) fn enter(&mut self, i: usize, direction: Direction) -> Result<()> {
        if !self.shared.plan.zero.stage.shards_parameters() {
            return Ok(());
        }
        self.gather(i)?;
        let next = match direction {
            Direction::Forward => i + 1,
            Direction::Backward => i.wrapping_sub(1),
        };
        if next >= self.walk().0 || !self.may_prefetch(i, next) {
            return Ok(());
        }
        self.units[next].fetch(&self.shared)?;
        self.note_gathered(0);
        Ok(())
    }

    /// Whether unit `next` may be fetched while unit `current` is in use: it fits the
    /// prefetch bucket, and the gathered elements beyond the unit in use stay within
    /// `stage3_max_live_parameters`.
    fn may_prefetch(&self, current: usize, next: usize) -> bool {
        let zero = &self.shared.plan.zero;
        let size = self.units[next].gathered_elems(&self.shared);
        let beyond: u64 = (0..self.units.len())
            .filter(|&id| id != current && (self.units[id].is_gathered() || self.units[id].is_fetching()))
            .map(|id| self.units[id].gathered_elems(&self.shared))
            .sum();
        !self.units[next].is_gathered()
            && size <= zero.prefetch_bucket_size
            && beyond + size <= zero.max_live_parameters
    }
}
