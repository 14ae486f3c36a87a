//! zerotrain: DeepSpeed-style ZeRO training for Burn.
#![deny(missing_docs)]

pub mod config;
mod error;
pub mod schedule;

pub use config::{Config, Overrides, Plan};
pub use error::{Error, Result};
