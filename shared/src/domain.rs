//! Domain types shared by rank 0 and the workers: what a ticket is, what a verdict is, how a
//! candidate is decoded. Protocol messages are converted into these at the edge.

use serde::{Deserialize, Serialize};
use std::fmt;

/// A binary QC verdict. Serialized as the Python original's `"pass"` / `"fail"`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Verdict {
    Pass,
    Fail,
}

impl Verdict {
    pub fn as_str(self) -> &'static str {
        match self {
            Verdict::Pass => "pass",
            Verdict::Fail => "fail",
        }
    }

    /// The Chinese word the rollout contract uses (`通过` / `不通过`).
    pub fn as_chinese(self) -> &'static str {
        match self {
            Verdict::Pass => "通过",
            Verdict::Fail => "不通过",
        }
    }
}

impl fmt::Display for Verdict {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// `{group_id}::{label}`: the identity of a ticket. The same group with both labels (a
/// resubmission) is two tickets.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(transparent)]
pub struct TicketKey(pub String);

impl TicketKey {
    pub fn new(group_id: &str, label: Verdict) -> Self {
        TicketKey(format!("{group_id}::{}", label.as_str()))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for TicketKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// Where a value came from in a user's input file (1-based line).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SourceLocation {
    pub file: String,
    pub line: usize,
}

/// One Stage-A group with its human label.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Ticket {
    pub group_id: String,
    pub mission: String,
    pub label: Verdict,
    /// Per-image summaries keyed `image_{n}`, in ascending `n`.
    pub per_image: Vec<(String, String)>,
    pub images: Vec<String>,
    pub label_source: String,
    pub label_timestamp: Option<String>,
    pub source: SourceLocation,
}

impl Ticket {
    pub fn key(&self) -> TicketKey {
        TicketKey::new(&self.group_id, self.label)
    }
}

/// One entry of `sampler.grid`: how a group of candidates is decoded.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DecodeSpec {
    pub temperature: f32,
    pub top_p: f32,
    pub max_new_tokens: u32,
    pub repetition_penalty: f32,
}

/// How one group of a ticket's candidates is decoded: a `sampler.grid` entry with one seed per
/// sample (sample `i` uses `seeds[i]`). Rank 0 puts it in a job, the worker's engine runs it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct DecodeGroup {
    pub decode_index: u32,
    /// 0 means greedy.
    pub temperature: f32,
    pub top_p: f32,
    pub repetition_penalty: f32,
    pub max_new_tokens: u32,
    pub seeds: Vec<u64>,
}

// The wire form is field for field the same: both ends of the gRPC edge convert through these.
impl From<crate::pb::DecodeSpec> for DecodeGroup {
    fn from(d: crate::pb::DecodeSpec) -> Self {
        DecodeGroup {
            decode_index: d.decode_index,
            temperature: d.temperature,
            top_p: d.top_p,
            repetition_penalty: d.repetition_penalty,
            max_new_tokens: d.max_new_tokens,
            seeds: d.seeds,
        }
    }
}

impl From<DecodeGroup> for crate::pb::DecodeSpec {
    fn from(d: DecodeGroup) -> Self {
        crate::pb::DecodeSpec {
            decode_index: d.decode_index,
            temperature: d.temperature,
            top_p: d.top_p,
            repetition_penalty: d.repetition_penalty,
            max_new_tokens: d.max_new_tokens,
            seeds: d.seeds,
        }
    }
}

/// A chat message handed to a worker; the worker renders it with its model's chat template.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
}

impl ChatMessage {
    pub fn system(content: impl Into<String>) -> Self {
        ChatMessage {
            role: "system".into(),
            content: content.into(),
        }
    }

    pub fn user(content: impl Into<String>) -> Self {
        ChatMessage {
            role: "user".into(),
            content: content.into(),
        }
    }
}
