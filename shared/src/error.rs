//! Stable error codes and the located input error.
//!
//! Every problem with a user's input (config, Stage-A JSONL, guidance, model file) carries a
//! code that never changes between releases, the file, and the line when there is one, so
//! scripts can match on the code and people can jump to the line.

use serde::Serialize;
use std::fmt;

/// Stable codes for bad input. The string form (`code()`) is the contract; never renumber or
/// rename a variant's string.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
pub enum ErrorCode {
    /// An input file does not exist or cannot be read.
    FileNotFound,
    /// A file has no records at all.
    EmptyFile,
    /// A line is not valid UTF-8.
    InvalidUtf8,
    /// A line is longer than the reader accepts.
    LineTooLong,
    /// A line is not valid JSON.
    NotJson,
    /// A line is JSON but not an object.
    NotAnObject,
    /// A required field is missing.
    MissingField,
    /// A required field is present but empty (or of the wrong type).
    EmptyField,
    /// A label that is neither pass nor fail.
    BadLabel,
    /// The same `{group_id}::{label}` appears twice.
    DuplicateTicket,
    /// Records of more than one mission in one run.
    SeveralMissions,
    /// A config key that stageb does not know.
    UnknownConfigKey,
    /// A config key of a feature of the Python original that stageb does not implement.
    UnsupportedConfigKey,
    /// A config value of the wrong type or out of range.
    InvalidConfigValue,
    /// A required config key is missing.
    MissingConfigKey,
    /// The config file is not valid YAML.
    InvalidYaml,
    /// The guidance file is malformed or lacks the mission.
    InvalidGuidance,
    /// A model file stageb cannot load.
    UnsupportedModel,
    /// Two `per_image` keys of one Stage-A record normalize to the same `image_{n}`.
    DuplicateImageKey,
    /// The run directory already holds a run, and neither `--resume` nor `--overwrite` was given.
    RunExists,
    /// `--resume` of a run whose inputs, config or model changed, or that cannot be resumed.
    ResumeMismatch,
    /// Another stageb process is running in the same run directory.
    RunLocked,
    /// No usable GPU for a worker: none visible, or `--device cuda:N` names one that does not
    /// exist.
    InvalidDevice,
    /// An input beyond the run's input budget ([`crate::budget`]): too many tickets or rules,
    /// a guidance file or rule text too large.
    InputBudget,
    /// `stageb coordinator` off loopback, with a model rank 0 can read, and nothing to decide
    /// the workers' numerics (`--worker-numerics`): the first peer to register would.
    NumericsUndecided,
    /// `stageb coordinator` off loopback, unable to read the model, not told its weights digest
    /// (`--model-digest`, `model.weights_sha256`) and with nothing to resume: the first peer to
    /// register would decide the run's weights.
    ModelUndecided,
    /// The weights digest rank 0 was told (`--model-digest`, `model.weights_sha256`) is not the
    /// digest of the model file it reads.
    ModelDigestMismatch,
}

impl ErrorCode {
    pub fn code(self) -> &'static str {
        match self {
            ErrorCode::FileNotFound => "E_FILE_NOT_FOUND",
            ErrorCode::EmptyFile => "E_EMPTY_FILE",
            ErrorCode::InvalidUtf8 => "E_INVALID_UTF8",
            ErrorCode::LineTooLong => "E_LINE_TOO_LONG",
            ErrorCode::NotJson => "E_NOT_JSON",
            ErrorCode::NotAnObject => "E_NOT_OBJECT",
            ErrorCode::MissingField => "E_MISSING_FIELD",
            ErrorCode::EmptyField => "E_EMPTY_FIELD",
            ErrorCode::BadLabel => "E_BAD_LABEL",
            ErrorCode::DuplicateTicket => "E_DUPLICATE_TICKET",
            ErrorCode::SeveralMissions => "E_SEVERAL_MISSIONS",
            ErrorCode::UnknownConfigKey => "E_UNKNOWN_CONFIG_KEY",
            ErrorCode::UnsupportedConfigKey => "E_UNSUPPORTED_CONFIG_KEY",
            ErrorCode::InvalidConfigValue => "E_INVALID_CONFIG_VALUE",
            ErrorCode::MissingConfigKey => "E_MISSING_CONFIG_KEY",
            ErrorCode::InvalidYaml => "E_INVALID_YAML",
            ErrorCode::InvalidGuidance => "E_INVALID_GUIDANCE",
            ErrorCode::UnsupportedModel => "E_UNSUPPORTED_MODEL",
            ErrorCode::DuplicateImageKey => "E_DUPLICATE_IMAGE_KEY",
            ErrorCode::RunExists => "E_RUN_EXISTS",
            ErrorCode::ResumeMismatch => "E_RESUME_MISMATCH",
            ErrorCode::RunLocked => "E_RUN_LOCKED",
            ErrorCode::InvalidDevice => "E_INVALID_DEVICE",
            ErrorCode::InputBudget => "E_INPUT_BUDGET",
            ErrorCode::NumericsUndecided => "E_NUMERICS_UNDECIDED",
            ErrorCode::ModelUndecided => "E_MODEL_UNDECIDED",
            ErrorCode::ModelDigestMismatch => "E_MODEL_DIGEST_MISMATCH",
        }
    }
}

impl fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.code())
    }
}

/// A problem with user input, located as precisely as the input allows.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub struct InputError {
    pub code: ErrorCode,
    pub file: String,
    /// 1-based line, when the problem has one.
    pub line: Option<usize>,
    pub message: String,
}

impl InputError {
    pub fn new(
        code: ErrorCode,
        file: impl Into<String>,
        line: Option<usize>,
        message: impl Into<String>,
    ) -> Self {
        InputError {
            code,
            file: file.into(),
            line,
            message: message.into(),
        }
    }
}

impl fmt::Display for InputError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.line {
            Some(line) => write!(
                f,
                "{}:{}: {} [{}]",
                self.file, line, self.message, self.code
            ),
            None => write!(f, "{}: {} [{}]", self.file, self.message, self.code),
        }
    }
}
