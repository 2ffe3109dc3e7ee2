//! `stageb launch`: the role from the launcher's environment (torchrun, Slurm, Kubernetes,
//! MPI). Rank 0 serves the run on all interfaces with one local worker; every other rank is a
//! worker dialing rank 0.

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::Result;
use stageb::roles::{self, CoordinatorSettings, LaunchTopology, LocalStart};
use stageb_shared::auth::AuthToken;
use stageb_shared::tls::ClientTls;
use stageb_worker::client::{JobLimits, WorkerOptions};
use stageb_worker::engine::ModelEngine;

use super::coordinator::serve;
use super::shutdown_signal;
use super::worker::work;
use crate::cli::{LaunchArgs, device_kind};

pub(crate) async fn run(args: LaunchArgs) -> Result<u8> {
    let interrupt = shutdown_signal();
    let topo = roles::resolve_topology(args.listen_port)?;
    let client_tls = args.tls.client()?;
    tracing::info!(rank = topo.rank, rank_from = %topo.rank_source, local_rank = topo.local_rank,
                   coordinator = %topo.coordinator, coordinator_from = %topo.coordinator_source, "launch topology");
    let token = args.token.load()?;
    args.rank0.metrics.start(topo.local_rank).await?;
    if topo.rank == 0 {
        serve_rank0(args, token, client_tls, interrupt, &topo).await
    } else {
        let model_path = roles::model_path_of(&args.rank0.config)?;
        let options = worker_options(topo, token, client_tls, args.reconnect_timeout_s);
        work(model_path, args.model, options, interrupt).await
    }
}

/// Rank 0: serve the run on all interfaces at `port`, with one local worker dialing it over
/// loopback as the other ranks do (same token, same client certificate).
async fn serve_rank0(
    args: LaunchArgs,
    token: Option<AuthToken>,
    client_tls: Option<ClientTls>,
    interrupt: impl std::future::Future<Output = ()>,
    topo: &LaunchTopology,
) -> Result<u8> {
    let model_path = roles::model_path_of(&args.rank0.config)?;
    let inputs = roles::prepare_inputs(&args.rank0.config, "cluster")?;
    let listen: SocketAddr = ([0, 0, 0, 0], topo.listen_port).into();
    let options = args.model.engine_options()?;
    let settings = CoordinatorSettings {
        token,
        expected_workers: topo.world_size.map_or(0, |n| n as usize),
        tls: args.tls.server.load()?,
        edge_limits: args.edge.limits(),
        workers_device: Some(device_kind(&options.device)),
        local_max_jobs: Some(args.model.max_jobs(&options.device)),
        ..args.rank0.settings(listen)
    };
    let limits = args.model.job_limits(&options.device);
    let spawn_local = move |start: LocalStart| {
        let addr: SocketAddr = ([127, 0, 0, 1], start.addr.port()).into();
        let start = LocalStart { addr, ..start };
        roles::spawn_local_workers(1, start, client_tls, limits, move |_| {
            ModelEngine::load(&model_path, &options).map_err(|e| e.to_string())
        })
    };
    serve(inputs, settings, spawn_local, interrupt, args.rank0.report).await
}

/// A rank > 0's way to rank 0: the address the topology names, up to
/// [`roles::LAUNCH_CONNECT_TIMEOUT`] to reach it.
fn worker_options(
    topo: LaunchTopology,
    token: Option<AuthToken>,
    tls: Option<ClientTls>,
    reconnect_timeout_s: u64,
) -> WorkerOptions {
    WorkerOptions {
        coordinator: topo.coordinator,
        token,
        tls,
        name: roles::worker_name(topo.rank as usize),
        device: String::new(),
        run_id: String::new(),
        connect_timeout: roles::LAUNCH_CONNECT_TIMEOUT,
        reconnect_timeout: Duration::from_secs(reconnect_timeout_s),
        // `work` sets the limits once the device is placed.
        limits: JobLimits::default(),
    }
}
