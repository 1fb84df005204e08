//! The bwrap command line of a sandbox (`ref/sandbox-recipe.md` §1), built without I/O.

use std::path::Path;

use crate::{SandboxSpec, inside};

/// Files the runtime writes for the sandbox's `/etc` (bound read-only).
pub const ETC_FILES: [(&str, &str); 4] = [
    (
        "passwd",
        "root:x:0:0:root:/root:/usr/sbin/nologin\nagent:x:1000:1000:agent:/home/agent:/bin/bash\nnobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n",
    ),
    ("group", "root:x:0:\nagent:x:1000:\nnogroup:x:65534:\n"),
    ("hosts", "127.0.0.1 localhost\n::1 localhost ip6-localhost\n"),
    ("nsswitch.conf", "passwd: files\ngroup: files\nhosts: files\n"),
];

/// Host paths bound read-only at the same path when they exist: the system the commands need.
const SYSTEM_READ_ONLY: [&str; 4] = [
    "/etc/alternatives",
    "/etc/ssl/certs",
    "/etc/ld.so.cache",
    "/etc/localtime",
];

/// The arguments after `bwrap`, up to and including the command. `etc_dir` holds [`ETC_FILES`];
/// `status_fd` receives bwrap's JSON status.
pub fn arguments(spec: &SandboxSpec, etc_dir: &Path, status_fd: u32, exists: impl Fn(&Path) -> bool) -> Vec<String> {
    let mut args: Vec<String> = Vec::new();
    let mut push = |items: &[&str]| args.extend(items.iter().map(|item| (*item).to_owned()));
    push(&["--unshare-user", "--uid", "1000", "--gid", "1000", "--disable-userns"]);
    push(&[
        "--unshare-pid",
        "--unshare-net",
        "--unshare-ipc",
        "--unshare-uts",
        "--hostname",
        "sortie",
    ]);
    push(&["--cap-drop", "ALL", "--die-with-parent", "--new-session"]);
    // --clearenv must come before every --setenv.
    push(&["--clearenv"]);
    push(&["--ro-bind", "/usr", "/usr"]);
    push(&[
        "--perms", "0755", "--dir", "/etc", "--perms", "0755", "--dir", "/home", "--perms", "0755", "--dir", "/run",
    ]);
    push(&[
        "--symlink",
        "usr/bin",
        "/bin",
        "--symlink",
        "usr/lib",
        "/lib",
        "--symlink",
        "usr/sbin",
        "/sbin",
    ]);
    if exists(Path::new("/usr/lib64")) {
        push(&["--symlink", "usr/lib64", "/lib64"]);
    }
    for path in SYSTEM_READ_ONLY {
        if exists(Path::new(path)) {
            push(&["--ro-bind", path, path]);
        }
    }
    for (name, _) in ETC_FILES {
        let source = etc_dir.join(name);
        args.extend([
            "--ro-bind".to_owned(),
            source.display().to_string(),
            format!("/etc/{name}"),
        ]);
    }
    let size = spec.limits.tmp_bytes.to_string();
    // /dev is bwrap's small tmpfs of device nodes: read-only but for /dev/shm, which programs expect.
    args.extend(
        [
            "--proc",
            "/proc",
            "--dev",
            "/dev",
            "--tmpfs",
            "/dev/shm",
            "--remount-ro",
            "/dev",
            "--size",
            &size,
            "--tmpfs",
            "/tmp",
        ]
        .map(str::to_owned),
    );
    let bind = |args: &mut Vec<String>, kind: &str, from: &Path, to: &str| {
        args.extend([kind.to_owned(), from.display().to_string(), to.to_owned()]);
    };
    bind(&mut args, "--bind", &spec.workspace, inside::WORKSPACE);
    bind(&mut args, "--bind", &spec.home, inside::HOME);
    if let Some(egress) = &spec.egress_dir {
        bind(&mut args, "--ro-bind", egress, inside::EGRESS_DIR);
    }
    for path in &spec.read_only {
        let text = path.display().to_string();
        bind(&mut args, "--ro-bind", path, &text);
    }
    for (from, to) in &spec.read_only_at {
        let text = to.display().to_string();
        bind(&mut args, "--ro-bind", from, &text);
    }
    let mut setenv = |key: &str, value: &str| args.extend(["--setenv".to_owned(), key.to_owned(), value.to_owned()]);
    setenv("HOME", inside::HOME);
    setenv("USER", "agent");
    setenv("LOGNAME", "agent");
    setenv("PATH", "/usr/local/bin:/usr/bin:/bin");
    setenv("LANG", "C.UTF-8");
    setenv("TMPDIR", "/tmp");
    for (key, value) in &spec.env {
        setenv(key, value);
    }
    let start_in = if spec.late_binds { "/" } else { inside::WORKSPACE };
    args.extend(["--chdir", start_in, "--json-status-fd"].map(str::to_owned));
    args.push(status_fd.to_string());
    // Last of the setup: after it every mount operation fails.
    args.extend(["--remount-ro", "/", "--"].map(str::to_owned));
    args.extend(spec.command.iter().cloned());
    args
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use super::*;
    use crate::{Limits, SandboxStdio};

    fn spec() -> SandboxSpec {
        SandboxSpec {
            name: "s1".into(),
            workspace: PathBuf::from("/srv/ws"),
            home: PathBuf::from("/srv/home"),
            egress_dir: Some(PathBuf::from("/srv/egress")),
            read_only: vec![PathBuf::from("/opt/agent")],
            read_only_at: Vec::new(),
            late_binds: false,
            env: vec![("HTTPS_PROXY".into(), "http://127.0.0.1:3128".into())],
            command: vec!["sortie".into(), "driver".into()],
            limits: Limits::default(),
            stdio: SandboxStdio::Null,
        }
    }

    fn position(args: &[String], needle: &[&str]) -> Option<usize> {
        args.windows(needle.len())
            .position(|w| w.iter().zip(needle).all(|(a, b)| a == b))
    }

    #[test]
    fn the_recipe_holds() {
        let args = arguments(&spec(), Path::new("/state/etc"), 3, |_| true);
        for needle in [
            &["--unshare-user", "--uid", "1000", "--gid", "1000", "--disable-userns"][..],
            &["--unshare-net"],
            &["--cap-drop", "ALL"],
            &["--bind", "/srv/ws", "/workspace"],
            &["--bind", "/srv/home", "/home/agent"],
            &["--ro-bind", "/srv/egress", "/run/sortie-egress"],
            &["--ro-bind", "/opt/agent", "/opt/agent"],
            &["--ro-bind", "/state/etc/passwd", "/etc/passwd"],
            &["--size", "536870912", "--tmpfs", "/tmp"],
            &["--json-status-fd", "3"],
        ] {
            assert!(position(&args, needle).is_some(), "{needle:?} in {args:?}");
        }
        let clearenv = position(&args, &["--clearenv"]).expect("clearenv");
        let first_setenv = position(&args, &["--setenv"]).expect("setenv");
        assert!(clearenv < first_setenv, "--clearenv before every --setenv");
        let remount = position(&args, &["--remount-ro", "/", "--", "sortie", "driver"]).expect("remount last");
        assert_eq!(remount + 5, args.len(), "the command ends the line");
        assert!(position(&args, &["--setenv", "HTTPS_PROXY", "http://127.0.0.1:3128"]).is_some());
        // Nothing else of the host: no /home, /root, /run or data dir bound.
        for forbidden in ["/root", "/var", "/run/docker.sock", "/etc/ssl/private", "/run/sortie"] {
            assert!(!args.iter().any(|a| a == forbidden), "{forbidden} must not be bound");
        }
    }

    #[test]
    fn optional_host_paths_are_skipped_when_missing() {
        let args = arguments(&spec(), Path::new("/state/etc"), 3, |path| {
            path != Path::new("/etc/ld.so.cache")
        });
        assert!(position(&args, &["--ro-bind", "/etc/ld.so.cache", "/etc/ld.so.cache"]).is_none());
        assert!(position(&args, &["--ro-bind", "/etc/alternatives", "/etc/alternatives"]).is_some());
    }
}
