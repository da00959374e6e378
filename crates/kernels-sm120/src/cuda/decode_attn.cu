// Paged decode attention with grouped-query heads, split over the KV length (flash-decoding).
//
// Pass 1 (`decode_attn_d{64,128}`): grid (batch * kv_heads, splits), DA_THREADS threads. A block takes
// one sequence, one KV head (and the `group` query heads that share it) and one contiguous slice of the
// context: slice = ceil(ctx / splits) tokens. It walks its slice in tiles of DA_TILE tokens with an
// online softmax, reading each K and V row once with 16-byte loads: D/8 lanes per token, each lane
// holding 8 dimensions. It writes an unnormalised partial output and its running max and sum.
// A slice past the end of a short sequence writes max = -inf, sum = 0.
//
// Pass 2 (`decode_attn_reduce`): grid (batch * q_heads), combines the splits:
// out = sum_s exp(m_s - m) * o_s / sum_s exp(m_s - m) * l_s.
//
// Every loop that contains a warp shuffle runs the same number of times on all lanes of the warp
// (lanes without a token compute on zeros), so no context length can leave a warp waiting.

#define DA_THREADS 128
#define DA_TILE 64
#define DA_MAXG 8

template <int D>
__device__ __forceinline__ void decode_attn_impl(
    const float* __restrict__ q, int q_row_stride, const int* __restrict__ rows, const bf16* __restrict__ k_cache,
    const bf16* __restrict__ v_cache, const int* __restrict__ block_tables, int bt_stride,
    const int* __restrict__ ctx_lens, int n_kv, int group, int block_size, float scale, int n_splits,
    float* __restrict__ part_o, float* __restrict__ part_ml) {
    constexpr int LANES = D / 8;
    constexpr int NSG = DA_THREADS / LANES;
    __shared__ float s_q[DA_MAXG][D];
    __shared__ float s_p[DA_MAXG][DA_TILE];
    __shared__ float s_m[DA_MAXG], s_l[DA_MAXG], s_alpha[DA_MAXG];
    __shared__ float s_red[NSG * D];

    const int b = blockIdx.x / n_kv, kvh = blockIdx.x % n_kv, split = blockIdx.y;
    const int tid = threadIdx.x, sg = tid / LANES, lane = tid % LANES;
    const int warp = tid / 32, wl = tid % 32;
    const int n_q = n_kv * group;
    const int ctx = ctx_lens[b];
    const int chunk = (ctx + n_splits - 1) / n_splits;
    const int t0 = min(ctx, split * chunk), t1 = min(ctx, t0 + chunk);
    const size_t kv_row = (size_t)n_kv * D;

    const float* qb = q + (size_t)rows[b] * q_row_stride + (size_t)kvh * group * D;
    for (int i = tid; i < group * D; i += DA_THREADS) s_q[i / D][i % D] = qb[i] * scale;
    if (tid < group) {
        s_m[tid] = NEG_INF;
        s_l[tid] = 0.f;
    }
    float acc[DA_MAXG][8];
#pragma unroll
    for (int g = 0; g < DA_MAXG; ++g)
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[g][j] = 0.f;
    __syncthreads();

    const int* bt = block_tables + (size_t)b * bt_stride;
    for (int base = t0; base < t1; base += DA_TILE) {
        const int n = min(DA_TILE, t1 - base);
        // Scores for this tile (q was pre-scaled).
        for (int ti = 0; ti < n; ti += NSG) {
            const int t = ti + sg;
            const bool valid = t < n;
            float k[8];
            if (valid) {
                const int pos = base + t;
                const size_t slot = (size_t)bt[pos / block_size] * block_size + pos % block_size;
                unpack8(*reinterpret_cast<const uint4*>(k_cache + slot * kv_row + (size_t)kvh * D + lane * 8), k);
            } else {
#pragma unroll
                for (int j = 0; j < 8; ++j) k[j] = 0.f;
            }
#pragma unroll
            for (int g = 0; g < DA_MAXG; ++g) {
                if (g < group) {
                    float s = 0.f;
#pragma unroll
                    for (int j = 0; j < 8; ++j) s += s_q[g][lane * 8 + j] * k[j];
#pragma unroll
                    for (int o = LANES / 2; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o, LANES);
                    if (valid && lane == 0) s_p[g][t] = s;
                }
            }
        }
        __syncthreads();
        // Online softmax update, one warp per query head.
        for (int g = warp; g < group; g += DA_THREADS / 32) {
            const float v0 = wl < n ? s_p[g][wl] : NEG_INF;
            const float v1 = wl + 32 < n ? s_p[g][wl + 32] : NEG_INF;
            const float m_old = s_m[g];
            const float m_new = fmaxf(m_old, warp_max(fmaxf(v0, v1)));
            const float p0 = wl < n ? expf(v0 - m_new) : 0.f;
            const float p1 = wl + 32 < n ? expf(v1 - m_new) : 0.f;
            s_p[g][wl] = p0;
            s_p[g][wl + 32] = p1;
            const float sum = warp_sum(p0 + p1);
            if (wl == 0) {
                const float alpha = m_old == NEG_INF ? 0.f : expf(m_old - m_new);
                s_alpha[g] = alpha;
                s_l[g] = s_l[g] * alpha + sum;
                s_m[g] = m_new;
            }
        }
        __syncthreads();
        // Rescale and accumulate V.
#pragma unroll
        for (int g = 0; g < DA_MAXG; ++g) {
            if (g < group) {
                const float a = s_alpha[g];
#pragma unroll
                for (int j = 0; j < 8; ++j) acc[g][j] *= a;
            }
        }
        for (int t = sg; t < n; t += NSG) {
            const int pos = base + t;
            const size_t slot = (size_t)bt[pos / block_size] * block_size + pos % block_size;
            float v[8];
            unpack8(*reinterpret_cast<const uint4*>(v_cache + slot * kv_row + (size_t)kvh * D + lane * 8), v);
#pragma unroll
            for (int g = 0; g < DA_MAXG; ++g) {
                if (g < group) {
                    const float p = s_p[g][t];
#pragma unroll
                    for (int j = 0; j < 8; ++j) acc[g][j] += p * v[j];
                }
            }
        }
        __syncthreads();
    }

    // Sum the subgroups' accumulators, one query head at a time.
#pragma unroll
    for (int g = 0; g < DA_MAXG; ++g) {
        if (g < group) {
#pragma unroll
            for (int j = 0; j < 8; ++j) s_red[sg * D + lane * 8 + j] = acc[g][j];
            __syncthreads();
            const size_t idx = ((size_t)b * n_q + kvh * group + g) * n_splits + split;
            for (int d = tid; d < D; d += DA_THREADS) {
                float s = 0.f;
                for (int k = 0; k < NSG; ++k) s += s_red[k * D + d];
                part_o[idx * D + d] = s;
            }
            __syncthreads();
        }
    }
    if (tid < group) {
        const size_t idx = ((size_t)b * n_q + kvh * group + tid) * n_splits + split;
        part_ml[2 * idx] = s_m[tid];
        part_ml[2 * idx + 1] = s_l[tid];
    }
}

#define DECODE_ATTN(D)                                                                                        \
    extern "C" __global__ void __launch_bounds__(DA_THREADS) decode_attn_d##D(                               \
        const float* __restrict__ q, int q_row_stride, const int* __restrict__ rows,                         \
        const bf16* __restrict__ k_cache, const bf16* __restrict__ v_cache, const int* __restrict__ block_tables, \
        int bt_stride, const int* __restrict__ ctx_lens, int n_kv, int group, int block_size, float scale,    \
        int n_splits, float* __restrict__ part_o, float* __restrict__ part_ml) {                             \
        decode_attn_impl<D>(q, q_row_stride, rows, k_cache, v_cache, block_tables, bt_stride, ctx_lens, n_kv, \
                            group, block_size, scale, n_splits, part_o, part_ml);                            \
    }

DECODE_ATTN(64)
DECODE_ATTN(128)

// One block per (sequence, query head); out row = rows[b].
extern "C" __global__ void decode_attn_reduce(const float* __restrict__ part_o, const float* __restrict__ part_ml,
                                              const int* __restrict__ rows, float* __restrict__ out,
                                              int out_row_stride, int n_q, int head_dim, int n_splits) {
    const int bh = blockIdx.x, b = bh / n_q, h = bh % n_q;
    const float* ml = part_ml + (size_t)bh * n_splits * 2;
    float m = NEG_INF;
    for (int s = 0; s < n_splits; ++s) m = fmaxf(m, ml[2 * s]);
    float l = 0.f;
    for (int s = 0; s < n_splits; ++s)
        if (ml[2 * s] != NEG_INF) l += expf(ml[2 * s] - m) * ml[2 * s + 1];
    const float inv_l = 1.f / l;
    float* o = out + (size_t)rows[b] * out_row_stride + (size_t)h * head_dim;
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
        float acc = 0.f;
        for (int s = 0; s < n_splits; ++s)
            if (ml[2 * s] != NEG_INF) acc += expf(ml[2 * s] - m) * part_o[((size_t)bh * n_splits + s) * head_dim + d];
        o[d] = acc * inv_l;
    }
}
