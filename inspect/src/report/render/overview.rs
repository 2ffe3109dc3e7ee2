//! Section `overview`: the audit's verdict, the run's identity and its totals.

use std::collections::BTreeMap;

use super::super::html::{Cell, Page, duration, esc};
use super::super::identity::{candidates_per_ticket, fingerprint_short};
use super::super::{AuditOutcome, RunData};
use super::{file_notes, left_out_note, opt};
use crate::report::{ROW_CAP, clip};
use stageb_coordinator::artifacts::documents::{Manifest, RunSummary};
use stageb_coordinator::artifacts::files;

pub fn render(page: &mut Page, data: &RunData) {
    page.open_section("overview", "Overview");
    verdict(page, data);
    let m = data.identity.manifest.as_ref();
    let s = data.identity.summary.as_ref();
    identity(page, m, s);
    totals(page, m, s);
    for w in s.map_or(&[][..], |s| &s.warnings) {
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

/// A text a reader of a damaged document got as its default (empty) is unknown.
fn known(text: &str) -> Option<&str> {
    (!text.is_empty()).then_some(text)
}

fn identity(page: &mut Page, m: Option<&Manifest>, s: Option<&RunSummary>) {
    let text = |v: Option<&str>| Cell::text(v.unwrap_or("—"));
    let path = m.map(|m| m.config_path.display().to_string());
    let config = match (
        path.as_deref().and_then(known),
        m.and_then(|m| known(&m.config_sha256)),
    ) {
        (Some(p), Some(sha)) => format!("{} (sha256 {})", p, clip(sha, 12)),
        (Some(p), None) => p.to_string(),
        (None, Some(sha)) => format!("sha256 {}", clip(sha, 12)),
        (None, None) => "—".into(),
    };
    let fingerprint = m.and_then(fingerprint_short);
    let s_runtime = s.map(RunSummary::runtime_facts);
    let s_runtime = s_runtime.as_ref();
    let started = m
        .and_then(|m| known(&m.runtime.started_at))
        .or(s_runtime.and_then(|r| known(&r.started_at)));
    let finished = m
        .and_then(|m| m.runtime.finished_at.as_deref())
        .or(s_runtime.and_then(|r| known(&r.finished_at)));
    let resumed = match m.map(|m| &m.runtime) {
        Some(r) if r.resumed => format!("yes ({} answers replayed)", r.replayed_answers),
        Some(_) => "no".into(),
        None => "—".into(),
    };
    page.heading("Run");
    page.facts(&[
        (
            "mission",
            text(m.and_then(|m| known(&m.mission))).metric("mission"),
        ),
        ("stageb", text(m.and_then(|m| known(&m.stageb_version)))),
        ("config", Cell::text(&config).metric("config")),
        ("mode", text(m.and_then(|m| known(&m.mode)))),
        ("model", text(m.and_then(|m| known(&m.model.path)))),
        (
            "fingerprint",
            Cell::markup(format!(
                "<span class=\"mono\">{}</span>",
                esc(fingerprint.as_deref().unwrap_or("—"))
            ))
            .metric("fingerprint"),
        ),
        ("started", text(started)),
        ("finished", text(finished).metric("finished")),
        (
            "elapsed",
            Cell::text(&s_runtime.map_or("—".into(), |r| duration(r.elapsed_seconds))),
        ),
        ("resumed", Cell::text(&resumed)),
    ]);
}

fn totals(page: &mut Page, m: Option<&Manifest>, s: Option<&RunSummary>) {
    let tickets = m.map(|m| m.tickets).or(s.map(|s| s.tickets));
    let epochs = m.map(|m| m.schedule.epochs).or(s.map(|s| s.epochs));
    page.heading("Totals (summary.json)");
    page.facts(&[
        ("tickets", Cell::num(opt(tickets)).metric("tickets")),
        ("epochs", Cell::num(opt(epochs)).metric("epochs")),
        (
            "candidates per ticket",
            Cell::num(opt(m.and_then(candidates_per_ticket))),
        ),
        (
            "candidates",
            Cell::num(opt(s.map(|s| s.candidates))).metric("candidates"),
        ),
        (
            "malformed candidates",
            Cell::num(opt(s.map(|s| s.malformed_candidates))).metric("malformed"),
        ),
        (
            "hard failures",
            Cell::num(opt(s.map(|s| s.hard_failures))).metric("hard_failures"),
        ),
        (
            "need-review rows",
            Cell::num(opt(s.map(|s| s.need_review))).metric("need_review"),
        ),
        (
            "reflection cycles",
            Cell::num(opt(s.map(|s| s.reflection_cycles))).metric("reflection_cycles"),
        ),
        (
            "guidance step",
            Cell::num(opt(s.map(|s| s.guidance_step))).metric("guidance_step"),
        ),
        (
            "guidance head",
            Cell::markup(format!(
                "<span class=\"mono\">{}</span>",
                esc(&s.map_or("—".into(), |s| clip(&s.guidance_hash, 19)))
            )),
        ),
    ]);
}
