//! zerotrain: DeepSpeed-style ZeRO training for Burn.
#![deny(missing_docs)]

pub mod config;
pub mod engine;
mod error;
mod launch;
pub mod models;
pub mod schedule;

pub use config::{Config, Overrides, Plan};
pub use engine::{Counters, Engine, MemoryReport, StepReport};
pub use error::{Error, Result};
pub use launch::{launch, RankContext};
