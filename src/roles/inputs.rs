//! The config and Stage-A inputs a role starts from, paths resolved like the original's and
//! recorded as the config wrote them.

use std::path::{Path, PathBuf};

use stageb_coordinator::run::RunInputs;
use stageb_shared::config::load_config;
use stageb_shared::ingest::{Ingested, load_tickets};

use super::ClusterError;

/// Load and validate the config and its Stage-A inputs. Relative paths resolve against the
/// working directory, as in the original ([`prepare_inputs_in`]).
pub fn prepare_inputs(config_path: &Path, mode: &str) -> Result<RunInputs, ClusterError> {
    let cwd = std::env::current_dir().map_err(ClusterError::Cwd)?;
    prepare_inputs_in(config_path, mode, &cwd)
}

/// [`prepare_inputs`] with the config's relative paths resolved against `base_dir` (a run's
/// working directory; a spec's stand-in for one). What the run records names its inputs as
/// the config wrote them, and the config itself relative to `base_dir` when it lies inside it,
/// so the same config run from two checkouts records the same manifest.
pub fn prepare_inputs_in(
    config_path: &Path,
    mode: &str,
    base_dir: &Path,
) -> Result<RunInputs, ClusterError> {
    let loaded = load_config(config_path)?;
    for notice in &loaded.notices {
        tracing::warn!("{notice}");
    }
    let config = loaded.config.with_paths_resolved(base_dir);
    let mut ingested = load_tickets(&config.stage_a_paths)?;
    tracing::info!(mission = %ingested.mission, tickets = ingested.tickets.len(), "inputs loaded");
    name_inputs_as_written(
        &mut ingested,
        &loaded.config.stage_a_paths,
        &config.stage_a_paths,
    );
    let recorded_path = config_path
        .strip_prefix(base_dir)
        .unwrap_or(config_path)
        .to_path_buf();
    let mut notices = loaded.notices;
    for notice in &mut notices {
        notice.file = recorded_path.display().to_string();
    }
    Ok(RunInputs {
        config,
        config_as_written: loaded.config,
        config_path: recorded_path,
        config_sha256: loaded.source_text_sha256,
        notices,
        ingested,
        mode: mode.to_string(),
        tuning: None,
    })
}

/// Name each Stage-A file (its digest, its tickets' source) by the path the config wrote
/// (`written[i]`) instead of the one it was opened at (`resolved[i]`).
fn name_inputs_as_written(ingested: &mut Ingested, written: &[PathBuf], resolved: &[PathBuf]) {
    for (digest, path) in ingested.input_digests.iter_mut().zip(written) {
        digest.path.clone_from(path);
    }
    let labels: Vec<(String, String)> = resolved
        .iter()
        .zip(written)
        .map(|(r, w)| (r.display().to_string(), w.display().to_string()))
        .collect();
    for ticket in &mut ingested.tickets {
        if let Some((_, written)) = labels.iter().find(|(r, _)| *r == ticket.source.file) {
            ticket.source.file.clone_from(written);
        }
    }
}

/// The model path of a config, resolved like the original (relative to the working directory).
pub fn model_path_of(config_path: &Path) -> Result<PathBuf, ClusterError> {
    let loaded = load_config(config_path)?;
    let cwd = std::env::current_dir().map_err(ClusterError::Cwd)?;
    Ok(stageb_shared::config::resolve_config_path(
        Path::new(&loaded.config.model.model_name_or_path),
        &cwd,
    ))
}
