//! The CPU fast path: our transformer on plain f32 buffers over GGUF Q4_1/Q8_0 blocks, with
//! kernels whose every output element follows one fixed recipe.
//!
//! - [`model`]: the transformer (llama, qwen2, qwen3), its KV cache (the prompt once, a suffix
//!   per candidate row) and the matmul [`model::Numerics`].
//! - [`cache`]: a job's KV cache (the prompt once, a suffix per candidate row, in blocks) and
//!   the slots a forward call's positions go to.
//! - [`kv_pool`]: the fixed-size KV blocks, handed out and taken back by one pool per model.
//! - [`weights`]: the weight matrices: GGUF Q4_1/Q8_0 blocks, f32, and the interleaved copy the
//!   integer kernels read; parsing, stacking and exact dequantization.
//! - [`kernels`]: f32 kernels: matmul, RMS norm, SiLU, `exp`, softmax sums (the AVX2 matmul
//!   tiles in `kernels/avx2.rs`).
//! - [`int8`]: integer matmuls: activations quantized per block of 32, one recipe computed by
//!   AVX-512 VNNI, AVX-512BW, AVX2 (`int8/x86.rs`) or scalar code.
//! - [`attention`]: attention over the transposed KV cache, many queries of one KV head per call.
//! - [`isa`]: the instruction sets the kernels run with, chosen once per process (`--kernels`).
//! - [`tasks`]: tasks of uneven cost over the threads, heaviest first (attention's blocks).
//!
//! Imports run one way: `model` → `cache` → `kv_pool`, `attention` → `kernels`; `model`, `kernels` and `int8` →
//! `weights` and `isa`, which import neither.

pub mod attention;
pub mod cache;
pub mod int8;
pub mod isa;
pub mod kernels;
pub mod kv_pool;
pub mod model;
pub mod tasks;
pub mod weights;

#[cfg(test)]
mod test_rng;
