// RMSNorm fused with the residual add: one block per row.
//   if has_add: x[row] += add[row]            (x is updated in place: the residual stream)
//   out[row] = bf16(x[row] * rsqrt(mean(x[row]^2) + eps) * w)
extern "C" __global__ void rmsnorm_residual(float* __restrict__ x, const float* __restrict__ add, int has_add,
                                            const bf16* __restrict__ w, bf16* __restrict__ out, int dim,
                                            float eps) {
    __shared__ float sh[33];
    size_t row = blockIdx.x;
    float* xr = x + row * dim;
    const float* ar = add + row * dim;
    float ss = 0.f;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) {
        float v = xr[i];
        if (has_add) {
            v += ar[i];
            xr[i] = v;
        }
        ss += v * v;
    }
    float inv = 1.f / sqrtf(block_sum(ss, sh) / (float)dim + eps);
    bf16* o = out + row * dim;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) o[i] = f2bf(xr[i] * inv * bf2f(w[i]));
}

// Per-head RMSNorm in place (Qwen3's q_norm and k_norm, before RoPE), on the f32 rows of a fused QKV
// matrix: the first `q_heads` heads of each row with `wq`, the next `k_heads` with `wk` (f32 weights of
// `head_dim`). One warp per head; blockDim.x = 32 * heads per block.
extern "C" __global__ void head_rmsnorm(float* __restrict__ qkv, int row_stride, int q_heads, int k_heads,
                                        int head_dim, const float* __restrict__ wq,
                                        const float* __restrict__ wk, float eps, long long total) {
    long long idx = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (idx >= total) return;
    int lane = threadIdx.x & 31, heads = q_heads + k_heads;
    long long row = idx / heads;
    int h = (int)(idx - row * heads);
    float* v = qkv + row * row_stride + (long long)h * head_dim;
    const float* w = h < q_heads ? wq : wk;
    float ss = 0.f;
    for (int i = lane; i < head_dim; i += 32) ss += v[i] * v[i];
    float inv = 1.f / sqrtf(warp_sum(ss) / (float)head_dim + eps);
    for (int i = lane; i < head_dim; i += 32) v[i] = v[i] * inv * w[i];
}
