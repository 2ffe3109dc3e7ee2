//! The model: loading it when a role starts, the one rank 0 pins a run to, and the context the
//! run plans with.

use std::path::{Path, PathBuf};

use stageb_coordinator::cluster::model_pin::weights_of;
use stageb_coordinator::cluster::server::ModelPin;
use stageb_coordinator::run::RunInputs;
use stageb_coordinator::run::start;
use stageb_shared::config;
use stageb_shared::error::{ErrorCode, InputError};
use stageb_shared::limits;
use stageb_worker::engine::{EngineOptions, ModelEngine};

use super::{ClusterError, CoordinatorSettings};

/// Load a model, reporting a missing or unloadable file as bad input (exit code 2) with a
/// stable code: at startup the model file is the user's input like any other.
pub fn load_model(model: &Path, options: &EngineOptions) -> Result<ModelEngine, InputError> {
    if !model.exists() {
        return Err(InputError::new(
            ErrorCode::FileNotFound,
            model.display().to_string(),
            None,
            "model not found (scripts/fetch-model.sh fetches the demo model)",
        ));
    }
    ModelEngine::load(model, options).map_err(|e| {
        InputError::new(
            ErrorCode::UnsupportedModel,
            model.display().to_string(),
            None,
            e.to_string(),
        )
    })
}

/// Which model the run accepts: the one an earlier attempt recorded (resume), else the one
/// the config names when rank 0 can read it, else the weights digest rank 0 was told
/// (`--model-digest`, `model.weights_sha256`), else the first worker's (said in the log; refused
/// off loopback without a worker of its own). A digest told and a model read must agree. The
/// run's context is decided with it: the earlier attempt's, else `model.max_model_len` or the
/// model's declaration, else the first worker's.
pub(super) async fn model_pin(
    inputs: &RunInputs,
    plan: &start::StartPlan,
    settings: &CoordinatorSettings,
) -> Result<ModelPin, ClusterError> {
    let worker_numerics = settings.worker_numerics.as_deref();
    let path = PathBuf::from(&inputs.config.model.model_name_or_path);
    let read = tokio::task::spawn_blocking({
        let path = path.clone();
        let hash = plan.pinned_fingerprint.is_none();
        move || {
            let declared = declared_context(&path);
            (
                hash.then(|| stageb_worker::engine::weights_sha256(&path)),
                declared,
            )
        }
    })
    .await
    .map_err(|e| ClusterError::Serve(format!("reading the model failed: {e}")))?;
    let (hashed, declared) = read;
    let told = told_digest(inputs, settings);
    let pin = match (plan.pinned_fingerprint.clone(), hashed) {
        (Some(fingerprint), _) => {
            if let Some((digest, from)) = &told
                && weights_of(&fingerprint) != digest
            {
                return Err(digest_refused(
                    ErrorCode::ResumeMismatch,
                    from,
                    "the run being resumed ran with other model weights".into(),
                ));
            }
            ModelPin::by_resumed_run(fingerprint)
        }
        (None, Some(Ok(weights))) => {
            if let Some((digest, from)) = &told
                && *digest != weights
            {
                return Err(digest_refused(
                    ErrorCode::ModelDigestMismatch,
                    from,
                    format!(
                        "{digest} is not the weights digest of {} ({weights})",
                        path.display()
                    ),
                ));
            }
            tracing::info!(model = %path.display(), weights_sha256 = %&weights[..weights.len().min(16)], "run model pinned by the config");
            ModelPin::by_config(weights).with_numerics_check(stageb_worker::engine::numerics_known)
        }
        (None, Some(Err(e))) => match told {
            Some((digest, from)) => {
                tracing::info!(model = %path.display(), weights_sha256 = %&digest[..digest.len().min(16)], %from, "rank 0 cannot read the config's model ({e}): run model pinned by the weights digest it was given");
                ModelPin::by_operator(digest)
                    .with_numerics_check(stageb_worker::engine::numerics_known)
            }
            None => {
                tracing::warn!(model = %path.display(), "rank 0 cannot read the config's model ({e}): the first worker to register pins the run's model (--model-digest pins it instead)");
                ModelPin::by_first_worker()
            }
        },
        (None, None) => ModelPin::by_first_worker(),
    };
    model_decided(&pin, settings)?;
    numerics_decided(&pin, settings)?;
    let pin = match worker_numerics {
        Some(numerics) => pin.with_expected_numerics(numerics).map_err(|refusal| {
            ClusterError::Input(InputError::new(
                ErrorCode::ResumeMismatch,
                "--worker-numerics".to_string(),
                None,
                refusal,
            ))
        })?,
        None => pin,
    };
    if let Some(context) = plan.pinned_context {
        return Ok(pin.with_context(context));
    }
    let context = run_context(inputs, declared)?;
    Ok(match context {
        Some(context) => pin.with_context(context),
        None => pin,
    })
}

/// The weights digest rank 0 was told, and by what: `--model-digest`, else the config's
/// `model.weights_sha256`.
fn told_digest(inputs: &RunInputs, settings: &CoordinatorSettings) -> Option<(String, String)> {
    match (&settings.model_digest, &inputs.config.model.weights_sha256) {
        (Some(d), _) => Some((d.clone(), "--model-digest".into())),
        (None, Some(d)) => Some((d.clone(), "model.weights_sha256".into())),
        (None, None) => None,
    }
}

fn digest_refused(code: ErrorCode, from: &str, why: String) -> ClusterError {
    ClusterError::Input(InputError::new(code, from.to_string(), None, why))
}

/// Off loopback, rank 0 without a worker of its own and with nothing to resume must know the
/// run's weights (a model it reads, or the digest it is told): otherwise the first peer holding
/// the token would decide them.
fn model_decided(pin: &ModelPin, settings: &CoordinatorSettings) -> Result<(), ClusterError> {
    let undecided = settings.rank0_runs_no_worker
        && !settings.listen.ip().is_loopback()
        && pin.pinned_by == "first_worker";
    if !undecided {
        return Ok(());
    }
    Err(ClusterError::Input(InputError::new(
        ErrorCode::ModelUndecided,
        "--model-digest".to_string(),
        None,
        format!(
            "listening on {} with no worker of its own, rank 0 cannot read the config's model \
             and needs its weights digest: --model-digest SHA256 (STAGEB_MODEL_DIGEST) or \
             model.weights_sha256 in the config (a worker logs it as weights_sha256=… when its \
             model is loaded; for a GGUF file it is the file's sha256sum); otherwise the first \
             peer to register would decide the run's weights",
            settings.listen
        ),
    )))
}

/// Off loopback, rank 0 without a worker of its own, with weights it hashed or was told and no
/// numerics decided yet, needs `--worker-numerics`: otherwise the first peer holding the token
/// would decide them.
fn numerics_decided(pin: &ModelPin, settings: &CoordinatorSettings) -> Result<(), ClusterError> {
    let undecided = settings.rank0_runs_no_worker
        && settings.worker_numerics.is_none()
        && !settings.listen.ip().is_loopback()
        && matches!(pin.pinned_by, "config" | "operator");
    if !undecided {
        return Ok(());
    }
    Err(ClusterError::Input(InputError::new(
        ErrorCode::NumericsUndecided,
        "--worker-numerics".to_string(),
        None,
        format!(
            "listening on {} with no worker of its own, rank 0 needs --worker-numerics DTYPE/DEVICE \
             (STAGEB_WORKER_NUMERICS): the numerics every worker must load the model with, as a \
             worker logs them (numerics=…, e.g. cpu-q8-fixed-order/cpu); otherwise the first peer \
             to register would decide them",
            settings.listen
        ),
    )))
}

/// The run's context from `model.max_model_len` and the model's declaration (`Err`: rank 0
/// cannot read the model); a conflict is an input error at the config's line.
pub fn run_context(
    inputs: &RunInputs,
    declared: Result<Option<u32>, String>,
) -> Result<Option<limits::RunContext>, InputError> {
    limits::decide_context(inputs.config.model.max_model_len, Some(declared)).map_err(|e| {
        let text = std::fs::read_to_string(&inputs.config_path).unwrap_or_default();
        let line = config::key_line(&text, "model.max_model_len")
            .or_else(|| config::key_line(&text, "model.model_name_or_path"));
        InputError::new(
            ErrorCode::InvalidConfigValue,
            inputs.config_path.display().to_string(),
            line,
            e.to_string(),
        )
    })
}

/// What the model at `path` declares as its context (`Err`: it cannot be read).
pub fn declared_context(path: &Path) -> Result<Option<u32>, String> {
    stageb_worker::engine::declared_context(path)
        .map(|n| n.map(|n| u32::try_from(n).unwrap_or(u32::MAX)))
        .map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_model_file_that_is_missing_or_not_a_model_is_bad_input_naming_the_file() {
        let tmp = tempfile::tempdir().unwrap();
        let missing = tmp.path().join("absent.gguf");
        let garbage = tmp.path().join("garbage.gguf");
        std::fs::write(&garbage, b"not a model").unwrap();
        let error = |path: &Path| match load_model(path, &EngineOptions::default()) {
            Err(e) => e,
            Ok(_) => panic!("{} loaded", path.display()),
        };
        let e = error(&missing);
        assert_eq!(e.code, ErrorCode::FileNotFound);
        assert!(e.to_string().contains("absent.gguf"), "{e}");
        assert_eq!(error(&garbage).code, ErrorCode::UnsupportedModel);
    }
}
