//! A GitHub App's installation tokens against the fake GitHub (`sortie-testkit`), which verifies the
//! App's JWT with the test key's public half and mints tokens in both of GitHub's formats: keys in both
//! PEM forms sign, a token is scoped to its one repository and used by the fake's pull-request routes,
//! it is cached, a refused one is minted again, and the App not installed on a repository says so.

use std::sync::Arc;

use sortie_github::app::AppKey;
use sortie_github::tokens::{GitHubApp, GitHubError, RepoName, TokenCache};
use sortie_testkit::forge::GitForge;
use sortie_testkit::github_app::{FakeApp, make_app_key};

const APP_ID: &str = "424242";
const CLIENT_ID: &str = "Iv23liTESTCLIENT";

struct Fixture {
    forge: Arc<GitForge>,
    api: String,
    keys: sortie_testkit::github_app::AppKeyFiles,
    _stub: sortie_testkit::http::Stub,
    _dir: tempfile::TempDir,
}

async fn fixture() -> Fixture {
    // The process's TLS provider, as `sortie serve` installs it for the forge client.
    let _ = rustls::crypto::ring::default_provider().install_default();
    let dir = tempfile::tempdir().expect("temp");
    let keys = make_app_key(&dir.path().join("key"));
    let forge = GitForge::new(&dir.path().join("repos"), "a-personal-token");
    let mut app = FakeApp::new(APP_ID, CLIENT_ID, keys.public_der.clone());
    app.install("octo-org/service", 77);
    app.install("octo-org/other", 77);
    forge.install_app(app);
    let stub = sortie_testkit::http::serve(forge.router()).await;
    Fixture {
        api: stub.url(),
        forge,
        keys,
        _stub: stub,
        _dir: dir,
    }
}

fn app(fixture: &Fixture, pem: &std::path::Path, issuer: &str) -> GitHubApp {
    let key = AppKey::from_pem(&std::fs::read(pem).expect("pem")).expect("an RSA key");
    GitHubApp::new(&fixture.api, issuer, key, reqwest::Client::new())
}

/// What the fake answers to listing `repo`'s pull requests with `token` as the bearer.
async fn pulls_status(fixture: &Fixture, repo: &str, token: &str) -> u16 {
    reqwest::Client::new()
        .get(format!("{}/repos/{repo}/pulls", fixture.api))
        .bearer_auth(token)
        .send()
        .await
        .expect("the fake answers")
        .status()
        .as_u16()
}

fn minted(fixture: &Fixture) -> usize {
    fixture.forge.with_app(|app| app.minted.len()).unwrap_or_default()
}

#[tokio::test]
async fn an_installation_token_is_minted_for_one_repository_cached_and_minted_again_once_refused() {
    let fixture = fixture().await;
    let service = RepoName::parse("octo-org/service").expect("name");
    // GitHub's download (PKCS#1) with the App ID as issuer.
    let tokens = TokenCache::new(app(&fixture, &fixture.keys.pkcs1_pem, APP_ID));
    let first = tokens.token(&service).await.expect("a token");
    assert!(first.token().starts_with("ghs_"), "{first:?}");
    let asked = fixture.forge.with_app(|app| app.minted[0].clone()).expect("minted");
    assert_eq!(asked.repositories, vec!["octo-org/service".to_owned()]);
    assert_eq!(asked.permissions.get("contents").map(String::as_str), Some("write"));
    assert_eq!(
        asked.permissions.get("pull_requests").map(String::as_str),
        Some("write")
    );
    assert_eq!(asked.permissions.get("metadata").map(String::as_str), Some("read"));
    assert_eq!(pulls_status(&fixture, "octo-org/service", first.token()).await, 200);
    assert_eq!(
        pulls_status(&fixture, "octo-org/other", first.token()).await,
        401,
        "scoped to its one repository"
    );

    // Cached: no second mint while it is fresh.
    let again = tokens.token(&service).await.expect("a token");
    assert_eq!(again.token(), first.token());
    assert_eq!(minted(&fixture), 1);

    // It expires early (as after an hour): the forge refuses it, and the next use gets a new one.
    fixture.forge.with_app(FakeApp::expire_all);
    assert_eq!(pulls_status(&fixture, "octo-org/service", first.token()).await, 401);
    tokens.refused(&service, first.token()).await;
    let renewed = tokens.token(&service).await.expect("a new token");
    assert_ne!(renewed.token(), first.token());
    assert_eq!(pulls_status(&fixture, "octo-org/service", renewed.token()).await, 200);
    // A refusal of the old token again leaves the new one alone.
    tokens.refused(&service, first.token()).await;
    assert_eq!(tokens.token(&service).await.expect("token").token(), renewed.token());
    assert_eq!(minted(&fixture), 2);
}

#[tokio::test]
async fn a_pkcs8_key_and_the_client_id_sign_too_and_stateless_tokens_work_as_the_classic_ones() {
    let fixture = fixture().await;
    fixture.forge.with_app(|app| app.stateless = true);
    let tokens = TokenCache::new(app(&fixture, &fixture.keys.pkcs8_pem, CLIENT_ID));
    let service = RepoName::parse("octo-org/service").expect("name");
    let token = tokens.token(&service).await.expect("a token");
    assert!(
        token.token().len() > 500 && token.token().matches('.').count() == 2,
        "the stateless form: {} chars",
        token.token().len()
    );
    assert_eq!(pulls_status(&fixture, "octo-org/service", token.token()).await, 200);
}

#[tokio::test]
async fn an_app_not_installed_or_signing_with_another_key_gets_githubs_refusal() {
    let fixture = fixture().await;
    let tokens = TokenCache::new(app(&fixture, &fixture.keys.pkcs1_pem, APP_ID));
    let elsewhere = RepoName::parse("someone/else").expect("name");
    let error = tokens.token(&elsewhere).await.expect_err("not installed");
    assert!(matches!(error, GitHubError::NotInstalled(_)), "{error}");
    assert!(error.to_string().contains("someone/else"), "{error}");

    let other_key = make_app_key(&fixture._dir.path().join("other-key"));
    let impostor = TokenCache::new(app(&fixture, &other_key.pkcs1_pem, APP_ID));
    let service = RepoName::parse("octo-org/service").expect("name");
    let error = impostor.token(&service).await.expect_err("a key GitHub does not know");
    assert!(
        matches!(&error, GitHubError::Refused { status: 401, message } if message.contains("JSON web token")),
        "{error}"
    );
    let wrong_issuer = TokenCache::new(app(&fixture, &fixture.keys.pkcs1_pem, "999"));
    let error = wrong_issuer.token(&service).await.expect_err("another App");
    assert!(matches!(error, GitHubError::Refused { status: 401, .. }), "{error}");
    assert_eq!(minted(&fixture), 0, "nothing was minted for them");
}
