//! `cargo xtask generate`: one prompt through the engine (its `generate` example), the default model
//! unless `--model` says otherwise.

use anyhow::Result;

pub(crate) fn run(args: &[String]) -> Result<()> {
    let mut a: Vec<String> = ["run", "--release", "-p", "pdserve-engine", "--example", "generate", "--"]
        .iter()
        .map(|s| (*s).to_owned())
        .collect();
    a.extend(args.iter().cloned());
    if !args.iter().any(|x| x == "--model" || x == "-h" || x == "--help") {
        a.push("--model".into());
        a.push(crate::fetch_model(&[])?.display().to_string());
    }
    let a: Vec<&str> = a.iter().map(String::as_str).collect();
    crate::cargo(&a)
}
