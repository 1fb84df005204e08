//! The GitHub App side of the fake forge ([`crate::forge::GitForge::install_app`]): an App with a test
//! RSA key, installed on some repositories, that verifies the App's RS256 JWT as GitHub does (a
//! signature by the App's key, `iss` its App ID or client ID, `exp` no more than ten minutes ahead, with
//! GitHub's words when it is) and mints installation tokens in both of GitHub's formats — the classic
//! 40 characters and the stateless `ghs_` JWT form of about 520 — each scoped to the repositories and
//! permissions asked for, living an hour, expirable on demand.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use base64::Engine;

/// A test App key, made by the `openssl` CLI: the PKCS#1 PEM GitHub hands out, its PKCS#8 form, and
/// the public key (PKCS#1 DER) the fake verifies with.
pub struct AppKeyFiles {
    pub pkcs1_pem: PathBuf,
    pub pkcs8_pem: PathBuf,
    pub public_der: Vec<u8>,
}

/// Makes a 2048-bit App key under `dir`.
pub fn make_app_key(dir: &Path) -> AppKeyFiles {
    std::fs::create_dir_all(dir).expect("key dir");
    let openssl = |args: &[&str]| crate::forge::openssl(dir, args);
    openssl(&["genrsa", "-traditional", "-out", "app.pem", "2048"]);
    openssl(&["pkcs8", "-topk8", "-nocrypt", "-in", "app.pem", "-out", "app.pkcs8.pem"]);
    openssl(&[
        "rsa",
        "-in",
        "app.pem",
        "-RSAPublicKey_out",
        "-outform",
        "DER",
        "-out",
        "app.pub.der",
    ]);
    AppKeyFiles {
        pkcs1_pem: dir.join("app.pem"),
        pkcs8_pem: dir.join("app.pkcs8.pem"),
        public_der: std::fs::read(dir.join("app.pub.der")).expect("public key"),
    }
}

/// An installation token the fake minted.
#[derive(Clone, Debug)]
pub struct MintedToken {
    pub token: String,
    pub installation_id: u64,
    /// `owner/name` of each repository it may reach.
    pub repositories: Vec<String>,
    pub permissions: BTreeMap<String, String>,
    pub expires_at: SystemTime,
    pub expired: bool,
}

/// The App, its installations and the tokens it minted.
pub struct FakeApp {
    pub app_id: String,
    pub client_id: String,
    public_der: Vec<u8>,
    /// Installation id by repository (`owner/name`).
    installed: BTreeMap<String, u64>,
    pub minted: Vec<MintedToken>,
    /// Mint the stateless (~520 characters) format unless a request asks otherwise.
    pub stateless: bool,
}

/// Why a JWT is refused: GitHub's `message`.
pub type Refusal = String;

impl FakeApp {
    pub fn new(app_id: &str, client_id: &str, public_der: Vec<u8>) -> Self {
        Self {
            app_id: app_id.to_owned(),
            client_id: client_id.to_owned(),
            public_der,
            installed: BTreeMap::new(),
            minted: Vec::new(),
            stateless: false,
        }
    }

    pub fn install(&mut self, repository: &str, installation_id: u64) {
        self.installed.insert(repository.to_owned(), installation_id);
    }

    pub fn installation(&self, repository: &str) -> Option<u64> {
        self.installed.get(repository).copied()
    }

    /// The repositories (`owner/name`) installation `installation_id` holds.
    pub fn repositories_of(&self, installation_id: u64) -> Vec<String> {
        self.installed
            .iter()
            .filter(|(_, id)| **id == installation_id)
            .map(|(repo, _)| repo.clone())
            .collect()
    }

    /// Checks `Authorization: Bearer <jwt>` as GitHub does.
    pub fn verify_jwt(&self, authorization: Option<&str>, now: SystemTime) -> Result<(), Refusal> {
        let jwt = authorization
            .and_then(|value| value.strip_prefix("Bearer "))
            .ok_or("A JSON web token could not be decoded")?;
        let mut parts = jwt.split('.');
        let (Some(header), Some(claims), Some(signature), None) =
            (parts.next(), parts.next(), parts.next(), parts.next())
        else {
            return Err("A JSON web token could not be decoded".into());
        };
        let decode = |part: &str| base64::engine::general_purpose::URL_SAFE_NO_PAD.decode(part);
        let (Ok(header_json), Ok(claims_json), Ok(signature)) = (decode(header), decode(claims), decode(signature))
        else {
            return Err("A JSON web token could not be decoded".into());
        };
        let header: serde_json::Value =
            serde_json::from_slice(&header_json).map_err(|_| "A JSON web token could not be decoded")?;
        if header["alg"] != "RS256" {
            return Err("A JSON web token could not be decoded".into());
        }
        let key =
            ring::signature::UnparsedPublicKey::new(&ring::signature::RSA_PKCS1_2048_8192_SHA256, &self.public_der);
        if key.verify(parts_prefix(jwt).as_bytes(), &signature).is_err() {
            return Err("A JSON web token could not be decoded".into());
        }
        let claims: serde_json::Value =
            serde_json::from_slice(&claims_json).map_err(|_| "A JSON web token could not be decoded")?;
        let issuer = match &claims["iss"] {
            serde_json::Value::String(text) => text.clone(),
            serde_json::Value::Number(number) => number.to_string(),
            _ => String::new(),
        };
        if issuer != self.app_id && issuer != self.client_id {
            return Err("Integration not found".into());
        }
        let now = now.duration_since(UNIX_EPOCH).unwrap_or_default().as_secs();
        let (Some(iat), Some(exp)) = (claims["iat"].as_u64(), claims["exp"].as_u64()) else {
            return Err("A JSON web token could not be decoded".into());
        };
        if exp > now + 600 {
            return Err("'Expiration time' claim ('exp') is too far in the future".into());
        }
        if exp <= now {
            return Err("'Expiration time' claim ('exp') must be a numeric value representing the future time at which the assertion expires".into());
        }
        if iat > now + 60 {
            return Err(
                "'Issued at' claim ('iat') must be an Integer representing the time that the assertion was issued"
                    .into(),
            );
        }
        Ok(())
    }

    /// Mints a token of `installation_id` for `repositories` (all its repositories when empty).
    pub fn mint(
        &mut self,
        installation_id: u64,
        repositories: &[String],
        permissions: BTreeMap<String, String>,
        stateless: bool,
        now: SystemTime,
    ) -> MintedToken {
        let serial = self.minted.len() + 1;
        let token = if stateless {
            // The stateless form: `ghs_` and a JWT-shaped body, about 520 characters.
            let body = "s".repeat(160);
            format!("ghs_{serial:04}{}.{}.{}", "h".repeat(120), body, "t".repeat(230))
        } else {
            format!("ghs_{serial:04}{}", "x".repeat(32))
        };
        let repositories = if repositories.is_empty() {
            self.repositories_of(installation_id)
        } else {
            repositories.to_vec()
        };
        let minted = MintedToken {
            token,
            installation_id,
            repositories,
            permissions,
            expires_at: now + Duration::from_secs(3600),
            expired: false,
        };
        self.minted.push(minted.clone());
        minted
    }

    /// Whether `token` is a live token of this App that may reach `repository` (`owner/name`, or a
    /// bare `name` for the git routes, which name no owner).
    pub fn accepts(&self, token: &str, repository: &str, now: SystemTime) -> bool {
        self.minted.iter().any(|minted| {
            minted.token == token
                && !minted.expired
                && minted.expires_at > now
                && minted
                    .repositories
                    .iter()
                    .any(|repo| repo == repository || repo.rsplit('/').next() == Some(repository))
        })
    }

    /// Whether `token` is a live token of this App for `repository` that was granted `permission` at
    /// `level` or above (`write` covers `read`).
    pub fn grants(&self, token: &str, repository: &str, permission: &str, level: &str, now: SystemTime) -> bool {
        self.accepts(token, repository, now)
            && self.minted.iter().any(|minted| {
                minted.token == token
                    && minted
                        .permissions
                        .get(permission)
                        .is_some_and(|granted| granted == level || granted == "write")
            })
    }

    /// Every token minted so far stops working (as an hour passing would do).
    pub fn expire_all(&mut self) {
        for minted in &mut self.minted {
            minted.expired = true;
        }
    }
}

/// `header.claims` of a JWT.
fn parts_prefix(jwt: &str) -> &str {
    jwt.rsplit_once('.').map_or(jwt, |(signed, _)| signed)
}

/// `sha256=<hex>`: GitHub's `X-Hub-Signature-256` of `body` under `secret`.
pub fn hub_signature(secret: &str, body: &[u8]) -> String {
    use hmac::{KeyInit, Mac};
    let mut mac = match <hmac::Hmac<sha2::Sha256> as KeyInit>::new_from_slice(secret.as_bytes()) {
        Ok(mac) => mac,
        Err(_) => return String::new(),
    };
    mac.update(body);
    let hex: String = mac.finalize().into_bytes().iter().map(|b| format!("{b:02x}")).collect();
    format!("sha256={hex}")
}

/// A webhook delivery as GitHub's hookshot sends it.
pub struct Delivery<'a> {
    pub event: &'a str,
    pub id: &'a str,
    /// The App's ID (`X-GitHub-Hook-Installation-Target-ID`).
    pub app_id: &'a str,
    pub payload: serde_json::Value,
}

/// POSTs `delivery` to `url`, signed with `secret` (`None`: with no signature), with GitHub's headers;
/// the answer's status and body.
pub async fn deliver(url: &str, secret: Option<&str>, delivery: &Delivery<'_>) -> (u16, String) {
    let body = delivery.payload.to_string();
    let mut request = reqwest::Client::new()
        .post(url)
        .header("content-type", "application/json")
        .header("user-agent", "GitHub-Hookshot/5a1c9e1")
        .header("x-github-event", delivery.event)
        .header("x-github-delivery", delivery.id)
        .header("x-github-hook-id", "12345")
        .header("x-github-hook-installation-target-type", "integration")
        .header("x-github-hook-installation-target-id", delivery.app_id);
    if let Some(secret) = secret {
        request = request.header("x-hub-signature-256", hub_signature(secret, body.as_bytes()));
    }
    match request.body(body).send().await {
        Ok(answer) => {
            let status = answer.status().as_u16();
            (status, answer.text().await.unwrap_or_default())
        }
        Err(error) => (0, error.to_string()),
    }
}

/// The author of a comment in a payload.
pub struct Author<'a> {
    pub login: &'a str,
    /// `User` or `Bot`.
    pub kind: &'a str,
}

/// An `issue_comment` payload (after `@octokit/webhooks-examples`), on issue `number` of
/// `repo_url` (`https://host/owner/name`); `pull_url` makes the issue a pull request.
pub fn issue_comment_payload(
    action: &str,
    repo_url: &str,
    number: u64,
    pull_url: Option<&str>,
    comment_id: u64,
    author: &Author<'_>,
    body: &str,
) -> serde_json::Value {
    let full_name = repo_url.splitn(4, '/').nth(3).unwrap_or_default();
    let user = serde_json::json!({"login": author.login, "id": 1, "type": author.kind});
    let mut issue = serde_json::json!({
        "number": number, "title": "Keep a changelog", "body": "Every release should say what changed.",
        "html_url": format!("{repo_url}/issues/{number}"), "state": "open", "user": user,
    });
    if let Some(pull_url) = pull_url {
        issue["pull_request"] = serde_json::json!({"url": pull_url, "html_url": pull_url});
    }
    serde_json::json!({
        "action": action,
        "issue": issue,
        "comment": {
            "id": comment_id, "body": body, "user": user, "author_association": "MEMBER",
            "html_url": format!("{repo_url}/issues/{number}#issuecomment-{comment_id}"),
            "performed_via_github_app": null,
        },
        "repository": {"full_name": full_name, "html_url": repo_url, "private": true},
        "sender": user,
        "installation": {"id": 99},
    })
}

/// An `issues` payload for issue `number` of `repo_url` assigned to `assignee` by `sender`.
pub fn issue_assigned_payload(repo_url: &str, number: u64, assignee: &str, sender: &Author<'_>) -> serde_json::Value {
    let full_name = repo_url.splitn(4, '/').nth(3).unwrap_or_default();
    let user = serde_json::json!({"login": sender.login, "id": 1, "type": sender.kind});
    serde_json::json!({
        "action": "assigned",
        "issue": {
            "number": number, "title": "Document the flags", "body": "Nobody knows what --quiet does.",
            "html_url": format!("{repo_url}/issues/{number}"), "state": "open", "user": user,
            "assignees": [{"login": assignee, "type": "Bot"}],
        },
        "assignee": {"login": assignee, "id": 2, "type": "Bot"},
        "repository": {"full_name": full_name, "html_url": repo_url, "private": true},
        "sender": user,
        "installation": {"id": 99},
    })
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_hub_signature_is_githubs_test_vector() {
        assert_eq!(
            super::hub_signature("It's a Secret to Everybody", b"Hello, World!"),
            "sha256=757107ea0eb2509fc211221cce984b8a37570b6d7586c22c46f4379c8b043e17"
        );
    }
}
