//! One-time warnings: where the engine runs a model otherwise than its user may believe
//! (a setting the path ignores, a layer no unit claims, a short micro-batch), it says so
//! once, on world rank 0's standard error, and keeps the message for
//! [`Engine::notices`](super::Engine::notices).

use burn::module::Module;

use super::{Engine, Granularity};

/// The warnings an engine gave.
#[derive(Debug, Default)]
pub(crate) struct Notices {
    given: Vec<String>,
    /// Whether this rank prints them (world rank 0).
    lead: bool,
}

impl Notices {
    /// Notices of a rank that prints them if `lead`.
    pub fn new(lead: bool) -> Self {
        Self { given: Vec::new(), lead }
    }

    /// Gives `message` unless it was given before.
    pub fn warn(&mut self, message: String) {
        if self.given.contains(&message) {
            return;
        }
        if self.lead {
            eprintln!("zerotrain: warning: {message}");
        }
        self.given.push(message);
    }

    /// Every message given, in order.
    pub fn all(&self) -> &[String] {
        &self.given
    }
}

impl<M: Module> Engine<M> {
    /// The notes a model declared in units gets once: which parameters the root holds, and
    /// what stage 3 without recomputation keeps.
    pub(super) fn note_layout(&mut self, root_paths: &[String]) {
        if !root_paths.is_empty() {
            let shown: Vec<&str> = root_paths.iter().take(8).map(String::as_str).collect();
            let more = root_paths.len().saturating_sub(shown.len());
            let more = if more > 0 { format!(" and {more} more") } else { String::new() };
            self.notices.warn(format!(
                "no declared unit claims {}{more}: they form the root unit, gathered for the whole pass (right for \
                 a parameter two units share; otherwise list them in a unit)",
                shown.join(", ")
            ));
        }
        let recompute =
            matches!(self.granularity, Granularity::Declared { recompute_every, .. } if recompute_every > 0);
        if self.shared.plan.zero.stage.shards_parameters() && !recompute {
            self.notices.warn(
                "stage 3 without activation_checkpointing: each unit stays gathered from its forward until its \
                 backward (Burn's autodiff graph holds its weights), so the peak is about the whole model; add an \
                 activation_checkpointing section to release each unit after its forward"
                    .into(),
            );
        }
    }

    /// With parameters on NVMe: how many of their shards `offload_param.max_in_cpu` keeps in
    /// memory instead (DeepSpeed's default, 1e9 elements, keeps a model of fewer whole:
    /// the step report then lists them as parameters in memory, as without offload).
    pub(super) fn note_param_cache(&mut self) {
        if self.shared.swaps.param.is_none() {
            return;
        }
        let kept: Vec<u64> = self.units.iter().map(super::unit::Unit::shard_bytes).filter(|&b| b > 0).collect();
        if kept.is_empty() {
            return;
        }
        let (bytes, units) = (kept.iter().sum::<u64>(), self.units.len());
        self.notices.warn(format!(
            "zero_optimization.offload_param.max_in_cpu ({} elements) keeps the parameter shards of {} of the {units} \
             units in memory, {bytes} bytes on this rank, not on NVMe; set it to 0 to hold in memory only the units \
             in use",
            self.shared.plan.zero.offload.max_in_cpu,
            kept.len()
        ));
    }

    /// At stage 3 over several ranks: how many parameters `stage3_param_persistence_threshold`
    /// keeps whole on every rank, and what they cost there (DeepSpeed's default of 1e5
    /// elements keeps a small model entirely unsharded). One rank's shard is the whole.
    pub(super) fn note_persistence(&mut self) {
        let plan = &self.shared.plan;
        if !plan.zero.stage.shards_parameters() || self.shared.comm.world_size() == 1 {
            return;
        }
        let threshold = plan.zero.param_persistence_threshold;
        let (mut tensors, mut elems, mut total) = (0usize, 0u64, 0u64);
        for unit in self.shared.sharding.units() {
            for entry in unit.layout.entries() {
                total += entry.num_elems as u64;
                if entry.num_elems as u64 <= threshold {
                    tensors += 1;
                    elems += entry.num_elems as u64;
                }
            }
        }
        if elems == 0 {
            return;
        }
        let bytes = elems * plan.precision.compute.bytes_per_elem() as u64;
        let ranks = self.shared.comm.world_size() as u64;
        self.notices.warn(format!(
            "stage 3 keeps {elems} of {total} parameters ({:.1}%, {tensors} tensors of <= {threshold} elements: \
             zero_optimization.stage3_param_persistence_threshold) whole on every rank: {bytes} bytes each, \
             against {} sharded; lower the threshold to shard them",
            100.0 * elems as f64 / total.max(1) as f64,
            bytes.div_ceil(ranks)
        ));
    }
}
