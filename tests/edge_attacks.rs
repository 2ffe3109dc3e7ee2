//! The network attacks found by an independent gRPC client that need rank 0 as its own process:
//! its memory, its descriptor limit and its log are what the attacker aims at. Each test starts
//! the real `stageb coordinator` binary on a small scripted mission and attacks it over
//! loopback; the legitimate worker is the scripted engine running the real worker loop in this
//! process.

use crate::support;

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use serde_json::json;
use stageb_worker::client::{WorkerOptions, run_worker};
use support::{
    Behaviour, MISSION, Proc, Script, ScriptedEngine, coordinator_command, wait_for_exit,
    worker_options,
};

/// The tests here hold many sockets and time a rank 0 process: run them one at a time.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Start `stageb coordinator` on `config` under a descriptor limit of `nofile`; returns the
/// process, its address, and its stderr lines as they come.
fn start_coordinator(
    config: &Path,
    nofile: u32,
) -> (Proc, SocketAddr, std::sync::mpsc::Receiver<String>) {
    let mut shell = Command::new("sh");
    shell
        .arg("-c")
        .arg(format!("ulimit -n {nofile} && exec \"$0\" \"$@\""))
        .arg(env!("CARGO_BIN_EXE_stageb"));
    let mut child = coordinator_command(&mut shell, config, "127.0.0.1:0", "120")
        .spawn()
        .unwrap();
    let stderr = child.stderr.take().unwrap();
    let proc = Proc(child);
    let (tx, rx) = std::sync::mpsc::channel::<String>();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    let deadline = Instant::now() + Duration::from_secs(60);
    let addr = loop {
        let line = rx
            .recv_timeout(deadline.saturating_duration_since(Instant::now()))
            .expect("the coordinator never said where it listens");
        if line.contains("coordinator listening")
            && let Some(rest) = line.split("addr=").nth(1)
        {
            break rest.split_whitespace().next().unwrap().parse().unwrap();
        }
    };
    (proc, addr, rx)
}

fn toy_config(dir: &Path) -> std::path::PathBuf {
    support::write_toy_mission(dir);
    support::write_config(dir, json!({}))
}

fn rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find(|l| l.starts_with("VmRSS:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .unwrap()
}

/// Regression: ~1,000 sockets that never speak exhausted a 1024-descriptor rank 0,
/// new workers could not connect, and the run failed writing its last artifact. Now silent
/// sockets are closed at the preface deadline, the cap keeps descriptors for the run, and a
/// legitimate worker (whose name tries to forge a log line) completes an audited run.
#[test]
fn a_legit_worker_completes_the_run_while_1000_idle_sockets_are_held() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    stageb_coordinator::cluster::edge::raise_fd_limit();
    let tmp = tempfile::tempdir().unwrap();
    let config = toy_config(tmp.path());
    let (mut coordinator, addr, log) = start_coordinator(&config, 1024);

    let idle: Vec<std::net::TcpStream> = (0..1000)
        .filter_map(|_| std::net::TcpStream::connect(addr).ok())
        .collect();
    assert!(idle.len() >= 900, "only {} idle sockets opened", idle.len());

    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let worker = runtime.block_on(async {
        let engine = ScriptedEngine::new(Script::new(Behaviour::default()));
        let opts = WorkerOptions {
            name: "legit\nlevel=ERROR forged by a worker name \u{1b}[31m".into(),
            connect_timeout: Duration::from_secs(90),
            reconnect_timeout: stageb_worker::client::DEFAULT_RECONNECT_TIMEOUT,
            limits: Default::default(),
            ..worker_options(addr.to_string())
        };
        tokio::time::timeout(
            Duration::from_secs(180),
            run_worker(engine, opts, std::future::pending()),
        )
        .await
    });
    let summary = worker
        .expect("the worker finished")
        .expect("the worker ran");
    assert!(summary.jobs_done > 0);

    let status = wait_for_exit(
        &mut coordinator,
        Duration::from_secs(60),
        "rank 0 did not exit",
    );
    let lines: Vec<String> = log.try_iter().collect();
    assert_eq!(status.code(), Some(0), "log:\n{}", lines.join("\n"));
    drop(idle);
    let run_dir = tmp.path().join("runs/it").join(MISSION);
    support::assert_audit_ok(&run_dir);
    // The worker's name stayed inside its line, escaped.
    assert!(
        !lines.iter().any(|l| l.starts_with("level=ERROR forged")),
        "a worker name forged a log line"
    );
    assert!(
        lines
            .iter()
            .any(|l| l.contains("worker registered") && l.contains("legit\\u{a}level=ERROR")),
        "the registration line shows the escaped name:\n{}",
        lines.join("\n")
    );
    assert!(
        !lines.iter().any(|l| l.contains('\u{1b}')),
        "ESC reached the log"
    );
}

/// Regression: 100 unfinished ~4 MiB health `Check` bodies took an idle rank 0
/// from 13 MB to 426 MB. The health cap (1 KiB) refuses each after its 5-byte header, flow
/// control bounds what is buffered, and a stranger's connection is closed at its fifth open
/// call or past its byte allowance (`stranger_budget`): rank 0 grows by less than 32 MiB.
#[test]
fn unfinished_unauthenticated_health_bodies_stay_within_a_memory_bound() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let tmp = tempfile::tempdir().unwrap();
    let config = toy_config(tmp.path());
    let (coordinator, addr, _log) = start_coordinator(&config, 4096);
    std::thread::sleep(Duration::from_millis(500));
    let before = rss_kib(coordinator.0.id());
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let held = runtime.block_on(async {
        let mut held = Vec::new();
        for _ in 0..4 {
            let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
            let (send, conn) = h2::client::handshake(tcp).await.unwrap();
            tokio::spawn(async move {
                let _ = conn.await;
            });
            for _ in 0..25 {
                // Rank 0 closes the connection once it holds more than a stranger may.
                let Ok(mut send) = send.clone().ready().await else {
                    break;
                };
                let request = http::Request::builder()
                    .method("POST")
                    .uri(format!("http://{addr}/grpc.health.v1.Health/Check"))
                    .header("content-type", "application/grpc")
                    .header("te", "trailers")
                    .body(())
                    .unwrap();
                let Ok((response, mut body)) = send.send_request(request, false) else {
                    break;
                };
                let mut header = vec![0u8];
                header.extend_from_slice(&(4u32 << 20).to_be_bytes());
                let _ = body.send_data(bytes::Bytes::from(header), false);
                let _ = body.send_data(bytes::Bytes::from(vec![b'x'; 1 << 20]), false);
                held.push((response, body));
            }
        }
        tokio::time::sleep(Duration::from_secs(2)).await;
        held
    });
    let after = rss_kib(coordinator.0.id());
    drop(held);
    let grown_mib = after.saturating_sub(before) / 1024;
    eprintln!("rank 0 RSS {before} KiB before, {after} KiB with 100 unfinished bodies");
    assert!(
        grown_mib < 32,
        "rank 0 grew by {grown_mib} MiB under unauthenticated bodies"
    );
}

/// `stageb coordinator` on `config` exits 2 (bad input) before serving anything.
fn assert_coordinator_refuses_input(config: &Path) {
    let out = Command::new(env!("CARGO_BIN_EXE_stageb"))
        .args(["coordinator", "--config"])
        .arg(config)
        .args(["--listen", "127.0.0.1:0"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
}

/// Regression: a mission name that is not a plain path component is bad input
/// (exit 2, like every input error), and an input error found once the run directory exists
/// leaves no empty `jobs.jsonl` behind.
#[test]
fn input_errors_exit_2_and_leave_no_empty_journal() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let tmp = tempfile::tempdir().unwrap();
    let config = toy_config(tmp.path());
    // The guidance has no section for the mission: found only after the directory exists.
    std::fs::write(tmp.path().join("guidance.json"), "{}").unwrap();
    assert_coordinator_refuses_input(&config);
    let run_dir = tmp.path().join("runs/it").join(MISSION);
    assert!(
        !run_dir.join("jobs.jsonl").exists(),
        "an empty journal was left behind"
    );

    let bad = tempfile::tempdir().unwrap();
    let config = toy_config(bad.path());
    let stage_a = std::fs::read_to_string(bad.path().join("stage_a.jsonl")).unwrap();
    std::fs::write(
        bad.path().join("stage_a.jsonl"),
        stage_a.replace(MISSION, ".."),
    )
    .unwrap();
    assert_coordinator_refuses_input(&config);
}
