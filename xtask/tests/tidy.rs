//! Tidy checks: rules of the project that a test can hold, run with every `cargo test`.

use std::fs;
use std::path::{Path, PathBuf};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf()
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = fs::read_dir(dir) else { return };
    for e in entries.flatten() {
        let p = e.path();
        let name = p.file_name().unwrap().to_string_lossy().into_owned();
        if p.is_dir() {
            if name != "target" && !name.starts_with('.') {
                rust_files(&p, out);
            }
        } else if name.ends_with(".rs") {
            out.push(p);
        }
    }
}

fn crates() -> Vec<String> {
    let mut v: Vec<String> = fs::read_dir(root().join("crates"))
        .unwrap()
        .flatten()
        .filter(|e| e.path().is_dir())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

/// The stack has no async runtime and no HTTP framework: everything runs on mio loops and threads.
#[test]
fn no_async_runtime_or_http_framework_in_the_lockfile() {
    let lock = fs::read_to_string(root().join("Cargo.lock")).expect("Cargo.lock is committed");
    let banned = ["tokio", "hyper", "axum", "async-std", "actix-web", "warp", "reqwest", "smol", "async-io"];
    let found: Vec<&str> = lock
        .lines()
        .filter_map(|l| l.strip_prefix("name = \""))
        .map(|l| l.trim_end_matches('"'))
        .filter(|n| banned.contains(n))
        .collect();
    assert!(found.is_empty(), "Cargo.lock pulls in {found:?}; find what brings it in (`cargo tree -i NAME`)");
}

/// A file may hold `unsafe` only if it is a `sys` module (`sys.rs` or under a `sys/` folder).
fn unsafe_allowed(path: &Path) -> bool {
    path.file_name().is_some_and(|n| n == "sys.rs") || path.components().any(|c| c.as_os_str() == "sys")
}

/// Line numbers (1-based) of `text` that use `unsafe` or opt into it, outside comments and strings.
fn unsafe_lines(text: &str) -> Vec<usize> {
    let mut found = Vec::new();
    for (i, line) in text.lines().enumerate() {
        // Blank out string literals, then drop a trailing comment.
        let mut code = String::new();
        let mut in_str = false;
        let mut prev = ' ';
        for ch in line.chars() {
            if ch == '"' && prev != '\\' {
                in_str = !in_str;
            } else if !in_str {
                code.push(ch);
            }
            prev = ch;
        }
        let code = code.split("//").next().unwrap_or("");
        let uses = code.split(|c: char| !c.is_alphanumeric() && c != '_').any(|w| w == "unsafe");
        if uses || code.contains("allow(unsafe_code)") {
            found.push(i + 1);
        }
    }
    found
}

#[test]
fn unsafe_detection_sees_code_and_ignores_text() {
    let text = "let a = 1;\nunsafe { f(\"x\") }\n// unsafe in a comment\nlet s = \"unsafe\";\n#![allow(unsafe_code)]\npub unsafe fn g() {}\n";
    assert_eq!(unsafe_lines(text), [2, 5, 6]);
}

#[test]
fn unsafe_code_only_in_sys_modules() {
    let mut files = Vec::new();
    rust_files(&root().join("crates"), &mut files);
    rust_files(&root().join("xtask"), &mut files);
    rust_files(&root().join("fuzz"), &mut files);
    let mut offenders = Vec::new();
    for f in files.iter().filter(|f| !unsafe_allowed(f)) {
        for line in unsafe_lines(&fs::read_to_string(f).unwrap()) {
            offenders.push(format!("{}:{line}", f.strip_prefix(root()).unwrap().display()));
        }
    }
    assert!(offenders.is_empty(), "unsafe outside a sys module: {offenders:?}");
}

#[test]
fn crates_without_a_sys_module_forbid_unsafe() {
    for c in crates() {
        let dir = root().join("crates").join(&c).join("src");
        let has_sys = dir.join("sys.rs").exists() || dir.join("sys").is_dir();
        let lib = fs::read_to_string(dir.join("lib.rs"))
            .or_else(|_| fs::read_to_string(dir.join("main.rs")))
            .unwrap();
        if !has_sys {
            assert!(
                lib.contains("#![forbid(unsafe_code)]"),
                "crates/{c} has no sys module but does not forbid unsafe"
            );
        }
    }
}

#[test]
fn every_crate_has_a_readme_with_an_example_and_a_code_map_entry() {
    let arch = fs::read_to_string(root().join("ARCHITECTURE.md")).expect("ARCHITECTURE.md exists");
    let members = fs::read_to_string(root().join("Cargo.toml")).unwrap();
    for c in crates() {
        let readme = fs::read_to_string(root().join("crates").join(&c).join("README.md"))
            .unwrap_or_else(|_| panic!("crates/{c}/README.md is missing"));
        assert!(readme.contains("```"), "crates/{c}/README.md has no example");
        assert!(
            arch.contains(&format!("crates/{c}")),
            "ARCHITECTURE.md's code map does not mention crates/{c}"
        );
        assert!(members.contains(&format!("\"crates/{c}\"")), "crates/{c} is not a workspace member");
    }
}

/// README.md keeps exactly the two set-up commands, and CI runs the test one.
#[test]
fn readme_and_ci_agree_on_the_test_command() {
    let readme = fs::read_to_string(root().join("README.md")).unwrap();
    assert!(readme.contains("cargo xtask test"), "README.md must give the test command");
    assert!(readme.contains("cargo xtask serve"), "README.md must give the serve command");
    let ci = fs::read_to_string(root().join(".ci/run")).unwrap();
    assert!(ci.contains("cargo xtask test"), ".ci/run must run the README's test command");
}
