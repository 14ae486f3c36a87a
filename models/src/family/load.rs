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
#[derive(Debug, Clone)]
pub struct ModelSource {
    /// The model's files.
    pub from: HfSource,
    /// A `tokenizer.json` to use instead of the checkpoint folder's (`model.tokenizer`);
    /// required for a model from a `config.json`.
    pub tokenizer: Option<PathBuf>,
    /// The context to train and evaluate at (`model.block_size`); `None`: the model's own
    /// positions (or sliding window).
    pub block_size: Option<usize>,
    /// Low-rank adapters to fine-tune, the rest frozen (the config's `zerotrain.lora`).
    pub lora: Option<super::Adapters>,
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
    /// The adapters it is fine-tuned with, if any.
    pub lora: Option<super::Adapters>,
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
            return Ok(super::import_adapted(&self.source, device, groups, self.lora.as_ref(), seed)?.1);
        }
        super::fresh_adapted(&self.config, device, groups, seed, self.lora.as_ref())
            .map_err(|e| anyhow::anyhow!("{}: {e}", self.source.display()))
    }

    /// The fingerprint of the frozen base a LoRA run trains on ([`super::base`]), `Null`
    /// without LoRA; `seed` is the run's (a fresh base's).
    pub fn base_fingerprint(&self, seed: u64) -> anyhow::Result<serde_json::Value> {
        struct Frozen;
        impl super::WithModel for Frozen {
            type Output = Vec<String>;
            fn run<M: crate::CausalLm>(self, model: M) -> Vec<String> {
                model.frozen_parameters()
            }
        }
        if self.lora.is_none() {
            return Ok(serde_json::Value::Null);
        }
        let frozen = self.model.clone().run(Frozen);
        let alias: fn(&str) -> Option<String> =
            if matches!(self.config.family, crate::hf::Family::Gpt2(_)) { crate::gpt2::alias } else { |_| None };
        let dir = self.source.is_dir().then_some(self.source.as_path());
        super::base::fingerprint(dir, &frozen, alias, seed)
    }

    /// The `config.json` the model was read from: `hf_dir`'s, or `hf_config`.
    pub fn config_file(&self) -> PathBuf {
        if self.source.is_dir() { self.source.join(hf::CONFIG_FILE) } else { self.source.clone() }
    }
}

/// Refuses a fresh model whose parameters, still lazy, would not fit this machine's memory
/// (from the config's shape, before anything is built).
pub fn check_buildable(config: &HfConfig, file: &Path) -> anyhow::Result<()> {
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
    seed: u64,
) -> anyhow::Result<LoadedModel> {
    let (source, lora) = (&wanted.from, wanted.lora.as_ref());
    let (config, model, dir) = match source {
        HfSource::Dir(dir) => {
            let (config, model) = super::import_adapted(dir, device, &ParallelGroups::alone(), lora, seed)?;
            (config, model, dir.clone())
        }
        HfSource::Config(file) => {
            let config = HfConfig::read(file)?;
            check_buildable(&config, file)?;
            let model = super::fresh_adapted(&config, device, &ParallelGroups::alone(), seed, lora)
                .map_err(|e| anyhow::anyhow!("{}: {e}", file.display()))?;
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
    Ok(LoadedModel { model, config, tokenizer, context, context_from, source: dir, lora: wanted.lora.clone() })
}

/// The context training defaults to where `model.block_size` is not set, when the model
/// has at least as many positions: `run_clm`'s `block_size` and TRL's `max_length` default.
pub const DEFAULT_TRAINING_CONTEXT: usize = 1024;

/// The context a run trains at, and where it comes from (to print): `model.block_size`
/// where set (`block_size_set`: `loaded.context` is it), else the smaller of the model's
/// positions and [`DEFAULT_TRAINING_CONTEXT`]. One rule of the config files alone, so every
/// rank of a job computes the same. Where it is the default, its activations for a
/// micro-batch of `micro` sequences ([`activation_bytes`](crate::hf::size::activation_bytes),
/// recomputed or not as `recompute` says) must fit `available` bytes (this machine's, where
/// known): an error saying what to set otherwise.
pub fn training_context(
    loaded: &LoadedModel,
    micro: u64,
    (block_size_set, recompute): (bool, bool),
    available: Option<u64>,
) -> anyhow::Result<(usize, String)> {
    if block_size_set {
        return Ok((loaded.context, loaded.context_from.clone()));
    }
    default_context(&loaded.config, micro, recompute, available)
}

/// [`training_context`] where `model.block_size` is not set: the smaller of `config`'s
/// positions and [`DEFAULT_TRAINING_CONTEXT`], checked against `available`.
fn default_context(
    config: &HfConfig,
    micro: u64,
    recompute: bool,
    available: Option<u64>,
) -> anyhow::Result<(usize, String)> {
    let (positions, _) = config.exact_context();
    let context = positions.min(DEFAULT_TRAINING_CONTEXT);
    let from = match context < positions {
        true => format!(
            "model.block_size not set: the smaller of the model's {positions} {} and {DEFAULT_TRAINING_CONTEXT}, as \
             run_clm and TRL default",
            config.context_key()
        ),
        false => format!("the model's {}; model.block_size not set", config.context_key()),
    };
    let bytes = crate::hf::size::activation_bytes(config, micro, context, recompute);
    if let Some(available) = available.filter(|&a| bytes > a) {
        let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
        bail!(
            "model.block_size is not set: training at context {context} ({from}) would keep about {:.1} GiB of \
             activations for a micro-batch of {micro}, more than the {:.1} GiB of memory available: set \
             model.block_size to a shorter context{}, or a smaller train_micro_batch_size_per_gpu",
            gib(bytes),
            gib(available),
            if recompute { "" } else { ", turn on activation_checkpointing" }
        );
    }
    Ok((context, from))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn llama(positions: usize) -> HfConfig {
        HfConfig::from_json(json!({"model_type": "llama", "hidden_size": 4096, "intermediate_size": 11008,
            "num_hidden_layers": 32, "num_attention_heads": 32, "vocab_size": 32000,
            "max_position_embeddings": positions}))
        .unwrap()
    }

    /// Without `model.block_size`, training runs at the smaller of the model's positions
    /// and 1024, whatever the machine's memory (Llama 3.1's 131072 positions, Llama 2's
    /// 4096, a model of 512), and says where that came from.
    #[test]
    fn the_default_context_is_one_rule_of_the_config_alone() {
        for (positions, want) in [(131_072, 1024), (4096, 1024), (512, 512)] {
            let (context, from) = default_context(&llama(positions), 1, false, None).unwrap();
            assert_eq!(context, want, "{positions} positions");
            let said = if want < positions { "the smaller of the model's" } else { "the model's" };
            assert!(from.contains(said) && from.contains("max_position_embeddings"), "{from}");
        }
    }

    /// The memory check charges what the models keep (34 values per token and width per
    /// layer in 2-byte units, one block of logits): Llama-2-7B's shape at 1,024 tokens keeps
    /// 2 x 34 x 1,024 x 4,096 x 32 B = 8.5 GiB plus 192 MiB of logits, no `[time, time]`
    /// scores (a 4,096-token micro-batch was charged 195 GiB with them); with
    /// recomputation, each layer's input and one layer's activations. Past the memory
    /// given, refused naming what to set.
    #[test]
    fn the_memory_check_charges_todays_activations_and_says_what_to_set() {
        let config = llama(4096);
        let layer = 2 * 34 * 1024 * 4096u64;
        let logits = 12 * (1u64 << 24);
        assert_eq!(crate::hf::size::activation_bytes(&config, 1, 1024, false), 32 * layer + logits);
        assert_eq!(crate::hf::size::activation_bytes(&config, 1, 1024, true), 32 * 4 * 1024 * 4096 + layer + logits);
        let err = default_context(&config, 1, false, Some(4 << 30)).unwrap_err().to_string();
        assert!(err.contains("set model.block_size to a shorter context, turn on activation_checkpointing"), "{err}");
        assert!(default_context(&config, 1, true, Some(4 << 30)).is_ok());
    }
}
