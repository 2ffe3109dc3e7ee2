//! Shared by the error specs (`config_errors`, `ingest_errors`): the one assertion "this input
//! fails with this code, at this line, saying this".

use stageb_shared::error::{ErrorCode, InputError};

/// Asserts that `err` has `code`, `line` (`None`: an error of the whole file) and every one of
/// `says` in its message.
#[track_caller]
pub fn assert_error(err: &InputError, code: ErrorCode, line: Option<usize>, says: &[&str]) {
    assert_eq!(err.code, code, "{err}");
    assert_eq!(err.line, line, "{err}");
    for part in says {
        assert!(
            err.message.contains(part),
            "message {:?} lacks {part:?}",
            err.message
        );
    }
}
