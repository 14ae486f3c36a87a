//! The NVMe optimizer tier: one unit's fp32 master weights and optimizer state in swap
//! files, stepped tile by tile.
//!
//! # Note: tiles
//! The unit's optimizer range is cut into tiles of `sub_group_size` elements (starting at
//! 4 KiB boundaries), each with its own [`UnitOptimizer`] over its pieces of parameters.
//! For a tile the step reads the master weights and every optimizer moment, imports them
//! into the tile's optimizer, steps it, exports the new moments and writes everything back;
//! between steps the optimizer holds no state and memory holds no tile. An element-wise
//! optimizer (all of Burn's) steps a tile exactly as it steps the whole range, so the
//! offloaded step gives the in-memory step's bits. With `pipeline_read` the next tile is
//! read while this one steps; with `pipeline_write` a tile's write-back finishes while the
//! next one steps; `buffer_count` bounds the tile buffers alive (one per tensor of a tile),
//! and pipelining that would exceed it is not done.
//!
//! # Note: fp32 parameters are their own master
//! In fp32 training the model's values (stages 1-2) or the parameter shard (stage 3) equal
//! the master weights bit for bit, so only the moments are swapped and the caller passes
//! the masters in; in fp16/bf16 the masters are swapped with the moments. So are mixed
//! precision's first masters when the compute dtype holds them exactly (a bf16 checkpoint
//! trained in bf16): until the first step or a load writes the masters' file, the
//! parameters widened are the masters, and the caller passes them in. An import then
//! writes half the bytes it would (the parameters, not also the fp32 masters).

use std::ops::Range;
use std::sync::Arc;

use burn_pack::Scalar;

use crate::config::{OffloadPlan, OptimPlan};
use crate::engine::optimizer::{ExportedState, ShardSegment, UnitOptimizer};
use crate::swap::{ALIGN_ELEMS, SwapDir, SwapFile};
use crate::{Error, Result};

use crate::engine::optimizer::OptimizerFactory;

mod step;

/// One tile: its range (relative to the unit's optimizer range) and optimizer.
struct Tile {
    range: Range<usize>,
    optimizer: UnitOptimizer,
    /// Whether the state files hold this tile's state (it has stepped, or was loaded).
    has_state: bool,
}

/// What every unit's swapped optimizer is built from: the optimizer's plan and factory, the
/// offload settings and the rank's swap folder.
pub(crate) struct NvmeOptimizerSetup<'a> {
    pub optim: &'a OptimPlan,
    pub factory: &'a OptimizerFactory,
    pub offload: &'a OffloadPlan,
    pub dir: &'a Arc<SwapDir>,
}

/// The masters a unit's swapped optimizer starts from (the module notes).
pub(crate) enum FirstMasters<'a> {
    /// fp32: the parameters, always.
    Parameters,
    /// Mixed precision: these fp32 values, written to the masters' file.
    Values(&'a [f32]),
    /// Mixed precision, values the compute dtype holds exactly: the parameters widened,
    /// until the first step or a load writes the masters' file.
    ParametersUntilStepped,
}

/// One unit's swapped optimizer (module docs).
pub(crate) struct NvmeOptimizer {
    unit: usize,
    len: usize,
    tiles: Vec<Tile>,
    /// Mixed precision: the masters' file (`None` in fp32; see the module notes).
    master: Option<SwapFile>,
    /// Whether the masters' file holds the masters (else the caller passes them in).
    masters_written: bool,
    /// Each optimizer state tensor's name and file, from the first step (or a load) on.
    states: Vec<(String, SwapFile)>,
    /// The optimizer's scalars (step counts), the same for every tile.
    scalars: Vec<(String, Scalar)>,
    buffer_count: u64,
    /// Whether `states` holds every tensor the optimizer keeps: after its first step or a
    /// load. Before, a tile's buffers are not known, so nothing is pipelined.
    states_known: bool,
    pipeline_read: bool,
    pipeline_write: bool,
    dir: Arc<SwapDir>,
    /// A step failed part-way: some tiles hold the new values, some the old. Every use is
    /// an error until a checkpoint load writes the whole range again (see `tier/mod.rs`'s note
    /// on lost master weights).
    torn: bool,
}

impl NvmeOptimizer {
    /// Unit `unit`'s optimizer over a range of `len` elements whose pieces are `segments`,
    /// tiled and swapped as `with` says, starting from the masters `first` says.
    pub fn new(
        unit: usize,
        len: usize,
        segments: &[ShardSegment],
        first: FirstMasters<'_>,
        with: &NvmeOptimizerSetup<'_>,
    ) -> Result<Self> {
        let NvmeOptimizerSetup { optim, factory, offload, dir } = *with;
        let tile = (offload.sub_group_size as usize).max(ALIGN_ELEMS);
        let tiles = (0..len.div_ceil(tile).max(1))
            .map(|t| {
                let range = t * tile..((t + 1) * tile).min(len);
                let mine: Vec<ShardSegment> = segments
                    .iter()
                    .filter_map(|s| {
                        let start = s.range.start.max(range.start);
                        let end = s.range.end.min(range.end);
                        (start < end).then(|| ShardSegment {
                            path: s.path.clone(),
                            shape: s.shape.clone(),
                            param_range: s.param_range.start + (start - s.range.start)
                                ..s.param_range.start + (end - s.range.start),
                            range: start - range.start..end - range.start,
                        })
                    })
                    .collect();
                // Swapped state is always stepped in host memory.
                let optimizer = UnitOptimizer::new(range.len(), &mine, optim, factory, true);
                Tile { range, optimizer, has_state: false }
            })
            .collect();
        let file = || dir.file(&format!("u{unit}.master"), len);
        let (master, masters_written) = match first {
            FirstMasters::Parameters => (None, false),
            FirstMasters::Values(values) => {
                let file = file()?;
                file.write_slice(0, values)?;
                (Some(file), true)
            }
            FirstMasters::ParametersUntilStepped => (Some(file()?), false),
        };
        Ok(Self {
            unit,
            len,
            tiles,
            master,
            masters_written,
            states: Vec::new(),
            scalars: Vec::new(),
            buffer_count: offload.buffer_count,
            states_known: false,
            pipeline_read: offload.pipeline_read,
            pipeline_write: offload.pipeline_write,
            dir: Arc::clone(dir),
            torn: false,
        })
    }

    /// An error if a step failed part-way (see `torn`).
    fn check(&self) -> Result<()> {
        match self.torn {
            true => Err(Error::Usage(format!(
                "unit {}'s offloaded optimizer step failed part-way, so its swap files mix two steps; load a \
                 checkpoint with its optimizer states to go on",
                self.unit
            ))),
            false => Ok(()),
        }
    }

    fn create_state_files<'a>(&mut self, names: impl Iterator<Item = &'a str>) -> Result<()> {
        self.states = names
            .map(|name| {
                let file = self.dir.file(&format!("u{}.{}", self.unit, sanitize(name)), self.len)?;
                Ok((name.to_string(), file))
            })
            .collect::<Result<_>>()?;
        Ok(())
    }

    /// Replaces the optimizer state with one over the whole range (a checkpoint load; empty:
    /// no state yet).
    pub fn import(&mut self, (tensors, scalars): ExportedState) -> Result<()> {
        if let Some((name, values)) = tensors.iter().find(|(_, v)| v.len() != self.len) {
            return Err(Error::Model(format!(
                "optimizer state `{name}` has {} values for a range of {}",
                values.len(),
                self.len
            )));
        }
        self.create_state_files(tensors.iter().map(|(n, _)| n.as_str()))?;
        for ((_, file), (_, values)) in self.states.iter().zip(&tensors) {
            file.write_slice(0, values)?;
        }
        for tile in &mut self.tiles {
            tile.has_state = !tensors.is_empty();
        }
        self.states_known = !tensors.is_empty();
        self.scalars = scalars;
        // The whole range's state is written again: whatever a failed step tore is gone.
        self.torn = false;
        Ok(())
    }

    /// Whether the swap holds the masters; else they are the parameters, passed in (the
    /// module notes).
    pub fn holds_masters(&self) -> bool {
        self.masters_written
    }

    /// The masters of the whole range, if the swap holds them (checkpoints).
    pub fn masters(&self) -> Result<Option<Vec<f32>>> {
        self.check()?;
        self.written_masters().map(|f| f.read_vec(0..self.len)).transpose()
    }

    /// The masters' file, if it holds the masters.
    fn written_masters(&self) -> Option<&SwapFile> {
        self.master.as_ref().filter(|_| self.masters_written)
    }

    /// Replaces the masters (mixed precision; a checkpoint load).
    pub fn load_masters(&mut self, values: &[f32]) -> Result<()> {
        match &self.master {
            Some(file) => {
                // Written from here on, whether or not this write completes (a failed
                // load leaves the unit to be loaded again).
                self.masters_written = true;
                file.write_slice(0, values)
            }
            None => Ok(()),
        }
    }

    /// The names of the optimizer state's tensors (empty before the first step).
    pub fn state_names(&self) -> Vec<String> {
        self.states.iter().map(|(n, _)| n.clone()).collect()
    }

    /// One optimizer state tensor over the whole range, read from its file alone.
    pub fn state_tensor(&self, name: &str) -> Result<Option<Vec<f32>>> {
        self.check()?;
        self.states.iter().find(|(n, _)| n == name).map(|(_, f)| f.read_vec(0..self.len)).transpose()
    }

    /// The optimizer's scalars (step counts).
    pub fn scalars(&self) -> &[(String, Scalar)] {
        &self.scalars
    }

    /// The optimizer state over the whole range (checkpoints).
    pub fn export(&self) -> Result<ExportedState> {
        self.check()?;
        let tensors =
            self.states.iter().map(|(n, f)| Ok((n.clone(), f.read_vec(0..self.len)?))).collect::<Result<_>>()?;
        Ok((tensors, self.scalars.clone()))
    }

    /// Bytes in the swap: masters and state.
    pub fn swapped_bytes(&self) -> u64 {
        let tensors = self.states.len() + usize::from(self.master.is_some());
        (tensors * self.len * size_of::<f32>()) as u64
    }
}

/// A state name as a file name (`momentum.moment_1` stays; anything odd becomes `_`).
fn sanitize(name: &str) -> String {
    name.chars().map(|c| if c.is_ascii_alphanumeric() || c == '.' || c == '_' { c } else { '_' }).collect()
}
