//! The `zerotrain` command line.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use clap::{Parser, Subcommand};
use zerotrain::{Config, Overrides};

#[derive(Parser)]
#[command(name = "zerotrain", version, about = "DeepSpeed-style ZeRO training for Burn")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
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
    },
    /// Check a config: print the resolved plan, or the errors.
    #[command(subcommand)]
    Config(ConfigCommand),
    /// Measure and print benchmark tables.
    #[command(subcommand)]
    Bench(BenchCommand),
}

#[derive(Subcommand)]
enum BenchCommand {
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
enum ConfigCommand {
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
        Command::Config(ConfigCommand::Check { file, world_size, steps, json }) => {
            let plan = Config::from_file(&file)?.resolve(Overrides { world_size, total_steps: steps })?;
            if json {
                println!("{}", serde_json::to_string_pretty(&plan)?);
            } else {
                println!("{} resolves to:\n{plan}", file.display());
            }
            Ok(())
        }
        Command::Bench(BenchCommand::Convert { mib, repeats, json }) => {
            let elems = (mib << 20) / 4;
            let rows = zerotrain::bench::conversion_table(elems, repeats);
            match json {
                true => println!("{}", serde_json::to_string_pretty(&rows)?),
                false => print!("{}", zerotrain::bench::format_conversion_table(&rows, elems, repeats)),
            }
            Ok(())
        }
        Command::Train { config, world_size, steps } => {
            let plan = Config::from_file(&config)?.resolve(Overrides { world_size, total_steps: Some(steps) })?;
            if let Some(warning) = plan.warning() {
                eprintln!("warning: {warning}");
            }
            println!(
                "training the built-in transformer: {} ranks, {}, {steps} steps",
                plan.world_size, plan.zero.stage
            );
            let s =
                zerotrain::train::train_demo(&plan, steps, &|line| println!("{line}")).context("training failed")?;
            let m = s.memory;
            println!(
                "validation loss {:.5} -> {:.5} ({:.1}x lower) in {:.1} s, {:.0} samples/s",
                s.initial_val_loss,
                s.final_val_loss,
                s.initial_val_loss / s.final_val_loss,
                s.seconds,
                s.samples_per_second
            );
            println!(
                "rank 0 model states: params {} B, grads {} B, optimizer {} B (Ψ = {}); peak transient {} B",
                m.params, m.grads, m.optimizer, s.num_params, m.peak_transient
            );
            println!("rank 0 communication: {} B per step", s.comm_bytes_per_step);
            Ok(())
        }
    }
}
