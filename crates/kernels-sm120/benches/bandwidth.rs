//! `cargo bench -p pdserve-kernels-sm120`: decode attention and RMSNorm bandwidth on GPU 0 as a
//! fraction of the copy peak (the same run as `cargo xtask bench-gpu`). Without a GPU it says so and
//! measures nothing.

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return; // `cargo bench -- --list` and `cargo test --benches` probes
    }
    if !pdserve_kernels_sm120::bench::run(&[]) {
        eprintln!("bandwidth: skipped or failed (see above); this benchmark needs an NVIDIA GPU");
    }
}
