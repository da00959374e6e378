// Skinny products for decode steps: y[r][j] = sum_i x[r][i] * w[j][i] for r < t (t <= GEMV_MAX_ROWS),
// j < n; bf16 inputs, f32 accumulation and output, all row-major (the same contract as the cuBLAS
// GEMM of Gpu::gemm_bf16). A decode step reads every weight once, so this is a bandwidth problem:
// one warp per output column j streams w's row j in 16-byte runs (k % 8 == 0, rows 16-byte
// aligned), four loads in flight per lane, the weights read without allocating in L1 (they are not
// read again this step) and x through the read-only cache (every warp reads all of it).

#define GEMV_MAX_ROWS 8
#define GEMV_WARPS 8

__device__ __forceinline__ uint4 load_stream(const uint4* p) {
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
}

__device__ __forceinline__ uint4 load_ro(const uint4* p) {
    uint4 v;
    asm volatile("ld.global.nc.v4.u32 {%0,%1,%2,%3}, [%4];\n" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}

extern "C" __global__ void __launch_bounds__(32 * GEMV_WARPS) gemv_bf16(const bf16* __restrict__ x,
                                                                       const bf16* __restrict__ w,
                                                                       float* __restrict__ y, int t, int k,
                                                                       int n) {
    int col = blockIdx.x * GEMV_WARPS + (threadIdx.x >> 5);
    int lane = threadIdx.x & 31;
    if (col >= n) return;
    const uint4* wr = (const uint4*)(w + (size_t)col * k);
    const uint4* xr = (const uint4*)x;
    int chunks = k >> 3, xstride = k >> 3;
    float acc[GEMV_MAX_ROWS];
#pragma unroll
    for (int r = 0; r < GEMV_MAX_ROWS; ++r) acc[r] = 0.f;
    int c = lane;
    // Four 16-byte weight loads in flight per lane, then their products.
    for (; c + 96 < chunks; c += 128) {
        uint4 wv[4];
#pragma unroll
        for (int u = 0; u < 4; ++u) wv[u] = load_stream(wr + c + 32 * u);
#pragma unroll
        for (int u = 0; u < 4; ++u) {
            float wf[8];
            unpack8(wv[u], wf);
#pragma unroll
            for (int r = 0; r < GEMV_MAX_ROWS; ++r) {
                if (r < t) {
                    float xf[8];
                    unpack8(load_ro(xr + (size_t)r * xstride + c + 32 * u), xf);
#pragma unroll
                    for (int e = 0; e < 8; ++e) acc[r] = fmaf(wf[e], xf[e], acc[r]);
                }
            }
        }
    }
    for (; c < chunks; c += 32) {
        float wf[8];
        unpack8(load_stream(wr + c), wf);
#pragma unroll
        for (int r = 0; r < GEMV_MAX_ROWS; ++r) {
            if (r < t) {
                float xf[8];
                unpack8(load_ro(xr + (size_t)r * xstride + c), xf);
#pragma unroll
                for (int e = 0; e < 8; ++e) acc[r] = fmaf(wf[e], xf[e], acc[r]);
            }
        }
    }
#pragma unroll
    for (int r = 0; r < GEMV_MAX_ROWS; ++r) {
        if (r < t) {
            float s = warp_sum(acc[r]);
            if (lane == 0) y[(size_t)r * n + col] = s;
        }
    }
}
