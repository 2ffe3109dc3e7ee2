//! The shared run token: where it comes from, how it is compared, and when it is required.
//!
//! Rank 0 binds loopback by default. Off loopback a peer must prove itself: with a token of at
//! least [`MIN_NETWORK_TOKEN_BYTES`] bytes, or with a client certificate (mutual TLS). A token
//! is read from `STAGEB_TOKEN` or from a file (`--token-file` / `STAGEB_TOKEN_FILE`), never from
//! the command line (visible in `ps`), compared in constant time, and never logged (its
//! `Debug` is redacted). A token sent over plaintext off loopback is allowed with a warning.

use std::fmt;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use subtle::ConstantTimeEq;

/// Environment variable holding the token itself.
pub const TOKEN_ENV: &str = "STAGEB_TOKEN";
/// Environment variable naming a file that holds the token.
pub const TOKEN_FILE_ENV: &str = "STAGEB_TOKEN_FILE";
/// gRPC metadata key carrying `Bearer <token>`.
pub const AUTH_HEADER: &str = "authorization";
/// Shortest token accepted for a non-loopback listener (a generated one has 64).
pub const MIN_NETWORK_TOKEN_BYTES: usize = 32;

#[derive(Debug, thiserror::Error)]
pub enum AuthError {
    #[error("cannot read token file {path}")]
    TokenFile {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("token from {origin} is empty")]
    EmptyToken { origin: String },
    #[error(
        "refusing to listen on non-loopback address {addr} without a token or mutual TLS: set {TOKEN_ENV} or {TOKEN_FILE_ENV} (or pass --token-file), or pass --tls-client-ca"
    )]
    NonLoopbackWithoutToken { addr: SocketAddr },
    #[error(
        "refusing a {len}-byte token for non-loopback address {addr}: tokens off loopback need at least {MIN_NETWORK_TOKEN_BYTES} bytes (e.g. `openssl rand -hex 32`)"
    )]
    TokenTooShort { addr: SocketAddr, len: usize },
}

/// How a listener's transport is secured.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transport {
    Plaintext,
    /// TLS: the server is authenticated, the channel encrypted.
    Tls,
    /// TLS with a required client certificate: both sides are authenticated.
    MutualTls,
}

/// A shared secret. Cloneable, comparable only in constant time, never printed.
#[derive(Clone)]
pub struct AuthToken(String);

impl fmt::Debug for AuthToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("AuthToken(<redacted>)")
    }
}

impl AuthToken {
    pub fn new(secret: impl Into<String>) -> Result<Self, AuthError> {
        let s = secret.into().trim().to_string();
        if s.is_empty() {
            return Err(AuthError::EmptyToken {
                origin: "argument".into(),
            });
        }
        Ok(AuthToken(s))
    }

    /// A fresh random token (256 bits) for runs that manage their own workers.
    pub fn generate() -> Self {
        AuthToken(format!(
            "{}{}",
            uuid::Uuid::new_v4().simple(),
            uuid::Uuid::new_v4().simple()
        ))
    }

    /// The token from an explicit file, else `STAGEB_TOKEN_FILE`, else `STAGEB_TOKEN`; `None`
    /// when none is configured.
    pub fn from_sources(explicit_file: Option<&Path>) -> Result<Option<Self>, AuthError> {
        let file = explicit_file
            .map(Path::to_path_buf)
            .or_else(|| std::env::var_os(TOKEN_FILE_ENV).map(PathBuf::from));
        if let Some(path) = file {
            let text = std::fs::read_to_string(&path).map_err(|source| AuthError::TokenFile {
                path: path.clone(),
                source,
            })?;
            let t = text.trim();
            if t.is_empty() {
                return Err(AuthError::EmptyToken {
                    origin: path.display().to_string(),
                });
            }
            return Ok(Some(AuthToken(t.to_string())));
        }
        match std::env::var(TOKEN_ENV) {
            Ok(v) if !v.trim().is_empty() => Ok(Some(AuthToken(v.trim().to_string()))),
            Ok(_) => Err(AuthError::EmptyToken {
                origin: TOKEN_ENV.into(),
            }),
            Err(_) => Ok(None),
        }
    }

    /// Constant-time comparison with what a peer presented.
    pub fn matches(&self, presented: &str) -> bool {
        self.0.as_bytes().ct_eq(presented.as_bytes()).into()
    }

    /// Compare against an `authorization` header value (`Bearer <token>`).
    pub fn matches_bearer(&self, header: &str) -> bool {
        match header.strip_prefix("Bearer ") {
            Some(t) => self.matches(t),
            None => false,
        }
    }

    /// The header value a client sends.
    pub fn bearer(&self) -> String {
        format!("Bearer {}", self.0)
    }

    /// Length in bytes (never the value).
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Always false: an empty token cannot be built.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

/// True for 127.0.0.0/8 and ::1.
pub fn is_loopback(addr: &SocketAddr) -> bool {
    addr.ip().is_loopback()
}

/// The listen policy. Loopback is always allowed. Off loopback a peer must authenticate: a
/// token of at least [`MIN_NETWORK_TOKEN_BYTES`] bytes, or mutual TLS. Returns the warnings to
/// log at start (a token over plaintext off loopback crosses the network in clear text).
pub fn check_listen_policy(
    addr: &SocketAddr,
    token: Option<&AuthToken>,
    transport: Transport,
) -> Result<Vec<String>, AuthError> {
    if is_loopback(addr) {
        return Ok(Vec::new());
    }
    match token {
        None if transport == Transport::MutualTls => Ok(Vec::new()),
        None => Err(AuthError::NonLoopbackWithoutToken { addr: *addr }),
        Some(t) if t.len() < MIN_NETWORK_TOKEN_BYTES => Err(AuthError::TokenTooShort {
            addr: *addr,
            len: t.len(),
        }),
        Some(_) if transport == Transport::Plaintext => Ok(vec![format!(
            "listening on {addr} without TLS: the token crosses the network in clear text (pass --tls-cert/--tls-key, and --tls-client-ca for mutual TLS)"
        )]),
        Some(_) => Ok(Vec::new()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_is_redacted_and_compared_exactly() {
        let t = AuthToken::new("s3cret").unwrap();
        assert_eq!(format!("{t:?}"), "AuthToken(<redacted>)");
        assert!(t.matches("s3cret"));
        assert!(!t.matches("s3cre"));
        assert!(!t.matches("s3cret2"));
        assert!(t.matches_bearer("Bearer s3cret"));
        assert!(!t.matches_bearer("s3cret"));
    }

    #[test]
    fn non_loopback_listen_requires_a_token_or_mutual_tls() {
        use Transport::*;
        let any: SocketAddr = "0.0.0.0:7000".parse().unwrap();
        let lo: SocketAddr = "127.0.0.1:7000".parse().unwrap();
        assert_eq!(check_listen_policy(&lo, None, Plaintext).unwrap().len(), 0);
        assert!(matches!(
            check_listen_policy(&any, None, Plaintext),
            Err(AuthError::NonLoopbackWithoutToken { .. })
        ));
        assert!(matches!(
            check_listen_policy(&any, None, Tls),
            Err(AuthError::NonLoopbackWithoutToken { .. })
        ));
        assert!(
            check_listen_policy(&any, None, MutualTls)
                .unwrap()
                .is_empty()
        );
        let strong = AuthToken::generate();
        assert!(
            check_listen_policy(&any, Some(&strong), Tls)
                .unwrap()
                .is_empty()
        );
    }

    #[test]
    fn a_token_over_plaintext_off_loopback_warns() {
        let any: SocketAddr = "10.0.0.5:7000".parse().unwrap();
        let warnings =
            check_listen_policy(&any, Some(&AuthToken::generate()), Transport::Plaintext).unwrap();
        assert_eq!(warnings.len(), 1);
        assert!(warnings[0].contains("clear text"));
    }

    #[test]
    fn short_tokens_are_refused_off_loopback_regression_one_character_token() {
        let any: SocketAddr = "0.0.0.0:7000".parse().unwrap();
        let lo: SocketAddr = "127.0.0.1:7000".parse().unwrap();
        let short = AuthToken::new("x").unwrap();
        let err = check_listen_policy(&any, Some(&short), Transport::Tls).unwrap_err();
        assert!(matches!(err, AuthError::TokenTooShort { len: 1, .. }));
        assert!(!err.to_string().contains("\"x\""), "never echo the token");
        assert!(check_listen_policy(&lo, Some(&short), Transport::Plaintext).is_ok());
    }
}
