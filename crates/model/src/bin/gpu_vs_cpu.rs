//! `pdserve-gpu-vs-cpu --model DIR`: the GPU backend against the CPU
//! backend on the fixture prompts of tests/fixtures/reference.json (32 greedy tokens each).
//!
//! The CPU backend runs twice: with the weights as loaded (checked against the fixture's independent
//! reference) and with the same weights rounded to bf16, which is what the GPU stores; the GPU must
//! give that run's greedy tokens. The GPU also decodes all prompts in one batch after a chunked
//! prefill, which must give the same tokens as one prompt at a time. Exit status 1 on any mismatch.

use std::path::PathBuf;
use std::sync::Arc;

use pdserve_kvcache::{KvCache, KvConfig, SeqId};
use pdserve_model::{Backend, CpuBackend, GpuBackend, ModelFiles, SeqStep, Weights};

const FIXTURE: &str = include_str!("../../tests/fixtures/reference.json");
const GREEDY: usize = 32;

fn argmax(v: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &x) in v.iter().enumerate() {
        if x > v[best] {
            best = i;
        }
    }
    best as u32
}

/// Greedy decoding of several prompts through one backend: prefill in `chunks` pieces per prompt,
/// then decode all prompts together, `GREEDY` tokens each. Returns tokens and the first logits.
fn greedy(backend: &mut dyn Backend, prompts: &[Vec<u32>], chunks: usize) -> (Vec<Vec<u32>>, Vec<Vec<f32>>) {
    let layout = backend.kv_layout();
    let mut kv =
        KvCache::new(KvConfig { num_blocks: layout.num_blocks as u32, block_size: layout.block_size as u32 })
            .unwrap();
    let mut first = Vec::new();
    let mut last = Vec::new();
    for (i, p) in prompts.iter().enumerate() {
        let s = SeqId(i as u64);
        kv.add_sequence(s, p).unwrap();
        let step = p.len().div_ceil(chunks);
        let mut done = 0;
        let mut logits = Vec::new();
        while done < p.len() {
            let n = step.min(p.len() - done);
            kv.reserve(s, n).unwrap();
            let table = kv.block_table(s).unwrap().to_vec();
            let out = backend
                .forward(&[SeqStep {
                    tokens: &p[done..done + n],
                    start_pos: done,
                    block_table: &table,
                    logits: 1,
                    state: None,
                }])
                .unwrap();
            kv.commit(s, n).unwrap();
            done += n;
            logits = out.into_iter().next().unwrap();
        }
        first.push(logits.clone());
        last.push(argmax(&logits));
    }
    let mut out: Vec<Vec<u32>> = last.iter().map(|&t| vec![t]).collect();
    while out[0].len() < GREEDY {
        let mut tables = Vec::new();
        let mut toks = Vec::new();
        for (i, o) in out.iter().enumerate() {
            let s = SeqId(i as u64);
            let t = *o.last().unwrap();
            kv.append_tokens(s, &[t]).unwrap();
            kv.reserve(s, 1).unwrap();
            tables.push(kv.block_table(s).unwrap().to_vec());
            toks.push((t, kv.computed_tokens(s).unwrap()));
        }
        let steps: Vec<SeqStep<'_>> = toks
            .iter()
            .zip(&tables)
            .map(|((t, pos), table)| SeqStep {
                tokens: std::slice::from_ref(t),
                start_pos: *pos,
                block_table: table,
                logits: 1,
                state: None,
            })
            .collect();
        let logits = backend.forward(&steps).unwrap();
        for (i, l) in logits.iter().enumerate() {
            kv.commit(SeqId(i as u64), 1).unwrap();
            out[i].push(argmax(l));
        }
    }
    (out, first)
}

fn rounded(w: &Weights) -> Weights {
    let r = |v: &Vec<f32>| v.iter().map(|&x| half::bf16::from_f32(x).to_f32()).collect::<Vec<f32>>();
    let mut out = w.clone();
    out.embed = r(&w.embed);
    out.final_norm = r(&w.final_norm);
    out.lm_head = w.lm_head.as_ref().map(r);
    for l in &mut out.layers {
        for m in [
            &mut l.input_norm,
            &mut l.q,
            &mut l.k,
            &mut l.v,
            &mut l.o,
            &mut l.post_norm,
            &mut l.gate,
            &mut l.up,
            &mut l.down,
        ] {
            *m = r(m);
        }
    }
    out
}

fn main() -> std::process::ExitCode {
    let args: Vec<String> = std::env::args().collect();
    let arg = |name: &str| args.iter().position(|a| a == name).and_then(|i| args.get(i + 1)).cloned();
    let Some(dir) = arg("--model").map(PathBuf::from) else {
        eprintln!("usage: pdserve-gpu-vs-cpu --model DIR   (a Hugging Face folder; `cargo xtask test-gpu` passes the default model)");
        return std::process::ExitCode::from(2);
    };
    let m = ModelFiles::load(&dir).expect("load the model");
    let fx: serde_json::Value = serde_json::from_str(FIXTURE).unwrap();
    // Each fixture prompt's token ids under `key` ("ids": the prompt, "greedy": the reference answer).
    let field = |key: &str| -> Vec<Vec<u32>> {
        let ids = |v: &serde_json::Value| {
            v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
        };
        fx["prompts"].as_array().unwrap().iter().map(|p| ids(&p[key])).collect()
    };
    let (prompts, reference) = (field("ids"), field("greedy"));
    let (blocks, bs) = (64, 16);
    let mut ok = true;

    let mut cpu = CpuBackend::new(m.config.clone(), Arc::new(m.weights.clone()), blocks, bs);
    let mut cpu_f32 = Vec::new();
    for p in &prompts {
        cpu_f32.push(greedy(&mut cpu, std::slice::from_ref(p), 1).0.remove(0));
    }
    let agree = cpu_f32.iter().zip(&reference).filter(|(a, b)| a == b).count();
    println!("CPU f32 weights vs the fixture's reference: {agree}/{} prompts equal", prompts.len());

    let wb = rounded(&m.weights);
    let mut cpu_b = CpuBackend::new(m.config.clone(), Arc::new(wb.clone()), blocks, bs);
    let mut gpu = match GpuBackend::new(m.config.clone(), &wb, blocks, bs, 0) {
        Ok(g) => g,
        Err(e) => {
            eprintln!("error: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    println!("GPU: {:?}", gpu.gpu());
    for (i, p) in prompts.iter().enumerate() {
        let (want, cl) = greedy(&mut cpu_b, std::slice::from_ref(p), 1);
        let (got, gl) = greedy(&mut gpu, std::slice::from_ref(p), 1);
        let diff = cl[0].iter().zip(&gl[0]).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
        let same = want[0] == got[0];
        let first_diff = want[0].iter().zip(&got[0]).position(|(a, b)| a != b);
        println!(
            "prompt {i} ({} tokens): GPU greedy == CPU(bf16 weights) greedy: {same} {}; max |logit diff| at the prompt's end {diff:.4}; CPU f32 == CPU bf16: {}",
            p.len(),
            first_diff.map(|d| format!("(first difference at token {d})")).unwrap_or_default(),
            cpu_f32[i] == want[0]
        );
        ok &= same;
    }
    let singles: Vec<Vec<u32>> =
        prompts.iter().map(|p| greedy(&mut gpu, std::slice::from_ref(p), 1).0.remove(0)).collect();
    let (batched, _) = greedy(&mut gpu, &prompts, 3);
    let same = batched == singles;
    println!("GPU: chunked prefill (3 chunks) + batched decode of all prompts == one at a time: {same}");
    ok &= same;
    println!("{}", if ok { "PASS" } else { "FAIL" });
    if ok {
        std::process::ExitCode::SUCCESS
    } else {
        std::process::ExitCode::FAILURE
    }
}
