//! `stageb coordinator`: rank 0 alone; workers join with `stageb worker`. Its last step,
//! [`serve`], is every rank 0's (`run` and `launch` too).

use std::time::Duration;

use anyhow::Result;
use stageb::roles::{self, CoordinatorSettings, LocalStart, LocalWorkers};
use stageb_coordinator::run::RunInputs;
use stageb_shared::config::DeviceKind;

use super::outcome::finish_run;
use super::shutdown_signal;
use crate::cli::{CoordinatorArgs, ReportArgs};

pub(crate) async fn run(args: CoordinatorArgs) -> Result<u8> {
    let interrupt = shutdown_signal();
    let token = args.token.load()?;
    let tls = args.tls.load()?;
    let inputs = roles::prepare_inputs(&args.rank0.config, "cluster")?;
    args.rank0.metrics.start(0).await?;
    let settings = CoordinatorSettings {
        token,
        tls,
        edge_limits: args.edge.limits(),
        worker_grace: Duration::from_secs(args.worker_grace_s),
        worker_numerics: args.worker_numerics.clone(),
        rank0_runs_no_worker: true,
        model_digest: args.model_digest.clone(),
        // The device of the numerics every worker must present, when the operator named them.
        workers_device: args
            .worker_numerics
            .as_deref()
            .and_then(|n| n.rsplit('|').find_map(DeviceKind::from_name)),
        ..args.rank0.settings(args.listen)
    };
    if settings.worker_numerics.is_none() {
        tracing::info!(
            "rank 0 runs no worker here: the first worker to register decides the run's numerics \
             (--worker-numerics DTYPE/DEVICE decides them instead; required off loopback)"
        );
    }
    serve(
        inputs,
        settings,
        |_| Vec::new(),
        interrupt,
        args.rank0.report,
    )
    .await
}

/// Serve the run as rank 0 until it is over (or `interrupt` drains it), then end it: the
/// report, the outcome line, the exit code.
pub(super) async fn serve(
    inputs: RunInputs,
    settings: CoordinatorSettings,
    spawn_local: impl FnOnce(LocalStart) -> LocalWorkers,
    interrupt: impl std::future::Future<Output = ()>,
    report: ReportArgs,
) -> Result<u8> {
    let summary = roles::run_coordinator_until(inputs, settings, spawn_local, interrupt).await?;
    Ok(finish_run(&summary, report).await)
}
