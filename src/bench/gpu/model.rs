//! What `bench gpu` trains: the built-in GPT, or a Hugging Face family's model of a
//! `config.json`; its tokens and its loss.

use burn::tensor::{Device, Int, Tensor, TensorData};
use serde::Serialize;
use zerotrain_models::GptConfig;
use zerotrain_models::hf::HfConfig;
use zerotrain_models::hf::size::ModelSize;

/// The model `bench gpu` trains.
#[derive(Debug, Clone, Serialize)]
pub enum BenchModel {
    /// The built-in GPT of this shape.
    Builtin(GptConfig),
    /// A Hugging Face family's model of a `config.json`, initialised as Hugging Face
    /// initialises one, trained on sequences of `context` tokens.
    Hf {
        /// Where its config came from, for the table.
        name: String,
        /// Its config.
        #[serde(skip)]
        config: Box<HfConfig>,
        /// Tokens per sequence.
        context: usize,
    },
}

impl BenchModel {
    /// The model `bench gpu --model` names: `builtin` (the built-in GPT of `shape`), `gpt2`
    /// or `llama` (the presets in `configs/models/`), or a `config.json`'s path; a Hugging
    /// Face model trains at `shape`'s context.
    pub fn named(name: &str, shape: GptConfig) -> std::result::Result<Self, zerotrain_models::file_error::FileError> {
        let file = match name {
            "builtin" => return Ok(Self::Builtin(shape)),
            "gpt2" => "configs/models/gpt2-small.json",
            "llama" => "configs/models/llama-1b.json",
            path => path,
        };
        let config = HfConfig::read(std::path::Path::new(file))?;
        Ok(Self::Hf { name: file.to_string(), config: Box::new(config), context: shape.block_size })
    }

    /// Tokens per sequence.
    pub fn context(&self) -> usize {
        match self {
            Self::Builtin(shape) => shape.block_size,
            Self::Hf { context, .. } => *context,
        }
    }

    pub(super) fn vocab(&self) -> usize {
        match self {
            Self::Builtin(shape) => shape.vocab_size,
            Self::Hf { config, .. } => config.vocab_size(),
        }
    }

    /// Trainable parameters (a tied head counted once).
    pub fn num_params(&self) -> u64 {
        match self {
            Self::Builtin(shape) => shape.num_params(),
            Self::Hf { config, .. } => ModelSize::of(config).params,
        }
    }

    /// Refuses a shape the model cannot train, naming `bench gpu`'s flag.
    pub fn validate(&self) -> std::result::Result<(), String> {
        match self {
            Self::Builtin(shape) => shape.validate().map_err(|e| {
                let flags = [
                    ("model.n_layer", "--layers"),
                    ("model.n_head", "--heads"),
                    ("model.n_embd", "--width"),
                    ("model.block_size", "--context"),
                    ("model.vocab_size", "--vocab"),
                ];
                flags.iter().fold(e, |e, (key, flag)| e.replace(key, flag))
            }),
            Self::Hf { config, context, .. } => {
                let (positions, bound) = config.exact_context();
                match *context {
                    0 => Err("--context must be at least 1".into()),
                    c if c > positions => Err(format!("--context {c} is longer than {bound}")),
                    _ => Ok(()),
                }
            }
        }
    }

    pub(super) fn describe(&self) -> String {
        match self {
            Self::Builtin(s) => format!(
                "GPT {}x{} ({} heads, context {}, vocabulary {}, {:.1}M parameters)",
                s.n_layer,
                s.n_embd,
                s.n_head,
                s.block_size,
                s.vocab_size,
                s.num_params() as f64 / 1e6
            ),
            Self::Hf { name, config, context } => format!(
                "{} of {name} ({} layers, context {context}, vocabulary {}, {:.1}M parameters)",
                config.model_type(),
                config.num_layers(),
                config.vocab_size(),
                self.num_params() as f64 / 1e6
            ),
        }
    }
}

/// Deterministic tokens `[batch, context + 1]` for step `step`.
pub(super) fn tokens(model: &BenchModel, batch: usize, step: usize, device: &Device) -> Tensor<2, Int> {
    let len = model.context() + 1;
    let vocab = model.vocab() as u64;
    let values: Vec<i64> =
        (0..(batch * len) as u64).map(|i| ((i * 2_654_435_761 + step as u64 * 40_503) % vocab) as i64).collect();
    Tensor::from_data(TensorData::new(values, [batch, len]), device)
}
