// Paged decode attention with grouped-query heads, split over the KV length (flash-decoding).
//
// Pass 1 (`decode_attn_d{64,128}_g{1..8}`: head size D, G query heads per KV head): grid
// (batch * kv_heads, splits), DA_THREADS threads. A block takes one sequence, one KV head (and the G
// query heads that share it) and one contiguous slice of the context: ceil(ctx / splits) tokens.
// Inside the block, D/8 lanes share a token (8 dimensions each, one 16-byte load) and form a
// subgroup; each subgroup walks its own tokens DA_TB at a time with its own online softmax, issuing
// all K and V loads of a step before using them (many loads in flight: the kernel is bound by memory
// latency otherwise), with no block-wide barrier in the loop. The subgroups merge at the end; the
// block writes an unnormalised partial output and its max and sum. A slice past the end of a short
// sequence writes max = -inf, sum = 0.
//
// Pass 2 (`decode_attn_reduce`): grid (batch * q_heads), combines the splits:
// out = sum_s exp(m_s - m) * o_s / sum_s exp(m_s - m) * l_s.
//
// Every loop that contains a warp shuffle runs the same number of times on all lanes of the block
// (lanes without a token compute on zeros and mask the score), so no context length can leave a
// warp waiting at a shuffle.

#define DA_THREADS 128
// Tokens per lane group per step: fewer for large groups, whose accumulators need the registers.
#define DA_TB(G) ((G) > 4 ? 2 : 4)

template <int D, int G>
__device__ __forceinline__ void decode_attn_impl(
    const float* __restrict__ q, int q_row_stride, const int* __restrict__ rows, const bf16* __restrict__ k_cache,
    const bf16* __restrict__ v_cache, const int* __restrict__ block_tables, int bt_stride,
    const int* __restrict__ ctx_lens, int n_kv, int block_size, float scale, int n_splits,
    float* __restrict__ part_o, float* __restrict__ part_ml) {
    constexpr int LANES = D / 8;
    constexpr int NSG = DA_THREADS / LANES;
    constexpr int TB = DA_TB(G);
    __shared__ __align__(16) float s_q[G][D];
    __shared__ float s_ml[NSG][G][2];
    __shared__ float s_red[NSG * D];

    const int b = blockIdx.x / n_kv, kvh = blockIdx.x % n_kv, split = blockIdx.y;
    const int tid = threadIdx.x, sg = tid / LANES, lane = tid % LANES;
    const int n_q = n_kv * G;
    const int ctx = ctx_lens[b];
    const int chunk = (ctx + n_splits - 1) / n_splits;
    const int t0 = min(ctx, split * chunk), t1 = min(ctx, t0 + chunk);
    const size_t kv_row = (size_t)n_kv * D;
    const size_t head_off = (size_t)kvh * D + lane * 8;

    const float* qb = q + (size_t)rows[b] * q_row_stride + (size_t)kvh * G * D;
    for (int i = tid; i < G * D; i += DA_THREADS) s_q[i / D][i % D] = qb[i] * scale;
    __syncthreads();

    float m[G], l[G], acc[G][8];
#pragma unroll
    for (int g = 0; g < G; ++g) {
        m[g] = NEG_INF;
        l[g] = 0.f;
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[g][j] = 0.f;
    }

    const int* bt = block_tables + (size_t)b * bt_stride;
    const int per_iter = NSG * TB;
    const int iters = (t1 - t0 + per_iter - 1) / per_iter;  // the same for every lane of the block
    for (int it = 0; it < iters; ++it) {
        const int base = t0 + (it * NSG + sg) * TB;
        uint4 kraw[TB], vraw[TB];
#pragma unroll
        for (int j = 0; j < TB; ++j) {
            const int pos = base + j;
            if (pos < t1) {
                const size_t slot = (size_t)bt[pos / block_size] * block_size + pos % block_size;
                kraw[j] = *reinterpret_cast<const uint4*>(k_cache + slot * kv_row + head_off);
                vraw[j] = *reinterpret_cast<const uint4*>(v_cache + slot * kv_row + head_off);
            } else {
                kraw[j] = make_uint4(0, 0, 0, 0);
                vraw[j] = make_uint4(0, 0, 0, 0);
            }
        }
        float sc[G][TB];
#pragma unroll
        for (int j = 0; j < TB; ++j) {
            float k[8];
            unpack8(kraw[j], k);
#pragma unroll
            for (int g = 0; g < G; ++g) {
                // q from shared memory (two 16-byte reads): registers go to loads in flight instead.
                const float4 qa = *reinterpret_cast<const float4*>(&s_q[g][lane * 8]);
                const float4 qb2 = *reinterpret_cast<const float4*>(&s_q[g][lane * 8 + 4]);
                float s = qa.x * k[0] + qa.y * k[1] + qa.z * k[2] + qa.w * k[3] + qb2.x * k[4] + qb2.y * k[5] +
                          qb2.z * k[6] + qb2.w * k[7];
#pragma unroll
                for (int o = LANES / 2; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o, LANES);
                sc[g][j] = base + j < t1 ? s : NEG_INF;
            }
        }
#pragma unroll
        for (int g = 0; g < G; ++g) {
            float mt = sc[g][0];
#pragma unroll
            for (int j = 1; j < TB; ++j) mt = fmaxf(mt, sc[g][j]);
            if (mt == NEG_INF) {  // no token of this subgroup in this step: nothing to add
#pragma unroll
                for (int j = 0; j < TB; ++j) sc[g][j] = 0.f;
                continue;
            }
            const float m_new = fmaxf(m[g], mt);
            const float alpha = m[g] == NEG_INF ? 0.f : expf(m[g] - m_new);
            m[g] = m_new;
            l[g] *= alpha;
#pragma unroll
            for (int d = 0; d < 8; ++d) acc[g][d] *= alpha;
#pragma unroll
            for (int j = 0; j < TB; ++j) sc[g][j] = sc[g][j] == NEG_INF ? 0.f : expf(sc[g][j] - m_new);
        }
#pragma unroll
        for (int j = 0; j < TB; ++j) {
            float v[8];
            unpack8(vraw[j], v);
#pragma unroll
            for (int g = 0; g < G; ++g) {
                const float p = sc[g][j];
                l[g] += p;
#pragma unroll
                for (int d = 0; d < 8; ++d) acc[g][d] += p * v[d];
            }
        }
    }

    // Merge the subgroups: common max per query head, rescale, sum.
    if (lane == 0) {
#pragma unroll
        for (int g = 0; g < G; ++g) {
            s_ml[sg][g][0] = m[g];
            s_ml[sg][g][1] = l[g];
        }
    }
    __syncthreads();
#pragma unroll
    for (int g = 0; g < G; ++g) {
        float mb = NEG_INF;
        for (int k = 0; k < NSG; ++k) mb = fmaxf(mb, s_ml[k][g][0]);
        const float f = m[g] == NEG_INF ? 0.f : expf(m[g] - mb);
#pragma unroll
        for (int d = 0; d < 8; ++d) s_red[sg * D + lane * 8 + d] = acc[g][d] * f;
        __syncthreads();
        const size_t idx = ((size_t)b * n_q + kvh * G + g) * n_splits + split;
        for (int d = tid; d < D; d += DA_THREADS) {
            float s = 0.f;
            for (int k = 0; k < NSG; ++k) s += s_red[k * D + d];
            part_o[idx * D + d] = s;
        }
        if (tid == 0) {
            float lb = 0.f;
            for (int k = 0; k < NSG; ++k)
                if (s_ml[k][g][0] != NEG_INF) lb += s_ml[k][g][1] * expf(s_ml[k][g][0] - mb);
            part_ml[2 * idx] = mb;
            part_ml[2 * idx + 1] = lb;
        }
        __syncthreads();
    }
}

#define DECODE_ATTN(D, G)                                                                                     \
    extern "C" __global__ void __launch_bounds__(DA_THREADS, 2) decode_attn_d##D##_g##G(                         \
        const float* __restrict__ q, int q_row_stride, const int* __restrict__ rows,                         \
        const bf16* __restrict__ k_cache, const bf16* __restrict__ v_cache, const int* __restrict__ block_tables, \
        int bt_stride, const int* __restrict__ ctx_lens, int n_kv, int block_size, float scale, int n_splits, \
        float* __restrict__ part_o, float* __restrict__ part_ml) {                                           \
        decode_attn_impl<D, G>(q, q_row_stride, rows, k_cache, v_cache, block_tables, bt_stride, ctx_lens, n_kv, \
                               block_size, scale, n_splits, part_o, part_ml);                               \
    }

DECODE_ATTN(64, 1)
DECODE_ATTN(64, 2)
DECODE_ATTN(64, 3)
DECODE_ATTN(64, 4)
DECODE_ATTN(64, 5)
DECODE_ATTN(64, 6)
DECODE_ATTN(64, 7)
DECODE_ATTN(64, 8)
DECODE_ATTN(128, 1)
DECODE_ATTN(128, 2)
DECODE_ATTN(128, 3)
DECODE_ATTN(128, 4)
DECODE_ATTN(128, 5)
DECODE_ATTN(128, 6)
DECODE_ATTN(128, 7)
DECODE_ATTN(128, 8)

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
