//! The `zerotrain` command line; everything it does lives in [`zerotrain_cli`].

fn main() -> std::process::ExitCode {
    zerotrain_cli::main()
}
