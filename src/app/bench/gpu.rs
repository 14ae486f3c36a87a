//! `bench gpu`: a GPT on one device (a GPU through wgpu or CUDA, or the CPU), a plain Burn
//! loop beside the engine at the given stages, in tokens per second and model FLOPs
//! utilisation, with the device's own count of the memory it holds.

use std::time::Instant;

use burn::module::Module;
use burn::optim::{AdamWConfig, GradientsParams};
use burn::tensor::{Device, Int, Tensor, TensorData};
use serde::Serialize;

use super::RunMode;
use super::engine::{median, median_times};
use crate::app::models::{Gpt, GptConfig};
use crate::config::ComputeDevice;
use crate::{Error, PhaseTimes, Result, launch};

/// What `bench gpu` measures.
#[derive(Debug, Clone, Serialize)]
pub struct GpuBench {
    /// The model's shape.
    pub shape: GptConfig,
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
    /// How the engine runs the model.
    pub mode: RunMode,
    /// The device's dense peak, TFLOPS, for the utilisation column.
    pub peak_tflops: f64,
}

/// One row of the table.
#[derive(Debug, Clone, Serialize)]
pub struct GpuRow {
    /// `plain Burn` or `engine stage N`.
    pub what: String,
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
    /// The engine's median phase times (`None` for the plain loop).
    pub times: Option<PhaseTimes>,
    /// Model-state bytes the engine's last step copied between host memory and the device
    /// (`None` for the plain loop).
    pub host_device: Option<crate::engine::HostDeviceBytes>,
}

/// Deterministic tokens `[batch, block + 1]` for step `step`.
fn tokens(shape: &GptConfig, batch: usize, step: usize, device: &Device) -> Tensor<2, Int> {
    let len = shape.block_size + 1;
    let vocab = shape.vocab_size as u64;
    let values: Vec<i64> =
        (0..(batch * len) as u64).map(|i| ((i * 2_654_435_761 + step as u64 * 40_503) % vocab) as i64).collect();
    Tensor::from_data(TensorData::new(values, [batch, len]), device)
}

impl GpuBench {
    /// Runs the plain loop, then the engine at each stage (world size 1), each for
    /// `steps` measured steps.
    pub fn run(&self) -> Result<Vec<GpuRow>> {
        let json = format!(
            r#"{{ "train_micro_batch_size_per_gpu": {}, {} "zerotrain": {{"device": "{}"}},
                 "optimizer": {{"type": "AdamW", "params": {{"lr": 1e-4, "weight_decay": 0.0}}}} }}"#,
            self.batch,
            self.mode.config_keys(),
            self.device.name()
        );
        let plans = self
            .stages
            .iter()
            .map(|&stage| {
                let precision = match self.precision.as_str() {
                    "fp32" => String::new(),
                    half @ ("fp16" | "bf16") => format!(r#""{half}": {{"enabled": true}},"#),
                    other => return Err(Error::Usage(format!("--precision must be fp32, fp16 or bf16, got {other}"))),
                };
                let json =
                    json.replacen('{', &format!(r#"{{ {precision} "zero_optimization": {{"stage": {stage}}},"#), 1);
                Ok((stage, super::resolve(&json, 1)?))
            })
            .collect::<Result<Vec<_>>>()?;
        let Some((_, first)) = plans.first() else { return Err(Error::Usage("no --stages given".into())) };
        // Initialised on the CPU, so that the device holds only what each row trains.
        let cpu = Device::flex().autodiff();
        cpu.seed(1);
        let init = Gpt::new(&self.shape, &cpu);
        let rows = launch(first, |ctx| {
            let device = ctx.device().clone();
            let mut rows = vec![self.plain(&init, &device)?];
            for (stage, plan) in &plans {
                rows.push(self.engine(*stage, &init, plan, &ctx)?);
            }
            Ok::<_, Error>(rows)
        })?;
        Ok(rows.into_iter().next().expect("one rank"))
    }

    /// The plain Burn loop the engine replaces: forward, backward, AdamW, in fp32.
    fn plain(&self, init: &Gpt, device: &Device) -> Result<GpuRow> {
        let mut model = init.clone().fork(device);
        let mut optim = AdamWConfig::new().with_epsilon(1e-8).with_weight_decay(0.0).init();
        let mut times = Vec::new();
        for step in 0..self.steps + 2 {
            let start = Instant::now();
            let loss = model.loss(tokens(&self.shape, self.batch, step, device));
            let grads = GradientsParams::from_grads(loss.backward(), &model);
            model = optim.step(1e-4, model, grads);
            device.sync().map_err(|e| Error::Model(format!("the device failed: {e:?}")))?;
            if step >= 2 {
                times.push(start.elapsed().as_secs_f64());
            }
        }
        Ok(self.row("plain Burn".into(), median(times), device, None))
    }

    /// The engine at `stage` on `ctx`'s device.
    fn engine(&self, stage: u8, init: &Gpt, plan: &crate::Plan, ctx: &crate::RankContext) -> Result<GpuRow> {
        let device = ctx.device();
        let mut engine = self.mode.engine(init.clone(), plan, ctx)?;
        let (mut times, mut reports) = (Vec::new(), Vec::new());
        for step in 0..self.steps + 2 {
            let start = Instant::now();
            let batch = tokens(&self.shape, self.batch, step, device);
            self.mode.micro_step(&mut engine, &batch, |m, b| m.loss(b.clone()))?;
            let report = engine.step()?.expect("accumulation 1");
            device.sync().map_err(|e| Error::Model(format!("the device failed: {e:?}")))?;
            if step >= 2 {
                times.push(start.elapsed().as_secs_f64());
                reports.push(report);
            }
        }
        let phases = median_times(&reports);
        let mut row = self.row(format!("engine stage {stage}"), median(times), device, Some(phases));
        row.host_device = reports.last().map(|r| r.host_device);
        Ok(row)
    }

    fn row(&self, what: String, step_seconds: f64, device: &Device, times: Option<PhaseTimes>) -> GpuRow {
        let tokens_per_s = (self.batch * self.shape.block_size) as f64 / step_seconds;
        let tflops = 6.0 * self.shape.num_params() as f64 * tokens_per_s / 1e12;
        GpuRow {
            what,
            step_seconds,
            tokens_per_s,
            tflops,
            mfu: tflops / self.peak_tflops,
            device_bytes: device.memory_pool_usage().map(|u| u.bytes_in_use),
            times,
            host_device: None,
        }
    }

    /// The table as text.
    pub fn format(&self, rows: &[GpuRow]) -> String {
        let s = &self.shape;
        let mut out = format!(
            "GPT {}x{} ({} heads, context {}, vocabulary {}, {:.1}M parameters), {} sequences per step, on {}; engine \
             in {} ({:?}); medians of {} steps; MFU against {} TFLOPS\n",
            s.n_layer,
            s.n_embd,
            s.n_head,
            s.block_size,
            s.vocab_size,
            s.num_params() as f64 / 1e6,
            self.batch,
            self.device.name(),
            self.precision,
            self.mode,
            self.steps,
            self.peak_tflops
        );
        out.push_str(
            "what              step ms   tokens/s   TFLOPS    MFU  device MiB  forward backward reduce  optim gather  \
             to/from device MiB\n",
        );
        for r in rows {
            let mib = r.device_bytes.map_or("-".into(), |b| format!("{:.1}", b as f64 / (1 << 20) as f64));
            let phases = r.times.map_or(String::new(), |t| {
                let ms = |x: f64| x * 1e3;
                format!(
                    "  {:>7.1} {:>8.1} {:>6.1} {:>6.1} {:>6.1}",
                    ms(t.forward),
                    ms(t.backward),
                    ms(t.reduce),
                    ms(t.optimizer),
                    ms(t.gather)
                )
            });
            let crossed = r.host_device.map_or(String::new(), |c| {
                let mib = |b: u64| b as f64 / (1 << 20) as f64;
                format!("  {:>8.1} / {:.1}", mib(c.to_device), mib(c.to_host))
            });
            out.push_str(&format!(
                "{:<16} {:>8.1} {:>10.0} {:>8.3} {:>5.2}% {:>11}{phases}{crossed}\n",
                r.what,
                r.step_seconds * 1e3,
                r.tokens_per_s,
                r.tflops,
                r.mfu * 100.0,
                mib
            ));
        }
        out
    }
}
