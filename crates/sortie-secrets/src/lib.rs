//! What counts as a secret in pushed changes (DESIGN §7.3, §9 invariants 7 and 12): well-known key
//! formats found by a hand scan (fixed prefixes need no regex engine), and values the operator knows,
//! compared by their SHA-256 digests. Pure: it reads lines of a patch and answers findings; callers
//! do the reading (the driver's early-warning scan inside the sandbox, the gateway's scan of every
//! pushed pack on the host).
//!
//! It must never keep or show a secret value (a finding is a file and a kind), and never do I/O.

use std::collections::HashSet;
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

/// Findings kept (and named) at most; one is enough to refuse.
const FINDINGS_MAX: usize = 20;

/// Why a digests file is not usable.
#[derive(Debug, thiserror::Error)]
pub enum SecretsError {
    #[error("the secret digests {path}, line {line}: expected 64 lowercase hex digits (a SHA-256)")]
    Invalid { path: PathBuf, line: usize },
}

/// The SHA-256 digests of secret values the operator knows (the values never enter the sandbox).
#[derive(Clone, Debug, Default)]
pub struct KnownSecrets {
    digests: HashSet<[u8; 32]>,
}

impl KnownSecrets {
    /// Parses a digests file's text (`path` only names it in errors): one lowercase hex SHA-256 per
    /// line; blank lines and `#` comments skipped.
    pub fn parse(text: &str, path: &Path) -> Result<Self, SecretsError> {
        let mut digests = HashSet::new();
        for (index, line) in text.lines().enumerate() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let invalid = || SecretsError::Invalid {
                path: path.to_owned(),
                line: index + 1,
            };
            let bytes = line.as_bytes();
            if bytes.len() != 64 || !bytes.iter().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')) {
                return Err(invalid());
            }
            let mut digest = [0_u8; 32];
            for (slot, pair) in digest.iter_mut().zip(bytes.chunks_exact(2)) {
                *slot = (hex_value(pair[0]) << 4) | hex_value(pair[1]);
            }
            digests.insert(digest);
        }
        Ok(Self { digests })
    }

    /// The digests of `values` (the gateway's list: the values stay in the host process, only
    /// their digests are kept).
    pub fn from_values<'v>(values: impl IntoIterator<Item = &'v [u8]>) -> Self {
        let mut known = Self::default();
        for value in values {
            known.insert_value(value);
        }
        known
    }

    /// Adds the digest of `value`; an empty value is never a secret (it would match nothing useful).
    pub fn insert_value(&mut self, value: &[u8]) {
        if !value.is_empty() {
            self.digests.insert(Sha256::digest(value).into());
        }
    }

    /// Adds `other`'s digests (a list read again never loses what an earlier read had).
    pub fn extend(&mut self, other: &Self) {
        self.digests.extend(other.digests.iter().copied());
    }

    pub fn len(&self) -> usize {
        self.digests.len()
    }

    pub fn is_empty(&self) -> bool {
        self.digests.is_empty()
    }

    fn contains(&self, value: &[u8]) -> bool {
        let digest: [u8; 32] = Sha256::digest(value).into();
        self.digests.contains(&digest)
    }
}

/// One line of a digests file for `value` (what [`KnownSecrets::parse`] reads back).
pub fn digest_line(value: &[u8]) -> String {
    let mut line: String = Sha256::digest(value).iter().map(|b| format!("{b:02x}")).collect();
    line.push('\n');
    line
}

fn hex_value(digit: u8) -> u8 {
    match digit {
        b'0'..=b'9' => digit - b'0',
        b'a'..=b'f' => digit - b'a' + 10,
        _ => 0,
    }
}

/// What kind of secret a line seems to hold.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum SecretKind {
    AwsAccessKeyId,
    PrivateKey,
    GithubToken,
    SlackToken,
    GoogleApiKey,
    AnthropicApiKey,
    OpenaiApiKey,
    /// A value whose digest the operator listed.
    KnownSecret,
}

impl SecretKind {
    pub fn describe(self) -> &'static str {
        match self {
            Self::AwsAccessKeyId => "an AWS access key id",
            Self::PrivateKey => "a private key",
            Self::GithubToken => "a GitHub token",
            Self::SlackToken => "a Slack token",
            Self::GoogleApiKey => "a Google API key",
            Self::AnthropicApiKey => "an Anthropic API key",
            Self::OpenaiApiKey => "an OpenAI API key",
            Self::KnownSecret => "a known secret value",
        }
    }
}

fn is_alnum(b: u8) -> bool {
    b.is_ascii_alphanumeric()
}

fn is_key_char(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b == b'_' || b == b'-'
}

/// How many bytes from `start` satisfy `class`.
fn run_length(line: &[u8], start: usize, class: impl Fn(u8) -> bool) -> usize {
    line.get(start..)
        .map_or(0, |rest| rest.iter().take_while(|b| class(**b)).count())
}

/// The kinds of well-known key formats in one line of text.
pub fn scan_key_formats(line: &[u8]) -> Vec<SecretKind> {
    let mut kinds = Vec::new();
    let mut found = |kind| {
        if !kinds.contains(&kind) {
            kinds.push(kind);
        }
    };
    if let Some(begin) = find(line, b"-----BEGIN ") {
        let rest = &line[begin + 11..];
        let header = rest.get(..find(rest, b"-----").unwrap_or(rest.len())).unwrap_or(rest);
        if find(header, b"PRIVATE KEY").is_some() {
            found(SecretKind::PrivateKey);
        }
    }
    for start in 0..line.len() {
        // Keys start at a word boundary: `task-…` is not `sk-…`.
        if start > 0 && is_key_char(line[start - 1]) {
            continue;
        }
        let rest = &line[start..];
        let after = |prefix: &[u8]| start + prefix.len();
        if rest.starts_with(b"AKIA") || rest.starts_with(b"ASIA") {
            let length = run_length(line, after(b"AKIA"), |b| b.is_ascii_uppercase() || b.is_ascii_digit());
            if length == 16 && !line.get(after(b"AKIA") + 16).is_some_and(|b| is_alnum(*b)) {
                found(SecretKind::AwsAccessKeyId);
            }
        } else if [b"ghp_", b"gho_", b"ghu_", b"ghs_", b"ghr_"]
            .iter()
            .any(|p| rest.starts_with(*p))
        {
            if run_length(line, after(b"ghp_"), is_alnum) >= 36 {
                found(SecretKind::GithubToken);
            }
        } else if rest.starts_with(b"github_pat_") {
            if run_length(line, after(b"github_pat_"), |b| is_alnum(b) || b == b'_') >= 22 {
                found(SecretKind::GithubToken);
            }
        } else if rest.starts_with(b"xox")
            && rest.get(3).is_some_and(|b| b"abprs".contains(b))
            && rest.get(4) == Some(&b'-')
        {
            if run_length(line, start + 5, |b| is_alnum(b) || b == b'-') >= 10 {
                found(SecretKind::SlackToken);
            }
        } else if rest.starts_with(b"AIza") {
            if run_length(line, after(b"AIza"), is_key_char) >= 35 {
                found(SecretKind::GoogleApiKey);
            }
        } else if rest.starts_with(b"sk-ant-") {
            if run_length(line, after(b"sk-ant-"), is_key_char) >= 20 {
                found(SecretKind::AnthropicApiKey);
            }
        } else if rest.starts_with(b"sk-") && run_length(line, after(b"sk-"), is_key_char) >= 32 {
            found(SecretKind::OpenaiApiKey);
        }
    }
    kinds
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|window| window == needle)
}

fn is_token_char(b: u8) -> bool {
    b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'+' | b'/' | b'=' | b'.' | b':')
}

/// Whether a line holds a known secret value: every token (a run of `[A-Za-z0-9_\-+/=.:]`) is
/// compared, and so are its parts before and after each `=` and `:` (`KEY=value`, `user:pass`).
pub fn contains_known_secret(line: &[u8], known: &KnownSecrets) -> bool {
    if known.is_empty() {
        return false;
    }
    line.split(|b| !is_token_char(*b))
        .filter(|t| !t.is_empty())
        .any(|token| {
            known.contains(token)
                || token.iter().enumerate().any(|(at, b)| {
                    matches!(b, b'=' | b':')
                        && ((at > 0 && known.contains(&token[..at]))
                            || (at + 1 < token.len() && known.contains(&token[at + 1..])))
                })
        })
}

/// A secret found in the changes: where and what kind, never the value.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Finding {
    pub file: String,
    pub kind: SecretKind,
}

/// Scans a patch (`git log -p`, `git diff`) line by line: only the lines a hunk adds are looked at,
/// counted from the hunk headers, so that an added line that reads like a header is still scanned.
#[derive(Debug)]
pub struct PatchScanner<'a> {
    known: &'a KnownSecrets,
    file: String,
    old_left: u64,
    new_left: u64,
    /// The last line handed in was an added line (its [`PatchScanner::continuation`]s are scanned).
    last_added: bool,
    findings: Vec<Finding>,
}

impl<'a> PatchScanner<'a> {
    pub fn new(known: &'a KnownSecrets) -> Self {
        Self {
            known,
            file: String::new(),
            old_left: 0,
            new_left: 0,
            last_added: false,
            findings: Vec::new(),
        }
    }

    /// Whether the scanner is inside a hunk (the next line is counted as the hunk's), so a caller
    /// can tell a header line of its own format (a commit id) from a line of the patch.
    pub fn in_hunk(&self) -> bool {
        self.old_left > 0 || self.new_left > 0
    }

    /// One line of the patch, without its newline.
    pub fn line(&mut self, line: &[u8]) {
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        self.last_added = false;
        if self.old_left > 0 || self.new_left > 0 {
            match line.first() {
                Some(b'+') => {
                    self.new_left = self.new_left.saturating_sub(1);
                    self.last_added = true;
                    self.scan(&line[1..]);
                }
                Some(b'-') => self.old_left = self.old_left.saturating_sub(1),
                Some(b'\\') => {}
                _ => {
                    self.old_left = self.old_left.saturating_sub(1);
                    self.new_left = self.new_left.saturating_sub(1);
                }
            }
            return;
        }
        if let Some(path) = line.strip_prefix(b"+++ ") {
            self.file = file_name(path);
        } else if line.starts_with(b"diff --git ") {
            self.file.clear();
        } else if let Some((old, new)) = parse_hunk_header(line) {
            self.old_left = old;
            self.new_left = new;
        }
    }

    /// More of the last line, which was too long to hand in whole (a reader with a line cap hands
    /// in the rest in pieces; each piece should repeat the end of the one before it, longer than any
    /// key, so that a key cut in two is still whole in one piece). Scanned if that line was added.
    pub fn continuation(&mut self, piece: &[u8]) {
        if self.last_added {
            self.scan(piece);
        }
    }

    /// Scans `line` as added content found outside a patch (a commit's message), named `origin`.
    pub fn added(&mut self, origin: &str, line: &[u8]) {
        let kinds = self.kinds(line);
        self.record(origin, kinds);
    }

    fn kinds(&self, added: &[u8]) -> Vec<SecretKind> {
        if self.findings.len() >= FINDINGS_MAX {
            return Vec::new();
        }
        let mut kinds = scan_key_formats(added);
        if contains_known_secret(added, self.known) {
            kinds.push(SecretKind::KnownSecret);
        }
        kinds
    }

    fn scan(&mut self, added: &[u8]) {
        let kinds = self.kinds(added);
        let file = std::mem::take(&mut self.file);
        self.record(&file, kinds);
        self.file = file;
    }

    fn record(&mut self, file: &str, kinds: Vec<SecretKind>) {
        for kind in kinds {
            if self.findings.len() >= FINDINGS_MAX {
                return;
            }
            let finding = Finding {
                file: file.to_owned(),
                kind,
            };
            if !self.findings.contains(&finding) {
                self.findings.push(finding);
            }
        }
    }

    pub fn findings(&self) -> &[Finding] {
        &self.findings
    }

    pub fn into_findings(self) -> Vec<Finding> {
        self.findings
    }
}

/// `b/src/x.rs` → `src/x.rs`; a quoted name loses its quotes (its escapes stay: it is only shown).
fn file_name(path: &[u8]) -> String {
    let text = String::from_utf8_lossy(path);
    let text = text.trim_end();
    let text = text.strip_prefix('"').and_then(|t| t.strip_suffix('"')).unwrap_or(text);
    text.strip_prefix("b/").unwrap_or(text).to_owned()
}

/// `@@ -12,3 +12,4 @@ …` → (3, 4); a missing count is 1.
fn parse_hunk_header(line: &[u8]) -> Option<(u64, u64)> {
    let text = std::str::from_utf8(line).ok()?;
    let rest = text.strip_prefix("@@ -")?;
    let (ranges, _) = rest.split_once(" @@")?;
    let (old, new) = ranges.split_once(" +")?;
    let count = |range: &str| -> Option<u64> {
        match range.split_once(',') {
            Some((_, count)) => count.parse().ok(),
            None => range.parse::<u64>().ok().map(|_| 1),
        }
    };
    Some((count(old)?, count(new)?))
}

/// The sentence a `SECRET_DETECTED` failure carries; `undone`: the delivery's own commit was taken back.
pub fn secret_reason(findings: &[Finding], undone: bool) -> String {
    let undone = if undone {
        " and the turn's commit was undone (its files are still in the workspace)"
    } else {
        ""
    };
    format!(
        "the changes seem to contain a secret: {}; nothing was pushed{undone}",
        describe(findings)
    )
}

/// What was found, for a person: `an AWS access key id in app.env, a private key in id_rsa and 2 more`.
pub fn describe(findings: &[Finding]) -> String {
    let named: Vec<String> = findings
        .iter()
        .take(5)
        .map(|f| {
            if f.file.is_empty() {
                f.kind.describe().to_owned()
            } else {
                format!("{} in {}", f.kind.describe(), f.file)
            }
        })
        .collect();
    let more = findings.len().saturating_sub(named.len());
    let more = if more > 0 {
        format!(" and {more} more")
    } else {
        String::new()
    };
    format!("{}{more}", named.join(", "))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn known(values: &[&str]) -> KnownSecrets {
        let text: String = values.iter().map(|value| digest_line(value.as_bytes())).collect();
        KnownSecrets::parse(&format!("# operator secrets\n\n{text}"), Path::new("digests")).expect("digests")
    }

    #[test]
    fn key_formats_are_recognised_at_word_boundaries() {
        use SecretKind::*;
        let github = format!("ghp_{}", "a1B2".repeat(9));
        let cases: Vec<(String, Vec<SecretKind>)> = vec![
            ("AWS_ACCESS_KEY_ID=AKIAIOSFODNN7EXAMPLE".into(), vec![AwsAccessKeyId]),
            ("key: ASIAIOSFODNN7EXAMPLE,".into(), vec![AwsAccessKeyId]),
            ("AKIAIOSFODNN7EXAMPLEX".into(), vec![]),
            ("AKIAIOSFODNN7EXAMPL".into(), vec![]),
            ("XAKIAIOSFODNN7EXAMPLE".into(), vec![]),
            ("AKIAiosfodnn7example".into(), vec![]),
            ("-----BEGIN RSA PRIVATE KEY-----".into(), vec![PrivateKey]),
            ("-----BEGIN OPENSSH PRIVATE KEY-----".into(), vec![PrivateKey]),
            ("\"-----BEGIN PRIVATE KEY-----\\nMIIE\"".into(), vec![PrivateKey]),
            ("-----BEGIN PUBLIC KEY-----".into(), vec![]),
            ("-----BEGIN CERTIFICATE----- PRIVATE KEY".into(), vec![]),
            (format!("token = \"{github}\""), vec![GithubToken]),
            (format!("gho_{}", "x".repeat(36)), vec![GithubToken]),
            (format!("ghs_{}", "x".repeat(35)), vec![]),
            (format!("github_pat_{}", "A_1".repeat(10)), vec![GithubToken]),
            ("github_pat_short".into(), vec![]),
            ("SLACK=xoxb-123456789012-abcdef".into(), vec![SlackToken]),
            ("xoxz-123456789012".into(), vec![]),
            ("xoxp-12".into(), vec![]),
            (format!("AIza{}", "Sy-_x".repeat(7)), vec![GoogleApiKey]),
            (format!("AIza{}", "x".repeat(34)), vec![]),
            (
                format!("ANTHROPIC_API_KEY=sk-ant-api03-{}", "Q".repeat(40)),
                vec![AnthropicApiKey],
            ),
            (format!("sk-proj-{}", "a".repeat(40)), vec![OpenaiApiKey]),
            (format!("sk-{}", "Z9".repeat(16)), vec![OpenaiApiKey]),
            (format!("sk-{}", "Z".repeat(31)), vec![]),
            (format!("task-{}", "a".repeat(40)), vec![]),
            (format!("disk-ant-{}", "a".repeat(40)), vec![]),
            (
                "plain prose mentions sk-ant- and AKIA and ghp_ in passing".into(),
                vec![],
            ),
            (
                format!("AKIAIOSFODNN7EXAMPLE and sk-{}", "b".repeat(40)),
                vec![AwsAccessKeyId, OpenaiApiKey],
            ),
        ];
        for (line, expected) in cases {
            assert_eq!(scan_key_formats(line.as_bytes()), expected, "{line}");
        }
    }

    #[test]
    fn known_secrets_match_tokens_and_their_parts_only() {
        let known = known(&["hunter2-is-long", "dGhpcyBpcyBiYXNlNjQ="]);
        let cases = [
            ("password: hunter2-is-long", true),
            ("PASSWORD=hunter2-is-long", true),
            ("url = https://me:hunter2-is-long@example.com", true),
            ("\"dGhpcyBpcyBiYXNlNjQ=\"", true),
            ("X=dGhpcyBpcyBiYXNlNjQ=", true),
            ("hunter2-is-longer", false),
            ("hunter2 is long", false),
            ("the_hunter2-is-long", false),
            ("", false),
        ];
        for (line, expected) in cases {
            assert_eq!(contains_known_secret(line.as_bytes(), &known), expected, "{line}");
        }
        assert!(!contains_known_secret(b"hunter2-is-long", &KnownSecrets::default()));
    }

    #[test]
    fn digests_files_are_strict() {
        let path = Path::new("digests");
        assert_eq!(KnownSecrets::parse("", path).expect("empty").len(), 0);
        let upper = "A".repeat(64);
        for bad in [upper.as_str(), "abc", &"a".repeat(65), "zz"] {
            assert!(
                matches!(
                    KnownSecrets::parse(&format!("# c\n{bad}\n"), path),
                    Err(SecretsError::Invalid { line: 2, .. })
                ),
                "{bad}"
            );
        }
    }

    #[test]
    fn the_patch_scanner_reads_only_added_lines_and_names_the_file() {
        let known = known(&["s3cr3t-value"]);
        let patch = "commit 0123\n\
diff --git a/app.env b/app.env\n\
new file mode 100644\n\
--- /dev/null\n\
+++ b/app.env\n\
@@ -0,0 +1,3 @@\n\
+AWS_KEY=AKIAIOSFODNN7EXAMPLE\n\
++++ b/looks-like-a-header\n\
+db=s3cr3t-value\n\
diff --git a/old.txt b/old.txt\n\
--- a/old.txt\n\
+++ b/old.txt\n\
@@ -1 +0,0 @@\n\
------BEGIN RSA PRIVATE KEY-----\n\
diff --git a/notes.md b/notes.md\n\
--- a/notes.md\n\
+++ b/notes.md\n\
@@ -3,2 +3,2 @@ heading\n\
 context -----BEGIN EC PRIVATE KEY-----\n\
-removed\n\
+-----BEGIN EC PRIVATE KEY-----\n\
\\ No newline at end of file\n\
commit 4567\n\
 commit message mentioning AKIAIOSFODNN7EXAMPLE\n";
        let mut scanner = PatchScanner::new(&known);
        for line in patch.lines() {
            scanner.line(line.as_bytes());
        }
        let expected = vec![
            Finding {
                file: "app.env".into(),
                kind: SecretKind::AwsAccessKeyId,
            },
            Finding {
                file: "app.env".into(),
                kind: SecretKind::KnownSecret,
            },
            Finding {
                file: "notes.md".into(),
                kind: SecretKind::PrivateKey,
            },
        ];
        assert_eq!(scanner.findings(), expected.as_slice());
        let reason = secret_reason(scanner.findings(), true);
        assert!(
            reason.contains("an AWS access key id in app.env")
                && !reason.contains("AKIA")
                && !reason.contains("s3cr3t"),
            "{reason}"
        );
    }

    #[test]
    fn known_values_are_kept_as_digests_only() {
        let known = KnownSecrets::from_values([&b"sk-workspace-key-123"[..], b""]);
        assert_eq!(known.len(), 1, "an empty value is no secret");
        assert!(contains_known_secret(b"KEY=sk-workspace-key-123", &known));
        assert!(!format!("{known:?}").contains("workspace-key"));
        let mut from_file = self::known(&["other"]);
        from_file.extend(&known);
        assert_eq!(from_file.len(), 2);
    }

    #[test]
    fn a_long_added_line_is_scanned_in_pieces_and_a_message_as_added_text() {
        let known = KnownSecrets::default();
        let mut scanner = PatchScanner::new(&known);
        for line in ["diff --git a/blob.bin b/blob.bin", "+++ b/blob.bin", "@@ -0,0 +1,2 @@"] {
            scanner.line(line.as_bytes());
        }
        assert!(scanner.in_hunk());
        scanner.line(b"+xxxxxxxx");
        scanner.continuation(b"xxxx AKIAZQ3DRSTUVWXY2345 xxxx");
        assert_eq!(
            scanner.findings(),
            [Finding {
                file: "blob.bin".into(),
                kind: SecretKind::AwsAccessKeyId
            }]
        );
        scanner.line(b" context line");
        assert!(!scanner.in_hunk());
        // The rest of a context line is not added content.
        scanner.continuation(b"-----BEGIN RSA PRIVATE KEY-----");
        assert_eq!(scanner.findings().len(), 1);
        scanner.added("the message of commit 0123abc", b"-----BEGIN RSA PRIVATE KEY-----");
        assert_eq!(scanner.findings()[1].file, "the message of commit 0123abc");
        assert_eq!(
            describe(scanner.findings()),
            "an AWS access key id in blob.bin, a private key in the message of commit 0123abc"
        );
    }

    #[test]
    fn hunk_headers() {
        let cases: [(&str, Option<(u64, u64)>); 6] = [
            ("@@ -12,3 +12,4 @@ fn main() {", Some((3, 4))),
            ("@@ -1 +1 @@", Some((1, 1))),
            ("@@ -0,0 +1,7 @@", Some((0, 7))),
            ("@@ -5,2 +4,0 @@", Some((2, 0))),
            ("@@@ -1,2 -1,2 +1,3 @@@", None),
            ("+@@ -1 +1 @@", None),
        ];
        for (line, expected) in cases {
            assert_eq!(parse_hunk_header(line.as_bytes()), expected, "{line}");
        }
    }
}
