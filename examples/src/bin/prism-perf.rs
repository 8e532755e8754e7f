//! prism-perf: see `prism_examples` for what it does and `prism-perf --help` for how to run it.

fn main() -> std::process::ExitCode {
    prism_examples::main()
}
