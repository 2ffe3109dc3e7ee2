//! Rank 0's progress display: a bar when stderr is a terminal (tickets done/total, the phase,
//! candidates/s, live workers, ETA), one log line every few seconds otherwise (Slurm and
//! Kubernetes logs need liveness evidence, not carriage returns). The phase and the ETA come
//! from [`ProgressSnapshot`]: the ETA counts the reflection still to run, not only the tickets
//! (indicatif's own ETA, by tickets alone, read 0 through the last reflection rounds).

use std::io::IsTerminal;
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressStyle};
use stageb_coordinator::run::{ProgressHandle, ProgressSnapshot};

/// Report progress until `stop` resolves.
pub async fn report(
    progress: ProgressHandle,
    every: Duration,
    stop: impl std::future::Future<Output = ()>,
) {
    tokio::pin!(stop);
    let start = Instant::now();
    let bar = std::io::stderr().is_terminal().then(|| {
        let b = ProgressBar::new(0);
        b.set_style(
            ProgressStyle::with_template(
                "{spinner} epoch {prefix} [{bar:30}] {pos}/{len} tickets {msg}",
            )
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
        );
        b
    });
    let tick = if bar.is_some() {
        Duration::from_millis(250)
    } else {
        every
    };
    let mut interval = tokio::time::interval(tick);
    loop {
        tokio::select! {
            _ = &mut stop => break,
            _ = interval.tick() => {}
        }
        let p = progress.lock().unwrap_or_else(|e| e.into_inner()).clone();
        let rate = p.candidates as f64 / start.elapsed().as_secs_f64().max(1e-3);
        let eta = eta_text(&p);
        match &bar {
            Some(b) => {
                b.set_length(p.total);
                b.set_position(p.done);
                b.set_prefix(format!("{}/{}", p.epoch, p.epochs));
                b.set_message(format!(
                    "{}, {rate:.1} cand/s, {} workers, ETA {eta}",
                    p.phase_text(),
                    p.live_workers
                ));
            }
            None if p.total > 0 => {
                tracing::info!(
                    epoch = p.epoch, phase = %p.phase_text(), done = p.done, total = p.total,
                    candidates_per_s = format!("{rate:.2}"), live_workers = p.live_workers,
                    eta = %eta, "progress"
                );
            }
            None => {}
        }
    }
    if let Some(b) = bar {
        b.finish_and_clear();
    }
}

/// The ETA as shown: whole seconds, `>=` before reflection was timed, or `?` before anything
/// was measured.
fn eta_text(p: &ProgressSnapshot) -> String {
    match p.eta(Instant::now()) {
        Some(eta) => {
            let at_least = if eta.at_least { ">=" } else { "" };
            format!("{at_least}{:.0}s", eta.left.as_secs_f64())
        }
        None => "?".into(),
    }
}
