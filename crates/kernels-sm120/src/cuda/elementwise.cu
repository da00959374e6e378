// Small row-wise and element-wise kernels: embedding gather, SwiGLU, casts, row gather, bias add,
// seeded random fill.

// out[row] = table[ids[row]] (bf16 table, f32 out). Ids outside the vocabulary give NaN rows (the host
// checks ids first; this only keeps a bad id from reading out of bounds).
extern "C" __global__ void embed_gather(const bf16* __restrict__ table, const unsigned* __restrict__ ids,
                                        float* __restrict__ out, int dim, unsigned vocab) {
    size_t row = blockIdx.x;
    unsigned id = ids[row];
    for (int i = threadIdx.x; i < dim; i += blockDim.x)
        out[row * dim + i] = id < vocab ? bf2f(table[(size_t)id * dim + i]) : __int_as_float(0x7fc00000);
}

// gu rows are [gate(inter) | up(inter)]; out = bf16(silu(gate) * up).
extern "C" __global__ void swiglu(const float* __restrict__ gu, bf16* __restrict__ out, int inter, long long n) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        long long r = i / inter;
        int j = (int)(i - r * inter);
        float g = gu[r * 2 * inter + j], u = gu[r * 2 * inter + inter + j];
        out[i] = f2bf(g / (1.f + expf(-g)) * u);
    }
}

extern "C" __global__ void cast_bf16(const float* __restrict__ in, bf16* __restrict__ out, long long n) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x)
        out[i] = f2bf(in[i]);
}

// out[i] = in[rows[i]] for bf16 rows of `dim` values.
extern "C" __global__ void gather_rows_bf16(const bf16* __restrict__ in, const int* __restrict__ rows,
                                            bf16* __restrict__ out, int dim) {
    size_t i = blockIdx.x;
    size_t src = (size_t)rows[i];
    for (int j = threadIdx.x; j < dim; j += blockDim.x) out[i * dim + j] = in[src * dim + j];
}

// x[r][j] += bias[j] for `rows` rows of `n` f32 values (attention biases).
extern "C" __global__ void add_bias_rows(float* __restrict__ x, const float* __restrict__ bias, int n,
                                         long long total) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x)
        x[i] += bias[i % n];
}

// out[i] = bf16(scale * u) with u uniform in [-1, 1) from splitmix64(seed + i * golden): seeded random
// weights made on the device (no host copy of a large model). reference::random_bf16 is the same.
extern "C" __global__ void fill_random_bf16(bf16* __restrict__ out, long long n, u64 seed, float scale) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        u64 x = seed + (u64)i * 0x9e3779b97f4a7c15ull;
        x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
        x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
        x ^= x >> 31;
        float u = (float)(x >> 40) * (1.0f / 8388608.0f) - 1.0f;
        out[i] = f2bf(u * scale);
    }
}
