//! The model a config's `model` section names, with its tokenizer and context: imported
//! from `hf_dir`, or fresh from `hf_config` ([`load_model`]).

use std::path::{Path, PathBuf};

use anyhow::bail;
use burn::tensor::Device;

use super::HfModel;
use crate::hf::size::ModelSize;
use crate::hf::{self, HfConfig};
use crate::text::Tokenizer;
use zerotrain::nn::parallel::ParallelGroups;

/// Where a Hugging Face family's model comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HfSource {
    /// A checkpoint folder (`model.hf_dir`): `config.json`, safetensors, `tokenizer.json`.
    Dir(PathBuf),
    /// A `config.json` (`model.hf_config`): the model initialised fresh.
    Config(PathBuf),
}

impl HfSource {
    /// The `config.json` the model is described by.
    pub fn config_file(&self) -> PathBuf {
        match self {
            HfSource::Dir(dir) => dir.join(hf::CONFIG_FILE),
            HfSource::Config(file) => file.clone(),
        }
    }
}

/// What [`load_model`] loads: the model, its tokenizer and its context, as a config's
/// `model` section names them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelSource {
    /// The model's files.
    pub from: HfSource,
    /// A `tokenizer.json` to use instead of the checkpoint folder's (`model.tokenizer`);
    /// required for a model from a `config.json`.
    pub tokenizer: Option<PathBuf>,
    /// The context to train and evaluate at (`model.block_size`); `None`: the model's own
    /// positions (or sliding window).
    pub block_size: Option<usize>,
}

/// A model of `config`'s `model` section, its tokenizer and context: imported from
/// `hf_dir`, or fresh from `hf_config` (its tokenizer then from `tokenizer_dir`).
pub struct LoadedModel {
    /// The model (its parameters still lazy).
    pub model: HfModel,
    /// Its `config.json`.
    pub config: HfConfig,
    /// Its tokenizer.
    pub tokenizer: Tokenizer,
    /// The context it trains and evaluates at: `model.block_size`, or the model's own
    /// positions (or sliding window) where that is not set.
    pub context: usize,
    /// Where [`context`](Self::context) comes from, for what the commands print.
    pub context_from: String,
    /// Where the model came from, for messages.
    pub source: PathBuf,
}

impl LoadedModel {
    /// The folder of the model's files: `hf_dir`, or the one holding `hf_config`'s file.
    pub fn folder(&self) -> Option<&Path> {
        if self.source.is_dir() { Some(&self.source) } else { self.source.parent() }
    }

    /// A mesh rank's part of the model for its `groups`, on `device`: its
    /// slices of the checkpoint's tensors (`hf_dir`), or of a fresh model drawn from `seed`
    /// and each parameter's name (`hf_config`: every rank draws the same whole model).
    pub fn split(&self, groups: &ParallelGroups, device: &Device, seed: u64) -> anyhow::Result<HfModel> {
        if self.source.is_dir() {
            return Ok(super::import_split(&self.source, device, groups)?.1);
        }
        super::fresh_split(&self.config, device, groups, seed)
            .map_err(|e| anyhow::anyhow!("{}: {e}", self.source.display()))
    }

    /// The `config.json` the model was read from: `hf_dir`'s, or `hf_config`.
    pub fn config_file(&self) -> PathBuf {
        if self.source.is_dir() { self.source.join(hf::CONFIG_FILE) } else { self.source.clone() }
    }
}

/// Refuses a fresh model whose parameters, still lazy, would not fit this machine's memory
/// (from the config's shape, before anything is built).
fn check_buildable(config: &HfConfig, file: &Path) -> anyhow::Result<()> {
    let size = ModelSize::of(config);
    let available = crate::hf::size::available_memory().unwrap_or(u64::MAX);
    if size.build_bytes() > available / 2 {
        bail!(
            "{}: a model of {} layers has {} parameter tensors, whose bookkeeping alone would take about {:.1} GiB \
             of the {:.1} GiB this machine has available (nothing was built)",
            file.display(),
            config.num_layers(),
            size.tensors,
            size.build_bytes() as f64 / (1u64 << 30) as f64,
            available as f64 / (1u64 << 30) as f64
        );
    }
    Ok(())
}

/// The model `wanted` names, on `device`, and its tokenizer: `tokenizer_dir`'s
/// `tokenizer.json` (a checkpoints' folder, where training puts it), else
/// `wanted.tokenizer`, else the checkpoint folder's. `config_file` is the config that asked
/// for it, named in messages.
pub fn load_model(
    wanted: &ModelSource,
    config_file: &Path,
    device: &Device,
    tokenizer_dir: Option<&Path>,
) -> anyhow::Result<LoadedModel> {
    let source = &wanted.from;
    let (config, model, dir) = match source {
        HfSource::Dir(dir) => {
            let (config, model) = super::import(dir, device)?;
            (config, model, dir.clone())
        }
        HfSource::Config(file) => {
            let config = HfConfig::read(file)?;
            check_buildable(&config, file)?;
            let model = super::fresh(&config, device);
            (config, model, file.clone())
        }
    };
    let tokenizer_file = match (source, tokenizer_dir, &wanted.tokenizer) {
        (_, Some(dir), _) => dir.join(hf::TOKENIZER_FILE),
        (_, None, Some(file)) => file.clone(),
        (HfSource::Dir(dir), None, None) => dir.join(hf::TOKENIZER_FILE),
        (HfSource::Config(_), None, None) => bail!(
            "{}: a model from model.hf_config needs model.tokenizer (a tokenizer.json; zerotrain tokenize \
             --train-vocab makes one)",
            config_file.display()
        ),
    };
    let tokenizer = Tokenizer::from_file(&tokenizer_file)?;
    if tokenizer.id_bound() > config.vocab_size() {
        bail!(
            "{} has ids up to {}, beyond the model's vocab_size {} ({}): the model has no embedding row for them",
            tokenizer_file.display(),
            tokenizer.id_bound() - 1,
            config.vocab_size(),
            source.config_file().display()
        );
    }
    let (exact, bound) = config.exact_context();
    let (context, context_from) = match wanted.block_size {
        Some(context) if context > exact => {
            bail!("{}: model.block_size {context} is longer than {bound}", config_file.display())
        }
        Some(context) => (context, "model.block_size".to_string()),
        None => (exact, format!("the model's {}; model.block_size not set", config.context_key())),
    };
    Ok(LoadedModel { model, config, tokenizer, context, context_from, source: dir })
}

/// The context a run trains at: `loaded`'s, or where `model.block_size` is not set and the
/// model's positions would not fit (the activations of a micro-batch of `micro` sequences,
/// estimated without recomputation, past half the memory available), the longest power of
/// two below them that does, with a notice saying so.
pub fn training_context(loaded: &LoadedModel, micro: u64, block_size_set: bool) -> (usize, Option<String>) {
    let available = crate::hf::size::available_memory().unwrap_or(u64::MAX) / 2;
    let bytes = |context: usize| crate::hf::size::activation_bytes(&loaded.config, micro, context);
    let mut context = loaded.context;
    if block_size_set || bytes(context) <= available {
        return (context, None);
    }
    // The longest power of two below the model's positions, halved while it does not fit.
    context = 1 << (usize::BITS - 1 - (context - 1).max(1).leading_zeros());
    while context > 16 && bytes(context) > available {
        context /= 2;
    }
    let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
    let notice = format!(
        "model.block_size is not set: training at context {context}, not the model's {} positions, whose activations \
         (about {:.1} GiB for a micro-batch of {micro}) would not fit the {:.1} GiB of memory available; set \
         model.block_size to choose",
        loaded.context,
        gib(bytes(loaded.context)),
        gib(2 * available)
    );
    (context, Some(notice))
}
