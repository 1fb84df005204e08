//! `kill -9` of `sortie serve` right after accepted creates loses none of them.

mod support;

use serde_json::{Value, json};
use support::{Server, git_repo};

fn create_then_kill(database_url: Option<&str>) {
    let temp = tempfile::tempdir().expect("temp");
    let data_dir = temp.path().join("data");
    // The embedded install may use local repositories; a shared PostgreSQL one only URLs.
    let repo = match database_url {
        None => git_repo(temp.path(), "repo").to_string_lossy().into_owned(),
        Some(_) => "https://github.com/o/r.git".to_owned(),
    };
    let server = Server::start(temp.path(), &data_dir, database_url);
    let token = std::fs::read_to_string(data_dir.join("admin-token"))
        .expect("token")
        .trim()
        .to_owned();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let accepted: Vec<String> = runtime.block_on(async {
        let client = support::http_client();
        let mut tasks = Vec::new();
        for i in 0..100 {
            let (client, url, token, repo) = (client.clone(), server.url.clone(), token.clone(), repo.clone());
            tasks.push(tokio::spawn(async move {
                let reply = client
                    .post(format!("{url}/v1/sessions"))
                    .bearer_auth(&token)
                    .json(&json!({"repo": repo, "task": format!("task {i}"), "agent": "scripted"}))
                    .send()
                    .await
                    .expect("create");
                assert_eq!(reply.status().as_u16(), 202);
                reply.json::<Value>().await.expect("body")["id"]
                    .as_str()
                    .expect("id")
                    .to_owned()
            }));
        }
        let mut ids = Vec::new();
        for task in tasks {
            ids.push(task.await.expect("join"));
        }
        ids
    });
    // The last 202 has been read: kill at once, with no graceful shutdown.
    server.kill_hard();

    let restarted = Server::start(temp.path(), &data_dir, database_url);
    let listed = restarted.client(temp.path(), &data_dir, &["--json", "ls", "--limit", "200"]);
    assert!(listed.status.success(), "{}", String::from_utf8_lossy(&listed.stderr));
    let listed: Value = serde_json::from_slice(&listed.stdout).expect("json");
    let mut found: Vec<String> = listed["sessions"]
        .as_array()
        .expect("sessions")
        .iter()
        .filter_map(|s| s["id"].as_str().map(str::to_owned))
        .collect();
    let mut expected = accepted;
    found.sort();
    expected.sort();
    assert_eq!(found.len(), 100);
    assert_eq!(found, expected, "every accepted session survived the kill");
}

#[test]
fn a_killed_server_loses_no_accepted_session_on_sqlite() {
    create_then_kill(None);
}

#[test]
fn a_killed_server_loses_no_accepted_session_on_postgres() {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    if !runtime.block_on(sortie_store::testing::postgres_available(
        "a_killed_server_loses_no_accepted_session_on_postgres",
    )) {
        return;
    }
    let database = runtime
        .block_on(sortie_store::testing::TestDatabase::postgres())
        .expect("postgres database");
    create_then_kill(Some(&database.url));
}
