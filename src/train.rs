//! The built-in training job behind `zerotrain train`: the test transformer on the
//! generated regression task, every rank a thread, rank 0 logging.

use std::time::Instant;

use burn::tensor::Device;

use crate::models::{RegressionTask, TinyTransformer};
use crate::{Engine, MemoryReport, Plan, Result, launch};

/// The task the demo trains on.
pub const DEMO_TASK: RegressionTask = RegressionTask { seq_len: 16, features: 8 };
/// First sample index of the validation set (disjoint from every training index).
const VALIDATION_START: u64 = 1 << 40;
/// Validation samples.
const VALIDATION_SAMPLES: u64 = 64;

/// What a demo run measured (rank 0's view).
#[derive(Debug, Clone)]
pub struct DemoSummary {
    /// Optimizer steps taken.
    pub steps: u64,
    /// Validation loss before training.
    pub initial_val_loss: f32,
    /// Validation loss after training.
    pub final_val_loss: f32,
    /// Mean training loss of the last step.
    pub last_train_loss: f32,
    /// Wall time of the training loop, seconds.
    pub seconds: f64,
    /// Training samples per second over all ranks.
    pub samples_per_second: f64,
    /// Trainable parameters.
    pub num_params: usize,
    /// Rank 0's model-state memory after training.
    pub memory: MemoryReport,
    /// Bytes rank 0 moved in collectives per optimizer step (mean).
    pub comm_bytes_per_step: u64,
}

/// Where and how often the demo saves checkpoints.
#[derive(Debug, Clone)]
pub struct CheckpointSettings {
    /// The checkpoint directory.
    pub dir: std::path::PathBuf,
    /// Save every this many steps (0: only at the end).
    pub every: u64,
    /// Continue from the checkpoint `latest` names.
    pub resume: bool,
}

/// Trains the demo model until `steps` optimizer steps are done under `plan` (resuming from
/// a checkpoint if asked); `log` receives rank 0's lines.
pub fn train_demo(
    plan: &Plan,
    steps: u64,
    checkpoints: Option<&CheckpointSettings>,
    log: &(dyn Fn(&str) + Sync),
) -> Result<DemoSummary> {
    let task = DEMO_TASK;
    // Built once, before the rank threads start: Flex's RNG is process-wide, so seeding
    // inside racing ranks would not make the initial weights reproducible.
    let seeded = Device::flex().autodiff();
    seeded.seed(plan.seed);
    let init = TinyTransformer::new(task.features, 64, 4, &seeded);
    let results = launch(plan, |ctx| {
        let device = ctx.device().clone();
        let mut engine = Engine::new(init.clone(), plan, &ctx)?;
        let validation = task.batch(VALIDATION_START..VALIDATION_START + VALIDATION_SAMPLES, &device);
        let val_loss = |engine: &mut Engine<TinyTransformer>| -> Result<f32> {
            engine.eval(|m| m.loss(&validation).into_scalar::<f32>())
        };
        if let Some(c) = checkpoints.filter(|c| c.resume) {
            engine.load_checkpoint(&c.dir, None, crate::LoadOptions::default())?;
            if ctx.rank() == 0 {
                log(&format!("resumed from {} at step {}", c.dir.display(), engine.counters().global_steps));
            }
        }
        let first_step = engine.counters().global_steps;
        let initial_val_loss = val_loss(&mut engine)?;
        let (rank, b) = (ctx.rank() as u64, plan.batch);
        let start = Instant::now();
        let comm_start = engine.comm_stats().total_bytes();
        let mut last_train_loss = f32::NAN;
        for step in first_step..steps {
            for micro in 0..b.gradient_accumulation_steps {
                let first =
                    step * b.train_batch_size + (micro * plan.world_size as u64 + rank) * b.micro_batch_per_rank;
                let batch = task.batch(first..first + b.micro_batch_per_rank, &device);
                let loss = engine.forward(|m| m.loss(&batch))?;
                engine.backward(loss)?;
                let Some(report) = engine.step()? else { continue };
                last_train_loss = report.loss;
                if let Some(c) = checkpoints.filter(|c| c.every > 0 && report.global_step % c.every == 0) {
                    engine.save_checkpoint(&c.dir, None, serde_json::json!({ "step": report.global_step }))?;
                }
                if ctx.rank() == 0 && (report.global_step % plan.steps_per_print == 0 || report.global_step == steps) {
                    let rate = (report.global_step * b.train_batch_size) as f64 / start.elapsed().as_secs_f64();
                    log(&format!(
                        "[Rank 0] step={}, skipped={}, lr=[{:.6e}], loss={:.5}, grad_norm={:.4}, loss_scale={}, samples/s={rate:.0}",
                        report.global_step,
                        engine.counters().skipped_steps,
                        report.lr,
                        report.loss,
                        report.grad_norm,
                        report.next_loss_scale
                    ));
                }
            }
        }
        let saved_last = checkpoints.is_some_and(|c| c.every > 0 && steps.is_multiple_of(c.every));
        if let Some(c) = checkpoints.filter(|_| !saved_last && steps > first_step) {
            engine.save_checkpoint(&c.dir, None, serde_json::json!({ "step": steps }))?;
        }
        let seconds = start.elapsed().as_secs_f64();
        let comm_bytes_per_step = (engine.comm_stats().total_bytes() - comm_start) / (steps - first_step).max(1);
        let final_val_loss = val_loss(&mut engine)?;
        Ok::<_, crate::Error>(DemoSummary {
            steps,
            initial_val_loss,
            final_val_loss,
            last_train_loss,
            seconds,
            samples_per_second: ((steps - first_step) * b.train_batch_size) as f64 / seconds,
            num_params: engine.layout().num_elems(),
            memory: engine.memory_report(),
            comm_bytes_per_step,
        })
    })?;
    Ok(results.into_iter().next().expect("at least one rank"))
}
