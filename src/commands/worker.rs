//! `stageb worker`: one worker against a coordinator. Its last step, [`work`], is every remote
//! worker's (`launch`'s ranks > 0 too).

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Result;
use stageb::roles;
use stageb_worker::client::{JobLimits, WorkerOptions, run_worker};
use stageb_worker::engine::Engine;

use super::outcome::worker_code;
use super::shutdown_signal;
use crate::cli::{ModelArgs, WorkerArgs};

pub(crate) async fn run(args: WorkerArgs) -> Result<u8> {
    let interrupt = shutdown_signal();
    let token = args.token.load()?;
    args.metrics.start(0).await?;
    let options = WorkerOptions {
        coordinator: args.coordinator,
        token,
        tls: args.tls.load()?,
        name: roles::worker_name(0),
        device: String::new(),
        run_id: String::new(),
        connect_timeout: Duration::from_secs(args.connect_timeout_s),
        reconnect_timeout: Duration::from_secs(args.reconnect_timeout_s),
        // `work` sets the limits once the device is placed.
        limits: JobLimits::default(),
    };
    work(args.model, args.model_args, options, interrupt).await
}

/// Place the device, load the model (on a blocking thread: it is CPU-heavy), then work for
/// rank 0 until the run is over, `interrupt` arrives or a draining rank 0 sends the worker
/// away. `options.device` is the loaded engine's; `options.limits` the flags' for the placed
/// device (`--max-jobs`, else the device's default).
pub(super) async fn work(
    model: PathBuf,
    model_args: ModelArgs,
    mut options: WorkerOptions,
    interrupt: impl std::future::Future<Output = ()> + Send,
) -> Result<u8> {
    let engine_options = model_args.engine_options()?;
    let max_jobs = model_args.max_jobs(&engine_options.device);
    options.limits = model_args.job_limits(&engine_options.device);
    let engine =
        tokio::task::spawn_blocking(move || roles::load_model(&model, &engine_options)).await??;
    let fingerprint = engine.fingerprint();
    options.device = fingerprint.device_kind().to_string();
    // What `stageb coordinator --worker-numerics` and `--model-digest` take, for whoever runs
    // rank 0 (the device kind: the first worker's fingerprint pins the GPU's details).
    tracing::info!(
        numerics = %format!("{}/{}", fingerprint.dtype, fingerprint.device_kind()),
        device = %fingerprint.device,
        weights_sha256 = %fingerprint.weights_sha256,
        max_jobs = %format!("{} ({})", max_jobs.value, max_jobs.from),
        "model loaded"
    );
    let summary = run_worker(engine, options, interrupt).await?;
    Ok(worker_code(&summary))
}
