//! `zerotrain eval`: the mean next-token loss and perplexity of a Hugging Face family's
//! model (from `model.hf_dir`, or a checkpoint of one) on a text file, through the engine
//! (so a model sharded at stage 3 evaluates as it trains).

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{Context, bail};
use burn::tensor::{Device, Int, Tensor, TensorData};
use zerotrain_zero::ReduceOp;

use crate::keys;
use crate::train::Handout;
use zerotrain::nn::parallel::ParallelGroups;
use zerotrain::{LoadOptions, Overrides, Plan};
use zerotrain_models::family::load::load_model;
use zerotrain_models::family::{HfModel, WithModel, companions};
use zerotrain_models::text::sequences;
use zerotrain_models::{CausalLm, LmBatch};

/// What `zerotrain eval` was asked.
#[derive(Debug, Clone, clap::Args)]
pub struct EvalArgs {
    /// A config whose `model` section names the model (`hf_dir` or `hf_config`); its
    /// `block_size`, where set, is the context (else the model's own positions).
    #[arg(long)]
    pub config: PathBuf,
    /// The UTF-8 text to score, tokenized by the model's tokenizer.json.
    #[arg(long, required_unless_present = "tokens", conflicts_with = "tokens")]
    pub text: Option<PathBuf>,
    /// A token file (zerotrain tokenize) to score: its held-out split, or all of it
    /// with --all.
    #[arg(long)]
    pub tokens: Option<PathBuf>,
    /// With --tokens: score every token of the file, not only its held-out split.
    #[arg(long, requires = "tokens")]
    pub all: bool,
    /// A checkpoint folder (holding `latest` and the tags) of the model to load.
    #[arg(long)]
    pub checkpoint: Option<PathBuf>,
    /// The checkpoint's tag (default: the one `latest` names).
    #[arg(long)]
    pub tag: Option<String>,
    /// A PEFT adapter folder (`adapter_config.json`, `adapter_model.safetensors`): the
    /// model gets its adapters, from its values (its config rules over `zerotrain.lora`).
    #[arg(long, value_name = "DIR")]
    pub adapter: Option<PathBuf>,
    /// Number of ranks (overrides `zerotrain.world_size`).
    #[arg(long)]
    pub world_size: Option<usize>,
    /// One JSON object instead of the sentence.
    #[arg(long)]
    pub json: bool,
}

impl EvalArgs {
    /// What to score: `--text`, or `--tokens` (all of it with `--all`).
    pub fn input(&self) -> EvalInput {
        match (&self.text, &self.tokens) {
            (Some(text), _) => EvalInput::Text(text.clone()),
            (None, Some(file)) => EvalInput::Tokens { file: file.clone(), all: self.all },
            (None, None) => unreachable!("clap requires --text or --tokens"),
        }
    }
}

/// What `zerotrain eval` scores.
#[derive(Debug, Clone)]
pub enum EvalInput {
    /// A UTF-8 text file, tokenized by the model's tokenizer.
    Text(PathBuf),
    /// A token file's held-out split, or (`all`) every token of it.
    Tokens { file: PathBuf, all: bool },
}

/// `zerotrain eval`.
pub fn eval(args: EvalArgs) -> anyhow::Result<()> {
    let overrides = Overrides { world_size: args.world_size, total_steps: Some(1), ..Overrides::default() };
    let (plan, settings) = keys::load(&args.config, overrides)?;
    let device = Device::flex().autodiff();
    device.seed(plan.runtime.seed);
    let checkpoint =
        args.checkpoint.as_deref().map(|d| companions::checked_folder(d, args.tag.as_deref())).transpose()?;
    let loaded = load_model(
        &settings.hf_model(&args.config, keys::adapters(&plan, args.adapter.as_deref())?)?,
        &args.config,
        &device,
        checkpoint.as_deref(),
        plan.runtime.seed,
    )?;
    let params = zerotrain_models::hf::size::ModelSize::of(&loaded.config).params;
    crate::train::memory::check_inference_memory(&plan, params, "eval")?;
    let (name, source) = match &args.input() {
        EvalInput::Text(path) => {
            let text = std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?;
            (path.display().to_string(), Source::Ids(loaded.tokenizer.encode_document(&text)?))
        }
        EvalInput::Tokens { file, all } => {
            let tokens = zerotrain_models::text::tokens::TokenFile::open(file)?;
            tokens.verify()?;
            tokens.check_written_by(&loaded.tokenizer)?;
            let range = if *all { 0..tokens.len() } else { tokens.train_tokens()..tokens.len() };
            let what = if *all { "" } else { " (held-out split)" };
            (format!("{}{what}", file.display()), Source::File(tokens, range))
        }
    };
    let windows = match &source {
        Source::File(file, _) if file.sequences() => Windows::sequences(&source, loaded.context, plan.mesh.sp),
        _ => Windows::over(&source, loaded.context, plan.mesh.sp),
    }
    .with_context(|| name.clone())?;
    let context_from = match windows.context < loaded.context {
        true => format!("the text's length; {} would be {}", loaded.context_from, loaded.context),
        false => loaded.context_from.clone(),
    };
    let (checkpoint, tag, vocab) = (checkpoint.as_deref(), args.tag.as_deref(), loaded.config.vocab_size());
    let split = |groups: &ParallelGroups, device: &Device| loaded.split(groups, device, plan.runtime.seed);
    let job = EvalJob { plan: &plan, windows: &windows, vocab, checkpoint, tag, split: &split };
    let Scores { loss, load_seconds, score_seconds } = loaded.model.clone().run(job)?;
    let scored = windows.scored();
    let weights = scored_weights(&plan, &loaded.config, checkpoint);
    if args.json {
        let json = serde_json::json!({"loss": loss, "perplexity": loss.exp(), "tokens": scored,
            "context": windows.context, "windows": windows.count, "context_from": context_from, "weights": weights,
            "load_seconds": load_seconds, "score_seconds": score_seconds});
        println!("{json}");
    } else {
        println!(
            "{name}: mean loss {loss:.6} per token, perplexity {:.4}, over {scored} tokens ({} of {}: \
             {context_from}); {weights}; model loaded in {load_seconds:.1} s, scored in {score_seconds:.1} s",
            loss.exp(),
            super::count(windows.count, "window"),
            windows.context
        );
    }
    Ok(())
}

/// Which weights `eval` scored, in words: the model's (or the checkpoint's fp32 masters)
/// in the config's compute dtype, and where an export of them is stored in another dtype
/// (`consolidate --format hf` writes config.json's), that it would score otherwise.
fn scored_weights(plan: &Plan, config: &zerotrain_models::hf::HfConfig, checkpoint: Option<&Path>) -> String {
    let compute = plan.precision.compute;
    let stored = zerotrain_models::family::export::stored_dtype(&config.json);
    let whose = match checkpoint {
        Some(dir) => format!("the fp32 masters of {}", dir.display()),
        None => "the model's weights".to_string(),
    };
    let mut words = format!("scored {whose} computed in {compute}");
    if checkpoint.is_some() && stored != compute {
        words += &format!(
            " (its Hugging Face export is stored in {stored}, config.json's dtype: compute in {stored} to score \
             those weights)"
        );
    }
    words
}

/// The tokens `eval` scores: a text's ids, or a range of a token file (read through its map).
pub enum Source {
    /// Ids in memory.
    Ids(Vec<u32>),
    /// Tokens `range` of a token file.
    File(zerotrain_models::text::tokens::TokenFile, std::ops::Range<usize>),
}

impl Source {
    fn len(&self) -> usize {
        match self {
            Self::Ids(ids) => ids.len(),
            Self::File(_, range) => range.len(),
        }
    }

    /// Tokens `range` (of this source) appended to `out`.
    fn extend(&self, range: std::ops::Range<usize>, out: &mut Vec<i64>) {
        match self {
            Self::Ids(ids) => out.extend(ids[range].iter().map(|&t| i64::from(t))),
            Self::File(file, within) => file.extend(within.start + range.start..within.start + range.end, out),
        }
    }
}

/// Non-overlapping windows of `context + 1` tokens, one token apart (each token after the
/// first is predicted once); a tail shorter than a window is left out. A text shorter than
/// one window is one window of its own length, as `transformers` scores the tokens it is
/// given.
pub struct Windows<'a> {
    source: &'a Source,
    /// The model's context (windows are one token longer).
    pub context: usize,
    /// How many windows.
    pub count: usize,
    /// In a file of fine-tuning sequences, its sequences (of the range scored), each a
    /// window of its own, padded, on its counted tokens only; `None`: windows across the
    /// tokens.
    sequences: Option<Vec<std::ops::Range<usize>>>,
}

impl<'a> Windows<'a> {
    /// The windows of `source`, each of a multiple of `sp` tokens (the sequence-parallel
    /// ranks each take an equal part); an error when it holds less than one.
    pub fn over(source: &'a Source, context: usize, sp: usize) -> anyhow::Result<Self> {
        if source.len() < 2 {
            bail!("{} token(s): a loss needs at least 2 (one to predict from, one to predict)", source.len());
        }
        let context = context.min(source.len() - 1) / sp * sp;
        if context == 0 {
            bail!(
                "{} token(s): a window split over zerotrain.mesh.sp {sp} ranks needs at least {} (a part for each, \
                 and one more to predict)",
                source.len(),
                sp + 1
            );
        }
        Ok(Self { source, context, count: (source.len() - 1) / context, sequences: None })
    }

    /// The sequences of a file of fine-tuning sequences within `source` (a range of it),
    /// each alone in a window of `context + 1` (a multiple of `sp`; a longer sequence
    /// truncated keeping its start); an error when it holds none.
    pub fn sequences(source: &'a Source, context: usize, sp: usize) -> anyhow::Result<Self> {
        let Source::File(file, within) = source else { bail!("a text holds no fine-tuning sequences") };
        let context = context / sp * sp;
        let sequences: Vec<_> =
            file.document_ranges().filter(|r| r.start >= within.start && r.end <= within.end).collect();
        if sequences.is_empty() {
            bail!("it holds no fine-tuning sequence in the range scored");
        }
        Ok(Self { source, context, count: sequences.len(), sequences: Some(sequences) })
    }

    /// Windows `range` as a batch `[n, context + 1]` (its rows split over `sp` sequence
    /// ranks), with its weight in the mean: the tokens it scores.
    fn batch(&self, range: std::ops::Range<usize>, sp: usize, device: &Device) -> (LmBatch, f64) {
        if let (Some(sequences), Source::File(file, _)) = (&self.sequences, self.source) {
            let alone: Vec<&[std::ops::Range<usize>]> = sequences[range].iter().map(std::slice::from_ref).collect();
            let (rows, counted) = sequences::rows(file, &alone, (self.context + 1, sequences::Packing::None), device);
            return (rows.divided_by(counted as f64).shared_by(sp as u64), counted as f64);
        }
        let n = range.len();
        let mut data = Vec::with_capacity(n * (self.context + 1));
        for w in range {
            self.source.extend(w * self.context..w * self.context + self.context + 1, &mut data);
        }
        (
            Tensor::<2, Int>::from_data(TensorData::new(data, [n, self.context + 1]), device).into(),
            (n * self.context) as f64,
        )
    }

    /// The tokens the windows score: every target, or the sequences' counted ones.
    pub fn scored(&self) -> usize {
        match (&self.sequences, self.source) {
            (Some(sequences), Source::File(file, _)) => {
                sequences.iter().map(|s| file.counted_in(s.start + 1..s.end.min(s.start + self.context + 1))).sum()
            }
            _ => self.count * self.context,
        }
    }
}

/// Tokens of windows a batch holds at least (the micro-batch's windows where they are more):
/// windows shorter than this go several to a forward pass, whose attention scores grow
/// with windows x length^2, so this bounds them by 4,096 x length per head.
const BATCH_TOKENS: usize = 4096;

/// Bytes of f32 logits a batch of short windows may hold (tokens x vocabulary x 4).
const LOGIT_BYTES: usize = 256 << 20;

/// Tokens a rank scores in one pass over the units, their activations between two units
/// held together (64 MiB per 1,024 of width in f32).
const HELD_TOKENS: usize = 16_384;

struct EvalJob<'a> {
    plan: &'a Plan,
    windows: &'a Windows<'a>,
    /// The model's vocabulary size (what its logits are wide).
    vocab: usize,
    checkpoint: Option<&'a Path>,
    tag: Option<&'a str>,
    /// A rank's part of the model for its groups, on a tensor- or sequence-parallel mesh.
    split: &'a (dyn Fn(&ParallelGroups, &Device) -> anyhow::Result<HfModel> + Sync),
}

/// What [`EvalJob`] measured.
struct Scores {
    /// Mean loss per token.
    loss: f64,
    /// Building the engine over the model (an import: its files read into the engine's
    /// tiers), and loading the checkpoint if one is given.
    load_seconds: f64,
    /// Scoring every window.
    score_seconds: f64,
}

impl WithModel for EvalJob<'_> {
    type Output = anyhow::Result<Scores>;

    /// Every data-parallel rank (of the mesh's, on one) scores its share of the windows, a
    /// batch at a time (the
    /// micro-batch, or `BATCH_TOKENS` of short windows, fewer for a vocabulary whose logits
    /// would pass `LOGIT_BYTES`), in rounds every rank joins (a rank out of windows scores
    /// window 0 with no weight), `HELD_TOKENS` per pass over the units; the sums are then
    /// all-reduced.
    fn run<M: CausalLm>(self, model: M) -> anyhow::Result<Scores> {
        let Self { plan, windows, vocab, checkpoint, tag, split } = self;
        let per = plan.batch.micro_batch_per_rank as usize;
        let model = Handout::new(model, plan);
        let sums = zerotrain::launch(plan, |ctx| -> zerotrain::Result<Scores> {
            let start = Instant::now();
            // On a mesh (as the model trained), each rank scores with its part of the model.
            let mut engine = match plan.mesh.is_trivial() {
                true => zerotrain::trainer(model.take(), plan, &ctx)?,
                false => {
                    let mesh = zerotrain::mesh::split(&ctx, plan)?;
                    let part =
                        split(&mesh.groups(), ctx.device()).map_err(|e| zerotrain::Error::Model(format!("{e:#}")))?;
                    let part = part
                        .into_model::<M>()
                        .ok_or_else(|| zerotrain::Error::Model("a part of another family".into()))?;
                    mesh.trainer(part)?
                }
            };
            if let Some(dir) = checkpoint {
                engine.load_checkpoint(dir, tag, LoadOptions::module_only())?;
            }
            let (load_seconds, start) = (start.elapsed().as_secs_f64(), Instant::now());
            let (n, d) = (engine.data_parallel_size(), engine.data_parallel_rank());
            // Short windows are scored many to a batch: each forward pass costs its
            // parameters' reads and conversions whatever its length.
            let batch_tokens = BATCH_TOKENS.min(LOGIT_BYTES / (4 * vocab.max(1)));
            let per = per.max(batch_tokens / (windows.context + 1));
            let rounds = windows.count.div_ceil(per * n);
            // Rounds are scored a chunk at a time, each unit running on every round of the
            // chunk in turn (at stage 3: gathered once per chunk, not per round).
            let chunk = (HELD_TOKENS / (per * (windows.context + 1))).max(1);
            let mut sum = [0.0f64, 0.0];
            for chunk_start in (0..rounds).step_by(chunk) {
                let (batches, weights): (Vec<_>, Vec<f64>) = (chunk_start..(chunk_start + chunk).min(rounds))
                    .map(|r| {
                        let first = (r * n + d) * per;
                        let range = first.min(windows.count)..(first + per).min(windows.count);
                        match range.is_empty() {
                            true => (windows.batch(0..1, plan.mesh.sp, ctx.device()).0, 0.0),
                            false => windows.batch(range, plan.mesh.sp, ctx.device()),
                        }
                    })
                    .unzip();
                for (loss, weight) in engine.evaluate_many(&batches)?.into_iter().zip(weights) {
                    sum[0] += f64::from(loss) * weight;
                    sum[1] += weight;
                }
            }
            // On a mesh, every rank of a data-parallel place holds the same sums: counted as
            // often in both, which the ratio does not see.
            let mut totals = [sum[0] as f32, sum[1] as f32];
            ctx.collective().all_reduce((&mut totals[..]).into(), ReduceOp::Sum)?;
            let loss = f64::from(totals[0]) / f64::from(totals[1]);
            Ok(Scores { loss, load_seconds, score_seconds: start.elapsed().as_secs_f64() })
        })?;
        Ok(sums.into_iter().next().expect("rank 0 scores"))
    }
}
