//! The model a config's `model` section names, with its tokenizer and context: imported
//! from `hf_dir`, or fresh from `hf_config` ([`load_model`]).

use std::path::{Path, PathBuf};

use anyhow::bail;
use burn::tensor::Device;

use super::HfModel;
use crate::app::hf::{self, HfConfig};
use crate::app::keys::{AppSettings, HfSource};
use crate::app::text::Tokenizer;

/// A model of `config`'s `model` section, its tokenizer and context: imported from
/// `hf_dir`, or fresh from `hf_config` (its tokenizer then from `tokenizer_dir`).
pub struct LoadedModel {
    /// The model (its parameters still lazy).
    pub model: HfModel,
    /// Its `config.json`.
    pub config: HfConfig,
    /// Its tokenizer.
    pub tokenizer: Tokenizer,
    /// `model.block_size`: the context it trains, evaluates and samples at.
    pub context: usize,
    /// Where the model came from, for messages.
    pub source: PathBuf,
}

impl LoadedModel {
    /// The folder of the model's files: `hf_dir`, or the one holding `hf_config`'s file.
    pub fn folder(&self) -> Option<&Path> {
        if self.source.is_dir() { Some(&self.source) } else { self.source.parent() }
    }

    /// The `config.json` the model was read from: `hf_dir`'s, or `hf_config`.
    pub fn config_file(&self) -> PathBuf {
        if self.source.is_dir() { self.source.join(hf::CONFIG_FILE) } else { self.source.clone() }
    }
}

/// The model the settings name, on `device`, and its tokenizer: `tokenizer_dir`'s
/// `tokenizer.json` (a checkpoints' folder, where training puts it), else
/// `model.tokenizer`, else `hf_dir`'s.
pub fn load_model(
    settings: &AppSettings,
    config_file: &Path,
    device: &Device,
    tokenizer_dir: Option<&Path>,
) -> anyhow::Result<LoadedModel> {
    let Some(source) = &settings.hf else {
        bail!("{}: give model.hf_dir (a Hugging Face checkpoint folder) or model.hf_config", config_file.display());
    };
    let (config, model, dir) = match source {
        HfSource::Dir(dir) => {
            let (config, model) = super::import(dir, device)?;
            (config, model, dir.clone())
        }
        HfSource::Config(file) => {
            let config = HfConfig::read(file)?;
            let model = super::fresh(&config, device);
            (config, model, file.clone())
        }
    };
    let tokenizer_file = match (source, tokenizer_dir, &settings.tokenizer) {
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
    if tokenizer.vocab_size() > config.vocab_size() {
        bail!(
            "{} has {} tokens, more than the model's vocab_size {}",
            tokenizer_file.display(),
            tokenizer.vocab_size(),
            config.vocab_size()
        );
    }
    let context = settings.model.block_size;
    let (exact, bound) = config.exact_context();
    if context > exact {
        bail!("{}: model.block_size {context} is longer than {bound}", config_file.display());
    }
    Ok(LoadedModel { model, config, tokenizer, context, source: dir })
}
