// Prefill attention on the tensor cores (mma.sync bf16, f32 accumulation) over paged KV with a causal
// mask: the same tile table, arguments and output as prefill_attn.cu, with tiles of up to PT_PAIRS
// query vectors.
//
// A block (PT_THREADS = 4 warps) takes one tile (rows of one sequence) and one KV head: the tile's
// rows x group query vectors ("pairs", pair p = row p / group, head p % group of the group), 16 per
// warp, and walks the keys 0 ..= the tile's last position in tiles of PT_KT = 64, K and V copied
// into shared memory with cp.async (keys past the end zero-filled). Per key tile each warp computes
//   S[16 x 64] = Q[16 x D] . K^T  (m16n8k16; Q scaled, bf16 fragments held in registers)
//   causal mask and online softmax per row on the fragments (a row lives in the four lanes of a quad)
//   O[16 x D] += P[16 x 64] . V   (m16n8k16; P from the score fragments, V through ldmatrix.trans)
// and at the end writes O / l for its valid pairs. Query at position p sees keys 0 ..= p. The new
// tokens' K/V must already be in the cache.

#define PT_THREADS 128
#define PT_KT 64
#define PT_PAIRS 64

template <int D>
__device__ __forceinline__ void prefill_attn_tc_impl(
    const float* __restrict__ q, int q_row_stride, const bf16* __restrict__ k_cache,
    const bf16* __restrict__ v_cache, const int* __restrict__ block_tables, int bt_stride,
    const int* __restrict__ tiles, int n_kv, int group, int block_size, float scale, float* __restrict__ out,
    int out_row_stride) {
    constexpr int STRIDE = D + 8;                    // bf16 per smem row: no bank conflicts
    constexpr int CPR = D / 8;                       // 16-byte chunks per K or V row
    constexpr int ROWS_PER_PASS = PT_THREADS / CPR;  // a warp's copies cover whole rows
    constexpr int NT = D / 8;                        // 8-wide output n-tiles
    __shared__ __align__(16) bf16 s_k[PT_KT * STRIDE];
    __shared__ __align__(16) bf16 s_v[PT_KT * STRIDE];

    const int tile = blockIdx.x, kvh = blockIdx.y;
    const int seq = tiles[4 * tile], row0 = tiles[4 * tile + 1], n_rows = tiles[4 * tile + 2],
              pos0 = tiles[4 * tile + 3];
    const int P = n_rows * group;
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, gid = lane >> 2, tig = lane & 3;
    const size_t kv_row = (size_t)n_kv * D;
    const int* bt = block_tables + (size_t)seq * bt_stride;
    const int kv_end = pos0 + n_rows;

    // This lane's two pairs (rows gid and gid + 8 of the warp's 16) and their positions.
    int pair[2], qpos[2];
    bool valid[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        pair[h] = warp * 16 + gid + 8 * h;
        valid[h] = pair[h] < P;
        qpos[h] = pos0 + (valid[h] ? pair[h] / group : 0);
    }
    // Q fragments (scaled, bf16), one set per 16 dimensions, read straight from the f32 rows.
    unsigned qa[D / 16][4];
    {
        const float* qr[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int r = valid[h] ? pair[h] / group : 0, g = valid[h] ? pair[h] % group : 0;
            qr[h] = q + (size_t)(row0 + r) * q_row_stride + (size_t)(kvh * group + g) * D;
        }
#pragma unroll
        for (int kc = 0; kc < D / 16; ++kc) {
            const int d = kc * 16 + tig * 2;
            qa[kc][0] = valid[0] ? pack_bf16(qr[0][d] * scale, qr[0][d + 1] * scale) : 0u;
            qa[kc][1] = valid[1] ? pack_bf16(qr[1][d] * scale, qr[1][d + 1] * scale) : 0u;
            qa[kc][2] = valid[0] ? pack_bf16(qr[0][d + 8] * scale, qr[0][d + 9] * scale) : 0u;
            qa[kc][3] = valid[1] ? pack_bf16(qr[1][d + 8] * scale, qr[1][d + 9] * scale) : 0u;
        }
    }

    float o[NT][4];
#pragma unroll
    for (int n = 0; n < NT; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
    float m[2] = {NEG_INF, NEG_INF}, l[2] = {0.f, 0.f};  // l: this lane's keys only
    const int ld_c = tid % CPR, ld_r = tid / CPR;

    for (int kb = 0; kb < kv_end; kb += PT_KT) {
        __syncthreads();  // the previous tile's readers are done
#pragma unroll
        for (int r = ld_r; r < PT_KT; r += ROWS_PER_PASS) {
            const int pos = kb + r;
            const bool in = pos < kv_end;
            const size_t slot = in ? (size_t)bt[pos / block_size] * block_size + pos % block_size : 0;
            const size_t off = slot * kv_row + (size_t)kvh * D + ld_c * 8;
            cp_async16_zfill(s_k + r * STRIDE + ld_c * 8, k_cache + off, in);
            cp_async16_zfill(s_v + r * STRIDE + ld_c * 8, v_cache + off, in);
        }
        tc_commit();
        tc_wait<0>();
        __syncthreads();
        // A warp whose pairs all come before this key tile has nothing to add (causal).
        const int last_pos = pos0 + min(P - 1, warp * 16 + 15) / group;
        if (warp * 16 >= P || kb > last_pos) continue;

        // Scores: s[j][0..1] row gid, keys kb + 8j + 2 tig + {0, 1}; s[j][2..3] row gid + 8.
        float s[PT_KT / 8][4];
#pragma unroll
        for (int j = 0; j < PT_KT / 8; ++j) {
            s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
#pragma unroll
            for (int kc = 0; kc < D / 16; ++kc) {
                const bf16* kr = s_k + (8 * j + gid) * STRIDE + kc * 16 + tig * 2;
                const unsigned b0 = *reinterpret_cast<const unsigned*>(kr);
                const unsigned b1 = *reinterpret_cast<const unsigned*>(kr + 8);
                mma_k16(s[j], qa[kc][0], qa[kc][1], qa[kc][2], qa[kc][3], b0, b1);
            }
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int key = kb + 8 * j + tig * 2 + e;
                if (key > qpos[0] || key >= kv_end) s[j][e] = NEG_INF;
                if (key > qpos[1] || key >= kv_end) s[j][2 + e] = NEG_INF;
            }
        }
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            float mx = NEG_INF;
#pragma unroll
            for (int j = 0; j < PT_KT / 8; ++j) mx = fmaxf(mx, fmaxf(s[j][2 * h], s[j][2 * h + 1]));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
            const float m_new = fmaxf(m[h], mx);
            if (m_new == NEG_INF) {  // no key of this row so far (an invalid pair)
#pragma unroll
                for (int j = 0; j < PT_KT / 8; ++j) s[j][2 * h] = s[j][2 * h + 1] = 0.f;
                continue;
            }
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
            for (int j = 0; j < PT_KT / 8; ++j) {
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const float v = s[j][2 * h + e];
                    const float p = v == NEG_INF ? 0.f : expf(v - m_new);
                    s[j][2 * h + e] = p;
                    l[h] += p;
                }
            }
        }
        // O += P . V, 16 keys per step: the score fragments of key blocks 2kk and 2kk + 1 are the A
        // fragment; V's (16 keys x 8 dims) B fragments through ldmatrix.trans, two n-tiles at a time.
#pragma unroll
        for (int kk = 0; kk < PT_KT / 16; ++kk) {
            const unsigned a0 = pack_bf16(s[2 * kk][0], s[2 * kk][1]);
            const unsigned a1 = pack_bf16(s[2 * kk][2], s[2 * kk][3]);
            const unsigned a2 = pack_bf16(s[2 * kk + 1][0], s[2 * kk + 1][1]);
            const unsigned a3 = pack_bf16(s[2 * kk + 1][2], s[2 * kk + 1][3]);
            const int mi = lane >> 3;
#pragma unroll
            for (int n = 0; n < NT; n += 2) {
                unsigned bv[4];
                ldmatrix_x4_trans(bv, s_v + (16 * kk + (mi & 1) * 8 + (lane & 7)) * STRIDE + (n + (mi >> 1)) * 8);
                mma_k16(o[n], a0, a1, a2, a3, bv[0], bv[1]);
                mma_k16(o[n + 1], a0, a1, a2, a3, bv[2], bv[3]);
            }
        }
    }

    // Row sums over the quad, then O / l for the valid pairs.
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        l[h] += __shfl_xor_sync(0xffffffffu, l[h], 1);
        l[h] += __shfl_xor_sync(0xffffffffu, l[h], 2);
        if (!valid[h]) continue;
        const int r = pair[h] / group, g = pair[h] % group;
        float* dst = out + (size_t)(row0 + r) * out_row_stride + (size_t)(kvh * group + g) * D;
        const float inv = 1.f / l[h];
#pragma unroll
        for (int n = 0; n < NT; ++n) {
            const int d = n * 8 + tig * 2;
            dst[d] = o[n][2 * h] * inv;
            dst[d + 1] = o[n][2 * h + 1] * inv;
        }
    }
}

#define PREFILL_ATTN_TC(D)                                                                                      \
    extern "C" __global__ void __launch_bounds__(PT_THREADS) prefill_attn_tc_d##D(                            \
        const float* __restrict__ q, int q_row_stride, const bf16* __restrict__ k_cache,                      \
        const bf16* __restrict__ v_cache, const int* __restrict__ block_tables, int bt_stride,                 \
        const int* __restrict__ tiles, int n_kv, int group, int block_size, float scale, float* __restrict__ out, \
        int out_row_stride) {                                                                                  \
        prefill_attn_tc_impl<D>(q, q_row_stride, k_cache, v_cache, block_tables, bt_stride, tiles, n_kv,       \
                                group, block_size, scale, out, out_row_stride);                               \
    }

PREFILL_ATTN_TC(64)
PREFILL_ATTN_TC(128)
