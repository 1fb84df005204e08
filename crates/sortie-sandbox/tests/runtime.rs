//! The local runtime through its trait: teardown that leaves nothing behind even when bwrap dies
//! during setup, usage accounting, and failures that say what to do.

use std::os::unix::fs::PermissionsExt;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use sortie_sandbox::local::{LocalConfig, LocalRuntime};
use sortie_sandbox::{Limits, SandboxError, SandboxRuntime, SandboxSpec, SandboxStatus, SandboxStdio};

struct Layout {
    _temp: tempfile::TempDir,
    root: PathBuf,
}

fn layout() -> Layout {
    let temp = tempfile::tempdir().expect("temp");
    std::fs::set_permissions(temp.path(), std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let root = temp.path().to_owned();
    for dir in ["workspace", "home", "state"] {
        std::fs::create_dir_all(root.join(dir)).expect("dir");
    }
    Layout { _temp: temp, root }
}

fn runtime(layout: &Layout) -> LocalRuntime {
    LocalRuntime::new(LocalConfig::new(layout.root.join("state"))).expect("runtime")
}

fn spec(layout: &Layout, name: &str, command: &[&str]) -> SandboxSpec {
    SandboxSpec {
        name: name.to_owned(),
        workspace: layout.root.join("workspace"),
        home: layout.root.join("home"),
        egress_dir: None,
        read_only: Vec::new(),
        read_only_at: Vec::new(),
        late_binds: false,
        env: Vec::new(),
        command: command.iter().map(|s| (*s).to_owned()).collect(),
        limits: Limits::default(),
        stdio: SandboxStdio::Null,
    }
}

fn processes_with(marker: &str) -> usize {
    std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .filter(|entry| entry.file_name().to_string_lossy().parse::<u32>().is_ok())
        .filter_map(|entry| std::fs::read(entry.path().join("cmdline")).ok())
        .filter(|cmdline| String::from_utf8_lossy(cmdline).contains(marker))
        .count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killing_bwrap_during_setup_never_leaves_a_process_behind() {
    let layout = layout();
    let runtime = std::sync::Arc::new(runtime(&layout));
    let marker = format!("setup-race-{}", std::process::id());
    let mut seed: u64 = 0x5DEE_CE66_D1CE_4E5B;
    for trial in 0..50 {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        let delay = Duration::from_micros(seed % 20_000);
        let name = format!("race-{trial}");
        let script = format!("python3 -c 'import time; time.sleep(60)' {marker} & setsid sleep 60 & wait");
        runtime
            .create(spec(&layout, &name, &["sh", "-c", &script]))
            .await
            .expect("create");
        let starter = {
            let runtime = runtime.clone();
            let name = name.clone();
            tokio::spawn(async move { runtime.start(&name).await })
        };
        let deadline = Instant::now() + Duration::from_secs(10);
        let pid = loop {
            if let Some(pid) = runtime.host_pid(&name) {
                break pid;
            }
            assert!(Instant::now() < deadline, "trial {trial}: bwrap was not spawned");
            tokio::time::sleep(Duration::from_micros(200)).await;
        };
        tokio::time::sleep(delay).await;
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(pid as i32),
            nix::sys::signal::Signal::SIGKILL,
        );
        let _ = starter.await;
        runtime
            .destroy(&name)
            .await
            .unwrap_or_else(|error| panic!("trial {trial} ({delay:?}): {error}"));
        assert_eq!(
            processes_with(&marker),
            0,
            "trial {trial} ({delay:?}): a sandbox process survived teardown"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn usage_is_measured_and_the_exit_reported() {
    let layout = layout();
    let runtime = runtime(&layout);
    let burn = "python3 -c 'import time\nt = time.process_time()\nx = bytearray(64 << 20)\nwhile time.process_time() - t < 0.3: pass'; exit 3";
    runtime
        .create(spec(&layout, "burn", &["sh", "-c", burn]))
        .await
        .expect("create");
    assert_eq!(runtime.status("burn").await.expect("status"), SandboxStatus::Created);
    runtime.start("burn").await.expect("start");
    let exit = runtime.wait("burn").await.expect("wait");
    assert_eq!((exit.code, exit.out_of_memory), (Some(3), false));
    assert!(matches!(
        runtime.status("burn").await.expect("status"),
        SandboxStatus::Exited(_)
    ));
    let usage = runtime.destroy("burn").await.expect("destroy");
    assert!(usage.cpu_seconds >= 0.25, "{usage:?}");
    assert!(usage.peak_memory_bytes >= 64 << 20, "{usage:?}");
    assert!(matches!(runtime.status("burn").await, Err(SandboxError::Unknown(_))));
}

/// All sandboxes together weigh a quarter of the default when the CPU is contended, so `sortie serve`
/// answers while they run (DESIGN §17). Read back from the kernel, on whichever cgroup version this
/// machine has. The weight is set when sortie makes the group, so a machine where an operator set
/// another one fails this test: CI's machines start without the group.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sandboxes_together_yield_the_cpu_to_the_host() {
    let layout = layout();
    let runtime = runtime(&layout);
    runtime
        .create(spec(&layout, "weighed", &["true"]))
        .await
        .expect("create");
    let root = std::path::Path::new("/sys/fs/cgroup");
    let (file, expected) = if root.join("cgroup.controllers").is_file() {
        (root.join("sortie/cpu.weight"), "25")
    } else {
        (root.join("cpu/sortie/cpu.shares"), "256")
    };
    let weight = std::fs::read_to_string(&file).unwrap_or_else(|error| panic!("{}: {error}", file.display()));
    runtime.destroy("weighed").await.expect("destroy");
    assert_eq!(weight.trim(), expected, "{}", file.display());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stop_ends_a_running_sandbox() {
    let layout = layout();
    let runtime = runtime(&layout);
    runtime
        .create(spec(&layout, "sleepy", &["sh", "-c", "trap '' TERM; sleep 60"]))
        .await
        .expect("create");
    runtime.start("sleepy").await.expect("start");
    let started = Instant::now();
    runtime.stop("sleepy", Duration::from_millis(300)).await.expect("stop");
    let exit = runtime.wait("sleepy").await.expect("wait");
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "stopped in {:?}",
        started.elapsed()
    );
    assert!(exit.code != Some(0), "{exit:?}");
    runtime.destroy("sleepy").await.expect("destroy");
}

#[tokio::test]
async fn failures_say_what_to_do() {
    let layout = layout();
    let mut config = LocalConfig::new(layout.root.join("state"));
    config.bwrap = PathBuf::from("/nonexistent/bwrap");
    let missing = LocalRuntime::new(config).err().expect("refused");
    assert!(missing.to_string().contains("apt-get install bubblewrap"), "{missing}");

    let runtime = runtime(&layout);
    let bad_name = runtime.create(spec(&layout, "../escape", &["true"])).await;
    assert!(matches!(bad_name, Err(SandboxError::Spec(_))), "{bad_name:?}");
    let mut relative = spec(&layout, "relative", &["true"]);
    relative.workspace = PathBuf::from("workspace");
    assert!(matches!(runtime.create(relative).await, Err(SandboxError::Spec(_))));
    if nix::unistd::geteuid().is_root() {
        let hidden = layout.root.join("private");
        std::fs::create_dir_all(hidden.join("ws")).expect("dir");
        std::fs::set_permissions(&hidden, std::fs::Permissions::from_mode(0o700)).expect("chmod");
        let mut unreachable = spec(&layout, "unreachable", &["true"]);
        unreachable.workspace = hidden.join("ws");
        let error = runtime.create(unreachable).await.expect_err("refused");
        assert!(
            error.to_string().contains("not reachable by the sandbox uid"),
            "{error}"
        );
    }
    runtime.create(spec(&layout, "twice", &["true"])).await.expect("create");
    assert!(matches!(
        runtime.create(spec(&layout, "twice", &["true"])).await,
        Err(SandboxError::Exists(_))
    ));
    runtime.destroy("twice").await.expect("destroy");
}

/// The host-held socket reaches the command as its stdin through everything between (the wrapper,
/// setpriv, bwrap), and the sandbox has no name for it: the host's path is not inside.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_listening_socket_of_the_host_reaches_the_command_as_stdin() {
    let layout = layout();
    let runtime = runtime(&layout);
    let host_dir = layout.root.join("host");
    std::fs::create_dir_all(&host_dir).expect("host dir");
    std::fs::set_permissions(&host_dir, std::fs::Permissions::from_mode(0o700)).expect("chmod");
    let socket = host_dir.join("driver.sock");
    let listener = std::os::unix::net::UnixListener::bind(&socket).expect("bind");
    let script = format!(
        "import os, socket\n\
         seen = os.path.exists({path:?}) or os.path.exists('/run/sortie')\n\
         s = socket.socket(fileno=0)\n\
         c, _ = s.accept()\n\
         c.sendall(b'served from inside; host path visible: %d' % seen)\n\
         c.close()\n",
        path = socket.display().to_string()
    );
    let mut spec = spec(&layout, "listener", &["python3", "-c", &script]);
    spec.stdio = SandboxStdio::Listener(std::sync::Arc::new(listener));
    runtime.create(spec).await.expect("create");
    runtime.start("listener").await.expect("start");
    let said = tokio::task::spawn_blocking(move || {
        use std::io::Read;
        let mut stream = std::os::unix::net::UnixStream::connect(&socket).expect("connect to the host path");
        stream.set_read_timeout(Some(Duration::from_secs(30))).expect("timeout");
        let mut said = String::new();
        stream.read_to_string(&mut said).expect("read");
        said
    })
    .await
    .expect("join");
    assert_eq!(said, "served from inside; host path visible: 0");
    let exit = tokio::time::timeout(Duration::from_secs(30), runtime.wait("listener"))
        .await
        .expect("ends")
        .expect("wait");
    assert_eq!(exit.code, Some(0));
    runtime.destroy("listener").await.expect("destroy");
}

/// The turn-end sweep: what ran before keeps running, everything started since (a background job, a
/// `setsid` child that left the process group) is killed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_newer_spares_what_ran_before_and_kills_what_came_since() {
    let layout = layout();
    let runtime = runtime(&layout);
    let marker = format!("sweep-{}", std::process::id());
    let script = format!(
        "touch /workspace/ready; while [ ! -e /workspace/go ]; do sleep 0.05; done; \
         sleep 600 & setsid sleep 601 & touch /workspace/started; \
         while :; do sleep 0.05; done; : {marker}"
    );
    runtime
        .create(spec(&layout, "sweep", &["sh", "-c", &script]))
        .await
        .expect("create");
    runtime.start("sweep").await.expect("start");
    // `start` returns once the namespaces exist; the command is what "ran before" the turn.
    let deadline = Instant::now() + Duration::from_secs(30);
    while !layout.root.join("workspace/ready").exists() {
        assert!(Instant::now() < deadline, "the sandbox's command did not start");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let before = runtime.processes("sweep").await.expect("processes");
    assert!(!before.is_empty(), "the sandbox has processes");
    std::fs::write(layout.root.join("workspace/go"), "").expect("go");
    let deadline = Instant::now() + Duration::from_secs(30);
    while !layout.root.join("workspace/started").exists() {
        assert!(Instant::now() < deadline, "the sandbox did not start its children");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let sleeping = |seconds: &str| -> usize {
        std::fs::read_dir("/proc")
            .expect("proc")
            .flatten()
            .filter(|entry| {
                let cmdline = std::fs::read(entry.path().join("cmdline")).unwrap_or_default();
                cmdline == format!("sleep\0{seconds}\0").into_bytes()
            })
            .count()
    };
    // `touch` may run before the children have exec'd their `sleep`.
    while (sleeping("600"), sleeping("601")) != (1, 1) {
        assert!(Instant::now() < deadline, "both children run");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let killed = runtime.kill_newer("sweep", &before).await.expect("sweep");
    assert!(killed >= 2, "killed {killed}");
    assert_eq!(
        (sleeping("600"), sleeping("601")),
        (0, 0),
        "nothing started since survives"
    );
    assert!(processes_with(&marker) >= 1, "the command that ran before still runs");
    assert!(
        matches!(runtime.status("sweep").await, Ok(SandboxStatus::Running)),
        "the sandbox goes on"
    );
    runtime.destroy("sweep").await.expect("destroy");
    assert_eq!(processes_with(&marker), 0);
}

/// A warm sandbox gets its session after it started: what the host binds into its slot then appears
/// inside, a mirror read-only (its directory is the sandbox uid's, so only the mount's flag stops a
/// write) and nothing set-uid, and the sandbox can neither write nor remount it, nor write under the
/// session's workspace through a process that was there before it (bwrap's pid 1). Releasing the slot
/// takes every bind down and leaves what was bound whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_is_bound_into_a_running_warm_sandbox_appears_inside_read_only_where_asked() {
    use sortie_sandbox::local::slot::WarmSlot;
    if !nix::unistd::geteuid().is_root() {
        eprintln!("skipped: binding into a running sandbox needs root");
        return;
    }
    let layout = layout();
    let runtime = runtime(&layout);
    let (uid, gid) = runtime.host_owner().expect("as root, sandboxes have a host uid");
    let (workspace, mirror) = (layout.root.join("session-workspace"), layout.root.join("mirror"));
    for dir in [&workspace, &mirror] {
        std::fs::create_dir_all(dir).expect("dir");
        std::os::unix::fs::chown(dir, Some(uid), Some(gid)).expect("chown");
    }
    std::fs::write(workspace.join("hello"), "hello").expect("write");
    std::fs::write(mirror.join("obj"), "obj").expect("write");
    let slot = WarmSlot::new(layout.root.join("pool/warm_test"), layout.root.join("warm/warm_test"));
    slot.prepare().expect("prepare");
    let script = "i=0; until [ -f /workspace/hello ] && [ -f /srv/mirrors/m/obj ]; do i=$((i+1)); \
                  [ $i -gt 2000 ] && exit 9; sleep 0.01; done; r=/workspace/report; \
                  echo \"ws-$(cat /workspace/hello)\" > $r; touch /workspace/new && echo ws-writable >> $r; \
                  (touch /srv/mirrors/m/x 2>/dev/null && echo mirror-writable || echo mirror-read-only) >> $r; \
                  grep ' /srv/mirrors/m ' /proc/self/mountinfo >> $r; \
                  (mount -o remount,rw /srv/mirrors/m 2>/dev/null && echo remounted || echo not-remounted) >> $r; \
                  (touch /proc/1/cwd/x 2>/dev/null && echo under-the-bind || echo not-under-the-bind) >> $r; \
                  (touch /proc/self/cwd/x 2>/dev/null && echo in-its-start || echo not-in-its-start) >> $r";
    let mut spec = spec(&layout, "warm_test", &["sh", "-c", script]);
    spec.workspace = slot.workspace();
    spec.home = slot.home();
    spec.read_only_at = vec![(slot.mirrors(), PathBuf::from("/srv/mirrors"))];
    spec.late_binds = true;
    runtime.create(spec).await.expect("create");
    runtime.start("warm_test").await.expect("start");
    slot.bind(&workspace, &slot.workspace(), false)
        .expect("bind the workspace");
    slot.bind(&mirror, &slot.mirrors().join("m"), true)
        .expect("bind the mirror");
    let exit = tokio::time::timeout(Duration::from_secs(60), runtime.wait("warm_test"))
        .await
        .expect("the sandbox ended")
        .expect("wait");
    assert_eq!(exit.code, Some(0), "{exit:?}");
    runtime.destroy("warm_test").await.expect("destroy");
    let report = std::fs::read_to_string(workspace.join("report")).expect("the sandbox's report");
    // Nothing inside writes under the session's binds, through a process that started before them.
    for said in [
        "ws-hello",
        "ws-writable",
        "mirror-read-only",
        "not-remounted",
        "not-under-the-bind",
        "not-in-its-start",
    ] {
        assert!(report.contains(said), "{said}: {report}");
    }
    let mount = report
        .lines()
        .find(|line| line.contains(" /srv/mirrors/m "))
        .expect("the mirror's mount");
    let options = mount.split(' ').nth(5).expect("mount options");
    for option in ["ro", "nosuid", "nodev"] {
        assert!(options.split(',').any(|o| o == option), "{option}: {mount}");
    }
    slot.release().expect("release");
    assert!(!slot.root().exists() && !slot.egress().exists());
    assert!(sortie_sandbox::local::slot::unmount_if_empty(&layout.root.join("pool")));
    assert!(workspace.join("new").is_file() && mirror.join("obj").is_file());
    assert!(!mirror.join("x").exists());
    let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").expect("mountinfo");
    assert!(
        !mountinfo.contains(layout.root.join("pool").to_str().expect("utf-8")),
        "{mountinfo}"
    );
}
