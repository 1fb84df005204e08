//! One conformance story for the store, run on SQLite and on PostgreSQL.

use std::sync::Arc;

use sortie_protocol::api::Role;
use sortie_protocol::limits::{PROMPT_MAX_BYTES, SESSION_PROMPTS_MAX_BYTES, TURN_QUEUE_MAX};
use sortie_protocol::phase::TurnMode;
use sortie_protocol::{FailureCode, SessionId, SessionPhase, TurnStatus};
use sortie_store::testing::{TestBackend, TestDatabase};
use sortie_store::*;

struct Fixture {
    store: Arc<SqlStore>,
    workspace: WorkspaceRow,
    _database: TestDatabase,
    _dir: tempfile::TempDir,
}

async fn fixture(backend: TestBackend) -> Fixture {
    let dir = tempfile::tempdir().expect("temp dir");
    let database = TestDatabase::new(backend, dir.path()).await.expect("test database");
    let store = Arc::new(SqlStore::connect(&database.url).await.expect("connect"));
    let workspace = store
        .create_workspace(
            "default",
            RepoAccess {
                any_local_path: true,
                allowed_roots: vec![],
            },
        )
        .await
        .expect("workspace");
    Fixture {
        store,
        workspace,
        _database: database,
        _dir: dir,
    }
}

fn new_session(workspace_id: &str, repo: &str, task: &str) -> NewSession {
    NewSession {
        id: SessionId::generate(),
        workspace_id: workspace_id.to_owned(),
        repo: repo.to_owned(),
        base: Some("main".into()),
        agent: "scripted".into(),
        model: None,
        title: "a title".into(),
        egress_allow: vec!["github.com".into()],
        setup: None,
        task: task.to_owned(),
        budget: Default::default(),
    }
}

fn queue(prompt: &str) -> NewTurn {
    NewTurn {
        prompt: prompt.to_owned(),
        mode: TurnMode::Queue,
    }
}

/// Generates one test per backend for each story.
macro_rules! on_both_databases {
    ($($name:ident),* $(,)?) => {
        mod sqlite {
            $(#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $name() { super::$name(sortie_store::testing::TestBackend::Sqlite).await; })*
        }
        mod postgres {
            $(#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $name() {
                if sortie_store::testing::postgres_available(stringify!($name)).await {
                    super::$name(sortie_store::testing::TestBackend::Postgres).await;
                }
            })*
        }
    };
}

on_both_databases!(
    workspaces_and_tokens,
    create_writes_session_and_first_turn,
    sessions_are_invisible_to_other_workspaces,
    list_is_newest_first_with_filters_and_pages,
    steer_queues_turns_until_the_queue_is_full,
    steer_refuses_prompts_past_the_session_budget,
    concurrent_steers_get_distinct_numbers_and_respect_the_queue,
    cancel_racing_steers_leaves_a_consistent_ledger,
    worker_ledger_claims_stops_and_finishes_turns,
    resume_and_archive_follow_the_phase_rules,
    parts_are_stored_once_in_order,
    parts_are_read_one_turn_at_a_time,
    a_batch_larger_than_one_statement_is_stored_once_in_order,
    transcript_sizes_count_parts_and_bytes,
    usage_is_summed_by_session_and_day,
    budgets_are_raised_paused_and_quotas_counted,
    retention_prunes_only_what_ended_before_the_cutoff,
    ticket_nonces_are_claimed_once,
    instance_secrets_are_stable,
    a_running_turn_is_routed_to_its_workers_feed,
    reconnecting_keeps_everything,
    egress_allowlists_are_amended_until_cancel,
    worker_finds_work_settles_sessions_and_counts_sandboxes,
    model_keys_are_sealed_per_workspace_and_api,
    forge_connections_are_sealed_per_workspace_and_host,
    a_session_keeps_its_first_pull_request,
    forge_deliveries_are_recorded_once_and_claimed_once,
    every_phase_and_status_change_is_an_event_in_commit_order,
    concurrent_writers_number_events_in_commit_order,
    webhook_deliveries_are_enqueued_and_claimed_once,
    a_turn_ends_with_its_session_in_one_call,
    another_processs_commits_wake_this_ones_readers,
);

/// Two stores on one database are two processes (a split api and worker): on PostgreSQL one's commits
/// wake the other's readers; on SQLite nothing claims to.
async fn another_processs_commits_wake_this_ones_readers(backend: TestBackend) {
    let f = fixture(backend).await;
    let other = SqlStore::connect(&f._database.url).await.expect("a second store");
    if backend == TestBackend::Sqlite {
        assert!(!other.hears_other_processes() && !f.store.hears_other_processes());
        return;
    }
    assert!(other.hears_other_processes());
    let mut signal = other.event_signal();
    // The second store's LISTEN takes effect a moment after connect: commit until one is heard.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    loop {
        signal.borrow_and_update();
        f.store
            .create_session(new_session(&f.workspace.id, "/r", "t"))
            .await
            .expect("create");
        let heard = tokio::time::timeout(std::time::Duration::from_secs(2), signal.changed()).await;
        if matches!(heard, Ok(Ok(()))) {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the other store never heard a commit"
        );
    }
    // Once listening, every commit is heard, and a session created elsewhere is readable here.
    for _ in 0..3 {
        signal.borrow_and_update();
        let session = f
            .store
            .create_session(new_session(&f.workspace.id, "/r", "t"))
            .await
            .expect("create");
        tokio::time::timeout(std::time::Duration::from_secs(10), signal.changed())
            .await
            .expect("heard within the deadline")
            .expect("the store lives");
        assert_eq!(
            other.session(&f.workspace.id, &session.id).await.expect("read").id,
            session.id
        );
    }
    other.close().await;
}

async fn forge_deliveries_are_recorded_once_and_claimed_once(backend: TestBackend) {
    use sortie_protocol::api::ForgeKind;
    use sortie_store::NewForgeDelivery;
    let f = fixture(backend).await;
    let ws = f.workspace.id.clone();
    // The App's connections with a webhook secret are found by App, or all of them.
    f.store
        .put_forge_connection(
            &ws,
            "github.com",
            ForgeKind::Github,
            "https://api.github.com",
            "c",
            "n",
            Some("42"),
        )
        .await
        .expect("put");
    assert!(
        f.store.app_connections("42").await.expect("read").is_empty(),
        "no secret yet"
    );
    assert!(
        f.store
            .set_forge_triggers(&ws, "github.com", Some(("sc", "sn")), Some("{\"repositories\":[]}"))
            .await
            .expect("set")
    );
    assert!(
        !f.store
            .set_forge_triggers(&ws, "elsewhere", None, None)
            .await
            .expect("none")
    );
    let found = f.store.app_connections("42").await.expect("read");
    assert_eq!(found.len(), 1);
    assert_eq!(found[0].webhook_secret, Some(("sc".to_owned(), "sn".to_owned())));
    assert_eq!(found[0].triggers.as_deref(), Some("{\"repositories\":[]}"));
    assert!(f.store.app_connections("43").await.expect("other").is_empty());

    // One connection of the instance takes an App's webhook deliveries.
    let other = f
        .store
        .create_workspace("other", RepoAccess::default())
        .await
        .expect("other workspace");
    f.store
        .put_forge_connection(
            &other.id,
            "github.com",
            ForgeKind::Github,
            "https://api.github.com",
            "c",
            "n",
            Some("42"),
        )
        .await
        .expect("put");
    let taken = f
        .store
        .set_forge_triggers(&other.id, "github.com", Some(("x", "y")), None)
        .await;
    assert!(matches!(taken, Err(sortie_store::StoreError::Conflict(_))), "{taken:?}");
    assert!(
        f.store
            .set_forge_triggers(&other.id, "github.com", None, None)
            .await
            .expect("no secret: fine")
    );

    let delivery = |id: &str, key: &str| NewForgeDelivery {
        delivery_id: id.to_owned(),
        request_key: key.to_owned(),
        workspace_id: ws.clone(),
        host: "github.com".into(),
        event: "issue_comment".into(),
        payload: "{}".into(),
    };
    assert!(
        f.store
            .record_forge_delivery(&delivery("d-1", "comment:1"))
            .await
            .expect("first")
    );
    assert!(
        !f.store
            .record_forge_delivery(&delivery("d-1", "comment:1"))
            .await
            .expect("redelivery")
    );
    assert!(
        !f.store
            .record_forge_delivery(&delivery("d-9", "comment:1"))
            .await
            .expect("same body, new id")
    );
    assert!(
        !f.store
            .record_forge_delivery(&delivery("d-1", "comment:9"))
            .await
            .expect("same id")
    );
    assert!(
        f.store
            .record_forge_delivery(&delivery("d-2", "comment:2"))
            .await
            .expect("second")
    );
    assert_eq!(f.store.pending_forge_deliveries(&ws).await.expect("count"), 2);
    assert_eq!(f.store.pending_forge_deliveries(&other.id).await.expect("count"), 0);
    // Two workers racing never claim one delivery both (on PostgreSQL the loser of a race may come away
    // empty-handed and claims at its next poll).
    let (a, b) = tokio::join!(
        f.store.claim_forge_delivery("w1", 60_000),
        f.store.claim_forge_delivery("w2", 60_000)
    );
    let mut claimed: Vec<String> = [a, b]
        .into_iter()
        .filter_map(|c| c.expect("claim").map(|row| row.delivery_id))
        .collect();
    while let Some(row) = f.store.claim_forge_delivery("w1", 60_000).await.expect("claim") {
        claimed.push(row.delivery_id);
    }
    claimed.sort();
    assert_eq!(claimed, vec!["d-1".to_owned(), "d-2".to_owned()]);
    assert_eq!(
        f.store.claim_forge_delivery("w3", 60_000).await.expect("none left"),
        None
    );
    assert_eq!(f.store.forge_delivery_outcome("d-1").await.expect("read"), None);
    f.store.finish_forge_delivery("d-1", "started s").await.expect("finish");
    assert_eq!(f.store.pending_forge_deliveries(&ws).await.expect("count"), 1);
    assert_eq!(
        f.store.forge_delivery_outcome("d-1").await.expect("read").as_deref(),
        Some("started s")
    );
    // A claim whose worker died is taken again after its lease; a finished one never.
    let again = f.store.claim_forge_delivery("w3", 0).await.expect("lease over");
    assert_eq!(again.map(|row| row.delivery_id).as_deref(), Some("d-2"));

    // Where a session was asked for, and the session of a pull request.
    let session = f
        .store
        .create_session(new_session(&ws, "https://github.com/o/r.git", "t"))
        .await
        .expect("create");
    assert_eq!(f.store.session_origin(&session.id).await.expect("none"), None);
    f.store
        .set_session_origin(&session.id, "{\"n\":1}")
        .await
        .expect("origin");
    f.store
        .set_session_origin(&session.id, "{\"n\":2}")
        .await
        .expect("again");
    assert_eq!(
        f.store.session_origin(&session.id).await.expect("read").as_deref(),
        Some("{\"n\":2}")
    );
    f.store
        .set_session_pr(&session.id, "https://github.com/o/r/pull/3", 3)
        .await
        .expect("pr");
    assert_eq!(
        f.store
            .session_by_pr_url(&ws, "https://github.com/o/r/pull/3")
            .await
            .expect("by pr"),
        Some(session.id.clone())
    );
    assert_eq!(
        f.store
            .session_by_pr_url("another", "https://github.com/o/r/pull/3")
            .await
            .expect("other ws"),
        None
    );
}

async fn a_session_keeps_its_first_pull_request(backend: TestBackend) {
    let f = fixture(backend).await;
    let session = f
        .store
        .create_session(new_session(&f.workspace.id, "https://forge/o/r.git", "t"))
        .await
        .expect("create");
    assert_eq!(f.store.session_by_id(&session.id).await.expect("read").pr, None);
    assert!(
        f.store
            .set_session_pr(&session.id, "https://forge/o/r/pull/7", 7)
            .await
            .expect("set")
    );
    assert!(
        !f.store
            .set_session_pr(&session.id, "https://forge/o/r/pull/8", 8)
            .await
            .expect("again")
    );
    assert_eq!(
        f.store.session_by_id(&session.id).await.expect("read").pr,
        Some(("https://forge/o/r/pull/7".to_owned(), 7))
    );
}

async fn forge_connections_are_sealed_per_workspace_and_host(backend: TestBackend) {
    use sortie_protocol::api::ForgeKind;
    let f = fixture(backend).await;
    let ws = f.workspace.id.clone();
    let other = f
        .store
        .create_workspace("other", RepoAccess::default())
        .await
        .expect("other workspace");
    let ring = KeyRing::generate().expect("ring");
    assert_eq!(f.store.forge_connection(&ws, "github.com").await.expect("read"), None);
    assert!(
        workspace_forge_token(f.store.as_ref(), &ring, &ws, "github.com")
            .await
            .expect("none")
            .is_none()
    );

    let sealed = ring.seal_forge_token(&ws, "github.com", b"ghp_first").expect("seal");
    let stored = f
        .store
        .put_forge_connection(
            &ws,
            "github.com",
            ForgeKind::Github,
            "https://api.github.com",
            &sealed.ciphertext,
            &sealed.nonce,
            None,
        )
        .await
        .expect("put");
    assert_eq!((stored.host.as_str(), stored.kind), ("github.com", ForgeKind::Github));
    let replacement = ring.seal_forge_token(&ws, "github.com", b"ghp_second").expect("seal");
    f.store
        .put_forge_connection(
            &ws,
            "github.com",
            ForgeKind::Git,
            "",
            &replacement.ciphertext,
            &replacement.nonce,
            None,
        )
        .await
        .expect("replace");
    let local = ring.seal_forge_token(&ws, "git.local:8443", b"tok").expect("seal");
    f.store
        .put_forge_connection(
            &ws,
            "git.local:8443",
            ForgeKind::Git,
            "",
            &local.ciphertext,
            &local.nonce,
            None,
        )
        .await
        .expect("second host");
    let (row, token) = workspace_forge_token(f.store.as_ref(), &ring, &ws, "github.com")
        .await
        .expect("open")
        .expect("some");
    assert_eq!(
        (token.expose(), row.kind, row.api_base.as_str(), row.app_id.as_deref()),
        (&b"ghp_second"[..], ForgeKind::Git, "", None)
    );
    // A GitHub App's connection keeps its App ID beside the sealed key.
    let app_key = ring
        .seal_forge_token(&ws, "ghe.example.com", b"-----BEGIN RSA PRIVATE KEY-----")
        .expect("seal");
    let app = f
        .store
        .put_forge_connection(
            &ws,
            "ghe.example.com",
            ForgeKind::Github,
            "https://ghe.example.com/api/v3",
            &app_key.ciphertext,
            &app_key.nonce,
            Some("424242"),
        )
        .await
        .expect("an app");
    assert_eq!(app.app_id.as_deref(), Some("424242"));
    assert!(
        f.store
            .delete_forge_connection(&ws, "ghe.example.com")
            .await
            .expect("delete")
    );
    let hosts: Vec<String> = f
        .store
        .forge_connections(&ws)
        .await
        .expect("list")
        .into_iter()
        .map(|c| c.host)
        .collect();
    assert_eq!(hosts, ["git.local:8443", "github.com"]);
    assert_eq!(f.store.forge_connections(&other.id).await.expect("other"), vec![]);

    // A row copied to another workspace does not open there.
    f.store
        .put_forge_connection(
            &other.id,
            "github.com",
            ForgeKind::Github,
            "",
            &replacement.ciphertext,
            &replacement.nonce,
            None,
        )
        .await
        .expect("copied");
    assert!(matches!(
        workspace_forge_token(f.store.as_ref(), &ring, &other.id, "github.com").await,
        Err(KeyError::Open)
    ));
    assert!(
        f.store
            .delete_forge_connection(&ws, "github.com")
            .await
            .expect("delete")
    );
    assert!(!f.store.delete_forge_connection(&ws, "github.com").await.expect("again"));
    assert_eq!(f.store.forge_connection(&ws, "github.com").await.expect("read"), None);
}

async fn model_keys_are_sealed_per_workspace_and_api(backend: TestBackend) {
    use sortie_protocol::api::ModelApi;
    let f = fixture(backend).await;
    let ws = f.workspace.id.clone();
    let other = f
        .store
        .create_workspace("other", RepoAccess::default())
        .await
        .expect("other workspace");
    let ring = KeyRing::generate().expect("ring");
    let plaintext = b"sk-ant-api03-conformance-key-0123456789";

    assert_eq!(f.store.model_key(&ws, ModelApi::Anthropic).await.expect("read"), None);
    assert_eq!(f.store.model_keys(&ws).await.expect("list"), vec![]);
    assert!(
        workspace_model_key(f.store.as_ref(), &ring, &ws, ModelApi::Anthropic)
            .await
            .expect("none")
            .is_none()
    );

    let sealed = ring.seal(&ws, ModelApi::Anthropic, plaintext).expect("seal");
    let stored = f
        .store
        .put_model_key(
            &ws,
            ModelApi::Anthropic,
            &sealed.ciphertext,
            &sealed.nonce,
            Some("team"),
        )
        .await
        .expect("put");
    assert_eq!(
        (stored.workspace_id.as_str(), stored.api, stored.label.as_deref()),
        (ws.as_str(), ModelApi::Anthropic, Some("team"))
    );
    assert_eq!(
        (stored.key_ciphertext.as_str(), stored.key_nonce.as_str()),
        (sealed.ciphertext.as_str(), sealed.nonce.as_str())
    );
    assert!(stored.created_at > 0);
    let opened = workspace_model_key(f.store.as_ref(), &ring, &ws, ModelApi::Anthropic)
        .await
        .expect("open")
        .expect("a key");
    assert_eq!(opened.expose(), plaintext);

    // Replacing keeps one row per (workspace, api); another api is another row.
    let replacement = ring.seal(&ws, ModelApi::Anthropic, b"sk-ant-second").expect("seal");
    let replaced = f
        .store
        .put_model_key(
            &ws,
            ModelApi::Anthropic,
            &replacement.ciphertext,
            &replacement.nonce,
            None,
        )
        .await
        .expect("replace");
    assert_eq!(replaced.label, None);
    assert!(replaced.created_at >= stored.created_at);
    let openai = ring.seal(&ws, ModelApi::Openai, b"sk-proj-openai").expect("seal");
    f.store
        .put_model_key(&ws, ModelApi::Openai, &openai.ciphertext, &openai.nonce, None)
        .await
        .expect("put openai");
    let listed = f.store.model_keys(&ws).await.expect("list");
    assert_eq!(
        listed.iter().map(|row| row.api).collect::<Vec<_>>(),
        vec![ModelApi::Anthropic, ModelApi::Openai]
    );
    assert_eq!(listed[0], replaced);
    assert_eq!(
        workspace_model_key(f.store.as_ref(), &ring, &ws, ModelApi::Anthropic)
            .await
            .expect("open")
            .expect("a key")
            .expose(),
        b"sk-ant-second"
    );

    // Another workspace sees none of it, and a row moved there does not open.
    assert_eq!(f.store.model_keys(&other.id).await.expect("list"), vec![]);
    assert_eq!(
        f.store.model_key(&other.id, ModelApi::Anthropic).await.expect("read"),
        None
    );
    assert!(
        !f.store
            .delete_model_key(&other.id, ModelApi::Anthropic)
            .await
            .expect("delete")
    );
    f.store
        .put_model_key(
            &other.id,
            ModelApi::Anthropic,
            &replacement.ciphertext,
            &replacement.nonce,
            None,
        )
        .await
        .expect("put copied row");
    assert!(matches!(
        workspace_model_key(f.store.as_ref(), &ring, &other.id, ModelApi::Anthropic).await,
        Err(KeyError::Open)
    ));

    assert!(
        f.store
            .delete_model_key(&ws, ModelApi::Anthropic)
            .await
            .expect("delete")
    );
    assert!(!f.store.delete_model_key(&ws, ModelApi::Anthropic).await.expect("again"));
    assert_eq!(f.store.model_key(&ws, ModelApi::Anthropic).await.expect("read"), None);
    assert_eq!(
        f.store
            .model_keys(&ws)
            .await
            .expect("list")
            .iter()
            .map(|row| row.api)
            .collect::<Vec<_>>(),
        vec![ModelApi::Openai]
    );
    assert_eq!(f.store.model_keys(&other.id).await.expect("list").len(), 1);
}

async fn worker_finds_work_settles_sessions_and_counts_sandboxes(backend: TestBackend) {
    let f = fixture(backend).await;
    let ws = f.workspace.id.clone();
    let first = f
        .store
        .create_session(new_session(&ws, "/srv/a.git", "one"))
        .await
        .expect("create");
    let second = f
        .store
        .create_session(new_session(&ws, "/srv/b.git", "two"))
        .await
        .expect("create");
    let waiting: Vec<SessionId> = f
        .store
        .claimable_sessions(10)
        .await
        .expect("claimable")
        .into_iter()
        .map(|s| s.id)
        .collect();
    assert_eq!(waiting, vec![first.id.clone(), second.id.clone()], "oldest first");

    f.store
        .set_queued_reason(&second.id, Some("SANDBOX_CAPACITY_LIMIT"))
        .await
        .expect("reason");
    assert_eq!(
        f.store
            .session_by_id(&second.id)
            .await
            .expect("session")
            .queued_reason
            .as_deref(),
        Some("SANDBOX_CAPACITY_LIMIT")
    );

    let turn = f
        .store
        .claim_turn(&first.id, false, "w")
        .await
        .expect("claim")
        .expect("claimed");
    assert!(
        f.store
            .claimable_sessions(10)
            .await
            .expect("claimable")
            .iter()
            .all(|s| s.id != first.id)
    );
    assert_eq!(
        f.store
            .sessions_in_phases(&[SessionPhase::Provisioning])
            .await
            .expect("phases")
            .len(),
        1
    );
    assert!(
        f.store
            .transition_session(&first.id, SessionPhase::Provisioning, SessionPhase::Running)
            .await
            .expect("cas")
    );
    // A steer while the turn runs: the session keeps its phase, and settling queues it for the next turn.
    f.store.steer(&ws, &first.id, queue("next")).await.expect("steer");
    assert!(
        f.store
            .transition_session(&first.id, SessionPhase::Running, SessionPhase::Delivering)
            .await
            .expect("cas")
    );
    let timings = std::collections::BTreeMap::from([("clone".to_owned(), 12_u64), ("setup".to_owned(), 3)]);
    f.store
        .set_turn_details(&first.id, turn.n, Some("transcript"), Some(&timings))
        .await
        .expect("details");
    let stored = f.store.turn(&first.id, turn.n).await.expect("turn");
    assert_eq!(stored.priming.as_deref(), Some("transcript"));
    assert_eq!(stored.timings, Some(timings));
    f.store
        .finish_turn(
            &first.id,
            turn.n,
            TurnOutcome {
                status: TurnStatus::Completed,
                head_sha: Some("abc".into()),
                failure: None,
            },
        )
        .await
        .expect("finish");
    assert_eq!(
        f.store
            .settle_session(&first.id, SessionPhase::Delivering, false)
            .await
            .expect("settle"),
        Some(SessionPhase::Queued)
    );
    assert_eq!(
        f.store
            .settle_session(&first.id, SessionPhase::Delivering, false)
            .await
            .expect("settle"),
        None,
        "a CAS"
    );
    let turn = f
        .store
        .claim_turn(&first.id, true, "w")
        .await
        .expect("claim")
        .expect("claimed");
    assert_eq!(turn.n, 2);
    assert!(
        f.store
            .transition_session(&first.id, SessionPhase::Running, SessionPhase::Delivering)
            .await
            .expect("cas")
    );
    f.store
        .finish_turn(
            &first.id,
            2,
            TurnOutcome {
                status: TurnStatus::Failed,
                head_sha: None,
                failure: Some((FailureCode::AgentError, "boom".into())),
            },
        )
        .await
        .expect("finish");
    assert_eq!(
        f.store
            .settle_session(&first.id, SessionPhase::Delivering, true)
            .await
            .expect("settle"),
        Some(SessionPhase::Failed)
    );
    assert!(matches!(
        f.store.settle_session(&first.id, SessionPhase::Running, true).await,
        Err(StoreError::IllegalTransition { .. })
    ));

    // A failed session stays failed when its sandbox goes; only a finished one hibernates.
    assert!(matches!(
        f.store
            .transition_session(&first.id, SessionPhase::Failed, SessionPhase::Hibernated)
            .await,
        Err(StoreError::IllegalTransition { .. })
    ));
    // A resume without a prompt is claimed on its own.
    for (from, to) in [
        (SessionPhase::Failed, SessionPhase::Queued),
        (SessionPhase::Queued, SessionPhase::Provisioning),
        (SessionPhase::Provisioning, SessionPhase::Idle),
        (SessionPhase::Idle, SessionPhase::Hibernated),
    ] {
        assert!(
            f.store.transition_session(&first.id, from, to).await.expect("cas"),
            "{from} -> {to}"
        );
    }
    f.store.resume(&ws, &first.id).await.expect("resume");
    assert!(
        f.store
            .claimable_sessions(10)
            .await
            .expect("claimable")
            .iter()
            .any(|s| s.id == first.id)
    );
    assert!(f.store.claim_resume(&first.id).await.expect("claim resume"));
    assert!(!f.store.claim_resume(&first.id).await.expect("claim resume"), "once");
    assert_eq!(
        f.store
            .settle_session(&first.id, SessionPhase::Provisioning, false)
            .await
            .expect("settle"),
        Some(SessionPhase::Idle)
    );

    f.store.put_sandbox(&first.id, "local", "h1", "w").await.expect("put");
    f.store
        .put_sandbox(&first.id, "local", "h1b", "w")
        .await
        .expect("put again");
    f.store.put_sandbox(&second.id, "local", "h2", "w").await.expect("put");
    let live = f.store.sandboxes().await.expect("sandboxes");
    assert_eq!(live.len(), 2);
    assert!(live.iter().all(|row| row.workspace_id == ws));
    assert!(live.iter().any(|row| row.handle == "h1b"));
    f.store.delete_sandbox(&first.id).await.expect("delete");
    assert_eq!(f.store.sandboxes().await.expect("sandboxes").len(), 1);
}

async fn egress_allowlists_are_amended_until_cancel(backend: TestBackend) {
    let f = fixture(backend).await;
    let other = f
        .store
        .create_workspace("other", RepoAccess::default())
        .await
        .expect("other");
    let session = f
        .store
        .create_session(new_session(&f.workspace.id, "/r", "t"))
        .await
        .expect("create");
    let amended = vec!["github.com".to_owned(), "example.org".to_owned()];
    let row = f
        .store
        .set_egress_allow(&f.workspace.id, &session.id, &amended)
        .await
        .expect("amend");
    assert_eq!(row.egress_allow, amended);
    assert_eq!(
        f.store.set_egress_allow(&other.id, &session.id, &[]).await,
        Err(StoreError::NotFound)
    );
    f.store.cancel(&f.workspace.id, &session.id).await.expect("cancel");
    assert_eq!(
        f.store.set_egress_allow(&f.workspace.id, &session.id, &[]).await,
        Err(StoreError::NotSteerable("canceled"))
    );
    assert_eq!(
        f.store
            .session(&f.workspace.id, &session.id)
            .await
            .expect("s")
            .egress_allow,
        amended
    );
}

async fn workspaces_and_tokens(backend: TestBackend) {
    let f = fixture(backend).await;
    let again = f.store.create_workspace("default", RepoAccess::default()).await;
    assert!(matches!(again, Err(StoreError::Conflict(_))), "{again:?}");
    let team = f
        .store
        .create_workspace(
            "team",
            RepoAccess {
                any_local_path: false,
                allowed_roots: vec!["/srv/git".into()],
            },
        )
        .await
        .expect("team");
    assert_eq!(f.store.workspace_by_name("team").await.expect("by name"), team);
    assert_eq!(team.repo_access.allowed_roots, vec!["/srv/git".to_owned()]);
    assert!(matches!(
        f.store.workspace_by_name("nope").await,
        Err(StoreError::NotFound)
    ));

    let token_id = f
        .store
        .create_token(&team.id, Role::Viewer, "hash-1", Some("ci"), None)
        .await
        .expect("token");
    let principal = f.store.principal_by_token_hash("hash-1").await.expect("principal");
    assert_eq!(
        principal,
        Principal {
            token_id,
            workspace_id: team.id.clone(),
            workspace_name: "team".into(),
            role: Role::Viewer
        }
    );
    assert!(matches!(
        f.store.principal_by_token_hash("hash-2").await,
        Err(StoreError::NotFound)
    ));
    let duplicate = f.store.create_token(&team.id, Role::Admin, "hash-1", None, None).await;
    assert!(matches!(duplicate, Err(StoreError::Conflict(_))), "{duplicate:?}");
    f.store.ping().await.expect("ping");

    // An expired token signs nothing in; one that expires later does; uses and expiry are listed.
    let expired = f
        .store
        .create_token(&team.id, Role::Admin, "hash-old", None, Some(now_ms() - 1))
        .await
        .expect("token");
    assert!(matches!(
        f.store.principal_by_token_hash("hash-old").await,
        Err(StoreError::NotFound)
    ));
    let later = now_ms() + 60_000;
    f.store
        .create_token(&team.id, Role::Admin, "hash-new", None, Some(later))
        .await
        .expect("token");
    f.store
        .principal_by_token_hash("hash-new")
        .await
        .expect("not expired yet");
    f.store.touch_token(&expired, 1_234).await.expect("touch");
    let listed = f.store.tokens(Some(&team.id)).await.expect("tokens");
    let old = listed.iter().find(|t| t.id == expired).expect("listed");
    assert_eq!((old.last_used_at, old.workspace_name.as_str()), (Some(1_234), "team"));
    assert!(listed.iter().any(|t| t.expires_at == Some(later)));
    f.store
        .create_token(&f.workspace.id, Role::Viewer, "hash-elsewhere", None, None)
        .await
        .expect("token");
    let everywhere = f.store.tokens(None).await.expect("tokens");
    assert!(everywhere.len() > listed.len(), "the default workspace's too");

    // The audit log: newest first, a page at a time, one workspace's only.
    for n in 0..3 {
        let entry = AuditEntry {
            workspace_id: team.id.clone(),
            actor: "cli".into(),
            action: "token.create".into(),
            target: format!("tok_{n}"),
        };
        f.store.record_audit(&entry).await.expect("audit");
    }
    let page = f.store.audit_log(&team.id, None, 2).await.expect("audit");
    let targets: Vec<&str> = page.iter().map(|e| e.target.as_str()).collect();
    assert_eq!(targets, ["tok_2", "tok_1"]);
    let rest = f.store.audit_log(&team.id, Some(page[1].id), 2).await.expect("audit");
    assert_eq!(rest.iter().map(|e| e.target.as_str()).collect::<Vec<_>>(), ["tok_0"]);
    assert!(
        f.store
            .audit_log(&f.workspace.id, None, 10)
            .await
            .expect("audit")
            .is_empty()
    );
}

async fn create_writes_session_and_first_turn(backend: TestBackend) {
    let f = fixture(backend).await;
    let new = new_session(&f.workspace.id, "/srv/repo", "fix the bug");
    let session = f.store.create_session(new.clone()).await.expect("create");
    assert_eq!(session.id, new.id);
    assert_eq!(session.workspace_name, "default");
    assert_eq!(session.phase, SessionPhase::Queued);
    assert_eq!((session.n_turns, session.n_waiting, session.current_turn), (1, 1, None));
    assert_eq!(session.prompts_bytes, "fix the bug".len() as u64);
    assert_eq!(session.egress_allow, vec!["github.com".to_owned()]);
    assert_eq!(session.base.as_deref(), Some("main"));
    assert!(!session.archived && session.failure.is_none() && session.pr.is_none());

    let turns = f.store.turns(&f.workspace.id, &session.id).await.expect("turns");
    assert_eq!(turns.len(), 1);
    assert_eq!(
        (turns[0].n, turns[0].status, turns[0].mode),
        (1, TurnStatus::Accepted, TurnMode::Queue)
    );
    assert_eq!(turns[0].prompt, "fix the bug");

    let duplicate = f.store.create_session(new).await;
    assert!(matches!(duplicate, Err(StoreError::Conflict(_))), "{duplicate:?}");
}

async fn sessions_are_invisible_to_other_workspaces(backend: TestBackend) {
    let f = fixture(backend).await;
    let other = f
        .store
        .create_workspace("other", RepoAccess::default())
        .await
        .expect("other");
    let session = f
        .store
        .create_session(new_session(&f.workspace.id, "/r", "t"))
        .await
        .expect("create");
    let id = &session.id;
    assert!(matches!(
        f.store.session(&other.id, id).await,
        Err(StoreError::NotFound)
    ));
    assert!(matches!(f.store.turns(&other.id, id).await, Err(StoreError::NotFound)));
    assert!(matches!(
        f.store.steer(&other.id, id, queue("x")).await,
        Err(StoreError::NotFound)
    ));
    assert!(matches!(
        f.store.request_stop(&other.id, id).await,
        Err(StoreError::NotFound)
    ));
    assert!(matches!(f.store.cancel(&other.id, id).await, Err(StoreError::NotFound)));
    assert!(matches!(f.store.resume(&other.id, id).await, Err(StoreError::NotFound)));
    assert!(matches!(
        f.store.set_archived(&other.id, id, true).await,
        Err(StoreError::NotFound)
    ));
    assert!(
        f.store
            .list_sessions(&other.id, &SessionFilter::default())
            .await
            .expect("list")
            .is_empty()
    );
    assert!(
        f.store
            .usage(&other.id, Some(id))
            .await
            .expect("usage")
            .tokens
            .is_empty()
    );
    // Nothing changed for the owner.
    let unchanged = f.store.session(&f.workspace.id, id).await.expect("session");
    assert_eq!(
        (unchanged.phase, unchanged.n_turns, unchanged.archived),
        (SessionPhase::Queued, 1, false)
    );
}

async fn list_is_newest_first_with_filters_and_pages(backend: TestBackend) {
    let f = fixture(backend).await;
    let mut ids = Vec::new();
    for i in 0..5 {
        let repo = if i % 2 == 0 { "/even" } else { "/odd" };
        let mut new = new_session(&f.workspace.id, repo, "t");
        new.id = SessionId::from_ulid(ulid::Ulid::from_parts(1_700_000_000_000 + i, 7));
        ids.push(f.store.create_session(new).await.expect("create").id);
    }
    let all = f
        .store
        .list_sessions(&f.workspace.id, &SessionFilter::default())
        .await
        .expect("list");
    let listed: Vec<_> = all.iter().map(|s| s.id.clone()).collect();
    let mut newest_first = ids.clone();
    newest_first.reverse();
    assert_eq!(listed, newest_first);

    let page = SessionFilter {
        limit: 2,
        ..SessionFilter::default()
    };
    let first = f.store.list_sessions(&f.workspace.id, &page).await.expect("page 1");
    assert_eq!(first.iter().map(|s| &s.id).collect::<Vec<_>>(), vec![&ids[4], &ids[3]]);
    let second = f
        .store
        .list_sessions(
            &f.workspace.id,
            &SessionFilter {
                before: Some(ids[3].clone()),
                ..page.clone()
            },
        )
        .await
        .expect("page 2");
    assert_eq!(second.iter().map(|s| &s.id).collect::<Vec<_>>(), vec![&ids[2], &ids[1]]);

    let odd = f
        .store
        .list_sessions(
            &f.workspace.id,
            &SessionFilter {
                repo: Some("/odd".into()),
                ..SessionFilter::default()
            },
        )
        .await
        .expect("odd");
    assert_eq!(odd.len(), 2);
    f.store.cancel(&f.workspace.id, &ids[0]).await.expect("cancel");
    let canceled = f
        .store
        .list_sessions(
            &f.workspace.id,
            &SessionFilter {
                phase: Some(SessionPhase::Canceled),
                ..SessionFilter::default()
            },
        )
        .await
        .expect("canceled");
    assert_eq!(canceled.iter().map(|s| &s.id).collect::<Vec<_>>(), vec![&ids[0]]);
    f.store
        .set_archived(&f.workspace.id, &ids[0], true)
        .await
        .expect("archive");
    let unarchived = f
        .store
        .list_sessions(&f.workspace.id, &SessionFilter::default())
        .await
        .expect("list");
    assert_eq!(unarchived.len(), 4);
    let archived = f
        .store
        .list_sessions(
            &f.workspace.id,
            &SessionFilter {
                archived: true,
                ..SessionFilter::default()
            },
        )
        .await
        .expect("archived");
    assert_eq!(archived.iter().map(|s| &s.id).collect::<Vec<_>>(), vec![&ids[0]]);
}

async fn steer_queues_turns_until_the_queue_is_full(backend: TestBackend) {
    let f = fixture(backend).await;
    let session = f
        .store
        .create_session(new_session(&f.workspace.id, "/r", "t"))
        .await
        .expect("create");
    for n in 2..=TURN_QUEUE_MAX {
        let turn = f
            .store
            .steer(&f.workspace.id, &session.id, queue(&format!("steer {n}")))
            .await
            .expect("steer");
        assert_eq!((turn.n, turn.status), (n, TurnStatus::Accepted));
    }
    let full = f.store.steer(&f.workspace.id, &session.id, queue("one too many")).await;
    assert_eq!(full, Err(StoreError::TurnQueueFull(TURN_QUEUE_MAX)));
    let after = f.store.session(&f.workspace.id, &session.id).await.expect("session");
    assert_eq!((after.n_turns, after.n_waiting), (TURN_QUEUE_MAX, TURN_QUEUE_MAX));
    assert_eq!(
        f.store.turns(&f.workspace.id, &session.id).await.expect("turns").len(),
        TURN_QUEUE_MAX as usize
    );

    f.store.cancel(&f.workspace.id, &session.id).await.expect("cancel");
    assert_eq!(
        f.store.steer(&f.workspace.id, &session.id, queue("late")).await,
        Err(StoreError::NotSteerable("canceled"))
    );
}

async fn steer_refuses_prompts_past_the_session_budget(backend: TestBackend) {
    let f = fixture(backend).await;
    let big = "x".repeat(PROMPT_MAX_BYTES);
    let session = f
        .store
        .create_session(new_session(&f.workspace.id, "/r", &big))
        .await
        .expect("create");
    let mut total = big.len() as u64;
    // Run every turn to completion so the queue never fills; only the byte budget can refuse.
    loop {
        let claimed = f
            .store
            .claim_turn(&session.id, true, "w1")
            .await
            .expect("claim")
            .expect("a turn to claim");
        let done = TurnOutcome {
            status: TurnStatus::Completed,
            head_sha: None,
            failure: None,
        };
        assert!(f.store.finish_turn(&session.id, claimed.n, done).await.expect("finish"));
        assert!(
            f.store
                .transition_session(&session.id, SessionPhase::Running, SessionPhase::Delivering)
                .await
                .expect("deliver")
        );
        assert!(
            f.store
                .transition_session(&session.id, SessionPhase::Delivering, SessionPhase::Idle)
                .await
                .expect("idle")
        );
        match f.store.steer(&f.workspace.id, &session.id, queue(&big)).await {
            Ok(_) => total += big.len() as u64,
            Err(StoreError::PromptsTooLarge { would_be, limit }) => {
                assert_eq!(would_be, total + big.len() as u64);
                assert_eq!(limit, SESSION_PROMPTS_MAX_BYTES);
                assert!(would_be > SESSION_PROMPTS_MAX_BYTES && total <= SESSION_PROMPTS_MAX_BYTES);
                break;
            }
            Err(other) => panic!("unexpected {other:?}"),
        }
    }
    let after = f.store.session(&f.workspace.id, &session.id).await.expect("session");
    assert_eq!(after.prompts_bytes, total);
    assert_eq!(after.phase, SessionPhase::Idle, "a refused steer writes nothing");
    // A smaller prompt that still fits is accepted.
    let room = (SESSION_PROMPTS_MAX_BYTES - total) as usize;
    let fits = f
        .store
        .steer(&f.workspace.id, &session.id, queue(&"y".repeat(room)))
        .await
        .expect("fits exactly");
    assert_eq!(fits.n, after.n_turns + 1);
}

async fn concurrent_steers_get_distinct_numbers_and_respect_the_queue(backend: TestBackend) {
    let f = fixture(backend).await;
    let session = f
        .store
        .create_session(new_session(&f.workspace.id, "/r", "t"))
        .await
        .expect("create");
    let mut tasks = Vec::new();
    for i in 0..50 {
        let store = f.store.clone();
        let (workspace_id, session_id) = (f.workspace.id.clone(), session.id.clone());
        tasks.push(tokio::spawn(async move {
            store
                .steer(&workspace_id, &session_id, queue(&format!("steer {i}")))
                .await
        }));
    }
    let mut numbers = Vec::new();
    let mut full = 0;
    for task in tasks {
        match task.await.expect("join") {
            Ok(turn) => numbers.push(turn.n),
            Err(StoreError::TurnQueueFull(_)) => full += 1,
            Err(other) => panic!("unexpected {other:?}"),
        }
    }
    numbers.sort_unstable();
    let expected: Vec<u32> = (2..=TURN_QUEUE_MAX).collect();
    assert_eq!(numbers, expected, "distinct, gapless numbers up to the queue limit");
    assert_eq!(full, 50 - numbers.len());
    let turns = f.store.turns(&f.workspace.id, &session.id).await.expect("turns");
    assert_eq!(
        turns.iter().map(|t| t.n).collect::<Vec<_>>(),
        (1..=TURN_QUEUE_MAX).collect::<Vec<_>>()
    );
}

async fn cancel_racing_steers_leaves_a_consistent_ledger(backend: TestBackend) {
    let f = fixture(backend).await;
    for _round in 0..3 {
        let session = f
            .store
            .create_session(new_session(&f.workspace.id, "/r", "t"))
            .await
            .expect("create");
        let mut tasks = Vec::new();
        for i in 0..20 {
            let store = f.store.clone();
            let (workspace_id, session_id) = (f.workspace.id.clone(), session.id.clone());
            tasks.push(tokio::spawn(async move {
                if i == 7 {
                    store.cancel(&workspace_id, &session_id).await.map(|_| ())
                } else {
                    store.steer(&workspace_id, &session_id, queue("s")).await.map(|_| ())
                }
            }));
        }
        for task in tasks {
            match task.await.expect("join") {
                Ok(()) | Err(StoreError::TurnQueueFull(_)) | Err(StoreError::NotSteerable("canceled")) => {}
                Err(other) => panic!("unexpected {other:?}"),
            }
        }
        let after = f.store.session(&f.workspace.id, &session.id).await.expect("session");
        let turns = f.store.turns(&f.workspace.id, &session.id).await.expect("turns");
        assert_eq!(after.phase, SessionPhase::Canceled);
        assert_eq!(after.n_waiting, 0);
        assert_eq!(after.n_turns as usize, turns.len());
        assert_eq!(
            turns.iter().map(|t| t.n).collect::<Vec<_>>(),
            (1..=after.n_turns).collect::<Vec<_>>()
        );
        assert!(turns.iter().all(|t| t.status == TurnStatus::Canceled), "{turns:?}");
    }
}

async fn worker_ledger_claims_stops_and_finishes_turns(backend: TestBackend) {
    let f = fixture(backend).await;
    let ws = &f.workspace.id;
    let session = f
        .store
        .create_session(new_session(ws, "/r", "t"))
        .await
        .expect("create");
    assert_eq!(
        f.store.request_stop(ws, &session.id).await,
        Err(StoreError::NoTurnRunning)
    );

    // Two workers race for the same turn: exactly one wins.
    let (a, b) = tokio::join!(
        f.store.claim_turn(&session.id, false, "w1"),
        f.store.claim_turn(&session.id, false, "w2")
    );
    let winners = [a.expect("a"), b.expect("b")].into_iter().flatten().collect::<Vec<_>>();
    assert_eq!(winners.len(), 1);
    assert_eq!((winners[0].n, winners[0].status), (1, TurnStatus::Running));
    assert!(
        matches!(winners[0].claimed_by.as_deref(), Some("w1" | "w2")),
        "{:?}",
        winners[0].claimed_by
    );
    let provisioning = f.store.session(ws, &session.id).await.expect("session");
    assert_eq!(
        (provisioning.phase, provisioning.current_turn, provisioning.n_waiting),
        (SessionPhase::Provisioning, Some(1), 0)
    );
    assert!(
        f.store
            .transition_session(&session.id, SessionPhase::Provisioning, SessionPhase::Running)
            .await
            .expect("run")
    );
    assert!(
        !f.store
            .transition_session(&session.id, SessionPhase::Provisioning, SessionPhase::Running)
            .await
            .expect("stale CAS")
    );
    let illegal = f
        .store
        .transition_session(&session.id, SessionPhase::Running, SessionPhase::Hibernated)
        .await;
    assert!(
        matches!(illegal, Err(StoreError::IllegalTransition { .. })),
        "{illegal:?}"
    );

    let queued = f
        .store
        .steer(ws, &session.id, queue("next"))
        .await
        .expect("queued steer");
    assert_eq!(queued.n, 2);
    let stop = f.store.request_stop(ws, &session.id).await.expect("stop");
    assert_eq!((stop.n, stop.stop_requested), (1, Some(StopRequest::Stop)));
    assert_eq!(
        f.store.request_stop(ws, &session.id).await.expect("stop again").n,
        1,
        "stop is idempotent"
    );

    let stopped = TurnOutcome {
        status: TurnStatus::Stopped,
        head_sha: Some("abc123".into()),
        failure: None,
    };
    assert!(
        f.store
            .finish_turn(&session.id, 1, stopped.clone())
            .await
            .expect("finish")
    );
    assert!(
        !f.store
            .finish_turn(&session.id, 1, stopped)
            .await
            .expect("finish twice"),
        "a replayed callback changes nothing"
    );
    assert!(
        f.store
            .transition_session(&session.id, SessionPhase::Running, SessionPhase::Delivering)
            .await
            .expect("deliver")
    );
    assert!(
        f.store
            .transition_session(&session.id, SessionPhase::Delivering, SessionPhase::Queued)
            .await
            .expect("next")
    );
    let second = f
        .store
        .claim_turn(&session.id, true, "w1")
        .await
        .expect("claim 2")
        .expect("turn 2");
    assert_eq!(second.n, 2);
    assert_eq!(
        f.store.session(ws, &session.id).await.expect("s").phase,
        SessionPhase::Running
    );

    let interrupt = f
        .store
        .steer(
            ws,
            &session.id,
            NewTurn {
                prompt: "now".into(),
                mode: TurnMode::Interrupt,
            },
        )
        .await
        .expect("interrupt");
    assert_eq!((interrupt.n, interrupt.mode), (3, TurnMode::Interrupt));
    let turns = f.store.turns(ws, &session.id).await.expect("turns");
    assert_eq!(turns[1].stop_requested, Some(StopRequest::Interrupt));

    let failed = TurnOutcome {
        status: TurnStatus::Failed,
        head_sha: None,
        failure: Some((FailureCode::AgentError, "the agent exited".into())),
    };
    assert!(f.store.finish_turn(&session.id, 2, failed).await.expect("fail"));
    assert!(
        f.store
            .transition_session(&session.id, SessionPhase::Running, SessionPhase::Failed)
            .await
            .expect("failed")
    );
    let failed_session = f.store.session(ws, &session.id).await.expect("s");
    assert_eq!(
        failed_session.failure,
        Some((FailureCode::AgentError, "the agent exited".into()))
    );
    assert_eq!(failed_session.head_sha.as_deref(), Some("abc123"));
    let turns = f.store.turns(ws, &session.id).await.expect("turns");
    assert_eq!(
        turns.iter().map(|t| t.status).collect::<Vec<_>>(),
        vec![TurnStatus::Stopped, TurnStatus::Failed, TurnStatus::Accepted]
    );
    assert!(turns[0].started_at.is_some() && turns[0].completed_at.is_some());

    // A failed session that waits for a worker is queued again with its failure cleared by a steer.
    f.store.steer(ws, &session.id, queue("retry")).await.expect("retry");
    let retried = f.store.session(ws, &session.id).await.expect("s");
    assert_eq!(
        (retried.phase, retried.failure.clone(), retried.n_waiting),
        (SessionPhase::Queued, None, 2)
    );

    // Cancel asks the running turn to stop and cancels the waiting ones.
    let third = f
        .store
        .claim_turn(&session.id, true, "w1")
        .await
        .expect("claim")
        .expect("turn 3");
    assert_eq!(third.n, 3);
    f.store.cancel(ws, &session.id).await.expect("cancel");
    let turns = f.store.turns(ws, &session.id).await.expect("turns");
    assert_eq!(
        (turns[2].status, turns[2].stop_requested),
        (TurnStatus::Running, Some(StopRequest::Cancel))
    );
    assert_eq!(turns[3].status, TurnStatus::Canceled);
    assert!(
        f.store
            .finish_turn(
                &session.id,
                3,
                TurnOutcome {
                    status: TurnStatus::Canceled,
                    head_sha: None,
                    failure: None
                }
            )
            .await
            .expect("finish")
    );
}

async fn resume_and_archive_follow_the_phase_rules(backend: TestBackend) {
    let f = fixture(backend).await;
    let ws = &f.workspace.id;
    let session = f
        .store
        .create_session(new_session(ws, "/r", "t"))
        .await
        .expect("create");
    assert_eq!(
        f.store.set_archived(ws, &session.id, true).await,
        Err(StoreError::SessionActive(SessionPhase::Queued))
    );
    assert_eq!(
        f.store.resume(ws, &session.id).await.expect("resume queued").phase,
        SessionPhase::Queued
    );

    f.store
        .claim_turn(&session.id, true, "w")
        .await
        .expect("claim")
        .expect("turn");
    f.store
        .finish_turn(
            &session.id,
            1,
            TurnOutcome {
                status: TurnStatus::Completed,
                head_sha: None,
                failure: None,
            },
        )
        .await
        .expect("finish");
    f.store
        .transition_session(&session.id, SessionPhase::Running, SessionPhase::Delivering)
        .await
        .expect("deliver");
    f.store
        .transition_session(&session.id, SessionPhase::Delivering, SessionPhase::Idle)
        .await
        .expect("idle");
    f.store
        .transition_session(&session.id, SessionPhase::Idle, SessionPhase::Hibernated)
        .await
        .expect("hibernate");

    let resumed = f.store.resume(ws, &session.id).await.expect("resume");
    assert_eq!((resumed.phase, resumed.resume_requested), (SessionPhase::Queued, true));
    f.store
        .claim_turn(&session.id, false, "w")
        .await
        .expect("no turn to claim");
    f.store
        .transition_session(&session.id, SessionPhase::Queued, SessionPhase::Provisioning)
        .await
        .expect("provision");
    f.store
        .transition_session(&session.id, SessionPhase::Provisioning, SessionPhase::Idle)
        .await
        .expect("idle");

    let archived = f.store.set_archived(ws, &session.id, true).await.expect("archive idle");
    assert!(archived.archived);
    assert_eq!(
        f.store.steer(ws, &session.id, queue("x")).await,
        Err(StoreError::NotSteerable("archived"))
    );
    assert_eq!(
        f.store.resume(ws, &session.id).await,
        Err(StoreError::NotSteerable("archived"))
    );
    assert!(
        !f.store
            .set_archived(ws, &session.id, false)
            .await
            .expect("unarchive")
            .archived
    );
    f.store.cancel(ws, &session.id).await.expect("cancel");
    assert_eq!(
        f.store.resume(ws, &session.id).await,
        Err(StoreError::NotSteerable("canceled"))
    );
    assert!(
        f.store
            .set_archived(ws, &session.id, true)
            .await
            .expect("archive canceled")
            .archived
    );
}

async fn parts_are_stored_once_in_order(backend: TestBackend) {
    let f = fixture(backend).await;
    let session = f
        .store
        .create_session(new_session(&f.workspace.id, "/r", "t"))
        .await
        .expect("create");
    let part = |i: u32| NewPart {
        part_index: i,
        payload: format!(r#"{{"type":"text-delta","id":"t","delta":"{i}"}}"#),
        driver_index: None,
    };
    assert_eq!(
        f.store.transcript_progress(&session.id, 1).await.expect("progress"),
        TranscriptProgress::default(),
        "nothing stored yet"
    );
    assert_eq!(
        f.store
            .append_parts(&session.id, 1, &[part(0), part(1), part(2)])
            .await
            .expect("append"),
        3
    );
    // A replayed batch overlapping the stored prefix adds only what is new.
    assert_eq!(
        f.store
            .append_parts(&session.id, 1, &[part(2), part(3)])
            .await
            .expect("append"),
        1
    );
    assert_eq!(
        f.store.append_parts(&session.id, 2, &[part(0)]).await.expect("append"),
        1
    );
    let stored = f.store.parts(&session.id).await.expect("parts");
    let keys: Vec<(u32, u32)> = stored.iter().map(|p| (p.turn, p.part_index)).collect();
    assert_eq!(keys, vec![(1, 0), (1, 1), (1, 2), (1, 3), (2, 0)]);
    assert!(
        stored.windows(2).all(|w| w[0].seq < w[1].seq),
        "seq increases: {stored:?}"
    );
    assert_eq!(stored[3].payload, part(3).payload, "payload kept verbatim");
    let missing = f.store.append_parts(&SessionId::generate(), 1, &[part(0)]).await;
    assert_eq!(missing, Err(StoreError::NotFound));

    // Where a recorder goes on: the last part, the last part from the sandbox's stream, the sizes
    // (bytes, not characters: "é" is two).
    let from_sandbox = |i: u32, driver: u32| NewPart {
        part_index: i,
        payload: format!(r#"{{"type":"text-delta","id":"t","delta":"é{i}"}}"#),
        driver_index: Some(driver),
    };
    let added = [from_sandbox(4, 7), from_sandbox(5, 9), part(6)];
    f.store.append_parts(&session.id, 1, &added).await.expect("append");
    let turn_bytes: u64 = [part(0), part(1), part(2), part(3)]
        .iter()
        .chain(&added)
        .map(|p| p.payload.len() as u64)
        .sum();
    let progress = f.store.transcript_progress(&session.id, 1).await.expect("progress");
    assert_eq!(
        progress,
        TranscriptProgress {
            last_index: Some(6),
            driver_cursor: Some(9),
            turn_parts: 7,
            turn_bytes,
            session_parts: 8,
            session_bytes: turn_bytes + part(0).payload.len() as u64,
        }
    );
    assert_eq!(
        f.store.transcript_progress(&SessionId::generate(), 1).await,
        Err(StoreError::NotFound)
    );

    // The head the git proxy saw the upstream take, kept for a worker that starts again.
    assert_eq!(f.store.pushed_head(&session.id).await, Ok(None));
    let head = "a".repeat(40);
    f.store.set_pushed_head(&session.id, &head).await.expect("pushed head");
    assert_eq!(f.store.pushed_head(&session.id).await, Ok(Some(head)));
    assert_eq!(
        f.store.set_pushed_head(&SessionId::generate(), "b").await,
        Err(StoreError::NotFound)
    );

    // What a pod kept at the session's WIP ref, as the git proxy saw it taken; cleared again.
    assert_eq!(f.store.wip_head(&session.id).await, Ok(None));
    let wip = "c".repeat(40);
    f.store.set_wip_head(&session.id, Some(&wip)).await.expect("wip head");
    assert_eq!(f.store.wip_head(&session.id).await, Ok(Some(wip.clone())));
    f.store.set_wip_head(&session.id, None).await.expect("wip cleared");
    assert_eq!(f.store.wip_head(&session.id).await, Ok(None));
    assert_eq!(
        f.store.set_wip_head(&SessionId::generate(), None).await,
        Err(StoreError::NotFound)
    );
    // A delivered branch holds the kept work: recording it forgets the WIP commit.
    f.store.set_wip_head(&session.id, Some(&wip)).await.expect("wip head");
    f.store
        .set_pushed_head(&session.id, &"d".repeat(40))
        .await
        .expect("pushed head");
    assert_eq!(f.store.wip_head(&session.id).await, Ok(None));

    // What the agent kept in its home, given up by a pod at hibernation: bytes back as they went in,
    // the last one kept.
    assert_eq!(f.store.home_snapshot(&session.id).await, Ok(None));
    let tar: Vec<u8> = (0..=255u8).cycle().take(70_000).collect();
    f.store.set_home_snapshot(&session.id, &tar).await.expect("snapshot");
    f.store
        .set_home_snapshot(&session.id, &tar[..1000])
        .await
        .expect("replaced");
    assert_eq!(f.store.home_snapshot(&session.id).await, Ok(Some(tar[..1000].to_vec())));
}

async fn parts_are_read_one_turn_at_a_time(backend: TestBackend) {
    let f = fixture(backend).await;
    let session = f
        .store
        .create_session(new_session(&f.workspace.id, "/r", "t"))
        .await
        .expect("create");
    let other = f
        .store
        .create_session(new_session(&f.workspace.id, "/r", "t"))
        .await
        .expect("create other");
    let part = |turn: u32, i: u32| NewPart {
        part_index: i,
        payload: format!(r#"{{"type":"text-delta","id":"t","delta":"{turn}.{i}"}}"#),
        driver_index: None,
    };
    // Turns stored interleaved, out of order and with a gap (part 5 of turn 2 never arrived).
    let turn_2: Vec<NewPart> = [0, 1, 2, 3, 4, 6, 7].into_iter().map(|i| part(2, i)).collect();
    f.store
        .append_parts(&session.id, 2, &turn_2[3..])
        .await
        .expect("append");
    f.store
        .append_parts(&session.id, 1, &[part(1, 0), part(1, 1)])
        .await
        .expect("append");
    f.store
        .append_parts(&session.id, 2, &turn_2[..3])
        .await
        .expect("append");
    f.store
        .append_parts(&session.id, 3, &[part(3, 0)])
        .await
        .expect("append");
    f.store
        .append_parts(&other.id, 2, &[part(9, 0)])
        .await
        .expect("append other");
    let indexes = |parts: &[StoredPart]| parts.iter().map(|p| (p.turn, p.part_index)).collect::<Vec<_>>();
    let slice = |parts: u32| PartsLimit { parts, bytes: u64::MAX };

    let whole = f.store.turn_parts(&session.id, 2).await.expect("turn 2");
    assert_eq!(
        indexes(&whole),
        [0, 1, 2, 3, 4, 6, 7].map(|i| (2, i)).to_vec(),
        "one turn, in part order, nothing of other turns or sessions"
    );
    assert_eq!(whole[5].payload, part(2, 6).payload, "payload kept verbatim");
    let all = f.store.parts(&session.id).await.expect("all");
    let of_turn_2: Vec<StoredPart> = all.into_iter().filter(|p| p.turn == 2).collect();
    assert_eq!(
        whole, of_turn_2,
        "the same rows, seq included, as the session-wide read"
    );

    let tail = f
        .store
        .turn_parts_after(&session.id, 2, Some(4), slice(100))
        .await
        .expect("tail");
    assert_eq!(
        indexes(&tail),
        vec![(2, 6), (2, 7)],
        "after a part index, across the gap"
    );
    let first = f
        .store
        .turn_parts_after(&session.id, 2, None, slice(3))
        .await
        .expect("first slice");
    assert_eq!(indexes(&first), vec![(2, 0), (2, 1), (2, 2)]);
    // Slice by slice, each from the last index of the one before, reads the turn once.
    let mut sliced = Vec::new();
    let mut after = None;
    loop {
        let slice = f
            .store
            .turn_parts_after(&session.id, 2, after, slice(2))
            .await
            .expect("slice");
        let Some(last) = slice.last() else { break };
        after = Some(last.part_index);
        sliced.extend(slice);
    }
    assert_eq!(sliced, whole);
    // A byte limit stops before the part that would pass it, but never returns nothing while parts remain.
    let one_part = part(2, 0).payload.len() as u64;
    for (bytes, expected) in [
        (one_part * 2, 2),
        (one_part * 2 + 1, 2),
        (one_part * 2 - 1, 1),
        (1, 1),
        (0, 1),
    ] {
        let bounded = f
            .store
            .turn_parts_after(&session.id, 2, None, PartsLimit { parts: 100, bytes })
            .await
            .expect("bytes");
        assert_eq!(
            indexes(&bounded),
            whole[..expected].iter().map(|p| (2, p.part_index)).collect::<Vec<_>>(),
            "{bytes} bytes"
        );
    }
    for (turn, after, limit) in [(2, Some(7), 10), (2, Some(u32::MAX), 10), (2, None, 0), (4, None, 10)] {
        let nothing = f
            .store
            .turn_parts_after(&session.id, turn, after, slice(limit))
            .await
            .expect("empty");
        assert!(
            nothing.is_empty(),
            "turn {turn} after {after:?} limit {limit}: {nothing:?}"
        );
    }
    assert!(f.store.turn_parts(&session.id, 9).await.expect("no turn").is_empty());
    assert!(
        f.store
            .turn_parts(&SessionId::generate(), 1)
            .await
            .expect("no session")
            .is_empty()
    );
    assert_eq!(
        indexes(&f.store.turn_parts(&other.id, 2).await.expect("other")),
        vec![(2, 0)]
    );
}

async fn a_batch_larger_than_one_statement_is_stored_once_in_order(backend: TestBackend) {
    let f = fixture(backend).await;
    let session = f
        .store
        .create_session(new_session(&f.workspace.id, "/r", "t"))
        .await
        .expect("create");
    let part = |i: u32| NewPart {
        part_index: i,
        payload: format!(r#"{{"type":"text-delta","id":"t","delta":"{i} \"quoted\" é"}}"#),
        driver_index: None,
    };
    let stored_before: Vec<NewPart> = (1_500..1_510).map(part).collect();
    f.store
        .append_parts(&session.id, 1, &stored_before)
        .await
        .expect("append");
    let batch: Vec<NewPart> = (0..2_500).map(part).collect();
    assert_eq!(
        f.store.append_parts(&session.id, 1, &batch).await.expect("append"),
        2_490,
        "the ten parts stored before are not counted again"
    );
    let stored = f.store.turn_parts(&session.id, 1).await.expect("read");
    assert_eq!(stored.len(), 2_500);
    assert!(
        stored
            .iter()
            .zip(&batch)
            .all(|(s, b)| s.part_index == b.part_index && s.payload == b.payload)
    );
    let seq_of = |i: usize| stored[i].seq;
    assert!(
        (1..1_500).all(|i| seq_of(i - 1) < seq_of(i)) && (1_511..2_500).all(|i| seq_of(i - 1) < seq_of(i)),
        "seq follows the batch's order across statements"
    );
    assert!(
        seq_of(1_500) < seq_of(0),
        "the parts stored first kept their earlier seq"
    );
    let unique: std::collections::BTreeSet<i64> = stored.iter().map(|p| p.seq).collect();
    assert_eq!(unique.len(), 2_500, "no seq given twice");
}

async fn transcript_sizes_count_parts_and_bytes(backend: TestBackend) {
    let f = fixture(backend).await;
    let session = f
        .store
        .create_session(new_session(&f.workspace.id, "/r", "t"))
        .await
        .expect("create");
    assert_eq!(
        f.store.parts_size(&session.id, None).await.expect("empty"),
        PartsSize { parts: 0, bytes: 0 }
    );
    // Bytes, not characters: "é" is two bytes of UTF-8 and "🚀" four.
    let payloads = [r#"{"delta":"é"}"#, r#"{"delta":"🚀"}"#, r#"{"delta":"ascii"}"#];
    let parts: Vec<NewPart> = (0_u32..)
        .zip(payloads)
        .map(|(part_index, payload)| NewPart {
            part_index,
            payload: payload.to_owned(),
            driver_index: None,
        })
        .collect();
    f.store.append_parts(&session.id, 1, &parts[..2]).await.expect("append");
    f.store.append_parts(&session.id, 2, &parts[2..]).await.expect("append");
    // A replayed part is stored once and counted once.
    f.store.append_parts(&session.id, 1, &parts[..1]).await.expect("replay");
    let bytes = |range: std::ops::Range<usize>| payloads[range].iter().map(|p| p.len() as u64).sum::<u64>();
    assert_eq!(
        f.store.parts_size(&session.id, Some(1)).await.expect("turn 1"),
        PartsSize {
            parts: 2,
            bytes: bytes(0..2)
        }
    );
    assert_eq!(bytes(0..2), 14 + 16, "the payloads' UTF-8 length");
    assert_eq!(
        f.store.parts_size(&session.id, Some(2)).await.expect("turn 2"),
        PartsSize {
            parts: 1,
            bytes: bytes(2..3)
        }
    );
    assert_eq!(
        f.store.parts_size(&session.id, None).await.expect("session"),
        PartsSize {
            parts: 3,
            bytes: bytes(0..3)
        }
    );
    assert_eq!(
        f.store.parts_size(&session.id, Some(3)).await.expect("no such turn"),
        PartsSize::default()
    );
}

async fn budgets_are_raised_paused_and_quotas_counted(backend: TestBackend) {
    let f = fixture(backend).await;
    let mut new = new_session(&f.workspace.id, "/r", "t");
    new.budget = sortie_protocol::api::Budget {
        tokens: Some(500),
        compute_seconds: None,
    };
    let session = f.store.create_session(new).await.expect("create");
    assert_eq!((session.budget_tokens, session.budget_compute_ms), (Some(500), None));
    let usage = TokenUsage {
        session_id: session.id.clone(),
        turn: 1,
        model: "m".into(),
        epoch_ms: now_ms(),
        input_tokens: 300,
        output_tokens: 20,
    };
    f.store.record_token_usage(&usage).await.expect("usage");
    // A cap it had grows by the raise; one it had not starts at what it used.
    let raised = f
        .store
        .raise_budget(&f.workspace.id, &session.id, Some(100), Some(5_000))
        .await
        .expect("raise");
    assert_eq!(
        (raised.budget_tokens, raised.budget_compute_ms),
        (Some(600), Some(5_000))
    );
    assert!(matches!(
        f.store.raise_budget("ws_other", &session.id, Some(1), None).await,
        Err(StoreError::NotFound)
    ));
    // Paused once, released once; ending the turn releases it too.
    assert!(f.store.set_budget_paused(&session.id, true).await.expect("pause"));
    assert!(!f.store.set_budget_paused(&session.id, true).await.expect("again"));
    let paused = f.store.session_by_id(&session.id).await.expect("session");
    assert!(paused.budget_paused_at.is_some());
    assert!(f.store.set_budget_paused(&session.id, false).await.expect("release"));
    assert!(!f.store.set_budget_paused(&session.id, false).await.expect("again"));

    // Limits round-trip; the quotas' counts.
    let limits = sortie_protocol::api::WorkspaceLimits {
        budget: sortie_protocol::api::Budget {
            tokens: Some(7),
            compute_seconds: None,
        },
        quotas: sortie_protocol::api::Quotas {
            sessions_per_day: Some(3),
            tokens_per_month: None,
        },
    };
    assert_eq!(
        f.store.workspace_limits(&f.workspace.id).await.expect("limits"),
        Default::default()
    );
    f.store
        .set_workspace_limits(&f.workspace.id, &limits)
        .await
        .expect("set");
    assert_eq!(f.store.workspace_limits(&f.workspace.id).await.expect("limits"), limits);
    // Sessions per day: the limit counts today's, in the transaction that would write the next.
    for _ in 0..2 {
        f.store
            .create_session(new_session(&f.workspace.id, "/r", "t"))
            .await
            .expect("within the quota");
    }
    let refused = f.store.create_session(new_session(&f.workspace.id, "/r", "t")).await;
    match refused {
        Err(StoreError::QuotaExceeded(breach)) => {
            assert_eq!((breach.quota, breach.limit, breach.used), ("sessions_per_day", 3, 3));
        }
        other => panic!("{other:?}"),
    }
    // Tokens per month: steering is refused too.
    let tokens = sortie_protocol::api::WorkspaceLimits {
        quotas: sortie_protocol::api::Quotas {
            sessions_per_day: None,
            tokens_per_month: Some(320),
        },
        ..limits
    };
    f.store
        .set_workspace_limits(&f.workspace.id, &tokens)
        .await
        .expect("set");
    let steered = f.store.steer(&f.workspace.id, &session.id, queue("more")).await;
    match steered {
        Err(StoreError::QuotaExceeded(breach)) => {
            assert_eq!(
                (breach.quota, breach.limit, breach.used),
                ("tokens_per_month", 320, 320)
            );
        }
        other => panic!("{other:?}"),
    }
}

async fn retention_prunes_only_what_ended_before_the_cutoff(backend: TestBackend) {
    let f = fixture(backend).await;
    let store = &f.store;
    let ended = store
        .create_session(new_session(&f.workspace.id, "/r/a", "a"))
        .await
        .expect("create");
    let idle = store
        .create_session(new_session(&f.workspace.id, "/r/b", "b"))
        .await
        .expect("create");
    for session in [&ended, &idle] {
        store
            .append_parts(
                &session.id,
                1,
                &[NewPart {
                    part_index: 0,
                    payload: r#"{"type":"text-delta","id":"t","delta":"hi"}"#.into(),
                    driver_index: None,
                }],
            )
            .await
            .expect("parts");
    }
    // Its turn failed: a failed session could be steered again, until it is pruned.
    store
        .claim_turn(&ended.id, false, "w")
        .await
        .expect("claim")
        .expect("claimed");
    let failed = TurnOutcome {
        status: TurnStatus::Failed,
        head_sha: None,
        failure: Some((FailureCode::AgentError, "the agent exited".into())),
    };
    assert_eq!(
        store.end_turn(&ended.id, 1, failed).await.expect("end"),
        SessionPhase::Failed
    );
    let later = now_ms() + 60_000;
    // Queued (not ended) and the ended one before its cutoff: nothing to prune.
    assert!(
        store
            .prunable_sessions(now_ms() - 60_000, 10)
            .await
            .expect("prunable")
            .is_empty()
    );
    let prunable = store.prunable_sessions(later, 10).await.expect("prunable");
    assert_eq!(prunable.iter().map(|s| &s.id).collect::<Vec<_>>(), [&ended.id]);
    // A sandbox held keeps it.
    store
        .put_sandbox(&ended.id, "local", "sbx", "w")
        .await
        .expect("sandbox");
    assert!(!store.prune_session(&ended.id, later).await.expect("prune"));
    store.delete_sandbox(&ended.id).await.expect("forget");
    assert!(!store.prune_session(&idle.id, later).await.expect("not ended"));
    assert!(store.prune_session(&ended.id, later).await.expect("prune"));
    assert!(!store.prune_session(&ended.id, later).await.expect("once"));
    let pruned = store.session(&f.workspace.id, &ended.id).await.expect("session stays");
    assert!(pruned.pruned_at.is_some());
    assert!(store.parts(&ended.id).await.expect("parts").is_empty());
    assert_eq!(store.parts(&idle.id).await.expect("parts").len(), 1);
    assert_eq!(store.kept_repos().await.expect("repos"), vec!["/r/b".to_owned()]);
    // A pruned session takes no more turns: its workspace is gone.
    let steered = store.steer(&f.workspace.id, &ended.id, queue("again")).await;
    assert!(
        matches!(steered, Err(StoreError::NotSteerable(why)) if why.contains("pruned")),
        "{steered:?}"
    );
    store.compact().await.expect("compact");
}

async fn usage_is_summed_by_session_and_day(backend: TestBackend) {
    let f = fixture(backend).await;
    let session = f
        .store
        .create_session(new_session(&f.workspace.id, "/r", "t"))
        .await
        .expect("create");
    let day_one = 1_796_219_431_000; // 2026-12-02
    let day_two = day_one + 86_400_000;
    for (turn, at, input, output) in [(1, day_one, 100, 10), (1, day_one, 50, 5), (2, day_two, 7, 3)] {
        let usage = TokenUsage {
            session_id: session.id.clone(),
            turn,
            model: "claude-x".into(),
            epoch_ms: at,
            input_tokens: input,
            output_tokens: output,
        };
        f.store.record_token_usage(&usage).await.expect("tokens");
    }
    // Readings are the sandbox's cumulative count: each is metered for what it adds, once.
    f.store
        .put_sandbox(&session.id, "local", "sbx-1", "w1")
        .await
        .expect("sandbox");
    let reading = |cpu_ms, peak_memory_bytes| SandboxReading {
        cpu_ms,
        peak_memory_bytes,
    };
    for (turn, cumulative, peak) in [(1, 1_500, 30 << 20), (1, 1_500, 30 << 20), (2, 2_000, 20 << 20)] {
        f.store
            .meter_sandbox(&session.id, turn, day_one, reading(cumulative, peak))
            .await
            .expect("compute");
    }
    let turns = f.store.turns(&f.workspace.id, &session.id).await.expect("turns");
    let metered: Vec<(u64, u64)> = turns.iter().map(|t| (t.cpu_ms, t.peak_memory_bytes)).collect();
    assert_eq!(&metered[..1], &[(1_500, 30 << 20)], "turn 1 counted once");
    // A new sandbox counts from zero again; the session's peak is the largest of any.
    f.store
        .put_sandbox(&session.id, "local", "sbx-2", "w1")
        .await
        .expect("sandbox");
    f.store
        .meter_sandbox(&session.id, 2, day_one + 1, reading(0, 10 << 20))
        .await
        .expect("compute");
    let records = f.store.usage(&f.workspace.id, None).await.expect("usage");
    assert_eq!(
        records.tokens,
        vec![
            (session.id.clone(), "2026-12-03".into(), "claude-x".into(), 7, 3),
            (session.id.clone(), "2026-12-02".into(), "claude-x".into(), 150, 15),
        ]
    );
    assert_eq!(records.compute, vec![(session.id.clone(), "2026-12-02".into(), 2_000)]);
    let totals = f.store.session(&f.workspace.id, &session.id).await.expect("session");
    assert_eq!(
        (
            totals.input_tokens,
            totals.output_tokens,
            totals.compute_ms,
            totals.peak_memory_bytes
        ),
        (157, 18, 2_000, 30 << 20)
    );
}

async fn ticket_nonces_are_claimed_once(backend: TestBackend) {
    let f = fixture(backend).await;
    let expires = now_ms() + 60_000;
    assert!(f.store.claim_ticket_nonce("n-1", expires).await.expect("claim"));
    assert!(!f.store.claim_ticket_nonce("n-1", expires).await.expect("replay"));
    assert!(f.store.claim_ticket_nonce("n-2", expires).await.expect("other"));
}

async fn instance_secrets_are_stable(backend: TestBackend) {
    let f = fixture(backend).await;
    assert_eq!(
        f.store.instance_secret("ticket", "first").await.expect("secret"),
        "first"
    );
    assert_eq!(
        f.store.instance_secret("ticket", "second").await.expect("secret"),
        "first"
    );
}

async fn a_running_turn_is_routed_to_its_workers_feed(backend: TestBackend) {
    let f = fixture(backend).await;
    let session = f
        .store
        .create_session(new_session(&f.workspace.id, "/r", "t"))
        .await
        .expect("create");
    // Not claimed yet: no worker holds it.
    assert_eq!(f.store.live_feed(&session.id, 1).await.expect("route"), None);
    f.store
        .register_worker("w-feed", Some("http://10.0.0.7:7450"))
        .await
        .expect("register");
    let turn = f
        .store
        .claim_turn(&session.id, false, "w-feed")
        .await
        .expect("claim")
        .expect("claimed");
    assert_eq!(
        f.store.live_feed(&session.id, turn.n).await.expect("route").as_deref(),
        Some("http://10.0.0.7:7450")
    );
    assert_eq!(f.store.live_feed(&session.id, turn.n + 1).await.expect("route"), None);
    // A worker that registers again (restarted, moved) is found at its new address; one without a
    // feed is nowhere.
    f.store
        .register_worker("w-feed", Some("http://10.0.0.8:7450"))
        .await
        .expect("register again");
    assert_eq!(
        f.store.live_feed(&session.id, turn.n).await.expect("route").as_deref(),
        Some("http://10.0.0.8:7450")
    );
    f.store.register_worker("w-feed", None).await.expect("no feed");
    assert_eq!(f.store.live_feed(&session.id, turn.n).await.expect("route"), None);
    f.store
        .register_worker("w-feed", Some("http://10.0.0.8:7450"))
        .await
        .expect("register");
    // An ended turn has no live copy anywhere.
    f.store
        .finish_turn(
            &session.id,
            turn.n,
            TurnOutcome {
                status: TurnStatus::Completed,
                head_sha: None,
                failure: None,
            },
        )
        .await
        .expect("finish");
    assert_eq!(f.store.live_feed(&session.id, turn.n).await.expect("route"), None);
}

async fn reconnecting_keeps_everything(backend: TestBackend) {
    let f = fixture(backend).await;
    let session = f
        .store
        .create_session(new_session(&f.workspace.id, "/r", "t"))
        .await
        .expect("create");
    f.store.close().await;
    let reopened = SqlStore::connect(&f._database.url)
        .await
        .expect("reconnect (migrations are idempotent)");
    assert_eq!(
        reopened
            .session(&f.workspace.id, &session.id)
            .await
            .expect("session")
            .id,
        session.id
    );
    reopened.close().await;
}

/// What the events of a page say, as `(session-or-turn, state)` lines, for comparing whole stories.
fn said(page: &EventPage) -> Vec<String> {
    page.events
        .iter()
        .map(|e| match (e.change, e.turn) {
            (EventChange::Phase(phase), None) => format!("session {phase}"),
            (EventChange::Status(status), Some(n)) => format!("turn {n} {status}"),
            (change, turn) => panic!("an event of the wrong shape: {change:?} turn {turn:?}"),
        })
        .collect()
}

async fn every_phase_and_status_change_is_an_event_in_commit_order(backend: TestBackend) {
    let f = fixture(backend).await;
    let ws = &f.workspace.id;
    let other = f
        .store
        .create_workspace("other", RepoAccess::default())
        .await
        .expect("other workspace");
    let start = f.store.latest_event().await.expect("latest");
    let mut signal = f.store.event_signal();
    signal.borrow_and_update();

    let session = f
        .store
        .create_session(new_session(ws, "/r", "t"))
        .await
        .expect("create");
    assert!(
        signal.has_changed().expect("signal"),
        "a commit with events wakes readers"
    );
    f.store
        .claim_turn(&session.id, false, "w")
        .await
        .expect("claim")
        .expect("claimed");
    assert!(
        f.store
            .transition_session(&session.id, SessionPhase::Provisioning, SessionPhase::Running)
            .await
            .expect("run")
    );
    // A compare-and-set that loses writes nothing.
    assert!(
        !f.store
            .transition_session(&session.id, SessionPhase::Provisioning, SessionPhase::Running)
            .await
            .expect("lost")
    );
    f.store.steer(ws, &session.id, queue("two")).await.expect("steer");
    assert!(
        f.store
            .transition_session(&session.id, SessionPhase::Running, SessionPhase::Delivering)
            .await
            .expect("deliver")
    );
    f.store
        .finish_turn(
            &session.id,
            1,
            TurnOutcome {
                status: TurnStatus::Failed,
                head_sha: None,
                failure: Some((FailureCode::AgentError, "the agent broke".into())),
            },
        )
        .await
        .expect("finish");
    assert_eq!(
        f.store
            .settle_session(&session.id, SessionPhase::Delivering, true)
            .await
            .expect("settle"),
        Some(SessionPhase::Queued)
    );
    f.store.steer(ws, &session.id, queue("three")).await.expect("steer");
    f.store.cancel(ws, &session.id).await.expect("cancel");
    let foreign = f
        .store
        .create_session(new_session(&other.id, "/r", "t"))
        .await
        .expect("foreign");

    let page = f.store.events_after(Some(ws), start, 100).await.expect("events");
    assert_eq!(
        said(&page),
        [
            "session queued",
            "turn 1 accepted",
            "session provisioning",
            "turn 1 running",
            "session running",
            "turn 2 accepted",
            "session delivering",
            "turn 1 failed",
            "session queued",
            "turn 3 accepted",
            "session canceled",
            "turn 2 canceled",
            "turn 3 canceled",
        ]
    );
    assert!(page.events.windows(2).all(|w| w[0].seq < w[1].seq), "numbered in order");
    assert!(
        page.events
            .iter()
            .all(|e| e.session_id == session.id && &e.workspace_id == ws)
    );
    let failed = &page.events[7];
    assert_eq!(
        failed.failure,
        Some((FailureCode::AgentError, "the agent broke".into()))
    );
    assert_eq!(page.events[8].failure, None, "only a change to failed says why");

    // Another workspace sees only its own; the outbox sees both; a reader goes on after its last.
    let theirs = f.store.events_after(Some(&other.id), start, 100).await.expect("theirs");
    assert_eq!(said(&theirs), ["session queued", "turn 1 accepted"]);
    assert!(theirs.events.iter().all(|e| e.session_id == foreign.id));
    let all = f.store.events_after(None, start, 100).await.expect("all");
    assert_eq!(all.events.len(), 15);
    let after = page.events[10].seq;
    let rest = f.store.events_after(Some(ws), after, 100).await.expect("rest");
    assert_eq!(said(&rest), ["turn 2 canceled", "turn 3 canceled"]);
    let limited = f.store.events_after(Some(ws), start, 3).await.expect("limited");
    assert_eq!(limited.events.len(), 3);
    assert_eq!(f.store.latest_event().await.expect("latest"), all.events[14].seq);

    // A failed session says why in its phase event too.
    let failing = f
        .store
        .create_session(new_session(ws, "/r", "t"))
        .await
        .expect("create");
    f.store
        .claim_turn(&failing.id, false, "w")
        .await
        .expect("claim")
        .expect("claimed");
    f.store
        .finish_turn(
            &failing.id,
            1,
            TurnOutcome {
                status: TurnStatus::Failed,
                head_sha: None,
                failure: Some((FailureCode::CloneFailed, "no such repository".into())),
            },
        )
        .await
        .expect("finish");
    f.store
        .settle_session(&failing.id, SessionPhase::Provisioning, true)
        .await
        .expect("settle");
    let last = f.store.events_after(Some(ws), after, 100).await.expect("last");
    let phase = last.events.last().expect("an event");
    assert_eq!(phase.change, EventChange::Phase(SessionPhase::Failed));
    assert_eq!(
        phase.failure,
        Some((FailureCode::CloneFailed, "no such repository".into()))
    );

    // Pruning forgets old events and says how far, so a reader further back knows it lost some.
    assert_eq!(page.pruned_through, 0);
    assert_eq!(f.store.prune_events(0).await.expect("nothing is that old"), 0);
    let pruned = f.store.prune_events(now_ms() + 1).await.expect("prune");
    assert_eq!(pruned, 21);
    let gone = f.store.events_after(Some(ws), start, 100).await.expect("gone");
    assert!(gone.events.is_empty());
    assert_eq!(gone.pruned_through, phase.seq);
    // Numbers go on from where they were.
    f.store.steer(ws, &failing.id, queue("again")).await.expect("steer");
    let next = f
        .store
        .events_after(Some(ws), gone.pruned_through, 100)
        .await
        .expect("next");
    assert!(next.events.iter().all(|e| e.seq > phase.seq));
    assert_eq!(said(&next), ["session queued", "turn 2 accepted"]);
}

/// Writers racing on different sessions: a reader polling as they commit never sees a number appear
/// below one it has already read (on PostgreSQL a sequence alone would allow that).
async fn concurrent_writers_number_events_in_commit_order(backend: TestBackend) {
    let f = fixture(backend).await;
    let ws = f.workspace.id.clone();
    let start = f.store.latest_event().await.expect("latest");
    let writers: Vec<_> = (0..8)
        .map(|_| {
            let store = f.store.clone();
            let ws = ws.clone();
            tokio::spawn(async move {
                for _ in 0..10 {
                    let session = store.create_session(new_session(&ws, "/r", "t")).await.expect("create");
                    store.steer(&ws, &session.id, queue("more")).await.expect("steer");
                }
            })
        })
        .collect();
    let mut seen = Vec::new();
    let mut after = start;
    while seen.len() < 8 * 10 * 3 {
        let page = f.store.events_after(Some(&ws), after, 1000).await.expect("read");
        if let Some(last) = page.events.last() {
            after = last.seq;
        }
        seen.extend(page.events.into_iter().map(|e| e.seq));
        if writers.iter().all(|w| w.is_finished()) {
            let rest = f.store.events_after(Some(&ws), after, 1000).await.expect("read");
            seen.extend(rest.events.into_iter().map(|e| e.seq));
            break;
        }
        tokio::task::yield_now().await;
    }
    for writer in writers {
        writer.await.expect("writer");
    }
    let every = f.store.events_after(Some(&ws), start, 1000).await.expect("every");
    assert_eq!(every.events.len(), 8 * 10 * 3);
    assert_eq!(
        seen,
        every.events.iter().map(|e| e.seq).collect::<Vec<_>>(),
        "a reader following along read every event once, in order"
    );
}

async fn webhook_deliveries_are_enqueued_and_claimed_once(backend: TestBackend) {
    let f = fixture(backend).await;
    let ws = &f.workspace.id;
    let hook = f
        .store
        .create_webhook(NewWebhook {
            id: "whk_a".into(),
            workspace_id: ws.clone(),
            url: "http://192.0.2.1/".into(),
            secret_ciphertext: "c".into(),
            secret_nonce: "n".into(),
            events: vec!["session.phase".into()],
            cursor: 5,
        })
        .await
        .expect("create");
    assert_eq!(
        (hook.cursor, hook.events.clone()),
        (5, vec!["session.phase".to_owned()])
    );
    let delivery = |seq: u64| NewDelivery {
        id: format!("dlv_{seq}"),
        event_seq: seq,
        kind: "session.phase".into(),
        payload: format!("{{\"seq\":{seq}}}"),
    };
    // Two dispatchers move the cursor from 5: one wins, the other writes nothing.
    let batch = [delivery(6), delivery(7)];
    let (a, b) = tokio::join!(
        f.store.enqueue_deliveries("whk_a", 5, 7, &batch),
        f.store.enqueue_deliveries("whk_a", 5, 7, &batch)
    );
    assert_eq!([a.expect("a"), b.expect("b")].iter().filter(|won| **won).count(), 1);
    assert_eq!(f.store.webhooks(None).await.expect("hooks")[0].cursor, 7);

    // Claimed once while leased; due again after a retry's time; done once delivered.
    let now = now_ms();
    let (first, second) = tokio::join!(
        f.store.claim_due_deliveries(now, now + 60_000, 10),
        f.store.claim_due_deliveries(now, now + 60_000, 10)
    );
    let (first, second) = (first.expect("first"), second.expect("second"));
    assert_eq!(
        first.len() + second.len(),
        2,
        "each delivery claimed once: {first:?} {second:?}"
    );
    f.store
        .record_delivery_attempt(
            "dlv_6",
            &AttemptOutcome::Retry {
                status: Some(500),
                error: "500".into(),
                next_at: now + 1_000,
            },
        )
        .await
        .expect("retry");
    f.store
        .record_delivery_attempt("dlv_7", &AttemptOutcome::Delivered { status: 200 })
        .await
        .expect("delivered");
    assert!(
        f.store
            .claim_due_deliveries(now, now + 60_000, 10)
            .await
            .expect("claim")
            .is_empty(),
        "not due yet"
    );
    let due = f
        .store
        .claim_due_deliveries(now + 1_000, now + 61_000, 10)
        .await
        .expect("claim");
    assert_eq!(
        due.iter()
            .map(|d| (d.id.as_str(), d.attempts, d.last_status))
            .collect::<Vec<_>>(),
        [("dlv_6", 1, Some(500))]
    );
    f.store
        .record_delivery_attempt(
            "dlv_6",
            &AttemptOutcome::GaveUp {
                status: None,
                error: "refused".into(),
            },
        )
        .await
        .expect("gave up");
    let log = f.store.webhook_deliveries(ws, "whk_a", 10).await.expect("log");
    assert_eq!(
        log.iter()
            .map(|d| (d.id.as_str(), d.state, d.attempts))
            .collect::<Vec<_>>(),
        [
            ("dlv_7", DeliveryState::Delivered, 1),
            ("dlv_6", DeliveryState::Failed, 2)
        ]
    );
    assert!(
        f.store
            .webhook_deliveries("other", "whk_a", 10)
            .await
            .expect("foreign")
            .is_empty()
    );
    assert!(!f.store.delete_webhook("other", "whk_a").await.expect("foreign delete"));
    assert!(f.store.delete_webhook(ws, "whk_a").await.expect("delete"));
    assert!(f.store.webhooks(Some(ws)).await.expect("hooks").is_empty());
}

fn ending(status: TurnStatus, failure: Option<(FailureCode, &str)>) -> TurnOutcome {
    TurnOutcome {
        status,
        head_sha: None,
        failure: failure.map(|(code, reason)| (code, reason.to_owned())),
    }
}

async fn a_turn_ends_with_its_session_in_one_call(backend: TestBackend) {
    let f = fixture(backend).await;
    let ws = &f.workspace.id;
    let session = f
        .store
        .create_session(new_session(ws, "/r", "t"))
        .await
        .expect("create");
    let start = f.store.latest_event().await.expect("latest");

    // Failed while provisioning: the turn fails and the session with it.
    f.store
        .claim_turn(&session.id, false, "w")
        .await
        .expect("claim")
        .expect("claimed");
    let clone_failed = ending(
        TurnStatus::Failed,
        Some((FailureCode::CloneFailed, "no such repository")),
    );
    assert_eq!(
        f.store.end_turn(&session.id, 1, clone_failed).await.expect("end"),
        SessionPhase::Failed
    );
    let failed = f.store.session(ws, &session.id).await.expect("s");
    assert_eq!(
        failed.failure,
        Some((FailureCode::CloneFailed, "no such repository".into()))
    );

    // A turn that completes while another waits behind it: the session queues, through delivering.
    f.store.steer(ws, &session.id, queue("two")).await.expect("steer");
    f.store
        .claim_turn(&session.id, true, "w")
        .await
        .expect("claim")
        .expect("claimed");
    f.store
        .steer(ws, &session.id, queue("three"))
        .await
        .expect("steer behind");
    let delivered = TurnOutcome {
        status: TurnStatus::Completed,
        head_sha: Some("abc123".into()),
        failure: None,
    };
    assert_eq!(
        f.store.end_turn(&session.id, 2, delivered).await.expect("end"),
        SessionPhase::Queued
    );
    let queued = f.store.session(ws, &session.id).await.expect("s");
    assert_eq!((queued.head_sha.as_deref(), queued.failure), (Some("abc123"), None));

    // The last turn: idle. Ending it again changes nothing and says where the session is.
    f.store
        .claim_turn(&session.id, true, "w")
        .await
        .expect("claim")
        .expect("claimed");
    assert!(
        f.store
            .transition_session(&session.id, SessionPhase::Running, SessionPhase::Delivering)
            .await
            .expect("delivering")
    );
    assert_eq!(
        f.store
            .end_turn(&session.id, 3, ending(TurnStatus::Stopped, None))
            .await
            .expect("end"),
        SessionPhase::Idle
    );
    let replay = ending(TurnStatus::Lost, Some((FailureCode::SandboxLost, "gone")));
    assert_eq!(
        f.store.end_turn(&session.id, 3, replay).await.expect("again"),
        SessionPhase::Idle
    );
    let turns = f.store.turns(ws, &session.id).await.expect("turns");
    assert_eq!(
        turns.iter().map(|t| t.status).collect::<Vec<_>>(),
        [TurnStatus::Failed, TurnStatus::Completed, TurnStatus::Stopped]
    );

    // A turn ended by a vendor's refusal before its settlement keeps that end; the session fails.
    f.store.steer(ws, &session.id, queue("four")).await.expect("steer");
    f.store
        .claim_turn(&session.id, true, "w")
        .await
        .expect("claim")
        .expect("claimed");
    let refused = ending(
        TurnStatus::Failed,
        Some((FailureCode::VendorAuthRejected, "the key was refused")),
    );
    assert!(
        f.store
            .finish_turn(&session.id, 4, refused.clone())
            .await
            .expect("fail early")
    );
    assert_eq!(
        f.store.end_turn(&session.id, 4, refused).await.expect("end"),
        SessionPhase::Failed
    );

    // Canceled mid-turn: the turn ends canceled and the session stays canceling for its teardown.
    f.store.steer(ws, &session.id, queue("five")).await.expect("steer");
    f.store
        .claim_turn(&session.id, true, "w")
        .await
        .expect("claim")
        .expect("claimed");
    f.store.cancel(ws, &session.id).await.expect("cancel");
    assert_eq!(
        f.store
            .end_turn(&session.id, 5, ending(TurnStatus::Canceled, None))
            .await
            .expect("end"),
        SessionPhase::Canceling
    );
    let illegal = f
        .store
        .end_turn(&session.id, 5, ending(TurnStatus::Accepted, None))
        .await;
    assert!(
        matches!(illegal, Err(StoreError::IllegalTransition { .. })),
        "{illegal:?}"
    );

    let page = f.store.events_after(Some(ws), start, 100).await.expect("events");
    assert_eq!(
        said(&page),
        [
            "session provisioning",
            "turn 1 running",
            "turn 1 failed",
            "session failed",
            "session queued",
            "turn 2 accepted",
            "session running",
            "turn 2 running",
            "turn 3 accepted",
            "turn 2 completed",
            "session delivering",
            "session queued",
            "session running",
            "turn 3 running",
            "session delivering",
            "turn 3 stopped",
            "session idle",
            "session queued",
            "turn 4 accepted",
            "session running",
            "turn 4 running",
            "turn 4 failed",
            "session delivering",
            "session failed",
            "session queued",
            "turn 5 accepted",
            "session running",
            "turn 5 running",
            "session canceling",
            "turn 5 canceled",
        ]
    );
    let session_failed = &page.events[3];
    assert_eq!(
        session_failed.failure,
        Some((FailureCode::CloneFailed, "no such repository".into()))
    );
}

/// On SQLite, where one connection writes, a request's write waits for at most the worker's write in
/// progress and one more, not for a whole burst of transcript batches queued before it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_sqlite_a_create_is_not_queued_behind_a_burst_of_transcript_writes() {
    let f = fixture(TestBackend::Sqlite).await;
    let session = f
        .store
        .create_session(new_session(&f.workspace.id, "/srv/repo", "task"))
        .await
        .expect("create");
    const BATCHES: u32 = 40;
    let done = Arc::new(std::sync::atomic::AtomicU32::new(0));
    let mut tasks = Vec::new();
    for batch in 0..BATCHES {
        let (store, done, id) = (f.store.clone(), done.clone(), session.id.clone());
        tasks.push(tokio::spawn(async move {
            let parts: Vec<NewPart> = (0..200)
                .map(|i| NewPart {
                    part_index: batch * 200 + i,
                    payload: format!(r#"{{"type":"text-delta","id":"t","delta":"{}"}}"#, "x".repeat(1000)),
                    driver_index: None,
                })
                .collect();
            store.append_parts(&id, 1, &parts).await.expect("append");
            done.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        }));
    }
    // Every batch has asked for the writer by the time the first is through.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while done.load(std::sync::atomic::Ordering::SeqCst) == 0 {
        assert!(std::time::Instant::now() < deadline, "no batch was written");
        tokio::time::sleep(std::time::Duration::from_millis(1)).await;
    }
    let before = done.load(std::sync::atomic::Ordering::SeqCst);
    f.store
        .create_session(new_session(&f.workspace.id, "/srv/repo", "another"))
        .await
        .expect("create");
    let after = done.load(std::sync::atomic::Ordering::SeqCst);
    for task in tasks {
        task.await.expect("batch");
    }
    // The batch in progress and the next are expected; the rest of the margin is for this task being
    // descheduled around the create on a loaded machine. Queued behind the burst it waits for ~38.
    assert!(
        after - before < BATCHES / 4,
        "the create waited for {} of {BATCHES} transcript batches",
        after - before
    );
}
