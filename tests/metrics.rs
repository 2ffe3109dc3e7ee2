//! The Prometheus endpoint: what a scrape of a finished run shows, and that
//! it follows Prometheus conventions with bounded labels.
//!
//! The scrape runs in a process of its own: the recorder is process-wide, so the counts below
//! are this run's only if no other spec runs a mission beside it.

use crate::support;

use std::collections::BTreeSet;
use std::io::{Read, Write};

use serde_json::json;
use support::{ScriptedMission, ScriptedRun, read_jsonl};

/// `GET /metrics` over a plain socket: the body.
fn scrape(addr: std::net::SocketAddr) -> String {
    let mut stream = std::net::TcpStream::connect(addr).expect("connect to /metrics");
    write!(
        stream,
        "GET /metrics HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).unwrap();
    assert!(response.starts_with("HTTP/1.1 200"), "{response}");
    let (head, body) = response.split_once("\r\n\r\n").unwrap();
    assert!(
        head.to_ascii_lowercase()
            .contains("content-type: text/plain; version=0.0.4"),
        "{head}"
    );
    body.to_string()
}

/// The value of the sample `name{labels}` (exact text before the value).
fn sample(body: &str, series: &str) -> f64 {
    body.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' '))
        .unwrap_or_else(|| panic!("no sample {series} in:\n{body}"))
        .trim()
        .parse()
        .unwrap()
}

#[test]
fn a_scrape_counts_the_run_and_keeps_to_prometheus_conventions() {
    let me = support::isolated::spec_path(
        module_path!(),
        "a_scrape_counts_the_run_and_keeps_to_prometheus_conventions",
    );
    if !support::isolated::in_own_process(&me) {
        return;
    }
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let addr = runtime
        .block_on(stageb::metrics_endpoint::start(
            "127.0.0.1:0".parse().unwrap(),
        ))
        .expect("metrics endpoint");
    let ScriptedRun {
        summary, run_dir, ..
    } = ScriptedMission::demo().workers(2).run(json!({}));
    let body = scrape(addr);

    let decided = (summary.tickets * summary.epochs as usize) as f64;
    assert_eq!(sample(&body, "stageb_tickets_decided_total"), decided);
    assert_eq!(
        sample(&body, "stageb_candidates_total"),
        summary.candidates as f64
    );
    let epochs = read_jsonl(&run_dir, "metrics.jsonl")
        .into_iter()
        .filter(|r| r["event"] == "epoch_end")
        .collect::<Vec<_>>();
    for row in &epochs {
        let series = format!(
            "stageb_epoch_accuracy_ratio{{epoch=\"{}\",review=\"included\"}}",
            row["epoch"]
        );
        assert_eq!(
            sample(&body, &series),
            row["include_manual_review"]["acc"].as_f64().unwrap()
        );
    }
    assert_eq!(
        sample(&body, "stageb_guidance_step"),
        summary.guidance_step as f64
    );
    assert!(sample(&body, "stageb_leases_issued_total") >= decided);
    let idle = sample(&body, "stageb_workers_idle_ratio");
    assert!((0.0..=1.0).contains(&idle), "idle ratio {idle}");
    assert!(sample(&body, "stageb_worker_prefill_tokens_total") > 0.0);
    // Prefix reuse: the scripted engine reports each rollout's common
    // prefix with the one before, as the real engine's prefix cache does.
    // Rollouts and reflection calls are counted apart, by `kind`.
    for (kind, least) in [("rollout", decided), ("generate", 1.0)] {
        let lookups = sample(
            &body,
            &format!("stageb_worker_prefix_cache_lookups_total{{kind=\"{kind}\"}}"),
        );
        let hits = sample(
            &body,
            &format!("stageb_worker_prefix_cache_hits_total{{kind=\"{kind}\"}}"),
        );
        assert!(
            lookups >= least && hits > 0.0 && hits <= lookups,
            "{kind}: {hits} of {lookups}"
        );
        let saved = format!("stageb_worker_prefill_tokens_saved_total{{kind=\"{kind}\"}}");
        assert!(sample(&body, &saved) > 0.0, "{kind}");
    }
    // The phase: a finished run is `done`, and nothing else.
    assert_eq!(sample(&body, "stageb_phase{phase=\"done\"}"), 1.0);
    assert_eq!(sample(&body, "stageb_phase{phase=\"rollouts\"}"), 0.0);
    assert!(sample(&body, "stageb_rollout_step") >= 1.0);
    assert!(sample(&body, "stageb_worker_prefix_cache_bytes") > 0.0);
    let reuse = &summary.runtime["prefix_cache"];
    assert_eq!(reuse["rollouts"].as_f64(), Some(decided), "{reuse}");
    let with_hit = reuse["rollouts_with_hit"].as_f64().unwrap();
    assert!(with_hit > 0.0 && with_hit <= decided, "{reuse}");
    assert_eq!(reuse["hit_rate"].as_f64(), Some(with_hit / decided));
    let saved = reuse["prefill_tokens_saved"].as_u64().unwrap();
    assert!(
        saved > 0 && saved < reuse["prompt_tokens"].as_u64().unwrap(),
        "{reuse}"
    );
    assert!(body.contains("stageb_lease_wait_seconds_bucket{le=\"0.05\"}"));
    assert!(body.contains("stageb_reflection_calls_total{pass=\"decision\",outcome=\"parsed\"}"));

    // Conventions: every family described and typed, counters end in _total, and labels come
    // from small closed sets (never a ticket key, a group id or any text of the run).
    let allowed: BTreeSet<&str> = [
        "kind", "outcome", "pass", "code", "epoch", "review", "phase", "le",
    ]
    .into_iter()
    .collect();
    for line in body.lines().filter(|l| l.starts_with("# TYPE ")) {
        let mut parts = line.split_whitespace().skip(2);
        let (name, kind) = (parts.next().unwrap(), parts.next().unwrap());
        assert!(name.starts_with("stageb_"), "{name}");
        assert_eq!(kind == "counter", name.ends_with("_total"), "{line}");
        assert!(
            body.contains(&format!("# HELP {name} ")),
            "{name} has no HELP"
        );
    }
    for line in body
        .lines()
        .filter(|l| !l.starts_with('#') && l.contains('{'))
    {
        let labels = &line[line.find('{').unwrap() + 1..line.find('}').unwrap()];
        for pair in labels.split(',') {
            let (key, _) = pair.split_once('=').unwrap();
            assert!(allowed.contains(key), "unexpected label {key} in {line}");
        }
        assert!(
            !line.contains("::"),
            "a ticket key leaked into a label: {line}"
        );
    }
}

/// The Grafana dashboard only queries metrics stageb exports (a renamed metric would leave a
/// panel silently empty).
#[test]
fn the_dashboard_queries_only_exported_metrics() {
    let dashboard = include_str!("../deploy/grafana/stageb-dashboard.json");
    let exported = include_str!("../shared/src/observe.rs");
    let dashboard: serde_json::Value = serde_json::from_str(dashboard).expect("dashboard JSON");
    let mut names = BTreeSet::new();
    for panel in dashboard["panels"].as_array().unwrap() {
        for target in panel["targets"].as_array().unwrap() {
            let expr = target["expr"].as_str().unwrap();
            for (i, _) in expr.match_indices("stageb_") {
                let name: String = expr[i..]
                    .chars()
                    .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                    .collect();
                names.insert(name);
            }
        }
    }
    assert!(names.len() >= 15, "{names:?}");
    for name in names {
        let base = name.strip_suffix("_bucket").unwrap_or(&name);
        assert!(
            exported.contains(&format!("\"{base}\"")),
            "the dashboard queries {name}, which stageb does not export"
        );
    }
}
