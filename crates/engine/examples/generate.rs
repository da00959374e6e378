//! One prompt through the engine, embedded without HTTP: the completion as it streams, then its speed.
//! `cargo xtask generate` runs it (`cargo run --release -p pdserve-engine --example generate -- --help`).

use std::io::Write as _;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use pdserve_engine::{Engine, EngineConfig, Input, Output, Request};
use pdserve_model::{ChatMessage, WeightFormat};

const USAGE: &str = "\
generate --prompt TEXT [--chat] [--max-tokens N] [--temperature T] [--seed S] [--weights f32|bf16|q8|q4] --model DIR
  one completion from the engine, printed as it comes, then the time to the first token and the decode speed";

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match run(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("generate: {e}\n{USAGE}");
            ExitCode::from(2)
        }
    }
}

fn run(args: &[String]) -> Result<(), String> {
    let (mut prompt, mut chat, mut max_tokens, mut model) = (None, false, 64usize, None);
    let (mut temperature, mut seed, mut weights) = (0.0f32, 0u64, WeightFormat::F32);
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let mut val = || it.next().cloned().ok_or_else(|| format!("{a} needs a value"));
        match a.as_str() {
            "-h" | "--help" => {
                println!("{USAGE}");
                return Ok(());
            }
            "--prompt" => prompt = Some(val()?),
            "--chat" => chat = true,
            "--max-tokens" => max_tokens = val()?.parse().map_err(|e| format!("--max-tokens: {e}"))?,
            "--temperature" => temperature = val()?.parse().map_err(|e| format!("--temperature: {e}"))?,
            "--seed" => seed = val()?.parse().map_err(|e| format!("--seed: {e}"))?,
            "--weights" => weights = val()?.parse().map_err(|e: pdserve_model::ModelError| e.to_string())?,
            "--model" => model = Some(PathBuf::from(val()?)),
            other => return Err(format!("unknown argument {other:?}")),
        }
    }
    let prompt = prompt.ok_or("--prompt is required")?;
    let mut config = EngineConfig::new(model.ok_or("--model is required")?);
    config.weights = weights;
    let loading = Instant::now();
    let mut engine = Engine::start(config, Arc::new(|| {})).map_err(|e| e.to_string())?;
    eprintln!("loaded in {:.1} s", loading.elapsed().as_secs_f64());
    let input = if chat { Input::Chat(vec![ChatMessage::new("user", &prompt)]) } else { Input::Text(prompt) };
    let mut req = Request::new("generate", input, Instant::now() + Duration::from_secs(600));
    req.max_tokens = Some(max_tokens);
    req.sampling.temperature = temperature;
    req.seed = Some(seed);
    let sent = Instant::now();
    engine.submit(req).map_err(|e| e.to_string())?;
    let mut out = Vec::new();
    let mut first = None;
    let mut stdout = std::io::stdout().lock();
    loop {
        engine.poll_timeout(Duration::from_secs(1), &mut out);
        for o in out.drain(..) {
            match o {
                Output::Text { text, .. } => {
                    first.get_or_insert_with(Instant::now);
                    let _ = write!(stdout, "{text}");
                    let _ = stdout.flush();
                }
                Output::Finished { finish, usage, .. } => {
                    let _ = writeln!(stdout);
                    let end = Instant::now();
                    let first = first.unwrap_or(end);
                    let decode = end.saturating_duration_since(first).as_secs_f64().max(1e-9);
                    eprintln!(
                        "{finish:?}: prompt {} tokens, first token after {:.1} ms; {} tokens, {:.1} tokens/s after the first",
                        usage.prompt_tokens,
                        first.saturating_duration_since(sent).as_secs_f64() * 1e3,
                        usage.completion_tokens,
                        usage.completion_tokens.saturating_sub(1) as f64 / decode
                    );
                    return Ok(());
                }
                Output::Rejected { error, .. } => return Err(error.to_string()),
                _ => {}
            }
        }
    }
}
