//! `stageb-shared`'s integration specs, as one test binary: one module per area, and the
//! assertion helpers in `support/` compiled once.

mod support;

mod config_errors;
mod config_load;
mod contract_fixtures;
mod ingest_errors;
mod ingest_load;
