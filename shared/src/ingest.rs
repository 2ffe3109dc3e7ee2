//! Stage-A JSONL → tickets, strictly: every bad line is a located, coded, fatal error.
//!
//! This module owns reading the Stage-A summary files a run starts from. The Python original
//! logged and skipped bad records, merged colliding `per_image` keys and kept exact duplicate
//! tickets (whose per-key state then collided, bug B8). Here a file either ingests cleanly or
//! the run does not start, with the file, the 1-based line and a stable [`ErrorCode`].
//!
//! # Record rules (the reference's Stage-A input format)
//! Each non-blank line is one JSON object:
//! - `group_id`: non-empty string without leading/trailing whitespace (op evidence and
//!   decision ids are resolved trimmed, so a padded id could never match), or an integer
//!   (stringified).
//! - `mission`: non-empty string. All records of all files share one mission.
//! - `label`: trimmed and lowercased, must be `pass` or `fail`; anything else (including
//!   `null`, numbers, `通过`) is [`ErrorCode::BadLabel`].
//! - `per_image`: non-empty object of strings. A value that is itself a JSON object string
//!   becomes its values joined with `，`; a JSON string value is unwrapped. Keys become
//!   `image_{n}`, `n` being the raw key's trailing ASCII integer (leading zeros dropped) or,
//!   without one, the entry's 1-based position; entries are sorted by `n`. Two raw keys with
//!   the same `n`, or the same raw key twice, is [`ErrorCode::DuplicateImageKey`].
//! - optional `images` (list of strings), `label_source` (string; absent, null or empty →
//!   `"human"`), `label_timestamp` (string, kept as written). Other fields are accepted and
//!   ignored (logged once).
//!
//! `null` for a required field counts as present but of the wrong type
//! ([`ErrorCode::EmptyField`]); for an optional one it means absent. A field named twice in
//! one object is rejected ([`ErrorCode::NotJson`]): `serde_json::Value` would keep the last
//! silently. `{group_id}::{label}` must be unique over all files
//! ([`ErrorCode::DuplicateTicket`]); the same group with both labels is two tickets.
//!
//! # Reading
//! Files are read as bytes, line by line, through a bounded reader: a line longer than
//! [`MAX_LINE_BYTES`] is rejected as soon as the limit is passed, so a huge line is never
//! held in memory. Lines are decoded as strict UTF-8 (never lossily). A UTF-8 BOM at the
//! start of a file and CRLF line endings are accepted. Each file's sha256 is computed over
//! the same bytes while reading. Every file must hold at least one record.

use crate::domain::{SourceLocation, Ticket, TicketKey, Verdict};
use crate::error::{ErrorCode, InputError};
use serde::Serialize;
use serde::de::{self, DeserializeSeed, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde_json::Value;
use sha2::{Digest, Sha256};
use std::collections::{BTreeSet, HashMap, HashSet};
use std::fmt;
use std::fs::File;
use std::io::{self, BufRead, BufReader};
use std::path::{Path, PathBuf};

/// Longest accepted line, in bytes, not counting the line terminator.
pub const MAX_LINE_BYTES: usize = 1 << 20;

/// What a run records about each input file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct InputDigest {
    /// As given.
    pub path: PathBuf,
    /// Lowercase hex sha256 of the file's bytes.
    pub sha256: String,
    /// Records (non-blank lines) in the file.
    pub records: usize,
}

/// The tickets of one run.
#[derive(Debug, Clone, PartialEq)]
pub struct Ingested {
    pub mission: String,
    /// Files in the order given, records in line order.
    pub tickets: Vec<Ticket>,
    /// One per input file, in the order given.
    pub input_digests: Vec<InputDigest>,
}

/// Read all Stage-A files into tickets. See the module header for the rules.
pub fn load_tickets(paths: &[PathBuf]) -> Result<Ingested, InputError> {
    if paths.is_empty() {
        return Err(InputError::new(
            ErrorCode::EmptyFile,
            "<stage_a_paths>",
            None,
            "no Stage-A files were given",
        ));
    }
    let mut run = RunIngest::default();
    let mut input_digests = Vec::with_capacity(paths.len());
    for path in paths {
        input_digests.push(ingest_file(path, &mut run)?);
    }
    if !run.ignored_fields.is_empty() {
        tracing::info!(
            fields = ?run.ignored_fields,
            "Stage-A records carry fields stageb does not use; they are ignored"
        );
    }
    let mission = run.mission.map(|(mission, _)| mission).unwrap_or_default();
    Ok(Ingested {
        mission,
        tickets: run.tickets,
        input_digests,
    })
}

/// State across all files of a run.
#[derive(Default)]
struct RunIngest {
    /// The run's mission and where it was first seen.
    mission: Option<(String, SourceLocation)>,
    first_seen: HashMap<TicketKey, SourceLocation>,
    tickets: Vec<Ticket>,
    ignored_fields: BTreeSet<String>,
}

fn ingest_file(path: &Path, run: &mut RunIngest) -> Result<InputDigest, InputError> {
    let file_label = path.display().to_string();
    let unreadable = |err: io::Error| {
        InputError::new(
            ErrorCode::FileNotFound,
            &file_label,
            None,
            format!("cannot read Stage-A file: {err}"),
        )
    };
    let file = File::open(path).map_err(unreadable)?;
    let mut reader = BufReader::with_capacity(64 * 1024, file);
    let mut hasher = Sha256::new();
    let mut line_bytes = Vec::new();
    let mut line_number = 0usize;
    let mut records = 0usize;
    loop {
        let outcome =
            read_bounded_line(&mut reader, &mut line_bytes, &mut hasher).map_err(unreadable)?;
        if outcome == LineRead::Eof {
            break;
        }
        line_number += 1;
        let at = |code: ErrorCode, message: String| {
            InputError::new(code, &file_label, Some(line_number), message)
        };
        if line_bytes.last() == Some(&b'\r') {
            line_bytes.pop();
        }
        if outcome == LineRead::TooLong || line_bytes.len() > MAX_LINE_BYTES {
            return Err(at(
                ErrorCode::LineTooLong,
                format!("line is longer than {MAX_LINE_BYTES} bytes"),
            ));
        }
        let mut content = line_bytes.as_slice();
        if line_number == 1 {
            content = content.strip_prefix(b"\xEF\xBB\xBF").unwrap_or(content);
        }
        let text = std::str::from_utf8(content).map_err(|err| {
            at(
                ErrorCode::InvalidUtf8,
                format!(
                    "line is not valid UTF-8 (first bad byte at offset {})",
                    err.valid_up_to()
                ),
            )
        })?;
        if text.trim().is_empty() {
            continue;
        }
        let location = SourceLocation {
            file: file_label.clone(),
            line: line_number,
        };
        let parsed = parse_record(text, location).map_err(|(code, message)| at(code, message))?;
        run.admit(parsed)?;
        records += 1;
    }
    if records == 0 {
        let message = if line_number == 0 {
            "file is empty"
        } else {
            "file has no records (only blank lines)"
        };
        return Err(InputError::new(
            ErrorCode::EmptyFile,
            &file_label,
            None,
            message,
        ));
    }
    Ok(InputDigest {
        path: path.to_path_buf(),
        sha256: hex::encode(hasher.finalize()),
        records,
    })
}

impl RunIngest {
    /// Cross-record checks (one mission, unique keys), then keep the ticket.
    fn admit(&mut self, parsed: ParsedRecord) -> Result<(), InputError> {
        let ParsedRecord {
            ticket,
            unknown_fields,
        } = parsed;
        let here = ticket.source.clone();
        match &self.mission {
            None => self.mission = Some((ticket.mission.clone(), here.clone())),
            Some((mission, first)) if *mission != ticket.mission => {
                return Err(InputError::new(
                    ErrorCode::SeveralMissions,
                    &here.file,
                    Some(here.line),
                    format!(
                        "records of two missions: {mission:?} (first at {}:{}) and {:?}; a run has exactly one mission",
                        first.file, first.line, ticket.mission
                    ),
                ));
            }
            Some(_) => {}
        }
        if self.tickets.len() >= crate::budget::MAX_TICKETS {
            return Err(InputError::new(
                ErrorCode::InputBudget,
                &here.file,
                Some(here.line),
                format!(
                    "more than {} tickets: a run accepts at most that many (split the mission into several runs)",
                    crate::budget::MAX_TICKETS
                ),
            ));
        }
        let key = ticket.key();
        if let Some(first) = self.first_seen.get(&key) {
            return Err(InputError::new(
                ErrorCode::DuplicateTicket,
                &here.file,
                Some(here.line),
                format!(
                    "ticket `{key}` already appeared at {}:{}; each (group_id, label) pair must appear once",
                    first.file, first.line
                ),
            ));
        }
        self.first_seen.insert(key, here);
        self.ignored_fields.extend(unknown_fields);
        self.tickets.push(ticket);
        Ok(())
    }
}

// ---------------------------------------------------------------------------------------------
// Bounded line reader
// ---------------------------------------------------------------------------------------------

#[derive(Debug, PartialEq, Eq)]
enum LineRead {
    /// A line (without its `\n`) is in the buffer.
    Line,
    /// The line passed the limit; reading stopped there.
    TooLong,
    /// No bytes left.
    Eof,
}

/// Reads one `\n`-terminated line (or the unterminated last one) into `line`, hashing the
/// bytes consumed. Stops with [`LineRead::TooLong`] before the buffer would grow past
/// `MAX_LINE_BYTES + 1` (the extra byte is a CRLF's `\r`, removed by the caller).
fn read_bounded_line<R: BufRead>(
    reader: &mut R,
    line: &mut Vec<u8>,
    hasher: &mut Sha256,
) -> io::Result<LineRead> {
    line.clear();
    let mut read_any = false;
    loop {
        let chunk = match reader.fill_buf() {
            Ok(chunk) => chunk,
            Err(err) if err.kind() == io::ErrorKind::Interrupted => continue,
            Err(err) => return Err(err),
        };
        if chunk.is_empty() {
            return Ok(if read_any {
                LineRead::Line
            } else {
                LineRead::Eof
            });
        }
        read_any = true;
        let (content_len, consumed, complete) = match chunk.iter().position(|&byte| byte == b'\n') {
            Some(newline) => (newline, newline + 1, true),
            None => (chunk.len(), chunk.len(), false),
        };
        if line.len() + content_len > MAX_LINE_BYTES + 1 {
            return Ok(LineRead::TooLong);
        }
        line.extend_from_slice(&chunk[..content_len]);
        hasher.update(&chunk[..consumed]);
        reader.consume(consumed);
        if complete {
            return Ok(LineRead::Line);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// One record
// ---------------------------------------------------------------------------------------------

const KNOWN_FIELDS: [&str; 7] = [
    "group_id",
    "mission",
    "label",
    "per_image",
    "images",
    "label_source",
    "label_timestamp",
];

type RecordError = (ErrorCode, String);

/// A valid record: its ticket and the names of the fields stageb does not use.
struct ParsedRecord {
    ticket: Ticket,
    unknown_fields: Vec<String>,
}

fn parse_record(text: &str, source: SourceLocation) -> Result<ParsedRecord, RecordError> {
    let record = read_object(text)?;
    // Fields are checked in this order, so a record with several problems reports the first.
    let ticket = Ticket {
        group_id: parse_group_id(&record)?,
        mission: parse_mission(&record)?,
        label: parse_label(&record)?,
        per_image: parse_per_image(&record)?,
        images: parse_images(&record)?,
        label_source: optional_text(&record, "label_source")?
            .unwrap_or_else(|| "human".to_string()),
        label_timestamp: optional_text(&record, "label_timestamp")?,
        source,
    };
    let unknown_fields = record
        .fields
        .iter()
        .map(|(name, _)| name.clone())
        .filter(|name| !KNOWN_FIELDS.contains(&name.as_str()))
        .collect();
    Ok(ParsedRecord {
        ticket,
        unknown_fields,
    })
}

/// The line as one JSON object whose fields each appear once.
fn read_object(text: &str) -> Result<RawRecord, RecordError> {
    let record = match serde_json::from_str::<TopLevel>(text) {
        Ok(TopLevel::Object(record)) => record,
        Ok(TopLevel::Other(kind)) => {
            return Err((
                ErrorCode::NotAnObject,
                format!("a record must be a JSON object, got {kind}"),
            ));
        }
        Err(err) => return Err((ErrorCode::NotJson, json_error_message(&err))),
    };
    if let Some(field) = &record.repeated_field {
        return Err((
            ErrorCode::NotJson,
            format!("field `{field}` appears twice in the object"),
        ));
    }
    Ok(record)
}

/// `group_id`: a non-empty, unpadded string or an integer (kept as its decimal text).
fn parse_group_id(record: &RawRecord) -> Result<String, RecordError> {
    match record.field("group_id")? {
        // A padded id would be a different ticket key than the one a model (or a person)
        // writes back, which is trimmed: refused here rather than silently never matching.
        Value::String(text) if !text.trim().is_empty() && text.trim() != text => Err((
            ErrorCode::EmptyField,
            format!("`group_id` must not start or end with whitespace, got {text:?}"),
        )),
        Value::String(text) if !text.trim().is_empty() => Ok(text.clone()),
        Value::Number(number) if number.is_i64() || number.is_u64() => Ok(number.to_string()),
        other => Err(empty_field(
            "group_id",
            "a non-empty string or an integer",
            other,
        )),
    }
}

fn parse_mission(record: &RawRecord) -> Result<String, RecordError> {
    match record.field("mission")? {
        Value::String(text) if !text.trim().is_empty() => Ok(text.clone()),
        other => Err(empty_field("mission", "a non-empty string", other)),
    }
}

/// `label`: `pass` or `fail`, any case, surrounding spaces ignored.
fn parse_label(record: &RawRecord) -> Result<Verdict, RecordError> {
    match record.field("label")? {
        Value::String(text) => match text.trim().to_lowercase().as_str() {
            "pass" => Ok(Verdict::Pass),
            "fail" => Ok(Verdict::Fail),
            _ => Err((
                ErrorCode::BadLabel,
                format!("`label` must be \"pass\" or \"fail\", got {text:?}"),
            )),
        },
        other => Err((
            ErrorCode::BadLabel,
            format!(
                "`label` must be \"pass\" or \"fail\", got {}",
                describe(other)
            ),
        )),
    }
}

fn parse_per_image(record: &RawRecord) -> Result<Vec<(String, String)>, RecordError> {
    match &record.per_image {
        None => Err((
            ErrorCode::MissingField,
            "missing required field `per_image`".to_string(),
        )),
        Some(PerImage::NotObject(kind)) => Err((
            ErrorCode::EmptyField,
            format!("`per_image` must be a non-empty object, got {kind}"),
        )),
        Some(PerImage::Entries(entries)) => normalize_per_image(entries),
    }
}

/// `images`: optional list of strings (absent or `null`: none).
fn parse_images(record: &RawRecord) -> Result<Vec<String>, RecordError> {
    match record.optional("images") {
        None => Ok(Vec::new()),
        Some(Value::Array(items)) => items
            .iter()
            .map(|item| match item {
                Value::String(name) => Ok(name.clone()),
                other => Err(empty_field("images[]", "a string", other)),
            })
            .collect(),
        Some(other) => Err(empty_field("images", "a list of strings", other)),
    }
}

/// An optional string field; absent, `null` or blank is `None`.
fn optional_text(record: &RawRecord, name: &str) -> Result<Option<String>, RecordError> {
    match record.optional(name) {
        None => Ok(None),
        Some(Value::String(text)) if text.trim().is_empty() => Ok(None),
        Some(Value::String(text)) => Ok(Some(text.clone())),
        Some(other) => Err(empty_field(name, "a string", other)),
    }
}

fn empty_field(name: &str, expected: &str, got: &Value) -> RecordError {
    (
        ErrorCode::EmptyField,
        format!("`{name}` must be {expected}, got {}", describe(got)),
    )
}

fn describe(value: &Value) -> String {
    match value {
        Value::Null => "null".to_string(),
        Value::Bool(flag) => format!("boolean {flag}"),
        Value::Number(number) => format!("number {number}"),
        Value::String(text) if text.trim().is_empty() => "an empty string".to_string(),
        Value::String(text) => format!("string {text:?}"),
        Value::Array(_) => "an array".to_string(),
        Value::Object(_) => "an object".to_string(),
    }
}

/// serde_json's message without its "at line 1 column N" (the line is the file's, reported
/// separately), with the column kept.
fn json_error_message(err: &serde_json::Error) -> String {
    let full = err.to_string();
    let suffix = format!(" at line {} column {}", err.line(), err.column());
    let reason = full.strip_suffix(&suffix).unwrap_or(&full);
    format!("not valid JSON at column {}: {reason}", err.column())
}

/// `per_image` entries → `(image_{n}, summary)` sorted by `n`.
fn normalize_per_image(entries: &[(String, Value)]) -> Result<Vec<(String, String)>, RecordError> {
    if entries.is_empty() {
        return Err((
            ErrorCode::EmptyField,
            "`per_image` must be a non-empty object, got an empty object".to_string(),
        ));
    }
    let mut raw_keys = HashSet::new();
    // (index digits without leading zeros, raw key, summary)
    let mut indexed: Vec<(String, &str, String)> = Vec::with_capacity(entries.len());
    for (position, (raw_key, value)) in entries.iter().enumerate() {
        if !raw_keys.insert(raw_key.as_str()) {
            return Err((
                ErrorCode::DuplicateImageKey,
                format!("`per_image` has the key {raw_key:?} twice"),
            ));
        }
        let Value::String(raw_summary) = value else {
            return Err(empty_field(
                &format!("per_image.{raw_key}"),
                "a string",
                value,
            ));
        };
        indexed.push((
            image_index(raw_key, position + 1),
            raw_key,
            unwrap_summary(raw_summary),
        ));
    }
    // Numeric order on decimal strings of any length: shorter is smaller, then by digits.
    indexed.sort_by(|(a, _, _), (b, _, _)| a.len().cmp(&b.len()).then_with(|| a.cmp(b)));
    if let Some(pair) = indexed.windows(2).find(|pair| pair[0].0 == pair[1].0) {
        return Err((
            ErrorCode::DuplicateImageKey,
            format!(
                "`per_image` keys {:?} and {:?} both map to `image_{}`",
                pair[0].1, pair[1].1, pair[0].0
            ),
        ));
    }
    Ok(indexed
        .into_iter()
        .map(|(index, _, summary)| (format!("image_{index}"), summary))
        .collect())
}

/// The trailing ASCII integer of `raw_key` as decimal digits without leading zeros (kept as
/// text so any length orders correctly), else the 1-based position.
fn image_index(raw_key: &str, position: usize) -> String {
    let digits_start = raw_key.trim_end_matches(|c: char| c.is_ascii_digit()).len();
    let digits = &raw_key[digits_start..];
    if digits.is_empty() {
        return position.to_string();
    }
    let significant = digits.trim_start_matches('0');
    if significant.is_empty() {
        "0".to_string()
    } else {
        significant.to_string()
    }
}

/// A summary that is itself JSON: an object string becomes its values joined with `，`
/// (strings as-is, other values as JSON text); a string is unwrapped. Otherwise unchanged.
fn unwrap_summary(raw: &str) -> String {
    let trimmed = raw.trim_start();
    if trimmed.starts_with('{') || trimmed.starts_with('"') {
        match serde_json::from_str::<Value>(raw) {
            Ok(Value::Object(map)) => {
                return map
                    .values()
                    .map(|value| match value {
                        Value::String(text) => text.clone(),
                        other => other.to_string(),
                    })
                    .collect::<Vec<_>>()
                    .join("，");
            }
            Ok(Value::String(inner)) => return inner,
            _ => {}
        }
    }
    raw.to_string()
}

// ---------------------------------------------------------------------------------------------
// Parsing a line without merging keys
// ---------------------------------------------------------------------------------------------

/// One line's top-level JSON value. Objects are read field by field so that a repeated
/// field and repeated `per_image` keys are seen; anything else only needs its kind.
enum TopLevel {
    Object(RawRecord),
    Other(&'static str),
}

struct RawRecord {
    /// Fields other than `per_image`, in order (a repeated one once, see `repeated_field`).
    fields: Vec<(String, Value)>,
    per_image: Option<PerImage>,
    repeated_field: Option<String>,
}

enum PerImage {
    /// Entries in order, repeated keys kept.
    Entries(Vec<(String, Value)>),
    NotObject(&'static str),
}

impl RawRecord {
    fn optional(&self, name: &str) -> Option<&Value> {
        self.fields
            .iter()
            .find(|(field, _)| field == name)
            .map(|(_, value)| value)
            .filter(|value| !value.is_null())
    }

    fn field(&self, name: &str) -> Result<&Value, RecordError> {
        self.fields
            .iter()
            .find(|(field, _)| field == name)
            .map(|(_, value)| value)
            .ok_or_else(|| {
                (
                    ErrorCode::MissingField,
                    format!("missing required field `{name}`"),
                )
            })
    }
}

impl<'de> de::Deserialize<'de> for TopLevel {
    fn deserialize<D: de::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_any(TopLevelVisitor)
    }
}

struct TopLevelVisitor;

impl<'de> Visitor<'de> for TopLevelVisitor {
    type Value = TopLevel;

    fn expecting(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter.write_str("a JSON value")
    }

    fn visit_bool<E: de::Error>(self, _: bool) -> Result<TopLevel, E> {
        Ok(TopLevel::Other("a boolean"))
    }
    fn visit_i64<E: de::Error>(self, _: i64) -> Result<TopLevel, E> {
        Ok(TopLevel::Other("a number"))
    }
    fn visit_u64<E: de::Error>(self, _: u64) -> Result<TopLevel, E> {
        Ok(TopLevel::Other("a number"))
    }
    fn visit_f64<E: de::Error>(self, _: f64) -> Result<TopLevel, E> {
        Ok(TopLevel::Other("a number"))
    }
    fn visit_str<E: de::Error>(self, _: &str) -> Result<TopLevel, E> {
        Ok(TopLevel::Other("a string"))
    }
    fn visit_unit<E: de::Error>(self) -> Result<TopLevel, E> {
        Ok(TopLevel::Other("null"))
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<TopLevel, A::Error> {
        while seq.next_element::<IgnoredAny>()?.is_some() {}
        Ok(TopLevel::Other("an array"))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<TopLevel, A::Error> {
        let mut record = RawRecord {
            fields: Vec::new(),
            per_image: None,
            repeated_field: None,
        };
        let mut seen = HashSet::new();
        while let Some(name) = map.next_key::<String>()? {
            if !seen.insert(name.clone()) {
                record.repeated_field.get_or_insert_with(|| name.clone());
                map.next_value::<IgnoredAny>()?;
            } else if name == "per_image" {
                record.per_image = Some(map.next_value_seed(PerImageSeed)?);
            } else {
                let value = map.next_value::<Value>()?;
                record.fields.push((name, value));
            }
        }
        Ok(TopLevel::Object(record))
    }
}

struct PerImageSeed;

impl<'de> DeserializeSeed<'de> for PerImageSeed {
    type Value = PerImage;

    fn deserialize<D: de::Deserializer<'de>>(self, deserializer: D) -> Result<PerImage, D::Error> {
        deserializer.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for PerImageSeed {
    type Value = PerImage;

    fn expecting(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter.write_str("a JSON value")
    }

    fn visit_bool<E: de::Error>(self, _: bool) -> Result<PerImage, E> {
        Ok(PerImage::NotObject("a boolean"))
    }
    fn visit_i64<E: de::Error>(self, _: i64) -> Result<PerImage, E> {
        Ok(PerImage::NotObject("a number"))
    }
    fn visit_u64<E: de::Error>(self, _: u64) -> Result<PerImage, E> {
        Ok(PerImage::NotObject("a number"))
    }
    fn visit_f64<E: de::Error>(self, _: f64) -> Result<PerImage, E> {
        Ok(PerImage::NotObject("a number"))
    }
    fn visit_str<E: de::Error>(self, _: &str) -> Result<PerImage, E> {
        Ok(PerImage::NotObject("a string"))
    }
    fn visit_unit<E: de::Error>(self) -> Result<PerImage, E> {
        Ok(PerImage::NotObject("null"))
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<PerImage, A::Error> {
        while seq.next_element::<IgnoredAny>()?.is_some() {}
        Ok(PerImage::NotObject("an array"))
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<PerImage, A::Error> {
        let mut entries = Vec::new();
        while let Some(entry) = map.next_entry::<String, Value>()? {
            entries.push(entry);
        }
        Ok(PerImage::Entries(entries))
    }
}
