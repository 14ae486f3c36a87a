//! The models zerotrain trains, with what a Hugging Face user brings to them: the GPT-2 and
//! LLaMA families (LLaMA, Mistral, Qwen2, Qwen3) from their checkpoint folders, tokenizers
//! and token files, the built-in GPT of the main job, and small models for tests and
//! examples. Each model is a Burn module that implements the engine's
//! [`UnitModel`](zerotrain::engine::UnitModel), so stage 3 gathers it unit by unit.
//!
//! A library of its own, without the command line's crates (clap, plotters, indicatif):
//! a Burn program trains a Hugging Face family's model with the engine and no `zerotrain`
//! command. [`family::import`] reads a checkpoint folder, [`family::load::load_model`] a
//! model with its tokenizer as a config names them, [`family::fresh`] initialises one from
//! its `config.json` as Hugging Face does; each is declared in units (a block each), so
//! stage 3 gathers one block at a time:
//!
//! ```
//! use burn::tensor::{Device, Int, Tensor, TensorData};
//! use zerotrain::{Config, Engine, Overrides, launch};
//! use zerotrain_models::family::{self, HfModel};
//! use zerotrain_models::LmBatch;
//! use zerotrain_models::hf::HfConfig;
//!
//! // A LLaMA with grouped-query attention, as its config.json would describe it.
//! let config = HfConfig::from_json(zerotrain::serde_json::json!({
//!     "model_type": "llama", "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2,
//!     "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 40}))?;
//! let json = r#"{"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3},
//!                "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
//!                "zerotrain": {"world_size": 2}}"#;
//! let plan = Config::parse(json, "inline")?.resolve(Overrides::default())?;
//! // Parameters stay lazy: the engine initialises them unit by unit as it shards them.
//! let HfModel::Llama(init) = family::fresh(&config, &Device::flex().autodiff(), 7) else { unreachable!() };
//! let losses = launch(&plan, |ctx| {
//!     let mut engine = Engine::with_units(init.clone(), &plan, &ctx)?;
//!     // Each rank's two sequences of 8 tokens and their next tokens: [batch, time + 1],
//!     // every target counted (LmBatch::counted weighs some only, as a chat's answers).
//!     let ids: Vec<i64> = (0..18).map(|i| (i * 7 + 3 * ctx.rank() as i64) % 40).collect();
//!     let batch: LmBatch = Tensor::<2, Int>::from_data(TensorData::new(ids, [2, 9]), ctx.device()).into();
//!     let mut losses = Vec::new();
//!     for _ in 0..30 {
//!         engine.forward_backward(&batch)?;
//!         losses.extend(engine.step()?.map(|report| report.loss));
//!     }
//!     Ok::<_, zerotrain::Error>(losses)
//! })?;
//! assert!(losses[0][29] < losses[0][0] / 2.0, "{:?}", losses[0]);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! | module | holds |
//! |---|---|
//! | [`hf`] | Hugging Face checkpoint folders as files (`config.json`, safetensors) |
//! | [`family`] | Hugging Face families' models: fresh, imported, loaded with their tokenizer, exported |
//! | [`text`] | tokenizers (`tokenizer.json`) and token files |
//! | [`data`] | the character corpus and its deterministic sampler |
//! | [`gpt2`], [`llama`], [`layers`] | the families' modules, with their checkpoints' tensor names |
//! | crate root | the built-in [`Gpt`], [`Mlp`], [`TinyTransformer`], a BatchNorm [`ConvNet`] |

#![deny(missing_docs)]

mod causal_lm;
mod conv;
pub mod data;
pub mod family;
pub mod file_error;
mod gpt;
pub mod gpt2;
pub mod hf;
mod kv_cache;
pub mod layers;
pub mod llama;
mod lm_batch;
#[cfg(test)]
mod memory_tests;
mod mesh_part;
mod small;
#[cfg(test)]
mod stream_tests;
pub mod text;

pub use causal_lm::{CausalLm, Sampling, cross_entropy};
pub use conv::{ConvBlock, ConvNet, ImageTask, Images};
pub use gpt::{Block, BlockAdapters, Gpt, GptConfig, lora_sizes as gpt_lora_sizes};
pub use gpt2::Gpt2;
pub use layers::KvCache;
pub use llama::Llama;
pub use lm_batch::{Counted, LmBatch, Packing};
pub use small::*;
