//! Sections `reflection` and `need-review`: what reflection did with the gradient candidates,
//! and which tickets it gave up on.

use std::collections::BTreeSet;

use super::super::RunData;
use super::super::html::{Cell, Page, duration, esc, ratio};
use super::super::reflection::{CycleView, EpochReflection, OpView, RejectedView};
use super::super::review::{NeedReview, ReviewRow};
use super::{file_notes, left_out_note, opt};

pub fn reflection(page: &mut Page, data: &RunData) {
    let r = &data.reflection;
    page.open_section("reflection", "Reflection cycles");
    page.explain(
        "Each cycle takes a batch of gradient candidates: the decision pass splits them into \
         learnable cases and stop-gradient ones (sent to need-review), the ops pass proposes \
         rule changes, validation accepts or rejects each op, and coverage is the share of \
         learnable cases cited as evidence by an applied op.",
    );
    totals(page, r);
    if !r.rejected_by_reason.is_empty() {
        page.heading("Rejected ops by reason");
        page.table(
            &["reason", "ops"],
            r.rejected_by_reason
                .iter()
                .map(|(k, n)| vec![Cell::text(k), Cell::num(n)]),
        );
    }
    if !r.warnings.is_empty() {
        page.heading("Cycle warnings");
        page.table(
            &["warning", "cycles"],
            r.warnings
                .iter()
                .map(|(k, n)| vec![Cell::text(k), Cell::num(n)]),
        );
    }
    gates(page, r);
    if !r.cycles.is_empty() {
        page.heading("Cycles");
        page.wide_table(
            &[
                "cycle",
                "epoch",
                "batch",
                "learnable / stop-gradient",
                "coverage",
                "guidance",
                "accepted ops",
                "rejected ops",
                "tokens (calls)",
            ],
            r.cycles.iter().map(cycle_row),
        );
        left_out_note(page, r.cycles.len(), r.total_cycles, "cycles");
    } else if r.file.present {
        page.para("No reflection cycle ran.");
    }
    file_notes(page, [&r.file]);
    page.close_section();
}

/// The gate's decisions: each candidate guidance against its parent on the gate split.
fn gates(page: &mut Page, r: &super::super::reflection::Reflection) {
    if r.gate_checks == 0 {
        return;
    }
    page.heading("Gate decisions");
    page.explain(
        "With reflection.gate.check_edits, a cycle's validated ops are applied only if the \
         guidance they make holds its accuracy on the gate split (within the tolerance) and, \
         when asked, a paired bootstrap finds it better often enough; refused ops are rejected \
         as gate_regression and remembered.",
    );
    page.para(&format!(
        "{} checks, {} refused.",
        r.gate_checks, r.gate_refused
    ));
    let rows = r.gates.iter().map(|g| {
        let f = &g.figures;
        vec![
            Cell::num(g.cycle),
            Cell::num(g.epoch),
            Cell::num(g.ops),
            Cell::num(f.tickets),
            Cell::num(format!("{:.3}", f.parent_accuracy)),
            Cell::num(format!("{:.3}", f.candidate_accuracy)),
            Cell::num(format!("{} / {}", f.fixed, f.broken)),
            Cell::num(f.p_better.map_or("—".to_string(), |p| format!("{p:.3}"))),
            Cell::text(if f.passed { "applied" } else { "refused" })
                .metric(format!("gate_c{}", g.cycle)),
        ]
    });
    page.table(
        &[
            "cycle",
            "epoch",
            "ops",
            "gate tickets",
            "parent accuracy",
            "candidate accuracy",
            "fixed / broken",
            "P(better)",
            "decision",
        ],
        rows,
    );
    left_out_note(page, r.gates.len(), r.gate_checks, "gate checks");
}

fn totals(page: &mut Page, r: &super::super::reflection::Reflection) {
    let mut sum = EpochReflection::default();
    let row = |label: String, e: &EpochReflection, suffix: &str| {
        vec![
            Cell::text(&label),
            Cell::num(e.cycles).metric(format!("cycles_{suffix}")),
            Cell::num(e.applied_cycles).metric(format!("applied_cycles_{suffix}")),
            Cell::num(e.learnable),
            Cell::num(e.stop_gradient).metric(format!("stop_gradient_{suffix}")),
            Cell::num(format!("{} ({})", e.covered, ratio(e.covered, e.learnable))),
            Cell::num(e.accepted_ops).metric(format!("ops_accepted_{suffix}")),
            Cell::num(e.rejected_ops).metric(format!("ops_rejected_{suffix}")),
            Cell::num(e.applied_ops).metric(format!("ops_applied_{suffix}")),
            Cell::num(format!("{} ({} failed)", e.calls, e.failed_calls)),
            Cell::num(e.prompt_tokens),
            Cell::num(e.completion_tokens),
            Cell::num(duration(e.latency_us as f64 / 1e6)),
        ]
    };
    let mut rows = Vec::new();
    for (epoch, e) in &r.per_epoch {
        rows.push(row(format!("epoch {epoch}"), e, &format!("e{epoch}")));
        add(&mut sum, e);
    }
    rows.push(row("all".into(), &sum, "total"));
    page.table(
        &[
            "",
            "cycles",
            "applied",
            "learnable",
            "stop-gradient",
            "covered",
            "ops accepted",
            "ops rejected",
            "ops applied",
            "model calls",
            "prompt tokens",
            "completion tokens",
            "model time",
        ],
        rows,
    );
}

fn add(sum: &mut EpochReflection, e: &EpochReflection) {
    sum.cycles += e.cycles;
    sum.applied_cycles += e.applied_cycles;
    sum.learnable += e.learnable;
    sum.stop_gradient += e.stop_gradient;
    sum.covered += e.covered;
    sum.accepted_ops += e.accepted_ops;
    sum.rejected_ops += e.rejected_ops;
    sum.applied_ops += e.applied_ops;
    sum.calls += e.calls;
    sum.failed_calls += e.failed_calls;
    sum.prompt_tokens += e.prompt_tokens;
    sum.completion_tokens += e.completion_tokens;
    sum.latency_us += e.latency_us;
}

fn cycle_row(c: &CycleView) -> Vec<Cell> {
    let split = match (c.learnable, c.stop_gradient) {
        (None, None) => "no decision".to_string(),
        (l, s) => format!("{} / {}", opt(l), opt(s)),
    };
    let coverage = c.coverage.map_or("—".into(), |cv| {
        let share = ratio(cv.covered, cv.learnable);
        format!("{}/{} ({share})", cv.covered, cv.learnable)
    });
    let tokens = &c.tokens;
    vec![
        Cell::markup(format!(
            "{}<br><span class=\"muted mono\">{}</span>",
            c.cycle,
            esc(&c.reflection_id)
        )),
        Cell::num(c.epoch),
        Cell::markup(batch_html(c)),
        Cell::text(&split),
        Cell::text(&coverage),
        Cell::markup(outcome_html(c)),
        Cell::markup(op_list(c.accepted.iter().map(op_html), c.accepted_len)),
        Cell::markup(op_list(
            c.rejected.iter().map(rejected_html),
            c.rejected_len,
        )),
        Cell::num(format!(
            "{} + {} ({})",
            tokens.prompt_tokens, tokens.completion_tokens, tokens.calls
        )),
    ]
}

/// The batch: size, retry attempt, and its first ticket keys.
fn batch_html(c: &CycleView) -> String {
    let retry = if c.retry_attempt > 0 {
        format!(" · retry {}", c.retry_attempt)
    } else {
        String::new()
    };
    let keys: Vec<String> = c.batch.iter().map(|k| esc(k)).collect();
    let mut html = format!(
        "{} ticket(s){retry}<br><span class=\"mono\">{}",
        c.batch_len,
        keys.join("<br>")
    );
    if c.batch_len > c.batch.len() {
        html.push_str(&format!("<br>… {} more", c.batch_len - c.batch.len()));
    }
    html.push_str("</span>");
    html
}

/// Whether the cycle changed the guidance, and its warnings.
fn outcome_html(c: &CycleView) -> String {
    let mut html = if c.applied {
        format!(
            "<span class=\"tag ok\">applied</span> step {} → {}",
            c.step_before, c.step_after
        )
    } else {
        format!(
            "<span class=\"tag\">unchanged</span> step {}",
            c.step_before
        )
    };
    if !c.warnings.is_empty() {
        let warnings = esc(&c.warnings.join(", "));
        html.push_str(&format!("<br><span class=\"muted\">{warnings}</span>"));
    }
    html
}

fn op_list(items: impl Iterator<Item = String>, total: usize) -> String {
    let items: Vec<String> = items.collect();
    if items.is_empty() {
        return "—".into();
    }
    let mut out = String::from("<ul class=\"ops\">");
    for i in &items {
        out.push_str(&format!("<li>{i}</li>"));
    }
    if total > items.len() {
        out.push_str(&format!(
            "<li class=\"muted\">… {} more</li>",
            total - items.len()
        ));
    }
    out.push_str("</ul>");
    out
}

/// `update G3 ← G4, G5: «text»` (evidence count), escaped.
fn op_html(op: &OpView) -> String {
    let mut head = op.kind.clone();
    if let Some(k) = &op.key {
        head.push(' ');
        head.push_str(k);
    }
    if !op.merged_from.is_empty() {
        head.push_str(&format!(" ← {}", op.merged_from.join(", ")));
    }
    let mut out = format!("<b>{}</b>", esc(&head));
    if let Some(t) = &op.text {
        out.push_str(&format!(": <span class=\"rule\">{}</span>", esc(t)));
    }
    out.push_str(&format!(
        " <span class=\"muted\">({} evidence)</span>",
        op.evidence
    ));
    out
}

fn rejected_html(r: &RejectedView) -> String {
    format!(
        "{}<br><span class=\"tag bad\">{}</span> {}",
        op_html(&r.op),
        esc(&r.reason),
        esc(&r.detail)
    )
}

pub fn need_review(page: &mut Page, data: &RunData) {
    let nr = &data.review;
    page.open_section("need-review", "Need-review");
    page.explain(
        "Reflection routes a ticket to need-review when the decision pass finds no evidence \
         for its label (reflection_no_evidence_after_gt), when its retries or the epoch's calls \
         run out (budget_exhausted), or when the epoch's change cap was reached \
         (change_cap_reached). Routing is per epoch: the final epoch's rows are what is still \
         in review; earlier epochs are history. From need_review_queue.jsonl.",
    );
    review_counts(page, nr);
    let final_epoch = data
        .identity
        .epochs()
        .or_else(|| nr.per_epoch.keys().max().copied());
    match final_epoch.and_then(|e| nr.per_epoch.get(&e).map(|r| (e, r))) {
        Some((e, r)) => {
            page.heading(&format!("In review after the final epoch (epoch {e})"));
            page.wide_table(
                &[
                    "ticket",
                    "gt",
                    "predicted",
                    "reason code",
                    "cycle",
                    "predicted reason",
                    "uncertainty note",
                ],
                r.shown.iter().map(review_row),
            );
            left_out_note(page, r.shown.len(), r.rows, "rows");
        }
        None if nr.file.present => page.para("No ticket is in review after the final epoch."),
        None => {}
    }
    file_notes(page, [&nr.file]);
    page.close_section();
}

/// Rows and tickets per epoch and reason code, and the totals.
fn review_counts(page: &mut Page, nr: &NeedReview) {
    let codes: BTreeSet<&String> = nr
        .per_epoch
        .values()
        .flat_map(|e| e.by_code.keys())
        .collect();
    let mut headers = vec!["epoch", "rows", "tickets"];
    headers.extend(codes.iter().map(|c| c.as_str()));
    page.table(
        &headers,
        nr.per_epoch.iter().map(|(e, r)| {
            let mut row = vec![
                Cell::num(e),
                Cell::num(r.rows).metric(format!("need_review_rows_e{e}")),
                Cell::num(r.tickets).metric(format!("need_review_tickets_e{e}")),
            ];
            let count = |c: &String| r.by_code.get(c).copied().unwrap_or(0);
            row.extend(codes.iter().map(|&c| Cell::num(count(c))));
            row
        }),
    );
    page.facts(&[
        (
            "rows (all epochs)",
            Cell::num(nr.total_rows).metric("need_review_rows_total"),
        ),
        (
            "distinct tickets",
            Cell::num(nr.distinct_tickets).metric("need_review_distinct_tickets"),
        ),
    ]);
}

fn review_row(r: &ReviewRow) -> Vec<Cell> {
    vec![
        Cell::markup(format!(
            "<span class=\"mono\">{}</span>",
            esc(&r.ticket_key)
        )),
        Cell::text(&r.gt_label),
        Cell::text(&r.pred_verdict),
        Cell::text(&r.reason_code),
        Cell::markup(format!(
            "{}<br><span class=\"muted mono\">{}</span>",
            opt(r.reflection_cycle),
            esc(&r.reflection_id)
        )),
        Cell::text(&r.pred_reason),
        Cell::text(&r.uncertainty_note),
    ]
}
