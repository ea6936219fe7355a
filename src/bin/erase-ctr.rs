//! `erase-ctr`: the bundled CTR trainer (see `erase-ctr --help`, and [`erase::cli`]).

fn main() -> std::process::ExitCode {
    erase::cli::main()
}
