//! [`Engine::load_checkpoint`], in the phases the module note describes: open and check
//! the checkpoint, read every rank's ranges (checking them) before any rank changes
//! anything, then install the units, the buffers and the training progress.

use burn::module::Module;
use zerotrain_checkpoint::Checkpoint;
use zerotrain_precision::LossScaler;

use super::state::{EngineState, LoadOptions};
use crate::engine::Engine;
use crate::engine::shared::Shared;
use crate::{Error, Result};

/// One unit's values as a checkpoint holds them for this rank: its master range, and each
/// optimizer-state leaf's (named without the `optim.` prefix) where they are loaded.
type UnitValues = (Vec<f32>, Vec<(String, Vec<f32>)>);

impl<M: Module> Engine<M> {
    /// Loads `<dir>/<tag>` (or the checkpoint `<dir>/latest` names) into this engine, at any
    /// world size and stage, and returns the client state saved with it. Every rank must call
    /// it.
    pub fn load_checkpoint(
        &mut self,
        dir: impl AsRef<std::path::Path>,
        tag: Option<&str>,
        options: LoadOptions,
    ) -> Result<serde_json::Value> {
        if self.window.micro_steps > 0 {
            return Err(Error::Usage(format!(
                "load_checkpoint inside an accumulation window ({} of {} micro-steps done): its gradients would \
                 mix with the loaded weights; call step() first, or load before training",
                self.window.micro_steps, self.shared.plan.batch.gradient_accumulation_steps
            )));
        }
        let opened = Checkpoint::open(dir.as_ref(), tag).map_err(Error::from).and_then(|c| {
            self.check_fits(&c, options)?;
            let state = EngineState::read(&c)?;
            Ok((c, state))
        });
        let (ckpt, state) = self.agree_all(opened, "opening the checkpoint")?;
        self.same_checkpoint(&ckpt)?;
        let reader = UnitReader::new(&ckpt, options);
        let buffers = ckpt.read_buffers().map_err(Error::from).and_then(|b| self.check_buffers(&ckpt, b));
        let buffers = self.agree(buffers, "reading the checkpoint's buffers")?;
        let loaded = self.read_units(&reader)?;
        self.install_units(&reader, loaded, &state)?;
        self.install_buffers(buffers, &ckpt);
        if !options.load_module_only {
            self.restore_progress(state, options);
        }
        Ok(ckpt.manifest().client_state.clone())
    }

    /// Every rank opened the same checkpoint (by [`Checkpoint::identity`]): ranks given
    /// different tags, or reading `latest` while another job rewrote it, would each load
    /// its shard of another checkpoint and go on training a model made of both. Every rank
    /// fails alike, naming the ranks that differ from rank 0.
    fn same_checkpoint(&self, ckpt: &Checkpoint) -> Result<()> {
        let world = self.shared.checkpoint_ranks().as_ref();
        let id = ckpt.identity();
        // In 16-bit pieces, which f32 holds exactly.
        let mine: Vec<f32> = (0..4).map(|i| ((id >> (16 * i)) & 0xffff) as f32).collect();
        let mut all = vec![0.0f32; 4 * world.world_size()];
        world.all_gather((&mine).into(), (&mut all).into())?;
        let ids: Vec<u64> =
            all.chunks(4).map(|c| c.iter().enumerate().fold(0, |id, (i, &v)| id | (v as u64) << (16 * i))).collect();
        let differ: Vec<usize> = (0..ids.len()).filter(|&r| ids[r] != ids[0]).collect();
        if differ.is_empty() {
            return Ok(());
        }
        let manifest = ckpt.manifest();
        Err(Error::Resume(format!(
            "rank(s) {differ:?} opened another checkpoint than rank 0 (rank {} opened {}, tag {:?} at step {}): \
             every rank must load the same one; give them one tag, and let no other job write `latest` while this \
             one loads",
            world.rank(),
            ckpt.dir().display(),
            manifest.tag,
            manifest.global_step
        )))
    }

    /// Every rank reads (and so checks, block by block) all it needs before any rank
    /// changes anything. An engine whose states are offloaded may not hold them all in
    /// memory: it reads everything once to check it, keeping nothing (`None`), and
    /// [`install_units`](Self::install_units) reads again one unit at a time.
    fn read_units(&self, reader: &UnitReader<'_>) -> Result<Option<Vec<UnitValues>>> {
        let streaming = self.shared.swaps.optimizer.is_some() || self.shared.swaps.param.is_some();
        let units = 0..self.units.len();
        let loaded = match streaming {
            true => units.into_iter().try_for_each(|id| reader.unit(&self.shared, id).map(drop)).map(|()| None),
            false => units.map(|id| reader.unit(&self.shared, id)).collect::<Result<Vec<_>>>().map(Some),
        };
        self.agree_all(loaded, "reading its shard of the checkpoint")
    }

    /// Puts each unit's values (`loaded`, or read again now when streaming) where the
    /// stage keeps them. The rank is torn until every unit holds the checkpoint's values
    /// (`step.rs`'s note).
    fn install_units(
        &mut self,
        reader: &UnitReader<'_>,
        loaded: Option<Vec<UnitValues>>,
        state: &EngineState,
    ) -> Result<()> {
        let mut loaded = loaded.map(Vec::into_iter);
        self.progress.torn = true;
        for id in 0..self.units.len() {
            let (master, optim) = match &mut loaded {
                Some(all) => all.next().expect("one per unit"),
                // Checked in the first pass: failing now means the files changed since, and
                // the units before this one are already loaded; the error says so.
                None => reader.unit(&self.shared, id).map_err(|e| {
                    Error::Usage(format!(
                        "{e}; the checkpoint changed while it was being loaded, and units 0..{id} hold its values: \
                         load a checkpoint again before training"
                    ))
                })?,
            };
            let model = self.model.clone();
            self.model = self.units[id].load(model, master, &self.shared)?;
            if reader.with_optimizer {
                let scalars = if optim.is_empty() { Vec::new() } else { state.optimizer_scalars.clone() };
                self.units[id].import_state((optim, scalars), &self.shared)?;
            }
        }
        self.progress.torn = false;
        Ok(())
    }

    /// The checkpoint's buffers into the model; a checkpoint written before checkpoints
    /// kept them leaves the model's with a notice.
    fn install_buffers(&mut self, buffers: Option<Vec<f32>>, ckpt: &Checkpoint) {
        match buffers {
            Some(values) => {
                let model = self.model.clone();
                self.model = self.buffers.write(model, &values, |e| !e.frozen);
            }
            None if self.buffers.saved().next().is_some() => self.notices.warn(format!(
                "{} holds no buffers (it was written before checkpoints kept them): the model's running \
                 statistics keep the values they had",
                ckpt.dir().display()
            )),
            None => {}
        }
    }

    /// The step counters, and the lr schedule's position and the loss scaler's state where
    /// `options` ask for them.
    fn restore_progress(&mut self, state: EngineState, options: LoadOptions) {
        let progress = &mut self.progress;
        if options.load_lr_scheduler_states {
            progress.lr_iteration = state.lr_iteration;
            progress.lr_override = state.lr_override;
        }
        progress.counters = state.counters;
        if let (Some(LossScaler::Dynamic { state: live, .. }), Some(saved)) = (&mut progress.scaler, state.loss_scaler)
        {
            *live = saved;
        }
    }
}

/// Reads a unit's ranges from a checkpoint, wherever (which files, which global ranges) it
/// holds them.
struct UnitReader<'a> {
    ckpt: &'a Checkpoint,
    /// The checkpoint's optimizer-state tensors (`optim.*`).
    optim_names: Vec<&'a String>,
    /// Whether the optimizer's state is loaded (`load_optimizer_states`, not module-only).
    with_optimizer: bool,
}

impl<'a> UnitReader<'a> {
    fn new(ckpt: &'a Checkpoint, options: LoadOptions) -> Self {
        let optim_names = ckpt.manifest().tensors.iter().filter(|t| t.starts_with("optim.")).collect();
        Self { ckpt, optim_names, with_optimizer: options.load_optimizer_states && !options.load_module_only }
    }

    /// Unit `id`'s master range and, where loaded, its optimizer-state ranges.
    fn unit(&self, shared: &Shared, id: usize) -> Result<UnitValues> {
        let master = self.range(shared, id, "master")?;
        let mut optim = Vec::new();
        if self.with_optimizer {
            for name in &self.optim_names {
                optim.push((name["optim.".len()..].to_string(), self.range(shared, id, name)?));
            }
        }
        Ok((master, optim))
    }

    /// Unit `id`'s optimizer range of tensor `name`, from the global ranges it maps to.
    fn range(&self, shared: &Shared, id: usize, name: &str) -> Result<Vec<f32>> {
        let range = shared.optimizer_range(id);
        let mut values = vec![0.0; range.len()];
        for (unit_range, global) in shared.checkpoint_segments(id, shared.optimizer_real_range(id), false) {
            let out = &mut values[unit_range.start - range.start..unit_range.end - range.start];
            self.ckpt.read_range(name, global.start as u64..global.end as u64, out)?;
        }
        Ok(values)
    }
}
