//! The control plane, endpoint by endpoint: each happy path and each error code, in-process and over
//! a real socket, on SQLite and on PostgreSQL.

mod harness;

use axum::http::{Method, StatusCode};
use harness::{Harness, Payload, Reply, TICKET_SECRET, Transport};
use serde_json::{Value, json};
use sortie_protocol::api::TicketAction;
use sortie_protocol::limits::{
    MESSAGES_PAGE_MAX_BYTES, MESSAGES_PAGE_TURNS_DEFAULT, MESSAGES_PAGE_TURNS_MAX, PROMPT_MAX_BYTES,
    REQUEST_BODY_MAX_BYTES, SETUP_MAX_BYTES, TURN_PART_BYTES_MAX, TURN_PARTS_MAX, TURN_QUEUE_MAX,
};
use sortie_protocol::{SessionId, SessionPhase, TurnStatus};
use sortie_store::{
    ControlPlane, Ledger, NewPart, SandboxReading, Secrets, TokenUsage, Transcripts, TurnOutcome, testing::TestBackend,
};

/// One test per (transport, database) for each story.
macro_rules! on_every_server {
    ($($name:ident),* $(,)?) => {
        mod in_process_sqlite {
            $(#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $name() { super::$name(super::Harness::start(super::Transport::InProcess, super::TestBackend::Sqlite).await).await; })*
        }
        mod socket_sqlite {
            $(#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $name() { super::$name(super::Harness::start(super::Transport::Socket, super::TestBackend::Sqlite).await).await; })*
        }
        mod in_process_postgres {
            $(#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $name() {
                if sortie_store::testing::postgres_available(stringify!($name)).await {
                    super::$name(super::Harness::start(super::Transport::InProcess, super::TestBackend::Postgres).await).await;
                }
            })*
        }
        mod socket_postgres {
            $(#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $name() {
                if sortie_store::testing::postgres_available(stringify!($name)).await {
                    super::$name(super::Harness::start(super::Transport::Socket, super::TestBackend::Postgres).await).await;
                }
            })*
        }
    };
}

on_every_server!(
    create_accepts_a_valid_session,
    create_refuses_each_invalid_field_and_writes_nothing,
    create_checks_repository_access,
    list_pages_and_filters,
    read_endpoints_answer_and_miss,
    agents_are_listed_with_the_default,
    messages_assemble_stored_parts,
    messages_come_in_pages_of_turns_with_cursors,
    a_messages_page_stops_after_the_turn_that_fills_its_byte_budget,
    steer_adds_turns_and_refuses_with_codes,
    steer_refuses_past_the_session_prompt_budget,
    stop_needs_a_running_turn,
    cancel_ends_the_session_once,
    resume_wakes_hibernated_sessions_only,
    archive_hides_resting_sessions,
    attach_tickets_are_signed_for_one_session_and_action,
    usage_sums_by_session_and_day,
    another_workspace_sees_nothing,
    roles_and_tokens_are_enforced_everywhere,
    malformed_input_never_answers_500,
    operations_endpoints_answer,
    unknown_routes_and_methods_have_codes,
    concurrent_steers_get_distinct_numbers,
    cancel_racing_steers_keeps_the_ledger_consistent,
    egress_allowlists_are_amended,
    model_keys_are_set_listed_and_removed_by_admins_only,
    model_keys_refuse_bad_apis_and_bad_keys_and_write_nothing,
    model_keys_stay_in_their_workspace_and_sealed_at_rest,
    forge_connections_are_set_listed_and_removed_by_admins_only,
    events_tell_the_workspaces_changes_in_order_and_resume_after_the_last_seen,
    idempotency_keys_give_a_retry_the_first_answer,
    webhooks_are_added_listed_and_removed_by_admins_only,
    tokens_are_listed_created_once_and_revoked_by_admins_only,
    presets_are_kept_per_repository_checked_like_a_session,
    budgets_default_from_the_workspace_and_are_raised,
    quotas_refuse_creation_past_the_limit_with_details,
);

/// Security review S8 over a real socket, on each database (the flood is stored once per test).
mod flooded_turn {
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn sqlite() {
        let h = super::Harness::start(super::Transport::Socket, super::TestBackend::Sqlite).await;
        super::messages_of_a_flooded_turn_answer_fast_and_in_parallel(h).await;
    }
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn postgres() {
        if !sortie_store::testing::postgres_available("messages_of_a_flooded_turn_answer_fast_and_in_parallel").await {
            return;
        }
        let h = super::Harness::start(super::Transport::Socket, super::TestBackend::Postgres).await;
        super::messages_of_a_flooded_turn_answer_fast_and_in_parallel(h).await;
    }
}

/// A model key no answer may ever show, whole or but for its fingerprint.
const MODEL_KEY: &str = "sk-ant-api03-NEVER-SHOWN-5ecret-value-0123456789abcd";

/// Every answer a model-key story saw, to check afterwards that none holds the key.
#[derive(Default)]
struct Answers(std::sync::Mutex<Vec<Vec<u8>>>);

impl Answers {
    fn keep(&self, reply: Reply) -> Reply {
        self.0.lock().expect("answers").push(reply.raw.clone());
        reply
    }

    fn assert_none_holds(&self, key: &str) {
        let hidden = &key[..key.len() - 4];
        for raw in self.0.lock().expect("answers").iter() {
            let text = String::from_utf8_lossy(raw);
            assert!(!text.contains(hidden), "an answer shows the key: {text}");
        }
    }
}

async fn put_model_key(h: &Harness, token: &str, api: &str, body: Value) -> Reply {
    h.send(
        Method::PUT,
        &format!("/v1/model-keys/{api}"),
        Some(token),
        Payload::Json(body),
    )
    .await
}

async fn forge_connections_are_set_listed_and_removed_by_admins_only(h: Harness) {
    const TOKEN: &str = "ghp_NEVER-SHOWN-forge-token-0123456789wxyz";
    let answers = Answers::default();
    let put = |token: &'static str, host: &'static str, body: Value| {
        let h = &h;
        let token = match token {
            "admin" => h.admin.clone(),
            "operator" => h.operator.clone(),
            _ => h.viewer.clone(),
        };
        async move {
            h.send(
                Method::PUT,
                &format!("/v1/forge-connections/{host}"),
                Some(&token),
                Payload::Json(body),
            )
            .await
        }
    };
    let set = answers.keep(put("admin", "GitHub.com", json!({"token": TOKEN})).await);
    assert_eq!(set.status, StatusCode::OK, "{}", set.body);
    let mut fields: Vec<&str> = set
        .body
        .as_object()
        .expect("object")
        .keys()
        .map(String::as_str)
        .collect();
    fields.sort_unstable();
    assert_eq!(
        fields,
        ["api_base", "created_at", "fingerprint", "host", "kind"],
        "never the token"
    );
    assert_eq!(
        (
            &set.body["host"],
            &set.body["kind"],
            &set.body["api_base"],
            &set.body["fingerprint"]
        ),
        (
            &json!("github.com"),
            &json!("github"),
            &json!("https://api.github.com"),
            &json!("wxyz")
        )
    );
    let plain = answers.keep(
        put(
            "admin",
            "git.example.com:8443",
            json!({"token": "tok-1234", "kind": "git"}),
        )
        .await,
    );
    assert_eq!((plain.status, &plain.body["api_base"]), (StatusCode::OK, &json!("")));
    let listed = answers.keep(h.get("/v1/forge-connections", &h.admin).await);
    assert_eq!(listed.body["connections"], json!([plain.body, set.body]), "by host");

    for role in ["operator", "viewer"] {
        let refused = answers.keep(put(role, "github.com", json!({"token": TOKEN})).await);
        assert_error(&refused, StatusCode::FORBIDDEN, "FORBIDDEN");
    }
    for (host, body) in [
        ("github.com", json!({"token": "has space"})),
        ("github.com", json!({"token": ""})),
        ("github.com", json!({"token": TOKEN, "api_base": "http://plain"})),
        ("github.com", json!({"token": TOKEN, "kind": "gitlab"})),
        ("bad_host", json!({"token": TOKEN})),
        ("x:99999", json!({"token": TOKEN})),
        (
            "github.com",
            json!({"github_app": {"app_id": "42", "private_key": "not a key"}}),
        ),
        (
            "github.com",
            json!({"github_app": {"app_id": "4 2", "private_key": "x"}}),
        ),
        (
            "github.com",
            json!({"token": TOKEN, "github_app": {"app_id": "42", "private_key": "x"}}),
        ),
        (
            "github.com",
            json!({"kind": "git", "github_app": {"app_id": "42", "private_key": "x"}}),
        ),
        ("github.com", json!({"github_app": {"app_id": "42"}})),
    ] {
        let refused = answers.keep(put("admin", host, body.clone()).await);
        assert!(
            refused.status == StatusCode::BAD_REQUEST
                && ["FORGE_CONNECTION_INVALID", "INVALID_REQUEST"]
                    .contains(&refused.body["error"]["code"].as_str().unwrap_or("")),
            "{host} {body}: {} {}",
            refused.status,
            refused.body
        );
    }
    let unchanged = answers.keep(h.get("/v1/forge-connections", &h.admin).await);
    assert_eq!(unchanged.body, listed.body, "a refusal writes nothing");

    // A GitHub App instead of a token: its ID shown, its key never.
    let dir = tempfile::tempdir().expect("temp");
    let keys = sortie_testkit::github_app::make_app_key(dir.path());
    let pem = std::fs::read_to_string(&keys.pkcs8_pem).expect("pem");
    let app = answers.keep(
        put(
            "admin",
            "ghe.example.com",
            json!({"github_app": {"app_id": "Iv23liCLIENT", "private_key": pem}}),
        )
        .await,
    );
    assert_eq!(app.status, StatusCode::OK, "{}", app.body);
    assert_eq!(
        (&app.body["app_id"], &app.body["api_base"]),
        (&json!("Iv23liCLIENT"), &json!("https://ghe.example.com/api/v3"))
    );
    assert!(
        app.body["fingerprint"].as_str().is_some_and(|f| !f.contains('-')),
        "{}",
        app.body
    );
    let key_line = pem.lines().nth(2).expect("key material").to_owned();
    answers.keep(h.get("/v1/forge-connections", &h.admin).await);
    answers.assert_none_holds(&key_line);

    // Its webhook secret and triggers: the secret never shown, the agent named when none is given.
    const HOOK_SECRET: &str = "hook-secret-0123456789";
    let app_with = |extra: Value| {
        let mut app = json!({"app_id": "77", "private_key": pem, "webhook_secret": HOOK_SECRET});
        if let (Some(app), Some(extra)) = (app.as_object_mut(), extra.as_object()) {
            app.extend(extra.clone());
        }
        app
    };
    let triggered = answers.keep(
        put(
            "admin",
            "ghe.example.com",
            json!({"github_app": app_with(json!({})), "triggers": {"repositories": ["acme/app", "tools/*"]}}),
        )
        .await,
    );
    assert_eq!(triggered.status, StatusCode::OK, "{}", triggered.body);
    assert_eq!(triggered.body["webhook"], json!(true), "{}", triggered.body);
    assert_eq!(
        triggered.body["triggers"],
        json!({"repositories": ["acme/app", "tools/*"], "agent": sortie_protocol::agents::DEFAULT_AGENT, "others_pull_requests": false})
    );
    for (body, code) in [
        (
            json!({"github_app": app_with(json!({"app_id": "Iv23liCLIENT"}))}),
            "FORGE_CONNECTION_INVALID",
        ),
        (
            json!({"github_app": app_with(json!({"webhook_secret": "short"}))}),
            "FORGE_CONNECTION_INVALID",
        ),
        (
            json!({"token": TOKEN, "triggers": {"repositories": ["acme/app"]}}),
            "FORGE_CONNECTION_INVALID",
        ),
        (
            json!({"github_app": app_with(json!({})), "triggers": {"repositories": ["acme"]}}),
            "FORGE_CONNECTION_INVALID",
        ),
        (
            json!({"github_app": app_with(json!({})), "triggers": {"repositories": ["a/../b"]}}),
            "FORGE_CONNECTION_INVALID",
        ),
        (
            json!({"github_app": app_with(json!({})), "triggers": {"repositories": ["a/b"], "dashboard_url": "javascript:x"}}),
            "FORGE_CONNECTION_INVALID",
        ),
        (
            json!({"github_app": app_with(json!({})), "triggers": {"repositories": ["a/b"], "agent": "nope"}}),
            "AGENT_UNKNOWN",
        ),
        (
            json!({"github_app": app_with(json!({})), "triggers": {"repositories": ["a/b"], "egress_allow": ["*"]}}),
            "EGRESS_ALLOWLIST_INVALID",
        ),
    ] {
        let refused = answers.keep(put("admin", "ghe.example.com", body.clone()).await);
        assert_eq!(
            (refused.status, refused.code()),
            (StatusCode::BAD_REQUEST, code),
            "{body}: {}",
            refused.body
        );
    }
    answers.assert_none_holds(HOOK_SECRET);

    // The webhook endpoint takes no bearer: a delivery counts only when the App's secret signs it.
    let hook = |headers: Vec<(&'static str, String)>, body: &'static str| {
        let h = &h;
        async move {
            let extra: Vec<(&str, &str)> = headers.iter().map(|(k, v)| (*k, v.as_str())).collect();
            h.send_with_headers(
                Method::POST,
                "/v1/forges/github/webhook",
                None,
                &extra,
                Payload::Raw {
                    content_type: Some("application/json"),
                    bytes: body.as_bytes().to_vec(),
                },
            )
            .await
        }
    };
    let signed = |event: &str, id: &str, secret: &str, body: &str| {
        vec![
            ("x-github-event", event.to_owned()),
            ("x-github-delivery", id.to_owned()),
            ("x-github-hook-installation-target-id", "77".to_owned()),
            (
                "x-hub-signature-256",
                sortie_testkit::github_app::hub_signature(secret, body.as_bytes()),
            ),
        ]
    };
    let missing = hook(vec![("x-github-event", "ping".into())], "{}").await;
    assert_eq!(
        (missing.status, missing.code()),
        (StatusCode::BAD_REQUEST, "INVALID_REQUEST"),
        "{}",
        missing.body
    );
    let forged = hook(signed("ping", "d-1", "another-secret-entirely", "{}"), "{}").await;
    assert_eq!(
        (forged.status, forged.code()),
        (StatusCode::UNAUTHORIZED, "WEBHOOK_SIGNATURE_INVALID")
    );
    let unsigned = hook(signed("ping", "d-1", HOOK_SECRET, "{}")[..3].to_vec(), "{}").await;
    assert_eq!(unsigned.status, StatusCode::UNAUTHORIZED);
    let tampered = hook(signed("ping", "d-1", HOOK_SECRET, "{}"), "{ }").await;
    assert_eq!(tampered.status, StatusCode::UNAUTHORIZED);
    let ping = hook(signed("ping", "d-1", HOOK_SECRET, "{}"), "{}").await;
    assert_eq!(
        (ping.status, &ping.body["status"]),
        (StatusCode::OK, &json!("pong")),
        "{}",
        ping.body
    );
    let push = hook(signed("push", "d-2", HOOK_SECRET, "{}"), "{}").await;
    assert_eq!((push.status, &push.body["status"]), (StatusCode::OK, &json!("ignored")));
    // What cannot be a request is not kept.
    let junk = "{\"action\":\"created\"}";
    let kept = hook(signed("issue_comment", "d-4", HOOK_SECRET, junk), junk).await;
    assert_eq!((kept.status, &kept.body["status"]), (StatusCode::OK, &json!("ignored")));
    let comment = r#"{"action":"created","issue":{"number":1},"comment":{"id":2,"body":"@sortie hi","user":{"login":"o","type":"User"}},"repository":{"full_name":"acme/app","html_url":"https://ghe.example.com/acme/app"}}"#;
    let first = hook(signed("issue_comment", "d-3", HOOK_SECRET, comment), comment).await;
    assert_eq!(
        (first.status, &first.body["status"]),
        (StatusCode::ACCEPTED, &json!("accepted"))
    );
    let replay = hook(signed("issue_comment", "d-3", HOOK_SECRET, comment), comment).await;
    assert_eq!(
        (replay.status, &replay.body["status"]),
        (StatusCode::OK, &json!("duplicate"))
    );
    let path = "/v1/forge-connections/ghe.example.com";
    let removed = h.send(Method::DELETE, path, Some(&h.admin), Payload::Empty).await;
    assert_eq!(removed.status, StatusCode::NO_CONTENT);

    let path = "/v1/forge-connections/github.com";
    let removed = h.send(Method::DELETE, path, Some(&h.admin), Payload::Empty).await;
    assert_eq!(removed.status, StatusCode::NO_CONTENT);
    let again = answers.keep(h.send(Method::DELETE, path, Some(&h.admin), Payload::Empty).await);
    assert_error(&again, StatusCode::NOT_FOUND, "FORGE_CONNECTION_NOT_FOUND");
    answers.assert_none_holds(TOKEN);
}

async fn tokens_are_listed_created_once_and_revoked_by_admins_only(h: Harness) {
    let created = h
        .send(
            Method::POST,
            "/v1/tokens",
            Some(&h.admin),
            Payload::Json(json!({"role": "operator", "label": "ci"})),
        )
        .await;
    assert_eq!(created.status, StatusCode::CREATED, "{}", created.body);
    let secret = created.body["token"].as_str().expect("the secret, once").to_owned();
    let id = created.body["info"]["id"].as_str().expect("id").to_owned();
    // The new token works, at its role.
    let seen = h.get("/v1/sessions", &secret).await;
    assert_eq!(seen.status, StatusCode::OK, "{}", seen.body);
    let listed = h.get("/v1/tokens", &h.admin).await;
    assert_eq!(listed.status, StatusCode::OK);
    assert!(
        !listed.body.to_string().contains(&secret),
        "a list never shows a secret"
    );
    let mine = listed.body["tokens"]
        .as_array()
        .expect("tokens")
        .iter()
        .find(|t| t["id"] == id.as_str())
        .expect("the new token is listed")
        .clone();
    assert_eq!(
        (&mine["role"], &mine["label"], &mine["revoked_at"], &mine["current"]),
        (&json!("operator"), &json!("ci"), &Value::Null, &json!(false))
    );
    assert_eq!(
        listed.body["tokens"]
            .as_array()
            .expect("tokens")
            .iter()
            .filter(|t| t["current"] == true)
            .count(),
        1,
        "the caller's own token is marked"
    );
    for token in [&h.operator, &h.viewer] {
        assert_error(&h.get("/v1/tokens", token).await, StatusCode::FORBIDDEN, "FORBIDDEN");
        let refused = h
            .send(
                Method::POST,
                "/v1/tokens",
                Some(token),
                Payload::Json(json!({"role": "admin"})),
            )
            .await;
        assert_error(&refused, StatusCode::FORBIDDEN, "FORBIDDEN");
    }
    let bad = h
        .send(
            Method::POST,
            "/v1/tokens",
            Some(&h.admin),
            Payload::Json(json!({"role": "root"})),
        )
        .await;
    assert_error(&bad, StatusCode::BAD_REQUEST, "INVALID_REQUEST");
    // Revoked: it signs nothing in any more; twice is a miss; the caller's own cannot go.
    let path = format!("/v1/tokens/{id}");
    let revoked = h.send(Method::DELETE, &path, Some(&h.admin), Payload::Empty).await;
    assert_eq!(revoked.status, StatusCode::NO_CONTENT, "{}", revoked.body);
    assert_error(
        &h.get("/v1/sessions", &secret).await,
        StatusCode::UNAUTHORIZED,
        "UNAUTHORIZED",
    );
    assert_error(
        &h.send(Method::DELETE, &path, Some(&h.admin), Payload::Empty).await,
        StatusCode::NOT_FOUND,
        "TOKEN_NOT_FOUND",
    );
    let own = listed.body["tokens"]
        .as_array()
        .expect("tokens")
        .iter()
        .find(|t| t["current"] == true)
        .expect("own")["id"]
        .as_str()
        .expect("id")
        .to_owned();
    let refused = h
        .send(
            Method::DELETE,
            &format!("/v1/tokens/{own}"),
            Some(&h.admin),
            Payload::Empty,
        )
        .await;
    assert_error(&refused, StatusCode::CONFLICT, "TOKEN_IN_USE");
    assert_eq!(
        h.get("/v1/tokens", &h.admin).await.status,
        StatusCode::OK,
        "the admin still works"
    );

    // A token may expire: it says when, and says when it was last used (written off the request path).
    let expiring = h
        .post(
            "/v1/tokens",
            &h.admin,
            json!({"role": "viewer", "expires_in_seconds": 3600}),
        )
        .await;
    assert_eq!(expiring.status, StatusCode::CREATED, "{}", expiring.body);
    let expiring_id = expiring.body["info"]["id"].as_str().expect("id").to_owned();
    let expires_at = expiring.body["info"]["expires_at"].as_str().expect("expiry").to_owned();
    let expiring_secret = expiring.body["token"].as_str().expect("secret").to_owned();
    assert_eq!(h.get("/v1/sessions", &expiring_secret).await.status, StatusCode::OK);
    let listed_token =
        sortie_testkit::wait::eventually("the token's last use", std::time::Duration::from_secs(10), || async {
            let listed = h.get("/v1/tokens", &h.admin).await;
            listed.body["tokens"]
                .as_array()
                .and_then(|tokens| {
                    tokens
                        .iter()
                        .find(|t| t["id"] == expiring_id.as_str() && t["last_used_at"].is_string())
                        .cloned()
                })
                .ok_or(listed.body)
        })
        .await;
    assert_eq!(listed_token["expires_at"], expires_at.as_str());
    for bad in [json!(59), json!(400_000_000), json!("1h")] {
        let refused = h
            .post(
                "/v1/tokens",
                &h.admin,
                json!({"role": "viewer", "expires_in_seconds": bad}),
            )
            .await;
        assert_error(&refused, StatusCode::BAD_REQUEST, "INVALID_REQUEST");
    }
    // One that expired gets 401 on its next request, like a revoked one.
    let (lapsed, lapsed_hash) = sortie_server::tokens::generate_token().expect("token");
    let workspace = h.store.workspace_by_name("default").await.expect("workspace");
    h.store
        .create_token(
            &workspace.id,
            sortie_protocol::api::Role::Admin,
            &lapsed_hash,
            None,
            Some(sortie_store::now_ms() - 1),
        )
        .await
        .expect("token");
    assert_error(
        &h.get("/v1/sessions", &lapsed).await,
        StatusCode::UNAUTHORIZED,
        "UNAUTHORIZED",
    );

    // Every admin action above is in the audit log, newest first, with the token that did it.
    let audit = h.get("/v1/audit", &h.admin).await;
    assert_eq!(audit.status, StatusCode::OK, "{}", audit.body);
    let actions: Vec<(String, String)> = audit.body["entries"]
        .as_array()
        .expect("entries")
        .iter()
        .map(|e| {
            (
                e["action"].as_str().unwrap_or("").to_owned(),
                e["target"].as_str().unwrap_or("").to_owned(),
            )
        })
        .collect();
    assert_eq!(
        actions,
        [
            ("token.create".to_owned(), expiring_id.clone()),
            ("token.revoke".to_owned(), id.clone()),
            ("token.create".to_owned(), id.clone()),
        ]
    );
    assert!(
        audit.body["entries"]
            .as_array()
            .expect("entries")
            .iter()
            .all(|e| e["actor"] == own.as_str() && e["at"].is_string()),
        "{}",
        audit.body
    );
    let page = h.get("/v1/audit?limit=2", &h.admin).await;
    let cursor = page.body["next_cursor"].as_str().expect("a next page").to_owned();
    let rest = h.get(&format!("/v1/audit?limit=2&before={cursor}"), &h.admin).await;
    assert_eq!(rest.body["entries"][0]["target"], id.as_str());
    assert_eq!(rest.body["next_cursor"], Value::Null);
    assert_error(
        &h.get("/v1/audit", &h.operator).await,
        StatusCode::FORBIDDEN,
        "FORBIDDEN",
    );
    assert_error(
        &h.get("/v1/audit?before=x", &h.admin).await,
        StatusCode::BAD_REQUEST,
        "INVALID_REQUEST",
    );
}

async fn budgets_default_from_the_workspace_and_are_raised(h: Harness) {
    // No budget, no default: the session has none (the field is absent).
    let free = h.create("free").await;
    assert!(
        h.get(&format!("/v1/sessions/{free}"), &h.viewer)
            .await
            .body
            .get("budget")
            .is_none()
    );
    // The workspace's defaults: only an admin sets them, everyone reads them.
    let limits = json!({"budget": {"tokens": 1000, "compute_seconds": 60}, "quotas": {}});
    assert_error(
        &h.send(
            Method::PUT,
            "/v1/limits",
            Some(&h.operator),
            Payload::Json(limits.clone()),
        )
        .await,
        StatusCode::FORBIDDEN,
        "FORBIDDEN",
    );
    let set = h
        .send(Method::PUT, "/v1/limits", Some(&h.admin), Payload::Json(limits.clone()))
        .await;
    assert_eq!(set.status, StatusCode::OK, "{}", set.body);
    let read = h.get("/v1/limits", &h.viewer).await;
    assert_eq!(read.body["budget"], limits["budget"]);
    // A session takes the defaults field by field.
    let created = h
        .post(
            "/v1/sessions",
            &h.operator,
            json!({"repo": h.repo, "task": "t", "agent": "scripted", "budget": {"tokens": 500}}),
        )
        .await;
    assert_eq!(created.status, StatusCode::ACCEPTED, "{}", created.body);
    assert_eq!(
        created.body["budget"],
        json!({"tokens": 500, "compute_seconds": 60, "paused_at": null})
    );
    let id = created.body["id"].as_str().expect("id").to_owned();
    // Raised by an operator: added to the cap.
    let path = format!("/v1/sessions/{id}/budget");
    assert_error(
        &h.post(&path, &h.viewer, json!({"tokens": 100})).await,
        StatusCode::FORBIDDEN,
        "FORBIDDEN",
    );
    let raised = h
        .post(&path, &h.operator, json!({"tokens": 250, "compute_seconds": 30}))
        .await;
    assert_eq!(raised.status, StatusCode::OK, "{}", raised.body);
    assert_eq!(
        (
            &raised.body["budget"]["tokens"],
            &raised.body["budget"]["compute_seconds"]
        ),
        (&json!(750), &json!(90))
    );
    // A session without a cap gets one: what it used, plus the raise.
    let raised_free = h
        .post(
            &format!("/v1/sessions/{free}/budget"),
            &h.operator,
            json!({"tokens": 10}),
        )
        .await;
    assert_eq!(raised_free.body["budget"]["tokens"], 10, "{}", raised_free.body);
    for bad in [
        json!({}),
        json!({"tokens": 0}),
        json!({"tokens": -1}),
        json!({"tokens": 1, "dollars": 2}),
    ] {
        assert_error(
            &h.post(&path, &h.operator, bad).await,
            StatusCode::BAD_REQUEST,
            "INVALID_REQUEST",
        );
    }
    let bad_create = h
        .post(
            "/v1/sessions",
            &h.operator,
            json!({"repo": h.repo, "task": "t", "agent": "scripted", "budget": {"tokens": 0}}),
        )
        .await;
    assert_error(&bad_create, StatusCode::BAD_REQUEST, "INVALID_REQUEST");
    assert_error(
        &h.post(
            &format!("/v1/sessions/{}/budget", SessionId::generate()),
            &h.operator,
            json!({"tokens": 1}),
        )
        .await,
        StatusCode::NOT_FOUND,
        "SESSION_NOT_FOUND",
    );
    assert_error(
        &h.post(&path, &h.other_operator, json!({"tokens": 1})).await,
        StatusCode::NOT_FOUND,
        "SESSION_NOT_FOUND",
    );
    let audit = h.get("/v1/audit", &h.admin).await;
    assert_eq!(audit.body["entries"][0]["action"], "limits.set", "{}", audit.body);
}

async fn quotas_refuse_creation_past_the_limit_with_details(h: Harness) {
    let first = h.create("one").await;
    h.create("two").await;
    let set = h
        .send(
            Method::PUT,
            "/v1/limits",
            Some(&h.admin),
            Payload::Json(json!({"quotas": {"sessions_per_day": 2, "tokens_per_month": 1000}})),
        )
        .await;
    assert_eq!(set.status, StatusCode::OK, "{}", set.body);
    let before = h.session_count().await;
    let refused = h
        .post(
            "/v1/sessions",
            &h.operator,
            json!({"repo": h.repo, "task": "three", "agent": "scripted"}),
        )
        .await;
    assert_error(&refused, StatusCode::TOO_MANY_REQUESTS, "QUOTA_EXCEEDED");
    assert_eq!(
        refused.body["error"]["details"],
        json!({"quota": "sessions_per_day", "limit": 2, "used": 2})
    );
    assert_eq!(h.session_count().await, before, "nothing was written");
    // Another workspace has its own quotas.
    let other = h
        .post(
            "/v1/sessions",
            &h.other_operator,
            json!({"repo": "https://github.com/o/r.git", "task": "x", "agent": "scripted"}),
        )
        .await;
    assert_eq!(other.status, StatusCode::ACCEPTED, "{}", other.body);
    // Tokens this month past the quota: steering is refused too.
    let session_id = SessionId::parse(&first).expect("id");
    let usage = TokenUsage {
        session_id,
        turn: 1,
        model: "m".into(),
        epoch_ms: sortie_store::now_ms(),
        input_tokens: 900,
        output_tokens: 100,
    };
    h.store.record_token_usage(&usage).await.expect("usage");
    let steer = h
        .post(
            &format!("/v1/sessions/{first}/steer"),
            &h.operator,
            json!({"prompt": "more"}),
        )
        .await;
    assert_error(&steer, StatusCode::TOO_MANY_REQUESTS, "QUOTA_EXCEEDED");
    assert_eq!(
        steer.body["error"]["details"],
        json!({"quota": "tokens_per_month", "limit": 1000, "used": 1000})
    );
    let raised = h
        .send(
            Method::PUT,
            "/v1/limits",
            Some(&h.admin),
            Payload::Json(json!({"quotas": {"tokens_per_month": 5000}})),
        )
        .await;
    assert_eq!(raised.status, StatusCode::OK);
    let steer = h
        .post(
            &format!("/v1/sessions/{first}/steer"),
            &h.operator,
            json!({"prompt": "more"}),
        )
        .await;
    assert_eq!(steer.status, StatusCode::ACCEPTED, "{}", steer.body);
    assert_error(
        &h.send(
            Method::PUT,
            "/v1/limits",
            Some(&h.admin),
            Payload::Json(json!({"quotas": {"sessions_per_day": "many"}})),
        )
        .await,
        StatusCode::BAD_REQUEST,
        "INVALID_REQUEST",
    );
}

async fn presets_are_kept_per_repository_checked_like_a_session(h: Harness) {
    let repo = "https://github.com/acme/app.git";
    let set = h
        .send(
            Method::PUT,
            "/v1/presets",
            Some(&h.admin),
            Payload::Json(
                json!({"repo": repo, "agent": "scripted", "setup": "npm ci", "egress_allow": ["registry.example.org"]}),
            ),
        )
        .await;
    assert_eq!(set.status, StatusCode::OK, "{}", set.body);
    // Every role reads them (the composer applies them); only an admin changes them.
    let listed = h.get("/v1/presets", &h.viewer).await;
    assert_eq!(listed.status, StatusCode::OK);
    assert_eq!(listed.body["presets"], json!([set.body]));
    let refused = h
        .send(
            Method::PUT,
            "/v1/presets",
            Some(&h.operator),
            Payload::Json(json!({"repo": repo})),
        )
        .await;
    assert_error(&refused, StatusCode::FORBIDDEN, "FORBIDDEN");
    for (body, code) in [
        (json!({"repo": "ftp://x"}), "REPO_INVALID"),
        (json!({"repo": repo, "agent": "nobody"}), "AGENT_UNKNOWN"),
        (
            json!({"repo": repo, "egress_allow": ["bad_host!"]}),
            "EGRESS_ALLOWLIST_INVALID",
        ),
        (json!({"repo": repo, "setup": "x".repeat(70 * 1024)}), "SETUP_TOO_LARGE"),
        (json!({"repo": repo, "extra": 1}), "INVALID_REQUEST"),
    ] {
        let reply = h
            .send(Method::PUT, "/v1/presets", Some(&h.admin), Payload::Json(body.clone()))
            .await;
        assert_eq!(reply.body["error"]["code"], code, "{body}: {}", reply.body);
    }
    assert_eq!(
        h.get("/v1/presets", &h.admin).await.body,
        listed.body,
        "a refusal writes nothing"
    );
    let path = format!("/v1/presets?repo={}", "https%3A%2F%2Fgithub.com%2Facme%2Fapp.git");
    assert_eq!(
        h.send(Method::DELETE, &path, Some(&h.admin), Payload::Empty)
            .await
            .status,
        StatusCode::NO_CONTENT
    );
    assert_error(
        &h.send(Method::DELETE, &path, Some(&h.admin), Payload::Empty).await,
        StatusCode::NOT_FOUND,
        "PRESET_NOT_FOUND",
    );
}

async fn model_keys_are_set_listed_and_removed_by_admins_only(h: Harness) {
    let answers = Answers::default();
    let empty = answers.keep(h.get("/v1/model-keys", &h.admin).await);
    assert_eq!(
        (empty.status, empty.body.clone()),
        (StatusCode::OK, json!({"workspace": "default", "keys": []}))
    );

    let set = answers.keep(
        put_model_key(
            &h,
            &h.admin,
            "anthropic",
            json!({"key": MODEL_KEY, "label": "team account"}),
        )
        .await,
    );
    assert_eq!(set.status, StatusCode::OK, "{}", set.body);
    // Sorted: serde_json keeps insertion order when a dependency turns on `preserve_order`.
    let mut fields: Vec<&str> = set
        .body
        .as_object()
        .expect("object")
        .keys()
        .map(String::as_str)
        .collect();
    fields.sort_unstable();
    assert_eq!(
        fields,
        vec!["api", "created_at", "fingerprint", "label"],
        "nothing else, never the key"
    );
    assert_eq!(
        (
            set.body["api"].clone(),
            set.body["label"].clone(),
            set.body["fingerprint"].clone()
        ),
        (json!("anthropic"), json!("team account"), json!("abcd"))
    );
    assert!(is_rfc3339_utc(&set.body["created_at"]), "{}", set.body);

    let openai = answers.keep(put_model_key(&h, &h.admin, "openai", json!({"key": "sk-proj-0123456789wxyz"})).await);
    assert_eq!(
        (
            openai.status,
            openai.body["label"].clone(),
            openai.body["fingerprint"].clone()
        ),
        (StatusCode::OK, Value::Null, json!("wxyz"))
    );
    let listed = answers.keep(h.get("/v1/model-keys", &h.admin).await);
    assert_eq!(listed.status, StatusCode::OK);
    assert_eq!(listed.body["workspace"], "default");
    assert_eq!(listed.body["keys"], json!([set.body, openai.body]), "by api, as set");

    // Setting again replaces: one key per api.
    let replaced =
        answers.keep(put_model_key(&h, &h.admin, "anthropic", json!({"key": format!("{MODEL_KEY}-2nd9")})).await);
    assert_eq!(
        (
            replaced.status,
            replaced.body["fingerprint"].clone(),
            replaced.body["label"].clone()
        ),
        (StatusCode::OK, json!("2nd9"), Value::Null)
    );
    let listed = answers.keep(h.get("/v1/model-keys", &h.admin).await);
    assert_eq!(listed.body["keys"].as_array().map(Vec::len), Some(2));
    assert_eq!(listed.body["keys"][0], replaced.body);

    // Viewers and operators may do none of it; without a token nobody may.
    for token in [&h.viewer, &h.operator] {
        let refusals = [
            h.get("/v1/model-keys", token).await,
            put_model_key(&h, token, "anthropic", json!({"key": "sk-ant-operator-key"})).await,
            h.send(Method::DELETE, "/v1/model-keys/anthropic", Some(token), Payload::Empty)
                .await,
        ];
        for reply in refusals {
            assert_error(&answers.keep(reply), StatusCode::FORBIDDEN, "FORBIDDEN");
        }
    }
    for (method, path) in [
        (Method::GET, "/v1/model-keys"),
        (Method::PUT, "/v1/model-keys/anthropic"),
        (Method::DELETE, "/v1/model-keys/anthropic"),
    ] {
        let reply = h
            .send(method, path, None, Payload::Json(json!({"key": "sk-ant-anonymous"})))
            .await;
        assert_error(&answers.keep(reply), StatusCode::UNAUTHORIZED, "UNAUTHORIZED");
    }
    let unchanged = answers.keep(h.get("/v1/model-keys", &h.admin).await);
    assert_eq!(unchanged.body, listed.body, "no refused call changed anything");

    let removed = answers.keep(
        h.send(
            Method::DELETE,
            "/v1/model-keys/anthropic",
            Some(&h.admin),
            Payload::Empty,
        )
        .await,
    );
    assert_eq!((removed.status, removed.raw.len()), (StatusCode::NO_CONTENT, 0));
    let again = answers.keep(
        h.send(
            Method::DELETE,
            "/v1/model-keys/anthropic",
            Some(&h.admin),
            Payload::Empty,
        )
        .await,
    );
    assert_error(&again, StatusCode::NOT_FOUND, "MODEL_KEY_NOT_FOUND");
    let listed = answers.keep(h.get("/v1/model-keys", &h.admin).await);
    assert_eq!(listed.body["keys"], json!([openai.body]));
    answers.assert_none_holds(MODEL_KEY);
    answers.assert_none_holds("sk-proj-0123456789wxyz");
}

async fn model_keys_refuse_bad_apis_and_bad_keys_and_write_nothing(h: Harness) {
    let answers = Answers::default();
    for api in [
        "azure",
        "Anthropic",
        "anthropic%20",
        "open%2Fai",
        "%FF",
        &"a".repeat(300),
    ] {
        let put = answers.keep(put_model_key(&h, &h.admin, api, json!({"key": MODEL_KEY})).await);
        assert_error(&put, StatusCode::NOT_FOUND, "MODEL_API_UNKNOWN");
        let delete = answers.keep(
            h.send(
                Method::DELETE,
                &format!("/v1/model-keys/{api}"),
                Some(&h.admin),
                Payload::Empty,
            )
            .await,
        );
        assert_error(&delete, StatusCode::NOT_FOUND, "MODEL_API_UNKNOWN");
    }
    let unknown = answers.keep(put_model_key(&h, &h.admin, "azure", json!({"key": MODEL_KEY})).await);
    assert_eq!(
        unknown.body["error"]["details"]["known"],
        json!(["anthropic", "openai", "gemini"])
    );

    let too_long = "k".repeat(sortie_protocol::api::MODEL_KEY_MAX_BYTES + 1);
    let longest = "k".repeat(sortie_protocol::api::MODEL_KEY_MAX_BYTES);
    for key in [
        "",
        "sk-ant has-a-space",
        "sk-ant-with-newline\n",
        "\tsk-ant-tab",
        "sk-ant-\u{7f}",
        "sk-ant-ключ",
        too_long.as_str(),
    ] {
        let reply = answers.keep(put_model_key(&h, &h.admin, "anthropic", json!({"key": key})).await);
        assert_error(&reply, StatusCode::BAD_REQUEST, "MODEL_KEY_INVALID");
        if key.len() > 8 {
            assert!(
                !String::from_utf8_lossy(&reply.raw).contains(key.trim()),
                "the refusal quotes no key"
            );
        }
    }
    for body in [
        json!({}),
        json!({"key": 42}),
        json!({"key": null}),
        json!({"key": MODEL_KEY, "extra": true}),
        json!({"key": MODEL_KEY, "label": "l".repeat(201)}),
        json!({"key": MODEL_KEY, "label": "two\nlines"}),
        json!([MODEL_KEY]),
    ] {
        let reply = answers.keep(put_model_key(&h, &h.admin, "anthropic", body).await);
        assert_error(&reply, StatusCode::BAD_REQUEST, "INVALID_REQUEST");
    }
    for (content_type, bytes) in [
        (Some("text/plain"), format!(r#"{{"key": "{MODEL_KEY}"}}"#).into_bytes()),
        (None, format!(r#"{{"key": "{MODEL_KEY}"}}"#).into_bytes()),
    ] {
        let reply = answers.keep(
            h.send(
                Method::PUT,
                "/v1/model-keys/anthropic",
                Some(&h.admin),
                Payload::Raw { content_type, bytes },
            )
            .await,
        );
        assert_error(&reply, StatusCode::UNSUPPORTED_MEDIA_TYPE, "UNSUPPORTED_MEDIA_TYPE");
    }
    for (content_type, bytes) in [
        (Some("application/json"), b"{".to_vec()),
        (Some("application/json"), vec![0xff, 0xfe, 0x7b, 0x7d]),
        (Some("application/json"), br#"{"key": "\ud800"}"#.to_vec()),
    ] {
        let reply = answers.keep(
            h.send(
                Method::PUT,
                "/v1/model-keys/anthropic",
                Some(&h.admin),
                Payload::Raw { content_type, bytes },
            )
            .await,
        );
        assert!(
            reply.status.is_client_error() && !reply.code().is_empty(),
            "{}",
            reply.body
        );
    }
    assert_error(
        &answers.keep(
            h.send(
                Method::POST,
                "/v1/model-keys/anthropic",
                Some(&h.admin),
                Payload::Json(json!({"key": MODEL_KEY})),
            )
            .await,
        ),
        StatusCode::METHOD_NOT_ALLOWED,
        "METHOD_NOT_ALLOWED",
    );
    assert_eq!(
        h.store.model_keys(&h.workspace.id).await.expect("list"),
        vec![],
        "nothing was written"
    );
    let longest_ok = answers.keep(put_model_key(&h, &h.admin, "gemini", json!({"key": longest})).await);
    assert_eq!(
        longest_ok.status,
        StatusCode::OK,
        "4096 bytes is the limit: {}",
        longest_ok.body
    );
    answers.assert_none_holds(MODEL_KEY);
}

async fn model_keys_stay_in_their_workspace_and_sealed_at_rest(h: Harness) {
    use sortie_protocol::api::ModelApi;
    let answers = Answers::default();
    let set = answers.keep(put_model_key(&h, &h.admin, "anthropic", json!({"key": MODEL_KEY})).await);
    assert_eq!(set.status, StatusCode::OK, "{}", set.body);

    let theirs = answers.keep(h.get("/v1/model-keys", &h.other_admin).await);
    assert_eq!(
        (theirs.status, theirs.body.clone()),
        (StatusCode::OK, json!({"workspace": "other", "keys": []}))
    );
    let delete = answers.keep(
        h.send(
            Method::DELETE,
            "/v1/model-keys/anthropic",
            Some(&h.other_admin),
            Payload::Empty,
        )
        .await,
    );
    assert_error(&delete, StatusCode::NOT_FOUND, "MODEL_KEY_NOT_FOUND");
    let their_own = answers.keep(
        put_model_key(
            &h,
            &h.other_admin,
            "anthropic",
            json!({"key": "sk-ant-other-workspace-key-zzzz"}),
        )
        .await,
    );
    assert_eq!(their_own.status, StatusCode::OK);
    let ours = answers.keep(h.get("/v1/model-keys", &h.admin).await);
    assert_eq!(ours.body["keys"], json!([set.body]), "their key did not replace ours");

    // At rest: only ciphertext, which opens for this workspace and api alone.
    let row = h
        .store
        .model_key(&h.workspace.id, ModelApi::Anthropic)
        .await
        .expect("read")
        .expect("stored");
    assert!(!row.key_ciphertext.contains("NEVER-SHOWN") && !row.key_nonce.contains("NEVER-SHOWN"));
    let opened = sortie_store::workspace_model_key(h.store.as_ref(), &h.keyring, &h.workspace.id, ModelApi::Anthropic)
        .await
        .expect("open")
        .expect("a key");
    assert_eq!(opened.expose(), MODEL_KEY.as_bytes());
    assert_eq!(format!("{opened:?} {opened}"), "Secret([redacted]) [redacted]");
    let other = h.store.workspace_by_name("other").await.expect("other");
    assert!(
        h.keyring
            .open(&other.id, ModelApi::Anthropic, &row.key_ciphertext, &row.key_nonce)
            .is_err(),
        "a row moved to another workspace does not open"
    );
    answers.assert_none_holds(MODEL_KEY);
}

async fn egress_allowlists_are_amended(h: Harness) {
    let id = h.create("t").await;
    let path = format!("/v1/sessions/{id}/egress");
    let amended = h
        .post(&path, &h.operator, json!({"allow": ["github.com", "example.org"]}))
        .await;
    assert_eq!(amended.status, StatusCode::OK, "{}", amended.body);
    assert_eq!(amended.body["egress"], json!({"allow": ["github.com", "example.org"]}));
    let invalid = h
        .post(&path, &h.operator, json!({"allow": ["*.evil.com", "ok.com"]}))
        .await;
    assert_error(&invalid, StatusCode::BAD_REQUEST, "EGRESS_ALLOWLIST_INVALID");
    assert_eq!(invalid.body["error"]["details"]["entries"][0]["entry"], "*.evil.com");
    assert_error(
        &h.post(&path, &h.operator, json!({"hosts": []})).await,
        StatusCode::BAD_REQUEST,
        "INVALID_REQUEST",
    );
    assert_error(
        &h.post(&path, &h.viewer, json!({"allow": []})).await,
        StatusCode::FORBIDDEN,
        "FORBIDDEN",
    );
    assert_error(
        &h.post(&path, &h.other_operator, json!({"allow": []})).await,
        StatusCode::NOT_FOUND,
        "SESSION_NOT_FOUND",
    );
    h.post(&format!("/v1/sessions/{id}/cancel"), &h.operator, json!({}))
        .await;
    assert_error(
        &h.post(&path, &h.operator, json!({"allow": []})).await,
        StatusCode::CONFLICT,
        "SESSION_NOT_STEERABLE",
    );
    let session = h.get(&format!("/v1/sessions/{id}"), &h.viewer).await;
    assert_eq!(
        session.body["egress"],
        json!({"allow": ["github.com", "example.org"]}),
        "refusals changed nothing"
    );
}

fn assert_error(reply: &Reply, status: StatusCode, code: &str) {
    assert_eq!((reply.status, reply.code()), (status, code), "body: {}", reply.body);
    assert!(
        reply.body["error"]["message"].as_str().is_some_and(|m| !m.is_empty()),
        "a sentence: {}",
        reply.body
    );
    assert!(
        reply.body["error"]["details"].is_object(),
        "details object: {}",
        reply.body
    );
}

fn is_rfc3339_utc(text: &Value) -> bool {
    text.as_str()
        .is_some_and(|t| t.len() == 24 && t.ends_with('Z') && t.as_bytes()[10] == b'T')
}

async fn create_accepts_a_valid_session(h: Harness) {
    let reply = h
        .post(
            "/v1/sessions",
            &h.operator,
            json!({
                "repo": h.repo, "task": "Fix the flaky test\nIt fails on CI.", "base": "main", "model": "claude-sonnet-4-5",
                "egress": {"allow": ["github.com", "example.org"]}, "setup": "make deps"
            }),
        )
        .await;
    assert_eq!(reply.status, StatusCode::ACCEPTED, "{}", reply.body);
    let session = &reply.body;
    let id = session["id"].as_str().expect("id");
    assert!(SessionId::parse(id).is_ok(), "{id}");
    assert_eq!(session["workspace"], "default");
    assert_eq!(session["repo"], json!(h.repo));
    assert_eq!(session["branch"], json!(format!("sortie/{id}")));
    assert_eq!(session["agent"], "claude-code", "the default agent");
    assert_eq!(session["model"], "claude-sonnet-4-5");
    assert_eq!(session["base"], "main");
    assert_eq!(session["title"], "Fix the flaky test");
    assert_eq!(session["phase"], "queued");
    assert_eq!(session["turns"], 1);
    assert_eq!(session["current_turn"], Value::Null);
    assert_eq!(session["egress"], json!({"allow": ["github.com", "example.org"]}));
    assert_eq!(
        session["usage"],
        json!({"compute_seconds": 0, "peak_memory_bytes": 0, "input_tokens": 0, "output_tokens": 0})
    );
    assert_eq!(
        (
            session["pr"].clone(),
            session["failure"].clone(),
            session["archived"].clone()
        ),
        (Value::Null, Value::Null, json!(false))
    );
    assert!(
        is_rfc3339_utc(&session["created_at"]) && is_rfc3339_utc(&session["updated_at"]),
        "{session}"
    );

    let read = h.get(&format!("/v1/sessions/{id}"), &h.viewer).await;
    assert_eq!(read.status, StatusCode::OK);
    assert_eq!(&read.body, session);
    let turns = h.get(&format!("/v1/sessions/{id}/turns"), &h.viewer).await;
    assert_eq!(turns.body["turns"].as_array().map(Vec::len), Some(1));
    assert_eq!(turns.body["turns"][0]["status"], "accepted");
    assert_eq!(turns.body["turns"][0]["prompt"], "Fix the flaky test\nIt fails on CI.");

    // Exactly 100 KiB is accepted; the explicit title and a known agent are kept.
    let full = h
        .post(
            "/v1/sessions",
            &h.operator,
            json!({"repo": h.repo, "task": "a".repeat(PROMPT_MAX_BYTES), "title": "t", "agent": "gemini"}),
        )
        .await;
    assert_eq!(full.status, StatusCode::ACCEPTED, "{}", full.body);
    assert_eq!(
        (full.body["title"].clone(), full.body["agent"].clone()),
        (json!("t"), json!("gemini"))
    );
    assert_eq!(full.body["sandbox"], "released", "no sandbox yet");
    // A bare repository is a repository too.
    let bare = h.dir.path().join("bare.git");
    let status = std::process::Command::new("git")
        .args(["init", "-q", "--bare"])
        .arg(&bare)
        .status()
        .expect("git");
    assert!(status.success());
    let bare_reply = h
        .post("/v1/sessions", &h.operator, json!({"repo": bare, "task": "t"}))
        .await;
    assert_eq!(bare_reply.status, StatusCode::ACCEPTED, "{}", bare_reply.body);
    // An https URL is accepted as it stands.
    let remote = h
        .post(
            "/v1/sessions",
            &h.admin,
            json!({"repo": "https://github.com/o/r.git", "task": "t"}),
        )
        .await;
    assert_eq!(remote.status, StatusCode::ACCEPTED, "{}", remote.body);
    assert_eq!(h.session_count().await, 4);
}

async fn create_refuses_each_invalid_field_and_writes_nothing(h: Harness) {
    let repo = h.repo.clone();
    let base = json!({"repo": repo, "task": "t"});
    let with = |key: &str, value: Value| {
        let mut body = base.clone();
        body[key] = value;
        body
    };
    let cases: Vec<(Value, StatusCode, &str)> = vec![
        (json!({"repo": repo}), StatusCode::BAD_REQUEST, "INVALID_REQUEST"),
        (json!({"task": "t"}), StatusCode::BAD_REQUEST, "INVALID_REQUEST"),
        (with("surprise", json!(1)), StatusCode::BAD_REQUEST, "INVALID_REQUEST"),
        (with("task", json!(42)), StatusCode::BAD_REQUEST, "INVALID_REQUEST"),
        (with("task", json!("   ")), StatusCode::BAD_REQUEST, "INVALID_REQUEST"),
        (
            with("egress", json!({"allow": "github.com"})),
            StatusCode::BAD_REQUEST,
            "INVALID_REQUEST",
        ),
        (
            with("egress", json!({"allow": [], "deny": []})),
            StatusCode::BAD_REQUEST,
            "INVALID_REQUEST",
        ),
        (
            with("task", json!("a".repeat(PROMPT_MAX_BYTES + 1))),
            StatusCode::PAYLOAD_TOO_LARGE,
            "PROMPT_TOO_LARGE",
        ),
        (
            with("title", json!("t".repeat(201))),
            StatusCode::BAD_REQUEST,
            "TITLE_TOO_LONG",
        ),
        (
            with("setup", json!("s".repeat(SETUP_MAX_BYTES + 1))),
            StatusCode::PAYLOAD_TOO_LARGE,
            "SETUP_TOO_LARGE",
        ),
        (
            with("egress", json!({"allow": ["*.github.com"]})),
            StatusCode::BAD_REQUEST,
            "EGRESS_ALLOWLIST_INVALID",
        ),
        (
            with("agent", json!("nonexistent-agent")),
            StatusCode::BAD_REQUEST,
            "AGENT_UNKNOWN",
        ),
        (with("base", json!("a..b")), StatusCode::BAD_REQUEST, "BASE_INVALID"),
        (
            with("base", json!("no-such-branch")),
            StatusCode::BAD_REQUEST,
            "BASE_NOT_FOUND",
        ),
        (
            with("agent", json!("codex")),
            StatusCode::CONFLICT,
            "AGENT_NOT_INSTALLED",
        ),
        (
            with("model", json!("bad model")),
            StatusCode::BAD_REQUEST,
            "MODEL_INVALID",
        ),
        (
            with("repo", json!("relative/path")),
            StatusCode::BAD_REQUEST,
            "REPO_INVALID",
        ),
        (
            with("repo", json!("https://user:secret@github.com/o/r")),
            StatusCode::BAD_REQUEST,
            "REPO_INVALID",
        ),
        (
            with("repo", json!("ssh://git@github.com/o/r")),
            StatusCode::BAD_REQUEST,
            "REPO_INVALID",
        ),
        (
            with("repo", json!("/nonexistent/repo")),
            StatusCode::BAD_REQUEST,
            "REPO_INVALID",
        ),
        (
            with("repo", json!(h.dir.path())),
            StatusCode::BAD_REQUEST,
            "REPO_INVALID",
        ),
        (
            with("repo", json!(format!("{repo}/../repo"))),
            StatusCode::BAD_REQUEST,
            "REPO_INVALID",
        ),
    ];
    for (body, status, code) in cases {
        let reply = h.post("/v1/sessions", &h.operator, body.clone()).await;
        assert_error(&reply, status, code);
        let _ = body;
    }
    let egress = h
        .post(
            "/v1/sessions",
            &h.operator,
            with(
                "egress",
                json!({"allow": ["ok.com", "localhost", "10.0.0.1", "ok.com"]}),
            ),
        )
        .await;
    assert_error(&egress, StatusCode::BAD_REQUEST, "EGRESS_ALLOWLIST_INVALID");
    let entries = egress.body["error"]["details"]["entries"].as_array().expect("entries");
    let named: Vec<(&str, u64)> = entries
        .iter()
        .map(|e| {
            (
                e["entry"].as_str().unwrap_or_default(),
                e["index"].as_u64().unwrap_or(99),
            )
        })
        .collect();
    assert_eq!(named, vec![("localhost", 1), ("10.0.0.1", 2), ("ok.com", 3)]);
    let too_many: Vec<String> = (0..33).map(|i| format!("h{i}.example.com")).collect();
    let over = h
        .post("/v1/sessions", &h.operator, with("egress", json!({"allow": too_many})))
        .await;
    assert_error(&over, StatusCode::BAD_REQUEST, "EGRESS_ALLOWLIST_INVALID");
    assert_eq!(over.body["error"]["details"]["entries"][0]["entry"], "h32.example.com");

    // What the server cannot run it does not accept, and it says how to fix that.
    let uninstalled = h.post("/v1/sessions", &h.operator, with("agent", json!("codex"))).await;
    assert!(
        uninstalled.body["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("sortie agents install codex")),
        "{}",
        uninstalled.body
    );
    assert_eq!(
        uninstalled.body["error"]["details"]["install"],
        "sortie agents install codex"
    );

    let unknown_agent = h.post("/v1/sessions", &h.operator, with("agent", json!("nope"))).await;
    assert!(
        unknown_agent.body["error"]["details"]["known"]
            .as_array()
            .is_some_and(|k| k.contains(&json!("scripted")))
    );

    let not_json = h
        .send(
            Method::POST,
            "/v1/sessions",
            Some(&h.operator),
            Payload::Raw {
                content_type: Some("text/plain"),
                bytes: b"{}".to_vec(),
            },
        )
        .await;
    assert_error(&not_json, StatusCode::UNSUPPORTED_MEDIA_TYPE, "UNSUPPORTED_MEDIA_TYPE");
    let huge = h
        .send(
            Method::POST,
            "/v1/sessions",
            Some(&h.operator),
            Payload::Raw {
                content_type: Some("application/json"),
                bytes: vec![b' '; REQUEST_BODY_MAX_BYTES + 1],
            },
        )
        .await;
    assert_error(&huge, StatusCode::PAYLOAD_TOO_LARGE, "BODY_TOO_LARGE");
    assert_eq!(h.session_count().await, 0, "no refusal writes anything");
}

async fn create_checks_repository_access(h: Harness) {
    // Workspace `other` may use only /nonexistent-root: the real repo is outside it, and the answer
    // does not reveal whether a path exists.
    let outside = h
        .post("/v1/sessions", &h.other_operator, json!({"repo": h.repo, "task": "t"}))
        .await;
    assert_error(&outside, StatusCode::FORBIDDEN, "REPO_NOT_ALLOWED");
    let missing = h
        .post(
            "/v1/sessions",
            &h.other_operator,
            json!({"repo": "/etc/no-such-dir", "task": "t"}),
        )
        .await;
    assert_error(&missing, StatusCode::FORBIDDEN, "REPO_NOT_ALLOWED");
    // A symlink inside an allowed root that points outside it is refused after resolution.
    let root = h.dir.path().join("root");
    std::fs::create_dir(&root).expect("root");
    let root = std::fs::canonicalize(&root).expect("canonical root");
    let scoped = h
        .store
        .create_workspace(
            "scoped",
            sortie_store::RepoAccess {
                any_local_path: false,
                allowed_roots: vec![root.to_string_lossy().into_owned()],
            },
        )
        .await
        .expect("scoped");
    let (token, hash) = sortie_server::tokens::generate_token().expect("token");
    h.store
        .create_token(&scoped.id, sortie_protocol::api::Role::Operator, &hash, None, None)
        .await
        .expect("token");
    std::os::unix::fs::symlink(&h.repo, root.join("escape")).expect("symlink");
    let escape = h
        .post(
            "/v1/sessions",
            &token,
            json!({"repo": root.join("escape"), "task": "t"}),
        )
        .await;
    assert_error(&escape, StatusCode::FORBIDDEN, "REPO_NOT_ALLOWED");
    harness::git_init(&root.join("inside"));
    let inside = h
        .post(
            "/v1/sessions",
            &token,
            json!({"repo": root.join("inside"), "task": "t"}),
        )
        .await;
    assert_eq!(inside.status, StatusCode::ACCEPTED, "{}", inside.body);
    assert_eq!(inside.body["workspace"], "scoped");
}

async fn list_pages_and_filters(h: Harness) {
    let mut ids = Vec::new();
    for i in 0..5 {
        ids.push(h.create(&format!("task {i}")).await);
    }
    let all = h.get("/v1/sessions", &h.viewer).await;
    assert_eq!(all.status, StatusCode::OK);
    let listed: Vec<&str> = all.body["sessions"]
        .as_array()
        .expect("sessions")
        .iter()
        .filter_map(|s| s["id"].as_str())
        .collect();
    let mut newest_first: Vec<&str> = ids.iter().map(String::as_str).collect();
    newest_first.sort_unstable_by(|a, b| b.cmp(a));
    assert_eq!(listed, newest_first);
    assert_eq!(all.body["next_cursor"], Value::Null);

    let mut seen = Vec::new();
    let mut cursor: Option<String> = None;
    loop {
        let path = match &cursor {
            Some(c) => format!("/v1/sessions?limit=2&cursor={c}"),
            None => "/v1/sessions?limit=2".to_owned(),
        };
        let page = h.get(&path, &h.viewer).await;
        assert_eq!(page.status, StatusCode::OK, "{}", page.body);
        seen.extend(
            page.body["sessions"]
                .as_array()
                .expect("page")
                .iter()
                .filter_map(|s| s["id"].as_str().map(str::to_owned)),
        );
        match page.body["next_cursor"].as_str() {
            Some(next) => cursor = Some(next.to_owned()),
            None => break,
        }
    }
    assert_eq!(seen, newest_first, "pages cover every session once, in order");

    h.post(&format!("/v1/sessions/{}/cancel", ids[1]), &h.operator, json!({}))
        .await;
    let canceled = h.get("/v1/sessions?phase=canceled", &h.viewer).await;
    assert_eq!(canceled.body["sessions"].as_array().map(Vec::len), Some(1));
    let by_repo = h.get(&format!("/v1/sessions?repo={}", h.repo), &h.viewer).await;
    assert_eq!(by_repo.body["sessions"].as_array().map(Vec::len), Some(5));
    let other_repo = h.get("/v1/sessions?repo=/elsewhere", &h.viewer).await;
    assert_eq!(other_repo.body["sessions"].as_array().map(Vec::len), Some(0));
    h.post(&format!("/v1/sessions/{}/archive", ids[1]), &h.operator, json!({}))
        .await;
    let archived = h.get("/v1/sessions?archived=true", &h.viewer).await;
    assert_eq!(archived.body["sessions"][0]["id"], json!(ids[1]));
    assert_eq!(
        h.get("/v1/sessions", &h.viewer).await.body["sessions"]
            .as_array()
            .map(Vec::len),
        Some(4)
    );

    for bad in [
        "phase=sleeping",
        "limit=0",
        "limit=201",
        "limit=x",
        "archived=maybe",
        "cursor=nope",
        "color=red",
    ] {
        let reply = h.get(&format!("/v1/sessions?{bad}"), &h.viewer).await;
        assert_error(&reply, StatusCode::BAD_REQUEST, "INVALID_REQUEST");
    }
}

async fn agents_are_listed_with_the_default(h: Harness) {
    let listed = h.get("/v1/agents", &h.viewer).await;
    assert_eq!(listed.status, StatusCode::OK, "{}", listed.body);
    let ids: Vec<&str> = listed.body["agents"]
        .as_array()
        .expect("agents")
        .iter()
        .map(|agent| agent["id"].as_str().expect("id"))
        .collect();
    for built_in in sortie_protocol::agents::BUILT_IN_AGENTS {
        assert!(ids.contains(built_in), "{built_in} in {ids:?}");
    }
    assert_eq!(listed.body["default"], sortie_protocol::agents::DEFAULT_AGENT);
    // Whether this host can run each, and what a missing one needs.
    for agent in listed.body["agents"].as_array().expect("agents") {
        if agent["id"] == "codex" {
            assert_eq!(agent["installed"], false, "{agent}");
            assert_eq!(agent["needs"], "sortie agents install codex", "{agent}");
        } else {
            assert_eq!(agent["installed"], true, "{agent}");
            assert_eq!(agent["needs"], Value::Null, "{agent}");
        }
    }
    let anonymous = h.send(Method::GET, "/v1/agents", None, Payload::Empty).await;
    assert_error(&anonymous, StatusCode::UNAUTHORIZED, "UNAUTHORIZED");
}

async fn read_endpoints_answer_and_miss(h: Harness) {
    let id = h.create("t").await;
    for suffix in ["", "/turns", "/messages"] {
        let ok = h.get(&format!("/v1/sessions/{id}{suffix}"), &h.viewer).await;
        assert_eq!(ok.status, StatusCode::OK, "{suffix}: {}", ok.body);
        let unknown = h
            .get(&format!("/v1/sessions/{}{suffix}", SessionId::generate()), &h.viewer)
            .await;
        assert_error(&unknown, StatusCode::NOT_FOUND, "SESSION_NOT_FOUND");
        let malformed = h.get(&format!("/v1/sessions/not-an-id{suffix}"), &h.viewer).await;
        assert_error(&malformed, StatusCode::NOT_FOUND, "SESSION_NOT_FOUND");
    }
    let messages = h.get(&format!("/v1/sessions/{id}/messages"), &h.viewer).await;
    assert_eq!(
        messages.body,
        json!([{"id": format!("{id}-u1"), "role": "user", "parts": [{"type": "text", "text": "t"}]}])
    );
}

async fn messages_assemble_stored_parts(h: Harness) {
    let id = h.create("write a file").await;
    let session_id = SessionId::parse(&id).expect("id");
    let chunks = [
        json!({"type": "start", "messageId": format!("{id}-t1")}),
        json!({"type": "start-step"}),
        json!({"type": "text-start", "id": "t"}),
        json!({"type": "text-delta", "id": "t", "delta": "Done"}),
        json!({"type": "text-end", "id": "t"}),
        json!({"type": "data-sortie-delivery", "data": {"branch": format!("sortie/{id}"), "pushed": true}}),
        json!({"type": "finish-step"}),
        json!({"type": "finish"}),
    ];
    let parts: Vec<NewPart> = chunks
        .iter()
        .enumerate()
        .map(|(i, c)| NewPart {
            driver_index: None,
            part_index: i as u32,
            payload: c.to_string(),
        })
        .collect();
    h.store.append_parts(&session_id, 1, &parts).await.expect("parts");
    let messages = h.get(&format!("/v1/sessions/{id}/messages"), &h.viewer).await;
    assert_eq!(messages.status, StatusCode::OK);
    assert_eq!(messages.body[1]["id"], json!(format!("{id}-t1")));
    assert_eq!(messages.body[1]["role"], "assistant");
    assert_eq!(
        messages.body[1]["parts"],
        json!([
            {"type": "step-start"},
            {"type": "text", "text": "Done", "state": "done"},
            {"type": "data-sortie-delivery", "data": {"branch": format!("sortie/{id}"), "pushed": true}},
        ])
    );
}

/// Stores `chunks` as turn `n`'s parts, from part index 0, in batches.
async fn store_turn(h: &Harness, id: &SessionId, n: u32, chunks: impl Iterator<Item = Value>) {
    let mut batch = Vec::new();
    for (part_index, chunk) in (0_u32..).zip(chunks) {
        batch.push(NewPart {
            part_index,
            payload: chunk.to_string(),
            driver_index: None,
        });
        if batch.len() == 10_000 {
            h.store.append_parts(id, n, &batch).await.expect("parts");
            batch.clear();
        }
    }
    h.store.append_parts(id, n, &batch).await.expect("parts");
}

/// A turn's answer of one text block.
fn answer(text: &str) -> impl Iterator<Item = Value> {
    [
        json!({"type": "text-start", "id": "t"}),
        json!({"type": "text-delta", "id": "t", "delta": text}),
        json!({"type": "text-end", "id": "t"}),
    ]
    .into_iter()
}

/// The turn numbers of a page, from its message ids (`<id>-u<n>`, `<id>-t<n>`), each prompt checked
/// to be followed by its answer.
fn page_turns(reply: &Reply, id: &str) -> Vec<u32> {
    let messages = reply.body.as_array().expect("an array of messages");
    let mut turns = Vec::new();
    for pair in messages.chunks(2) {
        let n: u32 = pair[0]["id"]
            .as_str()
            .and_then(|m| m.strip_prefix(&format!("{id}-u")))
            .and_then(|n| n.parse().ok())
            .expect("a prompt's id");
        assert_eq!(pair[0]["parts"][0]["text"], format!("prompt {n}"));
        assert_eq!(
            pair.get(1).map(|m| m["id"].clone()),
            Some(json!(format!("{id}-t{n}"))),
            "{pair:?}"
        );
        let answer = pair[1]["parts"][0]["text"].as_str().unwrap_or_default();
        assert!(answer.starts_with(&format!("answer {n}")), "{n}: {answer:.40}");
        turns.push(n);
    }
    turns
}

fn cursors(reply: &Reply) -> (Option<&str>, Option<&str>) {
    let header = |name| reply.headers.get(name).map(|v| v.to_str().expect("ascii"));
    (header("sortie-older-cursor"), header("sortie-newer-cursor"))
}

/// `100000` as `100,000`.
fn thousands(n: u64) -> String {
    let digits = n.to_string();
    let mut out = String::new();
    for (i, digit) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(digit);
    }
    out
}

/// A session of `n_turns` turns, prompts `prompt <n>`, each answered with `answer_text(n)`.
async fn session_of_turns(h: &Harness, n_turns: u32, answer_text: impl Fn(u32) -> String) -> (String, SessionId) {
    let id = h.create("prompt 1").await;
    let session_id = SessionId::parse(&id).expect("id");
    for n in 1..=n_turns {
        if n > 1 {
            let steer = h
                .post(
                    &format!("/v1/sessions/{id}/steer"),
                    &h.operator,
                    json!({"prompt": format!("prompt {n}")}),
                )
                .await;
            assert_eq!(steer.status, StatusCode::ACCEPTED, "{}", steer.body);
        }
        run_one_turn(h, &session_id).await;
        store_turn(h, &session_id, n, answer(&answer_text(n))).await;
    }
    (id, session_id)
}

async fn messages_come_in_pages_of_turns_with_cursors(h: Harness) {
    let n_turns = MESSAGES_PAGE_TURNS_DEFAULT + 5;
    let (id, _) = session_of_turns(&h, n_turns, |n| format!("answer {n}")).await;
    let path = format!("/v1/sessions/{id}/messages");
    // No parameters: the newest turns, oldest first, in the shape of an unpaged answer.
    let newest = h.get(&path, &h.viewer).await;
    assert_eq!(newest.status, StatusCode::OK, "{}", newest.body);
    assert_eq!(page_turns(&newest, &id), (6..=n_turns).collect::<Vec<_>>());
    assert_eq!(cursors(&newest), (Some("6"), None));

    let older = h.get(&format!("{path}?before=6"), &h.viewer).await;
    assert_eq!(page_turns(&older, &id), vec![1, 2, 3, 4, 5]);
    assert_eq!(cursors(&older), (None, Some("5")));
    let middle = h.get(&format!("{path}?before=10&limit=3"), &h.viewer).await;
    assert_eq!(page_turns(&middle, &id), vec![7, 8, 9]);
    assert_eq!(cursors(&middle), (Some("7"), Some("9")));
    let newer = h.get(&format!("{path}?after=9&limit=3"), &h.viewer).await;
    assert_eq!(page_turns(&newer, &id), vec![10, 11, 12]);
    assert_eq!(cursors(&newer), (Some("10"), Some("12")));
    let to_the_end = h.get(&format!("{path}?after=20"), &h.viewer).await;
    assert_eq!(page_turns(&to_the_end, &id), vec![21, 22, 23, 24, 25]);
    assert_eq!(cursors(&to_the_end), (Some("21"), None));

    // Paging back from the newest page with each page's cursor visits every turn once.
    let mut seen = Vec::new();
    let mut next = Some(format!("{path}?limit=7"));
    while let Some(page_path) = next {
        let page = h.get(&page_path, &h.viewer).await;
        let mut turns = page_turns(&page, &id);
        turns.extend(seen);
        seen = turns;
        next = cursors(&page).0.map(|before| format!("{path}?limit=7&before={before}"));
    }
    assert_eq!(seen, (1..=n_turns).collect::<Vec<_>>());

    for beyond in ["?before=1", "?after=25", "?after=4000000000"] {
        let empty = h.get(&format!("{path}{beyond}"), &h.viewer).await;
        assert_eq!((empty.status, &empty.body), (StatusCode::OK, &json!([])), "{beyond}");
        assert_eq!(cursors(&empty), (None, None), "{beyond}");
    }
    // The document states the constants the server pages with.
    let document = h.send(Method::GET, "/v1/openapi.json", None, Payload::Empty).await;
    let operation = &document.body["paths"]["/v1/sessions/{id}/messages"]["get"];
    let description = operation["description"].as_str().expect("a description");
    for stated in [
        format!("newest {MESSAGES_PAGE_TURNS_DEFAULT} turns"),
        format!("{} MiB of stored transcript", MESSAGES_PAGE_MAX_BYTES >> 20),
        format!(
            "({} parts, {} MiB)",
            thousands(u64::from(TURN_PARTS_MAX)),
            TURN_PART_BYTES_MAX >> 20
        ),
    ] {
        assert!(description.contains(&stated), "{stated:?} in {description:?}");
    }
    let headers = &operation["responses"]["200"]["headers"];
    assert!(
        headers["Sortie-Older-Cursor"].is_object() && headers["Sortie-Newer-Cursor"].is_object(),
        "{headers}"
    );
    let too_many = format!("?limit={}", MESSAGES_PAGE_TURNS_MAX + 1);
    for bad in [
        "?limit=0",
        &too_many,
        "?before=3&after=1",
        "?before=x",
        "?after=-1",
        "?cursor=5",
    ] {
        assert_error(
            &h.get(&format!("{path}{bad}"), &h.viewer).await,
            StatusCode::BAD_REQUEST,
            "INVALID_REQUEST",
        );
    }
}

async fn a_messages_page_stops_after_the_turn_that_fills_its_byte_budget(h: Harness) {
    // Four answers of a third of the budget each, and a fifth turn that waits (no answer yet).
    let padding = " ".repeat(usize::try_from(MESSAGES_PAGE_MAX_BYTES / 3).expect("fits"));
    let (id, _) = session_of_turns(&h, 4, |n| format!("answer {n}{padding}")).await;
    let steer = h
        .post(
            &format!("/v1/sessions/{id}/steer"),
            &h.operator,
            json!({"prompt": "prompt 5"}),
        )
        .await;
    assert_eq!(steer.status, StatusCode::ACCEPTED, "{}", steer.body);
    let page = h.get(&format!("/v1/sessions/{id}/messages"), &h.viewer).await;
    assert_eq!(page.status, StatusCode::OK);
    let ids: Vec<&str> = page
        .body
        .as_array()
        .expect("array")
        .iter()
        .filter_map(|m| m["id"].as_str())
        .collect();
    // Read newest first: turn 5 (a prompt alone), 4, 3, then 2 takes the page past its budget and is
    // the last one taken, whole.
    let expected: Vec<String> = ["u2", "t2", "u3", "t3", "u4", "t4", "u5"]
        .iter()
        .map(|m| format!("{id}-{m}"))
        .collect();
    assert_eq!(ids, expected);
    assert_eq!(
        page.body[1]["parts"][0]["text"].as_str().map(str::len),
        Some(8 + padding.len())
    );
    assert_eq!(cursors(&page), (Some("2"), None));
    let rest = h.get(&format!("/v1/sessions/{id}/messages?before=2"), &h.viewer).await;
    assert_eq!(page_turns(&rest, &id), vec![1]);
    assert_eq!(cursors(&rest), (None, Some("1")));
}

/// Security review S8: a turn of 400,000 parts (the review's `flood: 400000`, stored as the recorder
/// stores text deltas) made one `GET /messages` take 250 s and six in parallel time out after 300 s. A
/// page now reads no more of a turn than the transcript caps and folds in linear time: the answer is
/// the turn's first `TURN_PARTS_MAX` parts and a truncation note. The bounds are for debug builds on a
/// loaded 2-core machine, where most of the time is the bundled SQLite, compiled without optimization,
/// reading 100,000 rows (2 to 3 s for one request here, a tenth of that in release); a quadratic fold
/// or a read of the whole turn would pass them by far. The printed times are what was measured.
async fn messages_of_a_flooded_turn_answer_fast_and_in_parallel(h: Harness) {
    const FLOOD: u32 = 400_000;
    let id = h.create("#!scripted\nflood: 400000\nsay: flooded").await;
    let session_id = SessionId::parse(&id).expect("id");
    let started = std::time::Instant::now();
    let delta = |i: u32| format!("flood {i}\n");
    let head = [
        json!({"type": "start", "messageId": format!("{id}-t1")}),
        json!({"type": "start-step"}),
        json!({"type": "text-start", "id": "0"}),
    ];
    let n_head = head.len() as u32;
    let flood = (0..FLOOD - n_head).map(|i| json!({"type": "text-delta", "id": "0", "delta": delta(i)}));
    store_turn(&h, &session_id, 1, head.into_iter().chain(flood)).await;
    println!("stored {FLOOD} parts in {:?}", started.elapsed());

    let path = format!("/v1/sessions/{id}/messages");
    let started = std::time::Instant::now();
    let one = h.get(&path, &h.viewer).await;
    let took = started.elapsed();
    println!(
        "one GET /messages of the flooded turn: {took:?}, {} bytes",
        one.raw.len()
    );
    assert_eq!(one.status, StatusCode::OK);
    let parts = one.body[1]["parts"].as_array().expect("the answer's parts");
    assert_eq!(parts.len(), 3, "step, text, note: {:?}", &parts[..parts.len().min(4)]);
    let shown_deltas = TURN_PARTS_MAX - n_head;
    let text = parts[1]["text"].as_str().expect("text");
    assert_eq!(text.len(), (0..shown_deltas).map(|i| delta(i).len()).sum::<usize>());
    assert!(
        text.ends_with(&delta(shown_deltas - 1)),
        "the first parts of the turn, in order"
    );
    assert_eq!(parts[2]["type"], sortie_protocol::ui::TRUNCATED_PART_TYPE);
    assert_eq!(parts[2]["data"]["shownParts"], TURN_PARTS_MAX);
    assert!(
        took < std::time::Duration::from_secs(10),
        "one GET /messages took {took:?}"
    );

    let started = std::time::Instant::now();
    let get = || h.get(&path, &h.viewer);
    let (a, b, c, d, e, f) = tokio::join!(get(), get(), get(), get(), get(), get());
    let replies = [a, b, c, d, e, f];
    let took = started.elapsed();
    println!("six concurrent GET /messages of the flooded turn: all done in {took:?}");
    for reply in &replies {
        assert_eq!((reply.status, &reply.raw), (StatusCode::OK, &one.raw));
    }
    assert!(
        took < std::time::Duration::from_secs(60),
        "six concurrent GET /messages took {took:?}"
    );
}

async fn steer_adds_turns_and_refuses_with_codes(h: Harness) {
    let id = h.create("t").await;
    let path = format!("/v1/sessions/{id}/steer");
    let steer = h.post(&path, &h.operator, json!({"prompt": "also add tests"})).await;
    assert_eq!(steer.status, StatusCode::ACCEPTED, "{}", steer.body);
    assert_eq!(
        (
            steer.body["n"].clone(),
            steer.body["status"].clone(),
            steer.body["mode"].clone()
        ),
        (json!(2), json!("accepted"), json!("queue"))
    );
    let interrupt = h
        .post(&path, &h.operator, json!({"prompt": "now", "mode": "interrupt"}))
        .await;
    assert_eq!(
        (interrupt.body["n"].clone(), interrupt.body["mode"].clone()),
        (json!(3), json!("interrupt"))
    );
    let exactly = h
        .post(&path, &h.operator, json!({"prompt": "p".repeat(PROMPT_MAX_BYTES)}))
        .await;
    assert_eq!(exactly.status, StatusCode::ACCEPTED);

    assert_error(
        &h.post(&path, &h.operator, json!({"prompt": "p".repeat(PROMPT_MAX_BYTES + 1)}))
            .await,
        StatusCode::PAYLOAD_TOO_LARGE,
        "PROMPT_TOO_LARGE",
    );
    assert_error(
        &h.post(&path, &h.operator, json!({"prompt": ""})).await,
        StatusCode::BAD_REQUEST,
        "INVALID_REQUEST",
    );
    assert_error(
        &h.post(&path, &h.operator, json!({"prompt": "x", "mode": "later"}))
            .await,
        StatusCode::BAD_REQUEST,
        "INVALID_REQUEST",
    );
    assert_error(
        &h.post(&path, &h.operator, json!({"text": "x"})).await,
        StatusCode::BAD_REQUEST,
        "INVALID_REQUEST",
    );
    for n in 5..=TURN_QUEUE_MAX {
        assert_eq!(
            h.post(&path, &h.operator, json!({"prompt": format!("s{n}")}))
                .await
                .status,
            StatusCode::ACCEPTED
        );
    }
    assert_error(
        &h.post(&path, &h.operator, json!({"prompt": "full"})).await,
        StatusCode::CONFLICT,
        "TURN_QUEUE_FULL",
    );
    let missing = h
        .post(
            &format!("/v1/sessions/{}/steer", SessionId::generate()),
            &h.operator,
            json!({"prompt": "x"}),
        )
        .await;
    assert_error(&missing, StatusCode::NOT_FOUND, "SESSION_NOT_FOUND");

    h.post(&format!("/v1/sessions/{id}/cancel"), &h.operator, json!({}))
        .await;
    assert_error(
        &h.post(&path, &h.operator, json!({"prompt": "late"})).await,
        StatusCode::CONFLICT,
        "SESSION_NOT_STEERABLE",
    );
    let turns = h.get(&format!("/v1/sessions/{id}/turns"), &h.viewer).await;
    assert_eq!(
        turns.body["turns"].as_array().map(Vec::len),
        Some(TURN_QUEUE_MAX as usize),
        "refusals add no turn"
    );

    // An archived session takes no turns either.
    let archived = h.create("t").await;
    h.post(&format!("/v1/sessions/{archived}/cancel"), &h.operator, json!({}))
        .await;
    h.post(&format!("/v1/sessions/{archived}/archive"), &h.operator, json!({}))
        .await;
    h.send(
        Method::DELETE,
        &format!("/v1/sessions/{archived}/archive"),
        Some(&h.operator),
        Payload::Empty,
    )
    .await;
    assert_error(
        &h.post(
            &format!("/v1/sessions/{archived}/steer"),
            &h.operator,
            json!({"prompt": "x"}),
        )
        .await,
        StatusCode::CONFLICT,
        "SESSION_NOT_STEERABLE",
    );
}

/// Plays the worker: claims the waiting turn, completes it and rests the session.
async fn run_one_turn(h: &Harness, id: &SessionId) {
    let turn = h
        .store
        .claim_turn(id, true, "test-worker")
        .await
        .expect("claim")
        .expect("a turn");
    let done = TurnOutcome {
        status: TurnStatus::Completed,
        head_sha: None,
        failure: None,
    };
    assert!(h.store.finish_turn(id, turn.n, done).await.expect("finish"));
    assert!(
        h.store
            .transition_session(id, SessionPhase::Running, SessionPhase::Delivering)
            .await
            .expect("deliver")
    );
    assert!(
        h.store
            .transition_session(id, SessionPhase::Delivering, SessionPhase::Idle)
            .await
            .expect("idle")
    );
}

async fn steer_refuses_past_the_session_prompt_budget(h: Harness) {
    let big = "b".repeat(PROMPT_MAX_BYTES);
    let reply = h
        .post("/v1/sessions", &h.operator, json!({"repo": h.repo, "task": big}))
        .await;
    let id = reply.body["id"].as_str().expect("id").to_owned();
    let session_id = SessionId::parse(&id).expect("id");
    let path = format!("/v1/sessions/{id}/steer");
    let mut accepted = 1;
    loop {
        run_one_turn(&h, &session_id).await;
        let steer = h.post(&path, &h.operator, json!({"prompt": big})).await;
        if steer.status == StatusCode::ACCEPTED {
            accepted += 1;
            continue;
        }
        assert_error(&steer, StatusCode::PAYLOAD_TOO_LARGE, "SESSION_PROMPTS_TOO_LARGE");
        break;
    }
    assert_eq!(accepted, 81, "81 prompts of 100 KiB fit in 8 MiB, the 82nd does not");
    let session = h.get(&format!("/v1/sessions/{id}"), &h.viewer).await;
    assert_eq!(
        (session.body["turns"].clone(), session.body["phase"].clone()),
        (json!(81), json!("idle")),
        "the refusal wrote nothing"
    );
}

async fn stop_needs_a_running_turn(h: Harness) {
    let id = h.create("t").await;
    let path = format!("/v1/sessions/{id}/stop");
    assert_error(
        &h.post(&path, &h.operator, json!({})).await,
        StatusCode::CONFLICT,
        "NO_TURN_RUNNING",
    );
    let session_id = SessionId::parse(&id).expect("id");
    h.store
        .claim_turn(&session_id, true, "test-worker")
        .await
        .expect("claim")
        .expect("turn");
    let stop = h.send(Method::POST, &path, Some(&h.operator), Payload::Empty).await;
    assert_eq!(stop.status, StatusCode::ACCEPTED, "{}", stop.body);
    assert_eq!(
        (stop.body["n"].clone(), stop.body["status"].clone()),
        (json!(1), json!("running"))
    );
    let again = h.post(&path, &h.operator, json!({})).await;
    assert_eq!(
        again.status,
        StatusCode::ACCEPTED,
        "stop is idempotent while the turn winds down"
    );
    assert_error(
        &h.post(
            &format!("/v1/sessions/{}/stop", SessionId::generate()),
            &h.operator,
            json!({}),
        )
        .await,
        StatusCode::NOT_FOUND,
        "SESSION_NOT_FOUND",
    );
    assert_error(
        &h.post(&path, &h.operator, json!({"force": true})).await,
        StatusCode::BAD_REQUEST,
        "INVALID_REQUEST",
    );
}

async fn cancel_ends_the_session_once(h: Harness) {
    let id = h.create("t").await;
    h.post(
        &format!("/v1/sessions/{id}/steer"),
        &h.operator,
        json!({"prompt": "more"}),
    )
    .await;
    let path = format!("/v1/sessions/{id}/cancel");
    let cancel = h.send(Method::POST, &path, Some(&h.operator), Payload::Empty).await;
    assert_eq!(cancel.status, StatusCode::ACCEPTED, "{}", cancel.body);
    assert_eq!(cancel.body["phase"], "canceled");
    let turns = h.get(&format!("/v1/sessions/{id}/turns"), &h.viewer).await;
    let statuses: Vec<&Value> = turns.body["turns"]
        .as_array()
        .expect("turns")
        .iter()
        .map(|t| &t["status"])
        .collect();
    assert_eq!(statuses, vec![&json!("canceled"), &json!("canceled")]);
    let again = h.post(&path, &h.operator, json!({})).await;
    assert_eq!(
        (again.status, again.body["phase"].clone()),
        (StatusCode::ACCEPTED, json!("canceled"))
    );
    assert_error(
        &h.post(
            &format!("/v1/sessions/{}/cancel", SessionId::generate()),
            &h.operator,
            json!({}),
        )
        .await,
        StatusCode::NOT_FOUND,
        "SESSION_NOT_FOUND",
    );
}

async fn resume_wakes_hibernated_sessions_only(h: Harness) {
    let id = h.create("t").await;
    let session_id = SessionId::parse(&id).expect("id");
    let path = format!("/v1/sessions/{id}/resume");
    let awake = h.post(&path, &h.operator, json!({})).await;
    assert_eq!(
        (awake.status, awake.body["phase"].clone()),
        (StatusCode::ACCEPTED, json!("queued"))
    );
    run_one_turn(&h, &session_id).await;
    assert!(
        h.store
            .transition_session(&session_id, SessionPhase::Idle, SessionPhase::Hibernated)
            .await
            .expect("hibernate")
    );
    let resumed = h.post(&path, &h.operator, json!({})).await;
    assert_eq!(
        (resumed.status, resumed.body["phase"].clone()),
        (StatusCode::ACCEPTED, json!("queued"))
    );
    h.post(&format!("/v1/sessions/{id}/cancel"), &h.operator, json!({}))
        .await;
    assert_error(
        &h.post(&path, &h.operator, json!({})).await,
        StatusCode::CONFLICT,
        "SESSION_NOT_STEERABLE",
    );
    assert_error(
        &h.post(
            &format!("/v1/sessions/{}/resume", SessionId::generate()),
            &h.operator,
            json!({}),
        )
        .await,
        StatusCode::NOT_FOUND,
        "SESSION_NOT_FOUND",
    );
}

async fn archive_hides_resting_sessions(h: Harness) {
    let id = h.create("t").await;
    let path = format!("/v1/sessions/{id}/archive");
    assert_error(
        &h.post(&path, &h.operator, json!({})).await,
        StatusCode::CONFLICT,
        "SESSION_ACTIVE",
    );
    run_one_turn(&h, &SessionId::parse(&id).expect("id")).await;
    let archived = h.post(&path, &h.operator, json!({})).await;
    assert_eq!(
        (archived.status, archived.body["archived"].clone()),
        (StatusCode::OK, json!(true))
    );
    assert_eq!(
        h.get("/v1/sessions", &h.viewer).await.body["sessions"]
            .as_array()
            .map(Vec::len),
        Some(0)
    );
    let unarchived = h.send(Method::DELETE, &path, Some(&h.operator), Payload::Empty).await;
    assert_eq!(
        (unarchived.status, unarchived.body["archived"].clone()),
        (StatusCode::OK, json!(false))
    );
    assert_eq!(
        h.get("/v1/sessions", &h.viewer).await.body["sessions"]
            .as_array()
            .map(Vec::len),
        Some(1)
    );
    let missing = format!("/v1/sessions/{}/archive", SessionId::generate());
    assert_error(
        &h.post(&missing, &h.operator, json!({})).await,
        StatusCode::NOT_FOUND,
        "SESSION_NOT_FOUND",
    );
    assert_error(
        &h.send(Method::DELETE, &missing, Some(&h.operator), Payload::Empty)
            .await,
        StatusCode::NOT_FOUND,
        "SESSION_NOT_FOUND",
    );
}

async fn attach_tickets_are_signed_for_one_session_and_action(h: Harness) {
    let id = h.create("t").await;
    let path = format!("/v1/sessions/{id}/attach-ticket");
    let minted = h.send(Method::POST, &path, Some(&h.viewer), Payload::Empty).await;
    assert_eq!(minted.status, StatusCode::CREATED, "{}", minted.body);
    assert_eq!(minted.body["stream_url"], json!(format!("/v1/sessions/{id}/stream")));
    assert!(is_rfc3339_utc(&minted.body["expires_at"]));
    let ticket = minted.body["ticket"].as_str().expect("ticket");
    let now = sortie_store::now_ms() / 1000;
    let claims =
        sortie_protocol::ticket::verify(TICKET_SECRET, ticket, now, &id, TicketAction::Attach).expect("verifies");
    assert_eq!((claims.ws, claims.ses.clone()), (h.workspace.id.clone(), id.clone()));
    assert!(
        claims.exp > now && claims.exp <= now + 90,
        "at most 90 s: {}",
        claims.exp - now
    );
    assert!(
        sortie_protocol::ticket::verify(TICKET_SECRET, ticket, now, &id, TicketAction::Turn).is_err(),
        "bound to its action"
    );
    assert!(sortie_protocol::ticket::verify(b"another secret", ticket, now, &id, TicketAction::Attach).is_err());
    let second = h.post(&path, &h.viewer, json!({"action": "attach"})).await;
    assert_ne!(
        second.body["ticket"], minted.body["ticket"],
        "every ticket has its own nonce"
    );

    assert_error(
        &h.post(&path, &h.viewer, json!({"action": "turn"})).await,
        StatusCode::FORBIDDEN,
        "FORBIDDEN",
    );
    let turn = h.post(&path, &h.operator, json!({"action": "turn"})).await;
    assert_eq!(turn.status, StatusCode::CREATED);
    assert!(
        sortie_protocol::ticket::verify(
            TICKET_SECRET,
            turn.body["ticket"].as_str().expect("t"),
            now,
            &id,
            TicketAction::Turn
        )
        .is_ok()
    );
    assert_error(
        &h.post(&path, &h.viewer, json!({"action": "watch"})).await,
        StatusCode::BAD_REQUEST,
        "INVALID_REQUEST",
    );
    assert_error(
        &h.post(
            &format!("/v1/sessions/{}/attach-ticket", SessionId::generate()),
            &h.viewer,
            json!({}),
        )
        .await,
        StatusCode::NOT_FOUND,
        "SESSION_NOT_FOUND",
    );
}

async fn usage_sums_by_session_and_day(h: Harness) {
    let empty = h.get("/v1/usage", &h.viewer).await;
    assert_eq!(
        (empty.status, empty.body.clone()),
        (StatusCode::OK, json!({"rows": []}))
    );
    let id = h.create("t").await;
    let session_id = SessionId::parse(&id).expect("id");
    let at = 1_796_219_431_000; // 2026-12-02
    for (model, input, output) in [("m-a", 10, 1), ("m-a", 5, 1), ("=m-b,\"x\"", 3, 2)] {
        let usage = TokenUsage {
            session_id: session_id.clone(),
            turn: 1,
            model: model.into(),
            epoch_ms: at,
            input_tokens: input,
            output_tokens: output,
        };
        h.store.record_token_usage(&usage).await.expect("usage");
    }
    h.store
        .meter_sandbox(
            &session_id,
            1,
            at,
            SandboxReading {
                cpu_ms: 12_345,
                peak_memory_bytes: 7 << 20,
            },
        )
        .await
        .expect("compute");
    let report = h.get(&format!("/v1/usage?session={id}"), &h.viewer).await;
    assert_eq!(
        report.body,
        json!({"rows": [{"session_id": id, "day": "2026-12-02", "compute_seconds": 12, "models": [
            {"model": "=m-b,\"x\"", "input_tokens": 3, "output_tokens": 2},
            {"model": "m-a", "input_tokens": 15, "output_tokens": 2},
        ]}]})
    );
    // The same as CSV: a model name is quoted and cannot start a spreadsheet formula.
    let csv = h.get(&format!("/v1/usage?session={id}&format=csv"), &h.viewer).await;
    assert_eq!(csv.status, StatusCode::OK);
    assert_eq!(csv.headers["content-type"], "text/csv; charset=utf-8");
    assert_eq!(
        String::from_utf8(csv.raw).expect("utf-8"),
        format!(
            "session_id,day,model,input_tokens,output_tokens,compute_seconds\r\n\
             {id},2026-12-02,,0,0,12\r\n\
             {id},2026-12-02,\"'=m-b,\"\"x\"\"\",3,2,0\r\n\
             {id},2026-12-02,\"m-a\",15,2,0\r\n"
        )
    );
    assert_error(
        &h.get("/v1/usage?format=xml", &h.viewer).await,
        StatusCode::BAD_REQUEST,
        "INVALID_REQUEST",
    );
    let session = h.get(&format!("/v1/sessions/{id}"), &h.viewer).await;
    assert_eq!(
        session.body["usage"],
        json!({"compute_seconds": 12, "peak_memory_bytes": 7 << 20, "input_tokens": 18, "output_tokens": 4})
    );
    assert_error(
        &h.get(&format!("/v1/usage?session={}", SessionId::generate()), &h.viewer)
            .await,
        StatusCode::NOT_FOUND,
        "SESSION_NOT_FOUND",
    );
    assert_error(
        &h.get("/v1/usage?since=yesterday", &h.viewer).await,
        StatusCode::BAD_REQUEST,
        "INVALID_REQUEST",
    );
    let other = h.get("/v1/usage", &h.other_operator).await;
    assert_eq!(other.body, json!({"rows": []}), "another workspace sees none of it");
}

/// Every session endpoint with a body that would succeed for the owner.
fn session_endpoints(id: &str) -> Vec<(Method, String, Payload)> {
    vec![
        (Method::GET, format!("/v1/sessions/{id}"), Payload::Empty),
        (Method::GET, format!("/v1/sessions/{id}/turns"), Payload::Empty),
        (Method::GET, format!("/v1/sessions/{id}/messages"), Payload::Empty),
        (
            Method::POST,
            format!("/v1/sessions/{id}/steer"),
            Payload::Json(json!({"prompt": "x"})),
        ),
        (
            Method::POST,
            format!("/v1/sessions/{id}/stop"),
            Payload::Json(json!({})),
        ),
        (
            Method::POST,
            format!("/v1/sessions/{id}/resume"),
            Payload::Json(json!({})),
        ),
        (
            Method::POST,
            format!("/v1/sessions/{id}/archive"),
            Payload::Json(json!({})),
        ),
        (Method::DELETE, format!("/v1/sessions/{id}/archive"), Payload::Empty),
        (
            Method::POST,
            format!("/v1/sessions/{id}/attach-ticket"),
            Payload::Json(json!({})),
        ),
        (Method::GET, format!("/v1/usage?session={id}"), Payload::Empty),
        (
            Method::POST,
            format!("/v1/sessions/{id}/egress"),
            Payload::Json(json!({"allow": ["github.com"]})),
        ),
        (
            Method::POST,
            format!("/v1/sessions/{id}/cancel"),
            Payload::Json(json!({})),
        ),
    ]
}

async fn another_workspace_sees_nothing(h: Harness) {
    let id = h.create("t").await;
    for (method, path, payload) in session_endpoints(&id) {
        let reply = h.send(method.clone(), &path, Some(&h.other_operator), payload).await;
        assert_error(&reply, StatusCode::NOT_FOUND, "SESSION_NOT_FOUND");
    }
    let listed = h.get("/v1/sessions", &h.other_operator).await;
    assert_eq!(listed.body["sessions"], json!([]));
    let unchanged = h.get(&format!("/v1/sessions/{id}"), &h.viewer).await;
    assert_eq!(
        (unchanged.body["phase"].clone(), unchanged.body["turns"].clone()),
        (json!("queued"), json!(1))
    );
}

async fn roles_and_tokens_are_enforced_everywhere(h: Harness) {
    let id = h.create("t").await;
    let mut endpoints = session_endpoints(&id);
    endpoints.push((Method::GET, "/v1/sessions".into(), Payload::Empty));
    endpoints.push((
        Method::POST,
        "/v1/sessions".into(),
        Payload::Json(json!({"repo": h.repo, "task": "t"})),
    ));
    endpoints.push((Method::GET, "/v1/usage".into(), Payload::Empty));
    for (method, path, payload) in endpoints {
        let bytes = match &payload {
            Payload::Json(value) => Some(value.clone()),
            _ => None,
        };
        let again = || bytes.clone().map_or(Payload::Empty, Payload::Json);
        for authorization in [
            None,
            Some("Bearer sortie_not-a-real-token".to_owned()),
            Some("Basic dXNlcjpwdw==".to_owned()),
            Some("Bearer ".to_owned()),
        ] {
            let reply = h.send_with(method.clone(), &path, authorization, again()).await;
            assert_error(&reply, StatusCode::UNAUTHORIZED, "UNAUTHORIZED");
            assert_eq!(
                reply.headers.get("www-authenticate").and_then(|v| v.to_str().ok()),
                Some("Bearer")
            );
        }
        let writes = method != Method::GET && !path.ends_with("/attach-ticket");
        let as_viewer = h.send(method.clone(), &path, Some(&h.viewer), again()).await;
        if writes {
            assert_error(&as_viewer, StatusCode::FORBIDDEN, "FORBIDDEN");
        } else {
            assert!(as_viewer.status.is_success(), "{method} {path}: {}", as_viewer.body);
        }
    }
    let session = h.get(&format!("/v1/sessions/{id}"), &h.viewer).await;
    assert_eq!(
        (session.body["phase"].clone(), session.body["turns"].clone()),
        (json!("queued"), json!(1)),
        "no refused write changed anything"
    );
}

async fn malformed_input_never_answers_500(h: Harness) {
    let id = h.create("t").await;
    let bodies: Vec<(Option<&'static str>, Vec<u8>)> = vec![
        (Some("application/json"), b"{".to_vec()),
        (Some("application/json"), b"[]".to_vec()),
        (Some("application/json"), b"null".to_vec()),
        (Some("application/json"), b"\"text\"".to_vec()),
        (
            Some("application/json"),
            br#"{"repo": 1, "task": [], "prompt": {}, "mode": 7, "action": false}"#.to_vec(),
        ),
        (Some("application/json"), br#"{"unknown": "field"}"#.to_vec()),
        (Some("application/json"), vec![0xff, 0xfe, 0x7b, 0x7d]),
        (Some("application/json"), b"{\"task\": \"\xc3\x28\"}".to_vec()),
        (Some("application/json"), br#"{"prompt": "\ud800"}"#.to_vec()),
        (
            Some("application/json"),
            format!("{{\"prompt\": \"{}\"}}", "x".repeat(REQUEST_BODY_MAX_BYTES)).into_bytes(),
        ),
        (Some("text/plain"), br#"{"prompt": "x"}"#.to_vec()),
        (Some("application/x-www-form-urlencoded"), b"prompt=x".to_vec()),
        (None, br#"{"prompt": "x"}"#.to_vec()),
        (Some("application/json"), b"{\"a\":".repeat(10_000)),
        (Some("application/json"), vec![b'['; 100_000]),
    ];
    let paths = [
        (Method::POST, "/v1/sessions".to_owned()),
        (Method::POST, format!("/v1/sessions/{id}/steer")),
        (Method::POST, format!("/v1/sessions/{id}/stop")),
        (Method::POST, format!("/v1/sessions/{id}/resume")),
        (Method::POST, format!("/v1/sessions/{id}/archive")),
        (Method::POST, format!("/v1/sessions/{id}/attach-ticket")),
        (Method::POST, format!("/v1/sessions/{id}/egress")),
        (Method::POST, format!("/v1/sessions/{id}/cancel")),
        (Method::GET, "/v1/sessions?limit=99999999999999999999".to_owned()),
        (Method::GET, "/v1/sessions?phase=%FF".to_owned()),
        (Method::GET, format!("/v1/sessions/{id}%00")),
        (Method::GET, "/v1/sessions/%E2%82".to_owned()),
        (Method::GET, "/v1/usage?session=%00".to_owned()),
    ];
    for (method, path) in &paths {
        for (content_type, bytes) in &bodies {
            // A GET handler does not read its body: a client still writing a large one when the answer
            // comes sees the connection close (a broken pipe), which says nothing about the server.
            if *method == Method::GET && bytes.len() > 1024 {
                continue;
            }
            let reply = h
                .send(
                    method.clone(),
                    path,
                    Some(&h.operator),
                    Payload::Raw {
                        content_type: *content_type,
                        bytes: bytes.clone(),
                    },
                )
                .await;
            assert!(
                reply.status.is_client_error(),
                "{method} {path} {content_type:?}: {} {}",
                reply.status,
                reply.body
            );
            assert!(
                !reply.code().is_empty(),
                "{method} {path}: an error code, got {}",
                String::from_utf8_lossy(&reply.raw)
            );
        }
    }
    let session = h.get(&format!("/v1/sessions/{id}"), &h.viewer).await;
    assert_eq!(
        (session.body["phase"].clone(), session.body["turns"].clone()),
        (json!("queued"), json!(1)),
        "nothing malformed was written"
    );
    assert_eq!(h.session_count().await, 1);
}

async fn operations_endpoints_answer(h: Harness) {
    let health = h.send(Method::GET, "/healthz", None, Payload::Empty).await;
    assert_eq!(
        (health.status, health.body.clone()),
        (StatusCode::OK, json!({"status": "ok"}))
    );
    let ready = h.send(Method::GET, "/readyz", None, Payload::Empty).await;
    assert_eq!(
        (ready.status, ready.body.clone()),
        (StatusCode::OK, json!({"status": "ready"}))
    );
    h.create("t").await;
    let metrics = h.send(Method::GET, "/metrics", None, Payload::Empty).await;
    assert_eq!(metrics.status, StatusCode::OK);
    let text = String::from_utf8_lossy(&metrics.raw);
    if h.socket_address().is_some() {
        // Only `run` installs the process-wide recorder, so only a served router has counted requests.
        assert!(text.contains("sortie_http_requests_total"), "{text}");
        assert!(
            text.contains(r#"route="/v1/sessions""#),
            "requests are labelled by route template: {text}"
        );
    }
    let openapi = h.send(Method::GET, "/v1/openapi.json", None, Payload::Empty).await;
    assert_eq!(openapi.status, StatusCode::OK);
    assert_eq!(
        openapi
            .headers
            .get(axum::http::header::CONTENT_TYPE)
            .map(|v| v.as_bytes()),
        Some(&b"application/json"[..])
    );
    assert_eq!(openapi.body["openapi"], "3.1.0");
    let paths = openapi.body["paths"].as_object().expect("paths");
    for (path, method) in [
        ("/v1/sessions", "post"),
        ("/v1/sessions", "get"),
        ("/v1/sessions/{id}", "get"),
        ("/v1/sessions/{id}/turns", "get"),
        ("/v1/sessions/{id}/messages", "get"),
        ("/v1/sessions/{id}/steer", "post"),
        ("/v1/sessions/{id}/stop", "post"),
        ("/v1/sessions/{id}/cancel", "post"),
        ("/v1/sessions/{id}/resume", "post"),
        ("/v1/sessions/{id}/archive", "post"),
        ("/v1/sessions/{id}/archive", "delete"),
        ("/v1/sessions/{id}/attach-ticket", "post"),
        ("/v1/sessions/{id}/egress", "post"),
        ("/v1/usage", "get"),
        ("/v1/model-keys", "get"),
        ("/v1/model-keys/{api}", "put"),
        ("/v1/model-keys/{api}", "delete"),
        ("/healthz", "get"),
        ("/readyz", "get"),
        ("/metrics", "get"),
    ] {
        assert!(
            paths.get(path).and_then(|p| p.get(method)).is_some(),
            "{method} {path} is documented"
        );
    }
    let codes = &openapi.body["components"]["schemas"]["ErrorCode"]["enum"];
    for code in sortie_protocol::ErrorCode::ALL {
        assert!(
            codes.as_array().is_some_and(|c| c.contains(&json!(code.as_str()))),
            "{code} documented: {codes}"
        );
    }
    assert!(openapi.body["components"]["securitySchemes"]["bearer"].is_object());
    // The document the dashboard's snapshot (tests/openapi.rs) is compared with is the one served.
    assert_eq!(openapi.body, json!(sortie_server::openapi()));
}

async fn unknown_routes_and_methods_have_codes(h: Harness) {
    assert_error(
        &h.get("/v1/nothing-here", &h.viewer).await,
        StatusCode::NOT_FOUND,
        "NOT_FOUND",
    );
    assert_error(
        &h.send(Method::PUT, "/v1/sessions", Some(&h.operator), Payload::Empty)
            .await,
        StatusCode::METHOD_NOT_ALLOWED,
        "METHOD_NOT_ALLOWED",
    );
    assert_error(
        &h.send(Method::DELETE, "/v1/sessions/x", Some(&h.operator), Payload::Empty)
            .await,
        StatusCode::METHOD_NOT_ALLOWED,
        "METHOD_NOT_ALLOWED",
    );
}

async fn concurrent_steers_get_distinct_numbers(h: Harness) {
    let id = h.create("t").await;
    let h = std::sync::Arc::new(h);
    let mut tasks = Vec::new();
    for i in 0..50 {
        let h = h.clone();
        let path = format!("/v1/sessions/{id}/steer");
        tasks.push(tokio::spawn(async move {
            h.post(&path, &h.operator, json!({"prompt": format!("steer {i}")}))
                .await
        }));
    }
    let mut numbers = Vec::new();
    let mut full = 0;
    for task in tasks {
        let reply = task.await.expect("join");
        match reply.status {
            StatusCode::ACCEPTED => numbers.push(reply.body["n"].as_u64().expect("n")),
            StatusCode::CONFLICT if reply.code() == "TURN_QUEUE_FULL" => full += 1,
            other => panic!("unexpected {other}: {}", reply.body),
        }
    }
    numbers.sort_unstable();
    assert_eq!(
        numbers,
        (2..=u64::from(TURN_QUEUE_MAX)).collect::<Vec<_>>(),
        "distinct numbers, at most the queue limit"
    );
    assert_eq!(full, 50 - numbers.len());
}

async fn cancel_racing_steers_keeps_the_ledger_consistent(h: Harness) {
    let id = h.create("t").await;
    let h = std::sync::Arc::new(h);
    let mut tasks = Vec::new();
    for i in 0..30 {
        let h = h.clone();
        let (path, body) = if i == 10 {
            (format!("/v1/sessions/{id}/cancel"), json!({}))
        } else {
            (format!("/v1/sessions/{id}/steer"), json!({"prompt": "s"}))
        };
        tasks.push(tokio::spawn(async move { h.post(&path, &h.operator, body).await }));
    }
    for task in tasks {
        let reply = task.await.expect("join");
        assert!(
            reply.status == StatusCode::ACCEPTED
                || ["TURN_QUEUE_FULL", "SESSION_NOT_STEERABLE"].contains(&reply.code()),
            "{} {}",
            reply.status,
            reply.body
        );
    }
    let session = h.get(&format!("/v1/sessions/{id}"), &h.viewer).await;
    let turns = h.get(&format!("/v1/sessions/{id}/turns"), &h.viewer).await;
    let turns = turns.body["turns"].as_array().expect("turns");
    assert_eq!(session.body["phase"], "canceled");
    assert_eq!(session.body["turns"].as_u64(), Some(turns.len() as u64));
    let numbers: Vec<u64> = turns.iter().filter_map(|t| t["n"].as_u64()).collect();
    assert_eq!(numbers, (1..=turns.len() as u64).collect::<Vec<_>>());
    assert!(
        turns.iter().all(|t| t["status"] == "canceled"),
        "no turn waits in a canceled session: {turns:?}"
    );
}

/// Server-sent events as they arrive: `(id, data)` of each complete event, comments skipped.
struct Events {
    body: futures::stream::BoxStream<'static, Vec<u8>>,
    buffer: Vec<u8>,
}

impl Events {
    async fn open(h: &Harness, path: &str, token: &str, extra: &[(&str, &str)]) -> Self {
        let (status, body) = h.open_stream(path, token, extra).await;
        assert_eq!(status, StatusCode::OK);
        Self {
            body,
            buffer: Vec::new(),
        }
    }

    /// The next event, or a failure after a deadline (the stream never ends by itself).
    async fn next(&mut self) -> (u64, Value) {
        use futures::StreamExt;
        let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(20);
        loop {
            if let Some(end) = self.buffer.windows(2).position(|w| w == b"\n\n") {
                let block = String::from_utf8(self.buffer.drain(..end + 2).collect()).expect("utf-8");
                let id = block.lines().find_map(|l| l.strip_prefix("id: "));
                let data = block.lines().find_map(|l| l.strip_prefix("data: "));
                if let (Some(id), Some(data)) = (id, data) {
                    return (
                        id.parse().expect("numeric id"),
                        serde_json::from_str(data).expect("json"),
                    );
                }
                continue;
            }
            let chunk = tokio::time::timeout_at(deadline, self.body.next())
                .await
                .expect("an event within 20 s")
                .expect("the stream went on");
            self.buffer.extend(chunk);
        }
    }

    /// The next `n` events as `"<session|turn N> <state>"` lines, with the last one's id.
    async fn said(&mut self, n: usize) -> (Vec<String>, Vec<Value>, u64) {
        let mut said = Vec::new();
        let mut events = Vec::new();
        let mut last = 0;
        for _ in 0..n {
            let (id, event) = self.next().await;
            assert_eq!(event["seq"], json!(id), "the SSE id is the event's seq");
            assert!(id > last, "ids increase");
            last = id;
            said.push(match event["type"].as_str() {
                Some("session.phase") => format!("session {}", event["phase"].as_str().expect("phase")),
                Some("turn.status") => format!("turn {} {}", event["turn"], event["status"].as_str().expect("status")),
                other => panic!("an event of type {other:?}"),
            });
            events.push(event);
        }
        (said, events, last)
    }
}

async fn events_tell_the_workspaces_changes_in_order_and_resume_after_the_last_seen(h: Harness) {
    // A viewer's stream starts with the next change; another workspace's changes never reach it.
    let mut events = Events::open(&h, "/v1/events", &h.viewer, &[]).await;
    let foreign = h
        .post(
            "/v1/sessions",
            &h.other_operator,
            json!({"repo": "https://example.com/a.git", "task": "t", "agent": "scripted"}),
        )
        .await;
    assert_eq!(foreign.status, StatusCode::ACCEPTED, "{}", foreign.body);
    let id = h.create("t").await;
    h.post(
        &format!("/v1/sessions/{id}/steer"),
        &h.operator,
        json!({"prompt": "more"}),
    )
    .await;
    let (said, seen, third) = events.said(3).await;
    assert_eq!(said, ["session queued", "turn 1 accepted", "turn 2 accepted"]);
    assert!(seen.iter().all(|e| e["session"] == json!(id)), "{seen:?}");
    assert!(seen[0]["at"].as_str().is_some_and(|at| at.ends_with('Z')));
    drop(events);

    // While nobody listens: a cancel. Resuming after the last event seen loses nothing.
    let cancel = h
        .send(
            Method::POST,
            &format!("/v1/sessions/{id}/cancel"),
            Some(&h.operator),
            Payload::Empty,
        )
        .await;
    assert_eq!(cancel.status, StatusCode::ACCEPTED);
    let third = third.to_string();
    let mut resumed = Events::open(&h, "/v1/events", &h.viewer, &[("last-event-id", &third)]).await;
    let (said, _, _) = resumed.said(3).await;
    assert_eq!(said, ["session canceled", "turn 1 canceled", "turn 2 canceled"]);
    // `?after=0` replays what is kept, from the start.
    let mut replay = Events::open(&h, "/v1/events?after=0", &h.viewer, &[]).await;
    let (said, _, _) = replay.said(4).await;
    assert_eq!(
        said,
        [
            "session queued",
            "turn 1 accepted",
            "turn 2 accepted",
            "session canceled"
        ]
    );

    assert_error(
        &h.send(Method::GET, "/v1/events", None, Payload::Empty).await,
        StatusCode::UNAUTHORIZED,
        "UNAUTHORIZED",
    );
    let (status, _) = h
        .open_stream("/v1/events", &h.viewer, &[("last-event-id", "soon")])
        .await;
    assert_eq!(status, StatusCode::BAD_REQUEST);

    // Once pruned, an old Last-Event-ID is told it lost events, with a code to act on.
    h.store.prune_events(sortie_store::now_ms() + 1).await.expect("prune");
    let (status, mut body) = h
        .open_stream("/v1/events", &h.viewer, &[("last-event-id", &third)])
        .await;
    assert_eq!(status, StatusCode::GONE);
    let mut raw = Vec::new();
    while let Some(chunk) = futures::StreamExt::next(&mut body).await {
        raw.extend(chunk);
    }
    let refusal: Value = serde_json::from_slice(&raw).expect("json");
    assert_eq!(refusal["error"]["code"], "EVENTS_PRUNED", "{refusal}");
}

async fn idempotency_keys_give_a_retry_the_first_answer(h: Harness) {
    let body = json!({"repo": h.repo, "task": "once", "agent": "scripted"});
    let key = [("idempotency-key", "create-7f3a")];
    let first = h.post_with("/v1/sessions", &h.operator, &key, body.clone()).await;
    assert_eq!(first.status, StatusCode::ACCEPTED, "{}", first.body);
    assert!(first.headers.get("idempotent-replayed").is_none());
    let sessions = h.session_count().await;
    // A retry: the same answer, no second session.
    let again = h.post_with("/v1/sessions", &h.operator, &key, body.clone()).await;
    assert_eq!((again.status, &again.body), (StatusCode::ACCEPTED, &first.body));
    assert_eq!(
        again.headers.get("idempotent-replayed").map(|v| v.as_bytes()),
        Some(&b"true"[..])
    );
    assert_eq!(h.session_count().await, sessions);
    // The same key for another request, or another endpoint, is refused; another workspace has its own keys.
    let other = json!({"repo": h.repo, "task": "twice", "agent": "scripted"});
    assert_error(
        &h.post_with("/v1/sessions", &h.operator, &key, other).await,
        StatusCode::UNPROCESSABLE_ENTITY,
        "IDEMPOTENCY_KEY_REUSED",
    );
    let id = first.body["id"].as_str().expect("id");
    let steer_path = format!("/v1/sessions/{id}/steer");
    assert_error(
        &h.post_with(&steer_path, &h.operator, &key, json!({"prompt": "more"}))
            .await,
        StatusCode::UNPROCESSABLE_ENTITY,
        "IDEMPOTENCY_KEY_REUSED",
    );
    let theirs = h
        .post_with(
            "/v1/sessions",
            &h.other_operator,
            &key,
            json!({"repo": "https://example.com/a.git", "task": "once", "agent": "scripted"}),
        )
        .await;
    assert_eq!(theirs.status, StatusCode::ACCEPTED, "{}", theirs.body);
    assert_ne!(theirs.body["id"], first.body["id"]);
    for bad in ["", "has space", &"k".repeat(256)] {
        let reply = h
            .post_with("/v1/sessions", &h.operator, &[("idempotency-key", bad)], body.clone())
            .await;
        assert_error(&reply, StatusCode::BAD_REQUEST, "INVALID_REQUEST");
    }
    assert_eq!(h.session_count().await, sessions);

    // A refused request gives its key back: the corrected retry runs.
    let refused = h
        .post_with(
            "/v1/sessions",
            &h.operator,
            &[("idempotency-key", "fix-me")],
            json!({"repo": h.repo, "task": "", "agent": "scripted"}),
        )
        .await;
    assert_eq!(refused.status, StatusCode::BAD_REQUEST, "{}", refused.body);
    let fixed = h
        .post_with(
            "/v1/sessions",
            &h.operator,
            &[("idempotency-key", "fix-me")],
            json!({"repo": h.repo, "task": "fixed", "agent": "scripted"}),
        )
        .await;
    assert_eq!(fixed.status, StatusCode::ACCEPTED, "{}", fixed.body);

    // Steer: a retried steer adds one turn.
    let steer_key = [("idempotency-key", "steer-1")];
    let turn = h
        .post_with(&steer_path, &h.operator, &steer_key, json!({"prompt": "more"}))
        .await;
    assert_eq!(turn.status, StatusCode::ACCEPTED, "{}", turn.body);
    let retried = h
        .post_with(&steer_path, &h.operator, &steer_key, json!({"prompt": "more"}))
        .await;
    assert_eq!((retried.status, &retried.body), (StatusCode::ACCEPTED, &turn.body));
    let turns = h.get(&format!("/v1/sessions/{id}/turns"), &h.viewer).await;
    assert_eq!(turns.body["turns"].as_array().map(Vec::len), Some(2));

    // Retries racing each other: one session; each answer is it, or "still being answered".
    let race = json!({"repo": h.repo, "task": "raced", "agent": "scripted"});
    let replies = futures::future::join_all((0..8).map(|_| {
        h.post_with(
            "/v1/sessions",
            &h.operator,
            &[("idempotency-key", "race")],
            race.clone(),
        )
    }))
    .await;
    let created: Vec<&Value> = replies
        .iter()
        .filter(|r| r.status == StatusCode::ACCEPTED)
        .map(|r| &r.body["id"])
        .collect();
    assert!(
        !created.is_empty() && created.iter().all(|id| *id == created[0]),
        "{replies:?}"
    );
    assert!(
        replies
            .iter()
            .all(|r| r.status == StatusCode::ACCEPTED || r.code() == "IDEMPOTENCY_KEY_IN_USE"),
        "{replies:?}"
    );
    assert_eq!(h.session_count().await, sessions + 2);
}

async fn webhooks_are_added_listed_and_removed_by_admins_only(h: Harness) {
    let secret = "a-secret-of-32-characters-000000";
    // TEST-NET-1 is public as far as the rules go, and needs no resolver.
    let good = json!({"url": "http://192.0.2.10:8080/hooks/sortie", "secret": secret, "events": ["session.phase"]});
    assert_error(
        &h.post("/v1/webhooks", &h.operator, good.clone()).await,
        StatusCode::FORBIDDEN,
        "FORBIDDEN",
    );
    for (url, why) in [
        ("http://127.0.0.1:9/hook", "loopback"),
        ("http://10.1.2.3/hook", "private"),
        ("http://[::1]:9/", "loopback"),
        ("http://169.254.169.254/latest", "metadata"),
        ("http://localhost:9/", "loopback"),
        ("ftp://192.0.2.10/", "http"),
        ("http://user:pw@192.0.2.10/", "credentials"),
    ] {
        let refused = h
            .post("/v1/webhooks", &h.admin, json!({"url": url, "secret": secret}))
            .await;
        assert_error(&refused, StatusCode::BAD_REQUEST, "WEBHOOK_URL_REFUSED");
        let message = refused.body["error"]["message"].as_str().unwrap_or_default();
        assert!(message.contains(why), "{url}: {message}");
    }
    for body in [
        json!({"url": "http://192.0.2.10/", "secret": "short"}),
        json!({"url": "http://192.0.2.10/", "secret": "has a space in the secret value"}),
        json!({"url": "http://192.0.2.10/", "secret": secret, "events": []}),
    ] {
        assert_error(
            &h.post("/v1/webhooks", &h.admin, body).await,
            StatusCode::BAD_REQUEST,
            "WEBHOOK_INVALID",
        );
    }
    assert_error(
        &h.post(
            "/v1/webhooks",
            &h.admin,
            json!({"url": "http://192.0.2.10/", "secret": secret, "events": ["session.nope"]}),
        )
        .await,
        StatusCode::BAD_REQUEST,
        "INVALID_REQUEST",
    );

    let created = h.post("/v1/webhooks", &h.admin, good).await;
    assert_eq!(created.status, StatusCode::CREATED, "{}", created.body);
    assert_eq!(created.body["events"], json!(["session.phase"]));
    assert!(
        !created.raw.windows(secret.len()).any(|w| w == secret.as_bytes()),
        "the secret is never shown"
    );
    let id = created.body["id"].as_str().expect("id").to_owned();
    assert!(id.starts_with("whk_"), "{id}");
    let all = h
        .post(
            "/v1/webhooks",
            &h.admin,
            json!({"url": "http://192.0.2.11/", "secret": secret}),
        )
        .await;
    assert_eq!(
        all.body["events"],
        json!(["session.phase", "turn.status"]),
        "default: every kind"
    );

    let listed = h.get("/v1/webhooks", &h.admin).await;
    assert_eq!(
        listed.body["webhooks"].as_array().map(Vec::len),
        Some(2),
        "{}",
        listed.body
    );
    assert!(!listed.raw.windows(secret.len()).any(|w| w == secret.as_bytes()));
    assert_error(
        &h.get("/v1/webhooks", &h.viewer).await,
        StatusCode::FORBIDDEN,
        "FORBIDDEN",
    );
    let theirs = h.get("/v1/webhooks", &h.other_admin).await;
    assert_eq!(theirs.body["webhooks"], json!([]), "another workspace sees none");
    let deliveries = h.get(&format!("/v1/webhooks/{id}/deliveries"), &h.admin).await;
    assert_eq!(
        (deliveries.status, deliveries.body["deliveries"].clone()),
        (StatusCode::OK, json!([]))
    );
    assert_error(
        &h.get(&format!("/v1/webhooks/{id}/deliveries"), &h.other_admin).await,
        StatusCode::NOT_FOUND,
        "WEBHOOK_NOT_FOUND",
    );

    let path = format!("/v1/webhooks/{id}");
    assert_error(
        &h.send(Method::DELETE, &path, Some(&h.other_admin), Payload::Empty)
            .await,
        StatusCode::NOT_FOUND,
        "WEBHOOK_NOT_FOUND",
    );
    assert_eq!(
        h.send(Method::DELETE, &path, Some(&h.admin), Payload::Empty)
            .await
            .status,
        StatusCode::NO_CONTENT
    );
    assert_error(
        &h.send(Method::DELETE, &path, Some(&h.admin), Payload::Empty).await,
        StatusCode::NOT_FOUND,
        "WEBHOOK_NOT_FOUND",
    );
    assert_eq!(
        h.get("/v1/webhooks", &h.admin).await.body["webhooks"]
            .as_array()
            .map(Vec::len),
        Some(1)
    );
}
