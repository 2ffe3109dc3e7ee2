//! Sections `accuracy`, `votes` and `malformed`: what the rollouts decided, per epoch.

use std::collections::{BTreeMap, BTreeSet};

use super::super::RunData;
use super::super::charts::{self, BarChart, LineChart, Series};
use super::super::html::{Cell, Page, pct, ratio};
use super::super::identity::config_f64;
use super::super::outcomes::{EpochAccuracy, EpochOutcome};
use super::file_notes;

/// A count read off a per-epoch record.
type Count<T> = fn(&T) -> u64;

/// Above this many distinct vote strengths the histogram bins by 0.05.
const MAX_EXACT_BINS: usize = 24;

fn count(v: f64) -> String {
    format!("{v:.0}")
}

fn share(v: f64) -> String {
    format!("{:.0}%", v * 100.0)
}

fn fine_share(v: f64) -> String {
    format!("{:.1}%", v * 100.0)
}

pub fn accuracy(page: &mut Page, data: &RunData) {
    let o = &data.outcomes;
    page.open_section("accuracy", "Accuracy per epoch");
    page.explain(
        "acc = correct / n, pass is the positive class: fp = predicted pass with gt fail, fn = \
         predicted fail with gt pass (a ticket without a verdict counts as wrong). \"All \
         tickets\" counts every ticket of the epoch; \"without need-review\" leaves out the \
         tickets routed to need-review in that epoch and the hard failures. From the epoch_end \
         rows.",
    );
    if o.accuracy_source != stageb_coordinator::artifacts::files::METRICS && !o.accuracy.is_empty()
    {
        page.note(
            "metrics.jsonl has no epoch_end row: these are summary.json's epoch_accuracy rows.",
        );
    }
    if o.accuracy.is_empty() {
        page.note("No epoch_end row in metrics.jsonl or summary.json: no epoch has finished.");
    }
    page.table(
        &[
            "epoch",
            "acc (all)",
            "n",
            "fn",
            "fp",
            "acc (without need-review)",
            "n",
            "fn",
            "fp",
            "need-review or no verdict",
        ],
        o.accuracy.iter().map(|a| {
            let e = a.epoch;
            let (i, x) = (&a.include, &a.exclude);
            vec![
                Cell::num(e),
                Cell::num(pct(i.acc)).metric(format!("acc_incl_e{e}")),
                Cell::num(i.n).metric(format!("n_incl_e{e}")),
                Cell::num(i.false_negatives).metric(format!("fn_incl_e{e}")),
                Cell::num(i.false_positives).metric(format!("fp_incl_e{e}")),
                Cell::num(pct(x.acc)).metric(format!("acc_excl_e{e}")),
                Cell::num(x.n).metric(format!("n_excl_e{e}")),
                Cell::num(x.false_negatives).metric(format!("fn_excl_e{e}")),
                Cell::num(x.false_positives).metric(format!("fp_excl_e{e}")),
                Cell::num(i.n.saturating_sub(x.n)),
            ]
        }),
    );
    split_accuracy(page, data);
    checked_predictions(page, data);
    rule_ablation(page, data);
    if !o.accuracy.is_empty() {
        accuracy_charts(page, data);
    }
    file_notes(page, o.files.iter().take(1));
    page.close_section();
}

/// Accuracy per held-out split (`reflection.gate`), the final split first: reflection never
/// saw it and nothing was decided on it, so it is the number to quote.
fn split_accuracy(page: &mut Page, data: &RunData) {
    let acc = &data.outcomes.accuracy;
    if acc.iter().all(|a| a.splits.is_empty()) {
        return;
    }
    page.explain(
        "Held-out splits (reflection.gate): train tickets feed reflection; gate and final \
         tickets are rolled out and decided like the others but never shown to reflection. \
         The final split is the headline: nothing was ever selected on it.",
    );
    let rows = acc.iter().flat_map(|a| {
        ["final", "gate", "train"]
            .into_iter()
            .filter_map(move |name| {
                let s = a.splits.get(name)?;
                let (e, i, x) = (a.epoch, &s.include_manual_review, &s.exclude_manual_review);
                Some(vec![
                    Cell::num(e),
                    Cell::text(name),
                    Cell::num(s.tickets),
                    Cell::num(pct(i.acc)).metric(format!("acc_{name}_e{e}")),
                    Cell::num(i.n),
                    Cell::num(pct(x.acc)),
                    Cell::num(x.n),
                ])
            })
    });
    page.table(
        &[
            "epoch",
            "split",
            "tickets",
            "acc (all)",
            "n",
            "acc (without need-review)",
            "n",
        ],
        rows,
    );
}

/// The claims of applied ops (`expected_flips`) and how the next epoch bore them out.
fn checked_predictions(page: &mut Page, data: &RunData) {
    let acc = &data.outcomes.accuracy;
    if acc.iter().all(|a| a.predictions.is_empty()) {
        return;
    }
    page.explain(
        "Checked predictions: an applied op may name the evidence tickets it expects to fix; \
         the next epoch's decisions of those tickets settle each claim (a hit when the verdict \
         matches the label).",
    );
    let rows = acc.iter().flat_map(|a| {
        a.predictions.iter().map(move |p| {
            let rate = if p.claimed == 0 {
                0.0
            } else {
                p.hits as f64 / p.claimed as f64
            };
            vec![
                Cell::num(a.epoch),
                Cell::text(&p.reflection_id),
                Cell::text(&format!("{} {}", p.op, p.key)),
                Cell::num(p.epoch_applied),
                Cell::num(p.claimed),
                Cell::num(p.hits),
                Cell::num(pct(rate)),
            ]
        })
    });
    page.table(
        &[
            "checked in epoch",
            "reflection",
            "op",
            "applied in epoch",
            "claimed",
            "hits",
            "hit rate",
        ],
        rows,
    );
}

/// Each learned rule's contribution on the gate split (leave-one-rule-out), per epoch it ran.
fn rule_ablation(page: &mut Page, data: &RunData) {
    let acc = &data.outcomes.accuracy;
    if acc.iter().all(|a| a.ablation.is_empty()) {
        return;
    }
    page.explain(
        "Rule ablation: each learned rule left out in turn on the gate split; its contribution \
         is the gate accuracy with it minus without it, with a 90% paired-bootstrap interval. \
         Nothing is removed for it.",
    );
    let rows = acc.iter().flat_map(|a| {
        a.ablation.iter().map(move |r| {
            let c = &r.contribution;
            vec![
                Cell::num(a.epoch),
                Cell::text(&r.key),
                Cell::num(r.tickets),
                Cell::num(pct(r.accuracy_with)),
                Cell::num(pct(r.accuracy_without)),
                Cell::num(format!("{:+.3}", c.mean))
                    .metric(format!("ablation_{}_e{}", r.key, a.epoch)),
                Cell::num(format!("[{:+.3}, {:+.3}]", c.low, c.high)),
            ]
        })
    });
    page.table(
        &[
            "epoch",
            "rule",
            "gate tickets",
            "accuracy with",
            "without",
            "contribution",
            "90% interval",
        ],
        rows,
    );
}

fn accuracy_charts(page: &mut Page, data: &RunData) {
    let acc = &data.outcomes.accuracy;
    let line = |name: &str, f: fn(&EpochAccuracy) -> f64| Series {
        name: name.to_string(),
        points: acc.iter().map(|a| (a.epoch as f64, f(a))).collect(),
    };
    let series = [
        line("all tickets", |a| a.include.acc),
        line("without need-review", |a| a.exclude.acc),
    ];
    page.markup("<div class=\"charts\">");
    page.chart(
        "accuracy per epoch",
        charts::line_chart(&LineChart {
            x_label: "epoch",
            y_label: "accuracy",
            series: &series,
            y_range: Some(0.0..1.05),
            integer_x: true,
            y_format: share,
        }),
    );
    errors_chart(page, acc);
    page.markup("</div>");
}

/// fn and fp per epoch, with and without need-review, side by side.
fn errors_chart(page: &mut Page, acc: &[EpochAccuracy]) {
    let categories: Vec<String> = acc.iter().map(|a| format!("epoch {}", a.epoch)).collect();
    let bars: [(&str, Count<EpochAccuracy>); 4] = [
        ("fn (all)", |a| a.include.false_negatives),
        ("fp (all)", |a| a.include.false_positives),
        ("fn (without)", |a| a.exclude.false_negatives),
        ("fp (without)", |a| a.exclude.false_positives),
    ];
    let series: Vec<(String, Vec<f64>)> = bars
        .iter()
        .map(|(name, f)| (name.to_string(), acc.iter().map(|a| f(a) as f64).collect()))
        .collect();
    page.chart(
        "false negatives and false positives per epoch",
        charts::bar_chart(&BarChart {
            x_label: "epoch",
            y_label: "tickets",
            categories: &categories,
            series: &series,
            stacked: false,
            y_format: count,
        }),
    );
}

/// Vote strengths as histogram bins: exact values when few, else 0.05 wide bins.
/// Returns (label, per-epoch counts).
fn vote_bins(epochs: &BTreeMap<u32, EpochOutcome>) -> Vec<(String, Vec<u64>)> {
    let values: BTreeSet<u32> = epochs
        .values()
        .flat_map(|e| e.vote_strength.keys().copied())
        .collect();
    let exact = values.len() <= MAX_EXACT_BINS;
    let bin_of = |permille: u32| {
        if exact {
            permille
        } else {
            (permille / 50).min(19) * 50
        }
    };
    let bins: BTreeSet<u32> = values.iter().map(|&v| bin_of(v)).collect();
    bins.iter()
        .map(|&b| {
            let label = if exact {
                format!("{:.2}", b as f64 / 1000.0)
            } else {
                format!("{:.2}–{:.2}", b as f64 / 1000.0, (b + 50) as f64 / 1000.0)
            };
            let counts = epochs
                .values()
                .map(|e| {
                    e.vote_strength
                        .iter()
                        .filter(|&(&v, _)| bin_of(v) == b)
                        .map(|(_, n)| n)
                        .sum()
                })
                .collect();
            (label, counts)
        })
        .collect()
}

pub fn votes(page: &mut Page, data: &RunData) {
    let epochs = &data.outcomes.epochs;
    page.open_section("votes", "Vote strength");
    let threshold = data
        .identity
        .manifest
        .as_ref()
        .and_then(|m| config_f64(m, "/manual_review/min_verdict_agreement"));
    page.explain(&format!(
        "A ticket's vote strength is the winning verdict's share among its format-ok \
         candidates, before overrides (selections.jsonl result.vote_strength). Below \
         manual_review.min_verdict_agreement ({}) the ticket is low-agreement and flagged for \
         manual review.",
        threshold.map_or("unknown".into(), |t| t.to_string())
    ));
    let bins = vote_bins(epochs);
    vote_table(page, epochs, &bins);
    if !bins.is_empty() {
        vote_chart(page, epochs, &bins);
    }
    file_notes(page, data.outcomes.files.get(1));
    page.close_section();
}

/// One row per bin, then the per-epoch flags and ticket counts.
fn vote_table(page: &mut Page, epochs: &BTreeMap<u32, EpochOutcome>, bins: &[(String, Vec<u64>)]) {
    let mut headers = vec!["vote strength".to_string()];
    headers.extend(epochs.keys().map(|e| format!("epoch {e}")));
    let headers: Vec<&str> = headers.iter().map(String::as_str).collect();
    let mut rows: Vec<Vec<Cell>> = bins
        .iter()
        .map(|(label, counts)| {
            let mut row = vec![Cell::text(label)];
            row.extend(counts.iter().map(Cell::num));
            row
        })
        .collect();
    let flags: [(&str, &str, Count<EpochOutcome>); 4] = [
        ("no vote (no format-ok candidate)", "no_vote", |o| o.no_vote),
        ("low agreement", "low_agreement", |o| o.low_agreement),
        ("needs manual review", "needs_manual_review", |o| {
            o.needs_manual_review
        }),
        ("tickets", "tickets", |o| o.tickets),
    ];
    for (name, metric, f) in flags {
        let mut row = vec![Cell::text(name)];
        row.extend(
            epochs
                .iter()
                .map(|(e, o)| Cell::num(f(o)).metric(format!("{metric}_e{e}"))),
        );
        rows.push(row);
    }
    page.table(&headers, rows);
}

fn vote_chart(page: &mut Page, epochs: &BTreeMap<u32, EpochOutcome>, bins: &[(String, Vec<u64>)]) {
    let categories: Vec<String> = bins.iter().map(|(l, _)| l.clone()).collect();
    let series: Vec<(String, Vec<f64>)> = epochs
        .keys()
        .enumerate()
        .map(|(i, e)| {
            let values = bins.iter().map(|(_, c)| c[i] as f64).collect();
            (format!("epoch {e}"), values)
        })
        .collect();
    page.chart(
        "vote strength histogram",
        charts::bar_chart(&BarChart {
            x_label: "vote strength",
            y_label: "tickets",
            categories: &categories,
            series: &series,
            stacked: false,
            y_format: count,
        }),
    );
}

pub fn malformed(page: &mut Page, data: &RunData) {
    let epochs = &data.outcomes.epochs;
    page.open_section("malformed", "Malformed candidates");
    page.explain(
        "A candidate is malformed when it breaks the two-line Verdict/Reason contract; it is \
         dropped from the vote. Candidates and malformed counts come from the selections' vote \
         counts, the violation codes from failure_malformed.jsonl. A hard failure is a ticket \
         left without a verdict (every candidate malformed, or the rollout job failed).",
    );
    let codes: BTreeSet<&String> = epochs
        .values()
        .flat_map(|e| e.malformed_by_code.keys())
        .collect();
    let mut headers = vec!["epoch", "tickets", "candidates", "malformed", "rate"];
    headers.extend(codes.iter().map(|c| c.as_str()));
    headers.push("hard failures");
    page.table(
        &headers,
        epochs.iter().map(|(e, o)| malformed_row(*e, o, &codes)),
    );
    for (e, o) in epochs {
        if o.malformed_rows() != o.malformed {
            page.note(&format!(
                "Epoch {e}: the selections count {} malformed candidates, failure_malformed.jsonl \
                 has {} format_error rows (`stageb audit` reports the difference).",
                o.malformed,
                o.malformed_rows()
            ));
        }
    }
    if codes.is_empty() {
        page.para("No malformed candidate: every candidate followed the contract.");
    } else {
        malformed_chart(page, epochs, &codes);
    }
    file_notes(page, data.outcomes.files.iter().skip(1));
    page.close_section();
}

fn malformed_row(e: u32, o: &EpochOutcome, codes: &BTreeSet<&String>) -> Vec<Cell> {
    let mut row = vec![
        Cell::num(e),
        Cell::num(o.tickets),
        Cell::num(o.candidates).metric(format!("candidates_e{e}")),
        Cell::num(o.malformed).metric(format!("malformed_e{e}")),
        Cell::num(ratio(o.malformed, o.candidates)).metric(format!("malformed_rate_e{e}")),
    ];
    row.extend(codes.iter().map(|&c| {
        let n = o.malformed_by_code.get(c).copied().unwrap_or(0);
        Cell::num(format!("{n} ({})", ratio(n, o.candidates)))
    }));
    let total: u64 = o.hard_failures.values().sum();
    let hard = if total == 0 {
        "0".to_string()
    } else {
        let parts: Vec<String> = o
            .hard_failures
            .iter()
            .map(|(k, n)| format!("{k}: {n}"))
            .collect();
        format!("{total} ({})", parts.join(", "))
    };
    row.push(Cell::text(&hard).metric(format!("hard_failures_e{e}")));
    row
}

fn malformed_chart(
    page: &mut Page,
    epochs: &BTreeMap<u32, EpochOutcome>,
    codes: &BTreeSet<&String>,
) {
    let categories: Vec<String> = epochs.keys().map(|e| format!("epoch {e}")).collect();
    let series: Vec<(String, Vec<f64>)> = codes
        .iter()
        .map(|&code| {
            let rates = epochs
                .values()
                .map(|o| {
                    let n = o.malformed_by_code.get(code).copied().unwrap_or(0);
                    if o.candidates == 0 {
                        0.0
                    } else {
                        n as f64 / o.candidates as f64
                    }
                })
                .collect();
            (code.clone(), rates)
        })
        .collect();
    page.chart(
        "malformed rate per epoch by violation code",
        charts::bar_chart(&BarChart {
            x_label: "epoch",
            y_label: "share of candidates",
            categories: &categories,
            series: &series,
            stacked: true,
            y_format: fine_share,
        }),
    );
}
