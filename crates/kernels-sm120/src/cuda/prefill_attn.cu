// Prefill attention over paged KV with a causal mask (chunked prefill on top of a cached prefix).
//
// The host cuts every prefill sequence's new tokens into tiles of at most PA_MAXP / group rows; the
// tile table holds 4 ints per tile: (sequence, first row, rows, position of the first row). Grid
// (tiles, kv_heads), PA_THREADS threads. A block takes one tile and one KV head, i.e. rows * group
// query vectors ("pairs"), and walks the keys 0 ..= last position of the tile in tiles of PA_KT, with
// K (f32, padded rows: no bank conflicts) and V (bf16) staged in shared memory and an online softmax
// per pair. Query at position p sees keys 0 ..= p. The new tokens' K/V must already be in the cache.

#define PA_THREADS 128
#define PA_KT 32
#define PA_MAXP 16

template <int D>
__device__ __forceinline__ void prefill_attn_impl(
    const float* __restrict__ q, int q_row_stride, const bf16* __restrict__ k_cache,
    const bf16* __restrict__ v_cache, const int* __restrict__ block_tables, int bt_stride,
    const int* __restrict__ tiles, int n_kv, int group, int block_size, float scale, float* __restrict__ out,
    int out_row_stride) {
    __shared__ float s_q[PA_MAXP][D];
    __shared__ float s_acc[PA_MAXP][D];
    __shared__ float s_k[PA_KT][D + 1];
    __shared__ __align__(16) bf16 s_v[PA_KT * D];
    __shared__ float s_s[PA_MAXP][PA_KT];
    __shared__ float s_m[PA_MAXP], s_l[PA_MAXP], s_alpha[PA_MAXP];

    const int tile = blockIdx.x, kvh = blockIdx.y;
    const int seq = tiles[4 * tile], row0 = tiles[4 * tile + 1], n_rows = tiles[4 * tile + 2],
              pos0 = tiles[4 * tile + 3];
    const int P = n_rows * group;
    const int tid = threadIdx.x, warp = tid / 32, wl = tid % 32;
    const size_t kv_row = (size_t)n_kv * D;
    const int* bt = block_tables + (size_t)seq * bt_stride;

    for (int i = tid; i < P * D; i += PA_THREADS) {
        const int p = i / D, d = i % D, r = p / group, g = p % group;
        s_q[p][d] = q[(size_t)(row0 + r) * q_row_stride + (size_t)(kvh * group + g) * D + d] * scale;
        s_acc[p][d] = 0.f;
    }
    if (tid < P) {
        s_m[tid] = NEG_INF;
        s_l[tid] = 0.f;
    }

    const int kv_end = pos0 + n_rows;
    for (int kb = 0; kb < kv_end; kb += PA_KT) {
        const int nk = min(PA_KT, kv_end - kb);
        __syncthreads();
        for (int i = tid; i < nk * (D / 8); i += PA_THREADS) {
            const int t = i / (D / 8), c = i % (D / 8), pos = kb + t;
            const size_t slot = (size_t)bt[pos / block_size] * block_size + pos % block_size;
            const size_t off = slot * kv_row + (size_t)kvh * D + c * 8;
            float k[8];
            unpack8(*reinterpret_cast<const uint4*>(k_cache + off), k);
#pragma unroll
            for (int j = 0; j < 8; ++j) s_k[t][c * 8 + j] = k[j];
            *reinterpret_cast<uint4*>(s_v + t * D + c * 8) = *reinterpret_cast<const uint4*>(v_cache + off);
        }
        __syncthreads();
        for (int i = tid; i < P * PA_KT; i += PA_THREADS) {
            const int p = i / PA_KT, t = i % PA_KT, r = p / group;
            float s = NEG_INF;
            if (t < nk && kb + t <= pos0 + r) {
                s = 0.f;
#pragma unroll 8
                for (int d = 0; d < D; ++d) s += s_q[p][d] * s_k[t][d];
            }
            s_s[p][t] = s;
        }
        __syncthreads();
        for (int p = warp; p < P; p += PA_THREADS / 32) {
            const float v = s_s[p][wl];
            const float m_old = s_m[p];
            const float m_new = fmaxf(m_old, warp_max(v));
            const float e = v == NEG_INF ? 0.f : expf(v - m_new);
            s_s[p][wl] = e;
            const float sum = warp_sum(e);
            if (wl == 0) {
                const float alpha = m_old == NEG_INF ? 0.f : expf(m_old - m_new);
                s_alpha[p] = alpha;
                s_l[p] = s_l[p] * alpha + sum;
                s_m[p] = m_new;
            }
        }
        __syncthreads();
        for (int i = tid; i < P * D; i += PA_THREADS) {
            const int p = i / D, d = i % D;
            float a = s_acc[p][d] * s_alpha[p];
            for (int t = 0; t < nk; ++t) a += s_s[p][t] * bf2f(s_v[t * D + d]);
            s_acc[p][d] = a;
        }
    }
    __syncthreads();
    for (int i = tid; i < P * D; i += PA_THREADS) {
        const int p = i / D, d = i % D, r = p / group, g = p % group;
        out[(size_t)(row0 + r) * out_row_stride + (size_t)(kvh * group + g) * D + d] = s_acc[p][d] / s_l[p];
    }
}

#define PREFILL_ATTN(D)                                                                                        \
    extern "C" __global__ void __launch_bounds__(PA_THREADS) prefill_attn_d##D(                               \
        const float* __restrict__ q, int q_row_stride, const bf16* __restrict__ k_cache,                      \
        const bf16* __restrict__ v_cache, const int* __restrict__ block_tables, int bt_stride,                 \
        const int* __restrict__ tiles, int n_kv, int group, int block_size, float scale, float* __restrict__ out, \
        int out_row_stride) {                                                                                  \
        prefill_attn_impl<D>(q, q_row_stride, k_cache, v_cache, block_tables, bt_stride, tiles, n_kv, group,   \
                             block_size, scale, out, out_row_stride);                                          \
    }

PREFILL_ATTN(64)
PREFILL_ATTN(128)
