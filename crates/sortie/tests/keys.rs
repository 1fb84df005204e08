//! `sortie keys` end to end: a key from stdin reaches the server sealed, is listed by its fingerprint
//! only, survives a restart (the master key file is reused) and is removed again.

mod support;

use std::io::Write;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::{Output, Stdio};

use serde_json::Value;
use support::{Server, sortie, stderr, stdout};

const KEY: &str = "sk-ant-api03-BINARY-TEST-never-shown-0123456789abcd";

/// A client command against `server` with `input` on its stdin.
fn with_stdin(server: &Server, home: &Path, data_dir: &Path, args: &[&str], input: &[u8]) -> Output {
    let mut child = sortie(home)
        .arg("--server")
        .arg(&server.url)
        .arg("--data-dir")
        .arg(data_dir)
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn client");
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(input)
        .expect("write the key");
    child.wait_with_output().expect("client")
}

#[test]
fn keys_set_from_stdin_list_by_fingerprint_and_remove() {
    let temp = tempfile::tempdir().expect("temp");
    let home = temp.path();
    let data_dir = temp.path().join("data");
    let server = Server::start(home, &data_dir, None);

    let keyring = data_dir.join("keyring.key");
    let master_key = std::fs::read(&keyring).expect("the master key file is created at start");
    assert_eq!(master_key.len(), 32);
    assert_eq!(
        std::fs::metadata(&keyring).expect("meta").permissions().mode() & 0o777,
        0o600
    );

    let set = with_stdin(
        &server,
        home,
        &data_dir,
        &["keys", "set", "anthropic"],
        format!("{KEY}\n").as_bytes(),
    );
    assert!(set.status.success(), "{}", stderr(&set));
    assert_eq!(stdout(&set), "set anthropic key …abcd\n");

    let listed = server.client(home, &data_dir, &["keys", "list"]);
    let text = stdout(&listed);
    assert!(listed.status.success(), "{}", stderr(&listed));
    assert!(
        text.contains("anthropic") && text.contains("…abcd") && !text.contains(&KEY[..KEY.len() - 4]),
        "{text}"
    );
    let json: Value =
        serde_json::from_slice(&server.client(home, &data_dir, &["--json", "keys", "list"]).stdout).expect("json list");
    assert_eq!(json["workspace"], "default");
    assert_eq!(json["keys"][0]["api"], "anthropic");
    assert_eq!(json["keys"][0]["fingerprint"], "abcd");

    // Refusals: an empty stdin, another workspace than the token's, an unknown api.
    let empty = with_stdin(&server, home, &data_dir, &["keys", "set", "openai"], b"\n");
    assert!(
        !empty.status.success() && stderr(&empty).contains("no key on stdin"),
        "{}",
        stderr(&empty)
    );
    let elsewhere = with_stdin(
        &server,
        home,
        &data_dir,
        &["keys", "set", "openai", "--workspace", "other"],
        b"sk-proj-elsewhere\n",
    );
    assert!(
        !elsewhere.status.success() && stderr(&elsewhere).contains(r#"not "other""#),
        "{}",
        stderr(&elsewhere)
    );
    let unknown = with_stdin(&server, home, &data_dir, &["keys", "set", "azure"], b"k\n");
    assert!(!unknown.status.success() && stderr(&unknown).contains("anthropic, openai, gemini"));
    let invalid = with_stdin(&server, home, &data_dir, &["keys", "set", "openai"], b"two words\n");
    assert!(
        !invalid.status.success() && stderr(&invalid).contains("MODEL_KEY_INVALID"),
        "{}",
        stderr(&invalid)
    );
    let same = with_stdin(
        &server,
        home,
        &data_dir,
        &["keys", "set", "gemini", "--workspace", "default", "--label", "ci"],
        b"AIzaSy-gemini-key-0123wxyz",
    );
    assert!(same.status.success(), "{}", stderr(&same));
    assert_eq!(stdout(&same), "set gemini key …wxyz\n");

    // At rest the database holds no plaintext; after a restart the same master key opens the key.
    server.kill_hard();
    for name in ["sortie.db", "sortie.db-wal"] {
        if let Ok(bytes) = std::fs::read(data_dir.join(name)) {
            assert!(
                !bytes.windows(KEY.len()).any(|w| w == KEY.as_bytes()),
                "{name} holds the key in plaintext"
            );
        }
    }
    let server = Server::start(home, &data_dir, None);
    assert_eq!(std::fs::read(&keyring).expect("keyring"), master_key, "kept");
    let listed = stdout(&server.client(home, &data_dir, &["keys", "list"]));
    assert!(
        listed.contains("…abcd") && listed.contains("…wxyz") && listed.contains("ci"),
        "{listed}"
    );
    assert!(!listed.contains("openai"), "no refused key was stored: {listed}");

    let removed = server.client(home, &data_dir, &["keys", "rm", "anthropic"]);
    assert!(removed.status.success(), "{}", stderr(&removed));
    assert_eq!(stdout(&removed), "removed anthropic key\n");
    let again = server.client(home, &data_dir, &["keys", "rm", "anthropic"]);
    assert!(!again.status.success() && stderr(&again).contains("MODEL_KEY_NOT_FOUND"));
    let listed = stdout(&server.client(home, &data_dir, &["keys", "list"]));
    assert!(!listed.contains("anthropic") && listed.contains("gemini"), "{listed}");
}

#[test]
fn a_malformed_master_key_variable_stops_serve() {
    let temp = tempfile::tempdir().expect("temp");
    let output = sortie(temp.path())
        .env("SORTIE_KEYRING_KEY", "dG9vIHNob3J0")
        .args(["serve", "--listen", "127.0.0.1:0", "--roles", "api", "--data-dir"])
        .arg(temp.path().join("data"))
        .output()
        .expect("serve");
    assert!(!output.status.success());
    let text = stderr(&output);
    assert!(
        text.contains("SORTIE_KEYRING_KEY") && text.contains("must be 32"),
        "{text}"
    );
    assert!(
        !temp.path().join("data/keyring.key").exists(),
        "no file when the variable is set"
    );
}
