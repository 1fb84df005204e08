//! Escape tests: each runs a real bubblewrap sandbox (`sortie sandbox exec`) and tries to break out.
//! They matter most as root, which is how CI runs them.

mod support;

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

fn is_root() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .map(|s| {
            s.lines()
                .any(|l| l.starts_with("Uid:") && l.split_whitespace().nth(1) == Some("0"))
        })
        .unwrap_or(false)
}

/// A directory the sandbox uid can reach (temp dirs are 0700).
fn open_dir(temp: &tempfile::TempDir, name: &str) -> PathBuf {
    std::fs::set_permissions(temp.path(), std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let dir = temp.path().join(name);
    std::fs::create_dir_all(&dir).expect("dir");
    dir
}

fn sandbox(temp: &Path, args: &[&str], script: &str) -> Command {
    let mut command = support::sortie(temp);
    command
        .args(["sandbox", "exec"])
        .args(args)
        .args(["--", "sh", "-c", script]);
    command
}

fn run(args: &[&str], script: &str) -> Output {
    let temp = tempfile::tempdir().expect("temp");
    sandbox(temp.path(), args, script)
        .output()
        .expect("sortie sandbox exec")
}

fn text(output: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    )
}

#[test]
fn a_command_runs_in_the_workspace_and_its_exit_code_comes_back() {
    let temp = tempfile::tempdir().expect("temp");
    let dir = open_dir(&temp, "work");
    std::fs::write(dir.join("input.txt"), "from the host\n").expect("write");
    let output = sandbox(
        temp.path(),
        &["--dir", dir.to_str().expect("utf-8")],
        "pwd; cat input.txt; echo made > out.txt; exit 7",
    )
    .output()
    .expect("run");
    assert_eq!(output.status.code(), Some(7), "{}", text(&output));
    assert_eq!(String::from_utf8_lossy(&output.stdout), "/workspace\nfrom the host\n");
    assert_eq!(std::fs::read_to_string(dir.join("out.txt")).expect("out"), "made\n");
    // The directory was lent to the sandbox uid and given back to its owner.
    assert_eq!(
        std::fs::metadata(dir.join("out.txt")).expect("meta").uid(),
        std::fs::metadata(&dir).expect("meta").uid()
    );
}

#[test]
fn the_hosts_secrets_are_invisible() {
    let temp = tempfile::tempdir().expect("temp");
    // The script names the files; the secret is their content (and the variable's value), which the
    // script never mentions, so seeing it means it leaked.
    let name = format!("canary-{}", std::process::id());
    let marker = format!(
        "s3cr3t-{}-{}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0)
    );
    let data_dir = temp.path().join("data");
    std::fs::create_dir_all(&data_dir).expect("data");
    std::fs::write(data_dir.join("admin-token"), &marker).expect("canary");
    let mut planted = vec![data_dir.join("admin-token")];
    for dir in ["/root", "/home"] {
        let file = Path::new(dir).join(format!(".{name}"));
        if std::fs::write(&file, &marker).is_ok() {
            planted.push(file);
        }
    }
    let paths: Vec<String> = planted.iter().map(|p| p.display().to_string()).collect();
    let script = format!(
        "for f in {}; do cat \"$f\" 2>/dev/null; done; ls -a /root /home {} 2>/dev/null; env; cat /proc/*/environ /proc/*/cmdline 2>/dev/null | tr '\\0' '\\n'; echo scanned",
        paths.join(" "),
        data_dir.display()
    );
    let output = sandbox(temp.path(), &[], &script)
        .env("SORTIE_CANARY_SECRET", &marker)
        .output()
        .expect("run");
    for file in &planted {
        let _ = std::fs::remove_file(file);
    }
    let seen = text(&output);
    assert!(seen.contains("scanned"), "{seen}");
    assert!(!seen.contains(&marker), "a canary leaked into the sandbox:\n{seen}");
}

#[test]
fn nothing_but_the_workspace_home_and_scratch_is_writable() {
    let script = r#"
for target in / /etc /usr /usr/local/bin /bin /run /proc/sys/kernel /sys /root /var /dev /home /run/sortie-egress; do
  if touch "$target/probe" 2>/dev/null; then echo "WRITABLE $target"; fi
done
echo 1 > /proc/sys/kernel/hostname 2>/dev/null && echo "WRITABLE /proc/sys/kernel/hostname"
echo 60 > /proc/sys/vm/swappiness 2>/dev/null && echo "WRITABLE swappiness"
for target in /workspace /home/agent /tmp /dev/shm; do touch "$target/probe" && echo "ok $target"; done
"#;
    let output = run(&[], script);
    let seen = text(&output);
    assert!(!seen.contains("WRITABLE"), "{seen}");
    for dir in ["/workspace", "/home/agent", "/tmp", "/dev/shm"] {
        assert!(seen.contains(&format!("ok {dir}")), "{dir} should be writable: {seen}");
    }
}

#[test]
fn there_is_no_network_but_the_relay() {
    let temp = tempfile::tempdir().expect("temp");
    let egress = open_dir(&temp, "egress");
    let socket = egress.join("egress.sock");
    let listener = std::os::unix::net::UnixListener::bind(&socket).expect("egress socket");
    std::thread::spawn(move || {
        use std::io::{Read, Write};
        for stream in listener.incoming().flatten() {
            let mut stream = stream;
            let mut buffer = [0_u8; 64];
            let read = stream.read(&mut buffer).unwrap_or(0);
            let _ = stream.write_all(format!("egress got {}", String::from_utf8_lossy(&buffer[..read])).as_bytes());
        }
    });
    let host = std::net::TcpListener::bind("127.0.0.1:0").expect("host listener");
    let port = host.local_addr().expect("addr").port();
    let script = format!(
        r#"python3 - <<'PY'
import socket
def attempt(family, address):
    s = socket.socket(family, socket.SOCK_STREAM)
    s.settimeout(2)
    try:
        s.connect(address)
        return "connected"
    except OSError as error:
        return "refused " + type(error).__name__
print("host-loopback", attempt(socket.AF_INET, ("127.0.0.1", {port})))
print("host-loopback6", attempt(socket.AF_INET6, ("::1", {port})))
try:
    socket.getaddrinfo("example.com", 443)
    print("dns resolved")
except OSError:
    print("dns failed")
print("interfaces", sorted(line.split(":")[0].strip() for line in open("/proc/net/dev").read().splitlines()[2:]))
print("routes", len(open("/proc/net/route").read().splitlines()) - 1)
s = socket.create_connection(("127.0.0.1", 3128), timeout=5)
s.sendall(b"ping")
print("relay", s.recv(64).decode())
PY"#
    );
    let output = sandbox(
        temp.path(),
        &["--egress-socket", socket.to_str().expect("utf-8")],
        &script,
    )
    .output()
    .expect("run");
    let seen = text(&output);
    assert!(seen.contains("host-loopback refused"), "{seen}");
    assert!(seen.contains("host-loopback6 refused"), "{seen}");
    assert!(seen.contains("dns failed"), "{seen}");
    assert!(seen.contains("interfaces ['lo']"), "{seen}");
    assert!(seen.contains("routes 0"), "no route to anywhere: {seen}");
    assert!(seen.contains("relay egress got ping"), "{seen}");
    drop(host);
}

#[test]
fn there_is_no_privilege_inside() {
    let temp = tempfile::tempdir().expect("temp");
    let dir = open_dir(&temp, "work");
    let script = r#"
id -u; grep -E '^(CapInh|CapPrm|CapEff|CapBnd|CapAmb|NoNewPrivs):' /proc/self/status
unshare -U true 2>/dev/null && echo "NESTED USERNS" || echo "no nested userns"
touch /workspace/owned-by-whom
su root -c id 2>/dev/null && echo "SU WORKED" || echo "su refused"
ls /proc | grep -E '^[0-9]+$' | while read p; do cat /proc/$p/cmdline 2>/dev/null | tr '\0' ' '; echo; done
"#;
    let output = sandbox(temp.path(), &["--dir", dir.to_str().expect("utf-8")], script)
        .output()
        .expect("run");
    let seen = text(&output);
    assert!(seen.starts_with("1000\n"), "{seen}");
    for cap in ["CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"] {
        assert!(
            seen.contains(&format!("{cap}:\t0000000000000000")),
            "{cap} is zero: {seen}"
        );
    }
    assert!(seen.contains("NoNewPrivs:\t1"), "{seen}");
    assert!(
        seen.contains("no nested userns") && seen.contains("su refused"),
        "{seen}"
    );
    assert!(
        !seen.contains("cargo") && !seen.contains("sandbox exec"),
        "no host process is visible: {seen}"
    );
    assert!(dir.join("owned-by-whom").exists());
}

#[test]
fn as_root_the_sandbox_runs_as_the_unprivileged_uid() {
    // As root, bwrap must not run as root: then the sandbox's uid 1000 is host uid 0 (ref/sandbox-recipe.md §0).
    if !is_root() {
        return;
    }
    let temp = tempfile::tempdir().expect("temp");
    let marker = format!("uid-probe-{}", std::process::id());
    let mut child = sandbox(
        temp.path(),
        &[],
        &format!("exec python3 -c 'import time; time.sleep(30)' {marker}"),
    )
    .stdout(Stdio::null())
    .spawn()
    .expect("spawn");
    let deadline = Instant::now() + Duration::from_secs(10);
    let uid = loop {
        if let Some(uid) = processes_with(&marker).first().map(|(_, uid)| *uid) {
            break uid;
        }
        assert!(Instant::now() < deadline, "the sandboxed process did not appear");
        std::thread::sleep(Duration::from_millis(20));
    };
    // bwrap itself, as the host sees it (the outermost one, whose parent is this run's `sortie`):
    // the sandbox uid and gid in every slot, no groups, and no capability it holds, could inherit
    // or could ever gain back.
    let (pid, _) = processes_with(&marker)[0];
    let mut outer = None;
    let mut at = pid;
    while let Some(parent) = parent_of(at) {
        if comm_of(at) == "bwrap" && comm_of(parent) != "bwrap" {
            outer = Some(at);
            break;
        }
        at = parent;
    }
    let outer = outer.expect("the sandbox's bwrap");
    let status = std::fs::read_to_string(format!("/proc/{outer}/status")).expect("status");
    let _ = child.kill();
    let _ = child.wait();
    assert_eq!(uid, 61_000, "host uid of the sandbox's process");
    for (field, value) in [
        ("Uid", "61000\t61000\t61000\t61000"),
        ("Gid", "61000\t61000\t61000\t61000"),
        ("Groups", ""),
        ("CapInh", "0000000000000000"),
        ("CapPrm", "0000000000000000"),
        ("CapEff", "0000000000000000"),
        ("CapBnd", "0000000000000000"),
        ("CapAmb", "0000000000000000"),
    ] {
        let line = status.lines().find(|line| line.starts_with(&format!("{field}:")));
        assert_eq!(
            line.map(|line| line[field.len() + 1..].trim()),
            Some(value),
            "bwrap's {field}: {status}"
        );
    }
}

fn parent_of(pid: u32) -> Option<u32> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // `pid (comm) state ppid …`: the comm may hold spaces, so read after its last `)`.
    stat.rsplit_once(')')?
        .1
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()
        .filter(|ppid| *ppid > 0)
}

fn comm_of(pid: u32) -> String {
    std::fs::read_to_string(format!("/proc/{pid}/comm"))
        .unwrap_or_default()
        .trim()
        .to_owned()
}

/// Host processes whose command line contains `marker`: (pid, uid).
fn processes_with(marker: &str) -> Vec<(u32, u32)> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(cmdline) = std::fs::read(entry.path().join("cmdline")) else {
            continue;
        };
        let cmdline = String::from_utf8_lossy(&cmdline);
        if cmdline.contains(marker)
            && !cmdline.contains("sandbox")
            && let Ok(meta) = std::fs::metadata(entry.path())
        {
            found.push((pid, meta.uid()));
        }
    }
    found
}

/// How long killed processes may take to be gone. The chain crosses three deaths (the host
/// process, bwrap by its parent-death signal, the pid namespace's init by its own) while this
/// binary's other tests load the machine (a fork bomb among them); one second failed once in CI,
/// where it takes 10-60 ms here. The processes sleep 60 s, so a broken chain still fails this bound.
const GONE_WITHIN: Duration = Duration::from_secs(15);

/// What is left of the processes carrying `marker`: pid, uid, state and command line, for a failure.
fn survivors(marker: &str) -> String {
    processes_with(marker)
        .into_iter()
        .map(|(pid, uid)| {
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
            let state = stat
                .rsplit_once(") ")
                .map_or("?", |(_, rest)| &rest[..1.min(rest.len())]);
            let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
            format!(
                "{pid} uid {uid} state {state}: {}",
                String::from_utf8_lossy(&cmdline).replace('\0', " ")
            )
        })
        .collect::<Vec<_>>()
        .join("; ")
}

fn wait_until_gone(marker: &str, within: Duration) -> bool {
    let deadline = Instant::now() + within;
    while Instant::now() < deadline {
        if processes_with(marker).is_empty() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    processes_with(marker).is_empty()
}

#[test]
fn a_fork_bomb_hits_the_pids_limit() {
    // The shell forks once, for the subshell that sets the bomb off (run directly, `bomb | bomb &`
    // would fork twice from this shell, and the first child's bomb can take the pids before the
    // second fork, which ends a non-interactive dash); then it waits with builtins only.
    let script =
        "bomb() { bomb | bomb & }; (bomb) & i=0; while [ $i -lt 300000 ]; do i=$((i + 1)); done; echo survived";
    let output = run(&["--pids", "64"], script);
    let seen = text(&output);
    assert!(seen.contains("survived"), "{seen}");
    assert!(
        seen.contains("fork") || seen.contains("Resource temporarily unavailable"),
        "forks were refused: {seen}"
    );
    assert!(
        output.status.success(),
        "the sandbox ended normally once its command did: {seen}"
    );
}

#[test]
fn a_memory_hog_is_killed_and_reported() {
    let output = run(
        &["--memory", "134217728"],
        "python3 -c 'x = []\nwhile True: x.append(bytearray(16 << 20))'",
    );
    assert_eq!(output.status.code(), Some(137), "{}", text(&output));
    assert!(text(&output).contains("ran out of memory"), "{}", text(&output));
}

#[test]
fn every_process_dies_with_the_command_or_the_host_process() {
    let marker = format!("orphan-{}", std::process::id());
    let script = format!(
        "python3 -c 'import time; time.sleep(60)' {marker}-bg & setsid python3 -c 'import time; time.sleep(60)' {marker}-setsid & nohup python3 -c 'import time; time.sleep(60)' {marker}-nohup >/dev/null 2>&1 & sleep 0.3; exit 0"
    );
    let output = run(&[], &script);
    assert!(output.status.success(), "{}", text(&output));
    assert!(
        wait_until_gone(&marker, GONE_WITHIN),
        "processes survived the command: {}",
        survivors(&marker)
    );

    let temp = tempfile::tempdir().expect("temp");
    let held = format!("held-{}", std::process::id());
    let mut holder = sandbox(temp.path(), &[], &format!("python3 -c 'import time; time.sleep(60)' {held} & setsid python3 -c 'import time; time.sleep(60)' {held}-2 & wait"))
        .stdout(Stdio::null())
        .spawn()
        .expect("spawn");
    let deadline = Instant::now() + Duration::from_secs(10);
    // Both sleepers, not the shell whose command line names them too: the setsid one must be running.
    let sleepers = || {
        processes_with(&held)
            .into_iter()
            .filter(|(pid, _)| {
                std::fs::read(format!("/proc/{pid}/cmdline")).is_ok_and(|cmdline| cmdline.starts_with(b"python3"))
            })
            .count()
    };
    while sleepers() < 2 {
        assert!(Instant::now() < deadline, "the sandbox did not start its processes");
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = holder.kill();
    let _ = holder.wait();
    assert!(
        wait_until_gone(&held, GONE_WITHIN),
        "processes survived the host process holding the sandbox: {}",
        survivors(&held)
    );
}

#[test]
fn two_sandboxes_cannot_see_each_other() {
    let temp = tempfile::tempdir().expect("temp");
    let first_dir = open_dir(&temp, "first");
    let marker = format!("neighbour-{}", std::process::id());
    let mut first = sandbox(
        temp.path(),
        &["--dir", first_dir.to_str().expect("utf-8")],
        &format!("echo secret > /tmp/{marker}; python3 -c 'import socket,time; s=socket.socket(); s.bind((\"127.0.0.1\", 47001)); s.listen(); u=socket.socket(socket.AF_UNIX); u.bind(\"\\0{marker}\"); u.listen(); time.sleep(30)' {marker}"),
    )
    .stdout(Stdio::null())
    .spawn()
    .expect("first");
    let deadline = Instant::now() + Duration::from_secs(10);
    while processes_with(&marker).is_empty() {
        assert!(Instant::now() < deadline, "the first sandbox did not start");
        std::thread::sleep(Duration::from_millis(20));
    }
    let probe = format!(
        r#"ls /tmp; ls /workspace; cat /proc/*/cmdline 2>/dev/null | tr '\0' ' ' | grep -c {marker}-x || true
python3 - <<'PY'
import socket
for family, address in ((socket.AF_INET, ("127.0.0.1", 47001)), (socket.AF_UNIX, "\0{marker}")):
    s = socket.socket(family)
    try:
        s.connect(address)
        print("REACHED", address)
    except OSError:
        print("unreachable")
PY"#
    );
    let output = run(&[], &probe);
    let _ = first.kill();
    let _ = first.wait();
    let seen = text(&output);
    assert!(
        !seen.contains(&marker),
        "the second sandbox saw the first's files or processes: {seen}"
    );
    assert!(!seen.contains("REACHED"), "{seen}");
    assert_eq!(seen.matches("unreachable").count(), 2, "{seen}");
}

#[test]
fn a_sandbox_uid_of_root_is_refused() {
    let output = run(&["--sandbox-uid", "0"], "true");
    if is_root() {
        assert_eq!(output.status.code(), Some(125));
        assert!(text(&output).contains("SANDBOX_START_FAILED"), "{}", text(&output));
    }
    if is_root() {
        assert!(!output.status.success());
        assert!(text(&output).contains("must not be 0"), "{}", text(&output));
    }
}
