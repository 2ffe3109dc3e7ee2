// Batched paged decode attention (stageb). One query position per row; keys and values in a
// pool of blocks, `(num_blocks, 2, BLOCK, n_kv, d)` per layer (keys then values), read through
// each row's table: `table[row] = [len, block_0, block_1, ...]`.
//
// Two launches. `paged_attn_partial_*`: one thread block per (KV head, row, partition of
// PARTITION positions), computing for the KV head's n_rep query heads the partition's maximum
// score m, its sum l = sum exp(s - m) and its weighted values acc = sum exp(s - m) v.
// `paged_attn_combine_*`: one thread block per (head, row), merging the row's partitions in
// ascending order. The partition size is fixed and every sum's order depends only on the
// block's own row, so a row's result is the same bits whatever the batch.
#include "common.cuh"

#define BLOCK 16
#define PARTITION 512

template <typename T>
__device__ void partial(const T* q, const T* pool, const uint32_t* table, int width, int n_head,
                        int n_kv, int d, float scale, int max_parts, float* acc, float* ml) {
    extern __shared__ float smem[];
    const int kvh = blockIdx.x, row = blockIdx.y, part = blockIdx.z;
    const int n_rep = n_head / n_kv;
    const uint32_t* trow = table + (size_t)row * width;
    const int len = (int)trow[0];
    const int parts = (len + PARTITION - 1) / PARTITION;
    if (part >= parts) return;  // the same for every thread of the block
    float* qs = smem;
    float* sc = qs + n_rep * d;
    float* scratch = sc + n_rep * PARTITION;
    for (int i = threadIdx.x; i < n_rep * d; i += blockDim.x)
        qs[i] = to_f32(q[((size_t)row * n_head + (size_t)kvh * n_rep) * d + i]);
    __syncthreads();
    const int start = part * PARTITION;
    const int n = min(len - start, PARTITION);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    const int per = d / 32;
    // Scores: one warp per position, each lane a fixed strided share of the dot product.
    for (int i = warp; i < n; i += warps) {
        const int pos = start + i;
        const size_t b = trow[1 + pos / BLOCK];
        const T* k = pool + ((b * 2 * BLOCK + pos % BLOCK) * n_kv + kvh) * d;
        float kr[8];
        for (int e = 0; e < per; ++e) kr[e] = to_f32(k[lane + 32 * e]);
        for (int r = 0; r < n_rep; ++r) {
            float s = 0.0f;
            for (int e = 0; e < per; ++e) s += qs[r * d + lane + 32 * e] * kr[e];
            s = warp_sum(s);
            if (lane == 0) sc[r * PARTITION + i] = s * scale;
        }
    }
    __syncthreads();
    for (int r = 0; r < n_rep; ++r) {
        float m = -INFINITY;
        for (int i = threadIdx.x; i < n; i += blockDim.x) m = fmaxf(m, sc[r * PARTITION + i]);
        m = block_reduce<true>(m, scratch);
        float l = 0.0f;
        for (int i = threadIdx.x; i < n; i += blockDim.x) {
            const float e = expf(sc[r * PARTITION + i] - m);
            sc[r * PARTITION + i] = e;
            l += e;
        }
        l = block_reduce<false>(l, scratch);
        if (threadIdx.x == 0) {
            const size_t at = ((size_t)row * n_head + (size_t)kvh * n_rep + r) * max_parts + part;
            ml[2 * at] = m;
            ml[2 * at + 1] = l;
        }
    }
    __syncthreads();
    // Weighted values: one thread per (head, dim), positions in ascending order.
    for (int t = threadIdx.x; t < n_rep * d; t += blockDim.x) {
        const int r = t / d, j = t % d;
        float a = 0.0f;
        for (int i = 0; i < n; ++i) {
            const int pos = start + i;
            const size_t b = trow[1 + pos / BLOCK];
            const T* v = pool + (((b * 2 + 1) * BLOCK + pos % BLOCK) * n_kv + kvh) * d;
            a += sc[r * PARTITION + i] * to_f32(v[j]);
        }
        const size_t at = ((size_t)row * n_head + (size_t)kvh * n_rep + r) * max_parts + part;
        acc[at * d + j] = a;
    }
}

template <typename T>
__device__ void combine(const float* acc, const float* ml, const uint32_t* table, int width,
                        int n_head, int d, int max_parts, T* out) {
    const int h = blockIdx.x, row = blockIdx.y;
    const int len = (int)table[(size_t)row * width];
    const int parts = (len + PARTITION - 1) / PARTITION;
    const size_t base = ((size_t)row * n_head + h) * max_parts;
    float big_m = -INFINITY;
    for (int p = 0; p < parts; ++p) big_m = fmaxf(big_m, ml[2 * (base + p)]);
    float big_l = 0.0f;
    for (int p = 0; p < parts; ++p) big_l += ml[2 * (base + p) + 1] * expf(ml[2 * (base + p)] - big_m);
    for (int j = threadIdx.x; j < d; j += blockDim.x) {
        float num = 0.0f;
        for (int p = 0; p < parts; ++p) num += acc[(base + p) * d + j] * expf(ml[2 * (base + p)] - big_m);
        out[((size_t)row * n_head + h) * d + j] = from_f32<T>(big_l > 0.0f ? num / big_l : 0.0f);
    }
}

#define PAGED_ATTN(NAME, T)                                                                   \
    extern "C" __global__ void paged_attn_partial_##NAME(                                     \
        const T* q, const T* pool, const uint32_t* table, int width, int n_head, int n_kv,    \
        int d, float scale, int max_parts, float* acc, float* ml) {                           \
        partial<T>(q, pool, table, width, n_head, n_kv, d, scale, max_parts, acc, ml);        \
    }                                                                                         \
    extern "C" __global__ void paged_attn_combine_##NAME(const float* acc, const float* ml,   \
                                                         const uint32_t* table, int width,   \
                                                         int n_head, int d, int max_parts,   \
                                                         T* out) {                           \
        combine<T>(acc, ml, table, width, n_head, d, max_parts, out);                         \
    }

PAGED_ATTN(f32, float)
PAGED_ATTN(bf16, __nv_bfloat16)
