//! What each `zerotrain` subcommand does (errors are `anyhow`).

pub mod bench;
mod check;
mod checkpoints;
pub mod estimate;
pub mod eval;
pub mod generate;
pub mod launch;
mod serve;
pub mod tokenize;

use std::path::PathBuf;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

pub use self::check::config_check;
pub use self::checkpoints::{ConsolidateArgs, consolidate, inspect};
pub use self::serve::serve;
use crate::keys;
use crate::train::{SampleMode, Samples, StepMetrics, TrainOptions, TrainSummary};
use anyhow::{Context, bail};
use indicatif::{ProgressBar, ProgressStyle};
use zerotrain::{Overrides, detect_mpirun};

/// The flag a stop signal sets: the job finishes its step, saves and ends.
///
/// Note: one stop per rank. A terminal's Ctrl-C goes to its whole foreground process group,
/// and Slurm signals every process of a step: the ranks of a launched job (which share the
/// launcher's group, as torchrun's do) get the signal directly and again as the launcher's
/// SIGTERM, a moment apart. So in a job of processes every signal after the first is the
/// same stop, and the launcher (or the scheduler) is who ends a rank that does not stop:
/// `zerotrain launch` kills its ranks at a second signal, or `--grace-s` after the first.
/// A job of threads, alone in its process, stops now at a second signal (exit 130).
fn stop_on_signals(in_processes: bool) -> anyhow::Result<Arc<AtomicBool>> {
    let stop = Arc::new(AtomicBool::new(false));
    let flag = Arc::clone(&stop);
    ctrlc::set_handler(move || match (flag.swap(true, Ordering::SeqCst), in_processes) {
        (false, _) => eprintln!(
            "\nzerotrain: SIGINT/SIGTERM: finishing this step, saving a checkpoint and stopping{}",
            if in_processes { "" } else { " (again to abort)" }
        ),
        (true, true) => {}
        (true, false) => {
            eprintln!("\nzerotrain: second signal: stopping now");
            std::process::exit(130);
        }
    })?;
    Ok(stop)
}

/// `n` and `noun`, the noun plural where `n` is not 1: "1 rank", "2 ranks".
pub(crate) fn count(n: usize, noun: &str) -> String {
    match n {
        1 => format!("1 {noun}"),
        n => format!("{n} {noun}s"),
    }
}

/// `zerotrain train`.
pub fn train(args: TrainArgs) -> anyhow::Result<()> {
    let overrides = Overrides { device: args.device, ..overrides(args.world_size, Some(args.steps))? };
    let (mut plan, settings) = keys::load_as_group(&args.config, overrides, &args.servers, args.group)?;
    if let Some(warning) = plan.warning() {
        eprintln!("warning: {warning}");
    }
    let stem = args.config.file_stem().and_then(|s| s.to_str()).unwrap_or("run").to_string();
    let out = args.out.clone().unwrap_or_else(|| PathBuf::from("runs").join(stem));
    // In a job of processes every process runs this; rank 0 alone speaks.
    let lead = crate::processes::place().is_none_or(|(rank, _)| rank == 0);
    let say = |line: String| {
        if lead {
            println!("{line}");
        }
    };
    if settings.hf.is_none() && args.packing.is_some() {
        bail!(
            "--packing: the built-in GPT trains on a text's characters, which holds no fine-tuning sequences; it \
             applies to a Hugging Face family's model on a token file of them (zerotrain tokenize of conversations or \
             prompt/completion rows)"
        );
    }
    let job = match settings.hf.is_some() {
        true => hf_job(&args, &mut plan, &settings, &out, &say)?,
        false => gpt_job(&args, &plan, &settings, &say)?,
    };
    let stop = stop_on_signals(crate::processes::place().is_some())?;
    let bar = if lead { ProgressBar::new(args.steps) } else { ProgressBar::hidden() };
    bar.set_style(
        ProgressStyle::with_template("{bar:30} {pos}/{len} steps  {msg}  ETA {eta}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    let log = |line: &str| if bar.is_hidden() { println!("{line}") } else { bar.println(line) };
    let progress = |m: &StepMetrics| {
        bar.set_position(m.step);
        bar.set_message(format!(
            "loss {:.4}  lr {:.2e}  scale {}  {:.0} tok/s",
            m.loss, m.lr, m.loss_scale, m.tokens_per_s
        ));
    };
    let options = TrainOptions {
        steps: args.steps,
        out,
        resume: args.resume,
        save_every: args.save_every,
        packing: args.packing.map(|mode| match mode {
            PackingMode::Bfd => zerotrain_models::text::sequences::Packing::Bfd,
            PackingMode::None => zerotrain_models::text::sequences::Packing::None,
        }),
        stop,
        samples: args.samples,
    };
    let s = match job {
        TrainJob::Gpt(corpus, shape) => {
            crate::train::train_gpt(&plan, &settings, &options, (&corpus, shape), &log, &progress)
        }
        TrainJob::Hf(loaded, data) => {
            crate::train::hf::train_hf(&plan, &settings, &options, *loaded, data, &log, &progress)
        }
    }
    .context("training failed")?;
    bar.finish_and_clear();
    if lead {
        print_summary(&s);
    }
    print_crossed(&s);
    Ok(())
}

/// On a device, each of this process's ranks: what the engine copied of model states
/// between host memory and its device (0 where they all live on the device). Every process
/// of a job says its own, so that a job's log holds every rank's.
fn print_crossed(s: &TrainSummary) {
    for r in &s.ranks {
        if let Some(c) = r.host_device {
            println!(
                "rank {}: model states crossed host<->device over {} steps: {} B to the device, {} B to the host",
                r.rank,
                s.last_step - s.first_step,
                c.to_device,
                c.to_host
            );
        }
    }
}

/// "N ranks on DEVICE, STAGE, DTYPE": how `plan` runs, for the line a job opens with.
fn ranks_of(plan: &zerotrain::Plan) -> String {
    format!(
        "{} on {}, {}, {}",
        count(plan.world_size(), "rank"),
        plan.runtime.device.name(),
        plan.zero.stage,
        plan.precision.compute
    )
}

/// The Hugging Face family's model of `settings`, its context (which every rank of a job of
/// processes must train at: it joins what the rendezvous compares, `plan.agreed`) and its
/// token data, said in one line.
fn hf_job(
    args: &TrainArgs,
    plan: &mut zerotrain::Plan,
    settings: &keys::AppSettings,
    out: &std::path::Path,
    say: &dyn Fn(String),
) -> anyhow::Result<TrainJob> {
    use zerotrain_models::family::load::{load_model, training_context};
    let device = burn::tensor::Device::flex().autodiff();
    device.seed(plan.runtime.seed);
    let wanted = settings.hf_model(&args.config, keys::adapters(plan, args.adapter.as_deref())?)?;
    keys::record_lora(plan, args.adapter.as_deref(), &wanted.from)?;
    let mut loaded = load_model(&wanted, &args.config, &device, None, plan.runtime.seed)?;
    let rule = (settings.block_size.is_some(), plan.activation_checkpointing);
    let available = zerotrain_models::hf::size::available_memory();
    (loaded.context, loaded.context_from) =
        training_context(&loaded, plan.batch.micro_batch_per_rank, rule, available)?;
    plan.agreed.insert("model.context".into(), loaded.context.to_string());
    let data = crate::train::hf::token_file(args.data.as_deref(), &loaded.tokenizer, out)?;
    say(format!(
        "training {} ({}, context {}: {}) on {} ({} tokens, {} held out): {}",
        loaded.source.display(),
        loaded.config.json["model_type"].as_str().unwrap_or("?"),
        loaded.context,
        loaded.context_from,
        data.path().display(),
        data.len(),
        data.len() - data.train_tokens(),
        ranks_of(plan)
    ));
    Ok(TrainJob::Hf(Box::new(loaded), data))
}

/// The built-in GPT of `settings` and its character corpus, said in one line.
fn gpt_job(
    args: &TrainArgs,
    plan: &zerotrain::Plan,
    settings: &keys::AppSettings,
    say: &dyn Fn(String),
) -> anyhow::Result<TrainJob> {
    if let Some(dir) = &args.adapter {
        anyhow::bail!(
            "--adapter {}: a PEFT adapter names a Hugging Face model's modules, and the built-in GPT (a model \
             section without hf_dir or hf_config) is not one: its adapters start fresh from zerotrain.lora",
            dir.display()
        );
    }
    let (corpus, shape) = crate::train::load_corpus(&settings.model, plan.runtime.seed, args.data.as_deref())?;
    say(format!(
        "training a GPT of {} parameters ({} layers, width {}, context {}) on {} ({} characters, vocabulary {}): {}",
        shape.num_params(),
        shape.n_layer,
        shape.n_embd,
        shape.block_size,
        corpus.name,
        corpus.train.len() + corpus.valid.len(),
        shape.vocab_size,
        ranks_of(plan)
    ));
    Ok(TrainJob::Gpt(corpus, shape))
}

/// What `zerotrain train` trains: the built-in GPT on a character corpus, or a Hugging
/// Face family's model on a token file.
enum TrainJob {
    Gpt(zerotrain_models::data::Corpus, zerotrain_models::GptConfig),
    Hf(Box<zerotrain_models::family::load::LoadedModel>, zerotrain_models::text::tokens::TokenFile),
}

/// The command line's overrides, plus what the launcher's environment says (`mpirun`'s, or
/// another launcher's: a malformed variable of theirs is an error naming it).
pub fn overrides(world_size: Option<usize>, total_steps: Option<u64>) -> anyhow::Result<Overrides> {
    let launcher = zerotrain::detect_launcher()?;
    Ok(Overrides { world_size, total_steps, mpirun: detect_mpirun(), launcher, device: None })
}

/// `zerotrain train`'s arguments (see `cli::Command::Train`).
#[derive(Debug, Clone, clap::Args)]
pub struct TrainArgs {
    /// A DeepSpeed-style JSON config.
    #[arg(long)]
    pub config: PathBuf,
    /// Number of ranks (overrides `zerotrain.world_size`).
    #[arg(long)]
    pub world_size: Option<usize>,
    /// Where the ranks compute: cpu, wgpu or cuda (overrides `zerotrain.device`).
    #[arg(long)]
    pub device: Option<zerotrain::config::ComputeDevice>,
    /// Optimizer steps to reach.
    #[arg(long, default_value_t = 2400)]
    pub steps: u64,
    /// What to train on. The built-in GPT: a UTF-8 text file of characters (default:
    /// generated arithmetic). A Hugging Face family's model: a token file (`zerotrain
    /// tokenize`), or a text or JSON-lines file, tokenized into <out>/data.tokens (1% of
    /// its tokens held out for validation).
    #[arg(long)]
    pub data: Option<PathBuf>,
    /// Run folder for metrics.jsonl, loss.png and checkpoints/ (default: runs/<config name>).
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Save a checkpoint every N steps (overrides `zerotrain.checkpoint_every`; 0: at the end).
    #[arg(long)]
    pub save_every: Option<u64>,
    /// Continue from the run folder's latest checkpoint.
    #[arg(long)]
    pub resume: bool,
    /// A token file of fine-tuning sequences: bfd packs several to a row (best-fit
    /// decreasing, as TRL's packing; positions restart at each and attention stays inside
    /// it), none trains one to a row, padded (TRL's packing=False). Default: bfd. Refused
    /// for data that holds no such sequences.
    #[arg(long, value_enum)]
    pub packing: Option<PackingMode>,
    /// Samples of the trained model at the end (they gather the whole model on rank 0).
    /// auto: unless stage 3 keeps the parameters offloaded (`offload_param`) or the base
    /// in NF4; on: always; off: never.
    #[arg(long, value_enum, default_value_t = SampleMode::Auto)]
    pub samples: SampleMode,
    /// A PEFT adapter folder (`adapter_config.json`, `adapter_model.safetensors`): the
    /// model gets its adapters, from its values (its config rules over `zerotrain.lora`).
    #[arg(long, value_name = "DIR")]
    pub adapter: Option<PathBuf>,
    /// Train as one replica group through this parameter server (`zerotrain serve`;
    /// repeat for several): overrides `local_sgd.servers`.
    #[arg(long = "server", value_name = "ADDR")]
    pub servers: Vec<String>,
    /// This job's replica group among the servers' groups: overrides `local_sgd.group`.
    #[arg(long)]
    pub group: Option<u64>,
}

/// `train --packing`: how fine-tuning sequences go into rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum PackingMode {
    /// Several to a row, kept apart.
    Bfd,
    /// One to a row.
    None,
}

/// How the validation loss moved, as a ratio: "2.2x lower", "1.1x higher".
fn loss_change(before: f32, after: f32) -> String {
    let r = before / after;
    if r.is_nan() {
        "no ratio".into()
    } else if r > 1.0 {
        format!("{r:.1}x lower")
    } else if r < 1.0 {
        format!("{:.1}x higher", 1.0 / r)
    } else {
        "unchanged".into()
    }
}

fn print_summary(s: &TrainSummary) {
    let (a, b) = s.val_loss;
    if s.interrupted {
        println!("stopped by SIGINT/SIGTERM at step {} (checkpoint saved)", s.last_step);
    }
    // A large model on a CPU may take seconds per token.
    let places = if s.tokens_per_s < 10.0 { 2 } else { 0 };
    println!(
        "validation loss {a:.5} -> {b:.5} ({}) in {:.1} s, steps {}..{}, {:.*} tokens/s",
        loss_change(a, b),
        s.seconds,
        s.first_step,
        s.last_step,
        places,
        s.tokens_per_s
    );
    println!("model states per rank (bytes; Ψ = {}):", s.num_params);
    // A frozen base's column (a LoRA run's: in memory, swap files aside) only where one is.
    let frozen = s.ranks.iter().any(|r| r.memory.frozen > 0);
    let column = |v: String| if frozen { format!(" {v:>12}") } else { String::new() };
    println!(
        "  {:>4} {:>12} {:>12} {:>12} {:>12} {:>15}{}",
        "rank",
        "params",
        "grads",
        "master",
        "optimizer",
        "peak transient",
        column("frozen".into())
    );
    for r in &s.ranks {
        let m = &r.memory;
        println!(
            "  {:>4} {:>12} {:>12} {:>12} {:>12} {:>15}{}",
            r.rank,
            m.params,
            m.grads,
            m.master,
            m.optimizer,
            m.peak_transient,
            column(m.frozen.to_string())
        );
    }
    println!("rank 0 communication: {} B per step", s.comm_bytes_per_step);
    let out = s.out.display();
    match &s.samples {
        Samples::Withheld(why) => println!("no samples from the trained model: {why}"),
        Samples::Written(lines) => {
            println!("samples from the trained model:");
            for sample in lines {
                println!("  {sample}");
            }
        }
    }
    println!("outputs: {out}/metrics.jsonl, {out}/loss.png, {out}/checkpoints/");
}

/// A `/proc/self/status` field in KiB (Linux).
pub(crate) fn proc_status_kib(field: &str) -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    status.lines().find(|l| l.starts_with(field))?.split_whitespace().nth(1)?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::loss_change;

    #[test]
    fn the_summary_says_which_way_the_loss_moved() {
        assert_eq!(loss_change(2.57, 1.16), "2.2x lower");
        assert_eq!(loss_change(1.0, 1.25), "1.2x higher");
        assert_eq!(loss_change(37.95, 37.98), "1.0x higher");
        assert_eq!(loss_change(3.0, 3.0), "unchanged");
        assert_eq!(loss_change(3.0, f32::NAN), "no ratio");
    }
}
