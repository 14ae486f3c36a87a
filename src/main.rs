//! The `zerotrain` command line: parse, run the subcommand, map errors to the exit code.

use std::process::ExitCode;

use clap::Parser;

mod cli;
mod commands;

use cli::{BenchCommand, Cli, Command, ConfigCommand};

fn main() -> ExitCode {
    match run(Cli::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::Train { config, world_size, steps, data, out, save_every, resume } => {
            commands::train(commands::TrainArgs { config, world_size, steps, data, out, save_every, resume })
        }
        Command::Estimate { params, world_size, nodes, offload, model_config, json } => {
            commands::estimate(params, world_size, nodes, offload, model_config.as_deref(), json)
        }
        Command::Config(ConfigCommand::Check { file, world_size, steps, json }) => {
            commands::config_check(&file, world_size, steps, json)
        }
        Command::Bench(BenchCommand::Convert { mib, repeats, json }) => {
            commands::bench::bench_convert(mib, repeats, json)
        }
        Command::Bench(BenchCommand::Collectives { world_sizes, max_mib, repeats, json }) => {
            commands::bench::bench_collectives(&world_sizes, max_mib, repeats, json)
        }
        Command::Bench(BenchCommand::Growth { steps, plot }) => commands::bench::bench_growth(steps, &plot),
        Command::Bench(BenchCommand::Engine { world_sizes, steps, json }) => {
            commands::bench::bench_engine(&world_sizes, steps, json)
        }
        Command::Bench(BenchCommand::Memory { millions, stage, world_size }) => {
            commands::bench::bench_memory(millions, stage, world_size)
        }
        Command::Consolidate { dir, tag, out, dtype } => commands::consolidate(&dir, tag.as_deref(), &out, &dtype),
        Command::Inspect { dir, tag, verify, json } => commands::inspect(&dir, tag.as_deref(), verify, json),
    }
}
