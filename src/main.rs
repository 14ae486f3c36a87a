//! The `zerotrain` command line; everything it does lives in [`zerotrain::app`].

fn main() -> std::process::ExitCode {
    zerotrain::app::main()
}
