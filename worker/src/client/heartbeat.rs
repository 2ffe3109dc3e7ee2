//! Heartbeats beside the job loop: they keep the leases in hand alive and report each one's
//! progress (from a batching engine: the forward steps its job has been through, the tokens it
//! decoded, its rows finished and its prompt tokens prefilled), and carry rank 0's word back.
//! A fenced lease cancels its job at the next decode step; a lease revoked for making no
//! progress is counted, and the session takes no new job until its engine gives one back (an
//! engine that looks hung should not be handed more); `STOP` cancels every job in hand,
//! `DRAIN` lets them finish.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use stageb_shared::pb;

use super::{Client, Session, SessionShared};
use crate::engine::CancelFlag;

/// Starts the session's heartbeat task.
pub(super) fn spawn_heartbeat(
    mut client: Client,
    session: &Session,
    shared: Arc<SessionShared>,
) -> tokio::task::JoinHandle<()> {
    let session_id = session.id.clone();
    let every = session.heartbeat;
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(every);
        loop {
            tick.tick().await;
            let (lease_ids, progress) = in_hand(&shared);
            let response = client
                .heartbeat(pb::HeartbeatRequest {
                    session: session_id.clone(),
                    lease_ids,
                    jobs_done: shared.finished.load(Ordering::Relaxed),
                    progress,
                })
                .await;
            let Ok(response) = response.map(|r| r.into_inner()) else {
                continue;
            };
            take_word(&shared, &response);
        }
    })
}

/// The leases in hand, and the progress of those whose engine counts it.
fn in_hand(shared: &SessionShared) -> (Vec<u64>, Vec<pb::LeaseProgress>) {
    let held = shared.held();
    let ids = held.keys().copied().collect();
    let progress = held
        .iter()
        .filter_map(|(id, h)| {
            h.progress.as_ref().map(|count| {
                let p = count.get();
                pb::LeaseProgress {
                    lease_id: *id,
                    steps: p.steps,
                    tokens: p.tokens,
                    rows_finished: p.rows_finished,
                    prompt_done: p.prompt_done,
                }
            })
        })
        .collect();
    (ids, progress)
}

/// Acts on a heartbeat answer: control, fenced and revoked leases.
fn take_word(shared: &SessionShared, response: &pb::HeartbeatResponse) {
    let control = pb::Control::try_from(response.control).unwrap_or(pb::Control::Continue);
    shared.note_control(control);
    let held = shared.held();
    for id in &response.fenced_lease_ids {
        let Some(h) = held.get(id) else { continue };
        if h.cancel.is_cancelled() {
            continue;
        }
        if response.revoked_lease_ids.contains(id) {
            tracing::warn!(
                lease = id,
                "rank 0 revoked a lease in hand: its job made no progress; abandoning it"
            );
            shared.revoked.fetch_add(1, Ordering::Relaxed);
            shared.stuck.store(true, Ordering::Relaxed);
        } else {
            tracing::warn!(
                lease = id,
                "rank 0 fenced a lease in hand: abandoning its job"
            );
        }
        h.cancel.cancel();
    }
    if control == pb::Control::Stop {
        held.values()
            .map(|h| &h.cancel)
            .for_each(CancelFlag::cancel);
    }
}
