//! The one-shot commands' flags: `tls-init`, `validate`, `generate`, `audit`, `report`,
//! `compare`. None of
//! them is a role a launcher starts, so only the model's flags read the environment.

use std::path::PathBuf;

use clap::Args;

use super::ModelArgs;

/// `stageb tls-init`.
#[derive(Args)]
pub(crate) struct TlsInitArgs {
    /// Directory to write into (created; on a shared filesystem for multi-node jobs).
    pub(crate) dir: PathBuf,
    /// Extra DNS names or IP addresses for the certificate (besides
    /// `stageb-coordinator`, `localhost`, `127.0.0.1`, `::1` and this host's name).
    #[arg(long = "host")]
    pub(crate) hosts: Vec<String>,
    /// Days the certificates stay valid.
    #[arg(long, default_value_t = 7)]
    pub(crate) days: u32,
}

/// `stageb validate`.
#[derive(Args)]
pub(crate) struct ValidateArgs {
    pub(crate) config: PathBuf,
}

/// `stageb generate`.
#[derive(Args)]
pub(crate) struct GenerateArgs {
    #[arg(long, env = "STAGEB_MODEL")]
    pub(crate) model: PathBuf,
    /// File with the user message.
    #[arg(long)]
    pub(crate) prompt_file: PathBuf,
    /// Optional system message file.
    #[arg(long)]
    pub(crate) system_file: Option<PathBuf>,
    #[arg(long, default_value_t = 8)]
    pub(crate) candidates: u32,
    #[arg(long, default_value_t = 17)]
    pub(crate) seed: u64,
    #[arg(long, default_value_t = 0.7)]
    pub(crate) temperature: f32,
    #[arg(long, default_value_t = 0.9)]
    pub(crate) top_p: f32,
    #[arg(long, default_value_t = 1.0)]
    pub(crate) repetition_penalty: f32,
    #[arg(long, default_value_t = 48)]
    pub(crate) max_new_tokens: u32,
    /// Decode without the two-line contract constraint.
    #[arg(long)]
    pub(crate) unconstrained: bool,
    /// One JSON object per line per candidate.
    #[arg(long)]
    pub(crate) json: bool,
    #[command(flatten)]
    pub(crate) model_args: ModelArgs,
}

/// `stageb audit`.
#[derive(Args)]
pub(crate) struct AuditArgs {
    /// `{output.root}/{run_name}/{mission}`.
    pub(crate) run_dir: PathBuf,
    /// Print the report as JSON.
    #[arg(long)]
    pub(crate) json: bool,
}

/// `stageb compare`.
#[derive(Args)]
pub(crate) struct CompareArgs {
    /// The reference run directory (`{output.root}/{run_name}/{mission}`).
    pub(crate) reference: PathBuf,
    /// The run directory compared with it.
    pub(crate) run: PathBuf,
    /// Print one JSON object (`equal`, `differing`, `selection_rows`, `rows_lost`,
    /// `rows_duplicated`) instead of one line per file.
    #[arg(long)]
    pub(crate) json: bool,
}

/// `stageb report`.
#[derive(Args)]
pub(crate) struct ReportCommandArgs {
    /// `{output.root}/{run_name}/{mission}`.
    pub(crate) run_dir: PathBuf,
    /// Where to write it (default: RUN_DIR/report.html).
    #[arg(long)]
    pub(crate) out: Option<PathBuf>,
    /// Run `stageb audit` for the verdict at the top: auto skips it when the artifacts
    /// pass 256 MiB (the audit keeps every selection in memory).
    #[arg(long, value_enum, default_value_t = AuditChoice::Auto)]
    pub(crate) audit: AuditChoice,
}

/// `stageb report --audit`.
#[derive(Clone, Copy, clap::ValueEnum)]
pub(crate) enum AuditChoice {
    Auto,
    Always,
    Never,
}

impl From<AuditChoice> for stageb_inspect::report::AuditMode {
    fn from(choice: AuditChoice) -> Self {
        match choice {
            AuditChoice::Auto => Self::Auto,
            AuditChoice::Always => Self::Always,
            AuditChoice::Never => Self::Never,
        }
    }
}
