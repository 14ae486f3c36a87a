//! `zerotrain bench offload`: the offload tiers against the hardware they run on, each pair
//! measured in the same run: the host AdamW step against memcpy's bandwidth and Burn's
//! AdamW on Flex, and the NVMe optimizer step against the disk's direct sequential read and
//! write bandwidth on files of the same size.

use std::path::Path;
use std::time::Instant;

use serde::Serialize;
use zerotrain::{Config, Overrides};

pub use zerotrain::engine::offload_bench::{OffloadReport, run};

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
    use burn::tensor::{Int, Tensor, TensorData};
    use zerotrain_models::{Gpt, GptConfig};
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
    let mut report = zerotrain::launch(&plan, |ctx| {
        let start = Instant::now();
        ctx.device().seed(plan.runtime.seed);
        let model = Gpt::new(&shape, ctx.device());
        let mut engine = zerotrain::Engine::with_units(model, &plan, &ctx)?;
        let build_s = start.elapsed().as_secs_f64();
        eprintln!("built in {build_s:.1} s ({} units)", engine.sharding().units().len());
        let values: Vec<i64> = (0..=tokens as i64).map(|i| (i * 7 + 3) % 32).collect();
        let batch = Tensor::<2, Int>::from_data(TensorData::new(values, [1, tokens + 1]), ctx.device()).into();
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
        Ok::<_, zerotrain::Error>(GptOffloadReport {
            params,
            fp32_adam_state_bytes: 16 * params,
            build_s,
            steps: rows,
            peak_rss_bytes: 0,
            swapped_bytes: engine.memory_report().swapped,
        })
    })?
    .remove(0);
    report.peak_rss_bytes = crate::commands::proc_status_kib("VmHWM:").unwrap_or(0) * 1024;
    Ok(report)
}
