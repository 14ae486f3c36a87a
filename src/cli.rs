//! The command line's shape (clap derive); `commands.rs` does the work.

use std::path::PathBuf;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "zerotrain", version, about = "DeepSpeed-style ZeRO training for Burn")]
pub struct Cli {
    #[command(subcommand)]
    /// The subcommand.
    pub command: Command,
}

#[derive(Subcommand)]
pub enum Command {
    /// Train the built-in transformer on the generated regression task.
    Train {
        /// A DeepSpeed-style JSON config.
        #[arg(long)]
        config: PathBuf,
        /// Number of ranks (overrides `zerotrain.world_size`).
        #[arg(long)]
        world_size: Option<usize>,
        /// Optimizer steps.
        #[arg(long, default_value_t = 600)]
        steps: u64,
        /// Checkpoint directory (checkpoints are saved only when it is given).
        #[arg(long)]
        out: Option<PathBuf>,
        /// Save every N steps (0: only at the end).
        #[arg(long, default_value_t = 0, requires = "out")]
        save_every: u64,
        /// Continue from the checkpoint `<out>/latest` names.
        #[arg(long, requires = "out")]
        resume: bool,
    },
    /// Check a config: print the resolved plan, or the errors.
    #[command(subcommand)]
    Config(ConfigCommand),
    /// Measure and print benchmark tables.
    #[command(subcommand)]
    Bench(BenchCommand),
    /// Write a checkpoint's parameters to one safetensors file keyed by module path.
    Consolidate {
        /// The checkpoint directory (holding `latest` and the tags).
        dir: PathBuf,
        /// The tag to read (default: the one `latest` names).
        #[arg(long)]
        tag: Option<String>,
        /// The output file.
        #[arg(long)]
        out: PathBuf,
        /// Output dtype: f32, bf16 or f16.
        #[arg(long, default_value = "f32")]
        dtype: String,
    },
    /// Summarise a checkpoint and optionally verify every checksum.
    Inspect {
        /// The checkpoint directory.
        dir: PathBuf,
        /// The tag to read (default: the one `latest` names).
        #[arg(long)]
        tag: Option<String>,
        /// Read every byte of every shard and check its checksum.
        #[arg(long)]
        verify: bool,
        /// Print the manifest as JSON.
        #[arg(long)]
        json: bool,
    },
}

#[derive(Subcommand)]
pub enum BenchCommand {
    /// f32 <-> f16 / bf16 conversion of flat buffers beside memcpy of the same bytes.
    Convert {
        /// MiB of f32 to convert.
        #[arg(long, default_value_t = 64)]
        mib: usize,
        /// Repeats per op (the best is kept).
        #[arg(long, default_value_t = 5)]
        repeats: usize,
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
}

#[derive(Subcommand)]
pub enum ConfigCommand {
    /// Resolve FILE and print the plan (exit 0) or the error (exit 1).
    Check {
        /// A DeepSpeed-style JSON config.
        file: PathBuf,
        /// Number of ranks (overrides `zerotrain.world_size`).
        #[arg(long)]
        world_size: Option<usize>,
        /// Total optimizer steps, for `total_num_steps: "auto"`.
        #[arg(long)]
        steps: Option<u64>,
        /// Print the plan as JSON.
        #[arg(long)]
        json: bool,
    },
}
