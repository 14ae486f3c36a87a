//! The offload tiers' kernels against the hardware they run on (`zerotrain bench
//! offload`), each pair measured in the same run: the host AdamW step against memcpy's
//! bandwidth and Burn's AdamW on Flex, and the NVMe optimizer step against the disk's
//! direct sequential read and write bandwidth on files of the same size. Here, beside the
//! tiers, because they are the engine's own and not public.

use std::path::Path;
use std::time::Instant;

use burn::optim::{AdamWConfig, Optimizer};
use burn::tensor::{Device, Tensor, TensorData};
use serde::Serialize;

use super::host_adam::{AdamW as HostAdamWParams, HostAdamW};
use super::optimizer::{ShardSegment, built_in};
use super::tier::{FirstMasters, NvmeOptimizer, NvmeOptimizerSetup};
use crate::swap::{AlignedBuf, SwapDir, wait};
use crate::{Config, Overrides, Result};

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

fn best(repeats: usize, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
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
pub fn run(elems: usize, nvme: &Path, tile_elems: usize, repeats: usize) -> Result<OffloadReport> {
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
        serde_json::Value::String(nvme.display().to_string())
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
