// Rotate-half RoPE applied in place to the Q and K heads of each row of a fused QKV matrix. The Q
// heads and then the K heads sit at the start of each row (`n_heads` = Q heads + K heads).
// inv_freq[i] = theta^(-2i/head_dim), computed by the host in f32 (as Hugging Face does), scaled
// frequencies included; `attn_factor` multiplies cos and sin (YaRN's attention factor, 1 otherwise).
extern "C" __global__ void rope_qk(float* __restrict__ qkv, const int* __restrict__ pos,
                                   const float* __restrict__ inv_freq, int row_stride, int n_heads,
                                   int head_dim, float attn_factor) {
    size_t row = blockIdx.x;
    int half = head_dim / 2;
    float p = (float)pos[row];
    float* r = qkv + row * row_stride;
    for (int idx = threadIdx.x; idx < n_heads * half; idx += blockDim.x) {
        int h = idx / half, i = idx % half;
        float s, c;
        sincosf(p * inv_freq[i], &s, &c);
        s *= attn_factor;
        c *= attn_factor;
        float* v = r + h * head_dim;
        float a = v[i], b = v[i + half];
        v[i] = a * c - b * s;
        v[i + half] = b * c + a * s;
    }
}
