//! `stageb run`: rank 0 and `--workers` local workers in one process, over loopback gRPC.

use std::path::PathBuf;
use std::sync::Mutex;

use anyhow::Result;
use stageb::roles::{self, ClusterError, CoordinatorSettings};
use stageb_coordinator::run::start;
use stageb_shared::auth::AuthToken;
use stageb_worker::engine::{Engine, EngineOptions, ModelEngine};

use super::coordinator::serve;
use super::shutdown_signal;
use crate::cli::{RunArgs, device_kind};

pub(crate) async fn run(args: RunArgs) -> Result<u8> {
    let interrupt = shutdown_signal();
    if args.workers == 0 {
        return Err(ClusterError::Launch(
            "--workers must be at least 1 (use `stageb coordinator` for a coordinator alone)"
                .into(),
        )
        .into());
    }
    let inputs = roles::prepare_inputs(&args.rank0.config, "embedded")?;
    args.rank0.metrics.start(0).await?;
    let model_path = PathBuf::from(&inputs.config.model.model_name_or_path);
    // Every worker's device is placed (a missing GPU is an error) and the model checked
    // before anything starts.
    let n = u32::try_from(args.workers).unwrap_or(u32::MAX);
    let options = (0..n)
        .map(|i| args.model.engine_options_for(i, n))
        .collect::<Result<Vec<_>>>()?;
    let first = roles::load_model(&model_path, &options[0])?;
    let fingerprint = first.fingerprint().id();
    start::check_resume_model(&inputs, args.rank0.start.mode(), &model_path, &fingerprint)
        .map_err(ClusterError::Input)?;
    let device = options[0].device;
    let settings = CoordinatorSettings {
        // The embedded run makes its own token: loopback today, but never unauthenticated.
        token: Some(AuthToken::generate()),
        worker_grace: roles::EMBEDDED_WORKER_GRACE,
        expected_workers: args.workers,
        workers_device: Some(device_kind(&device)),
        local_max_jobs: Some(args.model.max_jobs(&device)),
        ..args.rank0.settings(args.listen)
    };
    let limits = args.model.job_limits(&device);
    let (workers, engines) = (args.workers, engines(first, model_path, options));
    let spawn_local =
        move |start| roles::spawn_local_workers(workers, start, None, limits, engines);
    serve(inputs, settings, spawn_local, interrupt, args.rank0.report).await
}

/// The engine of local worker `i`: worker 0 takes the one loaded to check the model, the
/// others load their own with their options (`options[i]`: their device).
fn engines(
    first: ModelEngine,
    model: PathBuf,
    options: Vec<EngineOptions>,
) -> impl Fn(usize) -> Result<ModelEngine, String> + Send + Sync + 'static {
    let first = Mutex::new(Some(first));
    move |i| {
        if let Some(engine) = first
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
            .filter(|_| i == 0)
        {
            return Ok(engine);
        }
        let options = options.get(i).ok_or("no options for this worker")?;
        ModelEngine::load(&model, options).map_err(|e| e.to_string())
    }
}
