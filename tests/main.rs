//! The `stageb` crate's integration specs, as one test binary: one module per area, and the
//! fixtures in `support/` compiled once for all of them. One binary links the engine once
//! (a binary per file re-linked candle for each); `cargo test --test main AREA::` runs one area.
//!
//! The modules share a process, so a spec that owns something process-wide runs its body in a
//! child process of this binary ([`support::isolated`]): the Prometheus scrape (the recorder
//! is global, and other modules' runs would add to its counts). Specs that spawn the `stageb`
//! binary reach it through `CARGO_BIN_EXE_stageb`, which Cargo sets for this target too.

mod support;

mod adversarial;
mod audit;
mod compare;
mod drain;
mod e2e_real_model;
mod edge_attacks;
mod fuzz_corpus;
mod gate;
mod learning;
mod liveness;
mod metrics;
mod metrics_edge;
mod models_and_devices;
mod pipeline;
mod probe;
mod progress;
mod provenance;
mod reflection_loop;
mod report;
mod resume;
mod schema_tailoring;
mod security;
mod speculation;
mod stranger_budget;
mod tls;
mod version;
mod worker_exit;
