//! The command line's shape (clap derive); `commands` does the work. The `bench`
//! subcommands are declared in `bench.rs`.

use std::path::PathBuf;

use clap::{Parser, Subcommand};

mod bench;
pub use self::bench::BenchCommand;

#[derive(Parser)]
#[command(name = "zerotrain", version, about = "DeepSpeed-style ZeRO training for Burn")]
pub struct Cli {
    #[command(subcommand)]
    /// The subcommand.
    pub command: Command,
}

#[derive(Subcommand)]
pub enum Command {
    /// Train the config's model: the built-in GPT on generated arithmetic (the main job), or
    /// a Hugging Face family's model (`model.hf_dir` / `model.hf_config`) on --data.
    Train(crate::commands::TrainArgs),
    /// Start this node's ranks as processes (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
    /// MASTER_PORT set, as torchrun does) and supervise them: `zerotrain launch
    /// --nproc-per-node N -- train --config FILE`. The ranks train on CUDA GPUs over NCCL.
    Launch(crate::commands::launch::LaunchArgs),
    /// Run a parameter server for replica groups that are separate jobs (each trains with
    /// `local_sgd.servers` naming this address and its own `local_sgd.group`), until
    /// Ctrl-C or SIGTERM.
    Serve {
        /// The config the groups train with (any group's): its `local_sgd` section gives the
        /// groups and the outer optimizer.
        #[arg(long)]
        config: PathBuf,
        /// Address to listen on (loopback by default; port 0 picks a free one).
        #[arg(long, default_value = "127.0.0.1:50051")]
        listen: std::net::SocketAddr,
        /// Save the global weights and outer state here every `local_sgd.checkpoint_every`
        /// rounds, and start from the latest checkpoint found here.
        #[arg(long)]
        checkpoint: Option<PathBuf>,
    },
    /// Estimate per-rank model-state memory for every ZeRO stage.
    Estimate(crate::commands::estimate::EstimateArgs),
    /// Check a config: print the resolved plan, or the errors.
    #[command(subcommand)]
    Config(ConfigCommand),
    /// Measure and print benchmark tables.
    #[command(subcommand)]
    Bench(BenchCommand),
    /// Write a checkpoint's parameters to one safetensors file keyed by module path, or
    /// (`--format hf`) a Hugging Face family's checkpoint as a Hugging Face folder.
    Consolidate(crate::commands::ConsolidateArgs),
    /// Print the mean next-token loss and perplexity of a Hugging Face family's model
    /// (`model.hf_dir`, or a checkpoint of it with --checkpoint) on a text file.
    Eval(crate::commands::eval::EvalArgs),
    /// Sample text from a Hugging Face family's model (`model.hf_dir`, or a checkpoint of it).
    Generate(crate::commands::generate::GenerateArgs),
    /// Tokenize text or JSON-lines files into a token file for training (`--data`), with a
    /// tokenizer.json or a byte-level BPE trained on the same files.
    Tokenize(crate::commands::tokenize::TokenizeArgs),
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
