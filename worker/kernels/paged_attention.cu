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

// A partial block's partition: its KV head, row and partition, the row's table, the first
// position and how many, and its shared memory (the queries, the scores, the reductions'
// scratch).
struct Partition {
    int kvh, row, part, n_rep, start, n;
    const uint32_t* trow;
    float *qs, *sc, *scratch;
};

// Sets `p` up for this block and loads its n_rep queries into shared memory; false, for every
// thread of the block alike, when the row has no such partition.
template <typename T>
__device__ bool begin_partition(const T* q, const uint32_t* table, int width, int n_head,
                                int n_kv, int d, Partition& p) {
    extern __shared__ float smem[];
    p.kvh = blockIdx.x, p.row = blockIdx.y, p.part = blockIdx.z;
    p.n_rep = n_head / n_kv;
    p.trow = table + (size_t)p.row * width;
    const int len = (int)p.trow[0];
    const int parts = (len + PARTITION - 1) / PARTITION;
    if (p.part >= parts) return false;
    p.qs = smem;
    p.sc = p.qs + p.n_rep * d;
    p.scratch = p.sc + p.n_rep * PARTITION;
    const size_t q0 = ((size_t)p.row * n_head + (size_t)p.kvh * p.n_rep) * d;
    for (int i = threadIdx.x; i < p.n_rep * d; i += blockDim.x) p.qs[i] = to_f32(q[q0 + i]);
    __syncthreads();
    p.start = p.part * PARTITION;
    p.n = min(len - p.start, PARTITION);
    return true;
}

// A partition's softmax statistics for each of the n_rep query heads of a block: the maximum
// score m and l = sum exp(s - m) (each a fixed block tree), written to `ml` at `at0 + r *
// max_parts`; the scores in `sc` are replaced by their weights exp(s - m). Both partial kernels
// run this, so their statistics are the same bits.
__device__ void partition_softmax(float* sc, int n, int n_rep, float* scratch, float* ml,
                                  size_t at0, int max_parts) {
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
            const size_t at = at0 + (size_t)r * max_parts;
            ml[2 * at] = m;
            ml[2 * at + 1] = l;
        }
    }
}

template <typename T>
__device__ void partial(const T* q, const T* pool, const uint32_t* table, int width, int n_head,
                        int n_kv, int d, float scale, int max_parts, float* acc, float* ml) {
    Partition p;
    if (!begin_partition(q, table, width, n_head, n_kv, d, p)) return;  // the whole block
    const int kvh = p.kvh, row = p.row, part = p.part, n_rep = p.n_rep;
    const int start = p.start, n = p.n;
    const uint32_t* trow = p.trow;
    float *qs = p.qs, *sc = p.sc, *scratch = p.scratch;
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
    const size_t at0 = ((size_t)row * n_head + (size_t)kvh * n_rep) * max_parts + part;
    partition_softmax(sc, n, n_rep, scratch, ml, at0, max_parts);
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

// The partial step again with more loads in flight, computing the same bits: every score is
// the same lanes' shares summed in the same order and the same butterfly, every weighted sum
// the same products added in ascending position (`a += w * v`), so `partial` and
// `partial_v2` agree bit for bit (a device test holds it). What changes is how the work
// meets the memory: a warp loads UNROLL keys before it sums any, a thread loads a block's 16
// values before it adds any, each block's table entry is read once for its positions, and a
// thread keeps an accumulator for each of up to REP_GROUP query heads of its KV head, so a
// value is read once per group instead of once per query head (n_rep 4, Qwen3-8B's: once).
#define UNROLL 4
#define REP_GROUP 4

template <typename T>
__device__ void partial_v2(const T* q, const T* pool, const uint32_t* table, int width,
                           int n_head, int n_kv, int d, float scale, int max_parts, float* acc,
                           float* ml) {
    Partition p;
    if (!begin_partition(q, table, width, n_head, n_kv, d, p)) return;  // the whole block
    const int kvh = p.kvh, row = p.row, part = p.part, n_rep = p.n_rep;
    const int start = p.start, n = p.n;  // start: a multiple of BLOCK and of UNROLL
    const uint32_t* trow = p.trow;
    float *qs = p.qs, *sc = p.sc, *scratch = p.scratch;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    const int per = d / 32;
    const size_t kstride = (size_t)n_kv * d;  // from one position of a block to the next
    // Scores: a warp takes UNROLL consecutive positions (in one block of the pool), loads
    // their keys, then sums each as `partial` does.
    for (int i0 = warp * UNROLL; i0 < n; i0 += warps * UNROLL) {
        const int pos0 = start + i0;
        const size_t b = trow[1 + pos0 / BLOCK];
        const T* k0 = pool + ((b * 2 * BLOCK + pos0 % BLOCK) * n_kv + kvh) * d;
        const int m = min(UNROLL, n - i0);
        float kr[UNROLL][8];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u)
#pragma unroll
            for (int e = 0; e < 8; ++e)
                kr[u][e] = (u < m && e < per) ? to_f32(k0[u * kstride + lane + 32 * e]) : 0.0f;
        for (int r = 0; r < n_rep; ++r) {
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
                float s = 0.0f;
#pragma unroll
                for (int e = 0; e < 8; ++e)
                    if (e < per) s += qs[r * d + lane + 32 * e] * kr[u][e];
                s = warp_sum(s);
                if (lane == 0 && u < m) sc[r * PARTITION + i0 + u] = s * scale;
            }
        }
    }
    __syncthreads();
    const size_t at0 = ((size_t)row * n_head + (size_t)kvh * n_rep) * max_parts + part;
    partition_softmax(sc, n, n_rep, scratch, ml, at0, max_parts);
    __syncthreads();
    // Weighted values: one thread per (dim, group of REP_GROUP query heads), an accumulator
    // per query head, positions in ascending order, a block's table entry read once.
    for (int t = threadIdx.x; t < d * ((n_rep + REP_GROUP - 1) / REP_GROUP); t += blockDim.x) {
        const int j = t % d, r0 = t / d * REP_GROUP, nr = min(REP_GROUP, n_rep - r0);
        float a[REP_GROUP];
#pragma unroll
        for (int r = 0; r < REP_GROUP; ++r) a[r] = 0.0f;
        for (int i0 = 0; i0 < n; i0 += BLOCK) {
            const int pos0 = start + i0;
            const size_t b = trow[1 + pos0 / BLOCK];
            const T* v0 = pool + (((b * 2 + 1) * BLOCK) * n_kv + kvh) * d + j;
            const int m = min(BLOCK, n - i0);
            // The block's values loaded first, then added in ascending position.
            float vv[BLOCK];
#pragma unroll
            for (int o = 0; o < BLOCK; ++o) vv[o] = o < m ? to_f32(v0[o * kstride]) : 0.0f;
#pragma unroll
            for (int o = 0; o < BLOCK; ++o) {
                if (o < m) {
#pragma unroll
                    for (int r = 0; r < REP_GROUP; ++r)
                        if (r < nr) a[r] += sc[(r0 + r) * PARTITION + i0 + o] * vv[o];
                }
            }
        }
#pragma unroll
        for (int r = 0; r < REP_GROUP; ++r) {
            if (r < nr) {
                const size_t at =
                    ((size_t)row * n_head + (size_t)kvh * n_rep + r0 + r) * max_parts + part;
                acc[at * d + j] = a[r];
            }
        }
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
    extern "C" __global__ void paged_attn_partial_v2_##NAME(                                  \
        const T* q, const T* pool, const uint32_t* table, int width, int n_head, int n_kv,    \
        int d, float scale, int max_parts, float* acc, float* ml) {                           \
        partial_v2<T>(q, pool, table, width, n_head, n_kv, d, scale, max_parts, acc, ml);     \
    }                                                                                         \
    extern "C" __global__ void paged_attn_combine_##NAME(const float* acc, const float* ml,   \
                                                         const uint32_t* table, int width,   \
                                                         int n_head, int d, int max_parts,   \
                                                         T* out) {                           \
        combine<T>(acc, ml, table, width, n_head, d, max_parts, out);                         \
    }

PAGED_ATTN(f32, float)
PAGED_ATTN(bf16, __nv_bfloat16)

// Flash prefill attention (stageb). One job's chunk of `c` query rows at positions
// `start..start + c`, `start = table[0] - c`, attends causally to positions `0..start + c`
// of the pool through the job's table `[len, block_0, block_1, ...]` (the chunk's keys and
// values already written). One thread block per (head, group of QROWS rows). Per row the
// recipe of `worker/src/engine/kernels/flash_prefill.rs`: key tiles of KEY_TILE positions at
// multiples of KEY_TILE in ascending order, an online softmax in f32; the dot products are a
// fixed warp butterfly, the tile's maximum, sum and weighted values run sequentially in
// ascending position by one thread per row (sum) or per (row, dim) (values). A row skips every
// tile past its own position, so its result depends on its position alone, not on its group
// or the chunk.
#define KEY_TILE 32
#define QROWS 8
#define FLASH_THREADS 128
// Accumulators per thread: QROWS rows of up to 256 dims over FLASH_THREADS threads.
#define FLASH_ACC (QROWS * 256 / FLASH_THREADS)

template <typename T>
__device__ void flash_prefill(const T* q, const T* pool, const uint32_t* table, int width, int c,
                              int n_head, int n_kv, int d, float scale, T* out) {
    extern __shared__ float smem[];
    const int h = blockIdx.x, r0 = blockIdx.y * QROWS;
    const int kvh = h / (n_head / n_kv);
    const int nr = min(QROWS, c - r0);
    const int len = (int)table[0];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, warps = blockDim.x >> 5;
    float* qs = smem;                    // [QROWS][d]
    float* kv = qs + QROWS * d;          // [KEY_TILE][d]: the tile's keys, then its values
    float* sc = kv + KEY_TILE * d;       // [QROWS][KEY_TILE]: scores, then exp weights
    float* mrow = sc + QROWS * KEY_TILE; // [QROWS] running maximum
    float* lrow = mrow + QROWS;          // [QROWS] running sum
    float* crow = lrow + QROWS;          // [QROWS] this tile's correction
    int* nrow = (int*)(crow + QROWS);    // [QROWS] this tile's positions the row attends
    const bool bad = len < c || (len + BLOCK - 1) / BLOCK > width - 1;
    const int start = len - c;
    if (bad) {  // a table that does not hold the chunk: zeros, nothing read
        for (int t = tid; t < nr * d; t += blockDim.x)
            out[((size_t)(r0 + t / d) * n_head + h) * d + t % d] = from_f32<T>(0.0f);
        return;
    }
    for (int t = tid; t < nr * d; t += blockDim.x)
        qs[t] = to_f32(q[((size_t)(r0 + t / d) * n_head + h) * d + t % d]);
    if (tid < QROWS) {
        mrow[tid] = -INFINITY;
        lrow[tid] = 0.0f;
    }
    float acc[FLASH_ACC];
#pragma unroll
    for (int k = 0; k < FLASH_ACC; ++k) acc[k] = 0.0f;
    const int last = start + r0 + nr - 1;  // the group's last position
    const uint32_t* blocks = table + 1;
    for (int t0 = 0; t0 <= last; t0 += KEY_TILE) {
        const int n = min(KEY_TILE, last + 1 - t0);
        __syncthreads();  // the previous tile's values and weights are no longer read
        for (int t = tid; t < n * d; t += blockDim.x) {
            const int pos = t0 + t / d;
            const size_t b = blocks[pos / BLOCK];
            kv[t] = to_f32(pool[((b * 2 * BLOCK + pos % BLOCK) * n_kv + kvh) * d + t % d]);
        }
        __syncthreads();
        // Scores: one warp per (row, position), lanes a fixed strided share of the dot product.
        for (int p = warp; p < QROWS * KEY_TILE; p += warps) {
            const int r = p / KEY_TILE, j = p % KEY_TILE;
            if (r >= nr || j >= n) continue;  // the same for the whole warp
            float s = 0.0f;
            for (int e = lane; e < d; e += 32) s += qs[r * d + e] * kv[j * d + e];
            s = warp_sum(s);
            if (lane == 0) sc[r * KEY_TILE + j] = s * scale;
        }
        __syncthreads();
        // The online softmax's step: one thread per row, positions in ascending order.
        if (tid < nr) {
            const int r = tid, pos = start + r0 + r;
            const int nj = t0 <= pos ? min(n, pos + 1 - t0) : 0;
            nrow[r] = nj;
            crow[r] = 1.0f;
            if (nj > 0) {
                float mt = -INFINITY;
                for (int j = 0; j < nj; ++j) mt = fmaxf(mt, sc[r * KEY_TILE + j]);
                const float m_new = fmaxf(mrow[r], mt);
                const float corr = expf(mrow[r] - m_new);
                float l = lrow[r] * corr;
                for (int j = 0; j < nj; ++j) {
                    const float e = expf(sc[r * KEY_TILE + j] - m_new);
                    sc[r * KEY_TILE + j] = e;
                    l += e;
                }
                mrow[r] = m_new;
                lrow[r] = l;
                crow[r] = corr;
            }
        }
        __syncthreads();  // the keys are no longer read: the values take their place
        for (int t = tid; t < n * d; t += blockDim.x) {
            const int pos = t0 + t / d;
            const size_t b = blocks[pos / BLOCK];
            kv[t] = to_f32(pool[(((b * 2 + 1) * BLOCK + pos % BLOCK) * n_kv + kvh) * d + t % d]);
        }
        __syncthreads();
        // Weighted values: one thread per (row, dim), positions in ascending order.
#pragma unroll
        for (int k = 0; k < FLASH_ACC; ++k) {
            const int t = tid + k * FLASH_THREADS, r = t / d, e = t % d;
            if (r >= nr || nrow[r] == 0) continue;
            float a = acc[k] * crow[r];
            for (int j = 0; j < nrow[r]; ++j) a += sc[r * KEY_TILE + j] * kv[j * d + e];
            acc[k] = a;
        }
    }
    __syncthreads();
#pragma unroll
    for (int k = 0; k < FLASH_ACC; ++k) {
        const int t = tid + k * FLASH_THREADS, r = t / d, e = t % d;
        if (r < nr) out[((size_t)(r0 + r) * n_head + h) * d + e] = from_f32<T>(acc[k] / lrow[r]);
    }
}

#define FLASH_PREFILL(NAME, T)                                                                \
    extern "C" __global__ void flash_prefill_##NAME(const T* q, const T* pool,                \
                                                    const uint32_t* table, int width, int c,  \
                                                    int n_head, int n_kv, int d, float scale, \
                                                    T* out) {                                 \
        flash_prefill<T>(q, pool, table, width, c, n_head, n_kv, d, scale, out);              \
    }

FLASH_PREFILL(f32, float)
FLASH_PREFILL(bf16, __nv_bfloat16)
