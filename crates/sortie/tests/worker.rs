//! The whole session end to end (DESIGN §2): a real `sortie serve` with every role, real sandboxes, the
//! real driver and scripted agent, real git against a real bare repository. Each test owns its server,
//! directories and database.

mod support;

use std::collections::HashSet;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use support::world::{World, cgroup_has_processes, driver_pid, live_sandboxes, rev};
use support::{Server, git, sortie};

fn status_of(turns: &[Value], n: usize) -> &str {
    turns[n - 1]["status"].as_str().unwrap_or("")
}

fn code_of(value: &Value) -> &str {
    value["failure"]["code"].as_str().unwrap_or("")
}

async fn run_delivers_the_branch_and_the_transcript_is_what_a_live_client_saw(
    database: Option<&sortie_store::testing::TestDatabase>,
) {
    let world = World::start_on(&[], database);
    let script = "#!scripted\nplan: Write it | Check it\nthink: starting\nsay: working on it\nsleep: 400\nwrite: notes/hello.txt\nhello from the agent\n>>>\ndone: 1\nrun: cat notes/hello.txt\nsay: all done";
    let id = if database.is_none() {
        // The CLI, as a user would.
        let created = world.server.as_ref().expect("server").client(
            &world.root,
            &world.data_dir,
            &[
                "run",
                "--repo",
                world.upstream.to_str().expect("utf-8"),
                "--agent",
                "scripted",
                script,
            ],
        );
        assert!(created.status.success(), "{}", String::from_utf8_lossy(&created.stderr));
        String::from_utf8_lossy(&created.stdout)
            .split_whitespace()
            .next()
            .expect("id")
            .to_owned()
    } else {
        world.create(script, json!({})).await
    };
    // Attached at once: the stream waits for the turn, then follows it live to the end.
    let live = world.attach(&id, None).await;
    let (session, turns) = world.settled(&id, 1).await;
    assert_eq!(session["phase"], "idle", "{session:#}");
    assert_eq!(status_of(&turns, 1), "completed", "{turns:#?}");

    let head = world.branch(&id).expect("the branch was pushed");
    assert_eq!(session["head_sha"].as_str(), Some(head.as_str()));
    assert_eq!(turns[0]["head_sha"].as_str(), Some(head.as_str()));
    assert_eq!(world.files_on_branch(&id), vec!["notes/hello.txt".to_owned()]);
    assert_eq!(world.commits_on_branch(&id), 1);
    let content = git(&world.upstream, &["show", &format!("{head}:notes/hello.txt")]);
    assert_eq!(content, "hello from the agent");

    // What the live client saw is what the store kept.
    assert_eq!(live.first().map(|c| c["type"].clone()), Some(json!("start")));
    assert_eq!(live.last().map(|c| c["type"].clone()), Some(json!("finish")));
    let messages = world.messages(&id).await;
    let assistant = messages
        .iter()
        .find(|m| m["role"] == "assistant")
        .expect("an assistant message");
    let seen = sortie_protocol::ui::assemble_parts(live.iter());
    assert_eq!(
        assistant["parts"],
        Value::Array(seen),
        "stored transcript = live stream"
    );
    let replay = world.attach(&id, Some(1)).await;
    assert_eq!(replay, live, "a replay of the finished turn is the same stream");
    let kinds: HashSet<String> = live
        .iter()
        .filter_map(|c| c["type"].as_str().map(ToOwned::to_owned))
        .collect();
    for kind in [
        "data-sortie-delivery",
        "data-sortie-phase",
        "tool-input-available",
        "reasoning-delta",
        "text-delta",
    ] {
        assert!(kinds.contains(kind), "{kind} in {kinds:?}");
    }
    let delivery = live
        .iter()
        .rev()
        .find(|c| c["type"] == "data-sortie-delivery")
        .expect("delivery part");
    assert_eq!(delivery["data"]["headSha"].as_str(), Some(head.as_str()), "{delivery}");
    // The first delivery is counted from the commit the session started at, as git counts it.
    let shortstat = git(&world.upstream, &["diff", "--shortstat", "refs/heads/main", &head]);
    assert_eq!(
        delivery["data"]["diffStat"],
        json!({"files": 1, "insertions": 1, "deletions": 0}),
        "git says {shortstat}"
    );
    // The branch's diff was stored at delivery, on either database.
    let (status, diff) = world
        .call(reqwest::Method::GET, &format!("/v1/sessions/{id}/diff"), None)
        .await;
    assert_eq!(status, 200, "{diff:#}");
    assert_eq!(diff["files"][0]["path"], "notes/hello.txt", "{diff:#}");
    assert_eq!(
        (&diff["files_changed"], &diff["files"][0]["status"]),
        (&json!(1), &json!("added"))
    );
    // Every phase is timed by the host, on the turn body and in the phase part the live client saw last.
    let timings = turns[0]["timings"].as_object().expect("timings");
    let phases = [
        "queued",
        "clone",
        "sandbox",
        "setup",
        "first_part",
        "agent_turn",
        "delivery",
    ];
    let phase_part = live
        .iter()
        .rev()
        .find(|c| c["type"] == "data-sortie-phase")
        .expect("phase part");
    assert_eq!(phase_part["data"]["phase"], "done", "{phase_part}");
    for phase in phases {
        assert!(timings[phase].is_u64(), "{phase} in {timings:?}");
        assert_eq!(
            phase_part["data"]["timings"][phase], timings[phase],
            "{phase} in {phase_part}"
        );
    }

    // `sortie show` says idle with the head (on PostgreSQL with the workspace's own token).
    let shown = sortie(&world.root)
        .args(["--server", &world.url(), "--data-dir"])
        .arg(&world.data_dir)
        .args(["show", &id])
        .env("SORTIE_TOKEN", &world.token)
        .output()
        .expect("sortie show");
    let text = String::from_utf8_lossy(&shown.stdout);
    assert!(
        text.contains("idle") && text.contains(&head),
        "{text}{}",
        String::from_utf8_lossy(&shown.stderr)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_delivers_the_branch_on_sqlite() {
    run_delivers_the_branch_and_the_transcript_is_what_a_live_client_saw(None).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_delivers_the_branch_on_postgres() {
    if !sortie_store::testing::postgres_available("run_delivers_the_branch_on_postgres").await {
        return;
    }
    let database = sortie_store::testing::TestDatabase::postgres().await.expect("postgres");
    run_delivers_the_branch_and_the_transcript_is_what_a_live_client_saw(Some(&database)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn steer_interrupt_stop_and_cancel() {
    let world = World::start(&[]);
    let id = world.create("#!scripted\nwrite: a.txt\na\n>>>", json!({})).await;
    let (_, turns) = world.settled(&id, 1).await;
    let first = turns[0]["head_sha"].as_str().expect("head").to_owned();

    // A steer on the idle session: a second commit on the same branch, on the same sandbox.
    let driver_before = driver_pid(&id).expect("the warm sandbox's driver");
    world.steer(&id, "#!scripted\nwrite: b.txt\nb\n>>>", "queue").await;
    let (session, turns) = world.settled(&id, 2).await;
    assert_eq!(
        driver_pid(&id),
        Some(driver_before),
        "the steer ran in the same sandbox"
    );
    assert_eq!(status_of(&turns, 2), "completed", "{turns:#?}");
    assert_eq!(world.commits_on_branch(&id), 2);
    let second = world.branch(&id).expect("branch");
    assert_eq!(session["head_sha"].as_str(), Some(second.as_str()));
    assert_eq!(git(&world.upstream, &["rev-parse", &format!("{second}^")]), first);

    // Files changed: the branch against the commit the session started from, every turn so far, as
    // git lists it; the last delivery card counts the same diff.
    let (status, diff) = world
        .call(reqwest::Method::GET, &format!("/v1/sessions/{id}/diff"), None)
        .await;
    assert_eq!(status, 200, "{diff:#}");
    let listed: Vec<String> = diff["files"]
        .as_array()
        .expect("files")
        .iter()
        .map(|f| {
            format!(
                "{}\t{}",
                &f["status"].as_str().unwrap_or("?")[..1].to_uppercase(),
                f["path"].as_str().unwrap_or("?")
            )
        })
        .collect();
    let git_says = git(
        &world.upstream,
        &["diff", "--name-status", "--no-renames", &format!("main...{second}")],
    );
    assert_eq!(listed.join("\n"), git_says, "{diff:#}");
    assert_eq!(diff["head_sha"].as_str(), Some(second.as_str()));
    assert_eq!(diff["files_changed"], 2);
    assert!(
        diff["files"][1]["patch"]
            .as_str()
            .is_some_and(|p| p.starts_with("diff --git a/b.txt b/b.txt") && p.ends_with("+b\n")),
        "{diff:#}"
    );
    let messages = world.messages(&id).await;
    let last_card = messages
        .iter()
        .flat_map(|m| m["parts"].as_array().cloned().unwrap_or_default())
        .rfind(|p| p["type"] == "data-sortie-delivery")
        .expect("a delivery card");
    assert_eq!(
        last_card["data"]["diffStat"]["files"], diff["files_changed"],
        "{last_card:#}"
    );
    let (status, page) = world
        .call(
            reqwest::Method::GET,
            &format!("/v1/sessions/{id}/diff?offset=1&limit=1"),
            None,
        )
        .await;
    assert_eq!(
        (status, page["files"][0]["path"].as_str(), &page["next_offset"]),
        (200, Some("b.txt"), &Value::Null)
    );
    let (status, refused) = world
        .call(reqwest::Method::GET, &format!("/v1/sessions/{id}/diff?limit=0"), None)
        .await;
    assert_eq!(
        (status, refused["error"]["code"].as_str()),
        (400, Some("INVALID_REQUEST"))
    );

    // An interrupt during a long sleep cancels it and runs the new prompt.
    world
        .steer(&id, "#!scripted\nsay: waiting\nsleep: 60000\nsay: never", "queue")
        .await;
    world
        .wait(&id, 30, |s, t| {
            t.len() == 3 && status_of(t, 3) == "running" && s["phase"] == "running"
        })
        .await;
    world.wait_said(&id, "waiting").await;
    world.steer(&id, "#!scripted\nwrite: c.txt\nc\n>>>", "interrupt").await;
    let (_, turns) = world.settled(&id, 4).await;
    assert_eq!(status_of(&turns, 3), "stopped", "{turns:#?}");
    assert_eq!(status_of(&turns, 4), "completed", "{turns:#?}");
    assert!(world.files_on_branch(&id).contains(&"c.txt".to_owned()));
    // The interrupted turn was cut short (its sleep was a minute) and never got to its last line.
    let ran_ms = turns[2]["timings"]["agent_turn"].as_u64().expect("agent_turn timing");
    assert!(ran_ms < 30_000, "the interrupted turn ran on: {:#}", turns[2]);
    assert!(
        !world.assistant_said(&id, "never").await,
        "the interrupted turn went on"
    );

    // Stop mid-run pushes the work so far.
    world
        .steer(
            &id,
            "#!scripted\nwrite: d.txt\nd\n>>>\nsay: written d\nsleep: 60000",
            "queue",
        )
        .await;
    world
        .wait(&id, 30, |_, t| t.len() == 5 && status_of(t, 5) == "running")
        .await;
    world.wait_said(&id, "written d").await;
    world.post(&id, "stop").await;
    let (session, turns) = world.settled(&id, 5).await;
    assert_eq!(session["phase"], "idle");
    assert_eq!(status_of(&turns, 5), "stopped", "{turns:#?}");
    assert!(
        world.files_on_branch(&id).contains(&"d.txt".to_owned()),
        "stopped work is pushed"
    );

    // Cancel: stop, deliver, no sandbox process left, the session is over.
    world
        .steer(
            &id,
            "#!scripted\nwrite: e.txt\ne\n>>>\nsay: written e\nsleep: 60000",
            "queue",
        )
        .await;
    world.wait_said(&id, "written e").await;
    let (_, answer) = world
        .call(reqwest::Method::POST, &format!("/v1/sessions/{id}/cancel"), None)
        .await;
    assert_eq!(
        answer["phase"], "canceling",
        "a turn in flight is canceled by its worker: {answer:#}"
    );
    let (session, turns) = world.settled(&id, 6).await;
    assert_eq!(session["phase"], "canceled");
    // `canceled` is said after the delivery and the teardown: no wait from here.
    assert!(
        !live_sandboxes().contains(&id) && !cgroup_has_processes(&id),
        "the sandbox of a session that reads canceled still runs"
    );
    assert_eq!(status_of(&turns, 6), "canceled", "{turns:#?}");
    let delivered: Vec<Value> = world
        .messages(&id)
        .await
        .iter()
        .flat_map(|m| m["parts"].as_array().cloned().unwrap_or_default())
        .filter(|p| p["type"] == "data-sortie-delivery")
        .collect();
    assert!(
        world.files_on_branch(&id).contains(&"e.txt".to_owned()),
        "canceled work is pushed: {turns:#?} {delivered:#?}"
    );
    let gone = Instant::now() + Duration::from_secs(10);
    while live_sandboxes().contains(&id) || cgroup_has_processes(&id) {
        assert!(
            Instant::now() < gone,
            "a process of the canceled session's sandbox still runs"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hibernated_session_is_primed_when_steered() {
    let world = World::start(&["--idle-grace", "1"]);
    let id = world
        .create("#!scripted\nwrite: a.txt\na\n>>>\nsay: first turn done", json!({}))
        .await;
    world.settled(&id, 1).await;
    world.wait(&id, 30, |s, _| s["phase"] == "hibernated").await;
    let gone = Instant::now() + Duration::from_secs(10);
    while live_sandboxes().contains(&id) {
        assert!(Instant::now() < gone, "a hibernated session keeps no sandbox");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    world.steer(&id, "#!scripted\nwrite: b.txt\nb\n>>>", "queue").await;
    let (session, turns) = world.settled(&id, 2).await;
    assert_eq!(status_of(&turns, 2), "completed", "{turns:#?}");
    assert_eq!(turns[1]["priming"], "session_load", "{turns:#?}");
    assert_eq!(world.commits_on_branch(&id), 2, "{session:#}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_turn_is_metered_when_it_ends_not_when_its_sandbox_goes() {
    // A long idle grace: what is read must come from the turn's end, the sandbox stays warm.
    let world = World::start(&["--idle-grace", "600"]);
    // 1.5 s of CPU whatever the machine's speed, and 96 MiB written (so resident, not just mapped).
    let burn =
        "run: python3 -c 'exec(\"import time\\nb = b\\\"x\\\" * (96 << 20)\\nwhile time.process_time() < 1.5: pass\")'";
    let id = world.create(&format!("#!scripted\n{burn}"), json!({})).await;
    let (session, turns) = world.settled(&id, 1).await;
    assert_eq!(status_of(&turns, 1), "completed", "{turns:#?}");
    assert_eq!(session["phase"], "idle", "{session:#}");
    assert!(live_sandboxes().contains(&id), "the sandbox is still warm");
    let usage = &turns[0]["usage"];
    assert!(usage["cpu_ms"].as_u64().unwrap_or(0) >= 1_000, "{usage:#}");
    assert!(
        usage["peak_memory_bytes"].as_u64().unwrap_or(0) >= 96 << 20,
        "{usage:#}"
    );
    assert!(usage["wall_ms"].as_u64().unwrap_or(0) >= 1_000, "{usage:#}");
    assert!(
        session["usage"]["compute_seconds"].as_u64().unwrap_or(0) >= 1,
        "{session:#}"
    );
    assert!(
        session["usage"]["peak_memory_bytes"].as_u64().unwrap_or(0) >= 96 << 20,
        "{session:#}"
    );
    // A second turn is metered for what it used, not the sandbox's total again.
    world.steer(&id, "#!scripted\nsay: nothing to burn", "queue").await;
    let (session, turns) = world.settled(&id, 2).await;
    assert!(
        turns[1]["usage"]["cpu_ms"].as_u64().unwrap_or(u64::MAX) < 1_000,
        "{turns:#?}"
    );
    assert!(
        session["usage"]["compute_seconds"].as_u64().unwrap_or(0) < 4,
        "{session:#}"
    );
}

/// The `sortie git-launch` processes waiting in session `id`'s git cgroup.
fn parked_git_launchers(id: &str) -> Vec<u32> {
    let cgroup = format!("/{id}.git");
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|entry| {
            let pid = entry.file_name().to_str()?.parse::<u32>().ok()?;
            let cmdline = std::fs::read(entry.path().join("cmdline")).ok()?;
            let launcher = cmdline.split(|b| *b == 0).nth(1) == Some(&b"git-launch"[..]);
            let groups = std::fs::read_to_string(entry.path().join("cgroup")).ok()?;
            (launcher && groups.lines().any(|line| line.ends_with(&cgroup))).then_some(pid)
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_running_turns_git_launcher_waits_in_the_sessions_cgroup_and_a_resting_session_holds_none() {
    let world = World::start(&["--idle-grace", "600"]);
    let id = world
        .create(
            "#!scripted\nsay: thinking\nsleep: 4000\nwrite: parked.txt\nx\n>>>\nsay: done",
            json!({}),
        )
        .await;
    // While the agent thinks, three launchers are parked in the session's git cgroup, ahead of the
    // push's children in a row, and never more.
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut parked = Vec::new();
    while parked.len() < 3 && Instant::now() < deadline {
        parked = parked_git_launchers(&id);
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Not a wait for anything: a while in which a fourth would show, were the bound not kept.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let parked = parked_git_launchers(&id);
    assert_eq!(
        parked.len(),
        3,
        "three launchers parked while the turn runs: {parked:?}"
    );
    let (session, turns) = world.settled(&id, 1).await;
    assert_eq!(status_of(&turns, 1), "completed", "{turns:#?}");
    assert_eq!(session["phase"], "idle", "{session:#}");
    // The push went through launchers: the branch is there, and git children started from them.
    assert_eq!(world.files_on_branch(&id), vec!["parked.txt".to_owned()]);
    let metrics = scrape(&format!("{}/metrics", world.url())).await;
    let from_launchers = sample(&metrics, "sortie_git_children_total{start=\"parked\"}").unwrap_or(0.0);
    assert!(from_launchers >= 1.0, "{metrics}");
    // The session rests (its sandbox warm): it holds no launcher.
    let deadline = Instant::now() + Duration::from_secs(10);
    while !parked_git_launchers(&id).is_empty() && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(
        parked_git_launchers(&id),
        Vec::<u32>::new(),
        "an idle session parks nothing"
    );
    assert!(live_sandboxes().contains(&id), "the sandbox is still warm");
}

/// The index the driver refreshes beside the agent (`sortie_driver::refresh`) loses no edit: the agent
/// rewrites a file at its own size at once, most often within the checkout's second, then thinks long
/// enough for the refresh to be put in place at delivery; the edit is delivered all the same. (Here
/// the checkout's owner differs from the agent's view of it, so the copy's refresh reads every file;
/// where the agent's own uid checked out, in a pod, the copy keeping the index's time is what catches
/// such an edit: the driver's unit test covers that case.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_edit_at_the_same_size_in_the_checkouts_second_is_delivered() {
    let world = World::start(&[]);
    let id = world
        .create(
            "#!scripted\nwrite: README.md\nHELLO\n>>>\nsleep: 2500\nsay: done",
            json!({}),
        )
        .await;
    let (_, turns) = world.settled(&id, 1).await;
    assert_eq!(status_of(&turns, 1), "completed", "{turns:#?}");
    assert_eq!(world.files_on_branch(&id), vec!["README.md".to_owned()]);
    let delivered = git(&world.upstream, &["show", &format!("refs/heads/sortie/{id}:README.md")]);
    assert_eq!(delivered, "HELLO");
}

/// The disks primed ahead for the session's repository (`<work>/spares/primed/*.img`), by name.
fn primed_disks(world: &World) -> Vec<String> {
    let dir = world.data_dir.join("work/spares/primed");
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .map(|entries| {
            entries
                .flatten()
                .map(|entry| entry.file_name().to_string_lossy().into_owned())
                .filter(|name| name.ends_with(".img"))
                .collect()
        })
        .unwrap_or_default();
    names.sort();
    names
}

/// Waits until a primed disk other than any of `before` is there; its name.
async fn primed_anew(world: &World, before: &[String]) -> String {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if let Some(name) = primed_disks(world).into_iter().find(|name| !before.contains(name)) {
            return name;
        }
        assert!(
            Instant::now() < deadline,
            "no workspace was checked out ahead: {:?}",
            primed_disks(world)
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A session leaves the next session of its repository a workspace checked out ahead on a disk of its
/// own: that session adopts it (its clone phase is `primed_clone`) and works on its own branch from
/// the same start. After a push upstream, the disk primed before it is still taken, and the adoption
/// brings it to the refs the session's fetch brought: the branch starts at the new commit, and the
/// workspace's remote branches are the repository's now (the branches delivered since among them).
/// (Sessions' deliveries alone do not make a session fetch: it starts from none of them.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_next_session_of_a_repository_adopts_a_checkout_made_ahead_at_the_refs_it_fetched() {
    let world = World::start(&[]);
    let run = |task: String| {
        let world = &world;
        async move {
            let id = world.create(&task, json!({})).await;
            let (session, turns) = world.settled(&id, 1).await;
            assert_eq!(status_of(&turns, 1), "completed", "{session:#} {turns:#?}");
            assert_eq!(world.commits_on_branch(&id), 1, "from main as it is");
            (id, turns[0]["timings"].clone())
        }
    };
    let task = |i: usize| format!("#!scripted\nwrite: f{i}.txt\n{i}\n>>>\nsay: wrote {i}");
    let (first_id, first) = run(task(0)).await;
    assert!(first["clone"].is_u64(), "{first:#}");
    assert_eq!(world.files_on_branch(&first_id), ["f0.txt"]);
    let primed = primed_anew(&world, &[]).await;

    let (second_id, second) = run(task(1)).await;
    assert!(second["primed_clone"].is_u64(), "{second:#}");
    assert!(second.get("clone").is_none(), "{second:#}");
    assert_eq!(world.files_on_branch(&second_id), ["f1.txt"]);
    assert!(
        !primed_disks(&world).contains(&primed),
        "a primed disk serves one session"
    );
    primed_anew(&world, &[primed]).await;

    // Someone pushes to main: the disk primed before is at an older main.
    let pusher = world.clone_upstream("pusher");
    std::fs::write(pusher.join("pushed.txt"), "pushed\n").expect("write");
    git(&pusher, &["add", "."]);
    git(
        &pusher,
        &[
            "-c",
            "user.name=p",
            "-c",
            "user.email=p@example.com",
            "commit",
            "-q",
            "-m",
            "pushed",
        ],
    );
    git(&pusher, &["push", "-q", "origin", "HEAD:refs/heads/main"]);
    let main = rev(&world.upstream, "refs/heads/main").expect("main");
    let (third_id, third) = run(
        "#!scripted\nrun: git rev-parse refs/remotes/origin/main > origin-main.txt && \
         git for-each-ref --format='%(refname)' refs/remotes/origin > remotes.txt\nsay: looked"
            .to_owned(),
    )
    .await;
    assert!(third["primed_clone"].is_u64(), "{third:#}");
    assert_eq!(world.files_on_branch(&third_id), ["origin-main.txt", "remotes.txt"]);
    let shown = |file: &str| {
        git(
            &world.upstream,
            &["show", &format!("refs/heads/sortie/{third_id}:{file}")],
        )
    };
    assert_eq!(shown("origin-main.txt"), main);
    let remotes = shown("remotes.txt");
    for id in [&first_id, &second_id] {
        assert!(
            remotes
                .lines()
                .any(|line| line == format!("refs/remotes/origin/sortie/{id}")),
            "{id} missing from:\n{remotes}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gc_frees_what_ended_sessions_left_and_keeps_the_idle_ones() {
    // `sortie gc` runs beside the live server on the same data dir, as an operator would run it.
    let world = World::start(&[]);
    let idle = world
        .create("#!scripted\nwrite: kept.txt\nkept\n>>>\nsay: still here", json!({}))
        .await;
    let ended = world
        .create(
            "#!scripted\nwrite: gone.txt\ngone\n>>>\nsay: started\nsleep: 60000",
            json!({}),
        )
        .await;
    world.settled(&idle, 1).await;
    world.wait_said(&ended, "started").await;
    world.post(&ended, "cancel").await;
    world.wait(&ended, 60, |s, _| s["phase"] == "canceled").await;
    let sessions_dir = world.data_dir.join("work/sessions");
    // The canceled session's sandbox is torn down before gc may take it (gc skips a held sandbox).
    let deadline = Instant::now() + Duration::from_secs(30);
    while live_sandboxes().contains(&ended) {
        assert!(Instant::now() < deadline, "the canceled session's sandbox went");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(sessions_dir.join(&ended).is_dir() && sessions_dir.join(&idle).is_dir());
    let gc = |args: &[&str]| {
        let output = sortie(&world.root)
            .arg("--data-dir")
            .arg(&world.data_dir)
            .arg("--json")
            .arg("gc")
            .args(args)
            .output()
            .expect("gc");
        assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
        serde_json::from_slice::<Value>(&output.stdout).expect("json")
    };
    // Dry: says what it would free, frees nothing.
    let dry = gc(&["--older-than", "0s", "--dry-run"]);
    let named: Vec<&str> = dry["sessions"]
        .as_array()
        .expect("sessions")
        .iter()
        .filter_map(|s| s["id"].as_str())
        .collect();
    assert!(
        named.contains(&ended.as_str()) && !named.contains(&idle.as_str()),
        "{dry:#}"
    );
    assert!(sessions_dir.join(&ended).is_dir(), "a dry run removes nothing");
    assert!(world.assistant_said(&ended, "started").await);
    // A month's age spares what ended a minute ago.
    let month = gc(&["--older-than", "30d"]);
    assert_eq!(month["sessions"], json!([]), "{month:#}");

    let freed = gc(&["--older-than", "0s"]);
    let pruned = freed["sessions"]
        .as_array()
        .expect("sessions")
        .iter()
        .find(|s| s["id"] == ended.as_str())
        .cloned()
        .expect("the canceled session was pruned");
    assert!(
        pruned["parts"].as_u64().unwrap_or(0) > 0 && pruned["disk_bytes"].as_u64().unwrap_or(0) > 0,
        "{freed:#}"
    );
    assert!(freed["freed_bytes"].as_u64().unwrap_or(0) > 0, "{freed:#}");
    assert_eq!(
        freed["mirrors"],
        json!([]),
        "the idle session's workspace borrows its mirror"
    );
    assert!(!sessions_dir.join(&ended).exists(), "its directories are gone");
    assert!(!world.assistant_said(&ended, "started").await, "its transcript is gone");
    let asked: Vec<Value> = world.messages(&ended).await;
    assert!(
        asked.iter().all(|m| m["role"] == "user"),
        "only the prompts stay, with the turns: {asked:#?}"
    );
    let session = world.session(&ended).await;
    assert!(session["pruned_at"].is_string(), "{session:#}");
    assert_eq!(session["phase"], "canceled");

    // The idle session keeps everything; the list still answers with both.
    assert!(sessions_dir.join(&idle).is_dir());
    assert!(world.assistant_said(&idle, "still here").await);
    assert!(world.session(&idle).await["pruned_at"].is_null());
    let (status, list) = world.call(reqwest::Method::GET, "/v1/sessions", None).await;
    assert_eq!(status, 200);
    assert_eq!(list["sessions"].as_array().map(Vec::len), Some(2), "{list:#}");
    // And a steer of the idle session still runs on its workspace.
    world.steer(&idle, "#!scripted\nrun: cat kept.txt", "queue").await;
    let (_, turns) = world.settled(&idle, 2).await;
    assert_eq!(status_of(&turns, 2), "completed", "{turns:#?}");
}

/// The newest `data-sortie-budget` part of the session's transcript as stored.
async fn budget_part(world: &World, id: &str) -> Option<Value> {
    world
        .messages(id)
        .await
        .iter()
        .flat_map(|m| m["parts"].as_array().cloned().unwrap_or_default())
        .rfind(|p| p["type"] == "data-sortie-budget")
        .map(|p| p["data"].clone())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_token_budget_holds_the_agent_until_raised_or_ends_the_turn_with_its_work() {
    use sortie_testkit::{FakeVendor, FakeVendorOptions, VendorKind};
    // Every answer of the fake vendor reports 250 tokens: a 500-token budget lets two requests go.
    let mut options = FakeVendorOptions::new(VendorKind::Anthropic);
    options.input_tokens = 200;
    options.output_tokens = 50;
    let fake = FakeVendor::start_with(VendorKind::Anthropic, options)
        .await
        .expect("fake vendor");
    let world = World::start(&["--upstream-anthropic", &fake.url, "--budget-wait", "8"]);
    let (status, key) = world
        .call(
            reqwest::Method::PUT,
            "/v1/model-keys/anthropic",
            Some(json!({"key": "sk-ant-budget-0000000000000000000000"})),
        )
        .await;
    assert_eq!(status, 200, "{key}");
    // The scripted agent calls the model proxy as an agent does (its HTTP, on the sandbox's relay).
    let call = "run: curl --noproxy '*' -sS -o /dev/null -w 'model %{http_code}\\n' \
                http://127.0.0.1:3128/_sortie/model/anthropic/v1/messages -H 'content-type: application/json' \
                -H 'anthropic-version: 2023-06-01' \
                -d '{\"model\":\"claude-x\",\"max_tokens\":16,\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}]}'";
    let script = format!(
        "#!scripted\nwrite: before.txt\nbefore\n>>>\n{call}\n{call}\n{call}\nwrite: after.txt\nafter\n>>>\nsay: done"
    );

    let raised = world.create(&script, json!({"budget": {"tokens": 500}})).await;
    let (session, _) = world
        .wait(&raised, 60, |s, _| s["budget"]["paused_at"].is_string())
        .await;
    assert_eq!(session["phase"], "running", "{session:#}");
    assert_eq!(session["budget"]["tokens"], 500);
    assert_eq!(fake.requests().len(), 2, "the third request is held, not sent");
    let paused = sortie_testkit::wait::eventually("the budget part", Duration::from_secs(10), || async {
        budget_part(&world, &raised)
            .await
            .filter(|p| p["state"] == "paused")
            .ok_or(())
    })
    .await;
    assert_eq!(
        (&paused["spent"], &paused["limit"]),
        (&json!(500), &json!(500)),
        "{paused:#}"
    );
    assert!(
        paused["how"].as_str().is_some_and(|how| how.contains("sortie budget")),
        "{paused:#}"
    );
    let (status, metrics) = (
        200,
        reqwest::get(format!("{}/metrics", world.url())).await.expect("scrape"),
    );
    assert_eq!(metrics.status(), status);
    assert!(
        metrics
            .text()
            .await
            .expect("text")
            .contains("sortie_budget_pauses_total 1")
    );
    assert_eq!(fake.requests().len(), 2, "still held");
    let (status, after) = world
        .call(
            reqwest::Method::POST,
            &format!("/v1/sessions/{raised}/budget"),
            Some(json!({"tokens": 1000})),
        )
        .await;
    assert_eq!(status, 200, "{after}");
    assert_eq!(after["budget"]["tokens"], 1500);
    let (session, turns) = world.settled(&raised, 1).await;
    assert_eq!(status_of(&turns, 1), "completed", "{turns:#?}");
    assert!(session["budget"]["paused_at"].is_null(), "{session:#}");
    assert_eq!(fake.requests().len(), 3, "the held request went once raised");
    assert_eq!(
        world.files_on_branch(&raised),
        vec!["after.txt".to_owned(), "before.txt".to_owned()]
    );
    assert_eq!(budget_part(&world, &raised).await.expect("part")["state"], "raised");

    // Nobody raises it: past the wait the turn ends BUDGET_EXCEEDED, what it did delivered.
    let ended = world.create(&script, json!({"budget": {"tokens": 500}})).await;
    let (session, turns) = world.settled(&ended, 1).await;
    assert_eq!(status_of(&turns, 1), "failed", "{turns:#?}");
    assert_eq!(code_of(&session), "BUDGET_EXCEEDED", "{session:#}");
    assert_eq!(fake.requests().len(), 5, "two more, never the held one");
    assert_eq!(world.files_on_branch(&ended), vec!["before.txt".to_owned()]);
    assert_eq!(budget_part(&world, &ended).await.expect("part")["state"], "exceeded");
    assert!(session["budget"]["paused_at"].is_null(), "{session:#}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_compute_budget_stops_the_turn_at_the_cap_with_its_work() {
    let world = World::start(&[]);
    let burn = "run: python3 -c 'exec(\"import time\\nwhile time.process_time() < 30: pass\")'";
    let id = world
        .create(
            &format!("#!scripted\nwrite: started.txt\nstarted\n>>>\n{burn}\nwrite: never.txt\nnever\n>>>"),
            json!({"budget": {"compute_seconds": 1}}),
        )
        .await;
    let (session, turns) = world.settled(&id, 1).await;
    assert_eq!(code_of(&session), "BUDGET_EXCEEDED", "{session:#}");
    assert!(turns[0]["usage"]["cpu_ms"].as_u64().unwrap_or(0) >= 1_000, "{turns:#?}");
    // Well short of the 30 s the agent wanted.
    assert!(
        turns[0]["usage"]["wall_ms"].as_u64().unwrap_or(u64::MAX) < 20_000,
        "{turns:#?}"
    );
    assert_eq!(world.files_on_branch(&id), vec!["started.txt".to_owned()]);
    let part = budget_part(&world, &id).await.expect("a budget part");
    assert_eq!(
        (&part["state"], &part["kind"]),
        (&json!("exceeded"), &json!("compute_seconds"))
    );
}

/// The value of the one sample of `series` (name and labels exactly as rendered), if it is there.
fn sample(metrics: &str, series: &str) -> Option<f64> {
    metrics
        .lines()
        .find_map(|line| line.strip_prefix(series)?.strip_prefix(' ')?.trim().parse().ok())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_count_each_turns_outcome_and_time_its_phases() {
    let world = World::start(&[]);
    let completed = world.create("#!scripted\nsay: done", json!({})).await;
    let failed = world.create("#!scripted\nfail: on purpose", json!({})).await;
    let canceled = world.create("#!scripted\nsay: started\nsleep: 60000", json!({})).await;
    world.settled(&completed, 1).await;
    world.settled(&failed, 1).await;
    world.wait_said(&canceled, "started").await;
    world.post(&canceled, "cancel").await;
    let (_, turns) = world.settled(&canceled, 1).await;
    assert_eq!(status_of(&turns, 1), "canceled", "{turns:#?}");

    let scrape = || async {
        let response = reqwest::get(format!("{}/metrics", world.url())).await.expect("scrape");
        assert_eq!(response.status(), 200);
        response.text().await.expect("text")
    };
    let metrics = scrape().await;
    for outcome in ["completed", "failed", "canceled"] {
        let counted = format!("sortie_turns_total{{outcome=\"{outcome}\"}}");
        assert_eq!(sample(&metrics, &counted), Some(1.0), "{counted}\n{metrics}");
        let timed = format!("sortie_turn_duration_seconds_count{{outcome=\"{outcome}\"}}");
        assert_eq!(sample(&metrics, &timed), Some(1.0), "{timed}\n{metrics}");
        let bucket = format!("sortie_turn_duration_seconds_bucket{{outcome=\"{outcome}\",le=\"+Inf\"}}");
        assert_eq!(
            sample(&metrics, &bucket),
            Some(1.0),
            "a histogram, not a summary: {metrics}"
        );
    }
    for phase in ["queued", "clone", "sandbox", "setup", "total"] {
        let timed = format!("sortie_provision_seconds_count{{phase=\"{phase}\"}}");
        assert_eq!(sample(&metrics, &timed), Some(3.0), "{timed}\n{metrics}");
    }
    assert_eq!(sample(&metrics, "sortie_turns_queued"), Some(0.0), "{metrics}");
    assert_eq!(sample(&metrics, "sortie_budget_pauses_total"), Some(0.0), "{metrics}");
    // The gauge follows the worker's own sandboxes: the completed session's stays warm, the canceled
    // one's goes at once.
    let ours = [&completed, &failed, &canceled];
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let live = live_sandboxes();
        let expected = ours.iter().filter(|id| live.contains(id.as_str())).count() as f64;
        let reported = sample(&scrape().await, "sortie_sandboxes_live");
        if reported == Some(expected) && live.contains(completed.as_str()) && !live.contains(canceled.as_str()) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "sortie_sandboxes_live {reported:?}, {expected} live"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // With the worker busy, an accepted turn is counted while it waits: a steer behind a running one.
    world
        .steer(&completed, "#!scripted\nsay: busy\nsleep: 60000", "queue")
        .await;
    world.wait_said(&completed, "busy").await;
    world.steer(&completed, "#!scripted\nsay: next", "queue").await;
    assert_eq!(sample(&scrape().await, "sortie_turns_queued"), Some(1.0));
    world.post(&completed, "cancel").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failures_carry_their_codes() {
    let world = World::start(&["--turn-timeout", "3"]);
    let crash = world
        .create("#!scripted\nsay: about to crash\ncrash: 3", json!({}))
        .await;
    let timeout = world.create("#!scripted\nsay: sleeping\nsleep: 60000", json!({})).await;
    let setup = world
        .create(
            "#!scripted\nsay: never runs",
            json!({"setup": "echo preparing; echo the toolchain is broken >&2; exit 3"}),
        )
        .await;
    let secret = world
        .create(
            "#!scripted\nwrite: config.env\nAWS_ACCESS_KEY_ID=AKIAIOSFODNN7EXAMPLE\n>>>",
            json!({}),
        )
        .await;

    let (session, _) = world.settled(&crash, 1).await;
    assert_eq!(session["phase"], "failed");
    assert_eq!(code_of(&session), "AGENT_ERROR", "{session:#}");

    let (session, _) = world.settled(&timeout, 1).await;
    assert_eq!(code_of(&session), "TURN_TIMEOUT", "{session:#}");

    let (session, turns) = world.settled(&setup, 1).await;
    assert_eq!(code_of(&session), "SETUP_FAILED", "{session:#}");
    let reason = session["failure"]["reason"].as_str().unwrap_or("");
    assert!(
        reason.contains("code 3") && reason.contains("the toolchain is broken"),
        "{reason}"
    );
    assert_eq!(status_of(&turns, 1), "failed");

    let (session, _) = world.settled(&secret, 1).await;
    assert_eq!(code_of(&session), "SECRET_DETECTED", "{session:#}");
    assert!(world.branch(&secret).is_none(), "nothing was pushed");
    assert!(
        !session.to_string().contains("AKIAIOSFODNN7EXAMPLE"),
        "the reason never quotes the secret"
    );

    // A model key set while the sandbox is warm is one of the workspace's known secrets at the next
    // delivery: the value matches no common key format, only its digest.
    let known = world
        .create("#!scripted\nwrite: notes.txt\nplain\n>>>", json!({}))
        .await;
    world.settled(&known, 1).await;
    let delivered = world.branch(&known).expect("the first turn is delivered");
    let model_key = "team-model-key-Zq8w3N5r2T7yLm4";
    let (status, body) = world
        .call(
            reqwest::Method::PUT,
            "/v1/model-keys/openai",
            Some(json!({"key": model_key})),
        )
        .await;
    assert_eq!(status, 200, "{body}");
    world
        .steer(
            &known,
            &format!("#!scripted\nwrite: settings.ini\n[model]\nkey={model_key}\n>>>"),
            "queue",
        )
        .await;
    let (session, _) = world.settled(&known, 2).await;
    assert_eq!(code_of(&session), "SECRET_DETECTED", "{session:#}");
    assert_eq!(world.branch(&known), Some(delivered), "the branch is untouched");
    assert!(
        !session.to_string().contains(model_key),
        "the reason never quotes the key"
    );

    // Someone else moves the branch between two turns: the next delivery refuses to overwrite it.
    let moved = world.create("#!scripted\nwrite: a.txt\na\n>>>", json!({})).await;
    world.settled(&moved, 1).await;
    let theirs = world.clone_upstream("theirs");
    git(&theirs, &["checkout", "-q", &format!("sortie/{moved}")]);
    std::fs::write(theirs.join("theirs.txt"), "theirs\n").expect("write");
    git(&theirs, &["add", "."]);
    git(&theirs, &["commit", "-q", "-m", "someone else"]);
    git(
        &theirs,
        &["push", "-q", "origin", &format!("HEAD:refs/heads/sortie/{moved}")],
    );
    let their_head = world.branch(&moved).expect("branch");
    world.steer(&moved, "#!scripted\nwrite: b.txt\nb\n>>>", "queue").await;
    let (session, _) = world.settled(&moved, 2).await;
    assert_eq!(code_of(&session), "PUSH_CONFLICT", "{session:#}");
    assert_eq!(
        world.branch(&moved).as_deref(),
        Some(their_head.as_str()),
        "their work is untouched"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn capacity_limits_live_sandboxes_and_every_session_finishes() {
    let world = World::start(&["--sandboxes-per-workspace", "2"]);
    let mut ids = Vec::new();
    for i in 0..5 {
        ids.push(
            world
                .create(
                    &format!("#!scripted\nsleep: 1500\nwrite: f{i}.txt\n{i}\n>>>"),
                    json!({}),
                )
                .await,
        );
    }
    let watched: HashSet<String> = ids.iter().cloned().collect();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let sampler = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            let mut most = 0;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                // Alive: its driver runs, or anything at all is still in its cgroup.
                let drivers = live_sandboxes();
                let alive = watched
                    .iter()
                    .filter(|id| drivers.contains(*id) || cgroup_has_processes(id))
                    .count();
                most = most.max(alive);
                std::thread::sleep(Duration::from_millis(10));
            }
            most
        })
    };
    // The ones past the limit wait, and say why.
    let deadline = Instant::now() + Duration::from_secs(30);
    'waiting: loop {
        for id in &ids {
            let session = world.session(id).await;
            if session["phase"] == "queued" && session["queued_reason"] == "SANDBOX_CAPACITY_LIMIT" {
                break 'waiting;
            }
        }
        assert!(
            Instant::now() < deadline,
            "no session waited with SANDBOX_CAPACITY_LIMIT"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    for id in &ids {
        let (session, turns) = world
            .wait(id, 120, |s, t| {
                t.first().is_some_and(|t| t["completed_at"].is_string()) && s["phase"] != "queued"
            })
            .await;
        assert_eq!(status_of(&turns, 1), "completed", "{session:#}");
        assert!(world.branch(id).is_some());
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let most = sampler.join().expect("sampler");
    assert!(most <= 2, "{most} sandboxes were alive at once");
    assert!(most >= 1);
}

/// The mounts of the host under `under`: (mount point, device, root within the device), from mountinfo.
fn mounts_under(under: &Path) -> Vec<(PathBuf, String, String)> {
    let text = std::fs::read_to_string("/proc/self/mountinfo").expect("mountinfo");
    text.lines()
        .filter_map(|line| {
            let fields: Vec<&str> = line.split(' ').collect();
            let (device, root, point) = (fields.get(2)?, fields.get(3)?, PathBuf::from(fields.get(4)?));
            point
                .starts_with(under)
                .then(|| (point, (*device).to_owned(), (*root).to_owned()))
        })
        .collect()
}

async fn scrape(metrics_url: &str) -> String {
    reqwest::get(metrics_url)
        .await
        .expect("scrape")
        .text()
        .await
        .expect("text")
}

fn warm_slots(pool: &Path) -> Vec<String> {
    std::fs::read_dir(pool)
        .map(|entries| {
            entries
                .filter_map(Result::ok)
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn warm_sandboxes_each_serve_one_session_and_the_pool_stays_within_the_limit() {
    // More asked than the workspace may hold: the pool holds the limit.
    let mut world = World::start(&["--sandboxes-per-workspace", "2", "--warm-sandboxes", "scripted=4"]);
    let work = world.data_dir.join("work");
    let pool = work.join("pool");
    let gauge = "sortie_warm_sandboxes{agent=\"scripted\"}";
    let metrics_url = format!("{}/metrics", world.url());
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let metrics = scrape(&metrics_url).await;
        if sample(&metrics, gauge) == Some(2.0) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the pool did not fill: {:?}",
            sample(&metrics, gauge)
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(warm_slots(&pool).len(), 2, "{:?}", warm_slots(&pool));

    // Three sessions at once, one past the limit: no warm sandbox is given twice, whatever the order.
    let task = |i: usize| format!("#!scripted\nsleep: 300\nwrite: f{i}.txt\n{i}\n>>>\nsay: wrote {i}");
    let tasks = [task(0), task(1), task(2)];
    let (a, b, c) = tokio::join!(
        world.create(&tasks[0], json!({})),
        world.create(&tasks[1], json!({})),
        world.create(&tasks[2], json!({}))
    );
    let ids = [a, b, c];
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let sampler = {
        let (stop, work) = (stop.clone(), work.clone());
        std::thread::spawn(move || {
            // slot → the sessions whose disk was bound as its workspace (matched by device at the
            // same moment: a loop device is used again once a disk is let go), and the most mounts
            // seen stacked on one slot's workspace at once.
            let mut bound: std::collections::HashMap<String, HashSet<String>> = Default::default();
            let mut most_stacked = 0;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let mounts = mounts_under(&work);
                let disks: std::collections::HashMap<&String, String> = mounts
                    .iter()
                    .filter(|(point, _, root)| point.ends_with("disk") && root == "/")
                    .filter_map(|(point, device, _)| {
                        Some((device, point.parent()?.file_name()?.to_string_lossy().into_owned()))
                    })
                    .collect();
                let mut stacked: std::collections::HashMap<&PathBuf, usize> = Default::default();
                for (point, device, root) in &mounts {
                    if point.ends_with("binds/workspace") {
                        let slot = point.iter().rev().nth(2).expect("slot").to_string_lossy().into_owned();
                        assert_eq!(root, "/workspace", "a slot's workspace is a session's");
                        // A disk seen between two reads of a changing table is looked for again next round.
                        if let Some(session) = disks.get(device) {
                            bound.entry(slot).or_default().insert(session.clone());
                        }
                        *stacked.entry(point).or_default() += 1;
                    }
                }
                most_stacked = most_stacked.max(stacked.values().copied().max().unwrap_or(0));
                std::thread::sleep(Duration::from_millis(5));
            }
            (bound, most_stacked)
        })
    };
    let mut warm = 0;
    for (i, id) in ids.iter().enumerate() {
        let (session, turns) = world
            .wait(id, 120, |s, t| {
                t.first().is_some_and(|t| t["completed_at"].is_string()) && s["phase"] != "queued"
            })
            .await;
        assert_eq!(status_of(&turns, 1), "completed", "{session:#} {turns:#?}");
        assert_eq!(
            world.files_on_branch(id),
            vec![format!("f{i}.txt")],
            "each session's own work"
        );
        assert!(world.assistant_said(id, &format!("wrote {i}")).await);
        if turns[0]["timings"]["warm_sandbox"].is_u64() {
            warm += 1;
            assert!(turns[0]["timings"].get("sandbox").is_none(), "{turns:#?}");
        }
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let (bound, most_stacked) = sampler.join().expect("sampler");
    assert!(
        warm >= 2,
        "the two sessions that found the pool full took from it: {warm} did"
    );
    assert_eq!(most_stacked, 1, "one workspace per warm sandbox");
    assert!(
        bound.values().all(|sessions| sessions.len() == 1),
        "one session per warm sandbox: {bound:?}"
    );
    let mut sessions: Vec<&String> = bound.values().flatten().collect();
    let seen = sessions.len();
    sessions.sort();
    sessions.dedup();
    assert_eq!(sessions.len(), seen, "no session in two warm sandboxes: {bound:?}");
    assert!(sessions.iter().all(|s| ids.contains(*s)), "{bound:?} {ids:?}");
    assert_eq!(bound.len(), warm, "{bound:?}");

    // A server killed outright leaves its sandboxes to their keepers: the next one takes up the
    // sessions' (a steer runs in the same warm sandbox, its egress linked again) and ends the ones no
    // session had.
    // The pool refills behind the sessions (a failed start is tried again in 5 s: polled, not assumed).
    let deadline = Instant::now() + Duration::from_secs(60);
    let unassigned = loop {
        let metrics = scrape(&metrics_url).await;
        let unassigned: Vec<String> = warm_slots(&pool)
            .into_iter()
            .filter(|slot| !bound.contains_key(slot))
            .collect();
        if sample(&metrics, gauge) == Some(2.0) && unassigned.len() == 2 {
            break unassigned;
        }
        assert!(Instant::now() < deadline, "the pool did not refill: {unassigned:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    // A session that took a warm sandbox and holds it still (the limit hibernated the others).
    let mut last = None;
    for id in bound.values().flatten() {
        if world.session(id).await["phase"] == "idle" {
            last = Some(id.clone());
        }
    }
    let last = &last.expect("a session idle in its warm sandbox");
    world.kill_server();
    world.restart_server();
    world
        .steer(last, "#!scripted\nwrite: again.txt\nagain\n>>>\nsay: again", "queue")
        .await;
    let (session, turns) = world.settled(last, 2).await;
    assert_eq!(status_of(&turns, 2), "completed", "{session:#} {turns:#?}");
    assert!(world.files_on_branch(last).contains(&"again.txt".to_owned()));
    let timings = &turns[1]["timings"];
    assert!(
        timings.get("sandbox").is_none() && timings.get("warm_sandbox").is_none(),
        "the steer ran in the sandbox the session had: {timings}"
    );
    let metrics_url = format!("{}/metrics", world.url());
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let metrics = scrape(&metrics_url).await;
        let slots = warm_slots(&pool);
        if sample(&metrics, gauge) == Some(2.0) && !unassigned.iter().any(|slot| slots.contains(slot)) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "{slots:?}, left by the killed server: {unassigned:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    // A stop takes every warm sandbox down with its binds: nothing of a session stays mounted.
    drop(world.server.take());
    assert_eq!(mounts_under(&pool), Vec::new());
    assert_eq!(warm_slots(&pool), Vec::<String>::new());
    assert_eq!(warm_slots(&work.join("warm")), Vec::<String>::new());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_server_or_driver_never_leaves_a_session_hanging() {
    let mut world = World::start(&[]);
    // 1. `kill -9` of the server mid-turn: the sandbox outlives it, the restarted server adopts it and
    //    follows the turn to its end and its delivery; the transcript has every part once.
    let id = world
        .create(
            "#!scripted\nsay: before the crash\nsleep: 6000\nwrite: after.txt\nwritten after the restart\n>>>\nsay: after the crash",
            json!({}),
        )
        .await;
    world.wait(&id, 30, |s, _| s["phase"] == "running").await;
    world.wait_said(&id, "before the crash").await;
    let driver_before = driver_pid(&id).expect("the session's driver");
    world.kill_server();
    let restarted = Instant::now();
    world.restart_server();
    let (session, turns) = world.settled(&id, 1).await;
    assert!(restarted.elapsed() < Duration::from_secs(30));
    assert_eq!(
        status_of(&turns, 1),
        "completed",
        "re-adopted and finished: {session:#}"
    );
    assert_eq!(session["phase"], "idle", "{session:#}");
    assert_eq!(driver_pid(&id), Some(driver_before), "the same sandbox, adopted");
    assert_eq!(world.files_on_branch(&id), vec!["after.txt".to_owned()]);
    let said: String = world
        .messages(&id)
        .await
        .iter()
        .filter(|m| m["role"] == "assistant")
        .map(|m| m["parts"].to_string())
        .collect();
    assert_eq!(said.matches("before the crash").count(), 1, "{said}");
    assert_eq!(said.matches("after the crash").count(), 1, "{said}");

    // 2. The server and the sandbox both die (a host reboot): the turn is lost with a reason, at once.
    world
        .steer(&id, "#!scripted\nsay: lost with the host\nsleep: 120000", "queue")
        .await;
    world
        .wait(&id, 30, |s, t| t.len() == 2 && s["phase"] == "running")
        .await;
    world.wait_said(&id, "lost with the host").await;
    world.kill_server();
    for pid in support::sandbox_pids(&id) {
        let _ = Command::new("kill").args(["-9", &pid.to_string()]).status();
    }
    let restarted = Instant::now();
    world.restart_server();
    let (session, turns) = world
        .wait(&id, 30, |s, t| {
            t.len() == 2 && ["failed", "idle"].contains(&s["phase"].as_str().unwrap_or(""))
        })
        .await;
    assert!(restarted.elapsed() < Duration::from_secs(30));
    assert_eq!(code_of(&session), "SANDBOX_LOST", "{session:#}");
    assert_eq!(status_of(&turns, 2), "lost");
    assert!(
        world.assistant_said(&id, "lost with the host").await,
        "the transcript up to the crash is kept"
    );
    assert!(!live_sandboxes().contains(&id), "nothing of the sandbox is left");

    // 3. The session is steerable again; then its driver is killed mid-turn.
    world
        .steer(&id, "#!scripted\nsay: second try\nsleep: 120000", "queue")
        .await;
    world
        .wait(&id, 30, |s, t| t.len() == 3 && s["phase"] == "running")
        .await;
    world.wait_said(&id, "second try").await;
    let pid = {
        let found = Instant::now() + Duration::from_secs(10);
        loop {
            if let Some(pid) = driver_pid(&id) {
                break pid;
            }
            assert!(Instant::now() < found, "no driver process for the session");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    // A client attached across the crash gets what the turn said once and a clean end, whether it
    // was reading from the driver when it died or joined after. It names the turn: one that joins
    // after the worker already marked it lost would otherwise get 204 (no turn is active).
    let attached = world.attach(&id, Some(3));
    let kill = async {
        let killed = Command::new("kill")
            .args(["-9", &pid.to_string()])
            .status()
            .expect("kill");
        assert!(killed.success());
    };
    let (chunks, ()) = tokio::join!(attached, kill);
    let text: String = chunks
        .iter()
        .filter(|c| c["type"] == "text-delta")
        .filter_map(|c| c["delta"].as_str())
        .collect();
    assert_eq!(text.matches("second try").count(), 1, "{chunks:?}");
    let (session, turns) = world
        .wait(&id, 30, |s, t| {
            t.len() == 3 && ["failed", "idle"].contains(&s["phase"].as_str().unwrap_or(""))
        })
        .await;
    assert_eq!(code_of(&session), "SANDBOX_LOST", "{session:#}");
    assert_eq!(status_of(&turns, 3), "lost");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delivery_while_the_server_is_down_waits_for_it() {
    let mut world = World::start(&[]);
    let id = world
        .create(
            "#!scripted\nsay: working\nsleep: 1500\nwrite: late.txt\nlate\n>>>",
            json!({}),
        )
        .await;
    world.wait_said(&id, "working").await;
    let driver_before = driver_pid(&id).expect("the session's driver");
    world.kill_server();
    // The turn ends and its push finds no gateway: the driver delivers, and keeps trying (read here
    // from the driver itself, on the host's socket, as the restarted worker will).
    let driver = support::http_builder()
        .unix_socket(world.data_dir.join("work/sessions").join(&id).join("host/driver.sock"))
        .build()
        .expect("client");
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let report: Value = driver
            .get("http://driver/turns/1")
            .send()
            .await
            .expect("the driver's report")
            .json()
            .await
            .expect("json");
        if report["state"] == "delivering" {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the driver never waited for the gateway: {report}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Still delivering a while later: the push waits for the gateway.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let report: Value = driver
        .get("http://driver/turns/1")
        .send()
        .await
        .expect("report")
        .json()
        .await
        .expect("json");
    assert_eq!(report["state"], "delivering", "{report}");
    world.restart_server();
    let (session, turns) = world.settled(&id, 1).await;
    assert_eq!(status_of(&turns, 1), "completed", "{session:#}");
    assert_eq!(driver_pid(&id), Some(driver_before), "the same sandbox, adopted");
    assert_eq!(world.files_on_branch(&id), vec!["late.txt".to_owned()]);
    let head = world.branch(&id).expect("branch");
    assert_eq!(session["head_sha"].as_str(), Some(head.as_str()));
    // One message: the restarted worker went on with the transcript it had, and closed it once.
    let chunks = world.attach(&id, Some(1)).await;
    let count = |kind: &str| chunks.iter().filter(|c| c["type"] == kind).count();
    assert_eq!((count("start"), count("finish")), (1, 1), "{chunks:#?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_worker_starting_leaves_the_first_ones_turns_alone() {
    if !sortie_store::testing::postgres_available("a_second_worker_starting_leaves_the_first_ones_turns_alone").await {
        return;
    }
    let database = sortie_store::testing::TestDatabase::postgres().await.expect("postgres");
    let world = World::start_on(&[], Some(&database));
    let id = world
        .create(
            "#!scripted\nsay: working\nsleep: 3000\nwrite: done.txt\ndone\n>>>",
            json!({}),
        )
        .await;
    world.wait(&id, 30, |s, _| s["phase"] == "running").await;
    world.wait_said(&id, "working").await;

    // Another `sortie serve` on the same database, its own data dir and the same master key (replicas
    // share one, or the second refuses to start): it says it listens only once it has reconciled what
    // it held, which is nothing of the first one's.
    let second_dir = world.root.join("data-second");
    std::fs::create_dir_all(&second_dir).expect("mkdir");
    std::fs::copy(world.data_dir.join("keyring.key"), second_dir.join("keyring.key")).expect("share the key");
    let second = Server::start_with(&world.root, &second_dir, Some(&database.url), &[]);
    let (session, turns) = world.settled(&id, 1).await;
    assert_eq!(status_of(&turns, 1), "completed", "{session:#}");
    assert_eq!(session["phase"], "idle", "{session:#}");
    assert_eq!(world.files_on_branch(&id), vec!["done.txt".to_owned()]);
    second.kill_hard();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_manifest_agent_installed_outside_usr_runs_from_its_read_only_path() {
    // An operator's own ACP agent: a program in a directory of its own, named by the manifest.
    let install = tempfile::tempdir().expect("temp");
    let agent_dir = install.path().join("my-agent");
    std::fs::create_dir(&agent_dir).expect("mkdir");
    for dir in [install.path(), agent_dir.as_path()] {
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    }
    let scripted = Path::new(support::BINARY).with_file_name("sortie-scripted-agent");
    std::fs::copy(&scripted, agent_dir.join("agent")).expect("copy the scripted agent");
    let manifest = install.path().join("agents.toml");
    let write_manifest = |read_only: &Path| {
        std::fs::write(
            &manifest,
            format!(
                "[[agent]]\nid = \"mine\"\ncommand = \"{}\"\nread_only_paths = [\"{}\"]\n",
                agent_dir.join("agent").display(),
                read_only.display()
            ),
        )
        .expect("manifest");
    };
    write_manifest(&agent_dir);
    let world = World::start(&["--agent-profiles", manifest.to_str().expect("utf-8")]);
    let id = world
        .create("#!scripted\nwrite: mine.txt\nmine\n>>>", json!({"agent": "mine"}))
        .await;
    let (session, turns) = world.settled(&id, 1).await;
    assert_eq!(status_of(&turns, 1), "completed", "{session:#}");
    assert_eq!(world.files_on_branch(&id), vec!["mine.txt".to_owned()]);

    // A path that does not exist is the operator's to fix, and the turn says so.
    write_manifest(&install.path().join("gone"));
    let broken = world.create("#!scripted\nsay: never", json!({"agent": "mine"})).await;
    let (session, _) = world.settled(&broken, 1).await;
    assert_eq!(code_of(&session), "AGENT_START_FAILED", "{session:#}");
    assert!(
        session["failure"]["reason"]
            .as_str()
            .unwrap_or("")
            .contains("read_only_paths"),
        "{session:#}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_removed_after_create_fails_to_start_with_the_drivers_words() {
    // An operator's agent that is there when the session is accepted and gone when its sandbox starts.
    let install = tempfile::tempdir().expect("temp");
    let agent_dir = install.path().join("my-agent");
    std::fs::create_dir(&agent_dir).expect("mkdir");
    for dir in [install.path(), agent_dir.as_path()] {
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    }
    let program = agent_dir.join("agent");
    std::fs::copy(
        Path::new(support::BINARY).with_file_name("sortie-scripted-agent"),
        &program,
    )
    .expect("copy");
    let manifest = install.path().join("agents.toml");
    std::fs::write(
        &manifest,
        format!(
            "[[agent]]\nid = \"mine\"\ncommand = \"{}\"\nread_only_paths = [\"{}\"]\n",
            program.display(),
            agent_dir.display()
        ),
    )
    .expect("manifest");
    // One sandbox at a time: the second session waits while the first holds it.
    let world = World::start(&[
        "--agent-profiles",
        manifest.to_str().expect("utf-8"),
        "--sandboxes-per-workspace",
        "1",
    ]);
    let holder = world.create("#!scripted\nsleep: 60000", json!({})).await;
    world
        .wait(&holder, 60, |session, _| session["phase"] == "running")
        .await;
    let waiting = world.create("#!scripted\nsay: never", json!({"agent": "mine"})).await;
    world
        .wait(&waiting, 60, |session, _| session["queued_reason"].is_string())
        .await;
    std::fs::remove_file(&program).expect("remove the agent");
    world.post(&holder, "stop").await;
    let (session, turns) = world.settled(&waiting, 1).await;
    assert_eq!(status_of(&turns, 1), "failed", "{session:#}");
    assert_eq!(code_of(&session), "AGENT_START_FAILED", "{session:#}");
    let reason = session["failure"]["reason"].as_str().unwrap_or("");
    assert!(
        reason.contains("cannot find") && reason.contains("agent"),
        "the driver's own words: {session:#}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_repositorys_setup_script_runs_unless_the_session_names_one() {
    let world = World::start(&[]);
    let local = world.clone_upstream("with-setup");
    std::fs::create_dir_all(local.join(".sortie")).expect("mkdir");
    std::fs::write(
        local.join(".sortie/setup.sh"),
        "echo the repository prepares; echo its toolchain is missing >&2; exit 4\n",
    )
    .expect("write");
    git(&local, &["add", "."]);
    git(&local, &["commit", "-q", "-m", "setup script"]);
    git(&local, &["push", "-q", "origin", "HEAD:refs/heads/main"]);

    let from_repo = world.create("#!scripted\nsay: never runs", json!({})).await;
    let (session, _) = world.settled(&from_repo, 1).await;
    assert_eq!(code_of(&session), "SETUP_FAILED", "{session:#}");
    let reason = session["failure"]["reason"].as_str().unwrap_or("");
    assert!(
        reason.contains("code 4") && reason.contains("its toolchain is missing"),
        "{reason}"
    );

    let named = world
        .create(
            "#!scripted\nwrite: ok.txt\nok\n>>>",
            json!({"setup": "echo the session names its own setup"}),
        )
        .await;
    let (session, turns) = world.settled(&named, 1).await;
    assert_eq!(status_of(&turns, 1), "completed", "{session:#}");
    assert_eq!(world.files_on_branch(&named), vec!["ok.txt".to_owned()]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clients_joining_a_recorded_turn_midway_get_it_whole_and_once() {
    // The stored prefix (the recorder's) and the driver's live tail after it must meet exactly.
    let world = std::sync::Arc::new(World::start(&[]));
    let steps: Vec<String> = (0..40).map(|i| format!("say: [{i:02}]\nsleep: 60")).collect();
    let id = world
        .create(&format!("#!scripted\n{}", steps.join("\n")), json!({}))
        .await;
    let mut clients = Vec::new();
    for join_at in (0..40).step_by(5) {
        let world = world.clone();
        let id = id.clone();
        clients.push(tokio::spawn(async move {
            let deadline = Instant::now() + Duration::from_secs(30);
            loop {
                // Only the agent's answer counts: the prompt itself names every marker.
                let stored = world.messages(&id).await;
                let said = stored
                    .iter()
                    .filter(|m| m["role"] == "assistant")
                    .map(|m| m["parts"].to_string())
                    .collect::<String>();
                if (0..join_at).all(|i| said.contains(&format!("[{i:02}]"))) {
                    break;
                }
                assert!(Instant::now() < deadline, "the turn never reached [{join_at:02}]");
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            (join_at, world.attach(&id, None).await)
        }));
    }
    for client in clients {
        let (join_at, chunks) = client.await.expect("join");
        let text: String = chunks
            .iter()
            .filter(|c| c["type"] == "text-delta")
            .filter_map(|c| c["delta"].as_str())
            .collect();
        for i in 0..40 {
            assert_eq!(
                text.matches(&format!("[{i:02}]")).count(),
                1,
                "joined after [{join_at:02}]: [{i:02}] once: {text}"
            );
        }
        let count = |kind: &str| chunks.iter().filter(|c| c["type"] == kind).count();
        assert_eq!((count("start"), count("finish")), (1, 1), "joined after [{join_at:02}]");
    }
    world.settled(&id, 1).await;
}

/// Every file under `dir` (not following links) that holds `needle`.
fn files_holding(dir: &Path, needle: &[u8]) -> Vec<PathBuf> {
    let mut found = Vec::new();
    let mut pending = vec![dir.to_owned()];
    while let Some(dir) = pending.pop() {
        let Ok(entries) = std::fs::read_dir(&dir) else { continue };
        for entry in entries.flatten() {
            let path = entry.path();
            let Ok(kind) = entry.file_type() else { continue };
            if kind.is_dir() {
                pending.push(path);
            } else if kind.is_file()
                // The session's raw disk image is sparse and gigabytes long; its files are read
                // through the mount at `disk/` instead.
                && path.file_name().is_none_or(|name| name != "disk.img")
                && std::fs::read(&path).is_ok_and(|bytes| bytes.windows(needle.len()).any(|w| w == needle))
            {
                found.push(path);
            }
        }
    }
    found
}

/// A TLS forge serving one bare repository at `/<path>/upstream.git` for `token`, and a world whose
/// server trusts the forge's CA.
struct ForgeWorld {
    world: World,
    forge: std::sync::Arc<sortie_testkit::forge::GitForge>,
    repo: PathBuf,
    host: String,
    _dir: tempfile::TempDir,
}

async fn forge_world(token: &str, path: &str) -> ForgeWorld {
    use sortie_testkit::forge::{GitForge, make_certificates, serve_https};
    let dir = tempfile::tempdir().expect("temp");
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let certificates = make_certificates(&dir.path().join("tls"));
    let repos = dir.path().join("repos");
    let parent = repos.join(path);
    std::fs::create_dir_all(&parent).expect("repos");
    let repo = support::upstream_with_main(&parent);
    let forge = GitForge::new(&repos, token);
    let (address, _) = serve_https(forge.router(), &certificates).await;
    let ca_file = certificates.ca_file.to_str().expect("utf-8").to_owned();
    ForgeWorld {
        world: World::start(&["--forge-ca-file", &ca_file]),
        forge,
        repo,
        host: format!("127.0.0.1:{}", address.port()),
        _dir: dir,
    }
}

/// A forge world whose workspace is connected to the forge as GitHub, with its API at the forge.
async fn github_forge_world(token: &str) -> ForgeWorld {
    let forge_world = forge_world(token, "acme").await;
    let host = &forge_world.host;
    let (status, connection) = forge_world
        .world
        .call(
            reqwest::Method::PUT,
            &format!("/v1/forge-connections/{host}"),
            Some(json!({"token": token, "api_base": format!("https://{host}")})),
        )
        .await;
    assert_eq!((status, &connection["kind"]), (200, &json!("github")), "{connection}");
    forge_world
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_repository_on_an_https_forge_is_delivered_with_a_token_no_sandbox_holds() {
    const TOKEN: &str = "ghs_FORGE-canary-token-0123456789wxyz";
    let ForgeWorld {
        world,
        forge,
        repo,
        host,
        _dir,
    } = forge_world(TOKEN, "").await;
    let url = format!("https://{host}/upstream.git");

    // Without a connection to the forge the session says what to do.
    let unconnected = world
        .create("#!scripted\nwrite: x.txt\nx\n>>>", json!({"repo": url}))
        .await;
    let (session, _) = world.settled(&unconnected, 1).await;
    assert_eq!(code_of(&session), "CLONE_FAILED", "{session:#}");
    assert!(
        session["failure"]["reason"]
            .as_str()
            .is_some_and(|r| r.contains(&format!("sortie forge set {host}"))),
        "{session:#}"
    );

    // An admin connects the workspace to the forge: the token from stdin, never an argument.
    let mut child = sortie(&world.root)
        .args(["--server", &world.url(), "--data-dir"])
        .arg(&world.data_dir)
        .args(["forge", "set", &host, "--kind", "git"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("sortie forge set");
    std::io::Write::write_all(&mut child.stdin.take().expect("stdin"), format!("{TOKEN}\n").as_bytes()).expect("token");
    let set = child.wait_with_output().expect("forge set");
    let said = String::from_utf8_lossy(&set.stdout);
    assert!(set.status.success(), "{}", String::from_utf8_lossy(&set.stderr));
    assert!(
        said.contains(&host) && said.contains("…wxyz") && !said.contains(&TOKEN[..20]),
        "{said}"
    );

    let id = world
        .create(
            "#!scripted\nwrite: from-forge.txt\ndelivered through the forge\n>>>",
            json!({"repo": url}),
        )
        .await;
    let (session, turns) = world.settled(&id, 1).await;
    assert_eq!(status_of(&turns, 1), "completed", "{session:#}");
    let branch = format!("refs/heads/sortie/{id}");
    let head = rev(&repo, &branch).expect("the forge has the session's branch");
    assert_eq!(session["head_sha"].as_str(), Some(head.as_str()));
    let files = git(&repo, &["diff", "--name-only", "refs/heads/main", &branch]);
    assert_eq!(files.trim(), "from-forge.txt");
    let requests = forge.requests();
    assert!(
        requests.iter().any(|r| r.line.contains("git-receive-pack")),
        "the push reached the forge: {requests:?}"
    );
    assert!(
        requests.iter().all(|r| r.authorized),
        "every request carried the token: {requests:?}"
    );

    // The token is nowhere a sandbox (or anyone reading the session) could see it.
    let session_dir = world.data_dir.join("work/sessions").join(&id);
    // The workspace lives on the session's own disk (mounted at `disk/` while its sandbox is warm).
    let workspace = session_dir.join("disk/workspace");
    assert!(workspace.join(".git").is_dir(), "{}", workspace.display());
    let holding = files_holding(&session_dir, TOKEN.as_bytes());
    assert!(holding.is_empty(), "the token is in {holding:?}");
    let mirrors = files_holding(&world.data_dir.join("work/mirrors"), TOKEN.as_bytes());
    assert!(mirrors.is_empty(), "the token is in {mirrors:?}");
    let transcript = serde_json::to_string(&world.messages(&id).await).expect("json");
    assert!(!transcript.contains(TOKEN) && !session.to_string().contains(TOKEN));
    // Nor in the warm sandbox: not in any of its processes' environment or argv, not in a file under
    // its workspace (the remote URL and git config included), home or /tmp; nor in the server's log.
    support::assert_not_in_sandbox(&id, TOKEN, "the forge token");
    let origin = std::process::Command::new("git")
        .args(["-c", "safe.directory=*", "-C"])
        .arg(&workspace)
        .args(["remote", "get-url", "origin"])
        .output()
        .expect("git remote");
    assert!(origin.status.success(), "{}", String::from_utf8_lossy(&origin.stderr));
    let origin = String::from_utf8_lossy(&origin.stdout);
    assert!(
        origin.contains("/_sortie/git/") && !origin.contains(TOKEN),
        "origin is the git proxy: {origin}"
    );
    assert!(
        !world.server.as_ref().expect("server").log().contains(TOKEN),
        "the token is in the server's log"
    );

    // The token is rotated on the forge and in the workspace: the warm sandbox's next push uses the new one.
    const ROTATED: &str = "ghs_ROTATED-canary-token-9876543210";
    forge.set_token(ROTATED);
    let (status, _) = world
        .call(
            reqwest::Method::PUT,
            &format!("/v1/forge-connections/{host}"),
            Some(json!({"token": ROTATED, "kind": "git"})),
        )
        .await;
    assert_eq!(status, 200);
    let before = forge.requests().len();
    world
        .steer(&id, "#!scripted\nwrite: after-rotation.txt\nrotated\n>>>", "queue")
        .await;
    let (session, turns) = world.settled(&id, 2).await;
    assert_eq!(status_of(&turns, 2), "completed", "{session:#}");
    let files = git(&repo, &["diff", "--name-only", "refs/heads/main", &branch]);
    assert!(files.contains("after-rotation.txt"), "{files}");
    let after: Vec<_> = forge.requests().into_iter().skip(before).collect();
    assert!(
        !after.is_empty() && after.iter().all(|r| r.authorized),
        "after the rotation every request carried the new token: {after:?}"
    );
    let holding = files_holding(&session_dir, ROTATED.as_bytes());
    assert!(holding.is_empty(), "the rotated token is in {holding:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sandbox_holds_the_sortie_binary_which_is_the_scripted_agent_too_not_its_directory() {
    let world = World::start(&[]);
    // The step's shell is the driver's child: the driver's binary is `sortie`, bound where it lives.
    let id = world
        .create(
            "#!scripted\nrun: ls -a \"$(dirname \"$(readlink /proc/$PPID/exe)\")\"\nsay: listed",
            json!({}),
        )
        .await;
    let (session, turns) = world.settled(&id, 1).await;
    assert_eq!(status_of(&turns, 1), "completed", "{session:#}");
    let messages = world.messages(&id).await;
    let listing: Vec<String> = messages
        .iter()
        .filter(|m| m["role"] == "assistant")
        .flat_map(|m| m["parts"].as_array().cloned().unwrap_or_default())
        .filter_map(|p| p["output"]["text"].as_str().map(ToOwned::to_owned))
        .collect();
    let listing = listing.join("\n");
    let names: HashSet<&str> = listing.lines().collect();
    assert!(
        names.contains("sortie") && !names.contains("sortie-scripted-agent"),
        "{listing:?} in {messages:#?}"
    );
    for build_tree in ["deps", "build", ".fingerprint", "incremental"] {
        assert!(!names.contains(build_tree), "{build_tree} is visible: {listing:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_on_a_github_forge_opens_one_draft_pull_request() {
    let ForgeWorld {
        world,
        forge,
        repo,
        host,
        _dir,
    } = github_forge_world("ghs_PULLS-canary-token-0123456789abcd").await;

    // The token may push but not open pull requests: the branch is delivered and the turn says why
    // there is no PR, in GitHub's words.
    forge.forbid_pulls(true);
    let id = world
        .create(
            "#!scripted\nwrite: feature.txt\nthe feature\n>>>",
            json!({"repo": format!("https://{host}/acme/upstream.git"), "title": "Add the feature"}),
        )
        .await;
    let (session, turns) = world.settled(&id, 1).await;
    assert_eq!(status_of(&turns, 1), "failed", "{session:#}");
    assert_eq!(code_of(&turns[0]), "PR_OPEN_FAILED", "{turns:#?}");
    let reason = turns[0]["failure"]["reason"].as_str().unwrap_or_default();
    assert!(
        reason.contains("Resource not accessible by integration") && reason.contains(&format!("sortie/{id}")),
        "{reason}"
    );
    assert_eq!(session["phase"], "failed", "{session:#}");
    assert!(session["pr"].is_null(), "{session:#}");
    let first = rev(&repo, &format!("refs/heads/sortie/{id}")).expect("the branch is on the forge");
    assert_eq!(turns[0]["head_sha"], json!(first), "{turns:#?}");

    // Once the token may, the next turn opens the PR before the session settles, even one that
    // changes nothing (the branch is on the forge already).
    forge.forbid_pulls(false);
    world
        .steer(
            &id,
            "#!scripted\nsay: nothing to change; open the pull request",
            "queue",
        )
        .await;
    let (session, turns) = world.settled(&id, 2).await;
    assert_eq!(status_of(&turns, 2), "completed", "{session:#}");
    assert_eq!(session["phase"], "idle", "{session:#}");
    assert_eq!(
        session["pr"],
        json!({"url": "https://forge.test/acme/upstream/pull/1", "number": 1}),
        "{session:#}"
    );
    let pulls = forge.pulls();
    assert_eq!(pulls.len(), 1, "{pulls:?}");
    let pull = &pulls[0];
    assert_eq!(
        (pull.head.as_str(), pull.base.as_str(), pull.title.as_str(), pull.draft),
        (format!("sortie/{id}").as_str(), "main", "Add the feature", true)
    );
    assert!(
        pull.body.contains("write: feature.txt") && pull.body.contains(&id),
        "{}",
        pull.body
    );

    // A further delivery updates the same branch; the PR is not opened again.
    world
        .steer(&id, "#!scripted\nwrite: more.txt\nmore\n>>>", "queue")
        .await;
    let (session, turns) = world.settled(&id, 3).await;
    assert_eq!(status_of(&turns, 3), "completed", "{session:#}");
    assert_eq!(session["pr"]["number"], 1);
    // (Each turn after the PR opened also replaces its description: `PATCH …/pulls/1`.)
    let requests = forge.requests();
    let opened: Vec<_> = requests
        .iter()
        .filter(|r| r.line.starts_with("POST /repos/acme/upstream/pulls"))
        .collect();
    assert!(
        opened.len() == 2 && requests.iter().all(|c| c.authorized),
        "the refused call and the one that opened it, both authorized: {requests:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancel_while_the_forge_opens_the_pull_request_still_cancels() {
    let ForgeWorld {
        world,
        forge,
        repo,
        host,
        _dir,
    } = github_forge_world("ghs_SLOWPR-canary-token-0123456789abcd").await;
    forge.delay_pulls(Duration::from_secs(4));
    let id = world
        .create(
            "#!scripted\nwrite: slow.txt\nslow\n>>>",
            json!({"repo": format!("https://{host}/acme/upstream.git")}),
        )
        .await;
    // The branch is pushed and the pull request call is in flight: cancel now.
    let deadline = Instant::now() + Duration::from_secs(30);
    while !forge.requests().iter().any(|r| r.line.contains("/pulls")) {
        assert!(Instant::now() < deadline, "the pull request was never asked for");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(
        rev(&repo, &format!("refs/heads/sortie/{id}")).is_some(),
        "delivered first"
    );
    world.post(&id, "cancel").await;
    let (session, turns) = world.settled(&id, 1).await;
    assert_eq!(session["phase"], "canceled", "{session:#}");
    assert_eq!(status_of(&turns, 1), "canceled", "{turns:#?}");
    let gone = Instant::now() + Duration::from_secs(10);
    while live_sandboxes().contains(&id) {
        assert!(Instant::now() < gone, "the canceled session's sandbox still runs");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_allowlist_amended_through_the_api_opens_the_next_connection_of_a_running_turn() {
    // The "public" server every test name resolves to (127.0.0.1, exempted for the test only).
    let server = sortie_testkit::http::respond("reached-the-late-host").await;
    let port = server.port();
    let world = World::start(&[
        "--egress-hosts",
        "late.sortie-test.dev=127.0.0.1",
        "--egress-exempt",
        "127.0.0.1/32",
    ]);
    // The agent keeps trying (each try a new connection) until the name is allowed.
    let fetch = format!(
        "python3 -c \"import urllib.request as u; print(u.urlopen('http://late.sortie-test.dev:{port}/').read().decode())\""
    );
    let script = format!(
        "#!scripted\nrun: for i in $(seq 600); do {fetch} 2>/dev/null && break; sleep 0.05; done\nsay: fetched"
    );
    let id = world.create(&script, json!({"egress": {"allow": []}})).await;
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let stored = serde_json::to_string(&world.messages(&id).await).expect("json");
        if stored.contains("data-sortie-egress-denied") && stored.contains("late.sortie-test.dev") {
            break;
        }
        assert!(Instant::now() < deadline, "no denial reached the stream: {stored}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let (status, amended) = world
        .call(
            reqwest::Method::POST,
            &format!("/v1/sessions/{id}/egress"),
            Some(json!({"allow": ["late.sortie-test.dev"]})),
        )
        .await;
    assert_eq!(status, 200, "{amended}");
    let (session, turns) = world.settled(&id, 1).await;
    assert_eq!(status_of(&turns, 1), "completed", "{session:#}");
    let outputs: String = world
        .messages(&id)
        .await
        .iter()
        .filter(|m| m["role"] == "assistant")
        .flat_map(|m| m["parts"].as_array().cloned().unwrap_or_default())
        .filter_map(|p| p["output"]["text"].as_str().map(ToOwned::to_owned))
        .collect();
    assert!(
        outputs.contains("reached-the-late-host"),
        "the next connection after the amendment went through without a restart: {outputs}"
    );
    assert_eq!(session["egress"]["allow"], json!(["late.sortie-test.dev"]));

    // The agent was refused many times in its loop, but the stream holds the refusal once.
    let denials = world
        .messages(&id)
        .await
        .iter()
        .flat_map(|m| m["parts"].as_array().cloned().unwrap_or_default())
        .filter(|p| p["type"] == "data-sortie-egress-denied" && p["data"]["host"] == "late.sortie-test.dev")
        .count();
    assert_eq!(denials, 1, "one part for a refusal repeated in a loop");
    // Every refusal is counted and logged.
    let metrics = world
        .http
        .get(format!("{}/metrics", world.url()))
        .send()
        .await
        .expect("metrics");
    let metrics = metrics.text().await.expect("text");
    let counted = |decision: &str| {
        metrics
            .lines()
            .filter(|l| {
                l.starts_with("sortie_egress_decisions_total") && l.contains(&format!("decision=\"{decision}\""))
            })
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum::<f64>()
    };
    assert!(counted("denied") >= 1.0 && counted("allowed") >= 1.0, "{metrics}");
    let log = world.server.as_ref().expect("server").log();
    assert!(
        log.lines()
            .any(|l| l.contains("egress denied") && l.contains("late.sortie-test.dev") && l.contains("allowlist")),
        "the refusal is logged: {log}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateway_started_alone_serves_the_live_tail_of_the_worker_beside_it() {
    let world = World::start(&[]);
    // A second process on the same data dir with only the gateway role (a split deployment on one host).
    let gateway = Server::start_with(&world.root, &world.data_dir, None, &["--roles", "gateway"]);
    let id = world
        .create("#!scripted\nsay: live-first\nsleep: 3000\nsay: live-second", json!({}))
        .await;
    let (status, ticket) = world
        .call(
            reqwest::Method::POST,
            &format!("/v1/sessions/{id}/attach-ticket"),
            Some(json!({"action": "attach"})),
        )
        .await;
    assert_eq!(status, 201, "{ticket}");
    let response = world
        .http
        .get(format!("{}/v1/sessions/{id}/stream", gateway.url))
        .header(
            "authorization",
            format!("Ticket {}", ticket["ticket"].as_str().expect("ticket")),
        )
        .send()
        .await
        .expect("attach");
    assert_eq!(response.status(), 200);
    let mut response = response;
    let mut text = String::new();
    let deadline = Instant::now() + Duration::from_secs(30);
    while !text.contains("live-first") {
        let left = deadline.saturating_duration_since(Instant::now());
        match tokio::time::timeout(left, response.chunk()).await {
            Ok(Ok(Some(bytes))) => text.push_str(&String::from_utf8_lossy(&bytes)),
            other => panic!("the gateway's stream ended or stalled ({other:?}): {text}"),
        }
    }
    // The part came while the agent still ran: from the driver, not from the store after the turn.
    let (_, session) = world
        .call(reqwest::Method::GET, &format!("/v1/sessions/{id}"), None)
        .await;
    assert_eq!(session["phase"], "running", "{session:#}");
    while !text.ends_with("data: [DONE]\n\n") {
        let left = deadline.saturating_duration_since(Instant::now());
        match tokio::time::timeout(left, response.chunk()).await {
            Ok(Ok(Some(bytes))) => text.push_str(&String::from_utf8_lossy(&bytes)),
            other => panic!("the gateway's stream ended or stalled ({other:?}): {text}"),
        }
    }
    assert_eq!(text.matches("live-second").count(), 1, "{text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_setup_script_reaches_the_setup_hosts_and_the_agent_does_not() {
    // A "package registry" on this machine, reachable under a public-looking name.
    let server = sortie_testkit::http::respond("reached-the-registry").await;
    let port = server.port();
    let world = World::start(&[
        "--setup-hosts",
        "registry.sortie-test.dev",
        "--egress-hosts",
        "registry.sortie-test.dev=127.0.0.1",
        "--egress-exempt",
        "127.0.0.1/32",
    ]);
    let fetch = format!(
        "import urllib.request as u; print(u.urlopen('http://registry.sortie-test.dev:{port}/').read().decode())"
    );
    let id = world
        .create(
            &format!("#!scripted\nrun: python3 -c \"{fetch}\" 2>&1 | tail -1\nsay: tried"),
            json!({"setup": format!("python3 -c \"{fetch}\" > setup-fetch.txt")}),
        )
        .await;
    let (session, turns) = world.settled(&id, 1).await;
    assert_eq!(status_of(&turns, 1), "completed", "{session:#}");
    // The setup script fetched from the registry (its file is part of the delivered work)...
    let fetched = git(
        &world.upstream,
        &["show", &format!("refs/heads/sortie/{id}:setup-fetch.txt")],
    );
    assert_eq!(fetched.trim(), "reached-the-registry");
    // ...and the agent, after it, was refused the same host.
    let outputs: String = world
        .messages(&id)
        .await
        .iter()
        .filter(|m| m["role"] == "assistant")
        .map(|m| m["parts"].to_string())
        .collect();
    assert!(outputs.contains("HTTP Error 403"), "{outputs}");
    assert!(!outputs.contains("reached-the-registry"), "{outputs}");
}

/// A rolling restart catches sessions provisioning: each turn whose agent never had its prompt is queued
/// again and runs on the restarted server (issue 19), whatever moment of provisioning the kill hit —
/// before the claim or the clone, and while the setup script runs in a live sandbox.
async fn a_restart_while_provisioning_runs_the_turn_again(database: Option<&sortie_store::testing::TestDatabase>) {
    let mut world = World::start_on(&[], database);
    let task = "#!scripted\nwrite: provisioned.txt\nmade after the restart\n>>>\nsay: done";
    for moment in [
        "at once after the create",
        "as soon as a worker claimed it",
        "while the setup script runs",
    ] {
        let id = world.create(task, json!({"setup": "sleep 4"})).await;
        if moment == "as soon as a worker claimed it" {
            // Somewhere in mirror, clone, proxies and the sandbox's start: the setup script holds the
            // turn in provisioning for 4 s after them.
            world.wait(&id, 30, |s, _| s["phase"] == "provisioning").await;
        }
        if moment == "while the setup script runs" {
            world.wait(&id, 30, |s, _| s["phase"] == "provisioning").await;
            let live = Instant::now() + Duration::from_secs(30);
            while !live_sandboxes().contains(&id) {
                assert!(Instant::now() < live, "the sandbox never came up");
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
        world.kill_server();
        world.restart_server();
        let (session, turns) = world.settled(&id, 1).await;
        assert_eq!(
            (session["phase"].as_str(), status_of(&turns, 1)),
            (Some("idle"), "completed"),
            "killed {moment}: {session:#} {turns:#?}"
        );
        assert_eq!(
            world.files_on_branch(&id),
            vec!["provisioned.txt".to_owned()],
            "killed {moment}"
        );
        assert_eq!(turns.len(), 1, "the same turn ran, not a new one");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_while_provisioning_runs_the_turn_again_on_sqlite() {
    a_restart_while_provisioning_runs_the_turn_again(None).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_while_provisioning_runs_the_turn_again_on_postgres() {
    if !sortie_store::testing::postgres_available("a_restart_while_provisioning_runs_the_turn_again_on_postgres").await
    {
        return;
    }
    let database = sortie_store::testing::TestDatabase::postgres().await.expect("postgres");
    a_restart_while_provisioning_runs_the_turn_again(Some(&database)).await;
}

/// A workspace connected to a GitHub forge as a GitHub App (`sortie forge set --app-id --private-key`):
/// the worker mints an installation token for the session's one repository (the fake GitHub verifies the
/// App's JWT with the key's public half), and clones, delivers and opens the draft PR with it. When the
/// forge stops taking that token mid-session (as an hour passing would), the next push is made with a
/// freshly minted one. Neither the App's key nor any token it minted is ever inside the sandbox.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_github_app_connection_mints_a_token_per_repository_and_renews_a_refused_one() {
    use sortie_testkit::github_app::{FakeApp, make_app_key};
    let ForgeWorld {
        world,
        forge,
        repo,
        host,
        _dir,
    } = forge_world("a-personal-token-nobody-uses", "acme").await;
    let keys = make_app_key(&_dir.path().join("app-key"));
    let mut app = FakeApp::new("424242", "Iv23liCLIENTID", keys.public_der.clone());
    app.install("acme/upstream", 99);
    forge.install_app(app);
    let set = sortie(&world.root)
        .args(["--server", &world.url(), "--data-dir"])
        .arg(&world.data_dir)
        .args(["forge", "set", &host, "--app-id", "424242", "--private-key"])
        .arg(&keys.pkcs1_pem)
        .args(["--api-base", &format!("https://{host}")])
        .output()
        .expect("sortie forge set");
    let said = String::from_utf8_lossy(&set.stdout);
    assert!(set.status.success(), "{}", String::from_utf8_lossy(&set.stderr));
    assert!(said.contains("GitHub App 424242") && said.contains(&host), "{said}");

    let id = world
        .create(
            "#!scripted\nwrite: by-the-app.txt\nan App's work\n>>>",
            json!({"repo": format!("https://{host}/acme/upstream.git"), "title": "The App's change"}),
        )
        .await;
    let (session, turns) = world.settled(&id, 1).await;
    assert_eq!(status_of(&turns, 1), "completed", "{session:#}\n{turns:#?}");
    let branch = format!("refs/heads/sortie/{id}");
    assert!(rev(&repo, &branch).is_some(), "the branch is on the forge");
    assert_eq!(session["pr"]["number"], 1, "{session:#}");
    // The delivery tokens (the pull request's description and check runs use a conversation token of
    // their own, minted beside the turn).
    let delivery_tokens = || {
        forge
            .with_app(|app| app.minted.clone())
            .expect("the app")
            .into_iter()
            .filter(|minted| minted.permissions.contains_key("contents"))
            .collect::<Vec<_>>()
    };
    let minted = delivery_tokens();
    assert_eq!(minted.len(), 1, "one token for the session so far: {minted:?}");
    assert_eq!(minted[0].repositories, vec!["acme/upstream".to_owned()]);
    assert!(forge.requests().iter().all(|r| r.authorized), "{:?}", forge.requests());

    // The forge stops taking the token: the next turn's push is made with a fresh one.
    forge.with_app(FakeApp::expire_all);
    world
        .steer(&id, "#!scripted\nwrite: after-expiry.txt\nstill the App\n>>>", "queue")
        .await;
    let (session, turns) = world.settled(&id, 2).await;
    assert_eq!(status_of(&turns, 2), "completed", "{session:#}\n{turns:#?}");
    let files = git(&repo, &["diff", "--name-only", "refs/heads/main", &branch]);
    assert!(files.contains("after-expiry.txt"), "{files}");
    let minted = delivery_tokens();
    assert_eq!(minted.len(), 2, "minted again once refused: {minted:?}");
    // The conversation token expired too: the check run GitHub refused with it makes the worker mint
    // another, with which the pull request's description still shows the turn.
    sortie_testkit::wait::eventually("the description shows turn 2", Duration::from_secs(30), || async {
        let body = forge.pulls().first().map(|p| p.body.clone()).unwrap_or_default();
        let talking = forge
            .with_app(|app| {
                app.minted
                    .iter()
                    .filter(|m| m.permissions.contains_key("issues"))
                    .count()
            })
            .unwrap_or_default();
        if body.contains("### Turn 2") && talking == 2 {
            Ok(())
        } else {
            Err((talking, body))
        }
    })
    .await;

    // No token it minted, and nothing of its key, is where the sandbox (or a reader) could see it.
    let key_line = std::fs::read_to_string(&keys.pkcs1_pem)
        .expect("key")
        .lines()
        .nth(3)
        .expect("a line of key material")
        .to_owned();
    let session_dir = world.data_dir.join("work/sessions").join(&id);
    for (secret, what) in [
        (minted[0].token.as_str(), "the first installation token"),
        (minted[1].token.as_str(), "the renewed installation token"),
        (key_line.as_str(), "the App's private key"),
    ] {
        support::assert_not_in_sandbox(&id, secret, what);
        let holding = files_holding(&session_dir, secret.as_bytes());
        assert!(holding.is_empty(), "{what} is in {holding:?}");
        assert!(
            !world.server.as_ref().expect("server").log().contains(secret),
            "{what} is in the server's log"
        );
    }
}

/// Issue 21's acceptance, against the fake GitHub: `@sortie` in an issue starts a session whose draft pull
/// request is linked from an answering comment; `@sortie` on that pull request steers it, and the pull
/// request gets a second commit and a description with the commands and their exit codes; a check run
/// reports each turn. A reader is refused with a comment; a bot, an edit, a replayed delivery and a bad
/// signature do nothing; no App key, installation token or webhook secret reaches a sandbox.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn at_sortie_in_an_issue_starts_a_session_and_on_its_pull_request_steers_it() {
    use sortie_testkit::github_app::{
        Author, Delivery, FakeApp, deliver, issue_assigned_payload, issue_comment_payload, make_app_key,
    };
    use sortie_testkit::wait::eventually;
    const SECRET: &str = "the-webhook-secret-of-the-App-0123";
    const APP: &str = "424242";
    let ForgeWorld {
        world,
        forge,
        repo,
        host,
        _dir,
    } = forge_world("a-personal-token-nobody-uses", "acme").await;
    let keys = make_app_key(&_dir.path().join("app-key"));
    let mut app = FakeApp::new(APP, "Iv23liCLIENTID", keys.public_der.clone());
    app.install("acme/upstream", 99);
    forge.install_app(app);
    forge.set_permission("writer", "write");
    forge.set_permission("reader", "read");
    let secret_file = _dir.path().join("webhook-secret");
    std::fs::write(&secret_file, format!("{SECRET}\n")).expect("secret");
    let set = sortie(&world.root)
        .args(["--server", &world.url(), "--data-dir"])
        .arg(&world.data_dir)
        .args(["forge", "set", &host, "--app-id", APP, "--private-key"])
        .arg(&keys.pkcs1_pem)
        .args(["--api-base", &format!("https://{host}"), "--webhook-secret-file"])
        .arg(&secret_file)
        .args(["--trigger-repo", "acme/upstream", "--trigger-agent", "scripted"])
        .args([
            "--dashboard-url",
            "https://sortie.example.test",
            "--trigger-assignee",
            "sortie-app[bot]",
        ])
        .output()
        .expect("sortie forge set");
    let said = String::from_utf8_lossy(&set.stdout);
    assert!(set.status.success(), "{}", String::from_utf8_lossy(&set.stderr));
    assert!(
        said.contains("webhook secret set") && said.contains("@sortie in acme/upstream"),
        "{said}"
    );
    let hook = format!("{}/v1/forges/github/webhook", world.url());
    let repo_url = format!("https://{host}/acme/upstream");
    let writer = Author {
        login: "writer",
        kind: "User",
    };
    let delivery = |event: &'static str, id: &'static str, payload: Value| Delivery {
        event,
        id,
        app_id: APP,
        payload,
    };

    let (status, answer) = deliver(
        &hook,
        Some(SECRET),
        &delivery(
            "ping",
            "d-ping",
            json!({"zen": "Keep it logically awesome.", "hook_id": 1}),
        ),
    )
    .await;
    assert_eq!((status, answer.contains("pong")), (200, true), "{answer}");

    let ask = issue_comment_payload(
        "created",
        &repo_url,
        7,
        None,
        1001,
        &writer,
        "@sortie add a CHANGELOG entry\n#!scripted\nwrite: CHANGELOG.md\n## Unreleased\n- A changelog.\n>>>\n\
         run: grep -c Unreleased CHANGELOG.md\nsay: Added a CHANGELOG entry.",
    );
    // Signed with another secret, or not at all: refused, and nothing is recorded.
    for secret in [Some("not-the-secret-of-any-App"), None] {
        let (status, answer) = deliver(&hook, secret, &delivery("issue_comment", "d-1", ask.clone())).await;
        assert_eq!(status, 401, "{answer}");
        assert!(answer.contains("WEBHOOK_SIGNATURE_INVALID"), "{answer}");
    }
    let (status, answer) = deliver(&hook, Some(SECRET), &delivery("issue_comment", "d-1", ask.clone())).await;
    assert_eq!(status, 202, "{answer}");
    // A redelivery (same id) is not acted on again.
    let (status, answer) = deliver(&hook, Some(SECRET), &delivery("issue_comment", "d-1", ask.clone())).await;
    assert_eq!((status, answer.contains("duplicate")), (200, true), "{answer}");

    let id = eventually("the comment starts a session", Duration::from_secs(30), || async {
        let (_, list) = world.call(reqwest::Method::GET, "/v1/sessions", None).await;
        match list["sessions"].as_array().map(Vec::as_slice) {
            Some([one]) => Ok(one["id"].as_str().unwrap_or_default().to_owned()),
            other => Err(format!("{other:?}")),
        }
    })
    .await;
    let (session, turns) = world.settled(&id, 1).await;
    assert_eq!(status_of(&turns, 1), "completed", "{session:#}\n{turns:#?}");
    assert_eq!(session["title"], "#7: Keep a changelog", "{session:#}");
    let branch = format!("refs/heads/sortie/{id}");
    let first_head = rev(&repo, &branch).expect("the branch is on the forge");
    let pr_url = session["pr"]["url"].as_str().expect("a draft pull request").to_owned();
    let pr_number = session["pr"]["number"].as_u64().expect("number");
    assert!(forge.pulls()[0].draft, "{:?}", forge.pulls());
    // 👀 on the comment; the issue is answered with the session's link, then the pull request's.
    eventually("👀 on the comment", Duration::from_secs(30), || async {
        let reactions = forge.reactions();
        if reactions
            .iter()
            .any(|r| r.comment_id == 1001 && r.on == "issues" && r.content == "eyes")
        {
            Ok(())
        } else {
            Err(reactions)
        }
    })
    .await;
    let answers = eventually(
        "the issue hears of the pull request",
        Duration::from_secs(30),
        || async {
            let on_issue: Vec<String> = forge
                .comments()
                .into_iter()
                .filter(|c| c.number == 7)
                .map(|c| c.body)
                .collect();
            if on_issue.iter().any(|body| body.contains(&pr_url)) {
                Ok(on_issue)
            } else {
                Err(on_issue)
            }
        },
    )
    .await;
    assert!(
        answers[0].contains(&id) && answers[0].contains(&format!("https://sortie.example.test/sessions/{id}")),
        "{answers:?}"
    );
    // The description is the session's evidence: the command and its exit code.
    let body = eventually("the description shows turn 1", Duration::from_secs(30), || async {
        match forge.pulls().first().map(|p| p.body.clone()) {
            Some(body) if body.contains("### Turn 1") => Ok(body),
            other => Err(other),
        }
    })
    .await;
    assert!(body.contains("| `grep -c Unreleased CHANGELOG.md` | 0 |"), "{body}");
    assert!(
        body.contains("Added a CHANGELOG entry.") && body.contains("`CHANGELOG.md` +2"),
        "{body}"
    );
    // The new head reports the turn as a finished check run.
    eventually("a check run on the first head", Duration::from_secs(30), || async {
        let runs = forge.check_runs();
        if runs
            .iter()
            .any(|r| r.head_sha == first_head && r.conclusion.as_deref() == Some("success"))
        {
            Ok(())
        } else {
            Err(runs)
        }
    })
    .await;

    // `@sortie` on the pull request steers the session: a second commit, a new description.
    let steer = issue_comment_payload(
        "created",
        &repo_url,
        pr_number,
        Some(&pr_url),
        1002,
        &writer,
        "@sortie also add a test\n#!scripted\nwrite: tests/changelog.sh\ngrep -q Unreleased CHANGELOG.md\n>>>\n\
         run: sh tests/changelog.sh\nrun: test -f NOTICE\nsay: Added a test.",
    );
    let (status, answer) = deliver(&hook, Some(SECRET), &delivery("issue_comment", "d-2", steer)).await;
    assert_eq!(status, 202, "{answer}");
    let (session, turns) = world.settled(&id, 2).await;
    assert_eq!(status_of(&turns, 2), "completed", "{session:#}\n{turns:#?}");
    let second_head = rev(&repo, &branch).expect("branch");
    assert_ne!(second_head, first_head);
    assert_eq!(
        git(&repo, &["rev-list", "--count", &format!("refs/heads/main..{branch}")]).trim(),
        "2"
    );
    eventually("👀 on the steering comment", Duration::from_secs(30), || async {
        let reactions = forge.reactions();
        if reactions.iter().any(|r| r.comment_id == 1002 && r.content == "eyes") {
            Ok(())
        } else {
            Err(reactions)
        }
    })
    .await;
    assert_eq!(forge.pulls().len(), 1, "the same pull request");
    let body = eventually("the description shows turn 2", Duration::from_secs(30), || async {
        match forge.pulls().first().map(|p| p.body.clone()) {
            Some(body) if body.contains("### Turn 2") => Ok(body),
            other => Err(other),
        }
    })
    .await;
    assert!(body.contains("| `sh tests/changelog.sh` | 0 |"), "{body}");
    assert!(body.contains("| `test -f NOTICE` | 1 |"), "{body}");
    assert!(
        body.contains("### Turn 1") && body.contains("Files changed: 2"),
        "{body}"
    );
    // Turn 2's check run went in progress on the first head and was completed, and the second head
    // has its own; none is left working.
    eventually("the check runs are completed", Duration::from_secs(30), || async {
        let runs = forge.check_runs();
        let done = runs.iter().all(|r| r.status == "completed")
            && runs
                .iter()
                .any(|r| r.head_sha == second_head && r.conclusion.as_deref() == Some("success"))
            && runs.iter().filter(|r| r.head_sha == first_head).count() == 2;
        if done { Ok(()) } else { Err(runs) }
    })
    .await;
    let (status, evidence) = world
        .call(reqwest::Method::GET, &format!("/v1/sessions/{id}/evidence"), None)
        .await;
    assert_eq!(status, 200, "{evidence}");
    let commands: Vec<(String, Option<i64>)> = evidence["turns"][1]["commands"]
        .as_array()
        .expect("commands")
        .iter()
        .map(|c| {
            (
                c["command"].as_str().unwrap_or_default().to_owned(),
                c["exit_code"].as_i64(),
            )
        })
        .collect();
    assert_eq!(
        commands,
        vec![
            ("sh tests/changelog.sh".to_owned(), Some(0)),
            ("test -f NOTICE".to_owned(), Some(1))
        ],
        "{evidence:#}"
    );

    // A reader is refused in the thread; a bot, an edit and a replay do nothing. The last delivery is a
    // second reader's: deliveries are acted on in order, so once it is answered the others were read.
    let reader = Author {
        login: "reader",
        kind: "User",
    };
    let bot = Author {
        login: "helper[bot]",
        kind: "Bot",
    };
    let ignored = [
        (
            "d-3",
            issue_comment_payload(
                "created",
                &repo_url,
                8,
                None,
                1003,
                &reader,
                "@sortie delete everything",
            ),
        ),
        (
            "d-4",
            issue_comment_payload("created", &repo_url, 9, None, 1004, &bot, "@sortie bump deps"),
        ),
        (
            "d-5",
            issue_comment_payload(
                "edited",
                &repo_url,
                10,
                None,
                1005,
                &writer,
                "@sortie add a CHANGELOG entry",
            ),
        ),
        ("d-1", ask.clone()),
        // The same signed body under a new delivery id.
        ("d-1-again", ask.clone()),
        // A writer on a pull request sortie did not open (the workspace does not take those).
        (
            "d-10",
            issue_comment_payload(
                "created",
                &repo_url,
                50,
                Some(&format!("{repo_url}/pull/50")),
                1010,
                &writer,
                "@sortie fix it",
            ),
        ),
        (
            "d-6",
            issue_comment_payload(
                "created",
                &repo_url,
                11,
                None,
                1006,
                &Author {
                    login: "stranger",
                    kind: "User",
                },
                "@sortie hi",
            ),
        ),
    ];
    for (delivery_id, payload) in ignored {
        let (status, answer) = deliver(&hook, Some(SECRET), &delivery("issue_comment", delivery_id, payload)).await;
        // A bot's and an edited comment are not even kept; a replay is known; the readers are kept
        // for a worker to ask GitHub about.
        let expected = match delivery_id {
            "d-3" | "d-6" | "d-10" => (202, "accepted"),
            "d-1" | "d-1-again" => (200, "duplicate"),
            _ => (200, "ignored"),
        };
        assert_eq!(
            (status, answer.contains(expected.1)),
            (expected.0, true),
            "{delivery_id}: {answer}"
        );
    }
    eventually("the last delivery is answered", Duration::from_secs(30), || async {
        let comments = forge.comments();
        if comments.iter().any(|c| c.number == 11) {
            Ok(())
        } else {
            Err(comments)
        }
    })
    .await;
    let comments = forge.comments();
    let refusal = comments.iter().find(|c| c.number == 8).expect("the reader is answered");
    assert!(
        refusal.body.contains("@reader") && refusal.body.contains("write access"),
        "{refusal:?}"
    );
    assert!(comments.iter().all(|c| c.number != 9 && c.number != 10), "{comments:?}");
    let not_ours = comments
        .iter()
        .find(|c| c.number == 50)
        .expect("the writer is answered");
    assert!(not_ours.body.contains("did not open this pull request"), "{not_ours:?}");
    let reacted: Vec<u64> = forge.reactions().iter().map(|r| r.comment_id).collect();
    assert_eq!(reacted, vec![1001, 1002], "only the requests taken get 👀");
    let (_, list) = world.call(reqwest::Method::GET, "/v1/sessions", None).await;
    assert_eq!(list["sessions"].as_array().map(Vec::len), Some(1), "{list:#}");

    // An issue assigned to the App's bot user by a writer is a request too; assigned to someone else, not.
    let elsewhere = issue_assigned_payload(&repo_url, 12, "octocat", &writer);
    let (status, answer) = deliver(&hook, Some(SECRET), &delivery("issues", "d-7", elsewhere)).await;
    assert_eq!((status, answer.contains("ignored")), (200, true), "{answer}");
    let assigned = issue_assigned_payload(&repo_url, 13, "sortie-app[bot]", &writer);
    let (status, answer) = deliver(&hook, Some(SECRET), &delivery("issues", "d-8", assigned)).await;
    assert_eq!(status, 202, "{answer}");
    let opened = json!({"action": "opened", "issue": {"number": 14}, "sender": {"login": "writer"},
        "repository": {"full_name": "acme/upstream", "html_url": repo_url}});
    let (status, answer) = deliver(&hook, Some(SECRET), &delivery("issues", "d-9", opened)).await;
    assert_eq!((status, answer.contains("ignored")), (200, true), "not kept: {answer}");
    let assigned_session = eventually("the assignment starts a session", Duration::from_secs(30), || async {
        let (_, list) = world.call(reqwest::Method::GET, "/v1/sessions", None).await;
        let titles: Vec<String> = list["sessions"]
            .as_array()
            .map(|l| {
                l.iter()
                    .map(|s| s["title"].as_str().unwrap_or_default().to_owned())
                    .collect()
            })
            .unwrap_or_default();
        match list["sessions"]
            .as_array()
            .and_then(|l| l.iter().find(|s| s["title"] == "#13: Document the flags"))
        {
            Some(found) => Ok(found["id"].as_str().unwrap_or_default().to_owned()),
            None => Err(titles),
        }
    })
    .await;
    let turns = world.turns(&assigned_session).await;
    let task = turns[0]["prompt"].as_str().unwrap_or_default();
    assert!(
        task.contains("Nobody knows what --quiet does.") && task.contains("@writer assigned it to sortie"),
        "{task}"
    );
    assert!(
        forge.comments().iter().all(|c| c.number != 12),
        "{:?}",
        forge.comments()
    );
    let (_, list) = world.call(reqwest::Method::GET, "/v1/sessions", None).await;
    assert_eq!(list["sessions"].as_array().map(Vec::len), Some(2), "{list:#}");
    let (_, turns) = world.settled(&assigned_session, 1).await;
    assert_eq!(status_of(&turns, 1), "completed", "{turns:#?}");

    // Nothing of the App's key, its tokens or the webhook secret is where a sandbox could see it.
    let minted = forge.with_app(|app| app.minted.clone()).expect("the app");
    assert!(
        minted
            .iter()
            .any(|m| m.permissions.get("issues").is_some_and(|p| p == "write"))
    );
    assert!(
        minted
            .iter()
            .filter(|m| m.permissions.contains_key("contents"))
            .all(|m| !m.permissions.contains_key("issues")),
        "the delivery token cannot talk: {minted:?}"
    );
    let key_line = std::fs::read_to_string(&keys.pkcs1_pem)
        .expect("key")
        .lines()
        .nth(3)
        .expect("a line of key material")
        .to_owned();
    let session_dir = world.data_dir.join("work/sessions").join(&id);
    let mut secrets: Vec<(String, String)> = minted
        .iter()
        .map(|m| (m.token.clone(), format!("the installation token {:?}", m.permissions)))
        .collect();
    secrets.push((key_line, "the App's private key".into()));
    secrets.push((SECRET.into(), "the webhook secret".into()));
    for (secret, what) in &secrets {
        support::assert_not_in_sandbox(&id, secret, what);
        let holding = files_holding(&session_dir, secret.as_bytes());
        assert!(holding.is_empty(), "{what} is in {holding:?}");
        assert!(
            !world.server.as_ref().expect("server").log().contains(secret.as_str()),
            "{what} is in the server's log"
        );
    }
}
