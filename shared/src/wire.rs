//! What crosses the network between rank 0 and its workers, seen from the side that must not
//! trust it: the caps on every string a worker sends, a log-safe rendering of such strings,
//! and the protobuf codec whose decode failures are the peer's fault (`INVALID_ARGUMENT`),
//! not ours (`INTERNAL`, tonic's default for a message that does not decode, e.g. a string
//! field holding invalid UTF-8).

use std::borrow::Cow;
use std::fmt::Write as _;
use std::marker::PhantomData;

use tonic::Status;
use tonic::codec::{BufferSettings, Codec, DecodeBuf, Decoder};
use tonic_prost::{ProstDecoder, ProstEncoder};

/// Longest worker name (`host:pid:rank`), in bytes.
pub const MAX_WORKER_NAME_BYTES: usize = 256;
/// Longest device string (`cpu`, `cuda:N`), in bytes.
pub const MAX_DEVICE_BYTES: usize = 64;
/// Longest worker version string, in bytes.
pub const MAX_VERSION_BYTES: usize = 64;
/// Longest model fingerprint id, in bytes (a sha256 plus a few short fields).
pub const MAX_FINGERPRINT_BYTES: usize = 256;
/// Longest run id a worker may name, in bytes.
pub const MAX_RUN_ID_BYTES: usize = 256;
/// Longest session secret a worker may present, in bytes.
pub const MAX_SESSION_BYTES: usize = 64;
/// Longest job error code, in bytes (`[A-Z0-9_]` only).
pub const MAX_ERROR_CODE_BYTES: usize = 64;
/// Longest job error message kept, in characters (longer ones are cut).
pub const MAX_ERROR_MESSAGE_CHARS: usize = 2000;
/// Most lease ids one heartbeat may name.
pub const MAX_HEARTBEAT_LEASES: usize = 1024;
/// Most candidates one rollout job may ask for (all its decodes' seeds together): a ticket's
/// `len(sampler.grid) × sampler.samples_per_decode`. `validate` and the run refuse a config
/// above it, and a worker refuses a job above it before it allocates anything (the Python
/// original sampled 8–16 per ticket).
pub const MAX_CANDIDATES_PER_JOB: usize = 256;
/// Most jobs one lease request may ask for, and so most jobs a worker holds at once
/// (`stageb worker --max-jobs` refuses more; rank 0 caps a larger request at it).
pub const MAX_JOBS_PER_LEASE: u32 = 16;

/// Refuse a string longer than `max` bytes, naming the field (never echoing the value).
pub fn check_len(field: &str, value: &str, max: usize) -> Result<(), Status> {
    if value.len() > max {
        Err(Status::invalid_argument(format!(
            "{field} is {} bytes; at most {max} are accepted",
            value.len()
        )))
    } else {
        Ok(())
    }
}

/// True for a job error code: 1–64 bytes of `A-Z`, `0-9`, `_`.
pub fn is_error_code(code: &str) -> bool {
    !code.is_empty()
        && code.len() <= MAX_ERROR_CODE_BYTES
        && code
            .bytes()
            .all(|b| b.is_ascii_uppercase() || b.is_ascii_digit() || b == b'_')
}

/// A peer's string as it may appear inside one log line: control characters (newlines, ESC,
/// C1 controls), line/paragraph separators and bidi overrides are written as `\u{..}` escapes,
/// so a worker name cannot forge a line or drive the terminal. Borrowed when nothing changes.
pub fn log_safe(s: &str) -> Cow<'_, str> {
    fn unsafe_char(c: char) -> bool {
        c.is_control()
            || matches!(c, '\u{2028}' | '\u{2029}' | '\u{200E}' | '\u{200F}')
            || ('\u{202A}'..='\u{202E}').contains(&c)
            || ('\u{2066}'..='\u{2069}').contains(&c)
    }
    if !s.chars().any(unsafe_char) {
        return Cow::Borrowed(s);
    }
    let mut out = String::with_capacity(s.len() + 8);
    for c in s.chars() {
        if unsafe_char(c) {
            let _ = write!(out, "\\u{{{:x}}}", c as u32);
        } else {
            out.push(c);
        }
    }
    Cow::Owned(out)
}

/// The prost codec with decode failures reported as `INVALID_ARGUMENT` (the generated code
/// uses it through `codec_path`, see `build.rs`).
#[derive(Debug, Clone)]
pub struct EdgeCodec<T, U> {
    _types: PhantomData<(T, U)>,
}

impl<T, U> Default for EdgeCodec<T, U> {
    fn default() -> Self {
        EdgeCodec {
            _types: PhantomData,
        }
    }
}

impl<T, U> Codec for EdgeCodec<T, U>
where
    T: prost::Message + Send + 'static,
    U: prost::Message + Default + Send + 'static,
{
    type Encode = T;
    type Decode = U;
    type Encoder = ProstEncoder<T>;
    type Decoder = EdgeDecoder<U>;

    fn encoder(&mut self) -> Self::Encoder {
        ProstEncoder::new(BufferSettings::default())
    }

    fn decoder(&mut self) -> Self::Decoder {
        EdgeDecoder(ProstDecoder::new(BufferSettings::default()))
    }
}

/// [`ProstDecoder`] whose errors blame the sender.
#[derive(Debug)]
pub struct EdgeDecoder<U>(ProstDecoder<U>);

impl<U: prost::Message + Default> Decoder for EdgeDecoder<U> {
    type Item = U;
    type Error = Status;

    fn decode(&mut self, buf: &mut DecodeBuf<'_>) -> Result<Option<U>, Status> {
        self.0
            .decode(buf)
            .map_err(|e| Status::invalid_argument(format!("malformed message: {}", e.message())))
    }

    fn buffer_settings(&self) -> BufferSettings {
        self.0.buffer_settings()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_safe_escapes_what_could_forge_a_line_or_drive_a_terminal() {
        assert_eq!(log_safe("host:1:0"), "host:1:0");
        assert!(matches!(log_safe("plain"), Cow::Borrowed(_)));
        assert_eq!(
            log_safe("a\nlevel=ERROR forged"),
            "a\\u{a}level=ERROR forged"
        );
        assert_eq!(log_safe("\u{1b}[31mred"), "\\u{1b}[31mred");
        assert_eq!(log_safe("x\u{2028}y\u{202e}z"), "x\\u{2028}y\\u{202e}z");
        assert_eq!(log_safe("\r\u{85}"), "\\u{d}\\u{85}");
    }

    #[test]
    fn error_codes_are_short_upper_snake_case() {
        assert!(is_error_code("PROMPT_TOO_LONG"));
        assert!(is_error_code("E2"));
        assert!(!is_error_code(""));
        assert!(!is_error_code("lower"));
        assert!(!is_error_code("A\nB"));
        assert!(!is_error_code(&"A".repeat(65)));
    }

    #[test]
    fn long_strings_are_refused_without_echoing_them() {
        let status = check_len("name", &"x".repeat(300), MAX_WORKER_NAME_BYTES).unwrap_err();
        assert_eq!(status.code(), tonic::Code::InvalidArgument);
        assert!(!status.message().contains("xxx"));
        assert!(check_len("name", "ok", MAX_WORKER_NAME_BYTES).is_ok());
    }
}
