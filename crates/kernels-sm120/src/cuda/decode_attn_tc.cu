// Paged decode attention on the tensor cores (mma.sync bf16, f32 accumulation), for up to 16 query
// heads per KV head. Same grid, split and partial-output contract as decode_attn.cu (the reduce
// kernel there combines the splits).
//
// A block (TC_THREADS = 4 warps) takes one sequence, one KV head and one slice of the context, and
// walks it in tiles of TC_KT = 64 tokens, multi-buffered in dynamic shared memory through cp.async
// (tokens past the slice are zero-filled). Each warp takes 16 tokens of a tile:
//   S[16 x 16] = Q[16 x D] . K^T  (m16n8k16; the G query rows of the group, padded to 16, in bf16)
//   online softmax per row on the fragments (each (row, token) score lives in exactly one lane)
//   O[16 x D] += P[16 x 16] . V   (m16n8k16; V fragments through ldmatrix.trans)
// At the end the four warps' (max, sum, O) merge through shared memory. Q and P enter the tensor
// cores as bf16; everything else is f32.

#define TC_THREADS 128

// mma_k16, mma_k8, ldmatrix_x4_trans, pack_bf16, cp_async16_zfill, tc_commit, tc_wait: mma.cuh.

template <int D, int TC_KT, int STAGES>
__device__ __forceinline__ void decode_attn_tc_impl(
    const float* __restrict__ q, int q_row_stride, const int* __restrict__ rows, const bf16* __restrict__ k_cache,
    const bf16* __restrict__ v_cache, const int* __restrict__ block_tables, int bt_stride,
    const int* __restrict__ ctx_lens, int n_kv, int group, int block_shift, float scale, int n_splits,
    float* __restrict__ part_o, float* __restrict__ part_ml) {
    constexpr int STRIDE = D + 8;  // bf16 per smem row: 16 bytes of padding, no bank conflicts
    constexpr int TILE = TC_KT * STRIDE;
    constexpr int NT = D / 8;                       // n-tiles of the output
    constexpr int CPR = D / 8;                      // 16-byte chunks per K or V row
    constexpr int ROWS_PER_PASS = TC_THREADS / CPR; // a warp's copies cover whole rows: coalesced
    constexpr int WT = TC_KT / 4;                   // tokens per warp per tile (8 or 16)
    constexpr int NJ = WT / 8;                      // 8-token score tiles per warp
    extern __shared__ __align__(16) bf16 s_kv[];    // STAGES x (K tile, V tile)
    __shared__ float s_ml[4][16][2];

    const int b = blockIdx.x / n_kv, kvh = blockIdx.x % n_kv, split = blockIdx.y;
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, gid = lane >> 2, tig = lane & 3;
    const int n_q = n_kv * group;
    const int ctx = ctx_lens[b];
    const int chunk = (ctx + n_splits - 1) / n_splits;
    const int t0 = min(ctx, split * chunk), t1 = min(ctx, t0 + chunk);
    const size_t kv_row = (size_t)n_kv * D;
    const int* bt = block_tables + (size_t)b * bt_stride;
    const int n_tiles = (t1 - t0 + TC_KT - 1) / TC_KT;
    const int ld_c = tid % CPR, ld_r = tid / CPR;
    const int block_mask = (1 << block_shift) - 1;

    auto load_tile = [&](int tile) {
        if (tile < n_tiles) {
            bf16* sk = s_kv + (tile % STAGES) * 2 * TILE;
            bf16* sv = sk + TILE;
#pragma unroll
            for (int r = ld_r; r < TC_KT; r += ROWS_PER_PASS) {
                const int pos = t0 + tile * TC_KT + r;
                const bool valid = pos < t1;
                const size_t slot = valid ? ((size_t)bt[pos >> block_shift] << block_shift) + (pos & block_mask) : 0;
                const size_t off = slot * kv_row + (size_t)kvh * D + ld_c * 8;
                cp_async16_zfill(sk + r * STRIDE + ld_c * 8, k_cache + off, valid);
                cp_async16_zfill(sv + r * STRIDE + ld_c * 8, v_cache + off, valid);
            }
        }
        tc_commit();  // an empty group past the end keeps the wait count uniform
    };
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) load_tile(s);

    // Q fragments (rows gid and gid + 8 of the group, scaled, bf16), one set per 16 dimensions. The
    // group's Q rows are first read with coalesced loads into the last pipeline stage, which no copy
    // has touched yet.
    const float* qb = q + (size_t)rows[b] * q_row_stride + (size_t)kvh * group * D;
    float* s_qf = reinterpret_cast<float*>(s_kv + (STAGES - 1) * 2 * TILE);
    for (int i = tid; i < group * D; i += TC_THREADS) s_qf[i] = qb[i] * scale;
    __syncthreads();
    unsigned qa[D / 16][4];
#pragma unroll
    for (int kc = 0; kc < D / 16; ++kc) {
        const int d = kc * 16 + tig * 2;
        const float* r0 = s_qf + gid * D;
        const float* r1 = s_qf + (gid + 8) * D;
        const bool v0 = gid < group, v1 = gid + 8 < group;
        qa[kc][0] = v0 ? pack_bf16(r0[d], r0[d + 1]) : 0u;
        qa[kc][1] = v1 ? pack_bf16(r1[d], r1[d + 1]) : 0u;
        qa[kc][2] = v0 ? pack_bf16(r0[d + 8], r0[d + 9]) : 0u;
        qa[kc][3] = v1 ? pack_bf16(r1[d + 8], r1[d + 9]) : 0u;
    }
    __syncthreads();  // the loop's first copy lands in that stage

    float o[NT][4];
#pragma unroll
    for (int n = 0; n < NT; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
    float m[2] = {NEG_INF, NEG_INF}, l[2] = {0.f, 0.f};  // rows gid, gid + 8; l: this lane's tokens only

    for (int tile = 0; tile < n_tiles; ++tile) {
        load_tile(tile + STAGES - 1);
        tc_wait<STAGES - 1>();
        __syncthreads();
        const bf16* sk = s_kv + (tile % STAGES) * 2 * TILE + warp * WT * STRIDE;
        const bf16* sv = sk + TILE;
        // Scores for this warp's WT tokens: NJ 8-token n-tiles. s[j][0..1]: row gid, tokens
        // 8j + 2 tig + {0, 1}; s[j][2..3]: row gid + 8.
        const float init1 = NJ == 2 ? 0.f : NEG_INF;  // with one n-tile, the second stays empty
        float s[2][4] = {{0.f, 0.f, 0.f, 0.f}, {init1, init1, init1, init1}};
#pragma unroll
        for (int j = 0; j < NJ; ++j) {
#pragma unroll
            for (int kc = 0; kc < D / 16; ++kc) {
                const bf16* kr = sk + (8 * j + gid) * STRIDE + kc * 16 + tig * 2;
                const unsigned b0 = *reinterpret_cast<const unsigned*>(kr);
                const unsigned b1 = *reinterpret_cast<const unsigned*>(kr + 8);
                mma_k16(s[j], qa[kc][0], qa[kc][1], qa[kc][2], qa[kc][3], b0, b1);
            }
            const int tok = t0 + tile * TC_KT + warp * WT + 8 * j + tig * 2;
            if (tok >= t1) s[j][0] = s[j][2] = NEG_INF;
            if (tok + 1 >= t1) s[j][1] = s[j][3] = NEG_INF;
        }
        float p[2][4];
#pragma unroll
        for (int h = 0; h < 2; ++h) {  // h = 0: row gid; h = 1: row gid + 8
            float mx = fmaxf(fmaxf(s[0][2 * h], s[0][2 * h + 1]), fmaxf(s[1][2 * h], s[1][2 * h + 1]));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
            if (mx == NEG_INF) {  // every token of this warp is past the slice
                p[0][2 * h] = p[0][2 * h + 1] = p[1][2 * h] = p[1][2 * h + 1] = 0.f;
                continue;
            }
            const float m_new = fmaxf(m[h], mx);
            if (m_new > m[h]) {
                const float alpha = m[h] == NEG_INF ? 0.f : expf(m[h] - m_new);
                l[h] *= alpha;
#pragma unroll
                for (int n = 0; n < NT; ++n) {
                    o[n][2 * h] *= alpha;
                    o[n][2 * h + 1] *= alpha;
                }
                m[h] = m_new;
            }
#pragma unroll
            for (int j = 0; j < 2; ++j) {
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const float v = s[j][2 * h + e];
                    p[j][2 * h + e] = v == NEG_INF ? 0.f : expf(v - m_new);
                    l[h] += p[j][2 * h + e];
                }
            }
        }
        // O += P . V: the P fragment is the score fragments' layout, in bf16.
        const unsigned a0 = pack_bf16(p[0][0], p[0][1]), a1 = pack_bf16(p[0][2], p[0][3]);
        if (NJ == 2) {  // 16 tokens: m16n8k16
            const unsigned a2 = pack_bf16(p[1][0], p[1][1]), a3 = pack_bf16(p[1][2], p[1][3]);
#pragma unroll
            for (int n = 0; n < NT; n += 2) {
                // Matrices: (tokens 0-7, n), (tokens 8-15, n), (tokens 0-7, n+1), (tokens 8-15, n+1).
                const int mi = lane >> 3;
                unsigned bv[4];
                ldmatrix_x4_trans(bv, sv + ((mi & 1) * 8 + (lane & 7)) * STRIDE + (n + (mi >> 1)) * 8);
                mma_k16(o[n], a0, a1, a2, a3, bv[0], bv[1]);
                mma_k16(o[n + 1], a0, a1, a2, a3, bv[2], bv[3]);
            }
        } else {  // 8 tokens: m16n8k8
#pragma unroll
            for (int n = 0; n < NT; n += 4) {
                unsigned bv[4];
                ldmatrix_x4_trans(bv, sv + (lane & 7) * STRIDE + (n + (lane >> 3)) * 8);
#pragma unroll
                for (int i = 0; i < 4; ++i) mma_k8(o[n + i], a0, a1, bv[i]);
            }
        }
        __syncthreads();  // the stage is overwritten by the next iteration's load
    }
    tc_wait<0>();
    __syncthreads();

    // Merge the warps. Row sums: over the quad first.
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        l[h] += __shfl_xor_sync(0xffffffffu, l[h], 1);
        l[h] += __shfl_xor_sync(0xffffffffu, l[h], 2);
    }
    if (tig == 0) {
        s_ml[warp][gid][0] = m[0];
        s_ml[warp][gid][1] = l[0];
        s_ml[warp][gid + 8][0] = m[1];
        s_ml[warp][gid + 8][1] = l[1];
    }
    float* s_o = reinterpret_cast<float*>(s_kv);  // 16 x D floats, the staging is free now
    for (int i = tid; i < 16 * D; i += TC_THREADS) s_o[i] = 0.f;
    __syncthreads();
    float f[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int r = gid + 8 * h;
        float mb = NEG_INF;
        for (int w = 0; w < 4; ++w) mb = fmaxf(mb, s_ml[w][r][0]);
        f[h] = m[h] == NEG_INF ? 0.f : expf(m[h] - mb);
    }
#pragma unroll
    for (int n = 0; n < NT; ++n) {
        const int d = n * 8 + tig * 2;
        atomicAdd(&s_o[gid * D + d], o[n][0] * f[0]);
        atomicAdd(&s_o[gid * D + d + 1], o[n][1] * f[0]);
        atomicAdd(&s_o[(gid + 8) * D + d], o[n][2] * f[1]);
        atomicAdd(&s_o[(gid + 8) * D + d + 1], o[n][3] * f[1]);
    }
    __syncthreads();
    for (int i = tid; i < group * D; i += TC_THREADS) {
        const int r = i / D, d = i % D;
        const size_t idx = ((size_t)b * n_q + kvh * group + r) * n_splits + split;
        part_o[idx * D + d] = s_o[r * D + d];
    }
    if (tid < group) {
        float mb = NEG_INF;
        for (int w = 0; w < 4; ++w) mb = fmaxf(mb, s_ml[w][tid][0]);
        float lb = 0.f;
        for (int w = 0; w < 4; ++w)
            if (s_ml[w][tid][0] != NEG_INF) lb += s_ml[w][tid][1] * expf(s_ml[w][tid][0] - mb);
        const size_t idx = ((size_t)b * n_q + kvh * group + tid) * n_splits + split;
        part_ml[2 * idx] = mb;
        part_ml[2 * idx + 1] = lb;
    }
}

#define DECODE_ATTN_TC(NAME, D, KT, STAGES, MIN_BLOCKS)                                                                \
    extern "C" __global__ void __launch_bounds__(TC_THREADS, MIN_BLOCKS) NAME(                                            \
        const float* __restrict__ q, int q_row_stride, const int* __restrict__ rows,                         \
        const bf16* __restrict__ k_cache, const bf16* __restrict__ v_cache, const int* __restrict__ block_tables, \
        int bt_stride, const int* __restrict__ ctx_lens, int n_kv, int group, int block_shift, float scale,   \
        int n_splits, float* __restrict__ part_o, float* __restrict__ part_ml) {                             \
        decode_attn_tc_impl<D, KT, STAGES>(q, q_row_stride, rows, k_cache, v_cache, block_tables, bt_stride, \
                                           ctx_lens, n_kv, group, block_shift, scale, n_splits, part_o, part_ml); \
    }

// 64-token tiles, 16 per warp (32-token tiles, 8 per warp through m16n8k8, measured 1-5% slower on
// an H200: crates/kernels-sm120/NOTES.md).
// MIN_BLOCKS: the resident blocks shared memory allows on an H100/H200 (registers must not be the
// tighter limit).
DECODE_ATTN_TC(decode_attn_tc_d64, 64, 64, 3, 4)
DECODE_ATTN_TC(decode_attn_tc_d128, 128, 64, 2, 3)
