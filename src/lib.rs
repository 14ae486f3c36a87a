//! zerotrain: DeepSpeed-style ZeRO training for [Burn](https://burn.dev).
//!
//! A DeepSpeed `ds_config.json` ([`Config`]) resolves into a validated [`Plan`]; [`launch`]
//! runs one closure per rank (threads of this process) with a [`RankContext`]; in it an
//! [`Engine`] wraps the rank's Burn model and trains it with `forward`, `backward` and
//! `step`, partitioning optimizer state (ZeRO-1), gradients (ZeRO-2) and parameters
//! (ZeRO-3) over the ranks as the plan's stage says. The partition math and collectives
//! live in `zerotrain-zero`.
//!
//! ```
//! use zerotrain::models::{Mlp, RegressionTask};
//! use zerotrain::{launch, Config, Engine, Overrides};
//!
//! let json = r#"{"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 2},
//!                "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
//!                "zerotrain": {"world_size": 2}}"#;
//! let plan = Config::parse(json, "inline")?.resolve(Overrides::default())?;
//! let task = RegressionTask { seq_len: 4, features: 3 };
//! // Build the model once, seeded, so every run starts from the same weights; each rank
//! // starts from a clone (the engine forks it onto the rank's device).
//! let device = burn::tensor::Device::flex().autodiff();
//! device.seed(plan.seed);
//! let init = Mlp::new(&[3, 16, 3], &device);
//! let losses = launch(&plan, |ctx| {
//!     let mut engine = Engine::new(init.clone(), &plan, &ctx)?;
//!     let mut losses = Vec::new();
//!     for step in 0..60u64 {
//!         let first = step * 8 + ctx.rank() as u64 * 4; // this rank's part of the global batch
//!         let batch = task.batch(first..first + 4, ctx.device());
//!         let loss = engine.forward(|model| model.loss(&batch))?;
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
//! # Design notes
//! - *Note: identifying parameters* (module paths, not `ParamId`s): `engine/params.rs`.
//! - *Note: why reduce-scatter per micro-step*: `engine/grads.rs`.
//! - *Note: persistence* (stage 3): `engine/stage3.rs`.
//! - *Note: the iteration convention* (DeepSpeed's lr schedules): [`schedule`].
//! - *Note: padding*, *the three-barrier protocol*, *byte counting*: `zerotrain-zero`.
#![deny(missing_docs)]

pub mod bench;
pub mod config;
pub mod data;
pub mod engine;
mod error;
pub mod estimate;
mod launch;
pub mod models;
pub mod schedule;
pub mod train;

pub use config::{Config, Overrides, Plan};
pub use engine::{Counters, Engine, LoadOptions, MemoryReport, PhaseTimes, StepReport};
pub use error::{Error, Result};
pub use launch::{RankContext, launch};
