//! `zerotrain bench`'s subcommands (clap derive): the performance tables.

use clap::Subcommand;

#[derive(Subcommand)]
pub enum BenchCommand {
    /// ZeRO-Infinity's claim on this machine: the built-in GPT (default 1.9B parameters,
    /// fp32 Adam states of 30 GB) trained at stage 3 in units with activation
    /// checkpointing, bf16, its optimizer and parameters on NVMe, one rank, on one repeated
    /// batch; prints each step's loss, time and swap traffic and the peak resident size.
    OffloadGpt {
        /// Transformer blocks.
        #[arg(long, default_value_t = 24)]
        layers: usize,
        /// Model width (heads of 128).
        #[arg(long, default_value_t = 2560)]
        width: usize,
        /// Tokens in the batch.
        #[arg(long, default_value_t = 16)]
        tokens: usize,
        /// Optimizer steps.
        #[arg(long, default_value_t = 3)]
        steps: u64,
        /// AdamW's learning rate.
        #[arg(long, default_value_t = 1e-5)]
        lr: f64,
        /// Folder for the swap files (about 16 bytes per parameter); without it the states
        /// stay in memory (to compare with a model that fits).
        #[arg(long)]
        nvme: Option<std::path::PathBuf>,
        /// Print JSON instead of lines.
        #[arg(long)]
        json: bool,
    },
    /// The offload tiers against the hardware, each pair in the same run: the host AdamW
    /// step against memcpy and Burn's AdamW, the NVMe optimizer step against the disk's
    /// direct sequential bandwidth on files of the same size.
    Offload {
        /// Elements of the optimizer range, in millions.
        #[arg(long, default_value_t = 64)]
        millions: usize,
        /// Folder for the swap files (on the disk to measure).
        #[arg(long)]
        nvme: std::path::PathBuf,
        /// Elements per optimizer tile (`sub_group_size`), in millions.
        #[arg(long, default_value_t = 16)]
        tile_millions: usize,
        /// Repeats of each measurement (the best is reported).
        #[arg(long, default_value_t = 3)]
        repeats: usize,
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// All-reduce, reduce-scatter and all-gather bandwidth: the threads backend and, under
    /// mpirun (built with --features mpi), MPI, for the same sizes in the same run.
    Collectives {
        /// Ranks for the threads backend (under mpirun: the process count).
        #[arg(long, value_delimiter = ',', default_value = "2,4")]
        world_sizes: Vec<usize>,
        /// Largest buffer, MiB (sizes go up by 4x from 4 KiB).
        #[arg(long, default_value_t = 256)]
        max_mib: usize,
        /// Calls per measurement.
        #[arg(long, default_value_t = 5)]
        repeats: usize,
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Step time and per-rank memory as the model and the world size grow, and a PNG plot.
    Growth {
        /// Measured steps per configuration.
        #[arg(long, default_value_t = 6)]
        steps: u64,
        /// Where to write the plot.
        #[arg(long, default_value = "growth.png")]
        plot: std::path::PathBuf,
    },
    /// Engine overhead against a plain Burn loop, and each stage's cost in each mode (step
    /// time, phase breakdown, time waiting on collectives against their own time, bytes per
    /// step against theory, memory against the formula). Under mpirun: the stage table over
    /// MPI, at mpirun's process count.
    Engine {
        /// World sizes for the stage table (threads).
        #[arg(long, value_delimiter = ',', default_value = "2,4")]
        world_sizes: Vec<usize>,
        /// Measured steps per configuration.
        #[arg(long, default_value_t = 10)]
        steps: u64,
        /// Set `overlap_comm` at every stage (default: DeepSpeed's, on at stage 3 only).
        #[arg(long)]
        overlap: bool,
        /// Print JSON instead of tables.
        #[arg(long)]
        json: bool,
    },
    /// Per-rank memory of a large MLP over 2 steps at one stage: model states, the process's
    /// peak resident size while building the engine and while training (run under mpirun
    /// for per-process figures; bench/mpi_memory.sh runs every stage).
    Memory {
        /// Parameters, in millions.
        #[arg(long, default_value_t = 60)]
        millions: usize,
        /// Layers of the MLP (each one unit).
        #[arg(long, default_value_t = 8)]
        layers: usize,
        /// ZeRO stage.
        #[arg(long)]
        stage: u8,
        /// Ranks for the threads backend (under mpirun: the process count).
        #[arg(long, default_value_t = 4)]
        world_size: usize,
        /// How the engine runs the model.
        #[arg(long, value_enum, default_value = "checkpointed")]
        mode: crate::bench::RunMode,
        /// Offload the optimizer (stages 1-3) and, at stage 3, the parameters to NVMe swap
        /// files under this folder.
        #[arg(long)]
        nvme: Option<std::path::PathBuf>,
    },
    /// Pipeline parallelism: each stage's idle fraction against GPipe's bubble for K stages
    /// and 1, 4, 8, 16 micro-batches, both schedules, kept activations, and plain data
    /// parallelism on the same ranks (under mpirun: over MPI, K = the process count).
    Pipeline {
        /// Stage counts (threads).
        #[arg(long, value_delimiter = ',', default_value = "2,4")]
        stages: Vec<usize>,
        /// Measured steps per configuration.
        #[arg(long, default_value_t = 5)]
        steps: usize,
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// A GPT on one device (default: GPT-2 small's shape on wgpu): a plain Burn loop and
    /// the engine at each stage, in tokens/s and model FLOPs utilisation, with the memory
    /// the device's allocator holds and the engine's phase times.
    Gpu {
        /// Where to run: cpu, wgpu or cuda.
        #[arg(long, default_value = "wgpu")]
        device: zerotrain::config::ComputeDevice,
        /// The model: `builtin` (the built-in GPT of --layers, --width, --heads, --vocab), a
        /// Hugging Face `config.json` (random weights: GPT-2 or the LLaMA family), or `gpt2`
        /// / `llama` for configs/models/gpt2-small.json / llama-1b.json.
        #[arg(long, default_value = "builtin")]
        model: String,
        /// Transformer blocks (the built-in GPT).
        #[arg(long, default_value_t = 12, conflicts_with = "model")]
        layers: usize,
        /// Model width (the built-in GPT).
        #[arg(long, default_value_t = 768, conflicts_with = "model")]
        width: usize,
        /// Attention heads (the built-in GPT).
        #[arg(long, default_value_t = 12, conflicts_with = "model")]
        heads: usize,
        /// Context length, tokens.
        #[arg(long, default_value_t = 1024)]
        context: usize,
        /// Vocabulary size (the built-in GPT).
        #[arg(long, default_value_t = 50304, conflicts_with = "model")]
        vocab: usize,
        /// Sequences per step.
        #[arg(long, default_value_t = 8)]
        batch: usize,
        /// Measured steps (after 2 warm-up steps).
        #[arg(long, default_value_t = 10)]
        steps: usize,
        /// ZeRO stages for the engine rows.
        #[arg(long, value_delimiter = ',', default_value = "0,3")]
        stages: Vec<u8>,
        /// The engine's compute dtype: fp32, fp16 or bf16.
        #[arg(long, default_value = "fp32", value_parser = ["fp32", "fp16", "bf16"])]
        precision: String,
        /// How the engine runs the model: a row per mode at each stage.
        #[arg(long, value_enum, value_delimiter = ',', default_value = "units,checkpointed")]
        mode: Vec<crate::bench::RunMode>,
        /// With `checkpointed`: a row per value, recomputing only that many blocks, the
        /// first (`zerotrain.recompute_units`); none given: one row recomputing every block.
        #[arg(long, value_delimiter = ',')]
        recompute_units: Vec<usize>,
        /// The device's dense peak in TFLOPS, for MFU (H200 and H100 SXM: 989 in bf16).
        #[arg(long, default_value_t = 989.0)]
        peak_tflops: f64,
        /// Phase times that split the step: the engine waits for the device at each phase's
        /// end (`wall_clock_breakdown`), which its step time then includes.
        #[arg(long)]
        breakdown: bool,
        /// A row after the engine's: plain Burn in the engine's precision with attention in
        /// Burn's own operations (`zerotrain::nn::set_attention_kernels(false)`), to measure
        /// the attention kernels against.
        #[arg(long)]
        blocked_attention: bool,
        /// A last row: plain Burn in the engine's precision with the loss of the whole logits
        /// (Burn's log-softmax of `[tokens, vocabulary]`) instead of over blocks of tokens.
        #[arg(long)]
        whole_logits: bool,
        /// Print one JSON object per row, a line each, instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// A parameter server's round over loopback: a group's rank pushes a pseudo-gradient
    /// (bf16 or fp32) and pulls the new global weights (f32) from a server in this process.
    Servers {
        /// Values per round (a place's shard).
        #[arg(long, default_value_t = 100e6)]
        params: f64,
        /// The pseudo-gradient's wire dtype: bf16 or fp32.
        #[arg(long, default_value = "bf16")]
        dtype: String,
        /// Rounds measured (each printed).
        #[arg(long, default_value_t = 3)]
        repeats: usize,
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
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
