//! The config and Stage-A inputs a role starts from, paths resolved like the original's.

use std::path::{Path, PathBuf};

use stageb_coordinator::run::RunInputs;
use stageb_shared::config::load_config;
use stageb_shared::ingest::load_tickets;

use super::ClusterError;

/// Load and validate the config and its Stage-A inputs. Relative paths resolve against the
/// working directory, as in the original.
pub fn prepare_inputs(config_path: &Path, mode: &str) -> Result<RunInputs, ClusterError> {
    let loaded = load_config(config_path)?;
    for notice in &loaded.notices {
        tracing::warn!("{notice}");
    }
    let cwd = std::env::current_dir().map_err(ClusterError::Cwd)?;
    let config = loaded.config.with_paths_resolved(&cwd);
    let ingested = load_tickets(&config.stage_a_paths)?;
    tracing::info!(mission = %ingested.mission, tickets = ingested.tickets.len(), "inputs loaded");
    Ok(RunInputs {
        config,
        config_path: config_path.to_path_buf(),
        config_sha256: loaded.source_text_sha256,
        notices: loaded.notices,
        ingested,
        mode: mode.to_string(),
    })
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
