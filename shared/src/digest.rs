//! Canonical JSON and sha256 digests.
//!
//! Decisions and inputs are digested so `stageb audit` can recompute them. Canonical JSON here
//! means: object keys sorted (byte order), no insignificant whitespace, serde_json's number
//! and string encoding. Timestamps must be left out by the caller.

use serde::Serialize;
use serde_json::Value;
use sha2::{Digest, Sha256};

/// Serialize `value` as canonical JSON (sorted keys, compact).
pub fn canonical_json<T: Serialize + ?Sized>(value: &T) -> String {
    let v = serde_json::to_value(value).expect("serializing an in-memory value cannot fail");
    let mut out = String::new();
    write_canonical(&v, &mut out);
    out
}

fn write_canonical(v: &Value, out: &mut String) {
    match v {
        Value::Object(map) => {
            let mut keys: Vec<&String> = map.keys().collect();
            keys.sort();
            out.push('{');
            for (i, k) in keys.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                out.push_str(&serde_json::to_string(k).expect("string"));
                out.push(':');
                write_canonical(&map[k.as_str()], out);
            }
            out.push('}');
        }
        Value::Array(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                write_canonical(item, out);
            }
            out.push(']');
        }
        other => out.push_str(&serde_json::to_string(other).expect("scalar")),
    }
}

/// Lowercase hex sha256 of bytes.
pub fn sha256_hex(bytes: &[u8]) -> String {
    hex::encode(Sha256::digest(bytes))
}

/// `sha256(canonical_json(value))`, prefixed `sha256:` as stored in artifacts.
pub fn digest_of<T: Serialize + ?Sized>(value: &T) -> String {
    format!("sha256:{}", sha256_hex(canonical_json(value).as_bytes()))
}

/// sha256 of a file's bytes, streamed.
pub fn sha256_file(path: &std::path::Path) -> std::io::Result<String> {
    use std::io::Read;
    let mut file = std::fs::File::open(path)?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = file.read(&mut buf)?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
    }
    Ok(hex::encode(hasher.finalize()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn canonical_json_sorts_keys_at_every_depth() {
        let a = json!({"b": 1, "a": {"d": [1, {"z": 0, "y": 1}], "c": "x"}});
        assert_eq!(
            canonical_json(&a),
            r#"{"a":{"c":"x","d":[1,{"y":1,"z":0}]},"b":1}"#
        );
    }

    #[test]
    fn digest_is_independent_of_key_order() {
        let a = json!({"x": 1, "y": "通过"});
        let b = json!({"y": "通过", "x": 1});
        assert_eq!(digest_of(&a), digest_of(&b));
        assert!(digest_of(&a).starts_with("sha256:"));
    }
}
