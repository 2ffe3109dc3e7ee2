// Fused kernels of a decode step (stageb): residual add + RMS norm, q/k RMS norm + RoPE + K/V
// write into the paged pool, SiLU(gate) * up. Statistics in f32, one rounding per output.
#include "common.cuh"

#define BLOCK 16

// One block per row: s = round(x + r) (the residual stream's dtype), then s's RMS norm.
// out holds the sums (rows x h) then the normed sums (rows x h).
template <typename T>
__device__ void add_rms_norm(const T* x, const T* r, const float* w, T* out, int rows, int h,
                             float eps) {
    __shared__ float scratch[32];
    const size_t row = blockIdx.x;
    T* s_out = out + row * h;
    T* n_out = out + (size_t)rows * h + row * h;
    float ss = 0.0f;
    for (int j = threadIdx.x; j < h; j += blockDim.x) {
        const T s = from_f32<T>(to_f32(x[row * h + j]) + to_f32(r[row * h + j]));
        s_out[j] = s;
        const float f = to_f32(s);
        ss += f * f;
    }
    ss = block_reduce<false>(ss, scratch);
    const float rms = sqrtf(ss / (float)h + eps);
    for (int j = threadIdx.x; j < h; j += blockDim.x)
        n_out[j] = from_f32<T>(to_f32(s_out[j]) / rms * w[j]);
}

// One block per (head, row), one thread per rotated pair (d / 2 threads, a multiple of 32).
// mode 0: query head `h` of the row,
// normed by `norm` (when given) and rotated, into q_out. mode 1: key head `h` normed and
// rotated and value head `h` as is, into the row's slot of the pool layer (a slot of
// 0xffffffff, a pad row's, writes nothing).
template <typename T>
__device__ void qk_rope(const T* qkv, int width, const float* norm, int has_norm, const T* cos,
                        const T* sin, const uint32_t* positions, int n_head, int n_kv, int d,
                        float eps, int interleaved, int mode, T* q_out, T* pool,
                        const uint32_t* slots) {
    __shared__ float scratch[32];
    const int h = blockIdx.x, row = blockIdx.y, i = threadIdx.x, half = d / 2;
    if (mode == 1 && slots[row] == 0xffffffffu) return;  // a pad row: the whole block skips
    const int a = interleaved ? 2 * i : i;
    const int b = interleaved ? 2 * i + 1 : i + half;
    const int head = mode == 0 ? h : n_head + h;
    const T* x = qkv + (size_t)row * width + (size_t)head * d;
    float xa = to_f32(x[a]), xb = to_f32(x[b]);
    if (has_norm) {
        const float ss = block_reduce<false>(xa * xa + xb * xb, scratch);
        const float rms = sqrtf(ss / (float)d + eps);
        xa = to_f32(from_f32<T>(xa / rms * norm[a]));
        xb = to_f32(from_f32<T>(xb / rms * norm[b]));
    }
    const size_t p = positions[row];
    const float c = to_f32(cos[p * half + i]), s = to_f32(sin[p * half + i]);
    const T ya = from_f32<T>(xa * c - xb * s), yb = from_f32<T>(xa * s + xb * c);
    if (mode == 0) {
        T* o = q_out + ((size_t)row * n_head + h) * d;
        o[a] = ya;
        o[b] = yb;
        return;
    }
    const size_t slot = slots[row], blk = slot / BLOCK, off = slot % BLOCK;
    T* k = pool + ((blk * 2 * BLOCK + off) * n_kv + h) * d;
    T* v = pool + (((blk * 2 + 1) * BLOCK + off) * n_kv + h) * d;
    const T* vs = qkv + (size_t)row * width + (size_t)(n_head + n_kv + h) * d;
    k[a] = ya;
    k[b] = yb;
    v[a] = vs[a];
    v[b] = vs[b];
}

template <typename T>
__device__ void silu_mul(const T* gu, T* out, int rows, int ff) {
    const size_t n = (size_t)rows * ff;
    for (size_t t = (size_t)blockIdx.x * blockDim.x + threadIdx.x; t < n;
         t += (size_t)gridDim.x * blockDim.x) {
        const size_t r = t / ff, j = t % ff;
        const float g = to_f32(gu[r * 2 * ff + j]);
        const float u = to_f32(gu[r * 2 * ff + ff + j]);
        out[t] = from_f32<T>(g / (1.0f + expf(-g)) * u);
    }
}

#define FUSED(NAME, T)                                                                        \
    extern "C" __global__ void add_rms_norm_##NAME(const T* x, const T* r, const float* w,    \
                                                   T* out, int rows, int h, float eps) {      \
        add_rms_norm<T>(x, r, w, out, rows, h, eps);                                          \
    }                                                                                         \
    extern "C" __global__ void q_rope_##NAME(                                                 \
        const T* qkv, int width, const float* norm, int has_norm, const T* cos, const T* sin, \
        const uint32_t* positions, int n_head, int n_kv, int d, float eps, int interleaved,  \
        T* q_out) {                                                                           \
        qk_rope<T>(qkv, width, norm, has_norm, cos, sin, positions, n_head, n_kv, d, eps,     \
                   interleaved, 0, q_out, nullptr, nullptr);                                  \
    }                                                                                         \
    extern "C" __global__ void kv_rope_write_##NAME(                                          \
        const T* qkv, int width, const float* norm, int has_norm, const T* cos, const T* sin, \
        const uint32_t* positions, int n_head, int n_kv, int d, float eps, int interleaved,  \
        T* pool, const uint32_t* slots) {                                                     \
        qk_rope<T>(qkv, width, norm, has_norm, cos, sin, positions, n_head, n_kv, d, eps,     \
                   interleaved, 1, nullptr, pool, slots);                                     \
    }                                                                                         \
    extern "C" __global__ void silu_mul_##NAME(const T* gu, T* out, int rows, int ff) {       \
        silu_mul<T>(gu, out, rows, ff);                                                       \
    }

FUSED(f32, float)
FUSED(bf16, __nv_bfloat16)
