//! `bench gpu`: a causal language model on one device (a GPU through wgpu or CUDA, or the
//! CPU): the built-in GPT, or a Hugging Face family's model of a `config.json` (random
//! weights). Plain Burn loops (fp32, and in the engine's precision) beside the engine at the
//! given stages and modes, in tokens per second and model FLOPs utilisation, with the
//! device's own count of the memory it holds; a table, or one JSON line per row.

use std::time::Instant;

use burn::module::{ModuleMapper, Param};
use burn::optim::{AdamWConfig, GradientsParams};
use burn::tensor::{DType, Device, FloatDType, Tensor};
use serde::Serialize;

use super::RunMode;
use super::engine::{median, median_times};
use zerotrain::config::ComputeDevice;
use zerotrain::{Error, PhaseTimes, Result, launch};
use zerotrain_models::family::{self, WithModel};
use zerotrain_models::{CausalLm, Gpt, LmBatch};

mod model;
mod table;

pub use model::BenchModel;
use model::tokens;

/// What `bench gpu` measures.
#[derive(Debug, Clone, Serialize)]
pub struct GpuBench {
    /// The model.
    pub model: BenchModel,
    /// Where it runs.
    pub device: ComputeDevice,
    /// Sequences per step.
    pub batch: usize,
    /// Measured steps (after 2 warm-up steps).
    pub steps: usize,
    /// ZeRO stages to run the engine at.
    pub stages: Vec<u8>,
    /// The engine's compute dtype: fp32, fp16 or bf16.
    pub precision: String,
    /// How the engine runs the model: a row per mode at each stage.
    pub modes: Vec<RunMode>,
    /// With recomputation: a row per value, recomputing only that many units, the first
    /// (`zerotrain.recompute_units`); empty: one row recomputing every unit.
    pub recompute_units: Vec<usize>,
    /// The device's dense peak, TFLOPS, for the utilisation column.
    pub peak_tflops: f64,
    /// The engine waits for the device at the end of each phase (`wall_clock_breakdown`),
    /// so that its phase times split the step; the step time includes those waits.
    pub breakdown: bool,
    /// A row after the engine's: plain Burn in the engine's precision with
    /// `zerotrain::nn::set_attention_kernels(false)` (attention in Burn's own operations,
    /// block by block), against which the attention kernels are measured.
    pub blocked_attention: bool,
    /// A last row: plain Burn in the engine's precision with `CausalLm::whole_logits_loss`
    /// (the whole logits), against which the loss over blocks of tokens is measured.
    pub whole_logits: bool,
}

/// One row of the table.
#[derive(Debug, Clone, Serialize)]
pub struct GpuRow {
    /// The model: `builtin`, or the family and its config file.
    pub model: String,
    /// `plain Burn` or `engine stage N`.
    pub what: String,
    /// The dtype the model computes in: fp32, fp16 or bf16.
    pub precision: String,
    /// The engine's ZeRO stage (`None` for a plain loop).
    pub stage: Option<u8>,
    /// How the engine ran the model (`None` for a plain loop).
    pub mode: Option<RunMode>,
    /// With recomputation, how many units were recomputed (`None`: every unit).
    pub recompute_units: Option<usize>,
    /// Median step time, seconds.
    pub step_seconds: f64,
    /// Tokens per second at the median.
    pub tokens_per_s: f64,
    /// Model FLOPs per second (6 x parameters x tokens / time), in TFLOPS.
    pub tflops: f64,
    /// `tflops` over the peak.
    pub mfu: f64,
    /// Bytes the device's allocator holds live after a step (`None`: the device does not
    /// report it, as Flex on the CPU).
    pub device_bytes: Option<u64>,
    /// Bytes the device's allocator reserves after the row: the pages it grew to, which it
    /// keeps for reuse, so the most any row so far needed at once (rows run in order; a
    /// row that needs more than every earlier one raises it).
    pub device_reserved: Option<u64>,
    /// The engine's median phase times (`None` for the plain loop).
    pub times: Option<PhaseTimes>,
    /// Model-state bytes the engine's last step copied between host memory and the device
    /// (`None` for the plain loop).
    pub host_device: Option<zerotrain::engine::HostDeviceBytes>,
}

/// An error naming the command-line flag `name` (`bench gpu`'s settings are its flags).
fn flag(name: &str, message: String) -> Error {
    Error::Config(zerotrain::config::ConfigError::Unsupported { key: name.into(), message })
}

/// [`GpuBench::run_with`] for whichever family's model `HfModel` holds.
struct Bench<'a> {
    bench: &'a GpuBench,
    measured: &'a (dyn Fn(&GpuRow) + Sync),
}

impl WithModel for Bench<'_> {
    type Output = Result<Vec<GpuRow>>;
    fn run<M: CausalLm>(self, model: M) -> Self::Output {
        self.bench.run_with(model, self.measured)
    }
}

impl GpuBench {
    /// Runs the plain loops, then the engine at each stage and mode (world size 1), each
    /// for `steps` measured steps, handing each row to `measured` as soon as it is (a run
    /// cut short by a time limit still reports the rows it finished). The model is
    /// initialised on the CPU, so that the device holds only what each row trains.
    pub fn run(&self, measured: impl Fn(&GpuRow) + Sync) -> Result<Vec<GpuRow>> {
        let cpu = Device::flex().autodiff();
        cpu.seed(1);
        match &self.model {
            BenchModel::Builtin(shape) => self.run_with(Gpt::new(shape, &cpu), &measured),
            BenchModel::Hf { config, .. } => {
                self.model.validate().map_err(|e| Error::Model(format!("bench gpu: {e}")))?;
                family::fresh(config, &cpu, 1).run(Bench { bench: self, measured: &measured })
            }
        }
    }

    fn run_with<M: CausalLm>(&self, init: M, measured: &(dyn Fn(&GpuRow) + Sync)) -> Result<Vec<GpuRow>> {
        let half = match self.precision.as_str() {
            "fp32" => None,
            "fp16" => Some(FloatDType::F16),
            "bf16" => Some(FloatDType::BF16),
            other => return Err(flag("--precision", format!("must be fp32, fp16 or bf16, got {other}"))),
        };
        let precision =
            half.map_or(String::new(), |_| format!(r#""{}": {{"enabled": true}},"#, self.precision.as_str()));
        let mut plans = Vec::new();
        let every: &[Option<usize>] = &[None];
        let partial: Vec<Option<usize>> = self.recompute_units.iter().copied().map(Some).collect();
        for &stage in &self.stages {
            for &mode in &self.modes {
                let recomputed = if mode == RunMode::Checkpointed && !partial.is_empty() { &partial } else { every };
                for &units in recomputed {
                    let units_key = units.map_or(String::new(), |u| format!(r#", "recompute_units": {u}"#));
                    let json = format!(
                        r#"{{ {precision} {} "zero_optimization": {{"stage": {stage}}}, "wall_clock_breakdown": {},
                             "train_micro_batch_size_per_gpu": {}, "zerotrain": {{"device": "{}"{units_key}}},
                             "optimizer": {{"type": "AdamW", "params": {{"lr": 1e-4, "weight_decay": 0.0}}}} }}"#,
                        mode.config_keys(),
                        self.breakdown,
                        self.batch,
                        self.device.name()
                    );
                    plans.push((Variant { stage, mode, recompute_units: units }, super::resolve(&json, 1)?));
                }
            }
        }
        let Some((_, first)) = plans.first() else {
            return Err(flag("--stages", "no --stages or --mode given".into()));
        };
        let rows = launch(first, |ctx| {
            let device = ctx.device().clone();
            if half.is_some_and(|h| !device.supports_dtype(DType::from(h))) {
                // Burn would compile the half-precision kernels anyway, and they panic inside
                // the device's thread (wgpu has no bf16), so refuse before the first row.
                return Err(flag(
                    "--precision",
                    format!(
                        "this {} device cannot compute in {}; use fp32{}",
                        self.device.name(),
                        self.precision,
                        if device.supports_dtype(DType::F16) { " or fp16" } else { "" }
                    ),
                ));
            }
            let mut rows = Vec::new();
            let mut keep = |row: GpuRow| {
                measured(&row);
                rows.push(row);
            };
            keep(self.plain(&init, &device, None, Plain::Own)?);
            if let Some(half) = half {
                keep(self.plain(&init, &device, Some(half), Plain::Own)?);
            }
            // A row that fails is reported and the others still run: one GPU session
            // should bring back every figure it can.
            let mut failed = Vec::new();
            for (variant, plan) in &plans {
                match self.engine(*variant, &init, plan, &ctx) {
                    Ok(row) => keep(row),
                    Err(e) => {
                        eprintln!("{}: {e}", variant.name());
                        failed.push(variant.name());
                    }
                }
            }
            if self.blocked_attention {
                keep(self.plain(&init, &device, half, Plain::BlockedAttention)?);
            }
            if self.whole_logits {
                // Last, so that what it reserves beyond the rows before shows its logits.
                keep(self.plain(&init, &device, half, Plain::WholeLogits)?);
            }
            if !failed.is_empty() {
                return Err(Error::Model(format!("bench gpu: {} failed (errors above)", failed.join(", "))));
            }
            Ok::<_, Error>(rows)
        })?;
        Ok(rows.into_iter().next().expect("one rank"))
    }

    /// The plain Burn loop the engine replaces: forward, backward, AdamW, in fp32 or with
    /// every parameter in `half` (no master weights, no loss scaling: the engine's
    /// arithmetic at the compute dtype's speed), as the model trains or with `plain`'s change.
    fn plain<M: CausalLm>(&self, init: &M, device: &Device, half: Option<FloatDType>, plain: Plain) -> Result<GpuRow> {
        let _kernels = AttentionKernels::set(plain != Plain::BlockedAttention);
        let mut model = init.clone().fork(device);
        if let Some(dtype) = half {
            model = model.map(&mut CastParams(dtype));
        }
        let mut optim = AdamWConfig::new().with_epsilon(1e-8).with_weight_decay(0.0).init();
        let mut times = Vec::new();
        for step in 0..self.steps + 2 {
            let start = Instant::now();
            let tokens = tokens(&self.model, self.batch, step, device);
            let loss = match plain {
                Plain::WholeLogits => model.whole_logits_loss(&tokens),
                Plain::Own | Plain::BlockedAttention => model.next_token_loss(&tokens),
            };
            let grads = GradientsParams::from_grads(loss.backward(), &model);
            model = optim.step(1e-4, model, grads);
            device.sync().map_err(|e| Error::Model(format!("the device failed: {e:?}")))?;
            if step >= 2 {
                times.push(start.elapsed().as_secs_f64());
            }
        }
        let precision = if half.is_some() { self.precision.clone() } else { "fp32".into() };
        let what = match plain {
            Plain::Own => format!("plain Burn {precision}"),
            Plain::WholeLogits => format!("plain {precision} whole logits"),
            Plain::BlockedAttention => format!("plain {precision} blocked attn"),
        };
        let mut row = self.row(what, median(times), device, None);
        row.precision = precision;
        Ok(row)
    }

    /// The engine row `variant` on `ctx`'s device.
    fn engine<M: CausalLm>(
        &self,
        variant: Variant,
        init: &M,
        plan: &zerotrain::Plan,
        ctx: &zerotrain::RankContext,
    ) -> Result<GpuRow> {
        let Variant { stage, mode, recompute_units } = variant;
        let device = ctx.device();
        let mut engine = mode.engine(init.clone(), plan, ctx)?;
        let (mut times, mut reports) = (Vec::new(), Vec::new());
        for step in 0..self.steps + 2 {
            let start = Instant::now();
            let batch = tokens(&self.model, self.batch, step, device).into();
            mode.micro_step(&mut engine, &batch, |m, b: &LmBatch| m.next_token_loss(&b.tokens))?;
            let report = engine.step()?.expect("accumulation 1");
            device.sync().map_err(|e| Error::Model(format!("the device failed: {e:?}")))?;
            if step >= 2 {
                times.push(start.elapsed().as_secs_f64());
                reports.push(report);
            }
        }
        let phases = median_times(&reports);
        let mut row = self.row(variant.name(), median(times), device, Some(phases));
        (row.stage, row.mode, row.host_device) = (Some(stage), Some(mode), reports.last().map(|r| r.host_device));
        row.recompute_units = recompute_units;
        Ok(row)
    }

    fn row(&self, what: String, step_seconds: f64, device: &Device, times: Option<PhaseTimes>) -> GpuRow {
        let tokens_per_s = (self.batch * self.model.context()) as f64 / step_seconds;
        let tflops = 6.0 * self.model.num_params() as f64 * tokens_per_s / 1e12;
        let usage = device.memory_pool_usage();
        GpuRow {
            model: match &self.model {
                BenchModel::Builtin(_) => "builtin".into(),
                BenchModel::Hf { name, config, .. } => format!("{} {name}", config.model_type()),
            },
            what,
            precision: self.precision.clone(),
            stage: None,
            mode: None,
            recompute_units: None,
            step_seconds,
            tokens_per_s,
            tflops,
            mfu: tflops / self.peak_tflops,
            device_bytes: usage.map(|u| u.bytes_in_use),
            device_reserved: usage.map(|u| u.bytes_reserved),
            times,
            host_device: None,
        }
    }
}

/// What a plain row changes from the way the model trains.
#[derive(Clone, Copy, PartialEq)]
enum Plain {
    /// Nothing: its loss over blocks of tokens (`zerotrain::nn::LinearCrossEntropy`), its
    /// attention through `zerotrain::nn::causal_attention`'s kernels.
    Own,
    /// `CausalLm::whole_logits_loss`: the whole logits `[tokens, vocabulary]`.
    WholeLogits,
    /// `causal_attention` in Burn's own operations (its kernels switched off).
    BlockedAttention,
}

/// `zerotrain::nn::set_attention_kernels` for a row's length: the setting before comes back
/// when the row ends, failed or not.
struct AttentionKernels(bool);

impl AttentionKernels {
    fn set(on: bool) -> Self {
        let before = zerotrain::nn::attention_kernels();
        zerotrain::nn::set_attention_kernels(on);
        Self(before)
    }
}

impl Drop for AttentionKernels {
    fn drop(&mut self) {
        zerotrain::nn::set_attention_kernels(self.0);
    }
}

/// One engine row: the stage, the mode and, with recomputation, how many units.
#[derive(Clone, Copy)]
struct Variant {
    stage: u8,
    mode: RunMode,
    recompute_units: Option<usize>,
}

impl Variant {
    /// The row's name: `engine 3 recompute`, `engine 3 recompute 6`.
    fn name(self) -> String {
        let units = self.recompute_units.map_or(String::new(), |u| format!(" {u}"));
        format!("engine {} {}{units}", self.stage, self.mode.short_name())
    }
}

/// Casts every float parameter to a dtype (the plain loop in the engine's precision). Each
/// cast is a new leaf that takes gradients: a cast left in the autodiff graph would take
/// none, so the optimizer would never update it and the next backward would find its graph
/// consumed.
struct CastParams(FloatDType);

impl ModuleMapper for CastParams {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        let dtype = self.0;
        param.map(|t| t.cast(dtype).detach().require_grad())
    }
}
