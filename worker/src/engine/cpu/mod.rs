//! The CPU fast path: our transformer on plain f32 buffers over GGUF Q4_1/Q8_0 blocks, with
//! kernels whose every output element follows one fixed recipe.

pub mod attention;
pub mod int8;
pub mod isa;
pub mod kernels;
pub mod model;
pub mod weights;

#[cfg(test)]
mod test_rng;
