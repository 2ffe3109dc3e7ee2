//! HTML building blocks: escaping, the page shell (inline CSS, a Content-Security-Policy that
//! forbids every script and every load), sections, tables, notes, number formats.
//!
//! Everything from an artifact is untrusted (rule texts and reasons are model output), so it
//! only enters the page through [`esc`] or [`Cell::text`]; markup is only ever written by this
//! crate. The CSP is the second wall: even an escaping bug could not run a script or fetch
//! anything, and the page needs neither (the charts are inline SVG, the styles inline CSS).

use std::fmt::Write as _;

use super::charts::{ChartError, Drawn};

/// The page's policy: nothing may load or run; inline styles only.
const CSP: &str =
    "default-src 'none'; style-src 'unsafe-inline'; base-uri 'none'; form-action 'none'";

const CSS: &str = r#"
:root { --fg:#1d232b; --muted:#5d6773; --line:#dde2e8; --bg:#f6f7f9; --ok:#1b7f3b; --bad:#b42318;
  --warn-bg:#fff6e0; --warn-line:#e8b64a; --add:#e6f6ea; --del:#fdeceb; }
* { box-sizing: border-box; }
body { margin:0; color:var(--fg); background:var(--bg); font: 14px/1.5 system-ui, -apple-system,
  "Segoe UI", "Noto Sans", "Noto Sans CJK SC", "WenQuanYi Micro Hei", "PingFang SC",
  "Microsoft YaHei", sans-serif; }
header.top { background:#fff; border-bottom:1px solid var(--line); padding:14px 28px; }
header.top h1 { margin:0 0 4px; font-size:20px; }
header.top nav a { color:var(--muted); margin-right:14px; text-decoration:none; font-size:13px; }
header.top nav a:hover { color:var(--fg); text-decoration:underline; }
main { max-width:1180px; margin:0 auto; padding:8px 28px 40px; }
section { background:#fff; border:1px solid var(--line); border-radius:8px; padding:16px 22px;
  margin:18px 0; }
section h2 { margin:0 0 10px; font-size:17px; }
section h3 { margin:18px 0 6px; font-size:14px; color:var(--muted); font-weight:600; }
p { margin:6px 0; }
.muted { color:var(--muted); }
.verdict { border-radius:6px; padding:10px 14px; font-weight:600; font-size:15px; margin-bottom:12px; }
.verdict.ok { background:#e8f5ec; color:var(--ok); border:1px solid #b7dfc3; }
.verdict.bad { background:#fdeceb; color:var(--bad); border:1px solid #f3b8b3; }
.verdict.skipped { background:var(--warn-bg); color:#7a5200; border:1px solid var(--warn-line); }
.note { background:var(--warn-bg); border-left:4px solid var(--warn-line); padding:6px 10px;
  margin:8px 0; border-radius:4px; }
dl.facts { display:grid; grid-template-columns: max-content 1fr max-content 1fr; gap:4px 16px;
  margin:8px 0; }
dl.facts dt { color:var(--muted); }
dl.facts dd { margin:0; font-variant-numeric: tabular-nums; overflow-wrap:anywhere; }
.scroll { overflow-x:auto; }
table { border-collapse:collapse; margin:6px 0 10px; font-size:13px; }
table.wide { width:100%; }
td .mono { white-space:nowrap; }
th, td { border-bottom:1px solid var(--line); padding:4px 8px; text-align:left; vertical-align:top; }
th { background:#f0f2f5; font-weight:600; }
td.n { text-align:right; font-variant-numeric: tabular-nums; white-space:nowrap; }
tbody tr:nth-child(even) { background:#fafbfc; }
figure.chart { margin:8px 0; }
.chart svg { width:100%; max-width:640px; height:auto; display:block; }
.chart figcaption { font-size:12px; color:var(--muted); max-width:640px; text-align:center; }
.chart .key { margin:0 8px; white-space:nowrap; }
.chart .key i { display:inline-block; width:10px; height:10px; margin-right:4px; border-radius:2px; }
.charts { display:grid; grid-template-columns: repeat(auto-fit, minmax(480px, 1fr)); gap:10px; }
code, .mono { font-family: ui-monospace, "SFMono-Regular", Menlo, Consolas, monospace; font-size:12px; }
.tag { display:inline-block; padding:0 6px; border-radius:10px; font-size:12px; background:#eef1f4; }
.tag.ok { background:#e8f5ec; color:var(--ok); } .tag.bad { background:#fdeceb; color:var(--bad); }
.rule { white-space:pre-wrap; overflow-wrap:anywhere; }
.add { background:var(--add); } .del { background:var(--del); text-decoration:line-through; }
.was, .now { padding:1px 3px; } .was { background:var(--del); } .now { background:var(--add); }
.was del { background:#f5bdb7; } .now ins { background:#b5e3c0; text-decoration:none; }
ul.ops { margin:0; padding-left:16px; } ul.ops li { margin:2px 0; overflow-wrap:anywhere; }
.version { border-top:1px solid var(--line); padding-top:8px; margin-top:10px; }
"#;

/// Escape `s` for element content and quoted attribute values. Characters that change how
/// text around them is displayed (bidirectional overrides and isolates, other control
/// characters besides tab and newline) are shown as `[U+XXXX]`, never passed through: a
/// reason or rule could otherwise make the page show text in an order it does not have.
pub fn esc(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 8);
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c if hides_text_order(c) => out.push_str(&format!("[U+{:04X}]", c as u32)),
            c => out.push(c),
        }
    }
    out
}

/// Bidirectional formatting characters (LRM/RLM/ALM, embeddings, overrides, isolates) and
/// control characters other than tab and newline.
fn hides_text_order(c: char) -> bool {
    matches!(c, '\u{200E}' | '\u{200F}' | '\u{061C}' | '\u{202A}'..='\u{202E}' | '\u{2066}'..='\u{2069}')
        || (c.is_control() && c != '\n' && c != '\t')
}

/// A run directory as the page names it: its last two components (`{run_name}/{mission}`),
/// never the absolute path of the machine that rendered it.
pub fn run_label(run_dir: &std::path::Path) -> String {
    let parts: Vec<_> = run_dir
        .components()
        .rev()
        .filter_map(|c| match c {
            std::path::Component::Normal(s) => Some(s.to_string_lossy()),
            _ => None,
        })
        .take(2)
        .collect();
    parts.into_iter().rev().collect::<Vec<_>>().join("/")
}

/// A share as a percentage with one decimal.
pub fn pct(share: f64) -> String {
    format!("{:.1}%", share * 100.0)
}

/// `part / whole` as a percentage, `—` when there is no whole.
pub fn ratio(part: u64, whole: u64) -> String {
    if whole == 0 {
        "—".into()
    } else {
        pct(part as f64 / whole as f64)
    }
}

/// Seconds as `1h 02m`, `3m 05s` or `12.3s`.
pub fn duration(seconds: f64) -> String {
    if !seconds.is_finite() || seconds < 0.0 {
        return "—".into();
    }
    let s = seconds.round() as u64;
    match s {
        0..60 => format!("{seconds:.1}s"),
        60..3600 => format!("{}m {:02}s", s / 60, s % 60),
        _ => format!("{}h {:02}m", s / 3600, (s % 3600) / 60),
    }
}

/// A table cell: safe markup plus how to lay it out.
pub struct Cell {
    html: String,
    numeric: bool,
    metric: Option<String>,
}

impl Cell {
    /// Text from anywhere, escaped.
    pub fn text(s: &str) -> Cell {
        Cell {
            html: esc(s),
            numeric: false,
            metric: None,
        }
    }

    /// A number (or `—`), right-aligned.
    pub fn num(v: impl std::fmt::Display) -> Cell {
        Cell {
            html: esc(&v.to_string()),
            numeric: true,
            metric: None,
        }
    }

    /// Markup this crate built (its text parts escaped already).
    pub fn markup(html: String) -> Cell {
        Cell {
            html,
            numeric: false,
            metric: None,
        }
    }

    /// Name the value for scripts and tests: `data-metric="NAME"`.
    pub fn metric(mut self, name: impl Into<String>) -> Cell {
        self.metric = Some(name.into());
        self
    }
}

/// The page being written.
pub struct Page {
    out: String,
}

impl Page {
    /// Start the page: head, styles, the heading and the section links.
    pub fn new(title: &str, subtitle: &str, links: &[(&str, &str)]) -> Page {
        let mut out = String::with_capacity(256 * 1024);
        let _ = write!(
            out,
            "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n\
             <meta http-equiv=\"Content-Security-Policy\" content=\"{CSP}\">\n\
             <meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\n\
             <title>{}</title>\n<style>{CSS}</style>\n</head>\n<body>\n\
             <header class=\"top\"><h1>{}</h1><div class=\"muted\">{}</div><nav>",
            esc(title),
            esc(title),
            esc(subtitle)
        );
        for (id, label) in links {
            let _ = write!(out, "<a href=\"#{}\">{}</a>", esc(id), esc(label));
        }
        out.push_str("</nav></header>\n<main>\n");
        Page { out }
    }

    pub fn open_section(&mut self, id: &str, title: &str) {
        let _ = write!(
            self.out,
            "<section id=\"{}\">\n<h2>{}</h2>\n",
            esc(id),
            esc(title)
        );
    }

    pub fn close_section(&mut self) {
        self.out.push_str("</section>\n");
    }

    pub fn heading(&mut self, text: &str) {
        let _ = writeln!(self.out, "<h3>{}</h3>", esc(text));
    }

    /// A paragraph of plain text.
    pub fn para(&mut self, text: &str) {
        let _ = writeln!(self.out, "<p>{}</p>", esc(text));
    }

    /// A paragraph of muted explanatory text.
    pub fn explain(&mut self, text: &str) {
        let _ = writeln!(self.out, "<p class=\"muted\">{}</p>", esc(text));
    }

    /// A visible note: something missing, damaged, left out or coarse.
    pub fn note(&mut self, text: &str) {
        let _ = writeln!(self.out, "<div class=\"note\">{}</div>", esc(text));
    }

    /// Markup this crate built.
    pub fn markup(&mut self, html: &str) {
        self.out.push_str(html);
        self.out.push('\n');
    }

    /// `name: value` pairs, two per line.
    pub fn facts(&mut self, facts: &[(&str, Cell)]) {
        self.out.push_str("<dl class=\"facts\">\n");
        for (name, value) in facts {
            let _ = write!(self.out, "<dt>{}</dt><dd", esc(name));
            if let Some(m) = &value.metric {
                let _ = write!(self.out, " data-metric=\"{}\"", esc(m));
            }
            let _ = writeln!(self.out, ">{}</dd>", value.html);
        }
        self.out.push_str("</dl>\n");
    }

    /// A table as wide as its content (numbers).
    pub fn table(&mut self, headers: &[&str], rows: impl IntoIterator<Item = Vec<Cell>>) {
        self.table_of("", headers, rows);
    }

    /// A table as wide as the section (text).
    pub fn wide_table(&mut self, headers: &[&str], rows: impl IntoIterator<Item = Vec<Cell>>) {
        self.table_of(" class=\"wide\"", headers, rows);
    }

    fn table_of(
        &mut self,
        class: &str,
        headers: &[&str],
        rows: impl IntoIterator<Item = Vec<Cell>>,
    ) {
        let _ = write!(
            self.out,
            "<div class=\"scroll\"><table{class}>\n<thead><tr>"
        );
        for h in headers {
            let _ = write!(self.out, "<th>{}</th>", esc(h));
        }
        self.out.push_str("</tr></thead>\n<tbody>\n");
        for row in rows {
            self.out.push_str("<tr>");
            for cell in row {
                self.out.push_str(if cell.numeric {
                    "<td class=\"n\""
                } else {
                    "<td"
                });
                if let Some(m) = &cell.metric {
                    let _ = write!(self.out, " data-metric=\"{}\"", esc(m));
                }
                let _ = write!(self.out, ">{}</td>", cell.html);
            }
            self.out.push_str("</tr>\n");
        }
        self.out.push_str("</tbody>\n</table></div>\n");
    }

    /// A chart (from [`super::charts`]) with its legend, or a note saying why there is none.
    pub fn chart(&mut self, label: &str, chart: Result<Drawn, ChartError>) {
        let chart = match chart {
            Ok(c) => c,
            Err(e) => return self.note(&e.to_string()),
        };
        let _ = write!(
            self.out,
            "<figure class=\"chart\" role=\"img\" aria-label=\"{}\">{}<figcaption>",
            esc(label),
            chart.svg
        );
        for (name, colour) in &chart.legend {
            let _ = write!(
                self.out,
                "<span class=\"key\"><i style=\"background:{}\"></i>{}</span>",
                esc(colour),
                esc(name)
            );
        }
        self.out.push_str("</figcaption></figure>\n");
    }

    pub fn finish(mut self, footer: &str) -> String {
        let _ = write!(
            self.out,
            "</main>\n<footer class=\"muted\" style=\"text-align:center;padding:0 0 24px\">{}</footer>\n</body>\n</html>\n",
            esc(footer)
        );
        self.out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Regression: raw bidi controls reached report.html, where they could reorder the text shown.
    #[test]
    fn regression_bidi_and_control_characters_are_shown_as_code_points() {
        assert_eq!(esc("a\u{202E}cba\u{202C}"), "a[U+202E]cba[U+202C]");
        assert_eq!(
            esc("\u{2066}x\u{2069}\u{200F}"),
            "[U+2066]x[U+2069][U+200F]"
        );
        assert_eq!(esc("bell\u{7}"), "bell[U+0007]");
        assert_eq!(
            esc("tab\tline\n通过"),
            "tab\tline\n通过",
            "ordinary text is kept"
        );
    }

    /// Regression: the page showed the absolute path of the run directory.
    #[test]
    fn regression_the_run_is_named_without_its_absolute_path() {
        let dir = std::path::Path::new("/home/alice/secret/runs/demo/挡风板安装检查");
        assert_eq!(run_label(dir), "demo/挡风板安装检查");
        assert_eq!(run_label(std::path::Path::new("only")), "only");
    }
}
