//! The security review's attacks (`ref/security-review.md`, S1–S12), each run again as it was run then:
//! from inside a real sandbox as the agent (the scripted agent's `run:` steps), against a real
//! `sortie serve` as root, or from a client for S11. Each test asserts the invariant of DESIGN §9 the
//! attack broke (8–12) now holds. A forged driver (S2, S3's answer) is in
//! `crates/sortie-worker/tests/hostile_driver.rs`: inside a sandbox the driver is out of the agent's
//! reach, so only a driver the test replaces can lie.

mod support;

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::Path;
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use support::world::World;
use support::{git, sortie};

/// Everything the assistant's message of turn `n` holds (text, tool calls and their outputs), as text.
async fn turn_text(world: &World, id: &str, n: u32) -> String {
    let wanted = format!("{id}-t{n}");
    world
        .messages(id)
        .await
        .into_iter()
        .find(|m| m["id"] == wanted.as_str())
        .map(|m| m["parts"].to_string())
        .unwrap_or_default()
}

/// The value of a field of `/proc/<pid>/status`, in kB.
fn status_kib(pid: u32, field: &str) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find_map(|line| line.strip_prefix(field))
        .and_then(|rest| rest.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

fn open_fds(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd")).map_or(0, |dir| dir.count())
}

fn server_pid(world: &World) -> u32 {
    world.server.as_ref().expect("server").child.id()
}

fn script(lines: &[&str]) -> String {
    format!("#!scripted\n{}", lines.join("\n"))
}

/// S1: the agent cannot put a name where the host connects: there is no `/run/sortie` at all, the
/// egress socket's directory is read-only, and the driver's socket is the host's, in a 0700 directory
/// of root's that no sandbox sees. A second workspace's session runs beside it untouched.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s1_a_sandbox_has_no_name_the_host_connects_by() {
    let world = World::start(&[]);
    // The victim: a session of another workspace on the same repository.
    let admin = |args: &[&str]| {
        sortie(&world.root)
            .arg("--data-dir")
            .arg(&world.data_dir)
            .args(args)
            .output()
            .expect("admin")
    };
    let created = admin(&[
        "workspace",
        "create",
        "w2",
        "--allow-root",
        world.root.to_str().expect("utf-8"),
    ]);
    assert!(created.status.success(), "{}", String::from_utf8_lossy(&created.stderr));
    let token = admin(&["token", "create", "--workspace", "w2", "--role", "operator"]);
    let victim_token = String::from_utf8_lossy(&token.stdout).trim().to_owned();
    let victim = world
        .http
        .post(format!("{}/v1/sessions", world.url()))
        .bearer_auth(&victim_token)
        .json(&json!({"repo": world.upstream, "agent": "scripted",
            "task": script(&["write: b-private.txt", "W2 CONFIDENTIAL", ">>>", "say: B turn 1"])}))
        .send()
        .await
        .expect("victim");
    assert_eq!(victim.status(), 202);
    let victim: Value = victim.json().await.expect("json");
    let victim_id = victim["id"].as_str().expect("id").to_owned();

    let attack = [
        "write: marker-a.txt",
        "A's own workspace",
        ">>>",
        // Each marker is put together by the shell: only a refusal (not the command's text) shows it.
        "run: ls -la /run; ls /run/sortie 2>&1; echo ---",
        "run: r=REFUSED; ln -s /tmp/x /run/sortie/driver.sock 2>&1 || echo LINK-$r",
        "run: r=REFUSED; mkdir -p /run/sortie 2>&1 || echo MKDIR-$r",
        "run: r=REFUSED; mv /run/sortie-egress/egress.sock /tmp/e 2>&1 || echo MOVE-$r",
        "run: r=REFUSED; ln -s /tmp/x /run/sortie-egress/driver.sock 2>&1 || echo EGRESS-DIR-$r",
        "run: r=REFUSED; python3 -c \"import socket; socket.socket(socket.AF_UNIX).bind('/run/driver.sock')\" 2>&1 || echo BIND-$r",
        "run: m=MOUNT; grep -c ' /run/sortie ' /proc/self/mountinfo || echo NO-RUN-SORTIE-$m",
        "say: A turn 1 done",
    ];
    let id = world.create(&script(&attack), json!({})).await;
    let (session, _) = world.settled(&id, 1).await;
    assert_eq!(session["phase"], "idle", "{session:#}");
    let said = turn_text(&world, &id, 1).await;
    for refused in [
        "LINK-REFUSED",
        "MKDIR-REFUSED",
        "MOVE-REFUSED",
        "EGRESS-DIR-REFUSED",
        "BIND-REFUSED",
        "NO-RUN-SORTIE-MOUNT",
    ] {
        assert!(said.contains(refused), "{refused} missing from {said}");
    }
    // The host's side: its socket, in a directory only root opens.
    let host_dir = world.data_dir.join("work/sessions").join(&id).join("host");
    let dir = std::fs::metadata(&host_dir).expect("host dir");
    assert_eq!((dir.uid(), dir.permissions().mode() & 0o777), (0, 0o700));
    let socket = std::fs::symlink_metadata(host_dir.join("driver.sock")).expect("driver socket");
    use std::os::unix::fs::FileTypeExt;
    assert!(socket.file_type().is_socket() && socket.uid() == 0, "{socket:?}");

    // A steer of A runs in A's sandbox: its own file is there, the victim's is not.
    world
        .steer(
            &id,
            &script(&["run: cat marker-a.txt; cat b-private.txt 2>&1; echo END"]),
            "queue",
        )
        .await;
    world.settled(&id, 2).await;
    let said = turn_text(&world, &id, 2).await;
    assert!(
        said.contains("A's own workspace") && !said.contains("W2 CONFIDENTIAL"),
        "{said}"
    );
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let turns: Value = world
            .http
            .get(format!("{}/v1/sessions/{victim_id}/turns", world.url()))
            .bearer_auth(&victim_token)
            .send()
            .await
            .expect("turns")
            .json()
            .await
            .expect("json");
        if turns["turns"][0]["completed_at"].is_string() {
            assert_eq!(turns["turns"][0]["status"], "completed", "{turns:#}");
            break;
        }
        assert!(Instant::now() < deadline, "the victim's turn never ended: {turns:#}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let victim_files = git(
        &world.upstream,
        &[
            "diff",
            "--name-only",
            "refs/heads/main",
            &format!("refs/heads/sortie/{victim_id}"),
        ],
    );
    assert_eq!(
        victim_files, "b-private.txt",
        "only the victim's own work is on its branch"
    );
}

/// S2 (inside): the agent cannot reach the driver's API nor read the driver (it is not dumpable), a
/// background process of its own cannot start a turn, and the operator's steer is what runs next.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s2_the_agent_cannot_reach_the_driver_nor_pre_empt_a_steer() {
    let world = World::start(&[]);
    let attack = [
        "run: curl -s --max-time 3 --unix-socket /run/sortie/driver.sock -d '{\"n\":2}' http://driver/turns 2>&1; echo curl=$?",
        "run: cat /proc/2/environ 2>&1 | head -c 200; echo; ls /proc/2/fd 2>&1 | head -3; head -c 4 /proc/2/mem 2>&1; echo probed",
        // The marker is put together by the shell, so only a socket found (not the command) can show it.
        "run: m=OTHER-SOCK; find / -path /proc -prune -o -type s -print 2>/dev/null | grep -v '^/run/sortie-egress/egress.sock$' | sed \"s#^#${m}ET #\"; echo sockets-listed",
        "say: turn 1 done",
    ];
    let id = world.create(&script(&attack), json!({})).await;
    world.settled(&id, 1).await;
    let said = turn_text(&world, &id, 1).await;
    assert!(said.contains("curl=7"), "the driver's API answered the agent: {said}");
    assert!(said.contains("probed") && said.contains("Permission denied"), "{said}");
    assert!(
        said.contains("sockets-listed") && !said.contains("OTHER-SOCKET /"),
        "a socket besides egress.sock is visible inside: {said}"
    );
    world
        .steer(&id, &script(&["say: OPERATOR STEER reached the agent"]), "queue")
        .await;
    let (_, turns) = world.settled(&id, 2).await;
    assert_eq!(turns[1]["status"], "completed");
    assert!(
        turn_text(&world, &id, 2)
            .await
            .contains("OPERATOR STEER reached the agent")
    );
    // Nothing sortie writes came from the sandbox: one delivery part per turn, the host's.
    let chunks = world.attach(&id, Some(1)).await;
    let deliveries = chunks.iter().filter(|c| c["type"] == "data-sortie-delivery").count();
    assert_eq!(deliveries, 1);
}

/// S3: a turn log with a line far past every bound, left by a sandbox whose driver died, is harvested
/// without being held: the server's peak memory barely moves.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s3_an_endless_line_in_the_turn_log_is_not_held() {
    let world = World::start(&[]);
    let pid = server_pid(&world);
    let before = status_kib(pid, "VmHWM:");
    let attack = [
        "say: about to flood the log",
        "run: head -c 314572800 /dev/zero | tr '\\0' x >> ~/.sortie/turns/1.jsonl; kill -9 2",
        "say: never reached",
    ];
    let id = world.create(&script(&attack), json!({})).await;
    let (session, turns) = world.settled(&id, 1).await;
    assert_eq!(turns[0]["status"], "lost", "{session:#}");
    assert_eq!(turns[0]["failure"]["code"], "SANDBOX_LOST");
    let grew_mib = status_kib(pid, "VmHWM:").saturating_sub(before) / 1024;
    println!("server peak memory grew {grew_mib} MiB for a 300 MiB line");
    assert!(grew_mib < 120, "the server held the line: +{grew_mib} MiB");
    assert!(turn_text(&world, &id, 1).await.contains("about to flood the log"));
}

/// S4: one sandbox holding thousands of connections to its egress socket neither exhausts the
/// server's descriptors nor cuts another session's git proxy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s4_a_sandbox_hoarding_connections_does_not_cut_another_session() {
    let world = World::start(&[]);
    let pid = server_pid(&world);
    let hog = [
        "write: /tmp/hog.py",
        "import socket, time",
        "held = []",
        "for i in range(3000):",
        "    s = socket.socket(socket.AF_UNIX)",
        "    s.setblocking(False)",
        "    try:",
        "        s.connect('/run/sortie-egress/egress.sock')",
        "    except (BlockingIOError, OSError):",
        "        pass",
        "    held.append(s)",
        "open('/workspace/holding', 'w').write(str(len(held)))",
        "time.sleep(12)",
        ">>>",
        "run: python3 /tmp/hog.py; cat /workspace/holding",
    ];
    let hog_id = world.create(&script(&hog), json!({})).await;
    let holding = world
        .data_dir
        .join("work/sessions")
        .join(&hog_id)
        .join("disk/workspace/holding");
    let deadline = Instant::now() + Duration::from_secs(60);
    while !holding.exists() {
        assert!(Instant::now() < deadline, "the hog never held its connections");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let fds_held = open_fds(pid);
    let victim = ["run: for i in 1 2 3; do git ls-remote origin >/dev/null 2>&1 && echo ok-$i || echo FAIL-$i; done"];
    let victim_id = world.create(&script(&victim), json!({})).await;
    world.settled(&victim_id, 1).await;
    let said = turn_text(&world, &victim_id, 1).await;
    assert!(said.contains("ok-1\\nok-2\\nok-3"), "{said}");
    println!("server descriptors while 3000 connections were held: {fds_held}");
    assert!(
        fds_held < 1000,
        "the hog's connections took {fds_held} descriptors of the server"
    );
    world.settled(&hog_id, 1).await;
    // And after: the hog's own session still reaches its git proxy.
    world
        .steer(
            &hog_id,
            &script(&["run: s=still; git ls-remote origin >/dev/null && echo $s-ok"]),
            "queue",
        )
        .await;
    world.settled(&hog_id, 2).await;
    assert!(turn_text(&world, &hog_id, 2).await.contains("still-ok"));
}

/// S5: a repository of another user, with hooks planted in it, is mirrored and pushed to through the
/// proxy as that user, and none of its hooks ever runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s5_a_hook_in_a_repository_of_another_user_never_runs() {
    let world = World::start(&[]);
    // Where a hook would leave its mark: open to the repository's owner, so a hook that ran could.
    let markers = world.root.join("markers");
    std::fs::create_dir_all(&markers).expect("markers");
    std::fs::set_permissions(&markers, std::fs::Permissions::from_mode(0o777)).expect("chmod");
    let marker = markers.join("hook-ran");
    for hook in [
        "pre-receive",
        "update",
        "post-receive",
        "post-update",
        "reference-transaction",
    ] {
        let path = world.upstream.join("hooks").join(hook);
        std::fs::write(&path, format!("#!/bin/sh\nid >> {}\n", marker.display())).expect("hook");
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    }
    // The repository now belongs to someone else (uid 1234), like a developer's checkout.
    let chowned = std::process::Command::new("chown")
        .args(["-R", "1234:1234"])
        .arg(&world.upstream)
        .status()
        .expect("chown");
    assert!(chowned.success());
    let id = world
        .create(&script(&["write: delivered.txt", "hello", ">>>"]), json!({}))
        .await;
    let (session, turns) = world.settled(&id, 1).await;
    assert_eq!(turns[0]["status"], "completed", "{session:#}");
    assert_eq!(world.files_on_branch(&id), vec!["delivered.txt".to_owned()]);
    assert!(!marker.exists(), "a hook ran: {:?}", std::fs::read_to_string(&marker));
    let owners: Vec<u32> = walk(&world.upstream).iter().map(|m| m.uid()).collect();
    assert!(owners.iter().all(|uid| *uid == 1234), "root wrote into the repository");
}

fn walk(root: &Path) -> Vec<std::fs::Metadata> {
    let mut out = Vec::new();
    let mut pending = vec![root.to_owned()];
    while let Some(path) = pending.pop() {
        let Ok(meta) = std::fs::symlink_metadata(&path) else {
            continue;
        };
        if meta.is_dir() {
            pending.extend(
                std::fs::read_dir(&path)
                    .into_iter()
                    .flatten()
                    .flatten()
                    .map(|e| e.path()),
            );
        }
        out.push(meta);
    }
    out
}

/// S6 (git): 300 requests from one sandbox that each announce a large body and hold it never have
/// more than a few `git http-backend` processes at once on the host.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s6_one_sandbox_cannot_make_the_host_run_hundreds_of_git_processes() {
    let world = World::start(&[]);
    let pid = server_pid(&world);
    let flood = [
        "write: /tmp/flood.py",
        "import socket, sys, time",
        "path = sys.argv[1]",
        "held = []",
        "for i in range(300):",
        "    s = socket.socket(socket.AF_UNIX)",
        "    s.connect('/run/sortie-egress/egress.sock')",
        "    s.sendall(('POST /_sortie/git/%s.git/git-upload-pack HTTP/1.1\\r\\nHost: x\\r\\n' % path +",
        "               'Content-Type: application/x-git-upload-pack-request\\r\\nContent-Length: 10000000\\r\\n\\r\\n0032want ').encode())",
        "    held.append(s)",
        "open('/workspace/flooding', 'w').write('yes')",
        "time.sleep(8)",
        ">>>",
        "run: python3 /tmp/flood.py \"$(git branch --show-current | sed 's#sortie/##')\"; echo flooded",
    ];
    let id = world.create(&script(&flood), json!({})).await;
    let flooding = world
        .data_dir
        .join("work/sessions")
        .join(&id)
        .join("disk/workspace/flooding");
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut most = 0;
    let mut crowd = Vec::new();
    // A backend is git's `git-http-backend`, a child of the server (run straight from git's exec
    // path, or as `git http-backend` where that is not found); it holds the proxy's slot until it has
    // ended, so counting the server's own children is exact even though /proc is not read in one
    // instant.
    let is_backend = |cmdline: &str| {
        let mut words = cmdline.split(' ');
        let program = words.next().unwrap_or_default();
        program.rsplit('/').next() == Some("git-http-backend") || words.next() == Some("http-backend")
    };
    let mut count = |most: &mut usize| {
        let now = git_children(pid);
        let backends = now
            .iter()
            .filter(|(_, ppid, cmdline)| *ppid == pid && is_backend(cmdline))
            .count();
        if backends > *most {
            *most = backends;
            crowd = now;
        }
    };
    while !flooding.exists() || most == 0 {
        count(&mut most);
        if flooding.exists() {
            break;
        }
        assert!(Instant::now() < deadline, "the flood never started");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let until = Instant::now() + Duration::from_secs(4);
    while Instant::now() < until {
        count(&mut most);
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    println!("most git backends of the server at once: {most}");
    assert!(most >= 1, "the flood never reached the git proxy");
    // The proxy's cap (`GitProcessLimits::max_concurrent`).
    assert!(most <= 4, "{most} git backends for one sandbox: {crowd:#?}");
    world.settled(&id, 1).await;
}

/// Descendants of `pid` running git's http-backend (pid, parent, command line).
fn git_children(pid: u32) -> Vec<(u32, u32, String)> {
    let mut processes = Vec::new();
    for entry in std::fs::read_dir("/proc").expect("proc").flatten() {
        let Ok(child) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let status = std::fs::read_to_string(entry.path().join("status")).unwrap_or_default();
        let ppid = status
            .lines()
            .find_map(|l| l.strip_prefix("PPid:"))
            .and_then(|v| v.trim().parse::<u32>().ok())
            .unwrap_or(0);
        let cmdline = std::fs::read(entry.path().join("cmdline")).unwrap_or_default();
        let cmdline = String::from_utf8_lossy(&cmdline).replace('\0', " ");
        processes.push((child, ppid, cmdline));
    }
    let mut tree = vec![pid];
    let mut grew = true;
    while grew {
        grew = false;
        for (child, ppid, _) in &processes {
            if tree.contains(ppid) && !tree.contains(child) {
                tree.push(*child);
                grew = true;
            }
        }
    }
    processes
        .into_iter()
        .filter(|(child, _, cmdline)| cmdline.contains("http-backend") && tree.contains(child))
        .collect()
}

/// S7: a key hidden from the driver's scan by `.gitattributes`, and a key pushed by the agent itself,
/// are both refused at the gateway: the turn fails SECRET_DETECTED and the upstream never holds it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s7_a_secret_hidden_by_attributes_or_pushed_directly_never_reaches_the_repository() {
    let world = World::start(&[]);
    let key = "AKIAZQ3DRSTUVWXY2345";
    let hidden = [
        "write: .gitattributes",
        "* -diff",
        ">>>",
        "write: creds.txt",
        &format!("aws_access_key_id = {key}"),
        ">>>",
    ];
    let hidden_id = world.create(&script(&hidden), json!({})).await;
    let direct = [
        "write: leak.txt",
        &format!("aws_access_key_id = {key}"),
        ">>>",
        "run: git add -A && git -c user.name=a -c user.email=a@b commit -qm leak && git push -q origin HEAD 2>&1; git rm -q leak.txt; echo pushed",
    ];
    let direct_id = world.create(&script(&direct), json!({})).await;
    for id in [&hidden_id, &direct_id] {
        let (session, turns) = world.settled(id, 1).await;
        assert_eq!(
            turns[0]["failure"]["code"], "SECRET_DETECTED",
            "{session:#}\n{turns:#?}"
        );
        let history = git(&world.upstream, &["log", "--all", "-p", "--format=%H"]);
        assert!(!history.contains(key), "the key reached the repository");
    }
}

/// S8: a flooding turn is capped (the rest of its output is not kept, the turn is stopped with a
/// notice) and `/messages` answers quickly afterwards.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s8_a_flood_is_capped_and_messages_answer_quickly() {
    let world = World::start(&[]);
    let id = world
        .create(&script(&["flood: 400000", "say: flooded"]), json!({}))
        .await;
    let (session, turns) = world.settled(&id, 1).await;
    assert_eq!(turns[0]["failure"]["code"], "AGENT_ERROR", "{session:#}");
    assert!(
        turns[0]["failure"]["reason"]
            .as_str()
            .unwrap_or("")
            .contains("transcript"),
        "{turns:#?}"
    );
    let started = Instant::now();
    let messages = world.messages(&id).await;
    let took = started.elapsed();
    println!("GET /messages after a capped flood: {took:?}");
    // Debug builds; the review's flood took 250 s. Release measurements are in the stop note.
    assert!(took < Duration::from_secs(10), "{took:?}");
    assert!(
        messages
            .iter()
            .any(|m| m["parts"].to_string().contains("TRANSCRIPT_LIMIT"))
    );
}

/// S9: the model proxy lends the workspace's key to the inference routes only: files, fine-tuning and
/// admin endpoints asked for from inside the sandbox are refused without reaching the vendor.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s9_the_model_proxy_refuses_what_is_not_inference() {
    let world = World::start(&[]);
    let probe = "curl -s -o /dev/null -w '%{http_code}\\n' --noproxy '*' -H 'OpenAI-Organization: org-victim'";
    let base = "http://127.0.0.1:3128/_sortie/model/openai/v1";
    let attack = [
        &format!(
            "run: {probe} {base}/files; {probe} -X DELETE {base}/files/file-x; {probe} -X POST {base}/fine_tuning/jobs -d '{{}}'; {probe} {base}/organization/admin_api_keys"
        ) as &str,
        "say: probed",
    ];
    let id = world.create(&script(&attack), json!({})).await;
    world.settled(&id, 1).await;
    // The probes' own output, a status code a line: the whole transcript also holds timings and ids,
    // in which "403" may appear by chance.
    let wanted = format!("{id}-t1");
    let messages = world.messages(&id).await;
    let output: String = messages
        .iter()
        .filter(|m| m["id"] == wanted.as_str())
        .filter_map(|m| m["parts"].as_array())
        .flatten()
        .filter(|part| part["type"] == "dynamic-tool")
        .filter_map(|part| part["output"]["text"].as_str().or(part["output"].as_str()))
        .collect();
    let codes: Vec<&str> = output.lines().map(str::trim).filter(|line| !line.is_empty()).collect();
    assert_eq!(codes, ["403"; 4], "{output}");
}

/// S10: a write past the session's disk quota fails inside the sandbox (ENOSPC), the turn fails with a
/// clear DISK_QUOTA_EXCEEDED, and the host's filesystem loses at most the quota.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s10_a_write_past_the_disk_quota_fails_clearly() {
    let world = World::start(&["--sandbox-disk-mib", "64"]);
    let id = world
        .create(
            &script(&["run: dd if=/dev/zero of=big.bin bs=1M count=300 2>&1 | head -2; echo dd-done"]),
            json!({}),
        )
        .await;
    let (session, turns) = world.settled(&id, 1).await;
    assert_eq!(
        turns[0]["failure"]["code"], "DISK_QUOTA_EXCEEDED",
        "{session:#}\n{turns:#?}"
    );
    assert!(
        turns[0]["failure"]["reason"]
            .as_str()
            .unwrap_or("")
            .contains("disk is full"),
        "{turns:#?}"
    );
    assert!(turn_text(&world, &id, 1).await.contains("No space left on device"));
    // What the host gave the session: the blocks of its disk image, and nothing of the 300 MiB outside
    // it. (Not the host's free space: every other test and process on the machine writes too.)
    use std::os::unix::fs::MetadataExt;
    let session_root = world.data_dir.join("work/sessions").join(&id);
    let image = std::fs::metadata(session_root.join("disk.img")).expect("the session's disk image");
    // The image's own blocks, plus the host filesystem's few blocks of extent tree for it.
    let allocated = image.blocks() * 512;
    assert!(
        allocated <= 65 << 20,
        "the image holds {allocated} bytes for a 64 MiB quota"
    );
    let written = support::scan_sizes(&session_root, "big.bin");
    assert!(
        written.iter().all(|(_, size)| *size < 64 << 20),
        "the file grew past the quota: {written:?}"
    );
    assert!(!written.is_empty(), "the agent's file is on the session's disk");
}

/// S11: 3,000 requests that never finish their headers are dropped (past the per-address cap at once,
/// the rest after the header timeout), and the API answers everyone else meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s11_half_sent_requests_are_dropped_after_the_header_timeout() {
    let world = World::start(&[]);
    let address = world.url().trim_start_matches("http://").to_owned();
    let pid = server_pid(&world);
    let mut held = Vec::new();
    for _ in 0..3000 {
        let mut stream = tokio::net::TcpStream::connect(&address).await.expect("connect");
        tokio::io::AsyncWriteExt::write_all(&mut stream, b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-a: ")
            .await
            .expect("half a request");
        held.push(stream);
    }
    // Another client (another address: one address may hold only so many connections, so most of the
    // 3,000 were refused at once) is answered meanwhile.
    let other = support::http_builder()
        .local_address(Some("127.0.0.2".parse().expect("address")))
        .build()
        .expect("client");
    let healthy = other
        .get(format!("{}/healthz", world.url()))
        .send()
        .await
        .expect("healthz");
    assert_eq!(healthy.status(), 200, "the API answers while 3,000 are held");
    // The server's header timeout is 10 s; every half-sent connection is closed within a deadline.
    let deadline = Instant::now() + Duration::from_secs(40);
    loop {
        let mut open = 0;
        for stream in &held {
            let mut byte = [0_u8; 1];
            match stream.try_read(&mut byte) {
                Ok(0) => {}
                Err(error) if error.kind() == std::io::ErrorKind::WouldBlock => open += 1,
                _ => {}
            }
        }
        if open == 0 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "{open} of 3000 half-sent connections still open"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    drop(held);
    println!("server descriptors after: {}", open_fds(pid));
}

/// S12: a `setsid` child the agent leaves behind is gone when its turn ends; the warm sandbox goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s12_a_setsid_child_is_gone_when_its_turn_ends() {
    let world = World::start(&[]);
    let escape = [
        "run: setsid -f sh -c 'while :; do date >> /tmp/alive; sleep 0.1; done; : escapee-marker'; sleep 0.5; echo started",
        "say: turn 1 done",
    ];
    let id = world.create(&script(&escape), json!({})).await;
    let (session, _) = world.settled(&id, 1).await;
    assert_eq!(session["phase"], "idle");
    let escapees = || {
        std::fs::read_dir("/proc")
            .expect("proc")
            .flatten()
            .filter(|entry| {
                std::fs::read(entry.path().join("cmdline"))
                    .is_ok_and(|c| String::from_utf8_lossy(&c).contains("escapee-marker"))
            })
            .count()
    };
    assert_eq!(escapees(), 0, "the setsid child outlived its turn");
    world
        .steer(
            &id,
            &script(&["run: sleep 0.5; cat /tmp/alive | wc -l; t=turn-2; echo $t-ran"]),
            "queue",
        )
        .await;
    let (_, turns) = world.settled(&id, 2).await;
    assert_eq!(turns[1]["status"], "completed");
    assert!(turn_text(&world, &id, 2).await.contains("turn-2-ran"));
}
