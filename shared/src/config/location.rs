//! Where a config error is: paths into the YAML document (`sampler.grid[0].top_p`), the line
//! probe that finds a path's line with the same parser (see the `config` module header), and
//! [`Doc`], the document being validated, which turns a path into a located [`InputError`].

use super::types::ConfigNotice;
use crate::error::{ErrorCode, InputError};
use serde::de::{self, DeserializeSeed, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde_norway::Value;
use std::fmt;

/// One step of a path into the YAML document.
#[derive(Debug, Clone)]
pub(super) enum Seg {
    Key(String),
    Index(usize),
}

pub(super) fn dotted(path: &[Seg]) -> String {
    let mut out = String::new();
    for seg in path {
        match seg {
            Seg::Key(key) => {
                if !out.is_empty() {
                    out.push('.');
                }
                out.push_str(key);
            }
            Seg::Index(index) => out.push_str(&format!("[{index}]")),
        }
    }
    out
}

pub(super) fn dotted_with(path: &[Seg], key: &str) -> String {
    let mut full = path.to_vec();
    full.push(Seg::Key(key.to_string()));
    dotted(&full)
}

/// The text a mapping key is matched and shown by (keys that are not strings included).
pub(super) fn key_text(key: &Value) -> String {
    match key {
        Value::String(text) => text.clone(),
        Value::Number(number) => number.to_string(),
        Value::Bool(flag) => flag.to_string(),
        Value::Null => "null".to_string(),
        Value::Sequence(_) | Value::Mapping(_) | Value::Tagged(_) => "<complex key>".to_string(),
    }
}

/// Marker carried by the probe's error; no real serde_norway message contains a NUL.
const PROBE_HIT: &str = "\u{0}stageb-config-probe-hit";

/// The line of a config key (`section.key`) in the config's text, for errors found after
/// parsing (a value the model cannot honour). `None` when the key is not written there.
pub fn key_line(text: &str, dotted_key: &str) -> Option<usize> {
    let path: Vec<Seg> = dotted_key
        .split('.')
        .map(|k| Seg::Key(k.to_string()))
        .collect();
    probe_line(text, &path)
}

/// 1-based line of the node at `path` (the key itself for a key, the item for an index), or
/// `None` when the path cannot be followed in the raw event stream. See the `config` module
/// header, "How lines are found".
fn probe_line(text: &str, path: &[Seg]) -> Option<usize> {
    let deserializer = serde_norway::Deserializer::from_str(text);
    match (Probe { path }).deserialize(deserializer) {
        Ok(()) => None,
        Err(err) if err.to_string().contains(PROBE_HIT) => err.location().map(|loc| loc.line()),
        Err(_) => None,
    }
}

fn probe_hit<E: de::Error>() -> E {
    E::custom(PROBE_HIT)
}

/// Walks to `path`; fails with [`PROBE_HIT`] while deserializing the target node.
struct Probe<'p> {
    path: &'p [Seg],
}

impl Probe<'_> {
    /// A scalar: the target if the path ends here, otherwise the path does not exist.
    fn scalar<E: de::Error>(self) -> Result<(), E> {
        if self.path.is_empty() {
            Err(probe_hit())
        } else {
            Ok(())
        }
    }
}

impl<'de> DeserializeSeed<'de> for Probe<'_> {
    type Value = ();

    fn deserialize<D: de::Deserializer<'de>>(self, deserializer: D) -> Result<(), D::Error> {
        deserializer.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Probe<'_> {
    type Value = ();

    fn expecting(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter.write_str("any YAML node")
    }

    fn visit_bool<E: de::Error>(self, _: bool) -> Result<(), E> {
        self.scalar()
    }
    fn visit_i64<E: de::Error>(self, _: i64) -> Result<(), E> {
        self.scalar()
    }
    fn visit_u64<E: de::Error>(self, _: u64) -> Result<(), E> {
        self.scalar()
    }
    fn visit_i128<E: de::Error>(self, _: i128) -> Result<(), E> {
        self.scalar()
    }
    fn visit_u128<E: de::Error>(self, _: u128) -> Result<(), E> {
        self.scalar()
    }
    fn visit_f64<E: de::Error>(self, _: f64) -> Result<(), E> {
        self.scalar()
    }
    fn visit_str<E: de::Error>(self, _: &str) -> Result<(), E> {
        self.scalar()
    }
    fn visit_unit<E: de::Error>(self) -> Result<(), E> {
        self.scalar()
    }
    fn visit_none<E: de::Error>(self) -> Result<(), E> {
        self.scalar()
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        match self.path.split_first() {
            None => Err(probe_hit()),
            Some((Seg::Index(target), rest)) => {
                let mut index = 0;
                loop {
                    let more = if index == *target {
                        seq.next_element_seed(Probe { path: rest })?.is_some()
                    } else {
                        seq.next_element::<IgnoredAny>()?.is_some()
                    };
                    if !more {
                        return Ok(());
                    }
                    index += 1;
                }
            }
            Some((Seg::Key(_), _)) => {
                while seq.next_element::<IgnoredAny>()?.is_some() {}
                Ok(())
            }
        }
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        match self.path.split_first() {
            None => Err(probe_hit()),
            Some((Seg::Key(target), rest)) => {
                while let Some(matched) = map.next_key_seed(KeyProbe {
                    target,
                    hit_on_match: rest.is_empty(),
                })? {
                    if matched {
                        map.next_value_seed(Probe { path: rest })?;
                    } else {
                        map.next_value::<IgnoredAny>()?;
                    }
                }
                Ok(())
            }
            Some((Seg::Index(_), _)) => {
                while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
                Ok(())
            }
        }
    }
}

/// Deserializes one mapping key: `Ok(true)` when it is the target (and the walk goes on),
/// the marker error when it is the target and the walk ends at this key.
struct KeyProbe<'t> {
    target: &'t str,
    hit_on_match: bool,
}

impl KeyProbe<'_> {
    fn compare<E: de::Error>(self, key: &str) -> Result<bool, E> {
        match (key == self.target, self.hit_on_match) {
            (true, true) => Err(probe_hit()),
            (matched, _) => Ok(matched),
        }
    }
}

impl<'de> DeserializeSeed<'de> for KeyProbe<'_> {
    type Value = bool;

    fn deserialize<D: de::Deserializer<'de>>(self, deserializer: D) -> Result<bool, D::Error> {
        deserializer.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for KeyProbe<'_> {
    type Value = bool;

    fn expecting(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter.write_str("a mapping key")
    }

    fn visit_bool<E: de::Error>(self, key: bool) -> Result<bool, E> {
        self.compare(&key.to_string())
    }
    fn visit_i64<E: de::Error>(self, key: i64) -> Result<bool, E> {
        self.compare(&key.to_string())
    }
    fn visit_u64<E: de::Error>(self, key: u64) -> Result<bool, E> {
        self.compare(&key.to_string())
    }
    fn visit_f64<E: de::Error>(self, key: f64) -> Result<bool, E> {
        self.compare(&serde_norway::Number::from(key).to_string())
    }
    fn visit_str<E: de::Error>(self, key: &str) -> Result<bool, E> {
        self.compare(key)
    }
    fn visit_unit<E: de::Error>(self) -> Result<bool, E> {
        self.compare("null")
    }
    fn visit_none<E: de::Error>(self) -> Result<bool, E> {
        self.compare("null")
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<bool, A::Error> {
        while seq.next_element::<IgnoredAny>()?.is_some() {}
        Ok(false)
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<bool, A::Error> {
        while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
        Ok(false)
    }
}

/// The document being validated: its text (for line probes), label and collected notices.
pub(super) struct Doc<'t> {
    pub(super) text: &'t str,
    pub(super) file: &'t str,
    pub(super) notices: Vec<ConfigNotice>,
}

impl Doc<'_> {
    /// Line of `path`, else of the nearest enclosing node that the probe can find.
    pub(super) fn line_of(&self, path: &[Seg]) -> usize {
        (0..=path.len())
            .rev()
            .find_map(|len| probe_line(self.text, &path[..len]))
            .unwrap_or(1)
            // The scanner places the end of a text without a final newline on the line after
            // it; an error there names the last line the text has.
            .min(self.text.matches('\n').count() + 1)
    }

    pub(super) fn error(
        &self,
        code: ErrorCode,
        path: &[Seg],
        message: impl Into<String>,
    ) -> InputError {
        InputError::new(code, self.file, Some(self.line_of(path)), message)
    }
}
