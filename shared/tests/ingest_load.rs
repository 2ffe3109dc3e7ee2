//! Valid Stage-A input: what tickets look like after ingest, and a property test that no
//! byte sequence makes the reader panic.

use proptest::prelude::*;
use serde_json::json;
use stageb_shared::digest::sha256_hex;
use stageb_shared::domain::{SourceLocation, TicketKey, Verdict};
use stageb_shared::ingest::{Ingested, MAX_LINE_BYTES, load_tickets};
use std::path::PathBuf;
use tempfile::TempDir;

fn write(dir: &TempDir, name: &str, bytes: &[u8]) -> PathBuf {
    let path = dir.path().join(name);
    std::fs::write(&path, bytes).unwrap();
    path
}

fn ingest_one(bytes: &[u8]) -> Ingested {
    let dir = TempDir::new().unwrap();
    let path = write(&dir, "stage_a.jsonl", bytes);
    load_tickets(&[path]).unwrap_or_else(|err| panic!("should ingest: {err}"))
}

#[test]
fn the_reference_example_record() {
    let text = r#"{"group_id": "QC-TEMP-20241206-0015502", "mission": "挡风板安装检查", "label": "fail", "images": ["QC-TEMP-20241206-0015502_4348975.jpeg"], "per_image": {"image_1": "BBU设备/华为/显示完整/这个BBU设备未按要求配备挡风板×2，备注: 无法判断品牌"}}"#;
    let ingested = ingest_one(format!("{text}\n").as_bytes());
    assert_eq!(ingested.mission, "挡风板安装检查");
    let ticket = &ingested.tickets[0];
    assert_eq!(
        ticket.key(),
        TicketKey("QC-TEMP-20241206-0015502::fail".into())
    );
    assert_eq!(ticket.label, Verdict::Fail);
    assert_eq!(
        ticket.images,
        vec!["QC-TEMP-20241206-0015502_4348975.jpeg".to_string()]
    );
    assert_eq!(ticket.per_image[0].0, "image_1");
    assert!(ticket.per_image[0].1.starts_with("BBU设备/华为"));
    assert_eq!(ticket.label_source, "human", "default label_source");
    assert_eq!(ticket.label_timestamp, None);
    assert_eq!(ticket.source.line, 1);
}

#[test]
fn same_group_with_both_labels_is_two_tickets() {
    // A resubmission: the group was rejected, fixed, then approved.
    let text = concat!(
        r#"{"group_id": "QC-7", "mission": "m", "label": "fail", "per_image": {"image_1": "挡风板/未安装"}}"#,
        "\n",
        r#"{"group_id": "QC-7", "mission": "m", "label": "pass", "per_image": {"image_1": "挡风板/安装方向正确"}}"#,
        "\n"
    );
    let ingested = ingest_one(text.as_bytes());
    let keys: Vec<String> = ingested
        .tickets
        .iter()
        .map(|ticket| ticket.key().0)
        .collect();
    assert_eq!(keys, vec!["QC-7::fail", "QC-7::pass"]);
}

#[test]
fn per_image_keys_normalize_and_sort_numerically() {
    // `image_10` after `image_2` (numeric, not lexicographic); `photo03` → image_3; leading
    // zeros dropped; a key without digits takes its 1-based position (`overview`, 5th).
    let record = json!({
        "group_id": "QC-1", "mission": "m", "label": "pass",
        "per_image": {"image_10": "ten", "image_2": "two", "photo03": "three", "img_1": "one", "overview": "five"}
    });
    let ingested = ingest_one(format!("{record}\n").as_bytes());
    let per_image: Vec<(&str, &str)> = ingested.tickets[0]
        .per_image
        .iter()
        .map(|(key, value)| (key.as_str(), value.as_str()))
        .collect();
    assert_eq!(
        per_image,
        vec![
            ("image_1", "one"),
            ("image_2", "two"),
            ("image_3", "three"),
            ("image_5", "five"),
            ("image_10", "ten")
        ]
    );
}

#[test]
fn per_image_index_of_any_length_orders_correctly() {
    let record = json!({
        "group_id": "QC-1", "mission": "m", "label": "pass",
        "per_image": {"image_100000000000000000000": "big", "image_99999999999999999999": "smaller"}
    });
    let ingested = ingest_one(format!("{record}\n").as_bytes());
    let keys: Vec<&str> = ingested.tickets[0]
        .per_image
        .iter()
        .map(|(key, _)| key.as_str())
        .collect();
    assert_eq!(
        keys,
        vec!["image_99999999999999999999", "image_100000000000000000000"]
    );
}

#[test]
fn json_encoded_summaries_are_unwrapped() {
    // An object string → its values joined with "，"; a JSON string → its content; text that
    // merely starts like JSON stays as written.
    let record = json!({
        "group_id": "QC-1", "mission": "m", "label": "pass",
        "per_image": {
            "image_1": r#"{"BBU设备": "显示完整", "挡风板": "安装方向正确", "count": 2}"#,
            "image_2": r#""螺丝/符合要求""#,
            "image_3": "{not json",
            "image_4": "plain"
        }
    });
    let ingested = ingest_one(format!("{record}\n").as_bytes());
    let values: Vec<&str> = ingested.tickets[0]
        .per_image
        .iter()
        .map(|(_, value)| value.as_str())
        .collect();
    assert_eq!(
        values,
        vec![
            "显示完整，安装方向正确，2",
            "螺丝/符合要求",
            "{not json",
            "plain"
        ]
    );
}

#[test]
fn bom_and_crlf_are_accepted() {
    let mut bytes = b"\xEF\xBB\xBF".to_vec();
    bytes.extend_from_slice(
        concat!(
            r#"{"group_id": "A", "mission": "m", "label": "PASS ", "per_image": {"image_1": "x"}}"#,
            "\r\n\r\n",
            r#"{"group_id": "B", "mission": "m", "label": "Fail", "per_image": {"image_1": "y"}}"#,
            "\r\n"
        )
        .as_bytes(),
    );
    let ingested = ingest_one(&bytes);
    assert_eq!(ingested.tickets.len(), 2);
    assert_eq!(
        ingested.tickets[0].label,
        Verdict::Pass,
        "labels are trimmed and lowercased"
    );
    assert_eq!(ingested.tickets[1].label, Verdict::Fail);
    assert_eq!(ingested.tickets[1].source.line, 3, "blank lines count");
    assert_eq!(ingested.tickets[1].per_image[0].1, "y", "no stray \\r");
}

#[test]
fn line_of_exactly_the_limit_is_accepted_also_with_crlf() {
    let head = r#"{"group_id": "A", "mission": "m", "label": "pass", "per_image": {"image_1": ""#;
    let tail = r#""}}"#;
    let summary = "x".repeat(MAX_LINE_BYTES - head.len() - tail.len());
    let line = format!("{head}{summary}{tail}");
    assert_eq!(line.len(), MAX_LINE_BYTES);
    let ingested = ingest_one(format!("{line}\r\n").as_bytes());
    assert_eq!(ingested.tickets[0].per_image[0].1.len(), summary.len());
}

#[test]
fn optional_fields_and_integer_group_ids() {
    let record = json!({
        "group_id": 15502, "mission": "m", "label": "fail",
        "per_image": {"image_1": "x"},
        "label_source": "auditor", "label_timestamp": "2024-12-06T10:00:00+08:00",
        "images": null,
        "stage_a_model": "qwen3-vl-8b"
    });
    let ticket = ingest_one(format!("{record}\n").as_bytes())
        .tickets
        .remove(0);
    assert_eq!(ticket.group_id, "15502");
    assert_eq!(ticket.label_source, "auditor");
    assert_eq!(
        ticket.label_timestamp.as_deref(),
        Some("2024-12-06T10:00:00+08:00")
    );
    assert!(ticket.images.is_empty(), "null images is no images");
}

#[test]
fn files_in_order_with_digests() {
    let dir = TempDir::new().unwrap();
    let first_bytes = concat!(
        r#"{"group_id": "A", "mission": "m", "label": "pass", "per_image": {"image_1": "x"}}"#,
        "\n\n",
        r#"{"group_id": "B", "mission": "m", "label": "fail", "per_image": {"image_1": "x"}}"#,
        "\n"
    );
    let second_bytes =
        r#"{"group_id": "A", "mission": "m", "label": "fail", "per_image": {"image_1": "x"}}"#;
    let first = write(&dir, "a.jsonl", first_bytes.as_bytes());
    let second = write(&dir, "b.jsonl", second_bytes.as_bytes());
    let ingested = load_tickets(&[first.clone(), second.clone()]).unwrap();

    let order: Vec<(String, SourceLocation)> = ingested
        .tickets
        .iter()
        .map(|ticket| (ticket.key().0, ticket.source.clone()))
        .collect();
    let at = |path: &PathBuf, line| SourceLocation {
        file: path.display().to_string(),
        line,
    };
    assert_eq!(
        order,
        vec![
            ("A::pass".to_string(), at(&first, 1)),
            ("B::fail".to_string(), at(&first, 3)),
            ("A::fail".to_string(), at(&second, 1)),
        ]
    );
    assert_eq!(ingested.input_digests.len(), 2);
    assert_eq!(ingested.input_digests[0].path, first);
    assert_eq!(
        ingested.input_digests[0].sha256,
        sha256_hex(first_bytes.as_bytes())
    );
    assert_eq!(ingested.input_digests[0].records, 2);
    assert_eq!(
        ingested.input_digests[1].sha256,
        sha256_hex(second_bytes.as_bytes())
    );
    assert_eq!(ingested.input_digests[1].records, 1);
}

#[test]
fn ticket_round_trips_through_json() {
    let record = json!({"group_id": "QC-1", "mission": "m", "label": "fail", "per_image": {"image_2": "b", "image_1": "a"}});
    let ticket = ingest_one(format!("{record}\n").as_bytes())
        .tickets
        .remove(0);
    let back: stageb_shared::domain::Ticket =
        serde_json::from_str(&serde_json::to_string(&ticket).unwrap()).unwrap();
    assert_eq!(back, ticket);
}

/// Lines assembled from JSON-ish fragments reach deeper into record validation than
/// uniformly random bytes do.
fn jsonish_line() -> impl Strategy<Value = String> {
    let fragment = prop_oneof![
        Just("{".to_string()),
        Just("}".to_string()),
        Just("[".to_string()),
        Just("]".to_string()),
        Just(",".to_string()),
        Just(":".to_string()),
        Just("\"group_id\"".to_string()),
        Just("\"mission\"".to_string()),
        Just("\"label\"".to_string()),
        Just("\"per_image\"".to_string()),
        Just("\"images\"".to_string()),
        Just("\"pass\"".to_string()),
        Just("\"fail\"".to_string()),
        Just("\"image_1\"".to_string()),
        Just("\"x1\"".to_string()),
        Just("\"{\\\"a\\\": 1}\"".to_string()),
        Just("null".to_string()),
        Just("7".to_string()),
        Just("1e400".to_string()),
        Just("\r".to_string()),
        Just("\u{feff}".to_string()),
        "[ -~]{0,8}".prop_map(|text| text),
    ];
    prop::collection::vec(fragment, 0..40).prop_map(|parts| parts.concat())
}

proptest! {
    #[test]
    fn arbitrary_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..2048)) {
        let dir = TempDir::new().unwrap();
        let path = write(&dir, "fuzz.jsonl", &bytes);
        let _ = load_tickets(&[path]);
    }

    #[test]
    fn jsonish_lines_never_panic_and_errors_are_located(lines in prop::collection::vec(jsonish_line(), 1..6)) {
        let dir = TempDir::new().unwrap();
        let path = write(&dir, "fuzz.jsonl", lines.join("\n").as_bytes());
        if let Err(err) = load_tickets(&[path]) {
            // Every line-level error names a line within the file.
            if let Some(line) = err.line {
                prop_assert!(line >= 1 && line <= lines.len(), "{}", err);
            }
        }
    }
}
