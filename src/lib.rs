//! The `zerotrain` command: everything the command line adds on top of the engine
//! (`zerotrain`) and the models it trains (`zerotrain_models`), and nothing either needs.
//!
//! | module | holds |
//! |---|---|
//! | [`keys`] | the application's keys in the config file (`model`, checkpoint and eval cadence) |
//! | [`train`] | the main job behind `zerotrain train`: metrics, plots, checkpoints, SIGINT/SIGTERM |
//! | [`bench`](mod@bench) | the tables behind `zerotrain bench` |
//! | `cli`, `commands` | clap's declarations and each subcommand's body |
//!
//! Errors here are `anyhow` (an application's); the library's are typed.

#![deny(missing_docs)]

pub mod bench;
mod cli;
mod commands;
pub mod keys;
mod processes;
pub mod train;

use std::process::ExitCode;

use clap::Parser;

use cli::{BenchCommand, Cli, Command, ConfigCommand};

/// The `zerotrain` binary: parses the command line, runs the subcommand, prints an error
/// as one `error:` line and maps it to exit code 1.
pub fn main() -> ExitCode {
    return_large_buffers_to_the_os();
    let cli = Cli::parse();
    // Jobs that talk over sockets keep SIGPIPE ignored: a parameter server that dies under
    // a worker's write must be an error the worker handles (it reconnects), not a silent
    // death by signal.
    if !matches!(cli.command, Command::Train { .. } | Command::Serve { .. } | Command::Launch { .. }) {
        end_quietly_on_a_closed_pipe();
    }
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// Note: the allocator. A training step allocates and frees buffers of a unit's size
/// (gathered parameters, gradient buckets). glibc serves allocations above a threshold
/// with `mmap` and returns them to the system when freed, but raises that threshold
/// (up to 32 MiB) each time such a buffer is freed; after that, unit-sized buffers come
/// from the heap, whose freed space fragments and stays resident. On a 60M-parameter model
/// at stage 3 that left 40% more resident memory at the peak than the buffers alive at
/// once. The `zerotrain` command therefore fixes the threshold at 1 MiB (a library leaves
/// such a process-wide choice to its program; a program can set
/// `MALLOC_MMAP_THRESHOLD_=1048576` in the environment to the same effect).
fn return_large_buffers_to_the_os() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only changes the allocator's tuning; it takes plain integers and is
    // called before any other thread exists.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 1 << 20);
    }
}

/// `zerotrain config check FILE | head` closes the pipe early: end quietly as other Unix
/// tools do (Rust ignores SIGPIPE, and a failed print panics). Before other threads exist.
fn end_quietly_on_a_closed_pipe() {
    #[cfg(unix)]
    // SAFETY: restoring a signal's default disposition before other threads exist.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
}

fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::Train(args) => commands::train(args),
        Command::Estimate(args) => commands::estimate::estimate(args),
        Command::Config(ConfigCommand::Check { file, world_size, steps, json }) => {
            commands::config_check(&file, world_size, steps, json)
        }
        Command::Bench(BenchCommand::Servers { params, dtype, repeats, json }) => {
            commands::bench::bench_servers(params, &dtype, repeats, json)
        }
        Command::Bench(BenchCommand::Convert { mib, repeats, json }) => {
            commands::bench::bench_convert(mib, repeats, json)
        }
        Command::Bench(BenchCommand::Collectives { world_sizes, max_mib, repeats, json }) => {
            commands::bench::bench_collectives(&world_sizes, max_mib, repeats, json)
        }
        Command::Bench(BenchCommand::Growth { steps, plot }) => commands::bench::bench_growth(steps, &plot),
        Command::Bench(BenchCommand::Engine { world_sizes, steps, overlap, json }) => {
            commands::bench::bench_engine(&world_sizes, steps, overlap, json)
        }
        Command::Bench(BenchCommand::Pipeline { stages, steps, json }) => {
            commands::bench::bench_pipeline(&stages, steps, json)
        }
        Command::Bench(BenchCommand::Gpu {
            device,
            model,
            layers,
            width,
            heads,
            context,
            vocab,
            batch,
            steps,
            stages,
            precision,
            mode,
            recompute_units,
            peak_tflops,
            breakdown,
            blocked_attention,
            whole_logits,
            json,
        }) => {
            let shape = zerotrain_models::GptConfig {
                n_layer: layers,
                n_head: heads,
                n_embd: width,
                block_size: context,
                vocab_size: vocab,
                tied_head: true,
            };
            let bench = crate::bench::gpu::GpuBench {
                model: bench::gpu::BenchModel::named(&model, shape)?,
                device,
                batch,
                steps,
                stages,
                precision,
                modes: mode,
                recompute_units,
                peak_tflops,
                breakdown,
                blocked_attention,
                whole_logits,
            };
            commands::bench::bench_gpu(&bench, json)
        }
        Command::Bench(BenchCommand::OffloadGpt { layers, width, tokens, steps, lr, nvme, json }) => {
            let shape = bench::offload::GptShape { layers, width, tokens };
            commands::bench::bench_offload_gpt(shape, steps, lr, nvme.as_deref(), json)
        }
        Command::Bench(BenchCommand::Offload { millions, nvme, tile_millions, repeats, json }) => {
            commands::bench::bench_offload(millions, &nvme, tile_millions, repeats, json)
        }
        Command::Bench(BenchCommand::Memory { millions, layers, stage, world_size, mode, nvme }) => {
            commands::bench::bench_memory(millions, layers, stage, world_size, mode, nvme.as_deref())
        }
        Command::Consolidate(args) => commands::consolidate(args),
        Command::Launch(args) => commands::launch::launch(args),
        Command::Generate(args) => commands::generate::generate(args),
        Command::Tokenize(args) => commands::tokenize::tokenize(args),
        Command::Eval(args) => commands::eval::eval(args),
        Command::Inspect { dir, tag, verify, json } => commands::inspect(&dir, tag.as_deref(), verify, json),
        Command::Serve { config, listen, checkpoint } => commands::serve(&config, listen, checkpoint),
    }
}
