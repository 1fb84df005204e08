//! Model keys at rest: a [`KeyRing`] (one 32-byte master key) seals each workspace's vendor keys with
//! XChaCha20-Poly1305 before the store sees them, and opens them again for the model proxy.
//!
//! Each key gets a fresh random 24-byte nonce, and the workspace id and the API are the associated
//! data: a row copied to another workspace or another API does not open. Ciphertext and nonce are
//! stored as base64 text. Plaintext only ever leaves this module as a [`Secret`], which never prints.
//! This module must never log a key, and never write the master key anywhere but its own file.

use std::fmt;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use base64::Engine;
use base64::engine::general_purpose::STANDARD;
use chacha20poly1305::aead::{Aead, KeyInit, Payload};
use chacha20poly1305::{Key, XChaCha20Poly1305, XNonce};
use sortie_protocol::api::ModelApi;

use crate::{ForgeConnectionRow, Store, StoreError};

/// The length of the master key, in bytes.
pub const MASTER_KEY_BYTES: usize = 32;
/// The name of the master key's file in the data dir.
pub const KEYRING_FILE: &str = "keyring.key";
const NONCE_BYTES: usize = 24;

/// Bytes that must never be printed: `Debug` and `Display` show `[redacted]`.
#[derive(Clone)]
pub struct Secret(Arc<[u8]>);

impl Secret {
    pub fn new(bytes: impl Into<Vec<u8>>) -> Self {
        Self(Arc::from(bytes.into()))
    }

    pub fn expose(&self) -> &[u8] {
        &self.0
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Secret([redacted])")
    }
}

impl fmt::Display for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("[redacted]")
    }
}

/// Why a key could not be sealed or opened, or the master key not loaded. No variant carries a key.
#[derive(Debug, thiserror::Error)]
pub enum KeyError {
    /// The master key text or file is not 32 bytes (base64 text for the environment variable).
    #[error("the master key {0}")]
    MasterKey(String),
    /// The master key file could not be read or created.
    #[error("the master key file {path}: {source}")]
    MasterKeyFile { path: PathBuf, source: std::io::Error },
    /// The operating system gave no randomness for a nonce or a master key.
    #[error("no randomness: {0}")]
    Random(String),
    /// The stored ciphertext or nonce is not base64 of the right length.
    #[error("the stored key is malformed: {0}")]
    Malformed(&'static str),
    /// Authentication failed: another master key, another workspace or API, or altered bytes.
    #[error("the stored key does not open with this master key for this workspace and API")]
    Open,
    /// Sealing failed (the cipher refused the input).
    #[error("the key could not be sealed")]
    Seal,
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// What the keyring check seals, bound to its own associated data (no secret's context can match it).
const CHECK_PLAINTEXT: &[u8] = b"sortie keyring check v1";
const CHECK_ASSOCIATED_DATA: &[u8] = b"sortie/keyring-check";

/// A sealed model key as the store keeps it: base64 ciphertext (with its tag) and base64 nonce.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SealedKey {
    pub ciphertext: String,
    pub nonce: String,
}

/// The master key that seals and opens model keys. `Debug` never shows it.
pub struct KeyRing {
    cipher: XChaCha20Poly1305,
}

impl fmt::Debug for KeyRing {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("KeyRing([redacted])")
    }
}

impl KeyRing {
    pub fn from_bytes(master_key: [u8; MASTER_KEY_BYTES]) -> Self {
        Self {
            cipher: XChaCha20Poly1305::new(&Key::from(master_key)),
        }
    }

    /// A keyring with a fresh random master key (tests; [`KeyRing::load_or_create`] for servers).
    pub fn generate() -> Result<Self, KeyError> {
        Ok(Self::from_bytes(random_master_key()?))
    }

    /// The master key from text: the standard base64 of 32 bytes (surrounding whitespace ignored).
    pub fn from_env_text(text: &str) -> Result<Self, KeyError> {
        let bytes = STANDARD
            .decode(text.trim())
            .map_err(|_| KeyError::MasterKey("is not base64 text (e.g. `openssl rand -base64 32`)".into()))?;
        let master_key: [u8; MASTER_KEY_BYTES] = bytes.as_slice().try_into().map_err(|_| {
            KeyError::MasterKey(format!(
                "is {} bytes once decoded; it must be {MASTER_KEY_BYTES}",
                bytes.len()
            ))
        })?;
        Ok(Self::from_bytes(master_key))
    }

    /// The master key from `path`: exactly 32 raw bytes. If the file does not exist, a random key is
    /// written there once (mode 0600, never replacing a file another process wrote meanwhile).
    pub fn load_or_create(path: &Path) -> Result<Self, KeyError> {
        let file_error = |source: std::io::Error| KeyError::MasterKeyFile {
            path: path.to_owned(),
            source,
        };
        match std::fs::read(path) {
            Ok(bytes) => {
                warn_if_readable_by_others(path);
                let master_key: [u8; MASTER_KEY_BYTES] = bytes.as_slice().try_into().map_err(|_| {
                    KeyError::MasterKey(format!(
                        "file {} is {} bytes; it must be exactly {MASTER_KEY_BYTES}",
                        path.display(),
                        bytes.len()
                    ))
                })?;
                Ok(Self::from_bytes(master_key))
            }
            Err(error) if error.kind() == std::io::ErrorKind::NotFound => {
                let master_key = random_master_key()?;
                if create_once(path, &master_key).map_err(file_error)? {
                    tracing::info!(path = %path.display(), "created the master key of model keys");
                    Ok(Self::from_bytes(master_key))
                } else {
                    // Another process created it first: use theirs.
                    Self::load_or_create(path)
                }
            }
            Err(error) => Err(file_error(error)),
        }
    }

    /// The master key from the environment variable's value when it is set and not blank, else from
    /// the file at `path` (created if absent).
    pub fn from_env_or_file(env_text: Option<&str>, path: &Path) -> Result<Self, KeyError> {
        match env_text.filter(|text| !text.trim().is_empty()) {
            Some(text) => Self::from_env_text(text),
            None => Self::load_or_create(path),
        }
    }

    /// Seals a workspace's key for one API with a fresh random nonce.
    pub fn seal(&self, workspace_id: &str, api: ModelApi, plaintext: &[u8]) -> Result<SealedKey, KeyError> {
        self.seal_bound(&associated_data(workspace_id, api), plaintext)
    }

    /// Opens a key sealed by [`KeyRing::seal`] for the same workspace and API.
    pub fn open(
        &self,
        workspace_id: &str,
        api: ModelApi,
        ciphertext_b64: &str,
        nonce_b64: &str,
    ) -> Result<Secret, KeyError> {
        self.open_bound(&associated_data(workspace_id, api), ciphertext_b64, nonce_b64)
    }

    /// Seals a workspace's token for the forge at `host` with a fresh random nonce.
    pub fn seal_forge_token(&self, workspace_id: &str, host: &str, token: &[u8]) -> Result<SealedKey, KeyError> {
        self.seal_bound(&forge_associated_data(workspace_id, host), token)
    }

    /// Opens a token sealed by [`KeyRing::seal_forge_token`] for the same workspace and host.
    pub fn open_forge_token(
        &self,
        workspace_id: &str,
        host: &str,
        ciphertext_b64: &str,
        nonce_b64: &str,
    ) -> Result<Secret, KeyError> {
        self.open_bound(&forge_associated_data(workspace_id, host), ciphertext_b64, nonce_b64)
    }

    /// Seals a webhook's signing secret, bound to its workspace and id.
    pub fn seal_webhook_secret(
        &self,
        workspace_id: &str,
        webhook_id: &str,
        secret: &[u8],
    ) -> Result<SealedKey, KeyError> {
        self.seal_bound(&webhook_associated_data(workspace_id, webhook_id), secret)
    }

    /// Opens a secret sealed by [`KeyRing::seal_webhook_secret`] for the same workspace and webhook.
    pub fn open_webhook_secret(
        &self,
        workspace_id: &str,
        webhook_id: &str,
        ciphertext_b64: &str,
        nonce_b64: &str,
    ) -> Result<Secret, KeyError> {
        self.open_bound(
            &webhook_associated_data(workspace_id, webhook_id),
            ciphertext_b64,
            nonce_b64,
        )
    }

    /// A sealed canary, `nonce.ciphertext`: the first replica stores it, and every other replica opens
    /// it with [`KeyRing::opens_check`] before it seals or opens anything, so one started with another
    /// master key refuses to start instead of failing every session's model request.
    pub fn check_value(&self) -> Result<String, KeyError> {
        let sealed = self.seal_bound(CHECK_ASSOCIATED_DATA, CHECK_PLAINTEXT)?;
        Ok(format!("{}.{}", sealed.nonce, sealed.ciphertext))
    }

    /// Whether `check` (from [`KeyRing::check_value`]) was sealed with this master key.
    pub fn opens_check(&self, check: &str) -> bool {
        check.split_once('.').is_some_and(|(nonce, ciphertext)| {
            self.open_bound(CHECK_ASSOCIATED_DATA, ciphertext, nonce)
                .is_ok_and(|plain| plain.expose() == CHECK_PLAINTEXT)
        })
    }

    fn seal_bound(&self, aad: &[u8], plaintext: &[u8]) -> Result<SealedKey, KeyError> {
        let mut nonce = [0_u8; NONCE_BYTES];
        getrandom::fill(&mut nonce).map_err(|error| KeyError::Random(error.to_string()))?;
        let ciphertext = self
            .cipher
            .encrypt(&XNonce::from(nonce), Payload { msg: plaintext, aad })
            .map_err(|_| KeyError::Seal)?;
        Ok(SealedKey {
            ciphertext: STANDARD.encode(ciphertext),
            nonce: STANDARD.encode(nonce),
        })
    }

    fn open_bound(&self, aad: &[u8], ciphertext_b64: &str, nonce_b64: &str) -> Result<Secret, KeyError> {
        let nonce = STANDARD
            .decode(nonce_b64)
            .map_err(|_| KeyError::Malformed("the nonce is not base64"))?;
        let nonce: [u8; NONCE_BYTES] = nonce
            .as_slice()
            .try_into()
            .map_err(|_| KeyError::Malformed("the nonce is not 24 bytes"))?;
        let ciphertext = STANDARD
            .decode(ciphertext_b64)
            .map_err(|_| KeyError::Malformed("the ciphertext is not base64"))?;
        let plaintext = self
            .cipher
            .decrypt(&XNonce::from(nonce), Payload { msg: &ciphertext, aad })
            .map_err(|_| KeyError::Open)?;
        Ok(Secret::new(plaintext))
    }
}

/// What a sealed key is bound to: the workspace and the API, length-prefixed so that no two pairs
/// share an encoding.
fn associated_data(workspace_id: &str, api: ModelApi) -> Vec<u8> {
    format!(
        "sortie model key v1\n{}:{workspace_id}\n{}",
        workspace_id.len(),
        api.as_str()
    )
    .into_bytes()
}

/// What a sealed forge token is bound to: the workspace and the forge's host, as for model keys.
fn forge_associated_data(workspace_id: &str, host: &str) -> Vec<u8> {
    format!("sortie forge token v1\n{}:{workspace_id}\n{host}", workspace_id.len()).into_bytes()
}

/// What a sealed webhook secret is bound to: the workspace and the webhook, as for model keys.
fn webhook_associated_data(workspace_id: &str, webhook_id: &str) -> Vec<u8> {
    format!(
        "sortie webhook secret v1\n{}:{workspace_id}\n{webhook_id}",
        workspace_id.len()
    )
    .into_bytes()
}

fn random_master_key() -> Result<[u8; MASTER_KEY_BYTES], KeyError> {
    let mut master_key = [0_u8; MASTER_KEY_BYTES];
    getrandom::fill(&mut master_key).map_err(|error| KeyError::Random(error.to_string()))?;
    Ok(master_key)
}

/// Writes `contents` to `path` if nothing is there: a private temporary file, synced, then linked into
/// place (a link never replaces a file). `false` if another process's file won.
fn create_once(path: &Path, contents: &[u8]) -> std::io::Result<bool> {
    use std::os::unix::fs::OpenOptionsExt;
    let mut suffix = [0_u8; 8];
    getrandom::fill(&mut suffix).map_err(|error| std::io::Error::other(error.to_string()))?;
    let name = path.file_name().map(|n| n.to_string_lossy()).unwrap_or_default();
    let temporary = path.with_file_name(format!(
        ".{name}.{}",
        suffix.iter().map(|b| format!("{b:02x}")).collect::<String>()
    ));
    let written = (|| {
        let mut file = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&temporary)?;
        file.write_all(contents)?;
        file.sync_all()
    })();
    let linked = written.and_then(|()| std::fs::hard_link(&temporary, path));
    let _ = std::fs::remove_file(&temporary);
    match linked {
        Ok(()) => {
            if let Some(parent) = path.parent()
                && let Ok(directory) = std::fs::File::open(parent)
            {
                let _ = directory.sync_all();
            }
            Ok(true)
        }
        Err(error) if error.kind() == std::io::ErrorKind::AlreadyExists => Ok(false),
        Err(error) => Err(error),
    }
}

fn warn_if_readable_by_others(path: &Path) {
    use std::os::unix::fs::PermissionsExt;
    if let Ok(metadata) = std::fs::metadata(path)
        && metadata.permissions().mode() & 0o077 != 0
    {
        tracing::warn!(path = %path.display(), "the master key file is readable by others; make it mode 0600");
    }
}

/// The decrypted key of a workspace for one API, for the model proxy; `None` if none is set.
pub async fn workspace_model_key(
    store: &dyn Store,
    ring: &KeyRing,
    workspace_id: &str,
    api: ModelApi,
) -> Result<Option<Secret>, KeyError> {
    let Some(row) = store.model_key(workspace_id, api).await? else {
        return Ok(None);
    };
    ring.open(workspace_id, api, &row.key_ciphertext, &row.key_nonce)
        .map(Some)
}

/// The workspace's connection to the forge at `host` and its token, opened; `None` if it has none.
pub async fn workspace_forge_token(
    store: &dyn Store,
    ring: &KeyRing,
    workspace_id: &str,
    host: &str,
) -> Result<Option<(ForgeConnectionRow, Secret)>, KeyError> {
    let Some(row) = store.forge_connection(workspace_id, host).await? else {
        return Ok(None);
    };
    let token = ring.open_forge_token(workspace_id, host, &row.token_ciphertext, &row.token_nonce)?;
    Ok(Some((row, token)))
}

#[cfg(test)]
mod tests {
    use super::*;

    const KEY: &[u8] = b"sk-ant-api03-PLAINTEXT-VALUE-0123456789abcd";

    #[test]
    fn the_keyring_check_opens_only_under_the_same_master_key() {
        let ring = KeyRing::generate().expect("ring");
        let check = ring.check_value().expect("check");
        assert!(ring.opens_check(&check));
        assert!(!KeyRing::generate().expect("another").opens_check(&check));
        for garbage in ["", ".", "x.y", &check.replace('.', "")] {
            assert!(!ring.opens_check(garbage), "{garbage:?}");
        }
    }

    #[test]
    fn a_forge_token_opens_only_for_its_workspace_and_host() {
        let ring = KeyRing::generate().expect("ring");
        let sealed = ring.seal_forge_token("ws_a", "github.com", KEY).expect("seal");
        let opened = ring
            .open_forge_token("ws_a", "github.com", &sealed.ciphertext, &sealed.nonce)
            .expect("open");
        assert_eq!(opened.expose(), KEY);
        for (workspace, host) in [("ws_b", "github.com"), ("ws_a", "gitlab.com")] {
            assert!(matches!(
                ring.open_forge_token(workspace, host, &sealed.ciphertext, &sealed.nonce),
                Err(KeyError::Open)
            ));
        }
        // Nor does a forge token open as a model key, or the other way round.
        assert!(matches!(
            ring.open("ws_a", ModelApi::Anthropic, &sealed.ciphertext, &sealed.nonce),
            Err(KeyError::Open)
        ));
    }

    #[test]
    fn a_sealed_key_opens_only_for_its_workspace_and_api() {
        let ring = KeyRing::generate().expect("ring");
        let sealed = ring.seal("ws_a", ModelApi::Anthropic, KEY).expect("seal");
        let opened = ring
            .open("ws_a", ModelApi::Anthropic, &sealed.ciphertext, &sealed.nonce)
            .expect("open");
        assert_eq!(opened.expose(), KEY);
        for (workspace, api) in [
            ("ws_b", ModelApi::Anthropic),
            ("ws_a", ModelApi::Openai),
            ("ws_a", ModelApi::Gemini),
            ("ws_", ModelApi::Anthropic),
            ("", ModelApi::Anthropic),
        ] {
            assert!(
                matches!(
                    ring.open(workspace, api, &sealed.ciphertext, &sealed.nonce),
                    Err(KeyError::Open)
                ),
                "{workspace} {api}"
            );
        }
        let other_ring = KeyRing::generate().expect("ring");
        assert!(matches!(
            other_ring.open("ws_a", ModelApi::Anthropic, &sealed.ciphertext, &sealed.nonce),
            Err(KeyError::Open)
        ));
    }

    #[test]
    fn the_ciphertext_holds_no_plaintext_and_nonces_differ() {
        let ring = KeyRing::generate().expect("ring");
        let first = ring.seal("ws_a", ModelApi::Anthropic, KEY).expect("seal");
        let second = ring.seal("ws_a", ModelApi::Anthropic, KEY).expect("seal");
        assert_ne!(first.nonce, second.nonce);
        assert_ne!(first.ciphertext, second.ciphertext);
        let raw = STANDARD.decode(&first.ciphertext).expect("base64");
        assert_eq!(raw.len(), KEY.len() + 16, "ciphertext and tag");
        assert_eq!(STANDARD.decode(&first.nonce).expect("base64").len(), NONCE_BYTES);
        assert!(
            KEY.windows(8).all(|piece| !raw.windows(8).any(|w| w == piece)),
            "no 8 bytes of the plaintext in the ciphertext"
        );
        let text = format!("{first:?}");
        assert!(!text.contains("PLAINTEXT") && !first.ciphertext.contains("PLAINTEXT"));
    }

    #[test]
    fn altered_or_malformed_rows_do_not_open() {
        let ring = KeyRing::generate().expect("ring");
        let sealed = ring.seal("ws_a", ModelApi::Openai, KEY).expect("seal");
        let mut raw = STANDARD.decode(&sealed.ciphertext).expect("base64");
        raw[0] ^= 1;
        let altered = STANDARD.encode(&raw);
        assert!(matches!(
            ring.open("ws_a", ModelApi::Openai, &altered, &sealed.nonce),
            Err(KeyError::Open)
        ));
        assert!(matches!(
            ring.open("ws_a", ModelApi::Openai, "not base64!", &sealed.nonce),
            Err(KeyError::Malformed(_))
        ));
        assert!(matches!(
            ring.open("ws_a", ModelApi::Openai, &sealed.ciphertext, "AAAA"),
            Err(KeyError::Malformed(_))
        ));
    }

    #[test]
    fn master_keys_come_from_base64_text_of_32_bytes() {
        let text = STANDARD.encode([7_u8; 32]);
        let ring = KeyRing::from_env_text(&format!("  {text}\n")).expect("ring");
        let same = KeyRing::from_bytes([7_u8; 32]);
        let sealed = ring.seal("ws_a", ModelApi::Gemini, KEY).expect("seal");
        assert_eq!(
            same.open("ws_a", ModelApi::Gemini, &sealed.ciphertext, &sealed.nonce)
                .expect("open")
                .expose(),
            KEY
        );
        for bad in [
            STANDARD.encode([7_u8; 31]),
            STANDARD.encode([7_u8; 33]),
            "%%%".to_owned(),
        ] {
            let error = KeyRing::from_env_text(&bad).expect_err("refused");
            assert!(matches!(error, KeyError::MasterKey(_)), "{error}");
        }
        assert_eq!(format!("{ring:?}"), "KeyRing([redacted])");
    }

    #[test]
    fn the_master_key_file_is_created_once_private_and_reused() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().expect("dir");
        let path = dir.path().join(KEYRING_FILE);
        let first = KeyRing::load_or_create(&path).expect("created");
        let bytes = std::fs::read(&path).expect("file");
        assert_eq!(bytes.len(), MASTER_KEY_BYTES);
        assert_eq!(
            std::fs::metadata(&path).expect("meta").permissions().mode() & 0o777,
            0o600
        );
        let sealed = first.seal("ws_a", ModelApi::Anthropic, KEY).expect("seal");
        let again = KeyRing::load_or_create(&path).expect("loaded");
        assert_eq!(std::fs::read(&path).expect("file"), bytes, "not replaced");
        assert_eq!(
            again
                .open("ws_a", ModelApi::Anthropic, &sealed.ciphertext, &sealed.nonce)
                .expect("open")
                .expose(),
            KEY
        );
        let leftovers: Vec<_> = std::fs::read_dir(dir.path())
            .expect("dir")
            .filter_map(Result::ok)
            .map(|e| e.file_name())
            .collect();
        assert_eq!(leftovers.len(), 1, "no temporary file left: {leftovers:?}");

        std::fs::write(&path, b"short").expect("write");
        assert!(matches!(KeyRing::load_or_create(&path), Err(KeyError::MasterKey(_))));
        let env = STANDARD.encode([1_u8; 32]);
        assert!(
            KeyRing::from_env_or_file(Some(&env), &path).is_ok(),
            "the variable wins"
        );
        assert!(
            KeyRing::from_env_or_file(Some("  "), &path).is_err(),
            "a blank one falls back"
        );
    }

    #[test]
    fn secrets_never_print() {
        let secret = Secret::new(b"hunter2".to_vec());
        assert_eq!(format!("{secret:?} {secret}"), "Secret([redacted]) [redacted]");
        assert_eq!(secret.expose(), b"hunter2");
    }
}
