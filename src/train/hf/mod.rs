//! `zerotrain train` of a Hugging Face family's model (`model.hf_dir` or `model.hf_config`)
//! on a token file (or a text file tokenized on the fly): the checkpoints' folder gets the
//! model's `config.json` and `tokenizer.json`, so `zerotrain consolidate --format hf` can
//! write a Hugging Face folder from any of its checkpoints.

use std::path::Path;

use std::sync::{Arc, Mutex};

use anyhow::{Context, bail};
use burn::tensor::{Device, Int, Tensor};

use super::{StepMetrics, Task, TrainData, TrainOptions, TrainSummary, task, train_model};
use crate::keys::AppSettings;
use zerotrain::Plan;
use zerotrain::engine::ParamCount;
use zerotrain::nn::parallel::ParallelGroups;
use zerotrain_models::family::load::LoadedModel;
use zerotrain_models::family::{HfModel, WithModel};
use zerotrain_models::file_error::read_optional;
use zerotrain_models::hf;
use zerotrain_models::text::Tokenizer;
use zerotrain_models::text::documents::Documents;
use zerotrain_models::text::sampler::TokenSampler;
use zerotrain_models::text::sequences::{Packing, SequenceRows};
use zerotrain_models::text::tokens::TokenFile;
use zerotrain_models::{CausalLm, LmBatch, Sampling};

/// The training data of a Hugging Face family's run: `data` as a token file, or a UTF-8
/// text file (or JSON lines, as `tokenize` reads them) tokenized into `<out>/data.tokens`
/// first (1% held out), a batch at a time.
pub fn token_file(data: Option<&Path>, tokenizer: &Tokenizer, out: &Path) -> anyhow::Result<TokenFile> {
    let Some(data) = data else {
        bail!("a Hugging Face family's run needs --data: a token file (zerotrain tokenize) or a text file")
    };
    let mut head = [0u8; 8];
    // Only a regular file: a FIFO's open would wait for a writer, a device never end.
    let mut opened = zerotrain_checkpoint::open_regular(data)
        .map_err(|e| anyhow::anyhow!("--data {}: cannot open it: {e}", data.display()))?;
    let is_tokens = std::io::Read::read_exact(&mut opened, &mut head).map(|()| &head == b"ZTTOKENS").unwrap_or(false);
    let file = if is_tokens { TokenFile::open(data)? } else { tokenized_once(data, tokenizer, out)? };
    file.verify()?;
    file.check_written_by(tokenizer)?;
    Ok(file)
}

/// The furthest position a checkpoint may record, in samples (2^48: far beyond any run, and
/// far enough below 2^64 that counting on from it cannot overflow).
const MAX_SAMPLES: u64 = 1 << 48;

/// `data`, a text file, as `<out>/data.tokens`, tokenized by one process: under mpirun every
/// process of the job asks, and they take turns on `<out>/data.tokens.lock`. The first
/// writes the file (through a rename) and then `data.tokens.source`, a stamp of the text
/// (its path, size and modification time) and the tokenizer's fingerprint; one that finds
/// the stamp its own opens the file instead of writing it again (once every process wrote
/// the same file over the others', truncating it under readers).
fn tokenized_once(data: &Path, tokenizer: &Tokenizer, out: &Path) -> anyhow::Result<TokenFile> {
    use std::os::unix::fs::MetadataExt;
    std::fs::create_dir_all(out).with_context(|| format!("cannot create {}", out.display()))?;
    let lock_path = out.join("data.tokens.lock");
    let lock = super::open_lock_file(&lock_path)?;
    lock.lock().with_context(|| format!("cannot lock {}", lock_path.display()))?;
    let meta = std::fs::metadata(data).with_context(|| format!("cannot read {}", data.display()))?;
    let stamp = serde_json::json!({
        "source": std::fs::canonicalize(data).unwrap_or_else(|_| data.to_path_buf()).display().to_string(),
        "bytes": meta.len(),
        "modified_ns": meta.mtime() as i128 * 1_000_000_000 + i128::from(meta.mtime_nsec()),
        "tokenizer": format!("{:016x}", tokenizer.fingerprint()),
    })
    .to_string();
    let (tokens, stamp_path) = (out.join("data.tokens"), out.join("data.tokens.source"));
    let recorded = read_optional(&stamp_path)?;
    if recorded.as_deref() == Some(stamp.as_bytes())
        && let Ok(file) = TokenFile::open(&tokens)
    {
        return Ok(file);
    }
    let _ = std::fs::remove_file(&stamp_path);
    let file = Documents::new(&[data.to_path_buf()], "text").write_token_file(tokenizer, &tokens, 0.01)?.0;
    zerotrain_models::family::export::write_atomically(&stamp_path, stamp.as_bytes())?;
    Ok(file)
}

/// A token file's windows (or, in a file of fine-tuning sequences, its sequences one to a
/// row) in the sampler's order, the position counted in samples.
struct TokenData {
    sampler: Cut,
    file: Arc<TokenFile>,
    /// Sequences per optimizer step, over every replica group ([`Plan::sequences_per_step`]).
    global_batch: u64,
    /// (samples drawn before the first step of this run, that step).
    base: Mutex<(u64, u64)>,
    /// The counted targets of the step whose first sample is the first value, counted once
    /// for its micro-batches and ranks (rank threads share this data).
    step_counted: Mutex<Option<(u64, u64)>>,
}

/// How a token file's samples are cut.
enum Cut {
    /// Windows across its documents (a corpus).
    Windows(TokenSampler),
    /// Its fine-tuning sequences, one to a row or packed.
    Sequences(SequenceRows),
}

impl TokenData {
    /// The first sample of the file's order (the sample prompt's start).
    fn first_row(&self, device: &Device) -> Tensor<2, Int> {
        match &self.sampler {
            Cut::Windows(windows) => windows.batch(0, 1, device),
            Cut::Sequences(rows) => rows.batch(0, 1, 1.0, device).tokens,
        }
    }

    /// The counted targets of the step that starts at sample `at` (its global batch).
    fn step_counted(&self, rows: &SequenceRows, at: u64) -> u64 {
        let mut cached = self.step_counted.lock().unwrap_or_else(|p| p.into_inner());
        match *cached {
            Some((first, counted)) if first == at => counted,
            _ => {
                let counted = rows.counted(at, self.global_batch);
                *cached = Some((at, counted));
                counted
            }
        }
    }

    /// The run's first sample of the step after `step`.
    fn first_sample(&self, step: u64) -> u64 {
        let (samples, from) = *self.base.lock().unwrap_or_else(|p| p.into_inner());
        samples + (step - from) * self.global_batch
    }
}

impl TrainData for TokenData {
    fn context(&self) -> usize {
        match &self.sampler {
            Cut::Windows(windows) => windows.context(),
            Cut::Sequences(rows) => rows.context(),
        }
    }

    fn batch(&self, step: u64, first: u64, count: u64, device: &Device) -> LmBatch {
        let at = self.first_sample(step);
        match &self.sampler {
            Cut::Windows(windows) => windows.batch(at + first, count, device).into(),
            Cut::Sequences(rows) => rows.batch(at + first, count, self.step_counted(rows, at) as f64, device),
        }
    }

    fn counted(&self, step: u64) -> Option<u64> {
        match &self.sampler {
            Cut::Windows(_) => None,
            Cut::Sequences(rows) => Some(self.step_counted(rows, self.first_sample(step))),
        }
    }

    fn validation(&self, device: &Device) -> LmBatch {
        match &self.sampler {
            Cut::Windows(windows) => windows.validation(device).into(),
            Cut::Sequences(rows) => rows.validation(device),
        }
    }

    fn position(&self, step: u64) -> serde_json::Value {
        serde_json::json!({
            "file": self.file.path().display().to_string(),
            "checksum": self.file.checksum(),
            "samples": self.first_sample(step),
        })
    }

    fn resume(&self, record: &serde_json::Value, step: u64) -> anyhow::Result<()> {
        if !record.is_object() || record.get("checksum").is_none() && record.get("samples").is_none() {
            bail!("the checkpoint records no position in a token file (it was not trained on one)");
        }
        let (Some(checksum), Some(samples)) = (record["checksum"].as_u64(), record["samples"].as_u64()) else {
            bail!("the checkpoint's position in its token file is malformed (a checksum and a sample count): {record}");
        };
        if samples > MAX_SAMPLES || checksum > u64::from(u32::MAX) {
            bail!(
                "the checkpoint's position in its token file is out of range (sample {samples}, checksum {checksum}; \
                 at most {MAX_SAMPLES} samples): the manifest is damaged"
            );
        }
        if checksum != u64::from(self.file.checksum()) {
            bail!(
                "the checkpoint was trained on {} (checksum {checksum:08x}); this run reads {} (checksum {:08x}): \
                 give the same --data to continue its sample order",
                record["file"].as_str().unwrap_or("another token file"),
                self.file.path().display(),
                self.file.checksum()
            );
        }
        *self.base.lock().unwrap_or_else(|p| p.into_inner()) = (samples, step);
        Ok(())
    }
}

/// Trains `loaded` on `data`; the checkpoints' folder gets its `config.json` and
/// `tokenizer.json` first, and the files that travel with them where the model's folders
/// have them (`tokenizer_config.json`, `special_tokens_map.json`,
/// `generation_config.json`).
pub fn train_hf(
    plan: &Plan,
    settings: &AppSettings,
    options: &TrainOptions,
    loaded: LoadedModel,
    data: TokenFile,
    log: &(dyn Fn(&str) + Sync),
    progress: &(dyn Fn(&StepMetrics) + Sync),
) -> anyhow::Result<TrainSummary> {
    let sp = plan.mesh.sp;
    if !loaded.context.is_multiple_of(sp) {
        bail!(
            "a context of {} tokens ({}) does not divide by zerotrain.mesh.sp {sp}: each sequence rank holds an \
             equal part of every sequence; set model.block_size to a multiple of {sp}",
            loaded.context,
            loaded.context_from
        );
    }
    let config = serde_json::to_string_pretty(&loaded.config.json)?.into_bytes();
    let tokenizer = zerotrain_models::file_error::read_file(loaded.tokenizer.file())?;
    let mut files = vec![(hf::CONFIG_FILE.to_string(), config), (hf::TOKENIZER_FILE.to_string(), tokenizer)];
    files.extend(companions(&loaded)?);
    let file = Arc::new(data);
    let (context, seed) = (loaded.context, plan.runtime.seed);
    let sampler = match file.sequences() {
        false if options.packing.is_some() => bail!(
            "--packing: {} holds documents (a corpus, read in windows across them), not fine-tuning sequences; it \
             applies to a token file of conversations or prompt/completion rows (zerotrain tokenize of .jsonl, .json \
             or .parquet rows)",
            file.path().display()
        ),
        false => Cut::Windows(TokenSampler::new(Arc::clone(&file), context, seed).map_err(anyhow::Error::msg)?),
        true => {
            let packing = options.packing.unwrap_or(Packing::Bfd);
            let rows = SequenceRows::new(Arc::clone(&file), context, seed, packing).map_err(anyhow::Error::msg)?;
            let how = match packing {
                Packing::None => "one to a row".to_string(),
                Packing::Bfd => format!(
                    "packed into {} ({:.1}% padding)",
                    crate::commands::count(rows.rows(), "row"),
                    100.0 * rows.padding()
                ),
            };
            log(&format!(
                "{}: {} {how} of {} tokens, the loss on their counted tokens{}",
                file.path().display(),
                crate::commands::count(rows.sequences(), "training sequence"),
                context + 1,
                match rows.truncated() {
                    0 => String::new(),
                    n => format!(" ({} longer, truncated keeping their start)", crate::commands::count(n, "sequence")),
                }
            ));
            Cut::Sequences(rows)
        }
    };
    let token_data = TokenData {
        sampler,
        file,
        global_batch: plan.sequences_per_step(),
        base: Mutex::new((0, 0)),
        step_counted: Mutex::new(None),
    };
    let seed = plan.runtime.seed;
    let split = |groups: &ParallelGroups, device: &Device| loaded.split(groups, device, seed);
    let (tokenizer, model) = (&loaded.tokenizer, loaded.model.clone());
    let base = loaded.base_fingerprint(seed)?;
    let job =
        HfJob { plan, settings, options, data: &token_data, tokenizer, files, base, split: &split, log, progress };
    model.run(job)
}

/// The files beside `loaded`'s tokenizer and model that an export hands on with them
/// (`tokenizer_config.json` with its end token and chat template, `special_tokens_map.json`,
/// `generation_config.json`), where those folders have them: (name, contents).
fn companions(loaded: &LoadedModel) -> anyhow::Result<Vec<(String, Vec<u8>)>> {
    let model_dir = loaded.folder();
    let tokenizer_dir = loaded.tokenizer.file().parent();
    let beside_tokenizer = hf::TOKENIZER_COMPANIONS.iter().filter_map(|name| Some(tokenizer_dir?.join(name)));
    let beside_model = model_dir.map(|dir| dir.join(hf::GENERATION_CONFIG_FILE));
    let mut files = Vec::new();
    for path in beside_tokenizer.chain(beside_model) {
        if let Some(contents) = read_optional(&path)? {
            files.push((path.file_name().expect("joined").to_string_lossy().into_owned(), contents));
        }
    }
    Ok(files)
}

struct HfJob<'a> {
    plan: &'a Plan,
    settings: &'a AppSettings,
    options: &'a TrainOptions,
    data: &'a TokenData,
    tokenizer: &'a Tokenizer,
    files: Vec<(String, Vec<u8>)>,
    base: serde_json::Value,
    /// A tensor-parallel rank's part of the model, for its group.
    split: &'a (dyn Fn(&ParallelGroups, &Device) -> anyhow::Result<HfModel> + Sync),
    log: &'a (dyn Fn(&str) + Sync),
    progress: &'a (dyn Fn(&StepMetrics) + Sync),
}

impl WithModel for HfJob<'_> {
    type Output = anyhow::Result<TrainSummary>;

    fn run<M: CausalLm>(self, model: M) -> anyhow::Result<TrainSummary> {
        let context = self.data.context();
        let samples = |model: &M| {
            let prompt = self.data.first_row(&Device::flex()).into_data().convert::<i64>();
            let prompt: Vec<u32> =
                prompt.as_slice::<i64>().unwrap_or_default().iter().take(context / 2).map(|&t| t as u32).collect();
            let out = model.generate(&prompt, 48, context, Sampling::top_k(0.8, 40), &[], &mut 0x5EED)?;
            let text = |ids: &[u32]| self.tokenizer.decode(ids).unwrap_or_else(|e| e.to_string());
            let continuation = self.tokenizer.decode_continuation(&prompt, &out).unwrap_or_else(|e| e.to_string());
            Ok(vec![format!("{}|{continuation}", text(&prompt))])
        };
        let num_params = ParamCount::trainable(&model);
        let family = |groups: &ParallelGroups, device: &Device| -> anyhow::Result<M> {
            let part = (self.split)(groups, device)?;
            part.into_model::<M>().ok_or_else(|| anyhow::anyhow!("a tensor-parallel part of another family"))
        };
        let split: Option<&task::Splitter<'_, M>> = Some(&family);
        let task = Task {
            num_params,
            init: model,
            data: self.data,
            samples: &samples,
            files: self.files,
            base: self.base,
            split,
        };
        train_model(self.plan, self.settings, self.options, task, self.log, self.progress)
    }
}

#[cfg(test)]
mod tests;
