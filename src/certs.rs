//! Per-job certificates for mutual TLS (`stageb tls-init`), so a cluster job can encrypt and
//! authenticate its gRPC links without OpenSSL or a site PKI.
//!
//! One run, one private CA: the CA signs a single certificate that every rank of the job uses,
//! as the coordinator's server certificate and as each worker's client certificate (it carries
//! both `serverAuth` and `clientAuth`). Possession of the key, readable only by the job's user
//! on the shared filesystem, is what admits a process to the run. The CA's own key is dropped
//! after signing, so nothing else can ever be issued under it. Names: `stageb-coordinator` (for
//! `STAGEB_TLS_SERVER_NAME`), `localhost`, the loopback addresses, this host's name and any
//! `--host` given.

use std::path::{Path, PathBuf};

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose,
};

/// The name every job certificate carries; workers can expect it whatever address they dial.
pub const COORDINATOR_NAME: &str = "stageb-coordinator";
/// File names written by [`write_job_certificates`].
pub const CA_FILE: &str = "ca.pem";
pub const CERT_FILE: &str = "node.pem";
pub const KEY_FILE: &str = "node.key";

#[derive(Debug, thiserror::Error)]
pub enum CertError {
    #[error("cannot generate the certificates: {0}")]
    Generate(#[from] rcgen::Error),
    #[error("cannot write {path}")]
    Write {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("--days must be between 1 and 3650")]
    Validity,
}

/// A job's CA certificate and its one node certificate with key (PEM).
pub struct JobCertificates {
    pub ca_pem: String,
    pub cert_pem: String,
    pub key_pem: String,
}

impl std::fmt::Debug for JobCertificates {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("JobCertificates(<redacted>)")
    }
}

/// Generate a CA and a node certificate for `hosts` (plus the fixed names), valid from an hour
/// ago (clock skew between nodes) for `days` days.
pub fn generate(hosts: &[String], days: u32) -> Result<JobCertificates, CertError> {
    if !(1..=3650).contains(&days) {
        return Err(CertError::Validity);
    }
    let now = time::OffsetDateTime::now_utc();
    let not_before = now - time::Duration::hours(1);
    let not_after = now + time::Duration::days(i64::from(days));

    let ca_key = KeyPair::generate()?;
    let mut ca = CertificateParams::new(Vec::<String>::new())?;
    ca.distinguished_name
        .push(DnType::CommonName, "stageb job CA");
    ca.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    ca.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    ca.not_before = not_before;
    ca.not_after = not_after;
    let ca_cert = ca.self_signed(&ca_key)?;
    let issuer = Issuer::new(ca, ca_key);

    let mut names: Vec<String> = [COORDINATOR_NAME, "localhost", "127.0.0.1", "::1"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    if let Some(host) = this_host() {
        names.push(host);
    }
    for h in hosts {
        if !names.contains(h) {
            names.push(h.clone());
        }
    }
    let mut node = CertificateParams::new(names)?;
    node.distinguished_name
        .push(DnType::CommonName, "stageb node");
    node.extended_key_usages = vec![
        ExtendedKeyUsagePurpose::ServerAuth,
        ExtendedKeyUsagePurpose::ClientAuth,
    ];
    node.key_usages = vec![
        KeyUsagePurpose::DigitalSignature,
        KeyUsagePurpose::KeyEncipherment,
    ];
    node.not_before = not_before;
    node.not_after = not_after;
    let node_key = KeyPair::generate()?;
    let node_cert = node.signed_by(&node_key, &issuer)?;
    Ok(JobCertificates {
        ca_pem: ca_cert.pem(),
        cert_pem: node_cert.pem(),
        key_pem: node_key.serialize_pem(),
    })
}

fn this_host() -> Option<String> {
    std::env::var("HOSTNAME")
        .ok()
        .or_else(|| std::fs::read_to_string("/etc/hostname").ok())
        .map(|h| h.trim().to_string())
        .filter(|h| !h.is_empty() && h.parse::<std::net::IpAddr>().is_err() && h.is_ascii())
}

/// Generate and write `ca.pem`, `node.pem` and `node.key` into `dir` (created, owner-only),
/// each file mode 0600. Returns the paths written.
pub fn write_job_certificates(
    dir: &Path,
    hosts: &[String],
    days: u32,
) -> Result<Vec<PathBuf>, CertError> {
    let certs = generate(hosts, days)?;
    create_private_dir(dir)?;
    let mut written = Vec::new();
    for (name, text) in [
        (CA_FILE, &certs.ca_pem),
        (CERT_FILE, &certs.cert_pem),
        (KEY_FILE, &certs.key_pem),
    ] {
        let path = dir.join(name);
        write_private(&path, text.as_bytes()).map_err(|source| CertError::Write {
            path: path.clone(),
            source,
        })?;
        written.push(path);
    }
    Ok(written)
}

fn create_private_dir(dir: &Path) -> Result<(), CertError> {
    let io = |source| CertError::Write {
        path: dir.to_path_buf(),
        source,
    };
    std::fs::create_dir_all(dir).map_err(io)?;
    // A directory that is a link would have its target chmodded and filled: refuse it.
    if std::fs::symlink_metadata(dir)
        .map_err(io)?
        .file_type()
        .is_symlink()
    {
        return Err(io(std::io::Error::other(
            "is a symbolic link; give tls-init a real directory",
        )));
    }
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700)).map_err(io)?;
    }
    Ok(())
}

/// Write `bytes` to `path` readable by the owner only. The bytes go to a new file beside it
/// (created exclusively, mode 0600 from the start, so the key is never readable by others,
/// not even briefly), which is then renamed over `path`: whatever stood at `path`, a planted
/// symbolic link included, is replaced, never followed.
fn write_private(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    use std::io::Write as _;
    let name = path.file_name().unwrap_or_default().to_string_lossy();
    let tmp = path.with_file_name(format!(".{name}.{}.tmp", std::process::id()));
    let mut options = std::fs::OpenOptions::new();
    // create_new: O_CREAT|O_EXCL, which fails on any existing entry, a link included.
    options.write(true).create_new(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        options.mode(0o600);
    }
    let written = options.open(&tmp).and_then(|mut file| {
        file.write_all(bytes)?;
        file.sync_all()
    });
    match written.and_then(|()| std::fs::rename(&tmp, path)) {
        Ok(()) => Ok(()),
        Err(e) => {
            let _ = std::fs::remove_file(&tmp);
            Err(e)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn job_certificates_are_written_owner_only() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("tls");
        let written = write_job_certificates(&out, &["node-7".into()], 2).unwrap();
        assert_eq!(written.len(), 3);
        for p in &written {
            let text = std::fs::read_to_string(p).unwrap();
            assert!(text.starts_with("-----BEGIN"), "{}", p.display());
            #[cfg(unix)]
            {
                use std::os::unix::fs::PermissionsExt;
                let mode = std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
                assert_eq!(mode, 0o600, "{}", p.display());
            }
        }
        assert!(!out.join("ca.key").exists(), "the CA key is never written");
    }

    /// Regression: a link planted at `DIR/node.key` received the private key and had
    /// its target chmodded.
    #[cfg(unix)]
    #[test]
    fn regression_tls_init_does_not_follow_a_planted_key_symlink() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("tls");
        std::fs::create_dir(&out).unwrap();
        let victim = dir.path().join("victim.txt");
        std::fs::write(&victim, "untouched").unwrap();
        std::fs::set_permissions(&victim, std::fs::Permissions::from_mode(0o644)).unwrap();
        std::os::unix::fs::symlink(&victim, out.join(KEY_FILE)).unwrap();

        write_job_certificates(&out, &["node-7".into()], 2).unwrap();

        assert_eq!(std::fs::read_to_string(&victim).unwrap(), "untouched");
        let mode = std::fs::metadata(&victim).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o644, "the link's target keeps its mode");
        let key = std::fs::symlink_metadata(out.join(KEY_FILE)).unwrap();
        assert!(
            key.file_type().is_file(),
            "node.key is a file of its own now"
        );
        assert_eq!(key.permissions().mode() & 0o777, 0o600);
        let leftovers: Vec<_> = std::fs::read_dir(&out)
            .unwrap()
            .filter_map(|e| e.ok())
            .filter(|e| e.file_name().to_string_lossy().ends_with(".tmp"))
            .collect();
        assert!(leftovers.is_empty(), "no temporary file is left behind");
    }

    #[cfg(unix)]
    #[test]
    fn a_directory_that_is_a_symlink_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let real = dir.path().join("real");
        std::fs::create_dir(&real).unwrap();
        let link = dir.path().join("tls");
        std::os::unix::fs::symlink(&real, &link).unwrap();
        let err = write_job_certificates(&link, &[], 2).unwrap_err();
        assert!(format!("{err:#}").contains("cannot write"), "{err}");
        assert_eq!(
            std::fs::read_dir(&real).unwrap().count(),
            0,
            "nothing written through it"
        );
    }

    #[test]
    fn validity_is_bounded() {
        assert!(matches!(generate(&[], 0), Err(CertError::Validity)));
    }
}
