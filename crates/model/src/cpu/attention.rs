//! KV memory (its element types and views) and attention over it: decode rows as flash-decoding
//! splits, prefill chunks as GEMMs over K and V gathered out of the paged cache.

use rayon::prelude::*;

use super::{gemm_xwt, sized, CpuBackend};
use crate::backend::{KvDtype, KvStore, SeqStep};
use crate::sys::{
    as_f32, as_f32_mut, as_u16, as_u16_mut, exp_scaled, f32_bytes, f32_bytes_mut, group_scores,
    group_scores_f16, group_weighted_sum, group_weighted_sum_f16, narrow_bf16, narrow_f16, prefetch,
    sgemm_nn, softmax_masked, widen_bf16, widen_f16, CpuKernels,
};

/// Where the KV memory lives: this backend's own heap (f32 words from a page boundary on, so every
/// block starts where a mapping's would), or a store it was given (shared memory a same-host decode
/// worker reads, say).
#[derive(Debug)]
pub(super) enum KvMemory {
    /// The pool is `words[start..start + len]`: `start` puts it on a page boundary.
    Heap {
        words: Vec<f32>,
        start: usize,
        len: usize,
    },
    Store(Box<dyn KvStore>),
}

/// The heap pool's alignment. A block copied in from a transfer (out of a page-aligned shared
/// region, or a receive buffer) runs about a third slower into a destination 16 bytes off a cache
/// line than into an aligned one (`rep movsb` on this machine: 15 against 21 GB/s), and a heap
/// allocation this size starts 16 bytes into its mapping.
const HEAP_ALIGN: usize = 4096;

impl KvMemory {
    /// A zeroed pool of `bytes`, resident from the start: every page is touched now, so no request
    /// pays the page faults of the blocks it is the first to use (a 2,048-token transfer into fresh
    /// pages took five times as long as into resident ones).
    pub(super) fn heap(bytes: usize) -> KvMemory {
        let (len, slack) = (bytes.div_ceil(4), HEAP_ALIGN / 4);
        let mut words = vec![0.0f32; len + slack];
        let start = (HEAP_ALIGN - words.as_ptr() as usize % HEAP_ALIGN) % HEAP_ALIGN / 4;
        // One store per 4 KiB page; the value is opaque to the compiler, so the store stays.
        for i in (0..words.len()).step_by(1024) {
            words[i] = std::hint::black_box(0.0);
        }
        KvMemory::Heap { words, start, len }
    }

    pub(super) fn bytes(&self) -> &[u8] {
        match self {
            KvMemory::Heap { words, start, len } => f32_bytes(&words[*start..*start + *len]),
            KvMemory::Store(s) => s.bytes(),
        }
    }

    pub(super) fn bytes_mut(&mut self) -> &mut [u8] {
        match self {
            KvMemory::Heap { words, start, len } => f32_bytes_mut(&mut words[*start..*start + *len]),
            KvMemory::Store(s) => s.bytes_mut(),
        }
    }

    fn values(&self, dtype: KvDtype) -> KvValues<'_> {
        match dtype {
            KvDtype::F32 => KvValues::F32(as_f32(self.bytes())),
            KvDtype::F16 => KvValues::F16(as_u16(self.bytes())),
            KvDtype::Bf16 => KvValues::Bf16(as_u16(self.bytes())),
        }
    }

    /// Stores f32 values at value index `at`, rounded to `dtype`.
    pub(super) fn store(&mut self, dtype: KvDtype, at: usize, src: &[f32]) {
        let n = src.len();
        match dtype {
            KvDtype::F32 => as_f32_mut(self.bytes_mut())[at..at + n].copy_from_slice(src),
            KvDtype::F16 => narrow_f16(src, &mut as_u16_mut(self.bytes_mut())[at..at + n]),
            KvDtype::Bf16 => narrow_bf16(src, &mut as_u16_mut(self.bytes_mut())[at..at + n]),
        }
    }
}

/// KV memory as its dtype's values.
#[derive(Clone, Copy)]
enum KvValues<'a> {
    F32(&'a [f32]),
    F16(&'a [u16]),
    Bf16(&'a [u16]),
}

impl KvValues<'_> {
    /// `dst.len()` values from value index `at`, as f32.
    fn read_into(&self, at: usize, dst: &mut [f32]) {
        let n = dst.len();
        match *self {
            KvValues::F32(v) => dst.copy_from_slice(&v[at..at + n]),
            KvValues::F16(v) => widen_f16(&v[at..at + n], dst),
            KvValues::Bf16(v) => widen_bf16(&v[at..at + n], dst),
        }
    }

    /// Prefetches `len` values from value index `at` (see `sys::prefetch`).
    fn prefetch(&self, at: usize, len: usize) {
        match *self {
            KvValues::F32(v) => prefetch(&v[at..at + len]),
            KvValues::F16(v) | KvValues::Bf16(v) => prefetch(&v[at..at + len]),
        }
    }

    /// `len` values from value index `at` as f32: borrowed where the memory is f32, widened into `buf`
    /// where not.
    fn f32s<'b>(&'b self, at: usize, len: usize, buf: &'b mut Vec<f32>) -> &'b [f32] {
        match *self {
            KvValues::F32(v) => &v[at..at + len],
            _ => {
                let dst = sized(buf, len);
                self.read_into(at, dst);
                dst
            }
        }
    }
}

/// Keys per split of a decode row's attention: long contexts are cut into splits that run in
/// parallel and are merged by their maxima and sums (flash-decoding), so one sequence's attention
/// uses every core.
const DECODE_SPLIT_KEYS: usize = 512;

/// One split's share of a decode row's attention, per query head: the largest score, the sum of
/// exp(score - largest), and the values weighted by those exps.
struct Partial {
    max: Vec<f32>,
    sum: Vec<f32>,
    acc: Vec<f32>,
}

impl CpuBackend {
    /// Attention of single-token rows (`decode_rows`, each reading its sequence's whole paged
    /// cache): tasks of (row, split of the keys) read each position's K and V rows once, whole (every
    /// KV head, contiguous within a block), score every query head against its KV head's key, and
    /// are merged per (row, head) into `attn`.
    pub(super) fn decode_attention(
        &self,
        steps: &[SeqStep<'_>],
        rows: &[(usize, usize)],
        decode_rows: &[usize],
        li: usize,
        (qkv, ldq): (&[f32], usize),
        attn: &mut [f32],
    ) {
        let (hd, nh, nkv, bs) =
            (self.cfg.head_dim, self.cfg.num_heads, self.cfg.num_kv_heads, self.layout.block_size);
        let (group, q_dim, stride) = (nh / nkv, nh * hd, nkv * hd);
        let scale = 1.0 / (hd as f32).sqrt();
        let kv_mem = self.kv.values(self.layout.dtype);
        // (row, first key, end key)
        let mut tasks = Vec::new();
        for &r in decode_rows {
            let ctx = rows[r].1 + 1;
            // A sliding window's row sees only its last `window` positions.
            let first = self.cfg.sliding_window.map_or(0, |w| ctx.saturating_sub(w));
            let keys = ctx - first;
            let splits = keys.div_ceil(DECODE_SPLIT_KEYS);
            tasks.extend(
                (0..splits).map(|sp| (r, first + sp * keys / splits, first + (sp + 1) * keys / splits)),
            );
        }
        let partials: Vec<Partial> = tasks
            .par_iter()
            .map(|&(r, j0, j1)| {
                let table = steps[rows[r].0].block_table;
                let q: Vec<f32> = qkv[r * ldq..][..q_dim].iter().map(|v| v * scale).collect();
                let n = j1 - j0;
                let mut part = Partial { max: vec![0.0; nh], sum: vec![0.0; nh], acc: vec![0.0; q_dim] };
                SCORES.with_borrow_mut(|scores| {
                    WIDE.with_borrow_mut(|wide| {
                        let scores = sized(scores, nh * n);
                        // Positions block by block: within a block, one position's K (or V) row of every
                        // KV head is `stride` floats long and the next position's follows it.
                        // (offset in this task's keys, block, position in the block, positions).
                        let runs = || {
                            let starts = std::iter::successors(Some(j0), |&j| Some((j / bs + 1) * bs));
                            starts
                                .take_while(|&j| j < j1)
                                .map(|j| (j - j0, table[j / bs], j % bs, (bs - j % bs).min(j1 - j)))
                        };
                        for (at, block, off, cnt) in runs() {
                            // The values of these positions, read after every key: on their way to
                            // L2 while the keys are scored.
                            kv_mem.prefetch(self.kv_at(block, li, 1, off), cnt * stride);
                            let (k_at, len) = (self.kv_at(block, li, 0, off), cnt * stride);
                            if let KvValues::F16(k) = kv_mem {
                                let rows = (&k[k_at..k_at + len], stride);
                                if group_scores_f16(&q, (hd, group), rows, cnt, (&mut scores[at..], n)) {
                                    continue;
                                }
                            }
                            let k = kv_mem.f32s(k_at, len, wide);
                            group_scores(&q, (hd, group), (k, stride), cnt, (&mut scores[at..], n));
                        }
                        for (h, row) in scores.chunks_exact_mut(n).enumerate() {
                            let max = row.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
                            part.max[h] = max;
                            part.sum[h] = exp_scaled(row, 1.0, max);
                        }
                        for (at, block, off, cnt) in runs() {
                            let (v_at, len) = (self.kv_at(block, li, 1, off), cnt * stride);
                            if let KvValues::F16(v) = kv_mem {
                                let rows = (&v[v_at..v_at + len], stride);
                                let p = (&scores[at..], n);
                                if group_weighted_sum_f16(p, (hd, group), rows, cnt, &mut part.acc) {
                                    continue;
                                }
                            }
                            let v = kv_mem.f32s(v_at, len, wide);
                            group_weighted_sum(
                                (&scores[at..], n),
                                (hd, group),
                                (v, stride),
                                cnt,
                                &mut part.acc,
                            );
                        }
                    })
                });
                part
            })
            .collect();
        // Merge each row's splits, which are consecutive in `tasks`.
        let mut i = 0;
        while i < tasks.len() {
            let r = tasks[i].0;
            let end = i + tasks[i..].iter().take_while(|t| t.0 == r).count();
            for head in 0..nh {
                let max = partials[i..end].iter().fold(f32::NEG_INFINITY, |m, p| m.max(p.max[head]));
                let out = &mut attn[r * q_dim + head * hd..][..hd];
                out.fill(0.0);
                let mut sum = 0.0;
                for p in &partials[i..end] {
                    let w = (p.max[head] - max).exp();
                    sum += p.sum[head] * w;
                    for (o, a) in out.iter_mut().zip(&p.acc[head * hd..(head + 1) * hd]) {
                        *o += a * w;
                    }
                }
                for o in out.iter_mut() {
                    *o /= sum;
                }
            }
            i = end;
        }
    }
}

thread_local! {
    /// An attention task's scores, reused by each pool thread: a GEMM-attention task's 64 rows by
    /// the keys they see, or a decode task's heads by its (at most 512) keys.
    static SCORES: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
    /// A decode task's K or V rows of one block, widened to f32 when the KV memory is 16-bit.
    static WIDE: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

impl CpuBackend {
    /// Attention for one sequence's step of `n` new tokens (`q` and `out`: n rows of all heads) as
    /// GEMMs: K and V^T of each KV head are gathered once out of the paged cache, then each (head,
    /// block of 64 query rows) task computes scores against only the keys its last row sees (the
    /// causal triangle, not the square), a masked softmax, and probabilities times values. With
    /// AVX2 or AVX-512 kernels the products read their operands where they lie ([`sgemm_nn`], the
    /// same values on both): the queries in `q`, K gathered transposed and V as it is; on the
    /// portable path K as it is and V transposed, as [`gemm_xwt`] takes them. (AVX-512 took
    /// `gemm_xwt`'s dot products until 2026-12-04: a warm 1,000-token prefill is 3-7% faster
    /// without them on a Zen 4 host.)
    pub(super) fn gemm_attention(
        &self,
        s: &SeqStep<'_>,
        li: usize,
        (q, ldq): (&[f32], usize),
        out: &mut [f32],
        gathered: &mut Vec<(Vec<f32>, Vec<f32>)>,
    ) {
        const ROW_BLOCK: usize = 64;
        let (hd, nh, nkv) = (self.cfg.head_dim, self.cfg.num_heads, self.cfg.num_kv_heads);
        let (q_dim, group, bs) = (nh * hd, nh / nkv, self.layout.block_size);
        let n = s.tokens.len();
        let ctx = s.start_pos + n;
        // Padded to the AVX-512 kernel's 32 columns; the padding's keys and values are zero and its
        // scores are masked like the future.
        let ctx_p = ctx.next_multiple_of(32);
        let kv_mem = self.kv.values(self.layout.dtype);
        let nn = crate::sys::cpu_kernels() >= CpuKernels::Avx2 && hd.is_multiple_of(16);
        // K transposed: rows of `ctx_p` positions and 16 more, so that rows 4 KiB apart (a 1,024-position
        // context) do not all fall in the same L1 sets as the product walks down a column of them
        // (a fifth slower there).
        let ldk = ctx_p + 16;
        gathered.resize_with(nkv, Default::default);
        gathered.par_iter_mut().enumerate().for_each(|(kvh, (kh, vt))| {
            // Zeroed: the padding past `ctx` must hold zeros, not a previous step's values.
            kh.clear();
            kh.resize(if nn { hd * ldk } else { ctx_p * hd }, 0.0);
            vt.clear();
            vt.resize(hd * ctx_p, 0.0);
            let (mut k_row, mut v_row) = (vec![0.0; hd], vec![0.0; hd]);
            // With a sliding window, no row of the step sees a position before the first row's window
            // (its blocks may be given back); those keys stay zero and are masked below.
            let first = self.cfg.sliding_window.map_or(0, |w| (s.start_pos + 1).saturating_sub(w));
            for j in first..ctx {
                let b = s.block_table[j / bs];
                let ki = self.kv_at(b, li, 0, j % bs) + kvh * hd;
                let vi = self.kv_at(b, li, 1, j % bs) + kvh * hd;
                if nn {
                    // `kh` holds K transposed and `vt` V as it is.
                    kv_mem.read_into(ki, &mut k_row);
                    kv_mem.read_into(vi, &mut vt[j * hd..(j + 1) * hd]);
                    for (d, &k) in k_row.iter().enumerate() {
                        kh[d * ldk + j] = k;
                    }
                    continue;
                }
                kv_mem.read_into(ki, &mut kh[j * hd..(j + 1) * hd]);
                kv_mem.read_into(vi, &mut v_row);
                for (d, &v) in v_row.iter().enumerate() {
                    vt[d * ctx_p + j] = v;
                }
            }
        });
        let gathered = &*gathered;
        let scale = 1.0 / (hd as f32).sqrt();
        let window = self.cfg.sliding_window;
        let blocks = n.div_ceil(ROW_BLOCK);
        let results: Vec<(usize, usize, Vec<f32>)> = (0..nh * blocks)
            .into_par_iter()
            .map(|task| {
                let (head, b) = (task / blocks, task % blocks);
                let (i0, i1) = (b * ROW_BLOCK, ((b + 1) * ROW_BLOCK).min(n));
                let rows = i1 - i0;
                let seen = (s.start_pos + i1).next_multiple_of(32);
                let (kh, vt) = &gathered[head / group];
                let mut o = vec![0.0; rows * hd];
                SCORES.with_borrow_mut(|scores| {
                    let scores = sized(scores, rows * seen);
                    let qh = (&q[i0 * ldq + head * hd..], ldq);
                    if nn {
                        // (It runs: AVX2 kernels, `seen` a multiple of 32.)
                        assert!(sgemm_nn(qh, rows, hd, (kh, ldk), seen, scores));
                    } else {
                        gemm_xwt(qh, rows, hd, (kh, hd), seen, scores);
                    }
                    for (i, row) in scores.chunks_exact_mut(seen).enumerate() {
                        let visible = s.start_pos + i0 + i + 1;
                        if let Some(w) = window {
                            // Positions before the sliding window weigh nothing.
                            row[..visible.saturating_sub(w)].fill(f32::NEG_INFINITY);
                        }
                        softmax_masked(row, visible, scale);
                    }
                    if nn {
                        // (It runs: AVX2 kernels, `hd` a multiple of 16.)
                        assert!(sgemm_nn((scores, seen), rows, seen, (vt, hd), hd, &mut o));
                    } else {
                        gemm_xwt((scores, seen), rows, seen, (vt, ctx_p), hd, &mut o);
                    }
                });
                (head, i0, o)
            })
            .collect();
        for (head, i0, o) in results {
            for (i, src) in o.chunks_exact(hd).enumerate() {
                out[(i0 + i) * q_dim + head * hd..][..hd].copy_from_slice(src);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_heap_pool_starts_on_a_page_and_holds_every_byte_asked_for() {
        for bytes in [4, 368_640, 5 * 368_640 + 4] {
            let mut m = KvMemory::heap(bytes);
            assert_eq!(m.bytes().as_ptr() as usize % HEAP_ALIGN, 0);
            assert_eq!(m.bytes().len(), bytes);
            assert!(m.bytes().iter().all(|&b| b == 0));
            m.bytes_mut()[bytes - 1] = 7;
            assert_eq!(m.bytes()[bytes - 1], 7);
        }
    }
}
