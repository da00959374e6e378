//! `cargo xtask generate`: one prompt through the model, printing the completion and its speed.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use pdserve_kvcache::{KvCache, KvConfig, SeqId};
use pdserve_model::{
    Backend, ChatMessage, CpuBackend, IncrementalDecoder, ModelFiles, Sampler, SamplingParams, SeqStep,
};

pub(crate) fn run(args: &[String]) -> Result<()> {
    let mut prompt = None;
    let mut chat = false;
    let mut max_tokens = 64usize;
    let mut params = SamplingParams::greedy();
    let mut seed = 0u64;
    let mut model: Option<PathBuf> = None;
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let mut val = || it.next().context("flag needs a value");
        match a.as_str() {
            "--prompt" => prompt = Some(val()?.clone()),
            "--chat" => chat = true,
            "--max-tokens" => max_tokens = val()?.parse()?,
            "--temperature" => params.temperature = val()?.parse()?,
            "--seed" => seed = val()?.parse()?,
            "--model" => model = Some(PathBuf::from(val()?)),
            other => bail!("unknown argument {other:?}"),
        }
    }
    let prompt = prompt.context("--prompt is required")?;
    let dir = match model {
        Some(d) => d,
        None => crate::fetch_model(&[])?,
    };
    let m = ModelFiles::load(&dir)?;
    let text =
        if chat { m.text.apply_chat_template(&[ChatMessage::new("user", &prompt)], true)? } else { prompt };
    let ids = m.text.encode(&text)?;
    let block_size = 16;
    let blocks = (ids.len() + max_tokens).div_ceil(block_size) + 1;
    let mut kv = KvCache::new(KvConfig { num_blocks: blocks as u32, block_size: block_size as u32 })?;
    let mut cpu = CpuBackend::new(m.config.clone(), Arc::new(m.weights), blocks, block_size);
    let seq = SeqId(1);
    kv.add_sequence(seq, &ids)?;
    kv.reserve(seq, ids.len())?;
    let mut sampler = Sampler::new(params, seed);
    let mut out: Vec<u32> = Vec::new();
    let mut detok = IncrementalDecoder::new();
    let t0 = Instant::now();
    let table = kv.block_table(seq)?.to_vec();
    let logits = cpu.forward(&[SeqStep { tokens: &ids, start_pos: 0, block_table: &table, logits: true }])?;
    kv.commit(seq, ids.len())?;
    let prefill = t0.elapsed();
    let mut next = sampler.sample(&logits[0], &ids, &out).token;
    let t1 = Instant::now();
    let mut stdout = std::io::stdout().lock();
    use std::io::Write as _;
    while out.len() < max_tokens {
        out.push(next);
        if m.config.eos_token_ids.contains(&next) {
            break;
        }
        write!(stdout, "{}", detok.push(&m.text, next)?)?;
        stdout.flush()?;
        if out.len() == max_tokens {
            break;
        }
        let pos = kv.computed_tokens(seq)?;
        kv.append_tokens(seq, &[next])?;
        kv.reserve(seq, 1)?;
        let table = kv.block_table(seq)?.to_vec();
        let logits =
            cpu.forward(&[SeqStep { tokens: &[next], start_pos: pos, block_table: &table, logits: true }])?;
        kv.commit(seq, 1)?;
        let history: Vec<u32> = ids.iter().chain(&out).copied().collect();
        next = sampler.sample(&logits[0], &history, &out).token;
    }
    writeln!(stdout, "{}", detok.finish(&m.text)?)?;
    let decode = t1.elapsed();
    let decoded = out.len().saturating_sub(1).max(1);
    eprintln!(
        "prefill: {} tokens in {:.1} ms ({:.1} tokens/s); decode: {} tokens in {:.1} ms ({:.1} tokens/s)",
        ids.len(),
        prefill.as_secs_f64() * 1e3,
        ids.len() as f64 / prefill.as_secs_f64(),
        out.len(),
        decode.as_secs_f64() * 1e3,
        decoded as f64 / decode.as_secs_f64()
    );
    Ok(())
}
