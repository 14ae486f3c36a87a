//! Hugging Face checkpoint folders as files: `config.json` read into a family's shape
//! ([`config`], its rotary settings in either of `transformers`' layouts in [`rope`]),
//! safetensors files and shard indexes memory-mapped ([`files`]), the model's size from
//! its config before anything is built ([`size`]), and the
//! source a model's parameters are read from by name ([`weights`]), whole or a
//! tensor-parallel rank's slice (`slices.rs`). The models built from
//! them, their import and export are [`family`](crate::family)'s.

pub mod config;
mod fields;
pub mod files;
pub mod peft;
pub mod rope;
pub mod size;
pub(crate) mod slices;
pub mod weights;

pub use self::config::{Family, HfConfig};

/// The configuration file of a checkpoint folder.
pub const CONFIG_FILE: &str = "config.json";
/// The tokenizer file of a checkpoint folder.
pub const TOKENIZER_FILE: &str = "tokenizer.json";
/// The file beside a `tokenizer.json` that names its special tokens (`eos_token`) and holds
/// its chat template.
pub const TOKENIZER_CONFIG_FILE: &str = "tokenizer_config.json";
/// The files that travel with a model's `tokenizer.json`, where its folder has them.
pub const TOKENIZER_COMPANIONS: [&str; 2] = [TOKENIZER_CONFIG_FILE, "special_tokens_map.json"];
/// The file that travels with a model's `config.json`, where its folder has it: the
/// settings `transformers` samples with.
pub const GENERATION_CONFIG_FILE: &str = "generation_config.json";
