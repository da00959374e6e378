//! DeepSeek V4 (`DeepseekV4ForCausalLM`) against the independent numpy reference
//! (`fixtures/deepseek_v4_reference.py`, written from transformers' `deepseek_v4` model): a seeded tiny
//! checkpoint in the real tensor layout (layers: sliding, sliding, compressed sparse at 4 with its
//! indexer, heavily compressed at 16; a window of 16, `index_topk` 8, 4 residual streams, hash-routed
//! first layers), greedy tokens and log-probs on a short prompt, a ~300-token one (it slides,
//! compresses and selects) and a ~3,000-token one.

use std::path::{Path, PathBuf};
use std::process::Command;

use pdserve_model::{DeepseekV4, V4Config, V4Layer};
use serde_json::Value;

fn script(args: &[&str]) -> Vec<u8> {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/deepseek_v4_reference.py");
    let out = Command::new(std::env::var("PYTHON").unwrap_or_else(|_| "python3".into()))
        .arg(&script)
        .args(args)
        .output()
        .expect("python3 (with numpy) runs");
    assert!(out.status.success(), "{args:?}: {}", String::from_utf8_lossy(&out.stderr));
    out.stdout
}

fn checkpoint(name: &str, overrides: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("pdserve-v4-{name}-{}", std::process::id()));
    script(&["write", dir.to_str().unwrap(), overrides]);
    dir
}

/// Seeded prompt ids below the tiny vocabulary.
fn prompt(len: usize, seed: u64) -> Vec<u32> {
    let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..len)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s % 128) as u32
        })
        .collect()
}

fn log_softmax(logits: &[f32], i: usize) -> f32 {
    let max = logits.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
    let sum: f32 = logits.iter().map(|&v| (v - max).exp()).sum();
    logits[i] - max - sum.ln()
}

fn argmax(v: &[f32]) -> usize {
    (0..v.len()).fold(0, |b, i| if v[i] > v[b] { i } else { b })
}

/// Our prompt logits, greedy tokens and their log-probs.
fn ours(model: &DeepseekV4, ids: &[u32], steps: usize) -> (Vec<f32>, Vec<u32>, Vec<f32>) {
    let mut state = model.new_state();
    let first = model.forward(&mut state, ids).unwrap();
    let (mut logits, mut greedy, mut logprobs) = (first.clone(), Vec::new(), Vec::new());
    for step in 0..steps {
        let next = argmax(&logits);
        greedy.push(next as u32);
        logprobs.push(log_softmax(&logits, next));
        if step + 1 < steps {
            logits = model.forward(&mut state, &[next as u32]).unwrap();
        }
    }
    (first, greedy, logprobs)
}

fn compare(dir: &Path, model: &DeepseekV4, ids: &[u32], steps: usize, what: &str) {
    let ids_json = serde_json::to_string(ids).unwrap();
    let out: Value =
        serde_json::from_slice(&script(&["run", dir.to_str().unwrap(), &ids_json, &steps.to_string()]))
            .unwrap();
    let floats = |k: &str| -> Vec<f32> {
        out[k].as_array().unwrap().iter().map(|v| v.as_f64().unwrap() as f32).collect()
    };
    let (want_logits, want_logprobs) = (floats("logits"), floats("logprobs"));
    let want_greedy: Vec<u32> =
        out["greedy"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect();
    let (logits, greedy, logprobs) = ours(model, ids, steps);
    let d = logits.iter().zip(&want_logits).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
    let lp = logprobs.iter().zip(&want_logprobs).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
    eprintln!("{what}: logits within {d}, log-probs within {lp}, greedy {greedy:?}");
    assert!(d < 1e-4, "{what}: prompt logits differ from the reference by {d}");
    assert_eq!(greedy, want_greedy, "{what}: greedy tokens");
    assert!(lp < 1e-4, "{what}: log-probs differ by {lp}");
}

#[test]
fn deepseek_v4_matches_the_numpy_reference() {
    let dir = checkpoint("tiny", "{}");
    let text = std::fs::read_to_string(dir.join("config.json")).unwrap();
    assert!(V4Config::is_v4(&text));
    let model = DeepseekV4::load(&dir).unwrap();
    let c = model.config();
    assert_eq!(
        c.kinds,
        [
            V4Layer::Sliding,
            V4Layer::Sliding,
            V4Layer::CompressedSparse,
            V4Layer::HeavilyCompressed { ratio: 16 },
            V4Layer::Sliding
        ]
    );
    compare(&dir, &model, &prompt(20, 1), 8, "20-token prompt");
    let long = prompt(300, 2);
    compare(&dir, &model, &long, 8, "300-token prompt");
    // It slid, compressed and selected: 75 rows at ratio 4 (8 chosen per query), 18 at 16, and a
    // window of 16 rows whatever the length.
    let mut state = model.new_state();
    model.forward(&mut state, &long).unwrap();
    assert_eq!((state.compressed_rows(2), state.compressed_rows(3)), (75, 18));
    // Prefilled in chunks (any split), or a token at a time (every step one token through every
    // layer, the hash-routed ones included), the same bits as the whole prompt run layer by layer.
    let mut whole = model.new_state();
    let want = model.forward(&mut whole, &long).unwrap();
    let mut chunked = model.new_state();
    model.forward(&mut chunked, &long[..123]).unwrap();
    assert_eq!(model.forward(&mut chunked, &long[123..]).unwrap(), want);
    let mut single = model.new_state();
    let mut last = Vec::new();
    for &id in &long {
        last = model.forward(&mut single, &[id]).unwrap();
    }
    assert_eq!(last, want, "a token at a time");
    compare(&dir, &model, &prompt(3000, 3), 4, "3,000-token prompt");
    // The indexer's choice matters: the same weights attending to every compressed row answer
    // otherwise, so the comparison above tells sparse from dense.
    let mut dense: Value = serde_json::from_str(&text).unwrap();
    dense["index_topk"] = 10_000.into();
    std::fs::write(dir.join("config.json"), dense.to_string()).unwrap();
    let all_rows = ours(&DeepseekV4::load(&dir).unwrap(), &long, 1).0;
    let sparse = ours(&model, &long, 1).0;
    let d = all_rows.iter().zip(&sparse).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
    assert!(d > 1e-2, "the indexer's selection changed nothing ({d})");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The weights as V4 ships them: dense projections in FP8 (e4m3, a ue8m0 power of two per 32 x 32
/// block here, 128 x 128 in the release), routed experts in MXFP4 (e2m1 codes two a byte, a ue8m0
/// scale per 32 columns), both under DeepSeek's `stem.scale` names: the same answers as the reference
/// reading them, which differ from the unrounded checkpoint's.
#[test]
fn a_v4_checkpoint_as_shipped_fp8_and_mxfp4_matches_the_reference() {
    let dir = checkpoint("shipped", r#"{"as_shipped": true}"#);
    let model = DeepseekV4::load(&dir).unwrap();
    assert_eq!(model.config().fp8_block, Some([32, 32]));
    let ids = prompt(300, 5);
    compare(&dir, &model, &ids, 4, "FP8 + MXFP4, 300 tokens");
    let plain = checkpoint("unrounded", "{}");
    let plain_model = DeepseekV4::load(&plain).unwrap();
    let unrounded = ours(&plain_model, &ids, 1).0;
    let shipped = ours(&model, &ids, 1).0;
    // Held as shipped: FP8 codes a byte and MXFP4 codes half a byte, against bf16's two.
    let (held, bf16) = (model.weight_bytes(), plain_model.weight_bytes());
    // (The hyper-connections, norms and embedding stay f32 in both; read into f32, the FP8 and
    // MXFP4 values would take twice bf16's bytes.)
    assert!((held as f64) < 0.6 * bf16 as f64, "held as shipped {held} bytes, bf16 {bf16}");
    let d = unrounded.iter().zip(&shipped).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
    assert!(d > 1e-3, "the rounding changed nothing ({d}): not read as FP8 / MXFP4?");
    std::fs::remove_dir_all(&dir).unwrap();
    std::fs::remove_dir_all(&plain).unwrap();
}

/// The multi-token prediction layer drafts as the reference's: after the prompt and after each greedy
/// step, its guess at the token after next given the token just chosen, and one more chained on.
#[test]
fn the_v4_mtp_layer_drafts_as_the_reference_does() {
    let dir = checkpoint("mtp", "{}");
    let model = DeepseekV4::load(&dir).unwrap();
    assert!(model.has_draft());
    let (ids, steps, guesses) = (prompt(40, 4), 4, 2);
    let ids_json = serde_json::to_string(&ids).unwrap();
    let out: Value = serde_json::from_slice(&script(&[
        "mtp",
        dir.to_str().unwrap(),
        &ids_json,
        &steps.to_string(),
        &guesses.to_string(),
    ]))
    .unwrap();
    let want: Vec<Vec<f32>> = out["drafts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d.as_array().unwrap().iter().map(|v| v.as_f64().unwrap() as f32).collect())
        .collect();
    // (A state made without drafting keeps no streams and refuses to draft.)
    let mut plain = model.new_state();
    model.forward(&mut plain, &ids).unwrap();
    assert!(model.draft(&mut plain, &ids[1..], 1).is_err());
    let mut state = model.new_drafting_state().unwrap();
    let mut logits = model.forward(&mut state, &ids).unwrap();
    let (mut greedy, mut drafts) = (Vec::new(), Vec::new());
    for step in 0..steps {
        let next = argmax(&logits) as u32;
        greedy.push(next);
        // The positions since the last draft, each with the token after it.
        let after: Vec<u32> =
            if step == 0 { ids[1..].iter().copied().chain([next]).collect() } else { vec![next] };
        drafts.extend(model.draft(&mut state, &after, guesses).unwrap());
        logits = model.forward(&mut state, &[next]).unwrap();
    }
    let want_greedy: Vec<u32> =
        out["greedy"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect();
    assert_eq!(greedy, want_greedy);
    assert_eq!(drafts.len(), want.len());
    for (i, (a, b)) in drafts.iter().zip(&want).enumerate() {
        let d = a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max);
        assert!(d < 1e-4, "draft {i}: logits differ from the reference by {d}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// What the engine cannot follow is refused by name.
#[test]
fn a_v4_config_that_does_not_fit_is_refused() {
    let dir = checkpoint("refused", "{}");
    let text = std::fs::read_to_string(dir.join("config.json")).unwrap();
    let mut v: Value = serde_json::from_str(&text).unwrap();
    v["scoring_func"] = "softmax".into();
    let e = V4Config::from_json(&v.to_string()).unwrap_err().to_string();
    assert!(e.contains("scoring_func"), "{e}");
    // A token past the vocabulary is refused before anything runs.
    let model = DeepseekV4::load(&dir).unwrap();
    let mut state = model.new_state();
    assert!(model.forward(&mut state, &[1, 2, 500]).is_err());
    assert_eq!(state.tokens, 0);
    v["scoring_func"] = "sqrtsoftplus".into();
    v["num_key_value_heads"] = 2.into();
    assert!(V4Config::from_json(&v.to_string()).unwrap_err().to_string().contains("num_key_value_heads"));
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Served: `V4Backend`'s batch steps in the compact layout (compressed rows in blocks, windows and
/// partial groups in a state slot per request) compute what the one-request model does, to the bit:
/// two requests batched, prefilled in chunks that cut groups anywhere, drafting; a state saved two
/// positions past a block boundary serving as the restore point of a prefix hit at that boundary; a
/// request moved as its blocks and its state's blocks (the partial last block copied on write); a
/// verify step whose draft tokens are rejected and recomputed (the state cut back).
#[test]
fn the_served_backend_computes_what_the_model_does() {
    use std::sync::Arc;

    use pdserve_kvcache::{BlockCopy, BlockId};
    use pdserve_model::{Backend, DraftStep, KvDtype, ModelConfig, SeqStep, V4Backend};

    let dir = checkpoint("compact", "{}");
    let cfg = ModelConfig::from_file(&dir.join("config.json")).unwrap();
    let model = Arc::new(DeepseekV4::load(&dir).unwrap());
    const BLOCK: usize = 16;
    // Slots: A 0, B 1, C 2, D 3, the restore point 4; cut back at most 4 positions.
    let mut b = V4Backend::new(model.clone(), cfg.clone(), (96, BLOCK), KvDtype::F32, (5, 4), None).unwrap();
    let (layout, state) = (b.kv_layout(), b.kv_state().expect("a state per request"));
    assert_eq!((state.first, state.slots, layout.num_blocks), (96, 5, 96 + 5 * state.blocks));
    // Its blocks: the compressed sparse layer's rows (32 values per 4 tokens) and keys (16 per 4),
    // the heavily compressed layer's (32 per 16): 14 values per token (a row per position and layer
    // of each layer's window row, compressor inputs and rows would be 5 x 272).
    assert_eq!(layout.bytes_per_token(), 14 * 4);
    let groups = b.group_bytes_per_token();
    assert_eq!(groups, [("c4".to_owned(), 32.0), ("c4-index".to_owned(), 16.0), ("c16".to_owned(), 8.0)]);
    let leak = |v: Vec<u32>| -> &'static [u32] { Vec::leak(v) };
    let table = |first: u32| -> &'static [BlockId] { Vec::leak((first..first + 24).map(BlockId).collect()) };
    let (ta, tb) = (table(0), table(24));
    let step = |tokens: &'static [u32], start_pos: usize, block_table: &'static [BlockId], slot: u32| {
        SeqStep { tokens, start_pos, block_table, logits: 1, state: Some(slot) }
    };
    let (a, bp) = (prompt(300, 11), prompt(77, 12));
    let reference = |ids: &[u32], steps: usize| -> Vec<Vec<f32>> {
        let mut state = model.new_state();
        let mut out = vec![model.forward(&mut state, ids).unwrap()];
        while out.len() < steps {
            let next = argmax(out.last().unwrap()) as u32;
            out.push(model.forward(&mut state, &[next]).unwrap());
        }
        out
    };
    let (want_a, want_b) = (reference(&a, 4), reference(&bp, 4));
    let mut drafting = model.new_drafting_state().unwrap();
    model.forward(&mut drafting, &a[..130]).unwrap();
    let want_draft = model.draft(&mut drafting, &a[1..=130], 1).unwrap();
    // A state with no slot, or a table reaching into the state's blocks, is refused.
    assert!(b.forward(&[SeqStep { state: None, ..step(leak(a[..4].to_vec()), 0, ta, 0) }]).is_err());
    let into_states: &'static [BlockId] = Vec::leak(vec![BlockId(96)]);
    assert!(b.forward(&[step(leak(a[..4].to_vec()), 0, into_states, 0)]).is_err());
    // Chunks: A 0..130 with B 0..50, A's drafts, then the rest of both.
    b.forward(&[step(leak(a[..130].to_vec()), 0, ta, 0), step(leak(bp[..50].to_vec()), 0, tb, 1)]).unwrap();
    let draft = DraftStep { step: 0, next: leak(a[1..=130].to_vec()), block_table: ta, guesses: 1 };
    assert_eq!(b.draft(&[draft]).unwrap(), want_draft, "a draft over the state's ring");
    // A's state at 130 saved as the restore point of the boundary at 128.
    let copy = |from: u32, to: u32| -> Vec<BlockCopy> {
        state
            .slot_blocks(from)
            .zip(state.slot_blocks(to))
            .map(|(src, dst)| BlockCopy { src, dst, tokens: BLOCK })
            .collect()
    };
    b.copy_blocks(&copy(0, 4)).unwrap();
    let out = b
        .forward(&[step(leak(a[130..].to_vec()), 130, ta, 0), step(leak(bp[50..].to_vec()), 50, tb, 1)])
        .unwrap();
    assert_eq!((&out[0], &out[1]), (&want_a[0], &want_b[0]), "prefill over the compact layout");
    // D: A's 19 blocks and its state as bytes, as a transfer moves them.
    let td = table(72);
    let mut bytes = vec![0u8; layout.block_bytes()];
    let moved = ta[..18].iter().copied().zip(td.iter().copied());
    for (src, dst) in moved.chain(state.slot_blocks(0).zip(state.slot_blocks(3))) {
        b.read_block(src, &mut bytes).unwrap();
        b.write_block(dst, &bytes).unwrap();
    }
    b.copy_blocks(&[BlockCopy { src: ta[18], dst: td[18], tokens: 12 }]).unwrap();
    // A draft pass reads rows of the pass before it: none past a step's own.
    let beyond = DraftStep { step: 1, next: leak(prompt(30, 5)), block_table: tb, guesses: 1 };
    assert!(b.draft(&[beyond]).is_err());
    // A decodes; its first step verifies two wrong draft tokens, cut back and computed again.
    let mut la = out[0].clone();
    for (i, want) in want_a.iter().enumerate().skip(1) {
        let next = argmax(&la) as u32;
        if i == 1 {
            let wrong = [next, (next + 1) % 128, (next + 2) % 128];
            let mut s = step(leak(wrong.to_vec()), 300, ta, 0);
            s.logits = 3;
            let rows = b.forward(&[s]).unwrap();
            assert_eq!(&rows[0], want, "the verified row");
        }
        let out = b.forward(&[step(leak(vec![next]), 299 + i, ta, 0)]).unwrap();
        assert_eq!(&out[0], want, "decode step {i}");
        la = out[0].clone();
    }
    // C: a prefix hit of A's first 8 blocks resumed from the restore point.
    let tc: &'static [BlockId] = Vec::leak([&ta[..8], &table(48)[8..]].concat());
    b.copy_blocks(&copy(4, 2)).unwrap();
    let out = b.forward(&[step(leak(a[128..].to_vec()), 128, tc, 2)]).unwrap();
    assert_eq!(out[0], want_a[0], "after a prefix hit of 128 positions");
    // D decodes from the moved blocks and state as A did.
    let mut ld = want_a[0].clone();
    for (i, want) in want_a.iter().enumerate().skip(1) {
        let out = b.forward(&[step(leak(vec![argmax(&ld) as u32]), 299 + i, td, 3)]).unwrap();
        assert_eq!(&out[0], want, "decode step {i} after a transfer");
        ld = out[0].clone();
    }
    // A block size that is not a multiple of every ratio is refused by name.
    let e = V4Backend::new(model.clone(), cfg, (8, 8), KvDtype::F32, (1, 0), None).unwrap_err().to_string();
    assert!(e.contains("block size"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}
