//! Bearer tokens and secrets. A token is shown once at creation; the store keeps only its SHA-256.

use base64::Engine;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use sha2::{Digest, Sha256};

/// Every token starts with this, so secret scanners and people recognise one.
pub const TOKEN_PREFIX: &str = "sortie_";

/// Bytes that must never be printed (one type with the store's, which opens model keys into it).
pub use sortie_store::Secret;

/// `n` bytes from the operating system's generator, base64url without padding.
pub fn random_text(n: usize) -> Result<String, getrandom::Error> {
    let mut bytes = vec![0_u8; n];
    getrandom::fill(&mut bytes)?;
    Ok(URL_SAFE_NO_PAD.encode(bytes))
}

/// A fresh token (256 random bits) and the hash the store keeps.
pub fn generate_token() -> Result<(String, String), getrandom::Error> {
    let token = format!("{TOKEN_PREFIX}{}", random_text(32)?);
    let hash = hash_token(&token);
    Ok((token, hash))
}

/// The hex SHA-256 of a token, the only form the store sees.
pub fn hash_token(token: &str) -> String {
    let digest = Sha256::digest(token.as_bytes());
    digest.iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_are_random_prefixed_and_hashed() {
        let (a, hash_a) = generate_token().expect("random");
        let (b, _) = generate_token().expect("random");
        assert_ne!(a, b);
        assert!(a.starts_with(TOKEN_PREFIX) && a.len() == TOKEN_PREFIX.len() + 43);
        assert_eq!(hash_a, hash_token(&a));
        assert_eq!(hash_a.len(), 64);
        assert_eq!(
            hash_token("abc"),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
    }

    #[test]
    fn secrets_never_print() {
        let secret = Secret::new(b"hunter2".to_vec());
        assert_eq!(format!("{secret:?} {secret}"), "Secret([redacted]) [redacted]");
        assert_eq!(secret.expose(), b"hunter2");
    }
}
