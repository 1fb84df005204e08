//! A GitHub App's private key and the JWT it signs (`ref/github.md` §1): `iat` a minute in the past
//! against clock drift, `exp` nine minutes ahead (GitHub refuses more than ten), `iss` the App ID or its
//! client ID.

use std::time::{SystemTime, UNIX_EPOCH};

use base64::Engine;
use ring::signature::{RSA_PKCS1_SHA256, RsaKeyPair};
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{PrivatePkcs1KeyDer, PrivatePkcs8KeyDer};

/// Why an App key cannot be used.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum AppKeyError {
    #[error("the App's private key is not a PEM RSA key (GitHub's `BEGIN RSA PRIVATE KEY`, or `BEGIN PRIVATE KEY`)")]
    NotPem,
    #[error("the App's private key is not a usable RSA key: {0}")]
    Rejected(String),
    #[error("the JWT could not be signed")]
    Signing,
}

/// An App's RSA private key. Its `Debug` shows nothing of it.
pub struct AppKey {
    pair: RsaKeyPair,
}

impl std::fmt::Debug for AppKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("AppKey([redacted])")
    }
}

impl AppKey {
    /// Reads a PKCS#1 (`BEGIN RSA PRIVATE KEY`, GitHub's download) or PKCS#8 (`BEGIN PRIVATE KEY`) PEM.
    pub fn from_pem(pem: &[u8]) -> Result<Self, AppKeyError> {
        let pair = if let Ok(der) = PrivatePkcs1KeyDer::from_pem_slice(pem) {
            RsaKeyPair::from_der(der.secret_pkcs1_der())
        } else if let Ok(der) = PrivatePkcs8KeyDer::from_pem_slice(pem) {
            RsaKeyPair::from_pkcs8(der.secret_pkcs8_der())
        } else {
            return Err(AppKeyError::NotPem);
        };
        pair.map(|pair| Self { pair })
            .map_err(|rejected| AppKeyError::Rejected(rejected.to_string()))
    }

    /// The App's JWT for `issuer` (App ID or client ID) at `now`.
    pub fn jwt(&self, issuer: &str, now: SystemTime) -> Result<String, AppKeyError> {
        let now = now.duration_since(UNIX_EPOCH).unwrap_or_default().as_secs();
        let encode = |bytes: &[u8]| base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(bytes);
        let header = encode(br#"{"alg":"RS256","typ":"JWT"}"#);
        let claims = serde_json::json!({"iat": now.saturating_sub(60), "exp": now + 540, "iss": issuer});
        let signed = format!("{header}.{}", encode(claims.to_string().as_bytes()));
        let mut signature = vec![0; self.pair.public().modulus_len()];
        self.pair
            .sign(
                &RSA_PKCS1_SHA256,
                &ring::rand::SystemRandom::new(),
                signed.as_bytes(),
                &mut signature,
            )
            .map_err(|_| AppKeyError::Signing)?;
        Ok(format!("{signed}.{}", encode(&signature)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn what_is_not_an_rsa_pem_is_refused_with_a_sentence() {
        assert_eq!(AppKey::from_pem(b"ghp_notakey").err(), Some(AppKeyError::NotPem));
        let ec = b"-----BEGIN PRIVATE KEY-----\nMIGHAgEAMBMGByqGSM49AgEGCCqGSM49AwEHBG0wawIBAQQg\n-----END PRIVATE KEY-----\n";
        assert!(matches!(
            AppKey::from_pem(ec),
            Err(AppKeyError::Rejected(_) | AppKeyError::NotPem)
        ));
        assert_eq!(
            format!("{:?}", AppKey::from_pem(b"x").err()),
            "Some(NotPem)",
            "errors name no key material"
        );
    }
}
