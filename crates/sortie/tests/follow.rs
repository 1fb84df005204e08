//! Following a session from the terminal with the real binaries: `sortie run --follow` and `sortie
//! logs` against a real `sortie serve` (every role, real sandboxes, the scripted agent), through a TCP
//! relay that can cut the stream's connection mid-turn.

mod support;

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::os::unix::fs::PermissionsExt;
use std::process::Output;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use serde_json::Value;
use support::{Server, sortie, stderr, stdout, upstream_with_main};

/// A relay from a local port to the server that, once armed, cuts the first connection whose answer
/// carries a streamed text part, right after passing that part on: the client has shown it and must
/// go on after it.
struct CuttingRelay {
    url: String,
    cuts: Arc<AtomicUsize>,
}

impl CuttingRelay {
    fn start(server_url: &str) -> Self {
        let upstream = server_url.trim_start_matches("http://").to_owned();
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let url = format!("http://{}", listener.local_addr().expect("addr"));
        let cuts = Arc::new(AtomicUsize::new(0));
        let armed = Arc::new(AtomicBool::new(true));
        let counted = cuts.clone();
        std::thread::spawn(move || {
            for client in listener.incoming().map_while(Result::ok) {
                let Ok(server) = TcpStream::connect(&upstream) else {
                    continue;
                };
                let (client_in, server_out) = (client.try_clone().expect("clone"), server.try_clone().expect("clone"));
                std::thread::spawn(move || pump(client_in, server_out));
                let (armed, counted) = (armed.clone(), counted.clone());
                std::thread::spawn(move || {
                    let (mut from, mut to) = (server, client);
                    let mut buffer = [0u8; 16 * 1024];
                    while let Ok(read) = from.read(&mut buffer) {
                        if read == 0 || to.write_all(&buffer[..read]).is_err() {
                            break;
                        }
                        let carried = &buffer[..read];
                        if carried.windows(10).any(|w| w == b"text-delta") && armed.swap(false, Ordering::SeqCst) {
                            counted.fetch_add(1, Ordering::SeqCst);
                            let _ = to.shutdown(Shutdown::Both);
                            let _ = from.shutdown(Shutdown::Both);
                            break;
                        }
                    }
                    let _ = to.shutdown(Shutdown::Write);
                });
            }
        });
        Self { url, cuts }
    }
}

fn pump(mut from: TcpStream, mut to: TcpStream) {
    let _ = std::io::copy(&mut from, &mut to);
    let _ = to.shutdown(Shutdown::Write);
}

struct Setup {
    _temp: tempfile::TempDir,
    home: std::path::PathBuf,
    data_dir: std::path::PathBuf,
    repo: String,
    server: Server,
}

fn setup() -> Setup {
    let temp = tempfile::tempdir().expect("temp");
    // The data dir is under this scratch dir, which must be searchable by the sandbox uid as
    // /var/lib/sortie is (the newcomer test takes the default path under a 0700 home).
    std::fs::set_permissions(temp.path(), std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let home = temp.path().to_path_buf();
    let data_dir = temp.path().join("data");
    let repo = upstream_with_main(temp.path()).to_string_lossy().into_owned();
    let server = Server::start_with(&home, &data_dir, None, &["--default-agent", "scripted"]);
    Setup {
        _temp: temp,
        home,
        data_dir,
        repo,
        server,
    }
}

impl Setup {
    fn client(&self, server: &str, args: &[&str]) -> Output {
        sortie(&self.home)
            .args(["--server", server, "--data-dir"])
            .arg(&self.data_dir)
            .args(args)
            .output()
            .expect("run the client")
    }

    fn run(&self, args: &[&str]) -> Output {
        self.client(&self.server.url, args)
    }

    fn session(&self, id: &str) -> Value {
        serde_json::from_slice(&self.run(&["--json", "show", id]).stdout).expect("session json")
    }
}

/// How many lines of `text` are `line` exactly.
fn count(text: &str, line: &str) -> usize {
    text.lines().filter(|l| *l == line).count()
}

fn session_id(out: &Output) -> String {
    let text = format!("{}{}", stdout(out), stderr(out));
    text.split_whitespace()
        .find(|word| word.starts_with("ses_"))
        .expect("a session id")
        .to_owned()
}

#[test]
fn run_follow_shows_the_turn_as_text_and_exits_with_its_outcome() {
    let s = setup();
    let relay = CuttingRelay::start(&s.server.url);
    // Through the relay, which cuts the stream's connection right after the first words: the client
    // attaches again with Last-Event-ID and shows each part once.
    let task = "#!scripted\nsay: First words.\nsleep: 1500\nrun: printf 'out-one\\nout-two\\n'\nwrite: hello.txt\nhi\n>>>\nsay: Last words.";
    let followed = s.client(
        &relay.url,
        &["run", "--repo", &s.repo, "--agent", "scripted", "--follow", task],
    );
    let out = stdout(&followed);
    assert_eq!(followed.status.code(), Some(0), "{out}\n{}", stderr(&followed));
    assert_eq!(relay.cuts.load(Ordering::SeqCst), 1, "the stream was cut once");
    for shown in [
        "First words.",
        "Last words.",
        "  │ out-one",
        "  │ out-two",
        "new file hello.txt +1 −0",
        "turn 1 completed",
    ] {
        // Each once, as a line of its own: nothing shown twice after the cut, nothing missed.
        assert_eq!(count(&out, shown), 1, "{shown:?} once in:\n{out}");
    }
    assert!(out.contains("→ delivered sortie/ses_"), "{out}");
    assert!(
        out.find("First words.") < out.find("out-one") && out.find("out-one") < out.find("Last words."),
        "{out}"
    );
    assert!(
        !out.contains('\u{1b}'),
        "no escape codes when stdout is not a terminal: {out:?}"
    );
    assert!(stderr(&followed).contains("Ctrl-C detaches"), "{}", stderr(&followed));

    // `logs` prints the finished conversation; `--json` its raw parts, one object a line.
    let id = session_id(&followed);
    let logs = s.run(&["logs", &id]);
    assert_eq!(logs.status.code(), Some(0), "{}", stderr(&logs));
    let printed = stdout(&logs);
    assert!(
        printed.contains("── turn 1 ── say: First words.") && count(&printed, "Last words.") == 1,
        "{printed}"
    );
    let raw = s.run(&["--json", "logs", &id]);
    let parts: Vec<Value> = stdout(&raw)
        .lines()
        .map(|line| serde_json::from_str(line).expect("one JSON object a line"))
        .collect();
    assert_eq!(parts.first().map(|p| p["type"].clone()), Some(Value::from("start")));
    assert_eq!(parts.last().map(|p| p["type"].clone()), Some(Value::from("finish")));

    // The session's other commands: allow, archive and back.
    let allowed = s.run(&["allow", &id, "example.com", "registry.example.org"]);
    assert!(allowed.status.success(), "{}", stderr(&allowed));
    assert_eq!(
        s.session(&id)["egress"]["allow"],
        serde_json::json!(["example.com", "registry.example.org"])
    );
    let refused = s.run(&["allow", &id, "10.0.0.1"]);
    assert!(!refused.status.success() && stderr(&refused).contains("EGRESS_ALLOWLIST_INVALID"));
    assert!(s.run(&["archive", &id]).status.success());
    assert_eq!(s.session(&id)["archived"], true);
    assert!(s.run(&["archive", "--undo", &id]).status.success());
    assert_eq!(s.session(&id)["archived"], false);
    let resume = s.run(&["resume", &id]);
    assert!(resume.status.success(), "{}", stderr(&resume));
}

#[test]
fn a_failed_turn_exits_1_with_its_code_and_a_stopped_one_3() {
    let s = setup();
    let failed = s.run(&[
        "run",
        "--repo",
        &s.repo,
        "--follow",
        "#!scripted\nsay: Trying.\nfail: the widget broke",
    ]);
    let out = stdout(&failed);
    assert_eq!(failed.status.code(), Some(1), "{out}\n{}", stderr(&failed));
    assert!(
        out.contains("Trying.") && out.contains("turn 1 failed: AGENT_ERROR") && out.contains("the widget broke"),
        "{out}"
    );

    // A turn stopped by someone else: `logs -f` follows it and exits 3.
    let created = s.run(&[
        "--json",
        "run",
        "--repo",
        &s.repo,
        "#!scripted\nsay: Long work.\nsleep: 60000",
    ]);
    let id = serde_json::from_slice::<Value>(&created.stdout).expect("json")["id"]
        .as_str()
        .expect("id")
        .to_owned();
    let follower = sortie(&s.home)
        .args(["--server", &s.server.url, "--data-dir"])
        .arg(&s.data_dir)
        .args(["logs", "-f", &id])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("follow");
    let deadline = Instant::now() + Duration::from_secs(60);
    while s.session(&id)["phase"] != "running" {
        assert!(Instant::now() < deadline, "the session never ran: {}", s.session(&id));
        std::thread::sleep(Duration::from_millis(100));
    }
    let stop = s.run(&["stop", &id]);
    assert!(stop.status.success(), "{}", stderr(&stop));
    let followed = follower.wait_with_output().expect("follower");
    let out = stdout(&followed);
    assert_eq!(followed.status.code(), Some(3), "{out}\n{}", stderr(&followed));
    assert!(out.contains("Long work.") && out.contains("turn 1 stopped"), "{out}");
}
