//! What `cargo xtask test` needs beyond the Rust toolchain, checked before anything is built: each
//! piece found, installed (Debian packages when running as root with apt-get, the toolchain's
//! components with rustup, cargo-fuzz with cargo), or named with the command that installs it, all
//! in one message, before a build starts. The Python packages come after, in the tests' own venv
//! (`test_venv`).

use std::path::Path;
use std::process::Command;

use anyhow::{bail, Result};

/// One thing the tests need.
struct Piece {
    /// What it is for, as the message names it.
    what: &'static str,
    /// Whether it is here.
    present: fn() -> bool,
    /// How it is installed.
    how: Install,
}

enum Install {
    /// A Debian package.
    Debian(&'static str),
    /// A command line (run as given where it can be).
    Command(&'static [&'static str]),
}

fn on_path(cmd: &str) -> bool {
    Command::new("sh").args(["-c", &format!("command -v {cmd}")]).output().is_ok_and(|o| o.status.success())
}

fn succeeds(cmd: &[&str]) -> bool {
    Command::new(cmd[0]).args(&cmd[1..]).output().is_ok_and(|o| o.status.success())
}

const PIECES: &[Piece] = &[
    Piece {
        what: "promtool (checks the Prometheus exposition in crates/telemetry's tests)",
        present: || on_path("promtool"),
        how: Install::Debian("prometheus"),
    },
    Piece {
        what: "dnsmasq (the real DNS server the router's discovery tests change records on)",
        present: || on_path("dnsmasq") || Path::new("/usr/sbin/dnsmasq").exists(),
        how: Install::Debian("dnsmasq-base"),
    },
    Piece {
        what: "UCX headers and libraries (the UCX transport's tests link libucp and libucs)",
        present: || Path::new("/usr/include/ucp/api/ucp.h").exists(),
        how: Install::Debian("libucx-dev"),
    },
    Piece {
        what: "qemu-x86_64 (the CPU kernels' tests run again on an emulated AVX2 CPU without AVX-512)",
        present: || on_path("qemu-x86_64"),
        how: Install::Debian("qemu-user"),
    },
    Piece {
        what: "python3 with venv and ensurepip (the tests' Python packages go into a venv of their own)",
        present: || succeeds(&["python3", "-c", "import venv, ensurepip"]),
        how: Install::Debian("python3-venv"),
    },
    Piece {
        what: "rustfmt and clippy (the format check and the lints)",
        present: || succeeds(&["cargo", "fmt", "--version"]) && succeeds(&["cargo", "clippy", "--version"]),
        how: Install::Command(&["rustup", "component", "add", "rustfmt", "clippy"]),
    },
    Piece {
        what: "cargo-fuzz (every fuzz target runs for a few seconds)",
        present: || succeeds(&["cargo", "fuzz", "--version"]),
        how: Install::Command(&["cargo", "install", "--locked", "cargo-fuzz"]),
    },
];

/// Installs what is missing where it can; otherwise fails with one message naming each missing
/// piece and the command that installs it.
pub(crate) fn prerequisites() -> Result<()> {
    let missing: Vec<&Piece> = PIECES.iter().filter(|p| !(p.present)()).collect();
    if missing.is_empty() {
        return Ok(());
    }
    let debian: Vec<&str> = missing
        .iter()
        .filter_map(|p| match p.how {
            Install::Debian(pkg) => Some(pkg),
            Install::Command(_) => None,
        })
        .collect();
    if !debian.is_empty() && crate::sys::is_root() && on_path("apt-get") {
        eprintln!("xtask test: installing Debian packages {}", debian.join(" "));
        let _ = Command::new("apt-get").args(["update", "-qq"]).status();
        let _ = Command::new("apt-get")
            .env("DEBIAN_FRONTEND", "noninteractive")
            .args(["install", "-y", "-qq", "--no-install-recommends"])
            .args(&debian)
            .status();
    }
    for p in &missing {
        if let Install::Command(cmd) = p.how {
            if (p.present)() {
                continue;
            }
            eprintln!("xtask test: installing: {}", cmd.join(" "));
            let _ = Command::new(cmd[0]).args(&cmd[1..]).status();
        }
    }
    let still: Vec<&&Piece> = missing.iter().filter(|p| !(p.present)()).collect();
    if still.is_empty() {
        return Ok(());
    }
    let mut msg = String::from(
        "the tests need what this machine lacks; install it, then run `cargo xtask test` again:\n",
    );
    for p in &still {
        let how = match p.how {
            Install::Debian(pkg) => format!("sudo apt-get install {pkg}"),
            Install::Command(cmd) => cmd.join(" "),
        };
        msg.push_str(&format!("  - {}\n      {how}\n", p.what));
    }
    bail!("{}", msg.trim_end())
}
