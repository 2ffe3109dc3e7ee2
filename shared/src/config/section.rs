//! Typed access to one mapping of the document: required/optional/nullable integers, floats
//! with their range rules, booleans, strings, paths and nested sections, each failure an
//! [`InputError`] located at the key.

use super::location::{Doc, Seg, dotted};
use crate::error::{ErrorCode, InputError};
use serde_norway::{Mapping, Value};
use std::path::PathBuf;

/// A mapping at a known path, with typed accessors that report located errors.
pub(super) struct Section<'v> {
    pub(super) path: Vec<Seg>,
    pub(super) map: &'v Mapping,
}

/// Range rules for floats.
#[derive(Clone, Copy)]
pub(super) enum FloatRule {
    /// ≥ 0.
    NonNegative,
    /// > 0.
    Positive,
    /// In [0, 1].
    UnitClosed,
    /// In (0, 1].
    UnitOpenBelow,
}

impl FloatRule {
    fn admits(self, value: f64) -> bool {
        match self {
            FloatRule::NonNegative => value >= 0.0,
            FloatRule::Positive => value > 0.0,
            FloatRule::UnitClosed => (0.0..=1.0).contains(&value),
            FloatRule::UnitOpenBelow => value > 0.0 && value <= 1.0,
        }
    }

    fn describe(self) -> &'static str {
        match self {
            FloatRule::NonNegative => "a number >= 0",
            FloatRule::Positive => "a number > 0",
            FloatRule::UnitClosed => "a number between 0 and 1",
            FloatRule::UnitOpenBelow => "a number > 0 and <= 1",
        }
    }
}

/// How a value was written, for error messages.
pub(super) fn describe(value: &Value) -> String {
    match value {
        Value::Null => "null".to_string(),
        Value::Bool(flag) => format!("boolean {flag}"),
        Value::Number(number) if number.is_f64() => format!("float {number}"),
        Value::Number(number) => format!("integer {number}"),
        Value::String(text) => format!("string {text:?}"),
        Value::Sequence(_) => "a list".to_string(),
        Value::Mapping(_) => "a mapping".to_string(),
        Value::Tagged(tagged) => format!("a value tagged {}", tagged.tag),
    }
}

impl<'v> Section<'v> {
    pub(super) fn key_path(&self, key: &str) -> Vec<Seg> {
        let mut path = self.path.clone();
        path.push(Seg::Key(key.to_string()));
        path
    }

    pub(super) fn name(&self, key: &str) -> String {
        dotted(&self.key_path(key))
    }

    pub(super) fn get(&self, key: &str) -> Option<&'v Value> {
        self.map.get(key)
    }

    pub(super) fn missing(&self, doc: &Doc, key: &str) -> InputError {
        let container = if self.path.is_empty() {
            "the config".to_string()
        } else {
            format!("`{}`", dotted(&self.path))
        };
        doc.error(
            ErrorCode::MissingConfigKey,
            &self.path,
            format!("missing required key `{}` in {container}", self.name(key)),
        )
    }

    pub(super) fn invalid(&self, doc: &Doc, key: &str, message: String) -> InputError {
        doc.error(
            ErrorCode::InvalidConfigValue,
            &self.key_path(key),
            format!("`{}` {message}", self.name(key)),
        )
    }

    pub(super) fn required(&self, doc: &Doc, key: &str) -> Result<&'v Value, InputError> {
        self.get(key).ok_or_else(|| self.missing(doc, key))
    }

    /// An integer in `[min, max]`.
    pub(super) fn int_value(
        &self,
        doc: &Doc,
        key: &str,
        value: &Value,
        min: u64,
        max: u64,
    ) -> Result<u64, InputError> {
        let out_of_range = || {
            let bound = if max == u64::from(u32::MAX) || max == u64::MAX {
                format!("an integer >= {min}")
            } else {
                format!("an integer between {min} and {max}")
            };
            self.invalid(
                doc,
                key,
                format!("must be {bound}, got {}", describe(value)),
            )
        };
        match value {
            Value::Number(number) if !number.is_f64() => match number.as_u64() {
                Some(parsed) if (min..=max).contains(&parsed) => Ok(parsed),
                _ => Err(out_of_range()),
            },
            other => Err(self.invalid(
                doc,
                key,
                format!("must be an integer, got {}", describe(other)),
            )),
        }
    }

    pub(super) fn req_u32(&self, doc: &Doc, key: &str, min: u32) -> Result<u32, InputError> {
        let value = self.required(doc, key)?;
        self.int_value(doc, key, value, u64::from(min), u64::from(u32::MAX))
            .map(narrow_u32)
    }

    pub(super) fn opt_u32(
        &self,
        doc: &Doc,
        key: &str,
        default: u32,
        min: u32,
    ) -> Result<u32, InputError> {
        match self.get(key) {
            None => Ok(default),
            Some(value) => self
                .int_value(doc, key, value, u64::from(min), u64::from(u32::MAX))
                .map(narrow_u32),
        }
    }

    /// Nullable integer (`null` or absent → `None`).
    pub(super) fn nullable_u32(
        &self,
        doc: &Doc,
        key: &str,
        min: u32,
    ) -> Result<Option<u32>, InputError> {
        match self.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(value) => self
                .int_value(doc, key, value, u64::from(min), u64::from(u32::MAX))
                .map(|v| Some(narrow_u32(v))),
        }
    }

    pub(super) fn opt_u64(
        &self,
        doc: &Doc,
        key: &str,
        default: u64,
        min: u64,
    ) -> Result<u64, InputError> {
        match self.get(key) {
            None => Ok(default),
            Some(value) => self.int_value(doc, key, value, min, u64::MAX),
        }
    }

    pub(super) fn float_value(
        &self,
        doc: &Doc,
        key: &str,
        value: &Value,
        rule: FloatRule,
    ) -> Result<f64, InputError> {
        let parsed = match value {
            Value::Number(number) => number.as_f64(),
            _ => None,
        };
        match parsed {
            Some(parsed) if parsed.is_finite() && rule.admits(parsed) => Ok(parsed),
            Some(_) => Err(self.invalid(
                doc,
                key,
                format!("must be {}, got {}", rule.describe(), describe(value)),
            )),
            None => Err(self.invalid(
                doc,
                key,
                format!("must be a number, got {}", describe(value)),
            )),
        }
    }

    pub(super) fn req_float(
        &self,
        doc: &Doc,
        key: &str,
        rule: FloatRule,
    ) -> Result<f64, InputError> {
        let value = self.required(doc, key)?;
        self.float_value(doc, key, value, rule)
    }

    pub(super) fn opt_float(
        &self,
        doc: &Doc,
        key: &str,
        default: f64,
        rule: FloatRule,
    ) -> Result<f64, InputError> {
        match self.get(key) {
            None => Ok(default),
            Some(value) => self.float_value(doc, key, value, rule),
        }
    }

    pub(super) fn opt_bool(&self, doc: &Doc, key: &str, default: bool) -> Result<bool, InputError> {
        match self.get(key) {
            None => Ok(default),
            Some(Value::Bool(flag)) => Ok(*flag),
            Some(other) => Err(self.invalid(
                doc,
                key,
                format!("must be true or false, got {}", describe(other)),
            )),
        }
    }

    pub(super) fn string_value(
        &self,
        doc: &Doc,
        key: &str,
        value: &Value,
    ) -> Result<String, InputError> {
        match value {
            Value::String(text) if !text.trim().is_empty() => Ok(text.clone()),
            Value::String(_) => Err(self.invalid(doc, key, "must not be empty".to_string())),
            other => Err(self.invalid(
                doc,
                key,
                format!("must be a string, got {}", describe(other)),
            )),
        }
    }

    pub(super) fn req_string(&self, doc: &Doc, key: &str) -> Result<String, InputError> {
        let value = self.required(doc, key)?;
        self.string_value(doc, key, value)
    }

    /// Optional path (`null` or absent → `None`).
    pub(super) fn nullable_path(
        &self,
        doc: &Doc,
        key: &str,
    ) -> Result<Option<PathBuf>, InputError> {
        match self.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(value) => self
                .string_value(doc, key, value)
                .map(|text| Some(PathBuf::from(text))),
        }
    }

    /// A nested section. `Ok(None)` when absent or `null`.
    pub(super) fn section(&self, doc: &Doc, key: &str) -> Result<Option<Section<'v>>, InputError> {
        match self.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::Mapping(map)) => Ok(Some(Section {
                path: self.key_path(key),
                map,
            })),
            Some(other) => Err(self.invalid(
                doc,
                key,
                format!("must be a mapping of keys, got {}", describe(other)),
            )),
        }
    }

    pub(super) fn req_section(&self, doc: &Doc, key: &str) -> Result<Section<'v>, InputError> {
        self.section(doc, key)?
            .ok_or_else(|| self.missing(doc, key))
    }
}

/// Values were range-checked against `u32::MAX` before narrowing.
fn narrow_u32(value: u64) -> u32 {
    u32::try_from(value).unwrap_or(u32::MAX)
}
