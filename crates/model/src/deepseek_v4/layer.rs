//! One V4 layer for one token: hyper-connection mixing, attention over the window and compressed rows,
//! the mixture of experts.

use std::collections::VecDeque;

use super::weights::{Compressor, Expert, HyperConnection, Routing, V4LayerWeights};
use crate::config::V4Config;

/// The indexer's compressor pools every 4 tokens (the compressed sparse layers' ratio).
pub(super) const INDEX_RATIO: usize = 4;

/// What one token's pass through a layer needs besides the weights and state.
pub(super) struct Ctx<'a> {
    pub c: &'a V4Config,
    /// The layer kind's inverse rope frequencies.
    pub rope: &'a [f32],
    /// The token's request (its index in the step) and the layer's index, in the [`Memory`].
    pub seq: usize,
    pub layer: usize,
    pub pos: usize,
    pub token: usize,
}

/// Which of a layer's compressors: its rows' (`Kv`), or its indexer's keys' (`Index`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Pool {
    Kv,
    Index,
}

/// A compressor's (value, gate) pairs of one group, oldest first.
pub(super) type Group = Vec<(Vec<f32>, Vec<f32>)>;

/// Where a request keeps what its later tokens read, layer by layer: the window's K=V rows, each
/// compressor's (value, gate) pairs until their group completes, and the compressed rows.
/// [`LayerState`]s hold them per request; the served backend (`paged.rs`) in paged KV blocks, a row
/// per position. Both give the same values, so both give the same numbers.
pub(super) trait Memory {
    /// Keeps `row`, position `pos`'s K=V row in layer `at`; the window's rows (the last `window`
    /// positions', oldest first, this one's last).
    fn window(&mut self, at: Place, pos: usize, window: usize, row: Vec<f32>) -> Vec<Vec<f32>>;

    /// Keeps position `pos`'s value and gate for compressor `pool`; when `pos` ends a group of
    /// `ratio`, that group's pairs and (with `overlap`) the previous group's (empty for the first).
    #[allow(clippy::too_many_arguments)]
    fn feed(
        &mut self,
        at: Place,
        pool: Pool,
        pos: usize,
        group: (usize, bool),
        a: Vec<f32>,
        s: Vec<f32>,
    ) -> Option<(Group, Group)>;

    /// Keeps the row compressor `pool` made from the group ending at `pos`.
    fn push_row(&mut self, at: Place, pool: Pool, pos: usize, row: Vec<f32>);

    /// Every row compressor `pool` (of `ratio`) has made up to and including position `pos`.
    fn rows(&self, at: Place, pool: Pool, pos: usize, ratio: usize) -> Vec<Vec<f32>>;
}

/// Which request (its index in the step) and which layer a memory access is for.
pub(super) type Place = (usize, usize);

/// A compressor's state: the rows made so far, the current group's values and gates, and the
/// previous group's.
#[derive(Debug, Clone)]
struct Pooled {
    row: usize,
    rows: Vec<f32>,
    pending: Group,
    previous: Group,
}

impl Pooled {
    fn new(row: usize) -> Pooled {
        Pooled { row, rows: Vec::new(), pending: Vec::new(), previous: Vec::new() }
    }

    fn count(&self) -> usize {
        self.rows.len() / self.row
    }
}

/// One layer's per-request state.
#[derive(Debug, Clone)]
pub(super) struct LayerState {
    /// The last `window` K=V rows, oldest first.
    window: VecDeque<Vec<f32>>,
    compressed: Option<Pooled>,
    index: Option<Pooled>,
}

impl LayerState {
    pub(super) fn new(w: &V4LayerWeights, c: &V4Config) -> LayerState {
        LayerState {
            window: VecDeque::with_capacity(c.window),
            compressed: w.compressor.is_some().then(|| Pooled::new(c.head_dim)),
            index: w.indexer.is_some().then(|| Pooled::new(c.index_dim)),
        }
    }

    /// f32 bytes of the fixed state (window, partial groups) and of the compressed rows.
    pub(super) fn bytes(&self) -> (usize, usize) {
        let window: usize = self.window.iter().map(Vec::len).sum();
        let pools = [&self.compressed, &self.index];
        let partial: usize = pools
            .iter()
            .flat_map(|p| p.iter())
            .flat_map(|p| p.pending.iter().chain(&p.previous))
            .map(|(a, s)| a.len() + s.len())
            .sum();
        let rows: usize = pools.iter().flat_map(|p| p.iter()).map(|p| p.rows.len()).sum();
        (4 * (window + partial), 4 * rows)
    }

    pub(super) fn rows(&self) -> usize {
        self.compressed.as_ref().map_or(0, Pooled::count)
    }

    fn pool(&mut self, pool: Pool) -> &mut Pooled {
        let p = match pool {
            Pool::Kv => &mut self.compressed,
            Pool::Index => &mut self.index,
        };
        p.as_mut().expect("a compressor's state where the layer has the compressor")
    }
}

/// A request's states, one per layer.
pub(super) struct PerLayer<'a>(pub &'a mut [LayerState]);

impl Memory for PerLayer<'_> {
    fn window(&mut self, (_, layer): Place, pos: usize, window: usize, row: Vec<f32>) -> Vec<Vec<f32>> {
        self.0[layer].window((0, 0), pos, window, row)
    }

    fn feed(
        &mut self,
        (_, layer): Place,
        pool: Pool,
        pos: usize,
        group: (usize, bool),
        a: Vec<f32>,
        s: Vec<f32>,
    ) -> Option<(Group, Group)> {
        self.0[layer].feed((0, 0), pool, pos, group, a, s)
    }

    fn push_row(&mut self, (_, layer): Place, pool: Pool, pos: usize, row: Vec<f32>) {
        self.0[layer].push_row((0, 0), pool, pos, row)
    }

    fn rows(&self, (_, layer): Place, pool: Pool, pos: usize, ratio: usize) -> Vec<Vec<f32>> {
        Memory::rows(&self.0[layer], (0, 0), pool, pos, ratio)
    }
}

/// One layer's state of one request (the draft layer's): the place is not read.
impl Memory for LayerState {
    fn window(&mut self, _: Place, _: usize, window: usize, row: Vec<f32>) -> Vec<Vec<f32>> {
        let w = &mut self.window;
        if w.len() == window {
            w.pop_front();
        }
        w.push_back(row);
        w.iter().cloned().collect()
    }

    fn feed(
        &mut self,
        _: Place,
        pool: Pool,
        _: usize,
        (ratio, overlap): (usize, bool),
        a: Vec<f32>,
        s: Vec<f32>,
    ) -> Option<(Group, Group)> {
        let p = self.pool(pool);
        p.pending.push((a, s));
        if p.pending.len() < ratio {
            return None;
        }
        let group = std::mem::take(&mut p.pending);
        let previous = std::mem::replace(&mut p.previous, group.clone());
        Some((if overlap { previous } else { Vec::new() }, group))
    }

    fn push_row(&mut self, _: Place, pool: Pool, _: usize, row: Vec<f32>) {
        self.pool(pool).rows.extend_from_slice(&row);
    }

    fn rows(&self, _: Place, pool: Pool, _: usize, _: usize) -> Vec<Vec<f32>> {
        let p = match pool {
            Pool::Kv => &self.compressed,
            Pool::Index => &self.index,
        };
        p.as_ref().map_or(Vec::new(), |p| p.rows.chunks_exact(p.row).map(<[f32]>::to_vec).collect())
    }
}

pub(super) fn matvec(w: &[f32], x: &[f32], cols: usize) -> Vec<f32> {
    w.chunks_exact(cols).map(|r| crate::sys::dot(r, x)).collect()
}

pub(super) fn rms_norm(x: &[f32], w: Option<&[f32]>, eps: f32) -> Vec<f32> {
    let var = x.iter().map(|v| v * v).sum::<f32>() / x.len() as f32;
    let inv = 1.0 / (var + eps).sqrt();
    match w {
        Some(w) => x.iter().zip(w).map(|(v, g)| v * inv * g).collect(),
        None => x.iter().map(|v| v * inv).collect(),
    }
}

/// The lowest index of the largest value.
pub(super) fn argmax(v: &[f32]) -> usize {
    (0..v.len()).fold(0, |b, i| if v[i] > v[b] { i } else { b })
}

fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// Rotates the interleaved pairs of the last `2 * freqs.len()` values of `x` by `pos * freq` (back by
/// it with `inverse`).
fn rope(x: &mut [f32], freqs: &[f32], pos: usize, inverse: bool) {
    let start = x.len() - 2 * freqs.len();
    for (i, &f) in freqs.iter().enumerate() {
        let angle = pos as f32 * f;
        let (sin, cos) = angle.sin_cos();
        let sin = if inverse { -sin } else { sin };
        let (re, im) = (x[start + 2 * i], x[start + 2 * i + 1]);
        x[start + 2 * i] = re * cos - im * sin;
        x[start + 2 * i + 1] = re * sin + im * cos;
    }
}

/// A hyper-connection's mixing weights for `streams` (`n` of `d`): each stream's weight into the
/// block (`pre`), the block output's weight into each stream (`post`, `scales` 3 only) and the
/// streams' doubly stochastic mixing matrix (`comb[j * n + k]`: stream j into k, Sinkhorn-normalised).
pub(super) fn mix(
    hc: &HyperConnection,
    streams: &[f32],
    n: usize,
    d: usize,
    c: &V4Config,
    scales: usize,
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let rms = (streams.iter().map(|v| v * v).sum::<f32>() / (n * d) as f32 + c.eps).sqrt();
    let mixes: Vec<f32> = matvec(&hc.func, streams, n * d).into_iter().map(|m| m / rms).collect();
    let pre = (0..n).map(|j| sigmoid(mixes[j] * hc.scale[0] + hc.base[j]) + c.hc_eps).collect();
    if scales == 1 {
        return (pre, Vec::new(), Vec::new());
    }
    let post = (n..2 * n).map(|j| 2.0 * sigmoid(mixes[j] * hc.scale[1] + hc.base[j])).collect();
    let mut comb: Vec<f32> = (2 * n..(2 + n) * n).map(|i| mixes[i] * hc.scale[2] + hc.base[i]).collect();
    for row in comb.chunks_exact_mut(n) {
        let max = row.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
        row.iter_mut().for_each(|v| *v = (*v - max).exp());
        let sum: f32 = row.iter().sum();
        row.iter_mut().for_each(|v| *v = *v / sum + c.hc_eps);
    }
    let columns = |comb: &mut Vec<f32>| {
        for k in 0..n {
            let sum: f32 = (0..n).map(|j| comb[j * n + k]).sum::<f32>() + c.hc_eps;
            (0..n).for_each(|j| comb[j * n + k] /= sum);
        }
    };
    columns(&mut comb);
    for _ in 1..c.hc_iters {
        for row in comb.chunks_exact_mut(n) {
            let sum: f32 = row.iter().sum::<f32>() + c.hc_eps;
            row.iter_mut().for_each(|v| *v /= sum);
        }
        columns(&mut comb);
    }
    (pre, post, comb)
}

/// `sum_j weights[j] * stream j`.
pub(super) fn combine(weights: &[f32], streams: &[f32], d: usize) -> Vec<f32> {
    let mut y = vec![0.0; d];
    for (wj, s) in weights.iter().zip(streams.chunks_exact(d)) {
        y.iter_mut().zip(s).for_each(|(y, v)| *y += wj * v);
    }
    y
}

/// The streams after a block: stream k is `post[k] * out + sum_j comb[j][k] * stream j`.
fn spread(out: &[f32], streams: &[f32], post: &[f32], comb: &[f32], n: usize, d: usize) -> Vec<f32> {
    let mut next = vec![0.0; n * d];
    for k in 0..n {
        let dst = &mut next[k * d..(k + 1) * d];
        dst.iter_mut().zip(out).for_each(|(x, o)| *x = post[k] * o);
        for j in 0..n {
            let w = comb[j * n + k];
            dst.iter_mut().zip(&streams[j * d..(j + 1) * d]).for_each(|(x, s)| *x += w * s);
        }
    }
    next
}

/// What a layer's block does to its tokens' normed inputs: their outputs.
type Rows<'a> = dyn FnMut(&[Vec<f32>]) -> Vec<Vec<f32>> + 'a;

/// Tokens through layer `w` in order (`ctxs[t]` and `streams[t]` token `t`'s), layer by layer: each
/// projection reads its weights once for every token (a product's rows are the one-token products'
/// bits), and what a token reads of the memory its predecessors wrote first, as one token at a time
/// would. The streams after the layer.
pub(super) fn run(
    ctxs: &[Ctx<'_>],
    w: &V4LayerWeights,
    mem: &mut dyn Memory,
    streams: Vec<Vec<f32>>,
) -> Vec<Vec<f32>> {
    let Some(first) = ctxs.first() else { return streams };
    let (c, n, d) = (first.c, first.c.hc_mult, first.c.hidden);
    let block = |streams: Vec<Vec<f32>>, hc: &HyperConnection, norm: &[f32], body: &mut Rows<'_>| {
        let mixes: Vec<_> = streams.iter().map(|s| mix(hc, s, n, d, c, 3)).collect();
        let xs: Vec<Vec<f32>> = streams
            .iter()
            .zip(&mixes)
            .map(|(s, (pre, _, _))| rms_norm(&combine(pre, s, d), Some(norm), c.eps))
            .collect();
        let outs = body(&xs);
        streams
            .iter()
            .zip(&mixes)
            .zip(&outs)
            .map(|((s, (_, post, comb)), o)| spread(o, s, post, comb, n, d))
            .collect::<Vec<_>>()
    };
    let streams = block(streams, &w.hc_attn, &w.attn_norm, &mut |xs| attention(ctxs, w, mem, xs));
    block(streams, &w.hc_ffn, &w.ffn_norm, &mut |xs| moe(ctxs, w, xs))
}

/// Feeds one token's value `a` and gate `gate` (before its position's `ape`) to compressor `pool`
/// (of `ratio`, making rows of `row` values); a row when it completes a group (pooled per channel by
/// a softmax of the gates over the group, and at ratio 4 over the previous group's first halves
/// too; normed, then rotated at the group's first position).
fn compress(
    ctx: &Ctx<'_>,
    cw: &Compressor,
    mem: &mut dyn Memory,
    (pool, ratio, row): (Pool, usize, usize),
    (a, gate): (Vec<f32>, &[f32]),
) {
    let ape = &cw.ape[(ctx.pos % ratio) * cw.width..(ctx.pos % ratio + 1) * cw.width];
    let s: Vec<f32> = gate.iter().zip(ape).map(|(g, b)| g + b).collect();
    let overlap = cw.width == 2 * row;
    let Some((previous, group)) = mem.feed((ctx.seq, ctx.layer), pool, ctx.pos, (ratio, overlap), a, s)
    else {
        return;
    };
    let mut out = vec![0.0; row];
    for (j, o) in out.iter_mut().enumerate() {
        // (value, gate) slots: the previous group's first halves, then this group's (second halves).
        let cur = if overlap { row + j } else { j };
        let slots: Vec<(f32, f32)> = previous
            .iter()
            .map(|(a, s)| (a[j], s[j]))
            .chain(group.iter().map(|(a, s)| (a[cur], s[cur])))
            .collect();
        let max = slots.iter().fold(f32::NEG_INFINITY, |m, &(_, s)| m.max(s));
        let total: f32 = slots.iter().map(|&(_, s)| (s - max).exp()).sum();
        *o = slots.iter().map(|&(a, s)| (s - max).exp() / total * a).sum();
    }
    let mut out = rms_norm(&out, Some(&cw.norm), ctx.c.eps);
    rope(&mut out, ctx.rope, ctx.pos + 1 - ratio, false);
    mem.push_row((ctx.seq, ctx.layer), pool, ctx.pos, out);
}

/// The compressed rows query `qi` keeps: the indexer's `index_topk` best (ties to the earlier row),
/// or every row when there are no more.
fn select(ctx: &Ctx<'_>, index: &[Vec<f32>], qi: &[f32], weights: &[f32]) -> Vec<usize> {
    let (ih, id, k) = (ctx.c.index_heads, ctx.c.index_dim, ctx.c.index_topk);
    let rows = index.len();
    if rows <= k {
        return (0..rows).collect();
    }
    let scale = (id as f32).powf(-0.5);
    let scores: Vec<f32> = (0..rows)
        .map(|w| {
            let key = &index[w];
            (0..ih)
                .map(|h| crate::sys::dot(&qi[h * id..(h + 1) * id], key).max(0.0) * scale * weights[h])
                .sum()
        })
        .collect();
    let mut order: Vec<usize> = (0..rows).collect();
    order.sort_by(|&x, &y| scores[y].total_cmp(&scores[x]).then(x.cmp(&y)));
    order.truncate(k);
    order
}

/// Attention of tokens (inputs `hs`, normed) in order over their windows and compressed rows; the
/// layer's outputs.
fn attention(ctxs: &[Ctx<'_>], w: &V4LayerWeights, mem: &mut dyn Memory, hs: &[Vec<f32>]) -> Vec<Vec<f32>> {
    let c = ctxs[0].c;
    let (heads, hd) = (c.heads, c.head_dim);
    // Every projection of every token first: none reads the memory.
    let qr: Vec<Vec<f32>> =
        w.wq_a.times_many(hs).into_iter().map(|v| rms_norm(&v, Some(&w.q_norm), c.eps)).collect();
    let mut qs = w.wq_b.times_many(&qr);
    let mut kvs: Vec<Vec<f32>> =
        w.wkv.times_many(hs).into_iter().map(|v| rms_norm(&v, Some(&w.kv_norm), c.eps)).collect();
    for ((q, kv), ctx) in qs.iter_mut().zip(&mut kvs).zip(ctxs) {
        for head in q.chunks_exact_mut(hd) {
            let normed = rms_norm(head, None, c.eps);
            head.copy_from_slice(&normed);
            rope(head, ctx.rope, ctx.pos, false);
        }
        rope(kv, ctx.rope, ctx.pos, false);
    }
    let pooled_in = w.compressor.as_ref().map(|cw| (cw.wkv.times_many(hs), cw.wgate.times_many(hs)));
    let index_in = w.indexer.as_ref().map(|iw| {
        let (ih, id) = (c.index_heads, c.index_dim);
        let mut qi = iw.wq_b.times_many(&qr);
        for (q, ctx) in qi.iter_mut().zip(ctxs) {
            q.chunks_exact_mut(id).for_each(|head| rope(head, ctx.rope, ctx.pos, false));
        }
        let weights: Vec<Vec<f32>> = iw
            .weights_proj
            .times_many(hs)
            .into_iter()
            .map(|v| v.into_iter().map(|v| v * (ih as f32).powf(-0.5)).collect())
            .collect();
        (iw.compressor.wkv.times_many(hs), iw.compressor.wgate.times_many(hs), qi, weights)
    });
    // Then each token in order: what it writes, then what it reads.
    let ratio = w.kind.ratio();
    let scale = (hd as f32).powf(-0.5);
    let mut os = Vec::with_capacity(hs.len());
    for (t, (ctx, kv)) in ctxs.iter().zip(kvs).enumerate() {
        let window = mem.window((ctx.seq, ctx.layer), ctx.pos, c.window, kv);
        let pooled = match (&w.compressor, &pooled_in) {
            (Some(cw), Some((a, gate))) => {
                compress(ctx, cw, mem, (Pool::Kv, ratio, hd), (a[t].clone(), &gate[t]));
                mem.rows((ctx.seq, ctx.layer), Pool::Kv, ctx.pos, ratio)
            }
            _ => Vec::new(),
        };
        let mut chosen: Vec<usize> = (0..pooled.len()).collect();
        if let (Some(iw), Some((a, gate, qi, weights))) = (&w.indexer, &index_in) {
            let at = (Pool::Index, INDEX_RATIO, c.index_dim);
            compress(ctx, &iw.compressor, mem, at, (a[t].clone(), &gate[t]));
            let keys = mem.rows((ctx.seq, ctx.layer), Pool::Index, ctx.pos, INDEX_RATIO);
            chosen = select(ctx, &keys, &qi[t], &weights[t]);
        }
        let keys: Vec<&[f32]> =
            window.iter().map(Vec::as_slice).chain(chosen.iter().map(|&r| pooled[r].as_slice())).collect();
        let mut o = vec![0.0; heads * hd];
        for (head, out) in o.chunks_exact_mut(hd).enumerate() {
            let qh = &qs[t][head * hd..(head + 1) * hd];
            let logits: Vec<f32> = keys.iter().map(|k| crate::sys::dot(qh, k) * scale).collect();
            // The sink: a logit with a value of zero.
            let sink = w.sink[head];
            let max = logits.iter().fold(sink, |m, &v| m.max(v));
            let total = logits.iter().map(|&l| (l - max).exp()).sum::<f32>() + (sink - max).exp();
            for (k, &l) in keys.iter().zip(&logits) {
                let p = (l - max).exp() / total;
                out.iter_mut().zip(k.iter()).for_each(|(o, v)| *o += p * v);
            }
            rope(out, ctx.rope, ctx.pos, true);
        }
        os.push(o);
    }
    // The grouped output LoRA, then the output projection, for every token.
    let (groups, rank) = (c.o_groups, c.o_lora);
    let per = heads * hd / groups;
    let mut zs = vec![Vec::with_capacity(groups * rank); os.len()];
    for g in 0..groups {
        let part: Vec<Vec<f32>> = os.iter().map(|o| o[g * per..(g + 1) * per].to_vec()).collect();
        for (z, zg) in zs.iter_mut().zip(w.wo_a.rows_times_many(g * rank..(g + 1) * rank, &part)) {
            z.extend(zg);
        }
    }
    w.wo_b.times_many(&zs)
}

/// A SwiGLU expert (`w2(silu(w1 x) * w3 x)`, clamped at `limit`) on each of `xs`.
fn swiglu(e: &Expert, xs: &[Vec<f32>], limit: f32) -> Vec<Vec<f32>> {
    let (gs, us) = (e.w1.times_many(xs), e.w3.times_many(xs));
    let acts: Vec<Vec<f32>> = gs
        .iter()
        .zip(&us)
        .map(|(g, u)| {
            g.iter()
                .zip(u)
                .map(|(&g, &u)| {
                    let (g, u) = if limit > 0.0 { (g.min(limit), u.clamp(-limit, limit)) } else { (g, u) };
                    g * sigmoid(g) * u
                })
                .collect()
        })
        .collect();
    e.w2.times_many(&acts)
}

/// The mixture of experts for tokens' `xs` (normed): each expert runs once over the tokens routed
/// to it; each token sums its experts' outputs in its own order.
fn moe(ctxs: &[Ctx<'_>], w: &V4LayerWeights, xs: &[Vec<f32>]) -> Vec<Vec<f32>> {
    let c = ctxs[0].c;
    let mut routes = Vec::with_capacity(xs.len());
    for (ctx, gate) in ctxs.iter().zip(w.gate.times_many(xs)) {
        // sqrt(softplus(logit)), softplus as log(1 + e^x) without overflow.
        let scores: Vec<f32> =
            gate.into_iter().map(|l| (l.max(0.0) + (-l.abs()).exp().ln_1p()).sqrt()).collect();
        let top: Vec<usize> = match &w.routing {
            Routing::Hash(table) => table[ctx.token * c.top_k..(ctx.token + 1) * c.top_k].to_vec(),
            Routing::Scored(bias) => {
                let choice: Vec<f32> = match bias {
                    Some(b) => scores.iter().zip(b).map(|(s, b)| s + b).collect(),
                    None => scores.clone(),
                };
                let mut order: Vec<usize> = (0..c.experts).collect();
                order.sort_by(|&a, &b| choice[b].total_cmp(&choice[a]).then(a.cmp(&b)));
                order.truncate(c.top_k);
                order
            }
        };
        let total: f32 = top.iter().map(|&e| scores[e]).sum::<f32>() + 1e-20;
        let weights: Vec<f32> = top.iter().map(|&e| scores[e] / total * c.routed_scaling).collect();
        routes.push((top, weights));
    }
    // Each expert over its tokens: out[t][k] is token t's k-th expert's output.
    let mut outs: Vec<Vec<Vec<f32>>> = routes.iter().map(|(top, _)| vec![Vec::new(); top.len()]).collect();
    for (e, expert) in w.experts.iter().enumerate() {
        // (A token routed to an expert twice, as a hash table may, gets its output twice.)
        let picks: Vec<(usize, usize)> = routes
            .iter()
            .enumerate()
            .flat_map(|(t, (top, _))| {
                top.iter().enumerate().filter(move |&(_, &x)| x == e).map(move |(k, _)| (t, k))
            })
            .collect();
        if picks.is_empty() {
            continue;
        }
        let inputs: Vec<Vec<f32>> = picks.iter().map(|&(t, _)| xs[t].clone()).collect();
        for (&(t, k), out) in picks.iter().zip(swiglu(expert, &inputs, c.swiglu_limit)) {
            outs[t][k] = out;
        }
    }
    let mut ys = swiglu(&w.shared, xs, c.swiglu_limit);
    for ((y, (_, weights)), outs) in ys.iter_mut().zip(&routes).zip(outs) {
        for (weight, out) in weights.iter().zip(outs) {
            y.iter_mut().zip(&out).for_each(|(y, o)| *y += weight * o);
        }
    }
    ys
}
