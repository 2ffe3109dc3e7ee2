//! `stageb-inspect`: reading a finished (or interrupted) run directory, never writing into
//! its artifacts.
//!
//! - [`audit`]: re-derives every decision from a run directory and checks every invariant
//!   (`stageb audit`).
//! - [`report`]: a run directory as one self-contained HTML page (`stageb report`).
//! - [`compare`]: two run directories' artifacts, equal aside runtime fields or not
//!   (`stageb compare`, the determinism specs, the system-test scripts).
//!
//! It depends on `stageb-shared` and the coordinator's artifact and decision modules only, so
//! it builds and tests without the inference engine.

pub mod audit;
pub mod compare;
pub mod report;
