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
