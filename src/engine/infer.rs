//! The inference walk: [`Engine::evaluate`] runs the declared units in inference mode, one
//! at a time, with no autodiff graph (the pipeline's evaluation walks its stage's units the
//! same way).

use super::model::UnitModel;
use super::unit_walk::{Direction, Pass};
use super::{Engine, Granularity};
use crate::{Error, Result};

impl<M: UnitModel> Engine<M> {
    /// The loss of `batch` without gradients, one unit at a time (stage 3: each unit
    /// gathered and released in turn), in inference mode: buffers (running statistics) are
    /// read, averaged over the ranks first, and not updated. The units' own loss terms are
    /// training terms and are not included. Neither its time nor its traffic counts in the
    /// next step's report. Every rank must call it.
    pub fn evaluate(&mut self, batch: &M::Batch) -> Result<f32> {
        if !matches!(self.granularity, Granularity::Declared { .. }) {
            return Err(Error::Usage("evaluate needs an engine built with Engine::with_units".into()));
        }
        self.off_the_clock(|engine| engine.sync_buffers().and_then(|()| engine.evaluate_units(batch)))
    }

    fn evaluate_units(&mut self, batch: &M::Batch) -> Result<f32> {
        let root = self.granularity.root();
        let root_was_released = root.is_some_and(|r| !self.units[r].is_gathered());
        if let Some(root) = root {
            self.gather(root)?;
        }
        let output = self.infer_units(None, batch)?;
        let loss = self.model.valid().output_loss(output, batch).into_scalar::<f32>();
        if root_was_released && let Some(root) = root {
            self.release(root);
        }
        Ok(loss)
    }

    /// Runs every declared unit in inference mode from `input`, each gathered for its run
    /// and released after if it was released before. Returns the last output.
    pub(super) fn infer_units(&mut self, mut hidden: Option<M::Hidden>, batch: &M::Batch) -> Result<M::Hidden> {
        for i in 0..self.walk().0 {
            let was_released = !self.units[i].is_gathered();
            self.enter(i, Direction::Forward)?;
            hidden = Some(self.run_unit(i, hidden.take(), batch, Pass::Infer)?.0);
            if was_released {
                self.release(i);
            }
        }
        Ok(hidden.expect("at least one unit"))
    }
}
