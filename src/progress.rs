//! Rank 0's progress display: a bar when stderr is a terminal (tickets done/total,
//! candidates/s, ETA, live workers), one log line every few seconds otherwise (Slurm and
//! Kubernetes logs need liveness evidence, not carriage returns).

use std::io::IsTerminal;
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressStyle};
use stageb_coordinator::run::ProgressHandle;

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
                "{spinner} epoch {prefix} [{bar:30}] {pos}/{len} tickets {msg} ETA {eta}",
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
        match &bar {
            Some(b) => {
                b.set_length(p.total);
                b.set_position(p.done);
                b.set_prefix(format!("{}/{}", p.epoch, p.epochs));
                b.set_message(format!("{rate:.1} cand/s, {} workers", p.live_workers));
            }
            None if p.total > 0 => {
                let eta = if p.done > 0 {
                    let per = start.elapsed().as_secs_f64() / p.done as f64;
                    format!("{:.0}s", per * (p.total - p.done) as f64)
                } else {
                    "?".into()
                };
                tracing::info!(
                    epoch = p.epoch, done = p.done, total = p.total, candidates_per_s = format!("{rate:.2}"),
                    live_workers = p.live_workers, eta = %eta, "progress"
                );
            }
            None => {}
        }
    }
    if let Some(b) = bar {
        b.finish_and_clear();
    }
}
