//! Section `overview`: the audit's verdict, the run's identity and its totals.

use std::collections::BTreeMap;

use super::super::html::{Cell, Page, duration, esc};
use super::super::identity::{Manifest, Summary};
use super::super::{AuditOutcome, RunData};
use super::{file_notes, left_out_note, opt};
use crate::report::{ROW_CAP, clip};
use stageb_coordinator::artifacts::files;

pub fn render(page: &mut Page, data: &RunData) {
    page.open_section("overview", "Overview");
    verdict(page, data);
    let empty_manifest = Manifest::default();
    let empty_summary = Summary::default();
    let m = data.identity.manifest.as_ref().unwrap_or(&empty_manifest);
    let s = data.identity.summary.as_ref().unwrap_or(&empty_summary);
    identity(page, m, s);
    totals(page, m, s);
    for w in &s.warnings {
        page.note(&format!("Run warning: {}", clip(w, 600)));
    }
    for status in &data.identity.files {
        if status.file == files::SUMMARY && !status.present {
            page.note(
                "summary.json is missing: the run has not completed (it is still running, was \
                 interrupted or crashed; `stageb run --resume` continues it). Run totals are \
                 unknown; the sections below read the other artifacts.",
            );
        } else {
            file_notes(page, [status]);
        }
    }
    page.close_section();
}

fn verdict(page: &mut Page, data: &RunData) {
    let a = match &data.audit {
        AuditOutcome::Ran(a) => a,
        AuditOutcome::Skipped(why) => {
            page.markup(&format!(
                "<div class=\"verdict skipped\" data-metric=\"audit\">Audit not run: {}.</div>",
                esc(why)
            ));
            return;
        }
    };
    if a.ok() {
        page.markup(&format!(
            "<div class=\"verdict ok\" data-metric=\"audit\">Audit OK: every invariant \
             `stageb audit` checks holds ({} tickets, {} epochs, {} selections, {} \
             trajectories, {} reflection cycles re-derived).</div>",
            a.tickets, a.epochs, a.selections, a.trajectories, a.reflection_cycles
        ));
        return;
    }
    page.markup(&format!(
        "<div class=\"verdict bad\" data-metric=\"audit\">Audit FAILED: {} violation(s). \
         The numbers below come from artifacts that break the run's invariants.</div>",
        a.violations.len()
    ));
    let mut by_check: BTreeMap<&str, u64> = BTreeMap::new();
    for v in &a.violations {
        *by_check.entry(v.check).or_default() += 1;
    }
    page.table(
        &["check", "violations"],
        by_check
            .iter()
            .map(|(c, n)| vec![Cell::text(c), Cell::num(n)]),
    );
    page.wide_table(
        &["check", "file", "line", "detail"],
        a.violations.iter().take(ROW_CAP).map(|v| {
            vec![
                Cell::text(v.check),
                Cell::text(&v.file),
                Cell::num(opt(v.line)),
                Cell::text(&clip(&v.detail, 400)),
            ]
        }),
    );
    left_out_note(page, ROW_CAP, a.violations.len() as u64, "violations");
}

fn identity(page: &mut Page, m: &Manifest, s: &Summary) {
    let text = |v: &Option<String>| Cell::text(v.as_deref().unwrap_or("—"));
    let config = match (&m.config_path, &m.config_sha256) {
        (Some(p), Some(sha)) => format!("{} (sha256 {})", p, clip(sha, 12)),
        (Some(p), None) => p.clone(),
        (None, Some(sha)) => format!("sha256 {}", clip(sha, 12)),
        (None, None) => "—".into(),
    };
    let fingerprint = m.fingerprint_short();
    let started = m
        .runtime
        .started_at
        .clone()
        .or(s.runtime.started_at.clone());
    let finished = m
        .runtime
        .finished_at
        .clone()
        .or(s.runtime.finished_at.clone());
    let resumed = match (m.runtime.resumed, m.runtime.replayed_answers) {
        (Some(true), n) => format!("yes ({} answers replayed)", opt(n)),
        (Some(false), _) => "no".into(),
        (None, _) => "—".into(),
    };
    page.heading("Run");
    page.facts(&[
        ("mission", text(&m.mission).metric("mission")),
        ("stageb", text(&m.stageb_version)),
        ("config", Cell::text(&config).metric("config")),
        ("mode", text(&m.mode)),
        ("model", text(&m.model.path)),
        (
            "fingerprint",
            Cell::markup(format!(
                "<span class=\"mono\">{}</span>",
                esc(fingerprint.as_deref().unwrap_or("—"))
            ))
            .metric("fingerprint"),
        ),
        ("started", text(&started)),
        ("finished", text(&finished).metric("finished")),
        (
            "elapsed",
            Cell::text(&s.runtime.elapsed_seconds.map_or("—".into(), duration)),
        ),
        ("resumed", Cell::text(&resumed)),
    ]);
}

fn totals(page: &mut Page, m: &Manifest, s: &Summary) {
    let tickets = m.tickets.or(s.tickets);
    let epochs = m.schedule.epochs.or(s.epochs);
    page.heading("Totals (summary.json)");
    page.facts(&[
        ("tickets", Cell::num(opt(tickets)).metric("tickets")),
        ("epochs", Cell::num(opt(epochs)).metric("epochs")),
        (
            "candidates per ticket",
            Cell::num(opt(m.candidates_per_ticket())),
        ),
        (
            "candidates",
            Cell::num(opt(s.candidates)).metric("candidates"),
        ),
        (
            "malformed candidates",
            Cell::num(opt(s.malformed_candidates)).metric("malformed"),
        ),
        (
            "hard failures",
            Cell::num(opt(s.hard_failures)).metric("hard_failures"),
        ),
        (
            "need-review rows",
            Cell::num(opt(s.need_review)).metric("need_review"),
        ),
        (
            "reflection cycles",
            Cell::num(opt(s.reflection_cycles)).metric("reflection_cycles"),
        ),
        (
            "guidance step",
            Cell::num(opt(s.guidance_step)).metric("guidance_step"),
        ),
        (
            "guidance head",
            Cell::markup(format!(
                "<span class=\"mono\">{}</span>",
                esc(&s
                    .guidance_hash
                    .as_deref()
                    .map_or("—".into(), |h| clip(h, 19)))
            )),
        ),
    ]);
}
