//! The inference walk: [`Engine::evaluate`] runs the declared units in inference mode, one
//! at a time, with no autodiff graph (the pipeline's evaluation walks its stage's units the
//! same way).

use super::gathering::Direction;
use super::model::UnitModel;
use super::unit_walk::Pass;
use super::{Engine, Granularity};
use crate::{Error, Result};

impl<M: UnitModel> Engine<M> {
    /// The loss of `batch` without gradients, one unit at a time (stage 3: each unit
    /// gathered and released in turn), in inference mode: buffers (running statistics) are
    /// read, averaged over the ranks first, and not updated. The units' own loss terms are
    /// training terms and are not included. Neither its time nor its traffic counts in the
    /// next step's report. Every rank must call it.
    pub fn evaluate(&mut self, batch: &M::Batch) -> Result<f32> {
        Ok(self.evaluate_many(std::slice::from_ref(batch))?[0])
    }

    /// [`evaluate`](Self::evaluate) of each of `batches`, unit by unit: each unit runs on
    /// every batch in turn before the next unit, so at stage 3 it is gathered once for all
    /// of them, not once per batch; their activations between two units are held meanwhile.
    /// Each loss is the one `evaluate` gives that batch, bit for bit. Every rank must call
    /// it, with as many batches.
    pub fn evaluate_many(&mut self, batches: &[M::Batch]) -> Result<Vec<f32>> {
        if !matches!(self.granularity, Granularity::Declared { .. }) {
            return Err(Error::Usage("evaluate needs an engine built with Engine::with_units".into()));
        }
        if batches.is_empty() {
            return Ok(Vec::new());
        }
        self.off_the_clock(|engine| engine.sync_buffers().and_then(|()| engine.evaluate_units(batches)))
    }

    fn evaluate_units(&mut self, batches: &[M::Batch]) -> Result<Vec<f32>> {
        let root = self.granularity.root();
        let root_was_released = root.is_some_and(|r| !self.units[r].is_gathered());
        if let Some(root) = root {
            self.gather(root)?;
        }
        let outputs = self.infer_units_many(batches.iter().map(|_| None).collect(), batches)?;
        let valid = self.model.valid();
        let losses: Result<Vec<f32>> = (outputs.into_iter().zip(batches))
            .map(|(o, b)| super::readout::read_scalar(valid.output_loss(o, b), "the evaluation loss"))
            .collect();
        if root_was_released && let Some(root) = root {
            self.release(root);
        }
        let mut losses = losses?;
        self.sequence_mean(&mut losses)?;
        Ok(losses)
    }

    /// Each of `losses` (this rank's, of its part of every sequence under sequence
    /// parallelism) made the whole sequences' loss: the mean over the model's sequence
    /// group, whose parts are equally long (the context divides by its size). Without
    /// sequence parallelism, unchanged. Every rank of the group must call it.
    pub(super) fn sequence_mean(&self, losses: &mut [f32]) -> Result<()> {
        let Some(split) = self.model.valid().model_split() else { return Ok(()) };
        let sp = split.sequence.size();
        if sp == 1 {
            return Ok(());
        }
        split.sequence.collective().all_reduce(losses.into(), zerotrain_zero::ReduceOp::Sum)?;
        losses.iter_mut().for_each(|l| *l /= sp as f32);
        Ok(())
    }

    /// Runs every declared unit in inference mode from `input`, each gathered for its run
    /// and released after if it was released before. Returns the last output.
    pub(super) fn infer_units(&mut self, hidden: Option<M::Hidden>, batch: &M::Batch) -> Result<M::Hidden> {
        let mut outputs = self.infer_units_many(vec![hidden], std::slice::from_ref(batch))?;
        Ok(outputs.pop().expect("one batch in, one output out"))
    }

    /// [`infer_units`](Self::infer_units) of each of `batches` from its input in `hidden`,
    /// unit-major: each unit gathered once for all of them.
    fn infer_units_many(&mut self, mut hidden: Vec<Option<M::Hidden>>, batches: &[M::Batch]) -> Result<Vec<M::Hidden>> {
        for i in 0..self.walk().0 {
            let was_released = !self.units[i].is_gathered();
            self.enter(i, Direction::Forward)?;
            for (h, batch) in hidden.iter_mut().zip(batches) {
                *h = Some(self.run_unit(i, h.take(), batch, Pass::Infer)?.0);
            }
            if was_released {
                self.release(i);
            }
        }
        Ok(hidden.into_iter().map(|h| h.expect("at least one unit")).collect())
    }
}
