//! A process's place in a launched job (torchrun, Slurm, Kubernetes, MPI): its rank, its local
//! rank and where rank 0 listens.

use super::ClusterError;

/// A process's place in a launched job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LaunchTopology {
    pub rank: u32,
    pub rank_source: String,
    pub local_rank: u32,
    /// `host:port` the other ranks dial.
    pub coordinator: String,
    pub coordinator_source: String,
    /// The port rank 0 listens on: always the port of `coordinator`, so rank 0 listens where
    /// the other ranks dial whichever variable named the address.
    pub listen_port: u16,
    /// Ranks in the job, when the launcher says (`STAGEB_WORLD_SIZE`, `WORLD_SIZE`,
    /// `SLURM_NTASKS`, `OMPI_COMM_WORLD_SIZE`): the workers rank 0 shares the work among.
    pub world_size: Option<u32>,
}

fn env_u32(env: &impl Fn(&str) -> Option<String>, names: &[&str]) -> Option<(u32, String)> {
    names.iter().find_map(|n| {
        env(n)
            .and_then(|v| v.trim().parse().ok())
            .map(|v| (v, n.to_string()))
    })
}

/// Resolve the launch topology from the process environment (see [`topology_from`]).
pub fn resolve_topology(listen_port: Option<u16>) -> Result<LaunchTopology, ClusterError> {
    topology_from(|name| std::env::var(name).ok(), listen_port)
}

/// The port `rank 0` serves on when nothing names one (`--listen-port` unset, no launcher
/// address).
pub const DEFAULT_LAUNCH_PORT: u16 = 50051;

/// Resolve the launch topology: rank from `STAGEB_RANK`, `RANK` (torchrun), `SLURM_PROCID`,
/// `JOB_COMPLETION_INDEX` (Kubernetes Indexed Job), `OMPI_COMM_WORLD_RANK`; local rank from
/// `STAGEB_LOCAL_RANK`, `LOCAL_RANK`, `SLURM_LOCALID`, `OMPI_COMM_WORLD_LOCAL_RANK`; the
/// coordinator from `STAGEB_COORDINATOR`, else `MASTER_ADDR:(MASTER_PORT+1)` (torchrun's own
/// store keeps `MASTER_PORT`), else loopback on rank 0. `listen_port` (`--listen-port`) names
/// the port where no variable does; a variable's port wins, and rank 0 listens on it.
pub fn topology_from(
    env: impl Fn(&str) -> Option<String>,
    listen_port: Option<u16>,
) -> Result<LaunchTopology, ClusterError> {
    let (rank, rank_source) = env_u32(
        &env,
        &[
            "STAGEB_RANK",
            "RANK",
            "SLURM_PROCID",
            "JOB_COMPLETION_INDEX",
            "OMPI_COMM_WORLD_RANK",
        ],
    )
    .unwrap_or((0, "default (single process)".into()));
    let (local_rank, _) =
        env_u32(&env, &stageb_shared::placement::LOCAL_RANK_VARS).unwrap_or((0, String::new()));
    let fallback_port = listen_port.unwrap_or(DEFAULT_LAUNCH_PORT);
    let (host, port, coordinator_source) = if let Some(c) = env("STAGEB_COORDINATOR") {
        let (host, port) = c
            .rsplit_once(':')
            .and_then(|(h, p)| Some((h.to_string(), p.parse::<u16>().ok()?)))
            .ok_or_else(|| {
                ClusterError::Launch(format!("STAGEB_COORDINATOR must be host:port, got {c:?}"))
            })?;
        (host, port, "STAGEB_COORDINATOR".to_string())
    } else if let Some(addr) = env("MASTER_ADDR") {
        let (port, source) = match env("MASTER_PORT").and_then(|p| p.trim().parse::<u16>().ok()) {
            Some(p) if p < u16::MAX => (p + 1, "MASTER_ADDR:MASTER_PORT+1"),
            _ => (fallback_port, "MASTER_ADDR:--listen-port"),
        };
        (addr, port, source.to_string())
    } else if rank == 0 {
        (
            "127.0.0.1".to_string(),
            fallback_port,
            "default".to_string(),
        )
    } else {
        return Err(ClusterError::Launch(
            "rank > 0 but no coordinator address: set STAGEB_COORDINATOR (or MASTER_ADDR/MASTER_PORT)".into(),
        ));
    };
    if let Some(asked) = listen_port
        && asked != port
    {
        tracing::warn!(asked, port, from = %coordinator_source, "--listen-port differs from the port the other ranks dial: rank 0 listens on the dialed port");
    }
    let world_size = env_u32(
        &env,
        &[
            "STAGEB_WORLD_SIZE",
            "WORLD_SIZE",
            "SLURM_NTASKS",
            "OMPI_COMM_WORLD_SIZE",
        ],
    )
    .map(|(n, _)| n)
    .filter(|&n| n > 0);
    Ok(LaunchTopology {
        rank,
        rank_source,
        local_rank,
        coordinator: format!("{host}:{port}"),
        coordinator_source,
        listen_port: port,
        world_size,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn topology(vars: &[(&str, &str)], listen_port: Option<u16>) -> LaunchTopology {
        let vars: Vec<(String, String)> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        topology_from(
            |name| vars.iter().find(|(k, _)| k == name).map(|(_, v)| v.clone()),
            listen_port,
        )
        .unwrap()
    }

    /// Regression: under torchrun rank 0 listened on --listen-port (50051) while the other
    /// ranks dialed MASTER_PORT+1, so they never connected and rank 0 worked alone.
    #[test]
    fn under_torchrun_rank_0_listens_where_the_other_ranks_dial() {
        let env = [
            ("MASTER_ADDR", "node-a"),
            ("MASTER_PORT", "29500"),
            ("WORLD_SIZE", "4"),
        ];
        let rank0 = topology(&[env.as_slice(), &[("RANK", "0")]].concat(), None);
        let rank3 = topology(&[env.as_slice(), &[("RANK", "3")]].concat(), None);
        assert_eq!(rank0.listen_port, 29501);
        assert_eq!(rank3.coordinator, "node-a:29501");
        assert_eq!(rank3.rank, 3);
        assert_eq!(rank0.world_size, Some(4));
        // An explicit coordinator wins over torchrun's variables, and rank 0 serves its port.
        let explicit = [("STAGEB_COORDINATOR", "head:7000"), ("RANK", "0")];
        let t = topology(&[env.as_slice(), &explicit].concat(), Some(50051));
        assert_eq!((t.coordinator.as_str(), t.listen_port), ("head:7000", 7000));
    }

    #[test]
    fn without_launcher_variables_the_listen_port_names_the_port() {
        let t = topology(&[], Some(6000));
        assert_eq!(
            (t.coordinator.as_str(), t.listen_port),
            ("127.0.0.1:6000", 6000)
        );
        assert_eq!(topology(&[], None).listen_port, DEFAULT_LAUNCH_PORT);
        let slurm = topology(
            &[("SLURM_PROCID", "2"), ("STAGEB_COORDINATOR", "n1:50051")],
            None,
        );
        assert_eq!(slurm.rank, 2);
    }
}
