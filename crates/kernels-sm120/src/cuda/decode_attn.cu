// Paged decode attention with grouped-query heads, split over the KV length (flash-decoding).
//
// Pass 1 (`decode_attn_d{64,128}_g{1..8}`: head size D, G query heads per KV head): grid
// (batch * kv_heads, splits), DA_THREADS threads. A block takes one sequence, one KV head (and the G
// query heads that share it) and one contiguous slice of the context: ceil(ctx / splits) tokens.
// Inside the block, D/8 lanes share a token (8 dimensions each, one 16-byte chunk) and form a lane
// group; each group walks its own tokens DA_TB at a time with its own online softmax, with no
// block-wide barrier in the loop. K and V arrive through a DA_STAGES-deep cp.async pipeline into
// per-thread shared-memory staging (each thread reads back only what it copied, so only its own
// cp.async.wait is needed): the kernel is bound by memory latency unless many loads are in flight. The subgroups merge at the end; the
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
// Tokens per lane group per pipeline step, and steps in flight.
#define DA_TB 2
#define DA_STAGES 5

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
    const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
__device__ __forceinline__ void cp_async_wait_stages() { asm volatile("cp.async.wait_group %0;\n" ::"n"(DA_STAGES - 1)); }
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;\n" ::); }

template <int D, int G>
__device__ __forceinline__ void decode_attn_impl(
    const float* __restrict__ q, int q_row_stride, const int* __restrict__ rows, const bf16* __restrict__ k_cache,
    const bf16* __restrict__ v_cache, const int* __restrict__ block_tables, int bt_stride,
    const int* __restrict__ ctx_lens, int n_kv, int block_size, float scale, int n_splits,
    float* __restrict__ part_o, float* __restrict__ part_ml) {
    constexpr int LANES = D / 8;
    constexpr int NSG = DA_THREADS / LANES;
    // Each thread's private staging: [stage][token][K|V] 16-byte chunks, thread-major so that a warp's
    // reads and writes are contiguous. Reused for the final reduction.
    __shared__ __align__(16) uint4 s_stage[DA_STAGES * DA_TB * 2][DA_THREADS];
    __shared__ __align__(16) float s_q[G][D];
    __shared__ float s_ml[NSG][G][2];
    float* s_red = reinterpret_cast<float*>(s_stage);  // NSG * D floats, after the loop

    const int b = blockIdx.x / n_kv, kvh = blockIdx.x % n_kv, split = blockIdx.y;
    const int tid = threadIdx.x, sg = tid / LANES, lane = tid % LANES;
    const int n_q = n_kv * G;
    const int ctx = ctx_lens[b];
    const int chunk = (ctx + n_splits - 1) / n_splits;
    const int t0 = min(ctx, split * chunk), t1 = min(ctx, t0 + chunk);
    const size_t kv_row = (size_t)n_kv * D;
    const size_t head_off = (size_t)kvh * D + lane * 8;
    const int* bt = block_tables + (size_t)b * bt_stride;
    const int per_iter = NSG * DA_TB;
    const int iters = (t1 - t0 + per_iter - 1) / per_iter;  // the same for every lane of the block

    // Issues the copies of step `it` (tokens past the slice are skipped, and masked when used).
    auto issue = [&](int it) {
        if (it < iters) {
            const int base = t0 + (it * NSG + sg) * DA_TB;
            const int st = it % DA_STAGES;
#pragma unroll
            for (int j = 0; j < DA_TB; ++j) {
                const int pos = base + j;
                if (pos < t1) {
                    const size_t slot = (size_t)bt[pos / block_size] * block_size + pos % block_size;
                    cp_async16(&s_stage[(st * DA_TB + j) * 2][tid], k_cache + slot * kv_row + head_off);
                    cp_async16(&s_stage[(st * DA_TB + j) * 2 + 1][tid], v_cache + slot * kv_row + head_off);
                }
            }
        }
        cp_async_commit();  // an empty group past the end keeps the wait count uniform
    };
#pragma unroll
    for (int st = 0; st < DA_STAGES - 1; ++st) issue(st);

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

    for (int it = 0; it < iters; ++it) {
        issue(it + DA_STAGES - 1);
        cp_async_wait_stages();  // this thread's copies of step `it` have landed
        const int base = t0 + (it * NSG + sg) * DA_TB;
        const int st = it % DA_STAGES;
        float sc[G][DA_TB];
#pragma unroll
        for (int j = 0; j < DA_TB; ++j) {
            const bool valid = base + j < t1;
            float k[8];
            unpack8(valid ? s_stage[(st * DA_TB + j) * 2][tid] : make_uint4(0, 0, 0, 0), k);
#pragma unroll
            for (int g = 0; g < G; ++g) {
                const float4 qa = *reinterpret_cast<const float4*>(&s_q[g][lane * 8]);
                const float4 qc = *reinterpret_cast<const float4*>(&s_q[g][lane * 8 + 4]);
                float s = qa.x * k[0] + qa.y * k[1] + qa.z * k[2] + qa.w * k[3] + qc.x * k[4] + qc.y * k[5] +
                          qc.z * k[6] + qc.w * k[7];
#pragma unroll
                for (int o = LANES / 2; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o, LANES);
                sc[g][j] = valid ? s : NEG_INF;
            }
        }
#pragma unroll
        for (int g = 0; g < G; ++g) {
            float mt = sc[g][0];
#pragma unroll
            for (int j = 1; j < DA_TB; ++j) mt = fmaxf(mt, sc[g][j]);
            if (mt == NEG_INF) {  // no token of this lane group in this step: nothing to add
#pragma unroll
                for (int j = 0; j < DA_TB; ++j) sc[g][j] = 0.f;
                continue;
            }
            const float m_new = fmaxf(m[g], mt);
            const float alpha = m[g] == NEG_INF ? 0.f : expf(m[g] - m_new);
            m[g] = m_new;
            l[g] *= alpha;
#pragma unroll
            for (int d = 0; d < 8; ++d) acc[g][d] *= alpha;
#pragma unroll
            for (int j = 0; j < DA_TB; ++j) sc[g][j] = sc[g][j] == NEG_INF ? 0.f : expf(sc[g][j] - m_new);
        }
#pragma unroll
        for (int j = 0; j < DA_TB; ++j) {
            const bool valid = base + j < t1;
            float v[8];
            unpack8(valid ? s_stage[(st * DA_TB + j) * 2 + 1][tid] : make_uint4(0, 0, 0, 0), v);
#pragma unroll
            for (int g = 0; g < G; ++g) {
                const float p = sc[g][j];
                l[g] += p;
#pragma unroll
                for (int d = 0; d < 8; ++d) acc[g][d] += p * v[d];
            }
        }
    }
    cp_async_wait_all();

    // Merge the lane groups: common max per query head, rescale, sum.
    if (lane == 0) {
#pragma unroll
        for (int g = 0; g < G; ++g) {
            s_ml[sg][g][0] = m[g];
            s_ml[sg][g][1] = l[g];
        }
    }
    __syncthreads();  // also: every thread is done with the staging buffer that s_red reuses
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
