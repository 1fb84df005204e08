//! First contact (DESIGN §13), taken as a newcomer takes it, README.md word for word: root with a
//! fresh 0700 `HOME`, no `SORTIE_*` variable, only the installed `sortie` on PATH, the default data dir
//! (`/var/lib/sortie`), the default address (`127.0.0.1:7700`) and a repository a person owns under
//! `/home`.
//!
//! Those defaults are the machine's own paths. So that they stay the real defaults and the machine is
//! left as it was, every command runs in a mount and network namespace of this test's: there
//! `/var/lib`, `/home` and `/usr/local/bin` are empty directories of its own (mode 0755, as on a fresh
//! system) and the loopback is private. `./scripts/install` would build the binary again (minutes);
//! this test puts the binary it built, alone, where the install puts it (`/usr/local/bin`).

mod support;

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::Duration;

use serde_json::Value;

/// The person who owns the repository, as on a first-user Debian install.
const PERSON: u32 = 1000;
const PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";
const HELLO: &str = "#!scripted\nwrite: hello.txt\nhi\n>>>";

/// A mount and network namespace held open by a sleeping process; commands enter it with `nsenter`.
struct Namespace {
    holder: Child,
    pid: String,
    scratch: tempfile::TempDir,
}

impl Namespace {
    fn new() -> Self {
        let scratch = tempfile::tempdir().expect("temp");
        for dir in ["var-lib", "home", "usr-local-bin", "root-home"] {
            std::fs::create_dir(scratch.path().join(dir)).expect("mkdir");
        }
        for dir in ["var-lib", "home", "usr-local-bin"] {
            chmod(&scratch.path().join(dir), 0o755);
        }
        // A fresh root home, private as on every Debian.
        chmod(&scratch.path().join("root-home"), 0o700);
        std::fs::copy(support::BINARY, scratch.path().join("usr-local-bin/sortie")).expect("install the binary");
        let ready = scratch.path().join("ready");
        let script = format!(
            "set -e; ip link set lo up; mount --bind {s}/var-lib /var/lib; mount --bind {s}/home /home; \
             mount --bind {s}/usr-local-bin /usr/local/bin; touch {ready}; exec sleep 100000",
            s = scratch.path().display(),
            ready = ready.display()
        );
        let holder = Command::new("unshare")
            .args([
                "--mount",
                "--net",
                "--propagation",
                "private",
                "--",
                "sh",
                "-c",
                &script,
            ])
            .stdin(Stdio::null())
            .spawn()
            .expect("unshare");
        let pid = holder.id().to_string();
        let namespace = Self { holder, pid, scratch };
        poll("the namespace", Duration::from_secs(20), || {
            ready.exists().then_some(())
        });
        namespace
    }

    fn root_home(&self) -> PathBuf {
        self.scratch.path().join("root-home")
    }

    /// `program args…` inside the namespace as root, with a newcomer's environment.
    fn command(&self, program: &str, args: &[&str]) -> Command {
        let mut command = Command::new("/usr/bin/nsenter");
        command
            .args(["--target", &self.pid, "--mount", "--net", "--", program])
            .args(args)
            .env_clear()
            .env("HOME", self.root_home())
            .env("PATH", PATH)
            .env("LANG", "C.UTF-8")
            .current_dir(self.root_home())
            .stdin(Stdio::null());
        command
    }

    fn sortie(&self, args: &[&str]) -> Output {
        self.command("sortie", args).output().expect("sortie")
    }

    /// `sortie args…` as the person (uid 1000), in their home.
    fn sortie_as_person(&self, args: &[&str], stdin: Option<&str>) -> Output {
        let uid = PERSON.to_string();
        let mut full = vec![
            "--reuid",
            uid.as_str(),
            "--regid",
            uid.as_str(),
            "--clear-groups",
            "sortie",
        ];
        full.extend_from_slice(args);
        let mut command = self.command("setpriv", &full);
        command.env("HOME", "/home/dev").current_dir("/");
        run_with_input(command, stdin)
    }

    /// Every process left in the namespace (sandboxes, their keepers), then the holder.
    fn kill_everything(&mut self) {
        let ours = std::fs::read_link(format!("/proc/{}/ns/mnt", self.pid)).ok();
        if let (Some(ours), Ok(entries)) = (ours, std::fs::read_dir("/proc")) {
            for entry in entries.flatten() {
                let name = entry.file_name().to_string_lossy().into_owned();
                if name.parse::<u32>().is_err() || name == self.pid {
                    continue;
                }
                if std::fs::read_link(entry.path().join("ns/mnt")).ok().as_ref() == Some(&ours) {
                    let _ = Command::new("kill")
                        .args(["-KILL", &name])
                        .stderr(Stdio::null())
                        .status();
                }
            }
        }
        let _ = self.holder.kill();
        let _ = self.holder.wait();
    }
}

impl Drop for Namespace {
    fn drop(&mut self) {
        self.kill_everything();
    }
}

fn run_with_input(mut command: Command, stdin: Option<&str>) -> Output {
    use std::io::Write;
    let Some(text) = stdin else {
        return command.output().expect("run");
    };
    let mut child = command
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn");
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(text.as_bytes())
        .expect("write stdin");
    child.wait_with_output().expect("wait")
}

fn chmod(path: &Path, mode: u32) {
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).expect("chmod");
}

fn poll<T>(what: &str, within: Duration, mut probe: impl FnMut() -> Option<T>) -> T {
    sortie_testkit::wait::eventually_blocking(what, within, || probe().ok_or("not yet"))
}

fn text(output: &Output) -> String {
    format!(
        "exit {:?}\nstdout: {}\nstderr: {}",
        output.status.code(),
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    )
}

/// A bare repository owned by the person: `/home/dev/app.git` (in the namespace) with `main`.
fn persons_repository(namespace: &Namespace) {
    let home = namespace.scratch.path().join("home/dev");
    std::fs::create_dir(&home).expect("mkdir");
    let bare = home.join("app.git");
    support::git(&home, &["init", "-q", "--bare", bare.to_str().expect("utf-8")]);
    let seed = namespace.scratch.path().join("seed");
    support::git(namespace.scratch.path(), &["init", "-q", seed.to_str().expect("utf-8")]);
    std::fs::write(seed.join("README.md"), "hello\n").expect("write");
    support::git(&seed, &["add", "."]);
    support::git(&seed, &["commit", "-q", "-m", "first"]);
    support::git(
        &seed,
        &["push", "-q", bare.to_str().expect("utf-8"), "HEAD:refs/heads/main"],
    );
    // A repository the person cannot read themselves: what the server cannot serve either.
    let locked = home.join("locked.git");
    support::git(&home, &["init", "-q", "--bare", locked.to_str().expect("utf-8")]);
    let status = Command::new("chown")
        .args(["-R", &format!("{PERSON}:{PERSON}")])
        .arg(&home)
        .status()
        .expect("chown");
    assert!(status.success());
    chmod(&home, 0o750);
    chmod(&locked, 0o000);
}

fn session_json(namespace: &Namespace, id: &str) -> Value {
    let output = namespace.sortie(&["--json", "show", id]);
    assert!(output.status.success(), "{}", text(&output));
    serde_json::from_slice(&output.stdout).expect("show --json")
}

fn session_id(output: &Output) -> String {
    assert!(output.status.success(), "{}", text(output));
    String::from_utf8_lossy(&output.stdout)
        .split_whitespace()
        .next()
        .expect("the new session's id")
        .to_owned()
}

/// Asserts a refusal at create: a non-zero exit whose words hold each of `words`.
fn refused(output: &Output, words: &[&str]) {
    assert!(!output.status.success(), "accepted: {}", text(output));
    let said = String::from_utf8_lossy(&output.stderr);
    for word in words {
        assert!(said.contains(word), "{word:?} not in the refusal: {}", text(output));
    }
}

#[test]
fn a_newcomer_follows_the_readme_and_the_first_session_delivers() {
    let mut namespace = Namespace::new();
    persons_repository(&namespace);

    // `sortie serve`, as the README says; a short idle grace so that a sandbox is released within the test.
    let serve_log = std::fs::File::create(namespace.scratch.path().join("serve.log")).expect("log");
    let mut serve = namespace
        .command("sortie", &["serve", "--idle-grace", "2"])
        .stdout(serve_log.try_clone().expect("log"))
        .stderr(serve_log)
        .spawn()
        .expect("sortie serve");
    let serve_log = || std::fs::read_to_string(namespace.scratch.path().join("serve.log")).unwrap_or_default();
    poll("sortie serve answering `sortie ls`", Duration::from_secs(60), || {
        if let Ok(Some(status)) = serve.try_wait() {
            panic!("sortie serve exited {status}: {}", serve_log());
        }
        namespace.sortie(&["ls"]).status.success().then_some(())
    });
    let data_dir = namespace.scratch.path().join("var-lib/sortie");
    assert!(
        data_dir.join("admin-token").is_file(),
        "the default data dir is /var/lib/sortie"
    );
    assert!(
        !serve_log().contains("\u{1b}["),
        "no colour codes in a log that is not a terminal: {}",
        serve_log()
    );

    // The README's first example delivers its branch into the person's repository.
    let first = session_id(&namespace.sortie(&["run", "--repo", "/home/dev/app.git", "--agent", "scripted", HELLO]));
    let settled = poll("the first session to settle", Duration::from_secs(120), || {
        let session = session_json(&namespace, &first);
        matches!(session["phase"].as_str(), Some("idle" | "failed" | "hibernated")).then_some(session)
    });
    assert_ne!(settled["phase"], "failed", "{settled:#}\n{}", serve_log());
    let log = namespace
        .command(
            "setpriv",
            &[
                "--reuid=1000",
                "--regid=1000",
                "--clear-groups",
                "git",
                "--git-dir",
                "/home/dev/app.git",
                "log",
                "--format=%s",
                &format!("sortie/{first}"),
                "--",
                "hello.txt",
            ],
        )
        .env("HOME", "/home/dev")
        .output()
        .expect("git log");
    assert!(
        log.status.success() && !log.stdout.is_empty(),
        "the branch holds the agent's commit: {}",
        text(&log)
    );

    // What the server accepts, it can run: the rest is refused at create, with the fix.
    refused(
        &namespace.sortie(&["run", "--repo", "/home/dev/app.git", "--agent", "codex", "hi"]),
        &["AGENT_NOT_INSTALLED", "sortie agents install codex"],
    );
    refused(
        &namespace.sortie(&["run", "--repo", "/home/dev/app.git", "hi"]),
        &["AGENT_NOT_INSTALLED", "claude-code", "scripted"],
    );
    refused(
        &namespace.sortie(&[
            "run",
            "--repo",
            "/home/dev/app.git",
            "--agent",
            "scripted",
            "--base",
            "no-such-branch",
            "hi",
        ]),
        &["BASE_NOT_FOUND", "no-such-branch"],
    );
    refused(
        &namespace.sortie(&["run", "--repo", "/home/dev/locked.git", "--agent", "scripted", "hi"]),
        &["REPO_NOT_READABLE", "/home/dev/locked.git"],
    );

    // A failed session stays failed when its sandbox is released; a finished one hibernates.
    let failing = session_id(&namespace.sortie(&[
        "run",
        "--repo",
        "/home/dev/app.git",
        "--agent",
        "scripted",
        "#!scripted\nfail: on purpose",
    ]));
    let released = poll(
        "the failed session's sandbox to be released",
        Duration::from_secs(120),
        || {
            let session = session_json(&namespace, &failing);
            (session["phase"] == "failed" && session["sandbox"] == "released").then_some(session)
        },
    );
    assert_eq!(released["failure"]["code"], "AGENT_ERROR", "{released:#}");
    let first_later = poll("the first session to hibernate", Duration::from_secs(60), || {
        let session = session_json(&namespace, &first);
        (session["sandbox"] == "released").then_some(session)
    });
    assert_eq!(first_later["phase"], "hibernated", "{first_later:#}");
    let failed_list = namespace.sortie(&["ls", "--phase", "failed"]);
    assert!(
        String::from_utf8_lossy(&failed_list.stdout).contains(&failing),
        "{}",
        text(&failed_list)
    );

    // A reader that goes away is an ordinary end: the README's pipe, and a pipe closed before a word.
    let piped = namespace
        .command("sh", &["-c", &format!("sortie show {first} | head -1")])
        .output()
        .expect("sh");
    assert!(piped.status.success(), "{}", text(&piped));
    assert_eq!(
        String::from_utf8_lossy(&piped.stdout).lines().count(),
        1,
        "{}",
        text(&piped)
    );
    let (reader, writer) = std::io::pipe().expect("pipe");
    drop(reader);
    let closed = namespace
        .command("sortie", &["show", &first])
        .stdout(writer)
        .stderr(Stdio::piped())
        .output()
        .expect("sortie show");
    assert!(
        closed.status.success() && !String::from_utf8_lossy(&closed.stderr).contains("panicked"),
        "{}",
        text(&closed)
    );

    // `sortie doctor` passes here, and names bwrap when PATH hides it.
    let doctor = namespace.sortie(&["doctor"]);
    assert!(doctor.status.success(), "{}", text(&doctor));
    let hidden = namespace
        .command("sortie", &["doctor"])
        .env("PATH", "/usr/local/bin")
        .output()
        .expect("doctor");
    assert!(!hidden.status.success(), "{}", text(&hidden));
    assert!(
        String::from_utf8_lossy(&hidden.stdout)
            .lines()
            .any(|line| line.contains("bwrap") && line.contains("apt-get install bubblewrap")),
        "{}",
        text(&hidden)
    );

    // The person's one-time step (README): an operator token from root, saved with `sortie login`.
    let token = namespace.sortie(&["token", "create", "--workspace", "default", "--role", "operator"]);
    assert!(token.status.success(), "{}", text(&token));
    let token = String::from_utf8_lossy(&token.stdout).trim().to_owned();
    let before = namespace.sortie_as_person(&["ls"], None);
    assert!(!before.status.success(), "no token yet: {}", text(&before));
    assert!(
        String::from_utf8_lossy(&before.stderr).contains("sortie login"),
        "{}",
        text(&before)
    );
    let login = namespace.sortie_as_person(&["login"], Some(&format!("{token}\n")));
    assert!(login.status.success(), "{}", text(&login));
    let saved = namespace.scratch.path().join("home/dev/.config/sortie/login.json");
    assert_eq!(
        std::fs::metadata(&saved).expect("login saved").permissions().mode() & 0o777,
        0o600
    );
    let listed = namespace.sortie_as_person(&["ls"], None);
    assert!(listed.status.success(), "{}", text(&listed));
    assert!(
        String::from_utf8_lossy(&listed.stdout).contains(&first),
        "{}",
        text(&listed)
    );
    let wrong = namespace.sortie_as_person(&["login"], Some("sortie_not-a-token\n"));
    assert!(!wrong.status.success(), "{}", text(&wrong));

    // SIGTERM: the worker gives its sandboxes back before it exits.
    let _ = Command::new("kill").args(["-TERM", &serve.id().to_string()]).status();
    poll("sortie serve to stop", Duration::from_secs(30), || {
        serve.try_wait().ok().flatten()
    });
    namespace.kill_everything();
}
