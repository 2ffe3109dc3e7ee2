//! TLS and mutual TLS for the gRPC links between rank 0 and its workers (rustls through
//! tonic: no OpenSSL, no system libraries).
//!
//! Only file paths come from the command line or the environment; the PEM text is read once
//! at start, checked for the blocks it must hold, and never logged. A coordinator with a
//! client CA requires every worker to present a certificate signed by it (mTLS); a worker
//! verifies the coordinator against its CA and, under mTLS, presents its own certificate.

use std::path::{Path, PathBuf};
use std::time::Duration;

use tonic::transport::{Certificate, ClientTlsConfig, Identity, ServerTlsConfig};

/// Environment variable: this process's certificate (PEM; the coordinator's server
/// certificate, or a worker's client certificate under mTLS).
pub const TLS_CERT_ENV: &str = "STAGEB_TLS_CERT";
/// Environment variable: the private key of [`TLS_CERT_ENV`] (PEM).
pub const TLS_KEY_ENV: &str = "STAGEB_TLS_KEY";
/// Environment variable: the CA a coordinator requires worker certificates to chain to.
pub const TLS_CLIENT_CA_ENV: &str = "STAGEB_TLS_CLIENT_CA";
/// Environment variable: the CA a worker verifies the coordinator's certificate against.
pub const TLS_CA_ENV: &str = "STAGEB_TLS_CA";
/// Environment variable: the name a worker expects in the coordinator's certificate (default:
/// the host it dials).
pub const TLS_SERVER_NAME_ENV: &str = "STAGEB_TLS_SERVER_NAME";

/// How long a TLS handshake may take before the connection is dropped.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("cannot read {what} {path}")]
    Read {
        what: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{what} {path} holds no PEM `{block}` block")]
    NotPem {
        what: &'static str,
        path: PathBuf,
        block: &'static str,
    },
    #[error("{0} is given without {1}: a certificate and its key go together")]
    Incomplete(&'static str, &'static str),
    #[error("--tls-client-ca (mutual TLS) needs the coordinator's own --tls-cert and --tls-key")]
    ClientCaWithoutIdentity,
    #[error(
        "the TLS certificate, key or CA cannot be used ({0}): check that they are PEM files of a matching certificate and key"
    )]
    Unusable(String),
}

fn read_pem(what: &'static str, path: &Path, block: &'static str) -> Result<Vec<u8>, TlsError> {
    let text = std::fs::read(path).map_err(|source| TlsError::Read {
        what,
        path: path.to_path_buf(),
        source,
    })?;
    let pem = String::from_utf8_lossy(&text);
    let found = pem.contains(&format!("-----BEGIN {block}"))
        // Keys come as `PRIVATE KEY`, `RSA PRIVATE KEY` or `EC PRIVATE KEY`.
        || (block == "PRIVATE KEY" && pem.contains(" PRIVATE KEY-----"));
    if !found {
        return Err(TlsError::NotPem {
            what,
            path: path.to_path_buf(),
            block,
        });
    }
    Ok(text)
}

fn identity(cert: &Path, key: &Path) -> Result<Identity, TlsError> {
    Ok(Identity::from_pem(
        read_pem("certificate", cert, "CERTIFICATE")?,
        read_pem("private key", key, "PRIVATE KEY")?,
    ))
}

fn pair<'a>(
    cert: Option<&'a Path>,
    key: Option<&'a Path>,
) -> Result<Option<(&'a Path, &'a Path)>, TlsError> {
    match (cert, key) {
        (Some(c), Some(k)) => Ok(Some((c, k))),
        (None, None) => Ok(None),
        (Some(_), None) => Err(TlsError::Incomplete("--tls-cert", "--tls-key")),
        (None, Some(_)) => Err(TlsError::Incomplete("--tls-key", "--tls-cert")),
    }
}

/// The coordinator's TLS: its identity and, for mutual TLS, the CA client certificates must
/// chain to.
#[derive(Clone)]
pub struct ServerTls {
    identity: Identity,
    client_ca: Option<Certificate>,
}

impl std::fmt::Debug for ServerTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServerTls")
            .field("mutual", &self.client_ca.is_some())
            .finish_non_exhaustive()
    }
}

impl ServerTls {
    /// TLS from PEM files; `Ok(None)` when none is given (plaintext).
    pub fn from_files(
        cert: Option<&Path>,
        key: Option<&Path>,
        client_ca: Option<&Path>,
    ) -> Result<Option<Self>, TlsError> {
        let Some((cert, key)) = pair(cert, key)? else {
            return match client_ca {
                Some(_) => Err(TlsError::ClientCaWithoutIdentity),
                None => Ok(None),
            };
        };
        let client_ca = client_ca
            .map(|p| read_pem("client CA", p, "CERTIFICATE").map(Certificate::from_pem))
            .transpose()?;
        let tls = ServerTls {
            identity: identity(cert, key)?,
            client_ca,
        };
        // rustls parses the PEM contents only when the server is built: do it now, so a
        // broken file is an input error at start, not a server that never serves.
        tonic::transport::Server::builder()
            .tls_config(tls.config())
            .map_err(|e| TlsError::Unusable(error_chain(&e)))?;
        Ok(Some(tls))
    }

    /// True when workers must present a certificate (mutual TLS).
    pub fn is_mutual(&self) -> bool {
        self.client_ca.is_some()
    }

    /// The tonic server configuration.
    pub fn config(&self) -> ServerTlsConfig {
        let config = ServerTlsConfig::new()
            .identity(self.identity.clone())
            .timeout(HANDSHAKE_TIMEOUT);
        match &self.client_ca {
            Some(ca) => config.client_ca_root(ca.clone()),
            None => config,
        }
    }
}

fn error_chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        text.push_str(": ");
        text.push_str(&s.to_string());
        source = s.source();
    }
    text
}

/// A worker's TLS: the CA it trusts for the coordinator, its own identity under mTLS, and the
/// name it expects in the coordinator's certificate.
#[derive(Clone)]
pub struct ClientTls {
    ca: Certificate,
    identity: Option<Identity>,
    server_name: Option<String>,
}

impl std::fmt::Debug for ClientTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClientTls")
            .field("client_certificate", &self.identity.is_some())
            .field("server_name", &self.server_name)
            .finish_non_exhaustive()
    }
}

impl ClientTls {
    /// TLS from PEM files; `Ok(None)` when no CA is given (plaintext). A client certificate
    /// without a CA is an error: it would silently go unused.
    pub fn from_files(
        ca: Option<&Path>,
        cert: Option<&Path>,
        key: Option<&Path>,
        server_name: Option<&str>,
    ) -> Result<Option<Self>, TlsError> {
        let identity = pair(cert, key)?;
        let Some(ca) = ca else {
            return match identity {
                Some(_) => Err(TlsError::Incomplete("--tls-cert", "--tls-ca")),
                None => Ok(None),
            };
        };
        Ok(Some(ClientTls {
            ca: Certificate::from_pem(read_pem("CA", ca, "CERTIFICATE")?),
            identity: identity
                .map(|(c, k)| crate::tls::identity(c, k))
                .transpose()?,
            server_name: server_name.filter(|s| !s.is_empty()).map(str::to_string),
        }))
    }

    /// The tonic client configuration; `host` is the name dialed (used unless a server name
    /// was given).
    pub fn config(&self, host: &str) -> ClientTlsConfig {
        let config = ClientTlsConfig::new()
            .ca_certificate(self.ca.clone())
            .domain_name(self.server_name.clone().unwrap_or_else(|| host.to_string()))
            .timeout(HANDSHAKE_TIMEOUT);
        match &self.identity {
            Some(id) => config.identity(id.clone()),
            None => config,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn half_an_identity_or_a_client_ca_without_one_is_refused() {
        let p = Path::new("/nonexistent.pem");
        assert!(matches!(
            ServerTls::from_files(Some(p), None, None),
            Err(TlsError::Incomplete(..))
        ));
        assert!(matches!(
            ServerTls::from_files(None, None, Some(p)),
            Err(TlsError::ClientCaWithoutIdentity)
        ));
        assert!(matches!(
            ClientTls::from_files(None, Some(p), Some(p), None),
            Err(TlsError::Incomplete(..))
        ));
        assert!(ServerTls::from_files(None, None, None).unwrap().is_none());
        assert!(
            ClientTls::from_files(None, None, None, None)
                .unwrap()
                .is_none()
        );
    }

    #[test]
    fn a_certificate_with_a_pem_header_but_garbage_inside_is_refused_at_load() {
        let dir = tempfile::tempdir().unwrap();
        let cert = dir.path().join("cert.pem");
        let key = dir.path().join("key.pem");
        std::fs::write(
            &cert,
            "-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n",
        )
        .unwrap();
        std::fs::write(
            &key,
            "-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----\n",
        )
        .unwrap();
        assert!(matches!(
            ServerTls::from_files(Some(&cert), Some(&key), None),
            Err(TlsError::Unusable(_))
        ));
    }

    #[test]
    fn a_file_without_the_pem_block_is_named() {
        let dir = tempfile::tempdir().unwrap();
        let cert = dir.path().join("cert.pem");
        std::fs::write(&cert, "not a certificate").unwrap();
        let err = ClientTls::from_files(Some(&cert), None, None, None).unwrap_err();
        assert!(err.to_string().contains("cert.pem"), "{err}");
        assert!(matches!(err, TlsError::NotPem { .. }));
    }
}
