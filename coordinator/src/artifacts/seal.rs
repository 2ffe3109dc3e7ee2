//! Keyed seals over what rank 0 writes, so an edit made afterwards is found: by `--resume`
//! before it trusts a file, and by `stageb audit` always.
//!
//! - **The key**: 32 random bytes, hex, in `integrity/key` inside the run directory (0600, the
//!   directory 0700), made when a run starts fresh and kept by every resume.
//! - **JSONL artifacts** (`trajectories.jsonl`, `selections.jsonl`, `reflection.jsonl`, …):
//!   the writer keeps an HMAC-SHA256 over the file's bytes from its start; at every sync (step
//!   boundaries, reflection cycles, the end) it writes `integrity/<file>.seal` (atomic:
//!   `{"bytes": n, "hmac": "…"}`), the seal of the first `n` bytes.
//! - **Journal rows** (`jobs.jsonl`, replayed on resume): each row carries its own `mac`, over
//!   the row's bytes without it, so a row is verified on its own, synced or not.
//!
//! What it protects against: an answer, candidate text, selection explanation or reflection
//! output edited (by hand or by a tool) after rank 0 wrote it, rows copied in from another run
//! (another key), rows removed or reordered, bit rot. What not: anyone who can read the key
//! (it sits beside the artifacts; keep the run directory as private as the token), and what
//! rank 0 itself was told (a forged answer from a worker holding the token is checked by the
//! result checks, not here). Seals live under `integrity/`, outside the compared artifacts:
//! the key differs per run, the artifacts do not.

use std::fs;
use std::io;
use std::path::{Path, PathBuf};

use hmac::{Hmac, Mac};
use serde::{Deserialize, Serialize};
use sha2::Sha256;

type HmacSha256 = Hmac<Sha256>;

/// The directory, inside the run directory, that holds the key and the seals.
pub const INTEGRITY_DIR: &str = "integrity";
const KEY_FILE: &str = "key";

/// A run's sealing key.
#[derive(Clone)]
pub struct SealKey(Vec<u8>);

impl std::fmt::Debug for SealKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SealKey(..)")
    }
}

impl SealKey {
    fn mac(&self) -> HmacSha256 {
        // An HMAC takes a key of any length.
        HmacSha256::new_from_slice(&self.0).expect("HMAC accepts any key length")
    }

    /// The hex HMAC of `bytes`.
    pub fn hmac_hex(&self, bytes: &[u8]) -> String {
        let mut m = self.mac();
        m.update(bytes);
        hex::encode(m.finalize().into_bytes())
    }
}

/// Makes a new key for `run_dir` (a fresh start), replacing any earlier one.
pub fn create_key(run_dir: &Path) -> io::Result<SealKey> {
    let dir = run_dir.join(INTEGRITY_DIR);
    if dir.exists() {
        fs::remove_dir_all(&dir)?;
    }
    fs::create_dir_all(&dir)?;
    let bytes: Vec<u8> = uuid::Uuid::new_v4()
        .as_bytes()
        .iter()
        .chain(uuid::Uuid::new_v4().as_bytes())
        .copied()
        .collect();
    let path = dir.join(KEY_FILE);
    let mut options = fs::OpenOptions::new();
    options.write(true).create_new(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
        options.mode(0o600);
        fs::set_permissions(&dir, fs::Permissions::from_mode(0o700))?;
    }
    io::Write::write_all(&mut options.open(&path)?, hex::encode(&bytes).as_bytes())?;
    Ok(SealKey(bytes))
}

/// The key of the run directory `run_dir`, if it has one (runs from before seals have none).
pub fn key_for(run_dir: &Path) -> io::Result<Option<SealKey>> {
    let path = run_dir.join(INTEGRITY_DIR).join(KEY_FILE);
    match fs::read_to_string(&path) {
        Ok(text) => hex::decode(text.trim())
            .map(|k| Some(SealKey(k)))
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidData, "integrity/key is not hex")),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e),
    }
}

/// What `integrity/<file>.seal` holds.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Seal {
    /// Bytes of the file the seal covers, from its start.
    pub bytes: u64,
    pub hmac: String,
}

fn seal_path(file: &Path) -> Option<PathBuf> {
    let dir = file.parent()?;
    let name = file.file_name()?.to_string_lossy();
    Some(dir.join(INTEGRITY_DIR).join(format!("{name}.seal")))
}

/// The running seal of one JSONL file, kept by its writer.
pub struct Sealer {
    mac: HmacSha256,
    seal: PathBuf,
}

impl Sealer {
    /// A sealer for `file` if its run directory has a key, over `existing` (the bytes already
    /// in the file, for a writer that continues it).
    pub fn for_file(file: &Path, existing: &[u8]) -> io::Result<Option<Sealer>> {
        let (Some(dir), Some(seal)) = (file.parent(), seal_path(file)) else {
            return Ok(None);
        };
        let Some(key) = key_for(dir)? else {
            return Ok(None);
        };
        let mut mac = key.mac();
        mac.update(existing);
        Ok(Some(Sealer { mac, seal }))
    }

    pub fn update(&mut self, bytes: &[u8]) {
        self.mac.update(bytes);
    }

    /// Writes the seal of everything written so far (`bytes` long).
    pub fn write(&self, bytes: u64) -> io::Result<()> {
        let hmac = hex::encode(self.mac.clone().finalize().into_bytes());
        super::write_json_atomic(&self.seal, &Seal { bytes, hmac })
    }
}

/// Seal the first `len` bytes of `file` (when its run has a key), before the file is cut back
/// to them: a crash between the cut and the writer's next sync then leaves a seal that covers
/// what the file holds, never more (which a resume would refuse as `Short`). Streamed.
pub fn seal_prefix(file: &Path, len: u64) -> io::Result<()> {
    let Some(mut sealer) = Sealer::for_file(file, b"")? else {
        return Ok(());
    };
    let mut reader = io::Read::take(fs::File::open(file)?, len);
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = io::Read::read(&mut reader, &mut buf)?;
        if n == 0 {
            break;
        }
        sealer.update(&buf[..n]);
    }
    sealer.write(len)
}

/// Why a file failed its seal.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SealError {
    #[error("{file} has no seal (integrity/{file}.seal) although the run has a key")]
    Missing { file: String },
    #[error("{file} holds {have} bytes, fewer than the {sealed} its seal covers")]
    Short {
        file: String,
        have: u64,
        sealed: u64,
    },
    #[error(
        "{file} was changed after rank 0 wrote it: its first {sealed} bytes do not match their seal"
    )]
    Mismatch { file: String, sealed: u64 },
    #[error("{file}: {reason}")]
    Unreadable { file: String, reason: String },
}

/// Checks `file` (a JSONL artifact of `run_dir`) against its seal. `Ok(None)`: the run has no
/// key (made before seals). `Ok(Some(n))`: the first `n` bytes are as rank 0 wrote them
/// (bytes after them were written after the last sync).
pub fn verify_file(run_dir: &Path, name: &str) -> Result<Option<u64>, SealError> {
    let unreadable = |e: io::Error| SealError::Unreadable {
        file: name.to_string(),
        reason: e.to_string(),
    };
    let Some(key) = key_for(run_dir).map_err(unreadable)? else {
        return Ok(None);
    };
    let file = run_dir.join(name);
    let seal_file = seal_path(&file).ok_or_else(|| SealError::Missing {
        file: name.to_string(),
    })?;
    let seal: Seal = match fs::read(&seal_file) {
        Ok(b) => serde_json::from_slice(&b).map_err(|e| SealError::Unreadable {
            file: name.to_string(),
            reason: format!("its seal is not JSON: {e}"),
        })?,
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            return Err(SealError::Missing {
                file: name.to_string(),
            });
        }
        Err(e) => return Err(unreadable(e)),
    };
    let have = fs::metadata(&file).map_err(unreadable)?.len();
    if have < seal.bytes {
        return Err(SealError::Short {
            file: name.to_string(),
            have,
            sealed: seal.bytes,
        });
    }
    // Streamed: a large run's files are never held in memory (the audit streams its rows too).
    let mut mac = key.mac();
    let mut reader = io::Read::take(fs::File::open(&file).map_err(unreadable)?, seal.bytes);
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = io::Read::read(&mut reader, &mut buf).map_err(unreadable)?;
        if n == 0 {
            break;
        }
        mac.update(&buf[..n]);
    }
    if hex::encode(mac.finalize().into_bytes()) != seal.hmac {
        return Err(SealError::Mismatch {
            file: name.to_string(),
            sealed: seal.bytes,
        });
    }
    Ok(Some(seal.bytes))
}

/// The JSONL files of `run_dir` that have a seal or should (every top-level `*.jsonl`).
pub fn sealed_files(run_dir: &Path) -> io::Result<Vec<String>> {
    let mut names: Vec<String> = fs::read_dir(run_dir)?
        .filter_map(|e| e.ok())
        .filter(|e| e.file_type().is_ok_and(|t| t.is_file()))
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".jsonl"))
        .collect();
    names.sort();
    Ok(names)
}

/// `row` (one JSON object, no newline) with a `mac` over its bytes appended as its last field.
pub fn with_row_mac(key: &SealKey, row: &[u8]) -> Vec<u8> {
    let mac = key.hmac_hex(row);
    let mut out = row[..row.len() - 1].to_vec();
    out.extend_from_slice(format!(",\"mac\":\"{mac}\"}}").as_bytes());
    out
}

/// The row without its `mac` if the mac matches, else `None` (a row without one included).
pub fn check_row_mac(key: &SealKey, line: &str) -> Option<String> {
    let cut = line.rfind(",\"mac\":\"")?;
    let mac = line[cut + 8..].strip_suffix("\"}")?;
    let row = format!("{}}}", &line[..cut]);
    (key.hmac_hex(row.as_bytes()) == mac).then_some(row)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_row_mac_verifies_its_row_and_nothing_else() {
        let dir = tempfile::tempdir().unwrap();
        let key = create_key(dir.path()).unwrap();
        let row = br#"{"digest":"sha256:a","output":{"text":"Verdict: pass"}}"#;
        let sealed = String::from_utf8(with_row_mac(&key, row)).unwrap();
        assert_eq!(
            check_row_mac(&key, &sealed).as_deref(),
            Some(std::str::from_utf8(row).unwrap())
        );
        let edited = sealed.replace("pass", "fail");
        assert_eq!(check_row_mac(&key, &edited), None);
        let other = create_key(tempfile::tempdir().unwrap().path()).unwrap();
        assert_eq!(check_row_mac(&other, &sealed), None);
        assert_eq!(check_row_mac(&key, std::str::from_utf8(row).unwrap()), None);
    }

    #[test]
    fn a_file_edited_after_its_seal_fails_and_a_tail_after_it_is_reported() {
        let dir = tempfile::tempdir().unwrap();
        create_key(dir.path()).unwrap();
        let file = dir.path().join("a.jsonl");
        fs::write(&file, b"{\"x\":1}\n").unwrap();
        let mut s = Sealer::for_file(&file, b"").unwrap().unwrap();
        s.update(b"{\"x\":1}\n");
        s.write(8).unwrap();
        assert_eq!(verify_file(dir.path(), "a.jsonl"), Ok(Some(8)));
        fs::write(&file, b"{\"x\":1}\n{\"x\":2}\n").unwrap();
        assert_eq!(verify_file(dir.path(), "a.jsonl"), Ok(Some(8)));
        fs::write(&file, b"{\"x\":7}\n").unwrap();
        assert!(matches!(
            verify_file(dir.path(), "a.jsonl"),
            Err(SealError::Mismatch { .. })
        ));
        assert!(matches!(
            verify_file(dir.path(), "b.jsonl"),
            Err(SealError::Missing { .. })
        ));
    }

    #[test]
    fn regression_a_file_cut_back_after_resealing_its_prefix_passes_its_seal() {
        // A resumed rank 0 cut a file back to its checkpoint and was killed before the file's
        // next sync: the seal of the longer file stayed, and no later resume could pass it.
        let dir = tempfile::tempdir().unwrap();
        create_key(dir.path()).unwrap();
        let file = dir.path().join("a.jsonl");
        fs::write(&file, b"{\"x\":1}\n{\"x\":2}\n").unwrap();
        seal_prefix(&file, 16).unwrap();
        assert_eq!(verify_file(dir.path(), "a.jsonl"), Ok(Some(16)));
        seal_prefix(&file, 8).unwrap();
        // Before the cut the longer file still passes (its prefix is sealed), and after it too.
        assert_eq!(verify_file(dir.path(), "a.jsonl"), Ok(Some(8)));
        fs::OpenOptions::new()
            .write(true)
            .open(&file)
            .unwrap()
            .set_len(8)
            .unwrap();
        assert_eq!(verify_file(dir.path(), "a.jsonl"), Ok(Some(8)));
    }
}
