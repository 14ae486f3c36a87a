//! What the engine reports: each step ([`StepReport`], [`PhaseTimes`]), the memory a rank
//! holds ([`MemoryReport`]) and DeepSpeed's step [`Counters`].

use std::time::Instant;

use burn::tensor::{FloatDType, Tensor};
use zerotrain_zero::{CommStats, Completed, Pending};

use crate::Result;

/// What one optimizer step did.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepReport {
    /// `global_steps` after this step.
    pub global_step: u64,
    /// Mean loss over every rank and micro-step of the step (with the units' extra loss
    /// terms, as back-propagated).
    pub loss: f32,
    /// The learning rate the step used (the default group's; a parameter group's is this
    /// times its `lr` scale).
    pub lr: f64,
    /// Global L2 norm of the averaged gradient, before clipping (inf or NaN on overflow).
    pub grad_norm: f32,
    /// The gradients were not finite and the step was skipped: parameters, optimizer state
    /// and the lr schedule are unchanged (see `precision.check_grad_overflow`).
    pub skipped: bool,
    /// The loss scale the step's gradients carried (1 without fp16 scaling).
    pub loss_scale: f64,
    /// The loss scale for the next step (differs after an fp16 overflow or growth).
    pub next_loss_scale: f64,
    /// Bytes this rank moved in collectives during the step's window (evaluation between
    /// steps not counted).
    pub comm_bytes: u64,
    /// Model-state bytes (gradients, parameters, master weights) this rank copied between
    /// host memory and its device during the step's window; zero on the CPU.
    pub host_device: HostDeviceBytes,
    /// Times this rank's host waited for its device to read the loss or the gradient norm
    /// during the step's window (0 on the CPU, where nothing is queued): one per micro-step
    /// (its loss), the norm coming back with the window's last loss where the gradients are
    /// on the device (or needing no read on the host); one more at the step where it is read
    /// apart (a pipeline stage, whose shared weights' gradient is summed over the stages).
    pub device_reads: u64,
    /// Where the step's time went (its micro-steps included; evaluation not).
    pub times: PhaseTimes,
}

/// Bytes copied between host memory and a rank's device, each way.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct HostDeviceBytes {
    /// Host memory -> device.
    pub to_device: u64,
    /// Device -> host memory.
    pub to_host: u64,
}

impl HostDeviceBytes {
    /// The bytes between `earlier` and `self`.
    pub fn since(&self, earlier: &Self) -> Self {
        Self { to_device: self.to_device - earlier.to_device, to_host: self.to_host - earlier.to_host }
    }

    /// `self` and `other` together.
    pub fn plus(&self, other: &Self) -> Self {
        Self { to_device: self.to_device + other.to_device, to_host: self.to_host + other.to_host }
    }
}

/// What a rank's counters say at one moment: collective traffic and host<->device copies.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct Traffic {
    pub comm: CommStats,
    pub crossed: HostDeviceBytes,
    /// Reads of the loss or the gradient norm from the device.
    pub reads: u64,
}

/// Where one optimizer step's wall time went (DeepSpeed's `wall_clock_breakdown`), seconds.
/// The first five phases partition the compute thread's time; `comm_wait` is the part of
/// `reduce` and `gather` spent blocked on collectives, `comm_busy` the time collectives ran
/// (on the communication thread, overlapping compute when they can).
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize)]
pub struct PhaseTimes {
    /// Forward passes (the closures, or the units and the loss).
    pub forward: f64,
    /// Back-propagation, recomputation of checkpointed units included.
    pub backward: f64,
    /// Collecting and reducing gradients (buckets, reduce-scatter / all-reduce, norm,
    /// overflow check).
    pub reduce: f64,
    /// The optimizer on the rank's range.
    pub optimizer: f64,
    /// Putting parameters in place: all-gathers and writing them into the model.
    pub gather: f64,
    /// Time the compute thread waited for collectives to finish.
    pub comm_wait: f64,
    /// Time the collectives themselves took.
    pub comm_busy: f64,
    /// Pipeline stages: time waiting for activations and gradients from the neighbouring
    /// stages, and at the flush for the last stage to finish (the bubble, and any
    /// imbalance); outside the other phases but for the flush, which is part of `reduce`.
    pub pipe_wait: f64,
}

impl PhaseTimes {
    /// Waits for `pending`, counting the wait (`comm_wait`) and the collective's own time
    /// (`comm_busy`).
    pub(crate) fn wait_for(&mut self, pending: Pending) -> Result<Completed> {
        let start = Instant::now();
        let done = pending.wait();
        self.comm_wait += start.elapsed().as_secs_f64();
        let done = done?;
        self.comm_busy += done.busy.as_secs_f64();
        Ok(done)
    }

    /// The compute thread's phases together.
    pub fn total(&self) -> f64 {
        self.forward + self.backward + self.reduce + self.optimizer + self.gather
    }
}

/// Model-state bytes one rank holds, by kind (see [`Engine::memory_report`](super::Engine::memory_report)).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MemoryReport {
    /// Trainable parameters in the model (compute dtype) plus, at stage 3, the parameter
    /// shards kept in memory (fp32 training's held shards, or compute-dtype copies when the
    /// optimizer is offloaded).
    pub params: u64,
    /// Gradient accumulators, at the size they have while a window accumulates (each is
    /// allocated by the window's first backward and freed at the step).
    pub grads: u64,
    /// Separate fp32 master weights (mixed precision; in fp32 training the parameters are
    /// their own master).
    pub master: u64,
    /// Optimizer state.
    pub optimizer: u64,
    /// Frozen parameters (a LoRA run's base), in memory: the model's whole copy below
    /// stage 3; at stage 3 this rank's shards plus what the model holds now (resident
    /// tensors, units gathered).
    pub frozen: u64,
    /// Bytes in NVMe swap files (`offload_optimizer` / `offload_param` with device
    /// `nvme`): master weights, optimizer state and parameter shards kept there instead of
    /// in memory. Not part of [`model_states`](Self::model_states).
    pub swapped: u64,
    /// Largest total of transient buffers alive at once inside a micro-step or step so far.
    pub peak_transient: u64,
    /// Stage 3: most bytes of gathered parameters alive at once so far in training (units
    /// in the model or being fetched), in the compute dtype; resident parameters not
    /// included, nor what evaluation gathers ([`peak_eval_gathered`](Self::peak_eval_gathered)).
    pub peak_gathered: u64,
    /// Stage 3: most bytes of parameters gathered at once for evaluation so far
    /// (`Engine::eval`, `full_model`: the whole model), in the compute dtype.
    pub peak_eval_gathered: u64,
    /// Stage 3: bytes of parameters that stay resident in the model (persistence).
    pub persistent: u64,
    /// A pipeline stage: most bytes of activations kept at once for pending backwards
    /// (unit boundaries, and inputs and outputs of units that keep their graphs; the
    /// graphs' insides are not counted).
    pub peak_activations: u64,
}

impl MemoryReport {
    /// Model states held between steps (everything but the transient peaks).
    pub fn model_states(&self) -> u64 {
        self.params + self.grads + self.master + self.optimizer + self.frozen
    }
}

/// Step counters, as DeepSpeed names them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Counters {
    /// Optimizer steps taken (skipped ones included).
    pub global_steps: u64,
    /// Backward passes.
    pub micro_steps: u64,
    /// Steps skipped because the gradients overflowed (every overflow skips a step).
    pub skipped_steps: u64,
    /// Samples consumed by all ranks.
    pub global_samples: u64,
}

/// The accumulation window in progress.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct Window {
    pub micro_steps: u64,
    /// [`Engine::forward`](super::Engine::forward) calls in the micro-step in progress.
    pub forward_calls: u64,
    pub loss_sum: f64,
    /// The traffic counters when the window began, moved on by the bytes of anything
    /// between that is not training (evaluation).
    pub at_start: Traffic,
    pub times: PhaseTimes,
}

impl Window {
    /// Marks the start of work that is not training (evaluation, an export): [`resume`]
    /// leaves its time and bytes out of the step's report.
    ///
    /// [`resume`]: Self::resume
    pub fn pause(&self, traffic: Traffic) -> Paused {
        Paused { times: self.times, traffic }
    }

    /// Ends what [`pause`](Self::pause) began; `traffic` is the rank's counters now.
    pub fn resume(&mut self, paused: Paused, now: Traffic) {
        self.times = paused.times;
        let (start, then) = (&mut self.at_start, &paused.traffic);
        start.comm = start.comm.plus(&now.comm.since(&then.comm));
        start.crossed = start.crossed.plus(&now.crossed.since(&then.crossed));
        start.reads += now.reads - then.reads;
    }
}

/// Loss values of a micro-step (one-element f32 tensors), left on the device until the
/// micro-step's work is all queued: reading a value waits for everything queued before it,
/// so a read before backward would leave the device idle while the host queues backward.
#[derive(Default)]
pub(super) struct LossValues(Vec<Tensor<1>>);

impl LossValues {
    pub fn of(value: Tensor<1>) -> Self {
        let mut values = Self::default();
        values.push(value);
        values
    }

    pub fn push(&mut self, value: Tensor<1>) {
        self.0.push(value.cast(FloatDType::F32));
    }

    /// This sum plus `terms`' sum (each from 0, in order), in one `read` of the device
    /// (`Shared::read_values`).
    pub fn read_with(self, terms: LossValues, read: impl FnOnce(Vec<Tensor<1>>) -> Result<Vec<f32>>) -> Result<f32> {
        Ok(self.read_beside(terms, Vec::new(), read)?.0)
    }

    /// [`read_with`](Self::read_with), and the values of the one-element f32 tensors
    /// `beside`, in the same read of the device.
    pub fn read_beside(
        self,
        terms: LossValues,
        beside: Vec<Tensor<1>>,
        read: impl FnOnce(Vec<Tensor<1>>) -> Result<Vec<f32>>,
    ) -> Result<(f32, Vec<f32>)> {
        let (mine, theirs) = (self.0.len(), terms.0.len());
        let mut values = read(self.0.into_iter().chain(terms.0).chain(beside).collect())?;
        let beside = values.split_off(mine + theirs);
        let sum = |v: &[f32]| v.iter().fold(0.0f32, |sum, v| sum + v);
        Ok((sum(&values[..mine]) + sum(&values[mine..]), beside))
    }
}

/// The window's time and the rank's traffic when non-training work began.
pub(super) struct Paused {
    times: PhaseTimes,
    traffic: Traffic,
}

/// Transient memory high-water marks, in bytes.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct Peaks {
    pub transient: u64,
    pub gathered: u64,
    pub activations: u64,
    /// Gathered for evaluation (`eval`, `full_model`): the whole model, kept apart from
    /// training's peaks.
    pub eval_gathered: u64,
}
