//! The real binary end to end: first start, client commands with no token setup, admin commands.

mod support;

use std::os::unix::fs::PermissionsExt;

use serde_json::{Value, json};
use support::{Server, git_repo, sortie, stderr, stdout};

#[test]
fn first_start_creates_an_admin_token_once() {
    let temp = tempfile::tempdir().expect("temp");
    let data_dir = temp.path().join("data");
    let server = Server::start(temp.path(), &data_dir, None);
    let token_path = data_dir.join("admin-token");
    let token = std::fs::read_to_string(&token_path)
        .expect("admin token saved")
        .trim()
        .to_owned();
    assert!(token.starts_with("sortie_"), "{token}");
    assert_eq!(
        std::fs::metadata(&token_path).expect("meta").permissions().mode() & 0o777,
        0o600
    );
    assert_eq!(
        std::fs::metadata(&data_dir).expect("meta").permissions().mode() & 0o777,
        0o700
    );
    assert!(
        server.banner.iter().any(|line| line == &token),
        "the token is printed once: {:?}",
        server.banner
    );
    server.kill_hard();

    let again = Server::start(temp.path(), &data_dir, None);
    assert!(
        again.banner.is_empty(),
        "a second start prints no token: {:?}",
        again.banner
    );
    assert_eq!(
        std::fs::read_to_string(&token_path).expect("token").trim(),
        token,
        "and keeps the first one"
    );
}

#[test]
fn client_commands_work_with_no_token_setup() {
    let temp = tempfile::tempdir().expect("temp");
    let data_dir = temp.path().join("data");
    let repo = git_repo(temp.path(), "repo");
    let server = Server::start_with(
        temp.path(),
        &data_dir,
        None,
        &["--roles", "api,gateway", "--default-agent", "scripted"],
    );
    let run = |args: &[&str]| server.client(temp.path(), &data_dir, args);

    let created = run(&[
        "run",
        "--repo",
        repo.to_str().expect("utf-8"),
        "--agent",
        "scripted",
        "--allow",
        "github.com",
        "Fix the bug",
    ]);
    assert!(created.status.success(), "{}", stderr(&created));
    let out = stdout(&created);
    let id = out.split_whitespace().next().expect("id").to_owned();
    assert!(
        id.starts_with("ses_") && out.contains("queued") && out.contains(&format!("branch sortie/{id}")),
        "{out}"
    );

    // A relative --repo is resolved by the client.
    let relative = sortie(temp.path())
        .current_dir(&repo)
        .args(["--server", &server.url, "--data-dir"])
        .arg(&data_dir)
        .args(["--json", "run", "--repo", ".", "second task"])
        .output()
        .expect("run");
    assert!(relative.status.success(), "{}", stderr(&relative));
    let second: Value = serde_json::from_slice(&relative.stdout).expect("json");
    assert_eq!(second["repo"], Value::String(repo.to_string_lossy().into_owned()));
    assert_eq!(second["agent"], "scripted", "the server's --default-agent");

    let listed = run(&["ls"]);
    assert!(listed.status.success());
    let text = stdout(&listed);
    assert!(
        text.contains(&id) && text.contains("Fix the bug") && text.lines().count() == 3,
        "{text}"
    );
    let listed_json: Value = serde_json::from_slice(&run(&["--json", "ls"]).stdout).expect("json");
    assert_eq!(listed_json["sessions"].as_array().map(Vec::len), Some(2));

    let steer = run(&["steer", &id, "also add a test"]);
    assert!(steer.status.success(), "{}", stderr(&steer));
    assert!(stdout(&steer).contains("turn 2 accepted"), "{}", stdout(&steer));
    let shown = run(&["show", &id]);
    let text = stdout(&shown);
    assert!(
        shown.status.success()
            && text.contains("Fix the bug")
            && text.contains("also add a test")
            && text.contains("github.com"),
        "{text}"
    );
    let shown_json: Value = serde_json::from_slice(&run(&["--json", "show", &id]).stdout).expect("json");
    assert_eq!(shown_json["turn_list"].as_array().map(Vec::len), Some(2));

    let stop = run(&["stop", &id]);
    assert!(!stop.status.success());
    assert!(stderr(&stop).contains("NO_TURN_RUNNING"), "{}", stderr(&stop));
    let cancel = run(&["cancel", &id]);
    assert!(
        cancel.status.success() && stdout(&cancel).contains("canceled"),
        "{}",
        stdout(&cancel)
    );
    let late = run(&["steer", &id, "too late"]);
    assert!(
        !late.status.success() && stderr(&late).contains("SESSION_NOT_STEERABLE"),
        "{}",
        stderr(&late)
    );

    let bad = run(&[
        "run",
        "--repo",
        repo.to_str().expect("utf-8"),
        "--allow",
        "*.evil.com",
        "--allow",
        "10.0.0.1",
        "x",
    ]);
    assert!(!bad.status.success());
    let err = stderr(&bad);
    assert!(
        err.contains("EGRESS_ALLOWLIST_INVALID") && err.contains("*.evil.com") && err.contains("10.0.0.1"),
        "{err}"
    );
    let missing = run(&["show", "ses_01jd8x3k4m5n6p7q8r9s0t1v2w"]);
    assert!(!missing.status.success() && stderr(&missing).contains("SESSION_NOT_FOUND"));
    let json_error = run(&["--json", "show", "nope"]);
    let refusal: Value = serde_json::from_slice(&json_error.stderr).expect("json error");
    assert_eq!(refusal["error"]["code"], "SESSION_NOT_FOUND");
}

#[test]
fn admin_commands_make_workspaces_and_tokens() {
    let temp = tempfile::tempdir().expect("temp");
    let data_dir = temp.path().join("data");
    let roots = temp.path().join("team-repos");
    let team_repo = git_repo(&roots, "service");
    let server = Server::start(temp.path(), &data_dir, None);
    let default_session = {
        let out = server.client(
            temp.path(),
            &data_dir,
            &[
                "--json",
                "run",
                "--repo",
                team_repo.to_str().expect("utf-8"),
                "--agent",
                "scripted",
                "default's task",
            ],
        );
        assert!(out.status.success(), "{}", stderr(&out));
        serde_json::from_slice::<Value>(&out.stdout).expect("json")["id"]
            .as_str()
            .expect("id")
            .to_owned()
    };

    let admin = |args: &[&str]| {
        sortie(temp.path())
            .arg("--data-dir")
            .arg(&data_dir)
            .args(args)
            .output()
            .expect("admin")
    };
    let created = admin(&[
        "workspace",
        "create",
        "team",
        "--allow-root",
        roots.to_str().expect("utf-8"),
    ]);
    assert!(created.status.success(), "{}", stderr(&created));
    let duplicate = admin(&["workspace", "create", "team"]);
    assert!(!duplicate.status.success() && stderr(&duplicate).contains("exists"));
    let bad_name = admin(&["workspace", "create", "Team Space"]);
    assert!(!bad_name.status.success());

    let token_out = admin(&["token", "create", "--workspace", "team", "--role", "operator"]);
    assert!(token_out.status.success(), "{}", stderr(&token_out));
    let token = stdout(&token_out);
    assert_eq!(token.lines().count(), 1, "only the token is printed");
    let token = token.trim();
    assert!(token.starts_with("sortie_"));
    assert!(
        !admin(&["token", "create", "--workspace", "nope", "--role", "viewer"])
            .status
            .success()
    );
    assert!(
        !admin(&["token", "create", "--workspace", "team", "--role", "root"])
            .status
            .success()
    );

    let as_team = |args: &[&str]| {
        sortie(temp.path())
            .env("SORTIE_TOKEN", token)
            .arg("--server")
            .arg(&server.url)
            .args(args)
            .output()
            .expect("client")
    };
    let ours = as_team(&[
        "--json",
        "run",
        "--repo",
        team_repo.to_str().expect("utf-8"),
        "--agent",
        "scripted",
        "team task",
    ]);
    assert!(ours.status.success(), "{}", stderr(&ours));
    assert_eq!(
        serde_json::from_slice::<Value>(&ours.stdout).expect("json")["workspace"],
        "team"
    );
    let outside = git_repo(temp.path(), "elsewhere");
    let refused = as_team(&[
        "run",
        "--repo",
        outside.to_str().expect("utf-8"),
        "--agent",
        "scripted",
        "x",
    ]);
    assert!(stderr(&refused).contains("REPO_NOT_ALLOWED"), "{}", stderr(&refused));
    let foreign = as_team(&["show", &default_session]);
    assert!(
        stderr(&foreign).contains("SESSION_NOT_FOUND"),
        "another workspace's session is not found"
    );
    let listed: Value = serde_json::from_slice(&as_team(&["--json", "ls"]).stdout).expect("json");
    assert_eq!(listed["sessions"].as_array().map(Vec::len), Some(1));

    // A token's life from the host: created with an expiry as JSON, listed without its value, revoked.
    let created = admin(&[
        "--json",
        "token",
        "create",
        "--workspace",
        "team",
        "--role",
        "viewer",
        "--expires-in",
        "1h",
    ]);
    assert!(created.status.success(), "{}", stderr(&created));
    let created: Value = serde_json::from_slice(&created.stdout).expect("json");
    let (id, secret) = (
        created["id"].as_str().expect("id").to_owned(),
        created["token"].as_str().expect("token").to_owned(),
    );
    assert!(id.starts_with("tok_") && secret.starts_with("sortie_"), "{created}");
    let as_new = |args: &[&str]| {
        sortie(temp.path())
            .env("SORTIE_TOKEN", &secret)
            .arg("--server")
            .arg(&server.url)
            .args(args)
            .output()
            .expect("client")
    };
    assert!(as_new(&["ls"]).status.success());
    let table = admin(&["token", "list", "--workspace", "team"]);
    assert!(table.status.success(), "{}", stderr(&table));
    let table = stdout(&table);
    assert!(
        table.contains(&id) && table.contains("viewer") && table.contains("live"),
        "{table}"
    );
    let listed = admin(&["--json", "token", "list"]);
    let text = stdout(&listed);
    assert!(
        !text.contains(&secret) && !text.contains(token),
        "a list never shows a token's value"
    );
    let listed: Value = serde_json::from_str(&text).expect("json");
    let ours = listed
        .as_array()
        .expect("tokens")
        .iter()
        .find(|t| t["id"] == id.as_str())
        .expect("listed");
    assert_eq!((&ours["workspace"], &ours["role"]), (&json!("team"), &json!("viewer")));
    assert!(
        ours["expires_at"].is_string() && ours["created_at"].is_string(),
        "{ours}"
    );
    assert!(
        listed
            .as_array()
            .expect("tokens")
            .iter()
            .any(|t| t["workspace"] == "default"),
        "every workspace's without --workspace"
    );
    let revoked = admin(&["token", "revoke", &id]);
    assert!(revoked.status.success(), "{}", stderr(&revoked));
    let refused = as_new(&["ls"]);
    assert!(!refused.status.success());
    assert!(stderr(&refused).contains("UNAUTHORIZED"), "{}", stderr(&refused));
    assert!(!admin(&["token", "revoke", &id]).status.success(), "twice is an error");
    assert!(
        !admin(&[
            "token",
            "create",
            "--workspace",
            "team",
            "--role",
            "viewer",
            "--expires-in",
            "10s"
        ])
        .status
        .success(),
        "an expiry under a minute is refused"
    );
}

#[test]
fn serve_runs_on_postgres_too() {
    let temp = tempfile::tempdir().expect("temp");
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    if !runtime.block_on(sortie_store::testing::postgres_available("serve_runs_on_postgres_too")) {
        return;
    }
    let database = runtime
        .block_on(sortie_store::testing::TestDatabase::postgres())
        .expect("postgres database");
    let data_dir = temp.path().join("data");
    let server = Server::start(temp.path(), &data_dir, Some(&database.url));
    let created = server.client(
        temp.path(),
        &data_dir,
        &[
            "--json",
            "run",
            "--repo",
            "https://github.com/o/r.git",
            "--agent",
            "scripted",
            "remote task",
        ],
    );
    assert!(created.status.success(), "{}", stderr(&created));
    let listed: Value =
        serde_json::from_slice(&server.client(temp.path(), &data_dir, &["--json", "ls"]).stdout).expect("json");
    assert_eq!(listed["sessions"][0]["title"], "remote task");
    // A shared database gives the default workspace no local repositories.
    let local = git_repo(temp.path(), "local");
    let refused = server.client(
        temp.path(),
        &data_dir,
        &[
            "run",
            "--repo",
            local.to_str().expect("utf-8"),
            "--agent",
            "scripted",
            "x",
        ],
    );
    assert!(stderr(&refused).contains("REPO_NOT_ALLOWED"), "{}", stderr(&refused));
    drop(server);
    drop(database);
}

#[test]
fn serve_answers_the_stream_with_single_use_tickets() {
    let temp = tempfile::tempdir().expect("temp");
    let data_dir = temp.path().join("data");
    let server = Server::start(temp.path(), &data_dir, None);
    let token = std::fs::read_to_string(data_dir.join("admin-token"))
        .expect("token")
        .trim()
        .to_owned();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    runtime.block_on(async {
        let client = support::http_client();
        let created: Value = client
            .post(format!("{}/v1/sessions", server.url))
            .bearer_auth(&token)
            .json(&serde_json::json!({"repo": "https://github.com/o/r.git", "task": "watch me", "agent": "scripted"}))
            .send()
            .await
            .expect("create")
            .json()
            .await
            .expect("json");
        let id = created["id"].as_str().expect("id");
        let minted: Value = client
            .post(format!("{}/v1/sessions/{id}/attach-ticket", server.url))
            .bearer_auth(&token)
            .send()
            .await
            .expect("ticket")
            .json()
            .await
            .expect("json");
        let stream_url = format!("{}{}", server.url, minted["stream_url"].as_str().expect("url"));
        let ticket = minted["ticket"].as_str().expect("ticket");
        // The queued turn has no driver yet: the stream opens and waits (only its head is read).
        let open = client
            .get(&stream_url)
            .header("authorization", format!("Ticket {ticket}"))
            .send()
            .await
            .expect("stream");
        assert_eq!(open.status().as_u16(), 200);
        assert_eq!(
            open.headers()
                .get("x-vercel-ai-ui-message-stream")
                .and_then(|v| v.to_str().ok()),
            Some("v1")
        );
        drop(open);
        let replay = client
            .get(&stream_url)
            .header("authorization", format!("Ticket {ticket}"))
            .send()
            .await
            .expect("stream");
        assert_eq!(replay.status().as_u16(), 401);
        let refusal: Value = replay.json().await.expect("json");
        assert_eq!(refusal["error"]["code"], "TICKET_REPLAYED");
        let bearer = client
            .get(&stream_url)
            .bearer_auth(&token)
            .send()
            .await
            .expect("stream");
        assert_eq!(bearer.status().as_u16(), 401, "a bearer token is not a ticket");
    });
}

#[test]
fn only_configured_origins_may_attach_from_another_site() {
    let temp = tempfile::tempdir().expect("temp");
    let data_dir = temp.path().join("data");
    let server = Server::start_with(
        temp.path(),
        &data_dir,
        None,
        &["--cors-origin", "https://tools.example.com"],
    );
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    runtime.block_on(async {
        let client = support::http_client();
        let preflight = |origin: &'static str| {
            client
                .request(
                    reqwest::Method::OPTIONS,
                    format!("{}/v1/sessions/ses_01jd8x3k4m5n6p7q8r9s0t1v2w/stream", server.url),
                )
                .header("origin", origin)
                .header("access-control-request-method", "GET")
                .header("access-control-request-headers", "authorization")
                .send()
        };
        let allowed = preflight("https://tools.example.com").await.expect("preflight");
        assert_eq!(allowed.status().as_u16(), 204);
        assert_eq!(
            allowed
                .headers()
                .get("access-control-allow-origin")
                .and_then(|v| v.to_str().ok()),
            Some("https://tools.example.com")
        );
        assert!(
            allowed
                .headers()
                .get("access-control-allow-headers")
                .and_then(|v| v.to_str().ok())
                .is_some_and(|h| h.contains("authorization"))
        );
        let other = preflight("https://elsewhere.example.com").await.expect("preflight");
        assert!(other.headers().get("access-control-allow-origin").is_none());

        // A refusal reaches an allowed page readably (its code), with the stream's header exposed;
        // another site gets no CORS headers at all.
        let attach = |origin: &'static str| {
            client
                .get(format!(
                    "{}/v1/sessions/ses_01jd8x3k4m5n6p7q8r9s0t1v2w/stream",
                    server.url
                ))
                .header("origin", origin)
                .header("authorization", "Ticket not-a-ticket")
                .send()
        };
        let refused = attach("https://tools.example.com").await.expect("attach");
        assert_eq!(refused.status().as_u16(), 401);
        let header = |response: &reqwest::Response, name: &str| {
            response
                .headers()
                .get(name)
                .and_then(|v| v.to_str().ok())
                .map(ToOwned::to_owned)
        };
        assert_eq!(
            header(&refused, "access-control-allow-origin").as_deref(),
            Some("https://tools.example.com")
        );
        assert_eq!(
            header(&refused, "access-control-expose-headers").as_deref(),
            Some("x-vercel-ai-ui-message-stream")
        );
        let body: serde_json::Value = refused.json().await.expect("json");
        assert_eq!(body["error"]["code"], "TICKET_INVALID");
        let elsewhere = attach("https://elsewhere.example.com").await.expect("attach");
        assert_eq!(elsewhere.status().as_u16(), 401);
        assert!(header(&elsewhere, "access-control-allow-origin").is_none());
        assert!(header(&elsewhere, "access-control-expose-headers").is_none());
    });
    drop(server);

    let refused = sortie(temp.path())
        .args(["serve", "--listen", "127.0.0.1:0", "--data-dir"])
        .arg(temp.path().join("other-data"))
        .args(["--cors-origin", "https://tools.example.com/app"])
        .output()
        .expect("serve");
    assert!(!refused.status.success());
    assert!(
        String::from_utf8_lossy(&refused.stderr).contains("is not an origin"),
        "{}",
        String::from_utf8_lossy(&refused.stderr)
    );
}
