// Shared helpers of stageb's kernels: dtype conversions and reductions in one fixed order.
// Written for this project; every reduction's order depends only on the block's own shape,
// never on the grid, so a result does not depend on what else is in the batch.
#pragma once
#include <cuda_bf16.h>
#include <stdint.h>

__device__ __forceinline__ float to_f32(float x) { return x; }
__device__ __forceinline__ float to_f32(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T> __device__ __forceinline__ T from_f32(float x);
template <> __device__ __forceinline__ float from_f32<float>(float x) { return x; }
template <> __device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float x) {
    return __float2bfloat16_rn(x);
}

// Butterfly over the 32 lanes of a warp: every lane ends with the same sum.
__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Sum (or max) over the block: each warp's butterfly, then warp 0 over the warps' results in
// warp order. `scratch` holds 32 floats; every thread returns the result.
template <bool MAX>
__device__ float block_reduce(float v, float* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int warps = (blockDim.x + 31) >> 5;
    v = MAX ? warp_max(v) : warp_sum(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    if (warp == 0) {
        float w = lane < warps ? scratch[lane] : (MAX ? -INFINITY : 0.0f);
        w = MAX ? warp_max(w) : warp_sum(w);
        if (lane == 0) scratch[0] = w;
    }
    __syncthreads();
    return scratch[0];
}
