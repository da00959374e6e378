//! KV memory (its element types and views) and attention over it: every row as flash-decoding
//! splits fixed in absolute positions, a sequence's consecutive rows sharing each K and V read.

use rayon::prelude::*;

use super::{sized, CpuBackend};
use pdserve_kvcache::{BlockCopy, BlockId};

use crate::backend::{check_block, KvDtype, KvLayout, KvStore, SeqStep};
use crate::sys::{
    as_f32, as_f32_mut, as_u16, as_u16_mut, exp_scaled, f32_bytes, f32_bytes_mut, group_scores,
    group_scores_f16, group_scores_f16_fits, group_weighted_sum, group_weighted_sum_f16,
    group_weighted_sum_f16_fits, narrow_bf16, narrow_f16, prefetch, widen_bf16, widen_f16,
};
use crate::ModelError;

/// Where the KV memory lives: this backend's own heap (f32 words from a page boundary on, so every
/// block starts where a mapping's would), or a store it was given (shared memory a same-host decode
/// worker reads, say).
#[derive(Debug)]
pub(crate) enum KvMemory {
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
    pub(crate) fn heap(bytes: usize) -> KvMemory {
        let (len, slack) = (bytes.div_ceil(4), HEAP_ALIGN / 4);
        let mut words = vec![0.0f32; len + slack];
        let start = (HEAP_ALIGN - words.as_ptr() as usize % HEAP_ALIGN) % HEAP_ALIGN / 4;
        // One store per 4 KiB page; the value is opaque to the compiler, so the store stays.
        for i in (0..words.len()).step_by(1024) {
            words[i] = std::hint::black_box(0.0);
        }
        KvMemory::Heap { words, start, len }
    }

    pub(crate) fn bytes(&self) -> &[u8] {
        match self {
            KvMemory::Heap { words, start, len } => f32_bytes(&words[*start..*start + *len]),
            KvMemory::Store(s) => s.bytes(),
        }
    }

    pub(crate) fn bytes_mut(&mut self) -> &mut [u8] {
        match self {
            KvMemory::Heap { words, start, len } => f32_bytes_mut(&mut words[*start..*start + *len]),
            KvMemory::Store(s) => s.bytes_mut(),
        }
    }

    pub(crate) fn values(&self, dtype: KvDtype) -> KvValues<'_> {
        match dtype {
            KvDtype::F32 => KvValues::F32(as_f32(self.bytes())),
            KvDtype::F16 => KvValues::F16(as_u16(self.bytes())),
            KvDtype::Bf16 => KvValues::Bf16(as_u16(self.bytes())),
        }
    }

    /// KV memory in `store`, which must hold `layout`'s blocks and be 4-byte aligned (a memory
    /// mapping is).
    pub(crate) fn from_store(store: Box<dyn KvStore>, layout: &KvLayout) -> Result<KvMemory, ModelError> {
        let (bytes, need) = (store.bytes(), layout.block_bytes() * layout.num_blocks);
        let aligned = bytes.as_ptr().align_offset(4) == 0;
        if bytes.len() < need || !aligned {
            return Err(ModelError::InvalidInput {
                problem: format!(
                    "a KV store of {} bytes at an address {} 4-byte aligned; {} blocks need {need} aligned bytes",
                    bytes.len(),
                    if aligned { "" } else { "not" },
                    layout.num_blocks,
                ),
            });
        }
        Ok(KvMemory::Store(store))
    }

    /// Performs copy-on-write copies of whole blocks of `layout` (see `Backend::copy_blocks`).
    pub(crate) fn copy_blocks(&mut self, layout: &KvLayout, copies: &[BlockCopy]) -> Result<(), ModelError> {
        let n = layout.block_bytes();
        for c in copies {
            check_block(layout, c.src, n)?;
            check_block(layout, c.dst, n)?;
            let (src, dst) = (c.src.0 as usize * n, c.dst.0 as usize * n);
            self.bytes_mut().copy_within(src..src + n, dst);
        }
        Ok(())
    }

    /// Copies one block's bytes into `out` (see `Backend::read_block`).
    pub(crate) fn read_block(
        &self,
        layout: &KvLayout,
        block: BlockId,
        out: &mut [u8],
    ) -> Result<(), ModelError> {
        check_block(layout, block, out.len())?;
        out.copy_from_slice(self.block(layout, block).expect("a checked block"));
        Ok(())
    }

    /// One block's bytes (see `Backend::block_bytes`).
    pub(crate) fn block(&self, layout: &KvLayout, block: BlockId) -> Option<&[u8]> {
        let n = layout.block_bytes();
        self.bytes().get(block.0 as usize * n..)?.get(..n)
    }

    pub(crate) fn block_mut(&mut self, layout: &KvLayout, block: BlockId) -> Option<&mut [u8]> {
        let n = layout.block_bytes();
        self.bytes_mut().get_mut(block.0 as usize * n..)?.get_mut(..n)
    }

    /// Stores one block received from a peer (see `Backend::write_block`).
    pub(crate) fn write_block(
        &mut self,
        layout: &KvLayout,
        block: BlockId,
        data: &[u8],
    ) -> Result<(), ModelError> {
        check_block(layout, block, data.len())?;
        // A block arriving by transfer is read by the next decode steps, not now, and a pull's blocks
        // together outgrow the cache: streaming stores skip reading each line before writing it.
        crate::sys::copy_streaming(self.block_mut(layout, block).expect("a checked block"), data);
        Ok(())
    }

    /// Stores f32 values at value index `at`, rounded to `dtype`.
    pub(crate) fn store(&mut self, dtype: KvDtype, at: usize, src: &[f32]) {
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
pub(crate) enum KvValues<'a> {
    F32(&'a [f32]),
    F16(&'a [u16]),
    Bf16(&'a [u16]),
}

impl KvValues<'_> {
    /// `dst.len()` values from value index `at`, as f32.
    pub(crate) fn read_into(&self, at: usize, dst: &mut [f32]) {
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

/// Keys per split of a row's attention: long contexts are cut into splits that run in parallel and
/// are merged by their maxima and sums (flash-decoding), so one sequence's attention uses every
/// core. The splits are fixed in absolute positions (split `s` holds keys `512 s .. 512 (s + 1)`),
/// so a position's attention is the same sums in the same order whether its row is a decode, one of
/// a prefill chunk's, or computed beside any other rows.
const SPLIT_KEYS: usize = 512;

/// Rows of one sequence's step that share a task: each key row read is scored against all of them
/// while it is in L1.
const ROWS_PER_TASK: usize = 16;

/// One split's share of a row's attention, per query head: the largest score, the sum of
/// exp(score - largest), and the values weighted by those exps.
struct Partial {
    max: Vec<f32>,
    sum: Vec<f32>,
    acc: Vec<f32>,
}

/// One task: rows `rows` (consecutive rows of one step's sequence, in position order) against the
/// keys of split `split`.
struct Task {
    rows: std::ops::Range<usize>,
    split: usize,
}

impl CpuBackend {
    /// Every row's attention over its sequence's paged cache (its own K and V already stored there):
    /// each row attends to positions `first..=pos` (`first` is 0, or where a sliding window starts).
    /// Each (row, split) is scored, softmaxed and weighted on its own, key block by key block in
    /// position order, so a row's result depends only on its position and the cache's contents;
    /// tasks group a sequence's consecutive rows so that each K and V row read serves all of them.
    pub(super) fn attention(
        &self,
        steps: &[SeqStep<'_>],
        rows: &[(usize, usize)],
        li: usize,
        (qkv, ldq): (&[f32], usize),
        select: &[Option<Vec<bool>>],
        attn: &mut [f32],
    ) {
        let (nh, nkv, bs) = (self.cfg.num_heads, self.cfg.num_kv_heads, self.layout.block_size);
        // Per head: the query's and key's width, the value's, and the scores' scale. Latent attention
        // (MLA) is one KV head whose rows are `[c_kv | k_rope]`: the absorbed queries score against
        // the whole row, and the values are its first `kv_lora_rank` values.
        let (hd, vd, scale, v_part) = match &self.cfg.mla {
            Some(m) => (m.latent_width(), m.kv_lora_rank, m.softmax_scale, 0),
            None => (self.cfg.head_dim, self.cfg.head_dim, 1.0 / (self.cfg.head_dim as f32).sqrt(), 1),
        };
        // A position's row of every KV head (a latent row holds the indexer's key after the latent).
        let (group, q_dim, o_dim, stride) = (nh / nkv, nh * hd, nh * vd, nkv * self.layout.head_dim);
        let kv_mem = self.kv.values(self.layout.dtype);
        let (f16_scores, f16_sums) = (group_scores_f16_fits(hd), group_weighted_sum_f16_fits(vd));
        // A row's visible keys: `first..ctx`.
        let visible = |r: usize| {
            let ctx = rows[r].1 + 1;
            (self.cfg.sliding_window.map_or(0, |w| ctx.saturating_sub(w)), ctx)
        };
        let mut tasks = Vec::new();
        let mut r = 0;
        while r < rows.len() {
            // Rows of the same step are consecutive and in position order.
            let step = rows[r].0;
            let end = r + rows[r..].iter().take_while(|x| x.0 == step).count();
            let mut r0 = r;
            while r0 < end {
                let r1 = (r0 + ROWS_PER_TASK).min(end);
                let (first, _) = visible(r0);
                let (_, ctx) = visible(r1 - 1);
                tasks.extend(
                    (first / SPLIT_KEYS..ctx.div_ceil(SPLIT_KEYS)).map(|split| Task { rows: r0..r1, split }),
                );
                r0 = r1;
            }
            r = end;
        }
        // Per task, per row of it: the row's partial for the split (none where it sees no key of it).
        let partials: Vec<Vec<Option<Partial>>> = tasks
            .par_iter()
            .map(|task| {
                let table = steps[rows[task.rows.start].0].block_table;
                let (s0, s1) = (task.split * SPLIT_KEYS, (task.split + 1) * SPLIT_KEYS);
                // Each row's keys in this split, and the task's span of them.
                let ranges: Vec<(usize, usize)> = task
                    .rows
                    .clone()
                    .map(|r| {
                        let (first, ctx) = visible(r);
                        (first.max(s0), ctx.min(s1))
                    })
                    .collect();
                let lo = ranges.iter().filter(|(a, b)| a < b).map(|r| r.0).min().unwrap_or(s0);
                let hi = ranges.iter().map(|r| r.1).max().unwrap_or(s0);
                let n = hi.saturating_sub(lo);
                let qs: Vec<Vec<f32>> = task
                    .rows
                    .clone()
                    .map(|r| qkv[r * ldq..][..q_dim].iter().map(|v| v * scale).collect())
                    .collect();
                let mut parts: Vec<Option<Partial>> = ranges
                    .iter()
                    .map(|(a, b)| {
                        (a < b).then(|| Partial {
                            max: vec![0.0; nh],
                            sum: vec![0.0; nh],
                            acc: vec![0.0; o_dim],
                        })
                    })
                    .collect();
                if n == 0 {
                    return parts;
                }
                SCORES.with_borrow_mut(|scores| {
                    WIDE.with_borrow_mut(|wide| {
                        // Row i's scores: heads by the task's keys `lo..hi` (only its own keys written).
                        let scores = sized(scores, ranges.len() * nh * n);
                        // Positions block by block: within a block, one position's K (or V) row of every
                        // KV head is `stride` floats long and the next position's follows it.
                        // (position, block, position in the block, positions).
                        let runs = || {
                            let starts = std::iter::successors(Some(lo), |&j| Some((j / bs + 1) * bs));
                            starts
                                .take_while(|&j| j < hi)
                                .map(|j| (j, table[j / bs], j % bs, (bs - j % bs).min(hi - j)))
                        };
                        for (j, block, off, cnt) in runs() {
                            // The values of these positions, read after every key: on their way to
                            // L2 while the keys are scored.
                            kv_mem.prefetch(self.kv_at(block, li, v_part, off), cnt * stride);
                            let k_at = self.kv_at(block, li, 0, off);
                            // f16 keys are widened in registers where the kernels can; else the run's
                            // rows once, for every row of the task.
                            let k16 = match kv_mem {
                                KvValues::F16(k) if f16_scores => Some(k),
                                _ => None,
                            };
                            let k32 =
                                if k16.is_none() { kv_mem.f32s(k_at, cnt * stride, wide) } else { &[][..] };
                            for (i, &(a, b)) in ranges.iter().enumerate() {
                                // This row's keys within the run.
                                let (from, to) = (a.max(j), b.min(j + cnt));
                                if from >= to {
                                    continue;
                                }
                                let (skip, m) = (from - j, to - from);
                                let out = (&mut scores[i * nh * n + (from - lo)..], n);
                                match k16 {
                                    Some(k) => {
                                        let rows =
                                            (&k[k_at + skip * stride..k_at + (skip + m) * stride], stride);
                                        assert!(group_scores_f16(&qs[i], (hd, group), rows, m, out));
                                    }
                                    None => group_scores(
                                        &qs[i],
                                        (hd, group),
                                        (&k32[skip * stride..], stride),
                                        m,
                                        out,
                                    ),
                                }
                            }
                        }
                        for (i, (&(a, b), slot)) in ranges.iter().zip(&mut parts).enumerate() {
                            // Sparse attention (V3.2): positions the row's indexer did not select
                            // weigh nothing; a split with none of them is no part of the row.
                            let keep = select.get(task.rows.start + i).and_then(Option::as_ref);
                            if keep.is_some_and(|k| a >= b || !k[a..b].iter().any(|&x| x)) {
                                *slot = None;
                            }
                            let Some(part) = slot else { continue };
                            for h in 0..nh {
                                let row = &mut scores[i * nh * n + h * n + (a - lo)..][..b - a];
                                if let Some(k) = keep {
                                    for (v, &kept) in row.iter_mut().zip(&k[a..b]) {
                                        if !kept {
                                            *v = f32::NEG_INFINITY;
                                        }
                                    }
                                }
                                let max = row.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
                                part.max[h] = max;
                                part.sum[h] = exp_scaled(row, 1.0, max);
                            }
                        }
                        for (j, block, off, cnt) in runs() {
                            let v_at = self.kv_at(block, li, v_part, off);
                            let v16 = match kv_mem {
                                KvValues::F16(v) if f16_sums => Some(v),
                                _ => None,
                            };
                            let v32 =
                                if v16.is_none() { kv_mem.f32s(v_at, cnt * stride, wide) } else { &[][..] };
                            for (i, (&(a, b), part)) in ranges.iter().zip(&mut parts).enumerate() {
                                let Some(part) = part else { continue };
                                let (from, to) = (a.max(j), b.min(j + cnt));
                                if from >= to {
                                    continue;
                                }
                                let (skip, m) = (from - j, to - from);
                                let p = (&scores[i * nh * n + (from - lo)..], n);
                                match v16 {
                                    Some(v) => {
                                        let rows =
                                            (&v[v_at + skip * stride..v_at + (skip + m) * stride], stride);
                                        assert!(group_weighted_sum_f16(
                                            p,
                                            (vd, group),
                                            rows,
                                            m,
                                            &mut part.acc
                                        ));
                                    }
                                    None => group_weighted_sum(
                                        p,
                                        (vd, group),
                                        (&v32[skip * stride..], stride),
                                        m,
                                        &mut part.acc,
                                    ),
                                }
                            }
                        }
                    })
                });
                parts
            })
            .collect();
        // Merge each row's splits in order.
        let mut merged: Vec<Vec<&Partial>> = vec![Vec::new(); rows.len()];
        for (task, parts) in tasks.iter().zip(&partials) {
            for (r, part) in task.rows.clone().zip(parts) {
                if let Some(p) = part {
                    merged[r].push(p);
                }
            }
        }
        for (r, parts) in merged.iter().enumerate() {
            for head in 0..nh {
                let max = parts.iter().fold(f32::NEG_INFINITY, |m, p| m.max(p.max[head]));
                let out = &mut attn[r * o_dim + head * vd..][..vd];
                out.fill(0.0);
                let mut sum = 0.0;
                for p in parts {
                    let w = (p.max[head] - max).exp();
                    sum += p.sum[head] * w;
                    for (o, a) in out.iter_mut().zip(&p.acc[head * vd..(head + 1) * vd]) {
                        *o += a * w;
                    }
                }
                for o in out.iter_mut() {
                    *o /= sum;
                }
            }
        }
    }
}

thread_local! {
    /// An attention task's scores, reused by each pool thread: its rows' heads by the (at most
    /// 512) keys of its split.
    static SCORES: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
    /// A decode task's K or V rows of one block, widened to f32 when the KV memory is 16-bit.
    static WIDE: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
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
