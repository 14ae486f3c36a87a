//! The main job behind `zerotrain train`: the built-in [`Gpt`] on a character corpus, every
//! rank a thread, rank 0 reporting. Outputs go to the run folder: `metrics.jsonl`,
//! `loss.png` and `checkpoints/`.

mod folder_lock;
pub mod hf;
pub(crate) mod memory;
mod metrics;
mod samples;
mod summary;
mod task;

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use burn::tensor::Device;
use zerotrain_zero::ReduceOp;

use self::folder_lock::lock_run_folder;
pub(crate) use self::folder_lock::open_lock_file;
pub use self::folder_lock::{LOCK_FILE, lock_file_name};
use self::memory::check_memory;
pub use self::metrics::{MetricsLog, StepMetrics, plot, register_font as plot_font};
pub use self::samples::SampleMode;
pub use self::summary::{RankTotals, Samples, TrainOptions, TrainSummary};
use self::task::CorpusData;
pub(crate) use self::task::Handout;
pub use self::task::{Task, TrainData};
use anyhow::{Context, bail};
pub use zerotrain_models::hf::size::available_memory;

use crate::keys::AppSettings;
use zerotrain::Trainer;
use zerotrain::config::ComputeDevice;
use zerotrain::engine::HostDeviceBytes;
use zerotrain::engine::UnitModel;
use zerotrain::nn::parallel::ParallelGroups;
use zerotrain::{Error, LoadOptions, Plan, RankContext, Result, StepReport, launch};
use zerotrain_models::LmBatch;
use zerotrain_models::data::Corpus;
use zerotrain_models::{Gpt, GptConfig};

/// Lines in the generated arithmetic corpus.
const ARITHMETIC_LINES: usize = 40_000;
/// Validation sequences per measurement.
const VALIDATION_SEQUENCES: u64 = 32;

/// The corpus the options name (generated from `seed`, or read from `data`), checked
/// against the model's context; and the model's shape with its vocabulary filled in.
pub fn load_corpus(model: &GptConfig, seed: u64, data: Option<&Path>) -> anyhow::Result<(Corpus, GptConfig)> {
    let corpus = match data {
        Some(path) => Corpus::from_file(path)?,
        None => Corpus::arithmetic(ARITHMETIC_LINES, seed),
    };
    corpus.check(model.block_size)?;
    let vocab = corpus.vocab.len();
    let model = match model.vocab_size {
        0 => GptConfig { vocab_size: vocab, ..*model },
        n if n < vocab => bail!("model.vocab_size is {n} but {} has {vocab} distinct characters", corpus.name),
        _ => *model,
    };
    model.validate().map_err(anyhow::Error::msg)?;
    Ok((corpus, model))
}

/// Runs the main job; `log` receives rank 0's lines, `progress` its per-step updates.
pub fn train_gpt(
    plan: &Plan,
    settings: &AppSettings,
    options: &TrainOptions,
    (corpus, shape): (&Corpus, GptConfig),
    log: &(dyn Fn(&str) + Sync),
    progress: &(dyn Fn(&StepMetrics) + Sync),
) -> anyhow::Result<TrainSummary> {
    check_memory(plan, shape.num_params())?;
    shape.check_mesh(plan.mesh.tp, plan.mesh.sp).map_err(anyhow::Error::msg)?;
    let device = Device::flex().autodiff();
    device.seed(plan.runtime.seed);
    let data = CorpusData { corpus, context: shape.block_size, seed: plan.runtime.seed };
    let samples = |model: &Gpt| samples::write_samples(model, corpus, &shape);
    let seed = plan.runtime.seed;
    // With zerotrain.lora, adapters on the layers it names and the rest frozen: the base is
    // drawn from the seed, which the checkpoints record (a resume must draw the same one).
    let lora = plan.lora.as_ref().map(|l| &*l.config);
    let init = match lora {
        Some(lora) => Gpt::new(&shape, &device).with_lora(lora).map_err(anyhow::Error::msg)?,
        None => Gpt::new(&shape, &device),
    };
    let num_params = zerotrain::engine::ParamCount::trainable(&init);
    let base = match lora {
        Some(_) => zerotrain_models::family::base::fingerprint(None, &[], |_| None, seed)?,
        None => serde_json::Value::Null,
    };
    // On a mesh, each rank's part of the model the run would otherwise start from.
    let part = |groups: &ParallelGroups, device: &Device| {
        Gpt::new_split_adapted(&shape, device, groups, seed, lora).map_err(anyhow::Error::msg)
    };
    let task = Task { init, num_params, data: &data, samples: &samples, files: Vec::new(), base, split: Some(&part) };
    train_model(plan, settings, options, task, log, progress)
}

/// Trains `task`'s model as the main job does: resume, train, validate, checkpoint, plot.
pub fn train_model<M: UnitModel<Batch = LmBatch> + Clone + Sync + 'static>(
    plan: &Plan,
    settings: &AppSettings,
    options: &TrainOptions,
    task: Task<'_, M>,
    log: &(dyn Fn(&str) + Sync),
    progress: &(dyn Fn(&StepMetrics) + Sync),
) -> anyhow::Result<TrainSummary> {
    let ckpt_dir = options.out.join("checkpoints");
    std::fs::create_dir_all(&options.out).with_context(|| format!("cannot create {}", options.out.display()))?;
    let _lock = lock_run_folder(&options.out)?;
    let resume_tag = zerotrain::resume_point(&ckpt_dir, options.resume).map_err(|e| match (e, options.resume) {
        (Error::Usage(_), false) => anyhow::anyhow!(
            "{} holds checkpoints of an earlier run: continue it with --resume, or choose another --out (nothing \
             was changed)",
            ckpt_dir.display()
        ),
        (Error::Usage(message), true) => anyhow::anyhow!("--resume: {message}"),
        (other, _) => other.into(),
    })?;
    check_memory(plan, task.num_params)?;
    if !task.files.is_empty() {
        std::fs::create_dir_all(&ckpt_dir).with_context(|| format!("cannot create {}", ckpt_dir.display()))?;
    }
    for (name, contents) in &task.files {
        zerotrain_models::family::export::write_atomically(&ckpt_dir.join(name), contents)?;
    }
    let every = options.save_every.unwrap_or(settings.checkpoint_every);
    let eval_every = settings.eval_every;
    let files = zerotrain_models::family::companions::record(&task.files);
    let Task { init, num_params: _, data, samples, files: _, base, split } = task;
    let job = Job {
        plan,
        options,
        data,
        samples,
        split,
        ckpt_dir,
        resume_tag,
        every,
        eval_every,
        files,
        base,
        log,
        progress,
    };
    let init = Handout::new(init, plan);
    let results = launch(plan, |ctx| job.run_rank(init.take(), &ctx))?;
    let ranks = results.iter().map(|s| s.ranks[0]).collect();
    let mut summary = results.into_iter().next().expect("at least one rank");
    summary.ranks = ranks;
    Ok(summary)
}

/// One `train_model` call, shared by its rank threads.
struct Job<'a, M> {
    plan: &'a Plan,
    options: &'a TrainOptions,
    data: &'a dyn TrainData,
    samples: &'a (dyn Fn(&M) -> zerotrain::Result<Vec<String>> + Sync),
    /// How a tensor-parallel rank builds its part of the model, where the model can.
    split: Option<&'a task::Splitter<'a, M>>,
    ckpt_dir: PathBuf,
    /// The checkpoint to resume from: `Some(None)` for `latest`, `Some(Some(tag))` for a tag.
    resume_tag: Option<Option<String>>,
    /// Checkpoint interval in steps (0: only at the end).
    every: u64,
    /// Validation interval in steps.
    eval_every: u64,
    /// The fingerprint of a LoRA run's frozen base (`Task::base`).
    base: serde_json::Value,
    /// The checksums of the files beside the checkpoints, which every checkpoint records
    /// (`family::companions`); `Null` for none.
    files: serde_json::Value,
    log: &'a (dyn Fn(&str) + Sync),
    progress: &'a (dyn Fn(&StepMetrics) + Sync),
}

impl<M: UnitModel<Batch = LmBatch> + Clone + Sync + 'static> Job<'_, M> {
    /// One rank's whole run: resume, train to `options.steps` (or a stop signal), save, sample.
    fn run_rank(&self, init: M, ctx: &RankContext) -> Result<TrainSummary> {
        let (plan, options) = (self.plan, self.options);
        let context = self.data.context();
        let mut engine = self.trainer(init, ctx)?;
        if let Some(tag) = &self.resume_tag {
            let client = engine.load_checkpoint(&self.ckpt_dir, tag.as_deref(), LoadOptions::default())?;
            let base = &client[zerotrain_models::family::base::KEY];
            zerotrain_models::family::base::check(base, &self.base).map_err(Error::Resume)?;
            let step = engine.counters().global_steps;
            self.data.resume(&client["data"], step).map_err(|e| Error::Resume(format!("{e:#}")))?;
        }
        let first_step = engine.counters().global_steps;
        let lead = ctx.rank() == 0;
        let metrics_path = options.out.join("metrics.jsonl");
        let mut log_file =
            if lead { Some(MetricsLog::open(&options.out, first_step).map_err(io(&metrics_path))?) } else { None };
        // Under sequence parallelism its rows are shared by the sequence ranks.
        let validation = self.data.validation(ctx.device()).shared_by(plan.mesh.sp as u64);
        let val_loss = |engine: &mut Box<dyn Trainer<M>>| engine.evaluate(&validation);
        let initial_val = val_loss(&mut engine)?;
        let tokens_per_step = (plan.batch.train_batch_size * context as u64) as f64;
        let (start, comm_start) = (Instant::now(), engine.comm_stats().total_bytes());
        let (mut step, mut last_saved, mut interrupted) = (first_step, first_step, false);
        let mut crossed = HostDeviceBytes::default();
        // The steps' own seconds (the training throughput), and the validation loss of the
        // model as it stands, where one was computed after the last step.
        let (mut train_secs, mut val_now) = (0.0, None);
        while step < options.steps {
            let (step_start, counted_tokens) = (Instant::now(), self.data.counted(step));
            let report = self.train_step(engine.as_mut(), step, ctx)?;
            // The step's own time: the validation below is not training throughput.
            let step_secs = step_start.elapsed().as_secs_f64();
            train_secs += step_secs;
            step = report.global_step;
            crossed = crossed.plus(&report.host_device);
            let val =
                (step % self.eval_every == 0 || step == options.steps).then(|| val_loss(&mut engine)).transpose()?;
            val_now = val;
            let metrics = StepMetrics {
                step,
                loss: report.loss,
                lr: report.lr,
                loss_scale: report.loss_scale,
                grad_norm: report.grad_norm,
                tokens_per_s: tokens_per_step / step_secs,
                skipped: report.skipped,
                val_loss: val,
                counted_tokens,
                comm_bytes: report.comm_bytes,
                rounds: engine.rounds(),
                live_groups: engine.last_round().map(|r| r.live_groups),
                staleness: engine.last_round().map(|r| r.staleness),
                global_round: engine.last_round().and_then(|r| r.global_round),
            };
            if let Some(file) = &mut log_file {
                file.push(&metrics).map_err(io(&metrics_path))?;
                (self.progress)(&metrics);
                // Once a stop signal has arrived, no more step lines: under mpirun the
                // launcher stops draining the ranks' output as it shuts down, and a rank
                // blocked on a full stdout pipe would never reach its save.
                if step % plan.runtime.steps_per_print == 0 && !options.stop.load(Ordering::Relaxed) {
                    self.print_step(&metrics, &report, engine.counters().skipped_steps);
                }
            }
            if self.every > 0 && step % self.every == 0 {
                self.save(engine.as_mut(), step)?;
                last_saved = step;
            }
            if stop_requested(&options.stop, ctx)? {
                interrupted = true;
                break;
            }
        }
        let seconds = start.elapsed().as_secs_f64();
        let comm_bytes_per_step = (engine.comm_stats().total_bytes() - comm_start) / (step - first_step).max(1);
        // A run of no steps saves the model it starts from (`--steps 0`: a fresh model to
        // export), as it says it does.
        if step > last_saved || self.resume_tag.is_none() && step == 0 {
            self.save(engine.as_mut(), step)?;
        }
        // Every rank took the same steps and so knows alike whether the last one was
        // validated (a validation is collective at stage 3).
        let final_val = match val_now {
            Some(val) => val,
            None => val_loss(&mut engine)?,
        };
        let samples = match samples::withheld(plan, options.samples) {
            Some(why) => Samples::Withheld(why),
            None => Samples::Written(
                engine.gather_model(0)?.map(|model| (self.samples)(&model)).transpose()?.unwrap_or_default(),
            ),
        };
        if let Some(file) = &mut log_file {
            let all = file.read_all().map_err(io(&metrics_path))?;
            let png = options.out.join("loss.png");
            plot(&all, &png).map_err(|e| io(&png)(std::io::Error::other(e)))?;
        }
        Ok(TrainSummary {
            first_step,
            last_step: step,
            interrupted,
            val_loss: (initial_val, final_val),
            seconds,
            tokens_per_s: (step - first_step) as f64 * tokens_per_step / train_secs.max(1e-9),
            num_params: engine.num_params(),
            ranks: vec![RankTotals {
                rank: ctx.rank(),
                memory: engine.memory_report(),
                host_device: (plan.runtime.device != ComputeDevice::Cpu).then_some(crossed),
            }],
            comm_bytes_per_step,
            samples,
            out: options.out.clone(),
        })
    }

    /// This rank's trainer: on a tensor-parallel mesh (each replica group's, with
    /// `local_sgd`), over its data-parallel group, of its part of the model (built for its
    /// tensor group: `init` is dropped); else of `init`.
    fn trainer(&self, init: M, ctx: &RankContext) -> Result<Box<dyn Trainer<M>>> {
        if self.plan.mesh.is_trivial() {
            return zerotrain::trainer(init, self.plan, ctx);
        }
        let mesh = zerotrain::mesh::split(ctx, self.plan)?;
        let model = match self.split {
            Some(split) => split(&mesh.groups(), ctx.device()).map_err(|e| Error::Model(format!("{e:#}")))?,
            // The engine refuses it, naming the missing plan.
            None => init,
        };
        mesh.trainer(model)
    }

    /// The optimizer step after `step`: every micro-batch of this rank, then the update.
    /// Data-parallel rank `d`'s micro-step `i` reads sequences `(i·D + d)·micro ..` of the
    /// step's batch, `D` the data-parallel ranks (every stage of one pipeline reads the same
    /// micro-batches).
    fn train_step(&self, engine: &mut dyn Trainer<M>, step: u64, ctx: &RankContext) -> Result<StepReport> {
        let b = &self.plan.batch;
        let (n, d) = (engine.data_parallel_size() as u64, engine.data_parallel_rank() as u64);
        // Those that share the step's loss: every micro-batch of every rank the engine
        // averages over (its data-parallel ranks and their sequence ranks).
        let parts = b.gradient_accumulation_steps * n * self.plan.mesh.sp as u64;
        engine.train_batch(&mut |micro| {
            let first = (micro as u64 * n + d) * b.micro_batch_per_rank;
            self.data.batch(step, first, b.micro_batch_per_rank, ctx.device()).shared_by(parts)
        })
    }

    /// DeepSpeed's per-step log line (and the time breakdown when `wall_clock_breakdown`).
    fn print_step(&self, m: &StepMetrics, report: &StepReport, skipped_steps: u64) {
        (self.log)(&format!(
            "[Rank 0] step={}, skipped={skipped_steps}, lr=[{:.6e}], loss={:.5}, grad_norm={:.4}, loss_scale={}, tokens/s={:.0}{}",
            m.step,
            m.lr,
            m.loss,
            m.grad_norm,
            report.next_loss_scale,
            m.tokens_per_s,
            m.val_loss.map(|v| format!(", val_loss={v:.5}")).unwrap_or_default()
        ));
        if self.plan.runtime.wall_clock_breakdown {
            let t = report.times;
            let ms = |s: f64| s * 1e3;
            (self.log)(&format!(
                "[Rank 0] time (ms) | forward: {:.2} | backward: {:.2} | reduce: {:.2} | optimizer: {:.2} | gather: {:.2}",
                ms(t.forward),
                ms(t.backward),
                ms(t.reduce),
                ms(t.optimizer),
                ms(t.gather)
            ));
        }
    }

    /// Saves a checkpoint tagged with the step, its client state `{"step": step}` and,
    /// where the data has one, its position (`"data"`).
    fn save(&self, engine: &mut dyn Trainer<M>, step: u64) -> Result<()> {
        let mut client = serde_json::json!({ "step": step });
        let position = self.data.position(step);
        if !position.is_null() {
            client["data"] = position;
        }
        if !self.files.is_null() {
            client[zerotrain_models::family::companions::KEY] = self.files.clone();
        }
        if !self.base.is_null() {
            client[zerotrain_models::family::base::KEY] = self.base.clone();
        }
        engine.save_checkpoint(&self.ckpt_dir, None, client)?;
        Ok(())
    }
}

/// Whether any rank saw SIGINT or SIGTERM. The signal reaches each rank (thread, or process
/// under mpirun, where a scheduler may signal only some) at a different moment,
/// so the ranks agree (an all-reduce MAX) before acting on it.
fn stop_requested(stop: &AtomicBool, ctx: &RankContext) -> Result<bool> {
    let mut flag = [if stop.load(Ordering::Relaxed) { 1.0f32 } else { 0.0 }];
    ctx.collective().all_reduce((&mut flag[..]).into(), ReduceOp::Max)?;
    Ok(flag[0] > 0.0)
}

fn io(path: &Path) -> impl Fn(std::io::Error) -> Error + '_ {
    move |source| Error::Io { path: path.to_path_buf(), cause: source }
}
