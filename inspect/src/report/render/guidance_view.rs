//! Section `guidance`: the rules in force at the end, every version of the chain as a diff
//! (added, removed, changed rules with before/after text), and the snapshots.

use super::super::RunData;
use super::super::guidance::{ChangeKind, GuidanceTimeline, RuleChange, VersionView};
use super::super::html::{Cell, Page, esc};
use super::{file_notes, opt};

pub fn render(page: &mut Page, data: &RunData) {
    let g = &data.guidance;
    page.open_section("guidance", "Guidance timeline");
    page.explain(
        "guidance.json keeps every version of the rules as a hash chain: a seed, then one \
         version per applied reflection (step + 1) or cleanup. Texts are replayed from the \
         seed with each version's applied ops; `stageb audit` verifies the chain itself.",
    );
    if !g.live_rules.is_empty() {
        page.heading(&format!(
            "Rules in force at the end ({})",
            g.live_rules.len()
        ));
        page.wide_table(
            &["rule", "text"],
            g.live_rules.iter().map(|(k, t)| {
                vec![
                    Cell::markup(format!("<b>{}</b>", esc(k.key()))),
                    Cell::markup(format!("<span class=\"rule\">{}</span>", esc(t))),
                ]
            }),
        );
    }
    versions(page, g);
    snapshots(page, g);
    for p in &g.problems {
        page.note(p);
    }
    if g.replay_matches_live == Some(false) {
        page.note(
            "Replaying the chain does not give the rules in force: guidance.json's \
             experiences and versions disagree (`stageb audit` says where).",
        );
    }
    file_notes(page, [&g.file]);
    page.close_section();
}

fn versions(page: &mut Page, g: &GuidanceTimeline) {
    if g.total_versions == 0 {
        return;
    }
    page.heading(&format!("Versions ({})", g.total_versions));
    page.markup(&format!(
        "<p class=\"muted\" data-metric=\"guidance_versions\">{} version(s), {} of them \
         reflections.</p>",
        g.total_versions,
        g.versions.iter().filter(|v| v.kind == "reflection").count()
    ));
    let shown = g.versions.len();
    if g.total_versions > shown {
        page.note(&format!(
            "The last {shown} versions of {} are shown; the {} earliest are left out (the \
             rules in force above are complete).",
            g.total_versions,
            g.total_versions - shown
        ));
    }
    page.wide_table(
        &["version", "change", "rule", "text"],
        g.versions.iter().flat_map(version_rows),
    );
}

fn version_rows(v: &VersionView) -> Vec<Vec<Cell>> {
    let mut label = format!("<b>v{}</b> · step {} · {}", v.seq, v.step, esc(&v.kind));
    for line in [&v.reflection_id, &v.created_at].into_iter().flatten() {
        label.push_str(&format!(
            "<br><span class=\"muted mono\">{}</span>",
            esc(line)
        ));
    }
    let mut rows: Vec<Vec<Cell>> = v.changes.iter().map(change_row).collect();
    rows.extend(v.skipped.iter().map(|s| {
        vec![
            Cell::markup("<span class=\"tag\">skipped</span>".into()),
            Cell::text(&s.op),
            Cell::text(&format!("{}: {}", s.reason, s.detail)),
        ]
    }));
    if rows.is_empty() {
        rows.push(vec![
            Cell::text("no rule changed"),
            Cell::text(""),
            Cell::text(""),
        ]);
    }
    // The version label heads the first row only.
    rows.into_iter()
        .enumerate()
        .map(|(i, mut row)| {
            let head = if i == 0 { label.clone() } else { String::new() };
            row.insert(0, Cell::markup(head));
            row
        })
        .collect()
}

fn change_row(c: &RuleChange) -> Vec<Cell> {
    let (tag, class) = match c.kind {
        ChangeKind::Added => ("added", "ok"),
        ChangeKind::Removed => ("removed", "bad"),
        ChangeKind::Changed => ("changed", ""),
    };
    let rule = |class: &str, t: &Option<String>| {
        t.as_ref().map_or(String::new(), |t| {
            format!("<div class=\"rule {class}\">{}</div>", esc(t))
        })
    };
    let mut text = match (c.kind, &c.before, &c.after) {
        (ChangeKind::Changed, Some(before), Some(after)) => {
            let (was, now) = marked_diff(before, after);
            format!("<div class=\"rule was\">{was}</div><div class=\"rule now\">{now}</div>")
        }
        (ChangeKind::Added | ChangeKind::Changed, _, _) => rule("add", &c.after),
        (ChangeKind::Removed, _, _) => rule("del", &c.before),
    };
    if let Some(note) = &c.note {
        text.push_str(&format!("<div class=\"muted\">{}</div>", esc(note)));
    }
    vec![
        Cell::markup(format!("<span class=\"tag {class}\">{tag}</span>")),
        Cell::markup(format!("<b>{}</b>", esc(&c.key))),
        Cell::markup(text),
    ]
}

/// The two texts with what differs between them marked: the common head and tail stay
/// plain, the middle is `<del>` in the old text and `<ins>` in the new one (a rule update
/// usually inserts or rewords one clause, which this shows at a glance).
fn marked_diff(before: &str, after: &str) -> (String, String) {
    let b: Vec<char> = before.chars().collect();
    let a: Vec<char> = after.chars().collect();
    let head = b.iter().zip(&a).take_while(|(x, y)| x == y).count();
    let tail = b[head..]
        .iter()
        .rev()
        .zip(a[head..].iter().rev())
        .take_while(|(x, y)| x == y)
        .count();
    let text = |cs: &[char]| esc(&cs.iter().collect::<String>());
    let mark = |cs: &[char], tag: &str| {
        let middle = &cs[head..cs.len() - tail];
        let middle = if middle.is_empty() {
            String::new()
        } else {
            format!("<{tag}>{}</{tag}>", text(middle))
        };
        format!(
            "{}{middle}{}",
            text(&cs[..head]),
            text(&cs[cs.len() - tail..])
        )
    };
    (mark(&b, "del"), mark(&a, "ins"))
}

fn snapshots(page: &mut Page, g: &GuidanceTimeline) {
    if g.snapshots_total == 0 {
        return;
    }
    page.heading(&format!("Snapshots ({})", g.snapshots_total));
    page.explain(
        "snapshots/ holds a copy of guidance.json taken before each version change (the last \
         guidance.retention of them). \"matches\" compares a snapshot's rules with the chain's \
         replayed rules of the version it names.",
    );
    page.table(
        &["file", "version", "step", "rules", "matches the chain"],
        g.snapshots.iter().map(|s| {
            let matches = match s.matches_chain {
                Some(true) => "<span class=\"tag ok\">yes</span>",
                Some(false) => "<span class=\"tag bad\">no</span>",
                None => "<span class=\"tag\">unknown</span>",
            };
            vec![
                Cell::markup(format!("<span class=\"mono\">{}</span>", esc(&s.name))),
                Cell::num(opt(s.seq)),
                Cell::num(opt(s.step)),
                Cell::num(opt(s.rules)),
                Cell::markup(matches.into()),
            ]
        }),
    );
    if g.snapshots_total > g.snapshots.len() {
        page.note(&format!(
            "The newest {} snapshots of {} are listed.",
            g.snapshots.len(),
            g.snapshots_total
        ));
    }
}
