// Writes each row's new K and V (f32, inside a fused QKV row) into one layer's paged cache, bf16,
// laid out [slot][kv head][head dim] with slot = block * block_size + position in block.
// A negative slot skips the row.
extern "C" __global__ void kv_write(const float* __restrict__ qkv, bf16* __restrict__ k_cache,
                                    bf16* __restrict__ v_cache, const long long* __restrict__ slots,
                                    int row_stride, int k_off, int v_off, int kv_dim) {
    size_t row = blockIdx.x;
    long long slot = slots[row];
    if (slot < 0) return;
    const float* r = qkv + row * row_stride;
    for (int j = threadIdx.x; j < kv_dim; j += blockDim.x) {
        k_cache[slot * kv_dim + j] = f2bf(r[k_off + j]);
        v_cache[slot * kv_dim + j] = f2bf(r[v_off + j]);
    }
}
