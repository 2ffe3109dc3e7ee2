//! `stageb-worker`'s integration specs, as one test binary: one module per area, on the real
//! test model (`common`: where it is) and the committed parity fixtures. One binary links
//! candle once; `cargo test -p stageb-worker --test main AREA::` runs one area.

mod common;

mod constraint_smollm2;
mod constraint_vocab;
mod engine_architectures;
mod engine_batching;
mod engine_bench;
mod engine_contract;
mod engine_finish;
mod engine_flash_prefill;
mod engine_paged;
mod engine_rollout;
mod engine_tokenizer;
mod parity_transformers;
mod prefix_cache;
