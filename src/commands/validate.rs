//! `stageb validate`: config, Stage-A inputs, guidance section, model file and prompts are
//! checked, and what a run would plan with is printed; nothing runs.

use std::path::Path;

use anyhow::Result;
use stageb::exit;
use stageb::roles;
use stageb_coordinator::run::{RunInputs, start};
use stageb_shared::error::{ErrorCode, InputError};
use stageb_shared::limits::{ContextSource, EffectiveLimits, RunContext};

pub(crate) fn run(config: &Path) -> Result<u8> {
    let inputs = roles::prepare_inputs(config, "validate")?;
    let cfg = &inputs.config;
    stageb_coordinator::guidance::load_mission_section(
        &cfg.guidance.path,
        &inputs.ingested.mission,
    )?;
    let model = Path::new(&cfg.model.model_name_or_path);
    if !model.exists() {
        return Err(InputError::new(
            ErrorCode::FileNotFound,
            model.display().to_string(),
            None,
            "model file not found (run scripts/fetch-model.sh for the demo model)",
        )
        .into());
    }
    for prompt in [
        &cfg.reflection.decision_prompt_path,
        &cfg.reflection.ops_prompt_path,
    ]
    .into_iter()
    .flatten()
    {
        check_prompt(prompt)?;
    }
    // Decided before saying ok: a length the model cannot hold is an input error.
    let context = roles::run_context(&inputs, roles::declared_context(model))?;
    for n in &inputs.notices {
        println!("warning: {n}");
    }
    println!(
        "ok: mission {}, {} tickets, {} candidates per ticket, {} epochs, model {}",
        inputs.ingested.mission,
        inputs.ingested.tickets.len(),
        cfg.candidates_per_ticket(),
        cfg.runner.epochs,
        model.display()
    );
    print_effective_limits(&inputs, context);
    // What a start would do with the run directory (a plain start there would be refused).
    if let Some(note) = start::existing_run_note(&inputs)? {
        println!("note: {note}");
    }
    Ok(exit::OK)
}

/// A reflection prompt file must be readable and say something.
fn check_prompt(prompt: &Path) -> Result<(), InputError> {
    let text = std::fs::read_to_string(prompt).map_err(|e| {
        InputError::new(
            ErrorCode::FileNotFound,
            prompt.display().to_string(),
            None,
            format!("cannot read prompt: {e}"),
        )
    })?;
    if text.trim().is_empty() {
        return Err(InputError::new(
            ErrorCode::EmptyFile,
            prompt.display().to_string(),
            None,
            "prompt file is empty",
        ));
    }
    Ok(())
}

/// The lengths a run of `inputs` would plan with, and every config value it would lower.
fn print_effective_limits(inputs: &RunInputs, context: Option<RunContext>) {
    let Some(context) = context else {
        println!(
            "note: cannot read the model's context here; the first worker to register states it"
        );
        return;
    };
    let limits = EffectiveLimits::fit(&inputs.config, context);
    println!(
        "context: {} tokens (from the {}); rollouts generate at most {:?} tokens, reflection \
         {} tokens after a prompt of at most {}",
        limits.context,
        match limits.context_source {
            ContextSource::Model => "model file",
            ContextSource::Config => "config's model.max_model_len",
            ContextSource::FirstWorker => "first worker",
        },
        limits.rollout_max_new_tokens,
        limits.reflection_max_new_tokens,
        limits.reflection_prompt_budget()
    );
    for a in &limits.adjusted {
        println!(
            "warning: {} asks for {} tokens, the run uses {}: {}",
            a.key, a.asked, a.used, a.why
        );
    }
}
