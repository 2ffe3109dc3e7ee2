//! Malformed Stage-A input (every bad record is refused with its code and line): one test per
//! case, each asserting the stable code AND the line. Inputs are small files written into a
//! tempdir by each test, so every case states its bytes and why they are wrong right where it
//! is checked.

use crate::support;

use serde_json::json;
use stageb_shared::error::ErrorCode::{
    BadLabel, DuplicateImageKey, DuplicateTicket, EmptyField, EmptyFile, FileNotFound, InvalidUtf8,
    LineTooLong, MissingField, NotAnObject, NotJson, SeveralMissions,
};
use stageb_shared::error::{ErrorCode, InputError};
use stageb_shared::ingest::{MAX_LINE_BYTES, load_tickets};
use std::path::PathBuf;
use support::assert_error;
use tempfile::TempDir;

/// A valid record; tests break one thing about it.
fn record() -> serde_json::Value {
    json!({
        "group_id": "QC-1",
        "mission": "挡风板安装检查",
        "label": "fail",
        "images": ["QC-1_1.jpeg"],
        "per_image": {"image_1": "BBU设备/显示完整，挡风板/未安装"}
    })
}

fn line(value: &serde_json::Value) -> String {
    format!("{value}\n")
}

fn with(key: &str, value: serde_json::Value) -> String {
    let mut rec = record();
    rec[key] = value;
    line(&rec)
}

fn without(key: &str) -> String {
    let mut rec = record();
    rec.as_object_mut().unwrap().remove(key);
    line(&rec)
}

fn write(dir: &TempDir, name: &str, bytes: &[u8]) -> PathBuf {
    let path = dir.path().join(name);
    std::fs::write(&path, bytes).unwrap();
    path
}

/// Ingest one file whose first line is a valid record and whose later lines are `rest`, so
/// every error below is on line 2 or later (a line number of 1 would prove little). It must
/// fail with `code` at `line`, naming the file and saying `says`.
#[track_caller]
fn fails_after_valid_line(
    rest: impl AsRef<[u8]>,
    code: ErrorCode,
    line_no: usize,
    says: &str,
) -> InputError {
    let dir = TempDir::new().unwrap();
    let mut bytes = line(&json!({"group_id": "QC-0", "mission": "挡风板安装检查", "label": "pass", "per_image": {"image_1": "ok"}})).into_bytes();
    bytes.extend_from_slice(rest.as_ref());
    let path = write(&dir, "stage_a.jsonl", &bytes);
    let err = load_tickets(&[path]).expect_err("input must be rejected");
    assert!(
        err.file.ends_with("stage_a.jsonl"),
        "error names the file: {err}"
    );
    assert_error(&err, code, Some(line_no), &[says]);
    err
}

/// Ingesting `paths` fails with `code` at `line` (`None`: the whole file), saying `says`.
#[track_caller]
fn files_fail(paths: &[PathBuf], code: ErrorCode, line: Option<usize>, says: &str) -> InputError {
    let err = load_tickets(paths).expect_err("input must be rejected");
    assert_error(&err, code, line, &[says]);
    err
}

// --- files ---

#[test]
fn missing_file() {
    // A path that does not exist: the original skipped it with a warning.
    let missing = PathBuf::from("/nonexistent/stageb/stage_a.jsonl");
    files_fail(&[missing], FileNotFound, None, "cannot read");
}

#[test]
fn empty_file() {
    // Zero bytes: "0 tickets" is an error, never an empty run.
    let dir = TempDir::new().unwrap();
    files_fail(&[write(&dir, "a.jsonl", b"")], EmptyFile, None, "empty");
}

#[test]
fn file_of_blank_lines_only() {
    // Only newlines (and whitespace): blank lines are skipped, leaving no records.
    let dir = TempDir::new().unwrap();
    files_fail(
        &[write(&dir, "a.jsonl", b"\n\n  \r\n\n")],
        EmptyFile,
        None,
        "no records",
    );
}

#[test]
fn second_file_empty() {
    // Every file must hold records, not just the run as a whole.
    let dir = TempDir::new().unwrap();
    let good = write(&dir, "good.jsonl", line(&record()).as_bytes());
    let empty = write(&dir, "empty.jsonl", b"");
    let err = files_fail(&[good, empty], EmptyFile, None, "empty");
    assert!(err.file.ends_with("empty.jsonl"));
}

#[test]
fn no_files_given() {
    files_fail(&[], EmptyFile, None, "no Stage-A files");
}

// --- bytes and lines ---

#[test]
fn invalid_utf8() {
    // A Latin-1 byte (0xE9) inside a string on line 2: rejected with its byte offset, never
    // decoded lossily.
    let mut rest = br#"{"group_id": "caf"#.to_vec();
    rest.push(0xE9);
    rest.extend_from_slice(
        b"\", \"mission\": \"m\", \"label\": \"pass\", \"per_image\": {\"a\": \"b\"}}\n",
    );
    fails_after_valid_line(rest, InvalidUtf8, 2, "offset 17");
}

#[test]
fn line_longer_than_the_limit() {
    // One byte over MAX_LINE_BYTES (content, not counting the newline), on line 2.
    let mut rest = vec![b' '; MAX_LINE_BYTES + 1];
    rest.push(b'\n');
    fails_after_valid_line(rest, LineTooLong, 2, "longer than 1048576 bytes");
}

#[test]
fn huge_line_without_newline() {
    // 16 MiB with no newline at all: rejected at the limit, the rest never read into memory.
    let rest = vec![b'x'; 16 << 20];
    fails_after_valid_line(rest, LineTooLong, 2, "longer than");
}

#[test]
fn truncated_last_line() {
    // The writer died mid-record: last line has no newline and is cut inside a string.
    fails_after_valid_line(
        r#"{"group_id": "QC-2", "mission": "挡风板安"#,
        NotJson,
        2,
        "not valid JSON at column",
    );
}

#[test]
fn not_json() {
    // Plain text where a record should be (line 3: blank lines still count).
    fails_after_valid_line(b"\nnot json at all\n", NotJson, 3, "not valid JSON");
}

#[test]
fn trailing_garbage_after_the_object() {
    // Two objects on one line: one line is one record.
    let rest = format!("{}{}", line(&record()).trim_end(), line(&record()));
    fails_after_valid_line(rest, NotJson, 2, "trailing characters");
}

#[test]
fn nan_is_not_json() {
    // Python's json.dumps writes NaN/Infinity; they are not JSON.
    let rest = line(&record()).replace(r#""label":"fail""#, r#""label":"fail","score":NaN"#);
    assert!(rest.contains("NaN"));
    fails_after_valid_line(rest, NotJson, 2, "not valid JSON");
}

#[test]
fn infinity_is_not_json() {
    let rest = line(&record()).replace(r#""label":"fail""#, r#""label":"fail","score":Infinity"#);
    fails_after_valid_line(rest, NotJson, 2, "not valid JSON");
}

#[test]
fn deeply_nested_json() {
    // Depth 10 000 in an ignored field: serde_json's recursion limit rejects it; no stack
    // overflow.
    let deep = format!("{}{}", "[".repeat(10_000), "]".repeat(10_000));
    let rest = line(&record()).replace(
        r#""label":"fail""#,
        &format!(r#""label":"fail","deep":{deep}"#),
    );
    fails_after_valid_line(rest, NotJson, 2, "recursion limit");
}

#[test]
fn repeated_field_in_one_object() {
    // `label` twice: serde_json's Value would silently keep the last one.
    let rest = line(&record()).replace(r#""label":"fail""#, r#""label":"fail","label":"pass""#);
    fails_after_valid_line(rest, NotJson, 2, "field `label` appears twice");
}

#[test]
fn not_an_object_array() {
    fails_after_valid_line(b"[]\n", NotAnObject, 2, "got an array");
}

#[test]
fn not_an_object_string() {
    fails_after_valid_line(b"\"x\"\n", NotAnObject, 2, "got a string");
}

#[test]
fn not_an_object_number() {
    fails_after_valid_line(b"42\n", NotAnObject, 2, "got a number");
}

// --- fields ---

#[test]
fn missing_group_id() {
    fails_after_valid_line(without("group_id"), MissingField, 2, "`group_id`");
}

#[test]
fn missing_mission() {
    fails_after_valid_line(without("mission"), MissingField, 2, "`mission`");
}

#[test]
fn missing_label() {
    fails_after_valid_line(without("label"), MissingField, 2, "`label`");
}

#[test]
fn missing_per_image() {
    fails_after_valid_line(without("per_image"), MissingField, 2, "`per_image`");
}

#[test]
fn empty_group_id() {
    fails_after_valid_line(
        with("group_id", json!("  ")),
        EmptyField,
        2,
        "`group_id` must be a non-empty string or an integer",
    );
}

#[test]
fn regression_padded_group_id() {
    // Op evidence and decision ids are resolved trimmed: " QC-1 ::fail" could never be
    // matched, so the padded id is an ingest error instead of a silently unlearnable ticket.
    for padded in [" QC-1", "QC-1 ", "\tQC-1"] {
        fails_after_valid_line(
            with("group_id", json!(padded)),
            EmptyField,
            2,
            "must not start or end with whitespace",
        );
    }
}

#[test]
fn null_group_id() {
    // null is a present field of the wrong type, not an absent one.
    fails_after_valid_line(with("group_id", json!(null)), EmptyField, 2, "got null");
}

#[test]
fn float_group_id() {
    // 1.5 would stringify ambiguously ("1.5" vs "1.50"); only strings and integers are ids.
    fails_after_valid_line(
        with("group_id", json!(1.5)),
        EmptyField,
        2,
        "got number 1.5",
    );
}

#[test]
fn group_id_larger_than_u64() {
    // Numbers beyond 64 bits become floats in serde_json: rejected, not rounded.
    let rest = line(&record()).replace(
        r#""group_id":"QC-1""#,
        r#""group_id":123456789012345678901234567890"#,
    );
    fails_after_valid_line(rest, EmptyField, 2, "`group_id`");
}

#[test]
fn empty_mission() {
    fails_after_valid_line(
        with("mission", json!("")),
        EmptyField,
        2,
        "`mission` must be a non-empty string",
    );
}

#[test]
fn mission_of_the_wrong_type() {
    fails_after_valid_line(
        with("mission", json!(["挡风板安装检查"])),
        EmptyField,
        2,
        "got an array",
    );
}

#[test]
fn label_in_chinese() {
    // The directory names (审核通过) or verdict words are not labels.
    fails_after_valid_line(with("label", json!("通过")), BadLabel, 2, "\"通过\"");
}

#[test]
fn label_unknown_word() {
    fails_after_valid_line(
        with("label", json!("need-review")),
        BadLabel,
        2,
        "must be \"pass\" or \"fail\"",
    );
}

#[test]
fn label_null() {
    fails_after_valid_line(with("label", json!(null)), BadLabel, 2, "got null");
}

#[test]
fn label_number() {
    fails_after_valid_line(with("label", json!(1)), BadLabel, 2, "got number 1");
}

#[test]
fn per_image_empty_object() {
    fails_after_valid_line(
        with("per_image", json!({})),
        EmptyField,
        2,
        "got an empty object",
    );
}

#[test]
fn per_image_not_an_object() {
    fails_after_valid_line(
        with("per_image", json!("image_1: ok")),
        EmptyField,
        2,
        "`per_image` must be a non-empty object, got a string",
    );
}

#[test]
fn per_image_value_not_a_string() {
    fails_after_valid_line(
        with("per_image", json!({"image_1": "ok", "image_2": 7})),
        EmptyField,
        2,
        "`per_image.image_2` must be a string",
    );
}

#[test]
fn per_image_keys_with_the_same_index() {
    // `image_1` and `photo01` both normalize to image_1: the original kept one silently.
    fails_after_valid_line(
        with("per_image", json!({"image_1": "a", "photo01": "b"})),
        DuplicateImageKey,
        2,
        "both map to `image_1`",
    );
}

#[test]
fn per_image_position_colliding_with_an_index() {
    // `front` has no digits, so it takes its position (1), which `image_1` also claims.
    fails_after_valid_line(
        with("per_image", json!({"front": "a", "image_1": "b"})),
        DuplicateImageKey,
        2,
        "`image_1`",
    );
}

#[test]
fn per_image_same_raw_key_twice() {
    // The same key twice in the JSON object (serde_json's Value would keep the last).
    let rest = line(&record()).replace(
        r#""per_image":{"image_1":"BBU设备/显示完整，挡风板/未安装"}"#,
        r#""per_image":{"image_1":"a","image_1":"b"}"#,
    );
    assert!(rest.contains(r#""image_1":"b""#), "test setup");
    fails_after_valid_line(rest, DuplicateImageKey, 2, "twice");
}

#[test]
fn images_not_a_list() {
    fails_after_valid_line(
        with("images", json!("QC-1_1.jpeg")),
        EmptyField,
        2,
        "`images` must be a list of strings",
    );
}

#[test]
fn label_source_of_the_wrong_type() {
    fails_after_valid_line(
        with("label_source", json!(true)),
        EmptyField,
        2,
        "`label_source`",
    );
}

// --- across records ---

#[test]
fn duplicate_ticket_in_one_file() {
    // The valid first line is QC-0::pass; lines 2 and 4 are both QC-1::fail.
    let rest = format!(
        "{}{}{}",
        line(&record()),
        with("group_id", json!("QC-9")),
        line(&record())
    );
    let err = fails_after_valid_line(
        rest,
        DuplicateTicket,
        4,
        "`QC-1::fail` already appeared at ",
    );
    assert!(
        err.message.contains("stage_a.jsonl:2;"),
        "names the first occurrence: {}",
        err.message
    );
}

#[test]
fn duplicate_ticket_across_files() {
    let dir = TempDir::new().unwrap();
    let first = write(&dir, "a.jsonl", line(&record()).as_bytes());
    let second = write(
        &dir,
        "b.jsonl",
        format!("{}{}", with("group_id", json!("QC-2")), line(&record())).as_bytes(),
    );
    let err = files_fail(&[first, second], DuplicateTicket, Some(2), "a.jsonl:1;");
    assert!(err.file.ends_with("b.jsonl"));
}

#[test]
fn integer_and_string_group_id_are_the_same_ticket() {
    // 7 is stringified to "7": the same key as "7".
    let rest = format!(
        "{}{}",
        with("group_id", json!(7)),
        with("group_id", json!("7"))
    );
    fails_after_valid_line(rest, DuplicateTicket, 3, "`7::fail`");
}

#[test]
fn several_missions_in_one_file() {
    let err = fails_after_valid_line(
        with("mission", json!("BBU接地线检查")),
        SeveralMissions,
        2,
        "\"挡风板安装检查\" (first at ",
    );
    assert!(err.message.contains("\"BBU接地线检查\""), "{}", err.message);
}

#[test]
fn several_missions_across_files() {
    let dir = TempDir::new().unwrap();
    let first = write(&dir, "a.jsonl", line(&record()).as_bytes());
    let other = format!("\n{}", with("mission", json!("BBU接地线检查")));
    let second = write(&dir, "b.jsonl", other.as_bytes());
    let err = files_fail(&[first, second], SeveralMissions, Some(2), "a.jsonl:1");
    assert!(err.file.ends_with("b.jsonl"));
}

/// Regression: 10 million tiny records grew `validate` to 3 GB before it was killed.
/// The record after the input budget's last ticket is refused at its line, so memory stays
/// bounded by the budget whatever the file holds.
#[test]
fn ten_million_tiny_records_stop_at_the_ticket_budget_not_at_the_memory_limit() {
    use stageb_shared::budget::MAX_TICKETS;
    let dir = TempDir::new().unwrap();
    let mut text = String::with_capacity((MAX_TICKETS + 2) * 96);
    for i in 0..MAX_TICKETS + 2 {
        text.push_str(&format!(
            "{{\"group_id\":\"G{i}\",\"mission\":\"m\",\"label\":\"pass\",\"per_image\":{{\"1\":\"x\"}}}}\n"
        ));
    }
    let path = write(&dir, "huge.jsonl", text.as_bytes());
    let err = load_tickets(&[path]).unwrap_err();
    assert_eq!(err.code, ErrorCode::InputBudget);
    assert_eq!(err.code.code(), "E_INPUT_BUDGET");
    assert_eq!(err.line, Some(MAX_TICKETS + 1));
    assert!(err.file.ends_with("huge.jsonl"), "{err:?}");
    assert!(err.message.contains("at most that many"), "{}", err.message);
}
