//! The fuzz targets' invariant checks ([`checks`]), shared with the stable corpus replay.

pub mod checks;

pub use checks::support::{fresh_dir, line_count, scratch, split_parts};
