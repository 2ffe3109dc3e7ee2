//! The rollout jobs of a config's first epoch as JSON lines, exactly as rank 0 builds them
//! (`rollout_payload`: the prompt from the seed guidance, one seed per candidate), for
//! replaying the same work through another engine (`scripts/bench/bench-engine.sh --demo` feeds
//! them to llama.cpp's server). Bench tooling, not the product path.
//!
//! ```text
//! cargo run --example rollout_jobs -- examples/demo/config.yaml > jobs.jsonl
//! ```
//!
//! One line per ticket, in input order:
//! `{"ticket_key", "messages": [{"role","content"}], "decodes": [{...,"seeds": [...]}], "constrained"}`.

use std::path::PathBuf;

use serde_json::json;
use stageb_coordinator::cluster::scheduler::JobPayload;
use stageb_coordinator::guidance::load_mission_section;
use stageb_coordinator::run::rollout_payload;
use stageb_shared::config::load_config;
use stageb_shared::ingest::load_tickets;

fn main() -> anyhow::Result<()> {
    let path: PathBuf = std::env::args()
        .nth(1)
        .ok_or_else(|| anyhow::anyhow!("usage: rollout_jobs CONFIG.yaml"))?
        .into();
    let cfg = load_config(&path)?.config;
    let ingested = load_tickets(&cfg.stage_a_paths)?;
    let guidance = load_mission_section(&cfg.guidance.path, &ingested.mission)?;
    let lines = guidance.render_for_prompt();
    for ticket in &ingested.tickets {
        let JobPayload::Rollout {
            messages,
            decodes,
            constrained,
        } = rollout_payload(&cfg, 1, ticket, &lines)
        else {
            anyhow::bail!("a rollout payload was expected");
        };
        let line = json!({
            "ticket_key": ticket.key().as_str(),
            "messages": messages.iter().map(|m| json!({"role": m.role, "content": m.content})).collect::<Vec<_>>(),
            "decodes": decodes.iter().map(|d| json!({
                "temperature": d.temperature,
                "top_p": d.top_p,
                "repetition_penalty": d.repetition_penalty,
                "max_new_tokens": d.max_new_tokens,
                "seeds": d.seeds,
            })).collect::<Vec<_>>(),
            "constrained": constrained,
        });
        println!("{line}");
    }
    Ok(())
}
