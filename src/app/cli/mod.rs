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
    /// Train the built-in GPT on generated arithmetic (or --data FILE): the main job.
    Train {
        /// A DeepSpeed-style JSON config.
        #[arg(long)]
        config: PathBuf,
        /// Number of ranks (overrides `zerotrain.world_size`).
        #[arg(long)]
        world_size: Option<usize>,
        /// Where the ranks compute: cpu, wgpu or cuda (overrides `zerotrain.device`).
        #[arg(long)]
        device: Option<crate::config::ComputeDevice>,
        /// Optimizer steps to reach.
        #[arg(long, default_value_t = 2400)]
        steps: u64,
        /// A UTF-8 text file to train on (default: generated arithmetic).
        #[arg(long)]
        data: Option<PathBuf>,
        /// Run folder for metrics.jsonl, loss.png and checkpoints/ (default: runs/<config name>).
        #[arg(long)]
        out: Option<PathBuf>,
        /// Save a checkpoint every N steps (overrides `zerotrain.checkpoint_every`; 0: at the end).
        #[arg(long)]
        save_every: Option<u64>,
        /// Continue from the run folder's latest checkpoint.
        #[arg(long)]
        resume: bool,
        /// Train as one replica group through this parameter server (`zerotrain serve`;
        /// repeat for several): overrides `local_sgd.servers`.
        #[arg(long = "server", value_name = "ADDR")]
        servers: Vec<String>,
        /// This job's replica group among the servers' groups: overrides `local_sgd.group`.
        #[arg(long)]
        group: Option<u64>,
    },
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
    Estimate {
        /// Parameters (e.g. 7.5e9); or take them from --model-config.
        #[arg(long, required_unless_present = "model_config")]
        params: Option<f64>,
        /// Parameters of the largest layer (unit), for DeepSpeed's ZeRO-3 estimate; or take
        /// it from --model-config (the largest unit of the GPT).
        #[arg(long)]
        largest_layer_params: Option<f64>,
        /// Total number of ranks (GPUs) over all nodes; default: --nodes x --gpus-per-node.
        #[arg(long, required_unless_present = "gpus_per_node")]
        world_size: Option<u64>,
        /// Ranks per node (DeepSpeed's `num_gpus_per_node`); default: --world-size / --nodes.
        #[arg(long)]
        gpus_per_node: Option<u64>,
        /// Nodes (machines) the ranks are spread over.
        #[arg(long, default_value_t = 1)]
        nodes: u64,
        /// Show DeepSpeed's estimates with offload to CPU too (stage 2: the optimizer;
        /// stage 3: the optimizer, then the parameters too).
        #[arg(long)]
        offload: bool,
        /// A config whose `model` section gives the parameter count, or a Hugging Face
        /// `config.json` (such as the presets in configs/models/).
        #[arg(long)]
        model_config: Option<PathBuf>,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Check a config: print the resolved plan, or the errors.
    #[command(subcommand)]
    Config(ConfigCommand),
    /// Measure and print benchmark tables.
    #[command(subcommand)]
    Bench(BenchCommand),
    /// Write a checkpoint's parameters to one safetensors file keyed by module path, or
    /// (`--format hf`) a Hugging Face family's checkpoint as a Hugging Face folder.
    Consolidate {
        /// The checkpoint directory (holding `latest` and the tags).
        dir: PathBuf,
        /// The tag to read (default: the one `latest` names).
        #[arg(long)]
        tag: Option<String>,
        /// The output file (`--format safetensors`) or new folder (`--format hf`).
        #[arg(long)]
        out: PathBuf,
        /// Output dtype: f32, bf16 or f16 (default: f32; with `--format hf`, the
        /// config's dtype or torch_dtype).
        #[arg(long)]
        dtype: Option<String>,
        /// safetensors (one file keyed by module path) or hf (config.json, sharded
        /// safetensors and the tokenizer, loadable by transformers).
        #[arg(long, default_value = "safetensors")]
        format: String,
        /// `--format hf`: the largest shard, e.g. 5GB, 500MB or bytes.
        #[arg(long, default_value = "5GB")]
        max_shard_size: String,
        /// `--format hf`: the folder with the model's config.json and tokenizer (default:
        /// DIR, where zerotrain train puts them).
        #[arg(long)]
        hf_config: Option<PathBuf>,
    },
    /// Print the mean next-token loss and perplexity of a Hugging Face family's model
    /// (`model.hf_dir`, or a checkpoint of it with --checkpoint) on a text file.
    Eval {
        /// A config whose `model` section names the model (`hf_dir` or `hf_config`) and
        /// whose `block_size` is the context.
        #[arg(long)]
        config: PathBuf,
        /// The UTF-8 text to score, tokenized by the model's tokenizer.json.
        #[arg(long, required_unless_present = "tokens", conflicts_with = "tokens")]
        text: Option<PathBuf>,
        /// A token file (zerotrain tokenize) to score: its held-out split, or all of it
        /// with --all.
        #[arg(long)]
        tokens: Option<PathBuf>,
        /// With --tokens: score every token of the file, not only its held-out split.
        #[arg(long, requires = "tokens")]
        all: bool,
        /// A checkpoint folder (holding `latest` and the tags) of the model to load.
        #[arg(long)]
        checkpoint: Option<PathBuf>,
        /// The checkpoint's tag (default: the one `latest` names).
        #[arg(long)]
        tag: Option<String>,
        /// Number of ranks (overrides `zerotrain.world_size`).
        #[arg(long)]
        world_size: Option<usize>,
        /// One JSON object instead of the sentence.
        #[arg(long)]
        json: bool,
    },
    /// Sample text from a Hugging Face family's model (`model.hf_dir`, or a checkpoint of it).
    Generate {
        /// A config whose `model` section names the model; `block_size` is the context.
        #[arg(long)]
        config: PathBuf,
        /// The text to continue.
        #[arg(long)]
        prompt: String,
        /// Tokens to add.
        #[arg(long, default_value_t = 64)]
        tokens: usize,
        /// 0: the most likely token each time; else the sampling temperature.
        #[arg(long, default_value_t = 0.8)]
        temperature: f32,
        /// Sample among the K most likely tokens only (0: all).
        #[arg(long, default_value_t = 40)]
        top_k: usize,
        /// Then among the fewest most likely whose probabilities reach P (nucleus
        /// sampling; 1: all).
        #[arg(long, default_value_t = 1.0)]
        top_p: f32,
        /// The sampler's seed (the same seed gives the same text).
        #[arg(long, default_value_t = 1)]
        seed: u64,
        /// A checkpoint folder (holding `latest` and the tags) of the model to load.
        #[arg(long)]
        checkpoint: Option<PathBuf>,
        /// The checkpoint's tag (default: the one `latest` names).
        #[arg(long)]
        tag: Option<String>,
        /// Print JSON: the text, and the token ids of the prompt and of what was added.
        #[arg(long)]
        json: bool,
        /// Add all --tokens, past the model's end tokens (by default sampling stops after
        /// one: generation_config.json's eos_token_id, else config.json's, else the
        /// tokenizer's end token).
        #[arg(long)]
        ignore_eos: bool,
    },
    /// Tokenize text or JSON-lines files into a token file for training (`--data`), with a
    /// tokenizer.json or a byte-level BPE trained on the same files.
    Tokenize {
        /// Text files (a document per blank-line-separated paragraph) or `.jsonl` files (a
        /// document per line).
        #[arg(required = true)]
        inputs: Vec<PathBuf>,
        /// The tokenizer.json to use (or to write, with --train-vocab).
        #[arg(long)]
        tokenizer: PathBuf,
        /// Train a byte-level BPE of this many tokens on the inputs and write it to --tokenizer.
        #[arg(long)]
        train_vocab: Option<usize>,
        /// The token file to write.
        #[arg(long)]
        out: PathBuf,
        /// The share of the tokens held out for validation (the file's end).
        #[arg(long, default_value_t = 0.01)]
        valid_fraction: f64,
        /// The JSON-lines field holding each document's text.
        #[arg(long, default_value = "text")]
        field: String,
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
