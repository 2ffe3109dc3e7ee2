//! `stageb generate`: read the prompt files, load the model, run the prompt
//! ([`stageb_worker::generate`]) and print each candidate: a JSON line, or a text block and a
//! closing timing line on stderr.

use anyhow::{Context, Result, anyhow};
use stageb::exit;
use stageb_worker::generate::{PromptSpec, run_prompt};

use crate::cli::GenerateArgs;

pub(crate) fn run(args: GenerateArgs) -> Result<u8> {
    let read = |path: &std::path::Path| {
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))
    };
    let spec = PromptSpec {
        user: read(&args.prompt_file)?,
        system: args.system_file.as_deref().map(read).transpose()?,
        candidates: args.candidates,
        seed: args.seed,
        temperature: args.temperature,
        top_p: args.top_p,
        repetition_penalty: args.repetition_penalty,
        max_new_tokens: args.max_new_tokens,
        constrained: !args.unconstrained,
    };
    let mut engine = args.model_args.load(&args.model)?;
    let out = run_prompt(&mut engine, &spec).map_err(|e| anyhow!("{e} [{}]", e.code()))?;
    for row in &out.rows {
        if args.json {
            println!("{}", serde_json::to_string(row)?);
        } else {
            println!("{}", row.text_block());
        }
    }
    if !args.json {
        eprintln!("{}", out.timing_line());
    }
    Ok(exit::OK)
}
