//! `sygpu-driver`: see the library documentation (`src/lib.rs`) and `README.md`.

#![forbid(unsafe_code)]

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    std::process::exit(sygpu_driver::main_with(&args));
}
