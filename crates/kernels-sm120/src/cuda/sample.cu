// Sampling on the device, one block of SAMPLE_THREADS threads per row of logits.
//
// argmax_rows: the largest logit, lowest id on ties.
// sample_rows: temperature, top-k and top-p with a per-request seed. With temperature <= 0 it is argmax.
// Thresholds are found exactly by bisection over the order-preserving integer keys of the logits:
//   top-k keeps every token whose logit is >= the k-th largest (ties at the boundary are kept);
//   top-p then keeps the tokens with the largest logits whose probability mass (after top-k, at the
//   given temperature) reaches p.
// The draw u = uniform(seed, step) picks the token where the running mass, in id order, passes
// u * total. The same seed and step give the same token.

#define SAMPLE_THREADS 1024

__device__ __forceinline__ unsigned order_key(float f) {
    unsigned u = __float_as_uint(f);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

__device__ __forceinline__ u64 splitmix64(u64 x) {
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

// Sum of an int over the block (shared scratch of 33 floats reused as ints through a float sum is
// exact below 2^24, which holds for any vocabulary).
__device__ int block_count(int c, float* sh) { return (int)block_sum((float)c, sh); }

// With has_lp, also the pick's log-probability: its logit minus the row's log-sum-exp, which for the
// largest logit is -log(sum exp(x - max)).
extern "C" __global__ void argmax_rows(const float* __restrict__ logits, int vocab, int* __restrict__ out,
                                       int has_lp, float* __restrict__ logprob) {
    __shared__ float s_v[SAMPLE_THREADS / 32];
    __shared__ int s_i[SAMPLE_THREADS / 32];
    __shared__ float sh[33];
    const float* x = logits + (size_t)blockIdx.x * vocab;
    float best = NEG_INF;
    int bi = 0x7fffffff;
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
        float v = x[i];
        if (v > best || (v == best && i < bi)) {
            best = v;
            bi = i;
        }
    }
    for (int o = 16; o > 0; o >>= 1) {
        float ov = __shfl_xor_sync(0xffffffffu, best, o);
        int oi = __shfl_xor_sync(0xffffffffu, bi, o);
        if (ov > best || (ov == best && oi < bi)) {
            best = ov;
            bi = oi;
        }
    }
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    if (lane == 0) {
        s_v[w] = best;
        s_i[w] = bi;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int k = 1; k < (int)(blockDim.x >> 5); ++k)
            if (s_v[k] > best || (s_v[k] == best && s_i[k] < bi)) {
                best = s_v[k];
                bi = s_i[k];
            }
        out[blockIdx.x] = bi == 0x7fffffff ? 0 : bi;
        s_v[0] = best;
    }
    if (!has_lp) return;
    __syncthreads();
    const float m = s_v[0];
    float sum = 0.f;
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
        const float v = x[i];
        if (v == v) sum += expf(v - m);  // NaN ignored, as in the pick
    }
    sum = block_sum(sum, sh);
    if (threadIdx.x == 0) logprob[blockIdx.x] = -logf(sum);
}

extern "C" __global__ void sample_rows(const float* __restrict__ logits, int vocab, const float* __restrict__ temps,
                                       const int* __restrict__ top_ks, const float* __restrict__ top_ps,
                                       const u64* __restrict__ seeds, const u64* __restrict__ steps,
                                       int* __restrict__ out) {
    __shared__ float sh[33];
    __shared__ float s_scan[SAMPLE_THREADS];
    __shared__ int s_pick;
    const int row = blockIdx.x, tid = threadIdx.x, nt = blockDim.x;
    const float* x = logits + (size_t)row * vocab;
    const float temp = temps[row];
    // Each thread owns a contiguous run of ids (needed for the draw, which walks ids in order).
    const int per = (vocab + nt - 1) / nt;
    const int lo = min(vocab, tid * per), hi = min(vocab, lo + per);

    float m = NEG_INF;
    for (int i = lo; i < hi; ++i) m = fmaxf(m, x[i]);
    m = block_max(m, sh);

    if (!(temp > 0.f)) {
        // Greedy: the lowest id holding the max.
        if (tid == 0) s_pick = 0x7fffffff;
        __syncthreads();
        for (int i = lo; i < hi; ++i)
            if (x[i] == m) {
                atomicMin(&s_pick, i);
                break;
            }
        __syncthreads();
        if (tid == 0) out[row] = s_pick == 0x7fffffff ? 0 : s_pick;
        return;
    }
    const float inv_t = 1.f / temp;

    // Top-k: the largest key K with count(key >= K) >= k.
    unsigned kmin = 0;
    const int k = top_ks[row];
    if (k > 0 && k < vocab) {
        unsigned lo_k = 0, hi_k = 0xffffffffu;  // invariant: count(>= lo_k) >= k
        while (lo_k < hi_k) {
            const unsigned mid = (unsigned)(((u64)lo_k + hi_k + 1) >> 1);  // no wrap at the full range
            int c = 0;
            for (int i = lo; i < hi; ++i) c += order_key(x[i]) >= mid;
            if (block_count(c, sh) >= k) lo_k = mid; else hi_k = mid - 1;
        }
        kmin = lo_k;
    }

    // Top-p over the survivors of top-k: the largest key K >= kmin whose kept mass reaches p * total.
    float total = 0.f;
    for (int i = lo; i < hi; ++i)
        if (order_key(x[i]) >= kmin) total += expf((x[i] - m) * inv_t);
    total = block_sum(total, sh);
    unsigned kfinal = kmin;
    const float p = top_ps[row];
    if (p < 1.f) {
        const float want = p * total;
        unsigned lo_p = kmin, hi_p = order_key(m);  // mass(>= kmin) = total >= want; mass(>= key(m)) > 0
        while (lo_p < hi_p) {
            const unsigned mid = (unsigned)(((u64)lo_p + hi_p + 1) >> 1);
            float s = 0.f;
            for (int i = lo; i < hi; ++i)
                if (order_key(x[i]) >= mid) s += expf((x[i] - m) * inv_t);
            if (block_sum(s, sh) >= want) lo_p = mid; else hi_p = mid - 1;
        }
        kfinal = lo_p;
    }

    // The draw: exclusive scan of each thread's kept mass, in id order.
    float own = 0.f;
    int last = -1;
    for (int i = lo; i < hi; ++i)
        if (order_key(x[i]) >= kfinal) {
            own += expf((x[i] - m) * inv_t);
            last = i;
        }
    s_scan[tid] = own;
    if (tid == 0) s_pick = -1;
    __syncthreads();
    for (int off = 1; off < nt; off <<= 1) {
        const float add = tid >= off ? s_scan[tid - off] : 0.f;
        __syncthreads();
        s_scan[tid] += add;
        __syncthreads();
    }
    const float kept = s_scan[nt - 1];
    const float before = s_scan[tid] - own;
    const u64 r = splitmix64(seeds[row] ^ splitmix64(steps[row]));
    const float u = (float)(r >> 40) * (1.f / 16777216.f);
    const float target = u * kept;
    if (own > 0.f && target >= before && target < before + own) {
        float run = before;
        int pick = last;
        for (int i = lo; i < hi; ++i)
            if (order_key(x[i]) >= kfinal) {
                run += expf((x[i] - m) * inv_t);
                if (target < run) {
                    pick = i;
                    break;
                }
            }
        s_pick = pick;
    }
    __syncthreads();
    // Rounding can leave target at or past the last interval's end: take the last kept id.
    if (s_pick < 0 && own > 0.f && before + own >= kept) atomicMax(&s_pick, last);
    __syncthreads();
    if (tid == 0) out[row] = s_pick;
}
