//! Which model and which context a run accepts, and who decided them.
//!
//! One run, one model: every worker's fingerprint must name the run's weights (and, once the
//! first worker completed the id, the same numerics). The run's context length travels with
//! the pin because it is part of the same decision: rank 0 plans every job within it
//! ([`stageb_shared::limits`]), so a worker that holds less is refused at Register, and one that
//! holds more is told the run's context and keeps to it. Whether a prompt fits thus never
//! depends on which worker took the job.
//!
//! The pin is shared (behind a mutex) by the gRPC service, which admits workers, and the run
//! loop, which waits for the context and records both in the manifest.

use std::sync::{Arc, Mutex};

use stageb_shared::limits::{ContextSource, RunContext};

/// Which model a run accepts, and who decided it (recorded in the manifest).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelPin {
    /// The full fingerprint id, once known.
    pub fingerprint: Option<String>,
    /// The weights digest every worker's fingerprint must start with, when rank 0 computed it
    /// from `model.model_name_or_path` itself.
    pub weights_sha256: Option<String>,
    /// `config` (rank 0 hashed the model file), `resumed_run` (the manifest of the run being
    /// resumed) or `first_worker` (rank 0 cannot read the model: the first worker's pins it).
    pub pinned_by: &'static str,
    /// The run's context, once known (from the model file, the config, an earlier attempt,
    /// or else the first admitted worker).
    pub context: Option<RunContext>,
}

impl ModelPin {
    /// Pinned to the weights rank 0 hashed; the first matching worker completes the id
    /// (candle version, dtype, device kind).
    pub fn by_config(weights_sha256: String) -> Self {
        ModelPin {
            fingerprint: None,
            weights_sha256: Some(weights_sha256),
            pinned_by: "config",
            context: None,
        }
    }

    /// Pinned to the full id an earlier attempt recorded.
    pub fn by_resumed_run(fingerprint: String) -> Self {
        ModelPin {
            weights_sha256: Some(weights_of(&fingerprint).to_string()),
            fingerprint: Some(fingerprint),
            pinned_by: "resumed_run",
            context: None,
        }
    }

    /// Nothing known yet: the first worker to register pins the run.
    pub fn by_first_worker() -> Self {
        ModelPin {
            fingerprint: None,
            weights_sha256: None,
            pinned_by: "first_worker",
            context: None,
        }
    }

    /// The run's context is already decided (read from the model or the config, or recorded by
    /// the attempt being resumed).
    pub fn with_context(mut self, context: RunContext) -> Self {
        self.context = Some(context);
        self
    }

    /// Check a worker's fingerprint and context, pinning the full id (and the context, when
    /// still open) on the first acceptable worker. The error never contains the expected
    /// fingerprint (a stranger with a token must not learn it).
    pub fn admit(&mut self, presented: &str, worker_context: u32) -> Result<(), String> {
        if let Some(weights) = &self.weights_sha256
            && weights_of(presented) != weights
        {
            return Err(
                "model fingerprint mismatch: this worker's model weights are not the run's model"
                    .into(),
            );
        }
        if let Some(fp) = &self.fingerprint
            && fp != presented
        {
            return Err("model fingerprint mismatch: this worker runs the run's weights with other numerics (candle version, dtype or device kind)".into());
        }
        if worker_context == 0 {
            return Err("the worker did not state its context length (max_context)".into());
        }
        if let Some(run) = self.context
            && worker_context < run.tokens
        {
            return Err(format!(
                "this worker holds a context of {worker_context} tokens, the run plans with {}; \
                 start it without --max-model-len or with at least that",
                run.tokens
            ));
        }
        self.fingerprint
            .get_or_insert_with(|| presented.to_string());
        self.context.get_or_insert(RunContext {
            tokens: worker_context,
            source: ContextSource::FirstWorker,
        });
        Ok(())
    }
}

/// The weights digest a fingerprint id starts with (`<sha256>|candle-…|dtype|device`).
pub fn weights_of(fingerprint: &str) -> &str {
    fingerprint.split('|').next().unwrap_or(fingerprint)
}

/// The pin, shared between the service and the run loop (which writes it to the manifest).
pub type ModelPinHandle = Arc<Mutex<ModelPin>>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_weights_pinned_by_the_config_cannot_be_squatted() {
        let mut pin = ModelPin::by_config("aaaa".into());
        assert!(pin.admit("bogus|candle-0.11|q|cpu", 8192).is_err());
        assert_eq!(pin.fingerprint, None, "a refused worker pins nothing");
        assert!(pin.admit("aaaa|candle-0.11|q|cpu", 8192).is_ok());
        assert_eq!(pin.fingerprint.as_deref(), Some("aaaa|candle-0.11|q|cpu"));
        let refusal = pin.admit("aaaa|candle-0.11|f32|cuda", 8192).unwrap_err();
        assert!(
            !refusal.contains("aaaa"),
            "never print the expected fingerprint"
        );
    }

    #[test]
    fn without_a_readable_model_the_first_worker_pins_the_run() {
        let mut pin = ModelPin::by_first_worker();
        assert!(pin.admit("x|c|d|cpu", 4096).is_ok());
        assert!(pin.admit("y|c|d|cpu", 4096).is_err());
        assert_eq!(pin.pinned_by, "first_worker");
        assert_eq!(
            pin.context,
            Some(RunContext {
                tokens: 4096,
                source: ContextSource::FirstWorker
            })
        );
    }

    #[test]
    fn a_worker_holding_less_than_the_runs_context_is_refused_and_pins_nothing() {
        let run = RunContext {
            tokens: 8192,
            source: ContextSource::Model,
        };
        let mut pin = ModelPin::by_config("aaaa".into()).with_context(run);
        let refusal = pin.admit("aaaa|c|d|cpu", 2048).unwrap_err();
        assert!(
            refusal.contains("2048") && refusal.contains("8192"),
            "{refusal}"
        );
        assert_eq!(pin.fingerprint, None);
        assert!(pin.admit("aaaa|c|d|cpu", 0).is_err(), "an unstated context");
        assert!(pin.admit("aaaa|c|d|cpu", 32768).is_ok(), "more is fine");
        assert_eq!(pin.context, Some(run), "the run's context is kept");
    }
}
