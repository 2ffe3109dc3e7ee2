//! `stageb`: the one CLI users run, as a thin layer over the library crates.
//!
//! # Layout
//! The library (this crate's `lib.rs`):
//! - [`roles`]: process roles: the embedded default (coordinator plus local workers in one
//!   process, still over loopback gRPC), a standalone coordinator, a standalone worker, and
//!   `launch` (role from torchrun / Slurm / Kubernetes environment variables); one file per
//!   concern (inputs, model, rank 0, local workers, launch topology).
//! - [`progress`]: rank 0's progress display (a bar on a terminal, periodic log lines
//!   otherwise).
//! - [`certs`]: per-job CA and certificate for mutual TLS (`stageb tls-init`).
//! - [`metrics_endpoint`]: the Prometheus `/metrics` endpoint (`--metrics-listen`).
//! - [`exit`]: the documented exit codes.
//!
//! The binary (`src/main.rs`, with `src/cli/` and `src/commands/`) only parses arguments, sets
//! up logging, hands each command to the library and maps errors to the exit codes.

pub mod certs;
pub mod metrics_endpoint;
pub mod progress;
pub mod roles;

/// Exit codes (documented in the README).
pub mod exit {
    /// The run completed (or the command succeeded).
    pub const OK: u8 = 0;
    /// The run completed, but some tickets had no usable candidate (hard failures).
    pub const COMPLETED_WITH_FAILURES: u8 = 1;
    /// Bad usage, config or input: nothing was run.
    pub const INPUT_ERROR: u8 = 2;
    /// The run could not complete (I/O, lost workers, refused connection).
    pub const RUNTIME_ERROR: u8 = 3;
    /// `stageb audit` found invariant violations.
    pub const AUDIT_FAILED: u8 = 4;
    /// Interrupted before the run was over (SIGTERM/SIGINT, or a worker told by a draining
    /// rank 0 to leave): everything finished is on disk and `--resume` continues the run. A
    /// scheduler should requeue on this code, never count it as a failure. 75 is sysexits'
    /// `EX_TEMPFAIL` ("try again later").
    pub const INTERRUPTED: u8 = 75;
}
