//! What a run of `zerotrain train` is asked ([`TrainOptions`]) and what it reports at its
//! end ([`TrainSummary`]).

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;

use zerotrain::MemoryReport;
use zerotrain::engine::HostDeviceBytes;

use super::SampleMode;

/// What `zerotrain train` was asked to do.
#[derive(Debug, Clone)]
pub struct TrainOptions {
    /// Optimizer steps to reach.
    pub steps: u64,
    /// The run folder.
    pub out: PathBuf,
    /// Continue from `<out>/checkpoints/latest`.
    pub resume: bool,
    /// Checkpoint interval, overriding `zerotrain.checkpoint_every` (0: only at the end).
    pub save_every: Option<u64>,
    /// How a token file's fine-tuning sequences go into rows, where `--packing` says
    /// (default: packed, best-fit decreasing); refused for a corpus.
    pub packing: Option<zerotrain_models::text::sequences::Packing>,
    /// Set (by SIGINT or SIGTERM) to finish the current step, save and stop.
    pub stop: Arc<AtomicBool>,
    /// Whether to write samples of the trained model at the end.
    pub samples: SampleMode,
}

/// What a run did, for the final summary.
#[derive(Debug, Clone)]
pub struct TrainSummary {
    /// The step the run started after (0, or the resumed step).
    pub first_step: u64,
    /// The step it ended at.
    pub last_step: u64,
    /// Stopped early by SIGINT or SIGTERM.
    pub interrupted: bool,
    /// Validation loss at the start and the end.
    pub val_loss: (f32, f32),
    /// Wall time of the training loop, seconds.
    pub seconds: f64,
    /// Training tokens per second over all ranks, over the steps' own time (the
    /// validations between them not counted).
    pub tokens_per_s: f64,
    /// Trainable parameters.
    pub num_params: usize,
    /// Each rank of this process at the end, in rank order.
    pub ranks: Vec<RankTotals>,
    /// Bytes rank 0 moved per step (mean).
    pub comm_bytes_per_step: u64,
    /// What the trained model wrote.
    pub samples: Samples,
    /// Where the metrics, plot and checkpoints are.
    pub out: PathBuf,
}

/// One rank at the end of a run.
#[derive(Debug, Clone, Copy)]
pub struct RankTotals {
    /// Its rank in the world.
    pub rank: usize,
    /// Its model-state memory.
    pub memory: MemoryReport,
    /// The bytes of model states copied between host memory and its device over the run's
    /// steps (the steps' reports summed); `None` on the CPU, where there is no device.
    pub host_device: Option<HostDeviceBytes>,
}

/// What a run wrote of the trained model at its end ([`SampleMode`]).
#[derive(Debug, Clone)]
pub enum Samples {
    /// Its text, a line each.
    Written(Vec<String>),
    /// None, and why.
    Withheld(String),
}
