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

/// The `[dependencies]` of a Cargo.toml that are crates of this workspace, by folder name.
fn internal_deps(manifest: &Path) -> Vec<String> {
    let text = fs::read_to_string(manifest).unwrap();
    let mut deps = Vec::new();
    let mut in_deps = false;
    for line in text.lines() {
        if line.starts_with('[') {
            in_deps = line.trim() == "[dependencies]";
            continue;
        }
        if in_deps {
            if let Some(name) = line.trim().strip_prefix("pdserve-") {
                let name = name.split(['.', ' ', '=']).next().unwrap();
                deps.push(name.to_owned());
            }
        }
    }
    deps.sort();
    deps
}

/// ARCHITECTURE.md's table of which crate may depend on which: `| `crate` | `a`, `b` |` rows under
/// "## Layers".
fn layer_table() -> Vec<(String, Vec<String>)> {
    let arch = fs::read_to_string(root().join("ARCHITECTURE.md")).unwrap();
    let section = arch.split("\n## Layers").nth(1).expect("ARCHITECTURE.md has a `## Layers` section");
    let section = section.split("\n## ").next().unwrap();
    let ticked = |s: &str| -> Vec<String> { s.split('`').skip(1).step_by(2).map(str::to_owned).collect() };
    section
        .lines()
        .filter(|l| l.starts_with("| `"))
        .map(|l| {
            let cells: Vec<&str> = l.split('|').collect();
            (ticked(cells[1]).remove(0), ticked(cells[2]))
        })
        .collect()
}

/// Every crate depends only on the crates ARCHITECTURE.md allows it, and that table has no cycle:
/// lower crates never import higher ones.
#[test]
fn crate_dependencies_follow_the_layers_of_architecture_md() {
    let table = layer_table();
    let allowed: std::collections::HashMap<&str, &Vec<String>> =
        table.iter().map(|(c, a)| (c.as_str(), a)).collect();
    let mut all = crates();
    all.push("xtask".to_owned());
    for c in &all {
        let dir = if c == "xtask" { root().join("xtask") } else { root().join("crates").join(c) };
        let may = allowed
            .get(c.as_str())
            .unwrap_or_else(|| panic!("ARCHITECTURE.md's layer table has no row for {c}"));
        for dep in internal_deps(&dir.join("Cargo.toml")) {
            assert!(
                may.contains(&dep),
                "{c} depends on {dep}, which ARCHITECTURE.md's layers do not allow it"
            );
        }
    }
    // No cycle in the table itself: repeatedly remove crates whose allowed dependencies are all gone.
    let mut left: Vec<&(String, Vec<String>)> = table.iter().collect();
    while !left.is_empty() {
        let before = left.len();
        let names: Vec<String> = left.iter().map(|(c, _)| c.clone()).collect();
        left.retain(|(_, deps)| deps.iter().any(|d| names.contains(d)));
        assert!(left.len() < before, "the layer table has a cycle among {names:?}");
    }
}

/// Text of a source file without its `#[cfg(test)] mod tests` (which may read the clock).
fn without_tests(text: &str) -> &str {
    match text.find("#[cfg(test)]\nmod tests") {
        Some(at) => &text[..at],
        None => text,
    }
}

/// The sans-IO cores read no clock, spawn no threads and open no sockets: time comes in as `now`.
#[test]
fn sans_io_cores_read_no_clock_spawn_no_threads_and_open_no_sockets() {
    let mut files = Vec::new();
    for dir in [
        "crates/kvcache/src",
        "crates/scheduler/src",
        "crates/api/src",
        "crates/router/src/policy",
        "crates/engine/src/core",
    ] {
        rust_files(&root().join(dir), &mut files);
    }
    for f in [
        "crates/http/src/request.rs",
        "crates/http/src/response.rs",
        "crates/http/src/client.rs",
        "crates/http/src/chunked.rs",
        "crates/http/src/sse.rs",
        "crates/pd-transfer/src/message.rs",
        "crates/pd-transfer/src/sender.rs",
        "crates/pd-transfer/src/receiver.rs",
        "crates/router/src/flight.rs",
        "crates/router/src/admission.rs",
        "crates/router/src/health.rs",
        "crates/telemetry/src/ledger.rs",
    ] {
        files.push(root().join(f));
    }
    let banned = [
        "Instant::now",
        "SystemTime::now",
        "thread::spawn",
        "std::thread",
        "TcpStream",
        "TcpListener",
        "UdpSocket",
        "mio::",
        "crossbeam",
        "Mutex",
    ];
    let mut offenders = Vec::new();
    for f in &files {
        let text = fs::read_to_string(f).unwrap_or_else(|_| panic!("{} is missing", f.display()));
        for (i, line) in without_tests(&text).lines().enumerate() {
            let code = line.split("//").next().unwrap_or("");
            for b in banned {
                if code.contains(b) {
                    offenders.push(format!("{}:{}: {b}", f.strip_prefix(root()).unwrap().display(), i + 1));
                }
            }
        }
    }
    assert!(offenders.is_empty(), "I/O in a sans-IO core: {offenders:?}");
}

/// `anyhow` is for binaries and xtask: every library crate has an error enum of its own.
#[test]
fn anyhow_only_in_xtask() {
    for c in crates() {
        let manifest = fs::read_to_string(root().join("crates").join(&c).join("Cargo.toml")).unwrap();
        assert!(
            !manifest.lines().any(|l| l.trim_start().starts_with("anyhow")),
            "crates/{c} depends on anyhow; give it an error enum of its own"
        );
    }
}

/// No source file outside tests and benches is over 800 lines: split along the seams the code has.
#[test]
fn no_file_over_800_lines_outside_tests() {
    let mut files = Vec::new();
    rust_files(&root().join("crates"), &mut files);
    rust_files(&root().join("xtask/src"), &mut files);
    rust_files(&root().join("fuzz/fuzz_targets"), &mut files);
    let long: Vec<String> = files
        .iter()
        .filter(|f| !f.components().any(|c| c.as_os_str() == "tests" || c.as_os_str() == "benches"))
        .filter_map(|f| {
            let n = fs::read_to_string(f).unwrap().lines().count();
            (n > 800).then(|| format!("{} ({n} lines)", f.strip_prefix(root()).unwrap().display()))
        })
        .collect();
    assert!(long.is_empty(), "files over 800 lines: {long:?}");
}

/// The model crate's modules import one another without a cycle (the layering inside the crate:
/// bits16 and sys at the bottom, the backends on top).
#[test]
fn model_modules_have_no_import_cycle() {
    let src = root().join("crates/model/src");
    let lib = fs::read_to_string(src.join("lib.rs")).unwrap();
    // Names re-exported at the crate root, by the module that defines them.
    let mut owner: std::collections::HashMap<String, String> = std::collections::HashMap::new();
    for line in lib.lines().filter_map(|l| l.trim().strip_prefix("pub use ")) {
        let (module, names) = line.split_once("::").unwrap();
        for n in names.trim_end_matches(';').trim_matches(|c| c == '{' || c == '}').split(',') {
            owner.insert(n.trim().to_owned(), module.to_owned());
        }
    }
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    let module_of = |f: &Path| -> String {
        let rel = f.strip_prefix(&src).unwrap();
        rel.components().next().unwrap().as_os_str().to_string_lossy().trim_end_matches(".rs").to_owned()
    };
    let modules: std::collections::HashSet<String> =
        files.iter().map(|f| module_of(f)).filter(|m| m != "lib" && m != "bin").collect();
    let mut edges: std::collections::HashMap<String, std::collections::HashSet<String>> = Default::default();
    for f in &files {
        let m = module_of(f);
        if !modules.contains(&m) {
            continue;
        }
        let text = fs::read_to_string(f).unwrap();
        for part in without_tests(&text).split("crate::").skip(1) {
            let names: Vec<&str> = match part.strip_prefix('{') {
                Some(list) => list.split('}').next().unwrap().split(',').map(str::trim).collect(),
                None => vec![part.split(|c: char| !c.is_alphanumeric() && c != '_').next().unwrap()],
            };
            for n in names {
                let target = if modules.contains(n) { Some(n.to_owned()) } else { owner.get(n).cloned() };
                if let Some(t) = target.filter(|t| *t != m) {
                    edges.entry(m.clone()).or_default().insert(t);
                }
            }
        }
    }
    // Depth-first search for a back edge.
    fn visit(
        m: &str,
        edges: &std::collections::HashMap<String, std::collections::HashSet<String>>,
        path: &mut Vec<String>,
        done: &mut std::collections::HashSet<String>,
    ) {
        if done.contains(m) {
            return;
        }
        assert!(!path.iter().any(|p| p == m), "import cycle in crates/model: {path:?} -> {m}");
        path.push(m.to_owned());
        for t in edges.get(m).into_iter().flatten() {
            visit(t, edges, path, done);
        }
        path.pop();
        done.insert(m.to_owned());
    }
    let mut done = std::collections::HashSet::new();
    for m in &modules {
        visit(m, &edges, &mut Vec::new(), &mut done);
    }
}
