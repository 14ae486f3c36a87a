//! zerotrain: DeepSpeed-style ZeRO training for [Burn](https://burn.dev).
//!
//! A DeepSpeed `ds_config.json` ([`Config`]) resolves into a validated [`Plan`]; [`launch`]
//! runs one closure per rank (threads of this process, or this process under `mpirun`) with
//! a [`RankContext`]; in it an [`Engine`] wraps the rank's Burn model and trains it with
//! `forward`, `backward` and `step` (or, for a model declared in units, `forward_backward`
//! and `step`), partitioning optimizer state (ZeRO-1), gradients (ZeRO-2) and parameters
//! (ZeRO-3) over the ranks as the plan's stage says; a [`Pipeline`] stage trains a run of a
//! model's units when the plan has pipeline stages. The partition
//! math and collectives live in `zerotrain-zero`, dtypes and loss scaling in
//! `zerotrain-precision`, checkpoint files in `zerotrain-checkpoint`.
//!
//! ```
//! use burn::module::Module;
//! use burn::nn::{Linear, LinearConfig};
//! use burn::tensor::{Device, Tensor, TensorData};
//! use zerotrain::{launch, Config, Engine, Overrides};
//!
//! #[derive(Module, Debug)]
//! struct Net {
//!     layer: Linear,
//! }
//!
//! let json = r#"{"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 2},
//!                "optimizer": {"type": "AdamW", "params": {"lr": 0.05}},
//!                "zerotrain": {"world_size": 2}}"#;
//! let plan = Config::parse(json, "inline")?.resolve(Overrides::default())?;
//! // Build the model once, seeded, so every run starts from the same weights; each rank
//! // starts from a clone (the engine forks it onto the rank's device).
//! let device = Device::flex().autodiff();
//! device.seed(plan.runtime.seed);
//! let init = Net { layer: LinearConfig::new(2, 1).init(&device) };
//! let losses = launch(&plan, |ctx| {
//!     let mut engine = Engine::new(init.clone(), &plan, &ctx)?;
//!     let mut losses = Vec::new();
//!     for step in 0..60u64 {
//!         // This rank's 4 samples of the global batch of 8: y = 2 x0 - x1.
//!         let first = step * 8 + ctx.rank() as u64 * 4;
//!         let x: Vec<f32> = (first..first + 4).flat_map(|i| [(i % 5) as f32 / 5.0, (i % 3) as f32 / 3.0]).collect();
//!         let y: Vec<f32> = x.chunks(2).map(|v| 2.0 * v[0] - v[1]).collect();
//!         let x = Tensor::<2>::from_data(TensorData::new(x, [4, 2]), ctx.device());
//!         let y = Tensor::<2>::from_data(TensorData::new(y, [4, 1]), ctx.device());
//!         let loss = engine.forward(|net| (net.layer.forward(x) - y).square().mean())?;
//!         engine.backward(loss)?;
//!         if let Some(report) = engine.step()? {
//!             losses.push(report.loss);
//!         }
//!     }
//!     Ok::<_, zerotrain::Error>(losses)
//! })?;
//! let mean = |l: &[f32]| l.iter().sum::<f32>() / l.len() as f32;
//! assert!(mean(&losses[0][55..]) < mean(&losses[0][..5]) / 2.0);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! # The library, the models and the command
//! This crate is the engine a Burn program depends on: [`config`], [`engine`], [`launch`],
//! [`RankContext`], [`schedule`], [`estimate`], [`random`], and parameter servers
//! ([`replicas`], the `servers` feature). The models it trains (Hugging Face's families,
//! their checkpoints and tokenizers, the built-in GPT) are the `zerotrain-models` crate; the
//! `zerotrain` command (the train job, metrics and plots, bench tables) is `zerotrain-cli`.
//! Imports point down: the command uses both, the models use the engine, the engine uses
//! neither; the engine never uses the launcher.
//!
//! # Design notes
//! - *Note: the root unit* (parameters no unit claims, tied weights): [`engine::model`].
//! - *Note: the unit walk* (gather, prefetch, recompute, reduce per unit): `engine/unit_walk.rs`.
//! - *Note: replayable randomness* (dropout under recomputation and thread ranks): [`random`].
//! - *Note: identifying parameters* (module paths, not `ParamId`s): `engine/params/index.rs`.
//! - *Note: why reduce-scatter per micro-step*, *reductions in flight*: `engine/accumulation.rs`.
//! - *Note: persistence* (stage 3): `engine/unit/`; *lost master weights*, the offload tiers: `engine/tier/` (`nvme.rs`: the NVMe tier); *threads and direct I/O* of its swap files: `swap/io.rs`; *the host AdamW*: `engine/host_adam.rs`.
//! - *Note: one engine, any span* (what a pipeline stage changes): `engine/span.rs`.
//! - *Note: buffers* (running statistics: averaged when observed): `engine/buffers.rs`.
//! - *Note: flat shards*, *parameter groups*: [`engine::optimizer`].
//! - *Note: a pipeline stage*, *seeding the stages*, *the header*: `engine/pipeline/`.
//! - *Note: the iteration convention* (DeepSpeed's lr schedules): [`schedule`].
//! - *Note: a loss that computes its gradients in forward* (the head without whole logits): `nn/cross_entropy.rs`.
//! - *Note: padding*, *the three-barrier protocol*, *byte counting*: `zerotrain-zero`.
#![deny(missing_docs)]

mod collectives;
pub mod config;
mod context;
mod device;
pub mod engine;
mod error;
pub mod estimate;
mod factory;
mod launch;
pub mod mesh;
pub mod nn;
pub mod random;
pub mod reduce;
pub mod replicas;
pub mod schedule;
mod swap;
mod trainer;

pub use config::{Config, ConfigExtension, Overrides, Plan};
pub use context::RankContext;
pub use engine::{
    Counters, Engine, LoadOptions, MemoryReport, PhaseTimes, Pipeline, StepReport, consolidate, resume_point,
};
pub use error::{Error, Result};
pub use factory::trainer;
pub use launch::{detect_launcher, detect_mpirun, launch};
/// The JSON values checkpoints carry as client state (`save_checkpoint`'s last argument),
/// re-exported so that a program needs no dependency of its own for it.
pub use serde_json;
pub use trainer::Trainer;
/// The dtypes of mixed precision: what `save_model` and `consolidate` write, re-exported so
/// that a program needs no dependency of its own for it.
pub use zerotrain_precision::Precision;
