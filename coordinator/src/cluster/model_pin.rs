//! Which model and which context a run accepts, and who decided them.
//!
//! One run, one model: every worker's fingerprint must name the run's weights (and, once the
//! first worker completed the id, the same numerics). The run's context length travels with
//! the pin because it is part of the same decision: rank 0 plans every job within it
//! ([`stageb_shared::limits`]), so a worker that holds less is refused at Register, and one that
//! holds more is told the run's context and keeps to it. Whether a prompt fits thus never
//! depends on which worker took the job.
//!
//! Who decides the numerics (the id after the weights digest: candle version, dtype, device
//! kind) matters as much as the weights: a peer that registers first with a made-up suffix
//! would otherwise lock every real worker out. When rank 0 runs a worker itself (`run`,
//! `launch`), that worker's fingerprint decides them ([`ModelPin::expect_local`],
//! [`ModelPin::decide_local`]); everyone else is told to retry until it has. When rank 0 hashed
//! the weights itself, a suffix this build cannot produce is refused
//! ([`ModelPin::with_numerics_check`]).
//!
//! The pin is shared (behind a mutex) by the gRPC service, which admits workers, and the run
//! loop, which waits for the context and records both in the manifest.

use std::sync::{Arc, Mutex};

use stageb_shared::limits::{ContextSource, RunContext};

/// Which model a run accepts, and who decided it (recorded in the manifest).
#[derive(Debug, Clone)]
pub struct ModelPin {
    /// The full fingerprint id, once known.
    pub fingerprint: Option<String>,
    /// The weights digest every worker's fingerprint must start with, when rank 0 computed it
    /// from `model.model_name_or_path` itself.
    pub weights_sha256: Option<String>,
    /// `config` (rank 0 hashed the model file), `operator` (rank 0 was told the weights
    /// digest), `resumed_run` (the manifest of the run being resumed) or `first_worker`
    /// (rank 0 cannot read the model and was told nothing: the first worker's pins it).
    pub pinned_by: &'static str,
    /// The run's context, once known (from the model file, the config, an earlier attempt,
    /// or else the first admitted worker).
    pub context: Option<RunContext>,
    /// Who decided the numerics: `resumed_run`, `operator` (`--worker-numerics`),
    /// `rank0_worker` (the worker rank 0 runs itself) or `first_worker` (rank 0 runs none).
    pub numerics_pinned_by: &'static str,
    /// Rank 0's own worker is still loading: until it decides the numerics, other workers are
    /// told to retry.
    awaiting_local: bool,
    /// The numerics the operator decided (`--worker-numerics`), when given.
    expected_numerics: Option<String>,
    /// The fingerprint suffixes (`candle-…|dtype|device`) this build can produce, when rank 0
    /// knows them (it hashed the weights itself).
    numerics_check: Option<fn(&str) -> bool>,
}

/// Why a worker is not admitted (yet).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PinRefusal {
    /// Rank 0's own worker has not decided the numerics yet: retry (`UNAVAILABLE`).
    NotYet(String),
    /// This worker cannot serve the run (`FAILED_PRECONDITION`).
    Refused(String),
}

impl std::fmt::Display for PinRefusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            PinRefusal::NotYet(m) | PinRefusal::Refused(m) => f.write_str(m),
        }
    }
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
            numerics_pinned_by: "first_worker",
            awaiting_local: false,
            expected_numerics: None,
            numerics_check: None,
        }
    }

    /// Pinned to the weights digest the operator gave rank 0 (`--model-digest`,
    /// `model.weights_sha256`), for a rank 0 that cannot read the model: as
    /// [`ModelPin::by_config`], the first matching worker completes the id.
    pub fn by_operator(weights_sha256: String) -> Self {
        ModelPin {
            pinned_by: "operator",
            ..ModelPin::by_config(weights_sha256)
        }
    }

    /// Pinned to the full id an earlier attempt recorded.
    pub fn by_resumed_run(fingerprint: String) -> Self {
        ModelPin {
            weights_sha256: Some(weights_of(&fingerprint).to_string()),
            fingerprint: Some(fingerprint),
            pinned_by: "resumed_run",
            context: None,
            numerics_pinned_by: "resumed_run",
            awaiting_local: false,
            expected_numerics: None,
            numerics_check: None,
        }
    }

    /// Nothing known yet: the first worker to register pins the run.
    pub fn by_first_worker() -> Self {
        ModelPin {
            fingerprint: None,
            weights_sha256: None,
            pinned_by: "first_worker",
            context: None,
            numerics_pinned_by: "first_worker",
            awaiting_local: false,
            expected_numerics: None,
            numerics_check: None,
        }
    }

    /// The run's context is already decided (read from the model or the config, or recorded by
    /// the attempt being resumed).
    pub fn with_context(mut self, context: RunContext) -> Self {
        self.context = Some(context);
        self
    }

    /// Refuse fingerprints whose suffix `known` rejects (a suffix this build cannot produce).
    /// Only meaningful with weights rank 0 hashed itself; a run pinned by its first worker
    /// (rank 0 cannot read the model, e.g. the load generator's scripted workers) keeps
    /// accepting any suffix.
    pub fn with_numerics_check(mut self, known: fn(&str) -> bool) -> Self {
        if self.weights_sha256.is_some() {
            self.numerics_check = Some(known);
        }
        self
    }

    /// The operator decided the numerics (`stageb coordinator --worker-numerics`): every
    /// worker's fingerprint must end in `numerics` (`candle-<ver>|dtype|device`). An error when
    /// a resumed run recorded other numerics.
    pub fn with_expected_numerics(mut self, numerics: &str) -> Result<Self, String> {
        if let Some(fp) = &self.fingerprint {
            if numerics_kind(numerics_of(fp)) != numerics_kind(numerics) {
                return Err(format!(
                    "the run being resumed ran with the numerics `{}`, not `{numerics}`",
                    numerics_of(fp)
                ));
            }
            return Ok(self);
        }
        self.expected_numerics = Some(numerics.to_string());
        self.numerics_pinned_by = "operator";
        Ok(self)
    }

    /// Rank 0 is starting a worker of its own: its fingerprint will decide the numerics, and
    /// until then (or [`ModelPin::release_local`]) other workers are told to retry. Nothing
    /// changes when the numerics are decided already (a resumed run, the operator's flag).
    pub fn expect_local(&mut self) {
        if self.fingerprint.is_none() && self.expected_numerics.is_none() {
            self.awaiting_local = true;
        }
    }

    /// Rank 0's own worker loaded its model: its fingerprint is the run's, when its weights are
    /// the run's and nothing decided the numerics before (later local workers are admitted or
    /// refused like anyone).
    pub fn decide_local(&mut self, fingerprint: &str) {
        if !self.awaiting_local {
            return;
        }
        self.awaiting_local = false;
        let weights_ok = self
            .weights_sha256
            .as_deref()
            .is_none_or(|w| weights_of(fingerprint) == w);
        if weights_ok && self.fingerprint.is_none() {
            self.fingerprint = Some(fingerprint.to_string());
            self.numerics_pinned_by = "rank0_worker";
        }
    }

    /// Rank 0's own worker could not load its model: the first acceptable worker decides.
    pub fn release_local(&mut self) {
        self.awaiting_local = false;
    }

    /// Check a worker's fingerprint and context, pinning the full id (and the context, when
    /// still open) on the first acceptable worker. The error never contains the expected
    /// fingerprint (a stranger with a token must not learn it).
    pub fn admit(&mut self, presented: &str, worker_context: u32) -> Result<(), PinRefusal> {
        let refused = |m: &str| Err(PinRefusal::Refused(m.to_string()));
        if let Some(weights) = &self.weights_sha256
            && weights_of(presented) != weights
        {
            return refused(
                "model fingerprint mismatch: this worker's model weights are not the run's model",
            );
        }
        if let Some(known) = self.numerics_check
            && !known(numerics_of(presented))
        {
            return refused(
                "model fingerprint refused: its numerics (candle version, dtype, device kind) are none this build produces",
            );
        }
        if let Some(expected) = &self.expected_numerics
            && numerics_kind(numerics_of(presented)) != numerics_kind(expected)
        {
            return refused(
                "model fingerprint refused: its numerics (candle version, dtype, device kind) are not the ones rank 0 was started with (--worker-numerics)",
            );
        }
        if let Some(fp) = &self.fingerprint
            && fp != presented
        {
            if weights_of(fp) != weights_of(presented) {
                return refused(
                    "model fingerprint mismatch: this worker's model weights are not the run's model",
                );
            }
            // Same weights, so naming the run's numerics tells the worker nothing it could
            // squat with (the run is pinned already), and tells its operator which GPU kind,
            // cuBLAS version or dtype to bring.
            return refused(&format!(
                "model fingerprint mismatch: this worker runs the run's weights with other \
                 numerics (candle version, dtype, or device: GPU model, compute capability, SM \
                 count, cuBLAS version): the run's are `{}`, this worker's `{}`",
                numerics_of(fp),
                numerics_of(presented)
            ));
        }
        if self.awaiting_local {
            return Err(PinRefusal::NotYet(
                "rank 0's own worker is still loading the model (it decides the run's numerics); retry".into(),
            ));
        }
        if worker_context == 0 {
            return refused("the worker did not state its context length (max_context)");
        }
        if let Some(run) = self.context
            && worker_context < run.tokens
        {
            return Err(PinRefusal::Refused(format!(
                "this worker holds a context of {worker_context} tokens, the run plans with {}; \
                 start it without --max-model-len or with at least that",
                run.tokens
            )));
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

/// Numerics with their device part reduced to the kind (`candle-…|cuda-bf16|cuda` of
/// `candle-…|cuda-bf16|cuda(NVIDIA H200; …)`): what an operator names with `--worker-numerics`;
/// the first worker admitted pins the device's details.
fn numerics_kind(numerics: &str) -> &str {
    let device_at = numerics.rfind('|').map_or(0, |i| i + 1);
    match numerics[device_at..].find('(') {
        Some(open) => &numerics[..device_at + open],
        None => numerics,
    }
}

/// The weights digest a fingerprint id starts with (`<sha256>|candle-…|dtype|device`).
pub fn weights_of(fingerprint: &str) -> &str {
    fingerprint.split('|').next().unwrap_or(fingerprint)
}

/// The numerics part of a fingerprint id (`candle-…|dtype|device`; empty when there is none).
pub fn numerics_of(fingerprint: &str) -> &str {
    fingerprint.split_once('|').map_or("", |(_, rest)| rest)
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
        let refusal = pin
            .admit("aaaa|candle-0.11|f32|cuda", 8192)
            .unwrap_err()
            .to_string();
        assert!(
            !refusal.contains("aaaa"),
            "never print the expected fingerprint"
        );
    }

    #[test]
    fn weights_the_operator_gave_admit_no_other_and_say_who_pinned_them() {
        let mut pin = ModelPin::by_operator("aaaa".into()).with_numerics_check(known);
        assert_eq!(pin.pinned_by, "operator");
        let other = pin.admit("bbbb|candle-0.11|cpu-q8-fixed-order|cpu", 8192);
        assert!(matches!(other, Err(PinRefusal::Refused(_))), "{other:?}");
        assert_eq!(pin.fingerprint, None, "a refused worker pins nothing");
        assert!(
            pin.admit("aaaa|candle-0.11|cpu-q8-fixed-order|cpu", 8192)
                .is_ok()
        );
        assert_eq!(pin.numerics_pinned_by, "first_worker");
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
        let refusal = pin.admit("aaaa|c|d|cpu", 2048).unwrap_err().to_string();
        assert!(
            refusal.contains("2048") && refusal.contains("8192"),
            "{refusal}"
        );
        assert_eq!(pin.fingerprint, None);
        assert!(pin.admit("aaaa|c|d|cpu", 0).is_err(), "an unstated context");
        assert!(pin.admit("aaaa|c|d|cpu", 32768).is_ok(), "more is fine");
        assert_eq!(pin.context, Some(run), "the run's context is kept");
    }

    fn known(numerics: &str) -> bool {
        matches!(
            numerics,
            "candle-0.11|cpu-q8-fixed-order|cpu" | "candle-0.11|cuda-bf16|cuda"
        )
    }

    #[test]
    fn a_made_up_fingerprint_suffix_cannot_pin_the_numerics() {
        // Rank 0 runs a worker of its own: a token holder registering first with the run's
        // weights and another (even valid) suffix is told to retry, and once rank 0's worker
        // decided, it is refused; the real workers are admitted.
        let mut pin = ModelPin::by_config("aaaa".into()).with_numerics_check(known);
        pin.expect_local();
        let squatter = pin.admit("aaaa|candle-0.11|cuda-bf16|cuda", 8192);
        assert!(
            matches!(squatter, Err(PinRefusal::NotYet(_))),
            "{squatter:?}"
        );
        assert_eq!(pin.fingerprint, None, "a waiting worker pins nothing");
        pin.decide_local("aaaa|candle-0.11|cpu-q8-fixed-order|cpu");
        assert_eq!(pin.numerics_pinned_by, "rank0_worker");
        let squatter = pin.admit("aaaa|candle-0.11|cuda-bf16|cuda", 8192);
        assert!(
            matches!(squatter, Err(PinRefusal::Refused(_))),
            "{squatter:?}"
        );
        assert!(
            pin.admit("aaaa|candle-0.11|cpu-q8-fixed-order|cpu", 8192)
                .is_ok()
        );
    }

    #[test]
    fn without_a_rank0_worker_a_suffix_this_build_cannot_produce_is_refused() {
        let mut pin = ModelPin::by_config("aaaa".into()).with_numerics_check(known);
        let made_up = pin.admit("aaaa|candle-0.11|q|cpu-made-up", 8192);
        assert!(
            matches!(made_up, Err(PinRefusal::Refused(_))),
            "{made_up:?}"
        );
        assert_eq!(pin.fingerprint, None);
        assert!(
            pin.admit("aaaa|candle-0.11|cpu-q8-fixed-order|cpu", 8192)
                .is_ok()
        );
        assert_eq!(pin.numerics_pinned_by, "first_worker");
        // Without weights rank 0 hashed (the load generator's scripted workers) any suffix goes.
        let mut open = ModelPin::by_first_worker().with_numerics_check(known);
        assert!(open.admit("loadgen|none|none|cpu", 4096).is_ok());
    }

    const H200: &str =
        "aaaa|candle-0.11|cuda-bf16|cuda(NVIDIA H200; cc 9.0; 132 SMs; cuBLAS 13.1.0)";
    const A100: &str =
        "aaaa|candle-0.11|cuda-bf16|cuda(NVIDIA A100-SXM4-80GB; cc 8.0; 108 SMs; cuBLAS 13.1.0)";

    #[test]
    fn a_worker_on_another_gpu_kind_is_refused_with_both_devices_named() {
        let mut pin = ModelPin::by_config("aaaa".into());
        assert!(pin.admit(H200, 8192).is_ok());
        let refusal = pin.admit(A100, 8192).unwrap_err();
        assert!(matches!(refusal, PinRefusal::Refused(_)), "{refusal:?}");
        let refusal = refusal.to_string();
        assert!(
            refusal.contains("cuda(NVIDIA H200; cc 9.0; 132 SMs; cuBLAS 13.1.0)")
                && refusal.contains("cuda(NVIDIA A100-SXM4-80GB; cc 8.0; 108 SMs; cuBLAS 13.1.0)"),
            "the refusal names the run's device and the worker's: {refusal}"
        );
        assert!(
            !refusal.contains("aaaa"),
            "never print the weights digest: {refusal}"
        );
        // Only the cuBLAS version differs: refused just the same.
        let other_cublas = H200.replace("cuBLAS 13.1.0", "cuBLAS 13.0.2");
        let refusal = pin.admit(&other_cublas, 8192).unwrap_err().to_string();
        assert!(
            refusal.contains("cuBLAS 13.0.2") && refusal.contains("cuBLAS 13.1.0"),
            "{refusal}"
        );
        assert!(
            pin.admit(H200, 8192).is_ok(),
            "the same GPU kind is admitted"
        );
        assert_eq!(pin.fingerprint.as_deref(), Some(H200));
    }

    #[test]
    fn without_the_runs_weights_the_refusal_names_no_numerics() {
        let mut pin = ModelPin::by_first_worker();
        assert!(pin.admit(H200, 8192).is_ok());
        let refusal = pin
            .admit(&A100.replace("aaaa", "bbbb"), 8192)
            .unwrap_err()
            .to_string();
        assert!(refusal.contains("weights"), "{refusal}");
        assert!(!refusal.contains("H200"), "{refusal}");
    }

    #[test]
    fn numerics_the_operator_named_by_kind_admit_the_first_gpu_which_pins_its_details() {
        let mut pin = ModelPin::by_config("aaaa".into())
            .with_expected_numerics("candle-0.11|cuda-bf16|cuda")
            .unwrap();
        assert!(pin.admit(H200, 8192).is_ok());
        assert_eq!(pin.fingerprint.as_deref(), Some(H200));
        assert!(
            pin.admit(A100, 8192).is_err(),
            "another GPU kind after the pin"
        );
        let resumed = ModelPin::by_resumed_run(H200.into());
        assert!(
            resumed
                .with_expected_numerics("candle-0.11|cuda-bf16|cuda")
                .is_ok(),
            "a resumed CUDA run accepts the operator's kind"
        );
    }

    #[test]
    fn a_rank0_worker_that_fails_to_load_lets_the_first_worker_decide() {
        let mut pin = ModelPin::by_config("aaaa".into());
        pin.expect_local();
        assert!(pin.admit("aaaa|c|d|cpu", 4096).is_err());
        pin.release_local();
        assert!(pin.admit("aaaa|c|d|cpu", 4096).is_ok());
        // A resumed run's numerics are decided already: nobody waits for rank 0's worker.
        let mut resumed = ModelPin::by_resumed_run("aaaa|c|d|cpu".into());
        resumed.expect_local();
        assert!(resumed.admit("aaaa|c|d|cpu", 4096).is_ok());
        resumed.decide_local("aaaa|c|e|cuda");
        assert_eq!(resumed.fingerprint.as_deref(), Some("aaaa|c|d|cpu"));
    }

    #[test]
    fn numerics_the_operator_decided_admit_no_other_whoever_comes_first() {
        let mut pin = ModelPin::by_config("aaaa".into())
            .with_expected_numerics("candle-0.11|cpu-q8-fixed-order|cpu")
            .unwrap();
        assert_eq!(pin.numerics_pinned_by, "operator");
        pin.expect_local();
        let squatter = pin.admit("aaaa|candle-0.11|cuda-bf16|cuda", 8192);
        assert!(
            matches!(squatter, Err(PinRefusal::Refused(_))),
            "{squatter:?}"
        );
        assert!(
            pin.admit("aaaa|candle-0.11|cpu-q8-fixed-order|cpu", 8192)
                .is_ok()
        );
        let resumed = ModelPin::by_resumed_run("aaaa|candle-0.11|cuda-bf16|cuda".into());
        assert!(
            resumed
                .with_expected_numerics("candle-0.11|cpu-q8-fixed-order|cpu")
                .is_err(),
            "a resumed run keeps the numerics it ran with"
        );
    }
}
