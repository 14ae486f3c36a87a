//! `zerotrain bench offload`: the offload tiers against the hardware they run on, each pair
//! measured in the same run: the host AdamW step against memcpy's bandwidth and Burn's
//! AdamW on Flex, and the NVMe optimizer step against the disk's direct sequential read and
//! write bandwidth on files of the same size.

use std::path::Path;
use std::time::Instant;

use burn::optim::{AdamWConfig, Optimizer};
use burn::tensor::{Device, Tensor, TensorData};
use serde::Serialize;

use crate::engine::optimizer::{ShardSegment, built_in};
use crate::engine::{FirstMasters, HostAdamW, HostAdamWParams, NvmeOptimizer, NvmeOptimizerSetup};
use crate::swap::{AlignedBuf, SwapDir, wait};
use crate::{Config, Overrides};

/// What one run measured (seconds are the best of the repeats).
#[derive(Debug, Clone, Serialize)]
pub struct OffloadReport {
    /// Elements of the optimizer range.
    pub elems: usize,
    /// memcpy: bytes read plus written per second.
    pub memcpy_gb_s: f64,
    /// The host AdamW step.
    pub host_adam_s: f64,
    /// Its bytes touched (28 per element: p, g, m, v read; p, m, v written) per second.
    pub host_adam_gb_s: f64,
    /// `host_adam_gb_s / memcpy_gb_s`: the share of the memory-bandwidth bound reached.
    pub host_adam_of_bound: f64,
    /// Burn's AdamW on Flex over the same range.
    pub burn_adam_s: f64,
    /// `burn_adam_s / host_adam_s`.
    pub host_adam_speedup: f64,
    /// Direct sequential writes and reads of the step's three files (masters, two moments).
    pub disk_write_gb_s: f64,
    /// See `disk_write_gb_s`.
    pub disk_read_gb_s: f64,
    /// The NVMe optimizer step (bf16 training: masters and moments swapped).
    pub nvme_step_s: f64,
    /// Bytes the step read and wrote (12 per element each way).
    pub nvme_step_bytes: u64,
    /// Time the disk alone needs for those bytes at the measured bandwidths, over the
    /// step's time: the share of the disk's bandwidth the step reaches.
    pub nvme_step_of_disk: f64,
}

fn best(repeats: usize, mut f: impl FnMut() -> anyhow::Result<()>) -> anyhow::Result<f64> {
    let mut best = f64::INFINITY;
    for _ in 0..repeats.max(1) {
        let start = Instant::now();
        f()?;
        best = best.min(start.elapsed().as_secs_f64());
    }
    Ok(best)
}

fn noise(n: usize, seed: u32) -> Vec<f32> {
    (0..n as u32).map(|i| ((i.wrapping_mul(2_654_435_761) ^ seed) as f32 / u32::MAX as f32 - 0.5) * 1e-2).collect()
}

/// Runs the measurements over `elems` elements, the swap files under `nvme`.
pub fn run(elems: usize, nvme: &Path, tile_elems: usize, repeats: usize) -> anyhow::Result<OffloadReport> {
    let n = elems;
    let bytes = (n * size_of::<f32>()) as f64;
    let src = noise(n, 1);
    let mut dst = vec![0.0f32; n];
    let memcpy = best(repeats, || {
        dst.copy_from_slice(&src);
        std::hint::black_box(&dst);
        Ok(())
    })?;
    let hyper = HostAdamWParams { beta_1: 0.9, beta_2: 0.999, epsilon: 1e-8, weight_decay: 0.01 };
    let (mut p, g) = (noise(n, 2), noise(n, 3));
    let mut ours = HostAdamW::new(hyper);
    ours.step_slices(1e-3, &mut p, &g); // the moments exist from here on, as in training
    let host = best(repeats, || {
        ours.step_slices(1e-3, &mut p, &g);
        Ok(())
    })?;
    let device = Device::flex();
    let burn = AdamWConfig::new().with_weight_decay(0.01).with_epsilon(1e-8).build();
    let tensor = |v: &Vec<f32>| Tensor::<1>::from_data(TensorData::new(v.clone(), [n]), &device);
    let (mut params, grads) = (tensor(&p), tensor(&g));
    let (next, mut state) = burn.step(1e-3, params, grads.clone(), None);
    params = next;
    let burn_s = best(repeats, || {
        let (next, s) = burn.step(1e-3, params.clone(), grads.clone(), state.take());
        (params, state) = (next, s);
        std::hint::black_box(params.clone().into_data());
        Ok(())
    })?;
    drop((params, grads, state, dst, src));

    let json = format!(
        r#"{{"train_micro_batch_size_per_gpu": 1, "bf16": {{"enabled": true}},
            "optimizer": {{"type": "AdamW", "params": {{"lr": 1e-3, "weight_decay": 0.01}}}},
            "zero_optimization": {{"stage": 1, "sub_group_size": {tile_elems},
              "offload_optimizer": {{"device": "nvme", "nvme_path": {}, "pipeline_read": true,
                                     "pipeline_write": true, "buffer_count": 9}}}}}}"#,
        serde_json::to_string(&nvme.display().to_string())?
    );
    let plan = Config::parse(&json, "bench")?.resolve(Overrides::default())?;
    let dir = std::sync::Arc::new(SwapDir::open(nvme, "bench", "rank0", plan.zero.offload.aio)?);
    // The disk alone: three files of the range, written then read, tile by tile as the
    // step does, with the same requests in flight.
    let files: Vec<_> = (0..3).map(|i| dir.file(&format!("disk{i}"), n)).collect::<Result<_, _>>()?;
    let tile = plan.zero.offload.sub_group_size as usize;
    let disk_write = best(repeats, || {
        for f in &files {
            for start in (0..n).step_by(tile) {
                let buf = AlignedBuf::from_slice(&p[start..start + tile.min(n - start)]);
                wait(f.write(start, buf)?)?;
            }
        }
        Ok(())
    })?;
    let disk_read = best(repeats, || {
        for f in &files {
            for start in (0..n).step_by(tile) {
                std::hint::black_box(wait(f.read(start..start + tile.min(n - start))?)?);
            }
        }
        Ok(())
    })?;
    drop(files);
    let segments = [ShardSegment { path: "w".into(), shape: vec![n], param_range: 0..n, range: 0..n }];
    let factory = built_in();
    let with = NvmeOptimizerSetup { optim: &plan.optim, factory: &factory, offload: &plan.zero.offload, dir: &dir };
    let mut swapped = NvmeOptimizer::new(0, n, &segments, FirstMasters::Values(&p), &with)?;
    let dtype = plan.precision.compute;
    swapped.step(1e-3, &g, None, dtype, &device)?; // creates the moments' files
    let step = best(repeats, || {
        std::hint::black_box(swapped.step(1e-3, &g, None, dtype, &device)?);
        Ok(())
    })?;
    let moved = 3.0 * bytes;
    let (write_bw, read_bw) = (moved / disk_write, moved / disk_read);
    Ok(OffloadReport {
        elems: n,
        memcpy_gb_s: 2.0 * bytes / memcpy / 1e9,
        host_adam_s: host,
        host_adam_gb_s: 7.0 * bytes / host / 1e9,
        host_adam_of_bound: (7.0 * bytes / host) / (2.0 * bytes / memcpy),
        burn_adam_s: burn_s,
        host_adam_speedup: burn_s / host,
        disk_write_gb_s: write_bw / 1e9,
        disk_read_gb_s: read_bw / 1e9,
        nvme_step_s: step,
        nvme_step_bytes: (2.0 * moved) as u64,
        nvme_step_of_disk: (moved / read_bw + moved / write_bw) / step,
    })
}

/// The report as a table.
pub fn format(r: &OffloadReport) -> String {
    format!(
        "offload bench over {} elements ({:.0} MiB per tensor)\n\
         memcpy                 {:.2} GB/s (bytes read + written)\n\
         host AdamW (fused)     {:.3} s  {:.2} GB/s touched = {:.0}% of memcpy's bound\n\
         Burn AdamW on Flex     {:.3} s  (host AdamW is {:.1}x faster)\n\
         disk, direct I/O       write {:.3} GB/s, read {:.3} GB/s (3 files of the range, tiled)\n\
         NVMe optimizer step    {:.3} s  {:.0} MiB moved = {:.0}% of the disk's bandwidth\n",
        r.elems,
        (r.elems * 4) as f64 / (1u64 << 20) as f64,
        r.memcpy_gb_s,
        r.host_adam_s,
        r.host_adam_gb_s,
        100.0 * r.host_adam_of_bound,
        r.burn_adam_s,
        r.host_adam_speedup,
        r.disk_write_gb_s,
        r.disk_read_gb_s,
        r.nvme_step_s,
        r.nvme_step_bytes as f64 / (1u64 << 20) as f64,
        100.0 * r.nvme_step_of_disk,
    )
}

/// What the GPT run measured (`zerotrain bench offload-gpt`).
#[derive(Debug, Clone, Serialize)]
pub struct GptOffloadReport {
    /// Trainable parameters.
    pub params: u64,
    /// fp32 Adam model states (16 bytes per parameter), for scale.
    pub fp32_adam_state_bytes: u64,
    /// Seconds to build the engine (the model initialised unit by unit and swapped out).
    pub build_s: f64,
    /// Each step: (loss, seconds, bytes read from swap, bytes written to swap).
    pub steps: Vec<(f32, f64, u64, u64)>,
    /// The process's peak resident size (`VmHWM`), bytes.
    pub peak_rss_bytes: u64,
    /// Bytes in swap files after the run.
    pub swapped_bytes: u64,
}

/// The GPT of [`run_gpt`]: `layers` blocks of width `width` (heads of 128), a batch of
/// `tokens` tokens.
#[derive(Debug, Clone, Copy)]
pub struct GptShape {
    /// Transformer blocks.
    pub layers: usize,
    /// Model width.
    pub width: usize,
    /// Tokens in the batch.
    pub tokens: usize,
}

/// Trains the built-in GPT of `shape` at stage 3 in units with activation checkpointing,
/// bf16, AdamW at `lr`, the optimizer and the parameters on NVMe under `nvme` (in memory
/// without it, for comparison), `steps` steps on one repeated batch, one rank. The model is
/// built inside the rank and handed over untouched, so the engine initialises it one unit
/// at a time.
pub fn run_gpt(shape: GptShape, steps: u64, lr: f64, nvme: Option<&Path>) -> anyhow::Result<GptOffloadReport> {
    let GptShape { layers, width, tokens } = shape;
    use crate::app::models::{Gpt, GptConfig};
    use burn::tensor::{Int, Tensor, TensorData};
    let shape = GptConfig {
        n_layer: layers,
        n_head: (width / 128).max(1),
        n_embd: width,
        block_size: tokens,
        vocab_size: 32,
        tied_head: true,
    };
    shape.validate().map_err(anyhow::Error::msg)?;
    let offload = match nvme {
        Some(nvme) => {
            let path = serde_json::to_string(&nvme.display().to_string())?;
            format!(
                r#", "offload_optimizer": {{"device": "nvme", "nvme_path": {path}, "pipeline_read": true,
                      "pipeline_write": true, "buffer_count": 6}},
                   "offload_param": {{"device": "nvme", "nvme_path": {path}, "max_in_cpu": 0}}"#
            )
        }
        None => String::new(),
    };
    let json = format!(
        r#"{{"train_micro_batch_size_per_gpu": 1, "bf16": {{"enabled": true}}, "gradient_clipping": 1.0,
            "optimizer": {{"type": "AdamW", "params": {{"lr": {lr}, "weight_decay": 0.0}}}},
            "activation_checkpointing": {{}},
            "zero_optimization": {{"stage": 3, "reduce_bucket_size": 2e7, "sub_group_size": 2e7,
              "stage3_param_persistence_threshold": 1e5 {offload}}},
            "aio": {{"block_size": 1048576, "queue_depth": 8, "thread_count": 1}},
            "zerotrain": {{"world_size": 1, "comm_timeout_s": 3600}}}}"#
    );
    let plan = Config::parse(&json, "bench")?.resolve(Overrides::default())?;
    let params = shape.num_params();
    let mut report = crate::launch(&plan, |ctx| {
        let start = Instant::now();
        ctx.device().seed(plan.runtime.seed);
        let model = Gpt::new(&shape, ctx.device());
        let mut engine = crate::Engine::with_units(model, &plan, &ctx)?;
        let build_s = start.elapsed().as_secs_f64();
        eprintln!("built in {build_s:.1} s ({} units)", engine.sharding().units().len());
        let values: Vec<i64> = (0..=tokens as i64).map(|i| (i * 7 + 3) % 32).collect();
        let batch = Tensor::<2, Int>::from_data(TensorData::new(values, [1, tokens + 1]), ctx.device());
        let mut rows = Vec::new();
        for step in 0..steps {
            let (before, start) = (engine.swap_traffic(), Instant::now());
            engine.forward_backward(&batch)?;
            let loss = engine.step()?.map_or(f32::NAN, |r| r.loss);
            let (after, seconds) = (engine.swap_traffic(), start.elapsed().as_secs_f64());
            let row = (loss, seconds, after.0 - before.0, after.1 - before.1);
            let gb = |b: u64| b as f64 / 1e9;
            eprintln!(
                "step {}: loss {:.5}, {:.1} s, {:.1} GB read, {:.1} GB written",
                step + 1,
                row.0,
                row.1,
                gb(row.2),
                gb(row.3)
            );
            rows.push(row);
        }
        Ok::<_, crate::Error>(GptOffloadReport {
            params,
            fp32_adam_state_bytes: 16 * params,
            build_s,
            steps: rows,
            peak_rss_bytes: 0,
            swapped_bytes: engine.memory_report().swapped,
        })
    })?
    .remove(0);
    report.peak_rss_bytes = crate::app::commands::proc_status_kib("VmHWM:").unwrap_or(0) * 1024;
    Ok(report)
}
