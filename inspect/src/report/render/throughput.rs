//! Section `throughput`: how fast the run went, from the timing fields the artifacts have.

use std::collections::BTreeMap;

use super::super::RunData;
use super::super::charts::{self, LineChart, Series};
use super::super::html::{Cell, Page, duration};
use super::super::identity::{config_f64, scheduler_counters};
use super::super::outcomes::TimingWindow;
use super::super::throughput::EpochCompute;
use super::{file_notes, opt};
use crate::report::clip;

/// Most points per epoch line; longer epochs are thinned evenly (the last point is kept).
const MAX_POINTS: usize = 400;

fn count(v: f64) -> String {
    format!("{v:.0}")
}

fn rate(n: f64, seconds: f64) -> String {
    if seconds > 0.0 {
        format!("{:.3}", n / seconds)
    } else {
        "—".into()
    }
}

pub fn render(page: &mut Page, data: &RunData) {
    page.open_section("throughput", "Throughput");
    let logging_steps = data
        .identity
        .manifest
        .as_ref()
        .and_then(|m| config_f64(m, "/runner/logging_steps"));
    let step = data
        .identity
        .manifest
        .as_ref()
        .map(|m| m.schedule.step_size);
    page.note(&format!(
        "Coarse: no artifact timestamps single tickets. The wall-clock points are the metrics \
         window rows, one every runner.logging_steps ({}) tickets, timed from the start of \
         their epoch; tickets are decided a rollout step ({} tickets) at a time, so rates \
         between neighbouring points of one step mean nothing, the slope over an epoch does. \
         Model time comes from the rollout jobs' runtime in trajectories.jsonl.",
        opt(logging_steps),
        opt(step)
    ));
    run_line(page, data);
    by_epoch(page, data);
    progress_chart(page, &data.outcomes.windows);
    workers(page, data);
    file_notes(page, [&data.compute.file]);
    page.close_section();
}

fn run_line(page: &mut Page, data: &RunData) {
    let Some(summary) = &data.identity.summary else {
        return;
    };
    let decided: u64 = data.outcomes.epochs.values().map(|e| e.tickets).sum();
    let elapsed = Some(summary.runtime_facts().elapsed_seconds);
    page.facts(&[
        (
            "run wall time",
            Cell::text(&elapsed.map_or("—".into(), duration)),
        ),
        (
            "tickets decided",
            Cell::num(decided).metric("tickets_decided"),
        ),
        (
            "tickets per second",
            Cell::num(elapsed.map_or("—".into(), |s| rate(decided as f64, s))),
        ),
    ]);
    let counters: Vec<Vec<Cell>> = scheduler_counters(summary)
        .iter()
        .map(|(k, v)| vec![Cell::text(k), Cell::num(clip(&v.to_string(), 40))])
        .collect();
    if !counters.is_empty() {
        page.heading("Scheduler");
        page.table(&["counter", "value"], counters);
    }
}

fn by_epoch(page: &mut Page, data: &RunData) {
    let last_window: BTreeMap<u32, &TimingWindow> =
        data.outcomes.windows.iter().map(|w| (w.epoch, w)).collect();
    let reflection = &data.reflection.per_epoch;
    let mut epochs: Vec<u32> = data.compute.per_epoch.keys().copied().collect();
    epochs.extend(last_window.keys());
    epochs.sort_unstable();
    epochs.dedup();
    page.heading("Per epoch");
    page.table(
        &[
            "epoch",
            "last window",
            "tickets/s",
            "rollout jobs",
            "candidates",
            "generated tokens",
            "decode time",
            "tokens/s (decode)",
            "prefill time",
            "prompt tokens",
            "reflection model time",
        ],
        epochs.iter().map(|&e| {
            let compute = data.compute.per_epoch.get(&e).copied().unwrap_or_default();
            let reflection_us = reflection.get(&e).map(|r| r.latency_us);
            epoch_row(e, &compute, last_window.get(&e).copied(), reflection_us)
        }),
    );
}

fn epoch_row(
    e: u32,
    c: &EpochCompute,
    window: Option<&TimingWindow>,
    reflection_us: Option<u64>,
) -> Vec<Cell> {
    let seconds = |us: u64| duration(us as f64 / 1e6);
    let reached = window.map_or("—".into(), |w| {
        let at = duration(w.timing.elapsed_seconds);
        format!("{} tickets at {at}", w.epoch_step_end)
    });
    let rate = window.map_or("—".into(), |w| {
        format!("{:.3}", w.timing.groups_per_second)
    });
    let decode_rate = c
        .decode_tokens_per_second()
        .map_or("—".into(), |r| format!("{r:.1}"));
    vec![
        Cell::num(e),
        Cell::num(reached),
        Cell::num(rate).metric(format!("tickets_per_second_e{e}")),
        Cell::num(c.jobs).metric(format!("rollout_jobs_e{e}")),
        Cell::num(c.candidates),
        Cell::num(c.completion_tokens),
        Cell::num(seconds(c.decode_us)),
        Cell::num(decode_rate),
        Cell::num(seconds(c.prefill_us)),
        Cell::num(c.prompt_tokens),
        Cell::num(reflection_us.map_or("—".into(), seconds)),
    ]
}

/// Tickets decided against seconds since the epoch's start, one line per epoch.
fn progress_chart(page: &mut Page, windows: &[TimingWindow]) {
    let mut per_epoch: BTreeMap<u32, Vec<(f64, f64)>> = BTreeMap::new();
    for w in windows {
        per_epoch
            .entry(w.epoch)
            .or_insert_with(|| vec![(0.0, 0.0)])
            .push((w.timing.elapsed_seconds, w.epoch_step_end as f64));
    }
    if per_epoch.is_empty() {
        page.para("No metrics window row has timing: there is no wall-clock curve to draw.");
        return;
    }
    let series: Vec<Series> = per_epoch
        .into_iter()
        .map(|(e, points)| Series {
            name: format!("epoch {e}"),
            points: thin(points),
        })
        .collect();
    page.chart(
        "tickets decided over time per epoch",
        charts::line_chart(&LineChart {
            x_label: "seconds since the epoch started",
            y_label: "tickets decided",
            series: &series,
            y_range: None,
            integer_x: false,
            y_format: count,
        }),
    );
}

/// At most [`MAX_POINTS`] points, evenly spaced, the last one always kept.
fn thin(points: Vec<(f64, f64)>) -> Vec<(f64, f64)> {
    if points.len() <= MAX_POINTS {
        return points;
    }
    let stride = points.len().div_ceil(MAX_POINTS);
    let last = points[points.len() - 1];
    let mut out: Vec<(f64, f64)> = points.into_iter().step_by(stride).collect();
    if out.last() != Some(&last) {
        out.push(last);
    }
    out
}

fn workers(page: &mut Page, data: &RunData) {
    let jobs = &data.compute.jobs_by_worker;
    if jobs.is_empty() {
        return;
    }
    page.heading("Rollout jobs by worker");
    page.table(
        &["worker", "jobs"],
        jobs.iter().map(|(w, n)| vec![Cell::text(w), Cell::num(n)]),
    );
}
