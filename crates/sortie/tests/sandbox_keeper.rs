//! Sandboxes held by a keeper (`sortie sandbox keep`, as `sortie serve` makes them) outlive the
//! runtime that made them: another runtime adopts them (and can destroy them); a sandbox no runtime
//! adopts dies once its lease has gone stale for the orphan grace. Needs root, as CI runs it.

mod support;

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use sortie_sandbox::local::{Keeper, LocalConfig, LocalRuntime};
use sortie_sandbox::{Limits, SandboxError, SandboxRuntime, SandboxSpec, SandboxStatus, SandboxStdio};

fn runtime(root: &Path, grace: Option<Duration>) -> LocalRuntime {
    let mut config = LocalConfig::new(root.join("state"));
    config.keeper = grace.map(|orphan_grace| Keeper {
        program: PathBuf::from(support::BINARY),
        args: vec!["sandbox".into(), "keep".into()],
        orphan_grace,
    });
    LocalRuntime::new(config).expect("runtime")
}

fn spec(root: &Path, name: &str, marker: &str) -> SandboxSpec {
    let dir = root.join(name);
    for sub in ["workspace", "home"] {
        std::fs::create_dir_all(dir.join(sub)).expect("dir");
    }
    SandboxSpec {
        name: name.to_owned(),
        workspace: dir.join("workspace"),
        home: dir.join("home"),
        egress_dir: None,
        read_only: Vec::new(),
        read_only_at: Vec::new(),
        late_binds: false,
        env: Vec::new(),
        command: vec!["sh".into(), "-c".into(), format!("sleep 600; : {marker}")],
        limits: Limits::default(),
        stdio: SandboxStdio::Null,
    }
}

/// Processes of the sandbox: its shell, whose command line holds the marker.
fn alive(marker: &str) -> bool {
    std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .filter(|entry| entry.file_name().to_string_lossy().parse::<u32>().is_ok())
        .filter_map(|entry| std::fs::read(entry.path().join("cmdline")).ok())
        .any(|cmdline| {
            let cmdline = String::from_utf8_lossy(&cmdline);
            cmdline.starts_with("sh\0-c\0") && cmdline.contains(marker)
        })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kept_sandbox_outlives_its_runtime_until_adopted_or_orphaned() {
    let temp = tempfile::tempdir().expect("temp");
    std::fs::set_permissions(temp.path(), std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let root = temp.path();
    let grace = Duration::from_secs(2);
    let adopted_marker = format!("kept-adopted-{}", std::process::id());
    let orphan_marker = format!("kept-orphan-{}", std::process::id());

    // Two sandboxes made by a runtime that then goes away (its process died, say).
    {
        let first = runtime(root, Some(grace));
        for (name, marker) in [("adopted", &adopted_marker), ("orphan", &orphan_marker)] {
            first.create(spec(root, name, marker)).await.expect("create");
            first.start(name).await.expect("start");
        }
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    while !(alive(&adopted_marker) && alive(&orphan_marker)) {
        assert!(Instant::now() < deadline, "the sandboxes did not outlive their runtime");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    // A runtime that cannot keep sandboxes cannot adopt one; a keeping runtime adopts a live one only.
    let plain = runtime(root, None);
    assert!(matches!(
        plain.adopt("adopted").await,
        Err(SandboxError::Unsupported(_))
    ));
    let second = runtime(root, Some(grace));
    assert!(second.adopt("never-made").await.is_err());
    second.adopt("adopted").await.expect("adopt");
    assert!(matches!(second.status("adopted").await, Ok(SandboxStatus::Running)));

    // Nobody renews the orphan's lease: it is gone after the grace. The adopted one, renewed, stays.
    let orphaned_at = Instant::now();
    while alive(&orphan_marker) {
        assert!(
            orphaned_at.elapsed() < grace + Duration::from_secs(10),
            "the orphan outlived its grace"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(
        orphaned_at.elapsed() + Duration::from_millis(600) >= grace,
        "killed before its grace"
    );
    assert!(alive(&adopted_marker), "the adopted sandbox lives on past the grace");

    // The adopting runtime owns it: it ends when destroyed.
    second.destroy("adopted").await.expect("destroy");
    assert!(!alive(&adopted_marker), "destroy left a process of the adopted sandbox");
    assert!(matches!(second.status("adopted").await, Err(SandboxError::Unknown(_))));
    // What is left of the orphan (its cgroup) is cleaned up by name.
    let _ = second.destroy("orphan").await;
}
