//! The worker loop (placeholder until the runtime lands).
