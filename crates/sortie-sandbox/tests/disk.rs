//! A session's own disk (S10), with real images, `mkfs.ext4`, loop mounts and sandboxes: a write past the
//! quota fails with ENOSPC inside a sandbox and leaves the host's filesystem alone, the image is sparse,
//! `ensure` is idempotent and keeps files across unmounts, an image is never attached twice (not even while
//! a sandbox still holds it), twenty disks come and go at once without leaking a loop device, and refusals
//! say what to do. Loop mounts need root: without it these tests say so and check nothing.

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use sortie_sandbox::local::disk::{self, DiskError, DiskTools, Ensured, Quota, SessionDisk, Unmounted};
use sortie_sandbox::local::{LocalConfig, LocalRuntime};
use sortie_sandbox::{Limits, SandboxRuntime, SandboxSpec, SandboxStdio};

const MIB: u64 = 1 << 20;

fn as_root() -> bool {
    let root = nix::unistd::geteuid().is_root();
    if !root {
        eprintln!("skipped: loop mounts need root");
    }
    root
}

/// A temp dir whose path has a space (mountinfo escapes it), reachable by the sandbox uid. Unmounts what
/// is left mounted under it when dropped, so a failed test leaks no mount or loop device.
struct Scratch {
    temp: tempfile::TempDir,
}

impl Scratch {
    fn new() -> Self {
        let temp = tempfile::Builder::new().prefix("sortie disk ").tempdir().expect("temp");
        std::fs::set_permissions(temp.path(), std::fs::Permissions::from_mode(0o755)).expect("chmod");
        Self { temp }
    }

    fn root(&self) -> PathBuf {
        std::fs::canonicalize(self.temp.path()).expect("canonical")
    }

    /// A session directory's disk image and mount point.
    fn session(&self, name: &str) -> (PathBuf, PathBuf) {
        let dir = self.root().join(name);
        std::fs::create_dir_all(&dir).expect("session dir");
        (dir.join("disk.img"), dir.join("disk"))
    }

    /// The backing files of every loop device over a file in this scratch dir, as `losetup` lists them.
    fn loop_backing_files(&self) -> Vec<String> {
        let output = std::process::Command::new("losetup")
            .args(["--list", "--noheadings", "--raw", "-O", "BACK-FILE"])
            .output()
            .expect("losetup");
        let root = self.root().display().to_string();
        let root_raw = root.replace(' ', "\\x20");
        String::from_utf8_lossy(&output.stdout)
            .lines()
            .filter(|line| line.starts_with(&root) || line.starts_with(&root_raw))
            .map(str::to_owned)
            .collect()
    }

    /// Waits (the kernel frees an autoclear loop device asynchronously) until no loop device is left.
    fn assert_no_loop_device_within(&self, within: Duration) {
        let deadline = Instant::now() + within;
        loop {
            let left = self.loop_backing_files();
            if left.is_empty() {
                return;
            }
            assert!(Instant::now() < deadline, "loop devices leaked: {left:?}");
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let root = self.root();
        let Ok(mountinfo) = std::fs::read_to_string("/proc/self/mountinfo") else {
            return;
        };
        let escaped = root.display().to_string().replace(' ', "\\040");
        let mut points: Vec<String> = mountinfo
            .lines()
            .filter_map(|line| line.split(' ').nth(4))
            .filter(|point| point.starts_with(&escaped))
            .map(|point| point.replace("\\040", " "))
            .collect();
        points.reverse();
        for point in points {
            let _ = std::process::Command::new("umount").arg("-l").arg(point).status();
        }
    }
}

fn allocated_bytes(path: &Path) -> u64 {
    std::fs::metadata(path).expect("stat").blocks() * 512
}

fn host_available_bytes(path: &Path) -> u64 {
    let stats = nix::sys::statvfs::statvfs(path).expect("statvfs");
    stats.blocks_available() * stats.fragment_size()
}

fn canonical_image(image: &Path) -> PathBuf {
    std::fs::canonicalize(image.parent().expect("parent"))
        .expect("canonical")
        .join(image.file_name().expect("name"))
}

fn sandbox_spec(name: &str, workspace: PathBuf, home: PathBuf, script: &str) -> SandboxSpec {
    SandboxSpec {
        name: name.to_owned(),
        workspace,
        home,
        egress_dir: None,
        read_only: Vec::new(),
        read_only_at: Vec::new(),
        late_binds: false,
        env: Vec::new(),
        command: vec!["sh".into(), "-c".into(), script.into()],
        limits: Limits::default(),
        stdio: SandboxStdio::Null,
    }
}

async fn eventually(within: Duration, what: &str, mut done: impl FnMut() -> bool) {
    let probe = || std::future::ready(if done() { Ok(()) } else { Err("not yet") });
    sortie_testkit::wait::eventually(what, within, probe).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_past_the_quota_fails_with_enospc_inside_a_sandbox_and_spares_the_host() {
    if !as_root() {
        return;
    }
    let scratch = Scratch::new();
    let (image, mount_point) = scratch.session("ses quota");
    let quota = 64 * MIB;
    let disk = SessionDisk::ensure(&image, &mount_point, quota).await.expect("ensure");
    assert_eq!(disk.quota(), &Quota::Enforced { size_bytes: quota });
    let (workspace, home) = (disk.mount_point().join("workspace"), disk.mount_point().join("home"));
    for dir in [&workspace, &home] {
        std::fs::create_dir_all(dir).expect("dir");
    }
    let run_dir = scratch.root().join("ses quota").join("run");
    let state = scratch.root().join("state");
    for dir in [&run_dir, &state] {
        std::fs::create_dir_all(dir).expect("dir");
    }
    let host_before = host_available_bytes(&scratch.root());

    // 2 GiB asked for: without the quota the host would lose all of it.
    // The results go to /tmp while the disk is full, then into the workspace once a small reserve
    // made first is freed (the sandbox has no other writable place the host can read).
    let script = "head -c 262144 /dev/zero >/workspace/reserve; \
                  dd if=/dev/zero of=/workspace/big bs=1M count=2048 2>/tmp/dd.log; echo $? >/tmp/dd.rc; \
                  head -c 1048576 /dev/zero >/home/agent/more 2>/tmp/home.log; echo $? >/tmp/home.rc; \
                  rm /workspace/reserve; mkdir /workspace/out && cp /tmp/dd.log /tmp/dd.rc /tmp/home.log /tmp/home.rc /workspace/out/";
    let runtime = LocalRuntime::new(LocalConfig::new(state)).expect("runtime");
    runtime
        .create(sandbox_spec("disk-quota", workspace.clone(), home.clone(), script))
        .await
        .expect("create");
    runtime.start("disk-quota").await.expect("start");
    let exit = tokio::time::timeout(Duration::from_secs(120), runtime.wait("disk-quota"))
        .await
        .expect("the sandbox ends")
        .expect("wait");
    runtime.destroy("disk-quota").await.expect("destroy");
    assert_eq!(exit.code, Some(0), "{exit:?}");

    let read = |name: &str| std::fs::read_to_string(workspace.join("out").join(name)).expect(name);
    assert_ne!(read("dd.rc").trim(), "0", "dd must fail: {}", read("dd.log"));
    assert!(read("dd.log").contains("No space left on device"), "{}", read("dd.log"));
    assert_ne!(
        read("home.rc").trim(),
        "0",
        "$HOME shares the quota: {}",
        read("home.log")
    );
    assert!(
        read("home.log").contains("No space left on device"),
        "{}",
        read("home.log")
    );
    let written = std::fs::metadata(workspace.join("big")).expect("big").len();
    assert!(written <= quota, "{written} bytes written on a {quota}-byte disk");
    assert!(
        written >= quota / 2,
        "the agent could use its quota: only {written} bytes"
    );

    let usage = disk.usage().expect("usage");
    assert!(usage.is_full(), "{usage:?}");
    assert!(usage.describe().contains("disk is full"), "{}", usage.describe());
    assert!(
        allocated_bytes(&image) <= quota + MIB,
        "the image holds {} bytes on the host for a {quota}-byte quota",
        allocated_bytes(&image)
    );
    let host_after = host_available_bytes(&scratch.root());
    let lost = host_before.saturating_sub(host_after);
    // Other builds share this filesystem, so only a loss near the 2 GiB asked for would mean a leak.
    assert!(lost < 1 << 30, "the host lost {lost} bytes");

    disk::remove(&image, &mount_point).await.expect("remove");
    assert!(!image.exists() && !mount_point.exists());
    scratch.assert_no_loop_device_within(Duration::from_secs(10));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ensure_is_idempotent_and_files_survive_unmounts() {
    if !as_root() {
        return;
    }
    let scratch = Scratch::new();
    let (image, mount_point) = scratch.session("ses idem");
    let first = SessionDisk::ensure(&image, &mount_point, 32 * MIB)
        .await
        .expect("ensure");
    assert_eq!(first.ensured(), Ensured::Created);
    std::fs::create_dir_all(first.mount_point().join("workspace")).expect("dir");
    std::fs::write(first.mount_point().join("workspace/kept.txt"), "kept").expect("write");

    let again = SessionDisk::ensure(&image, &mount_point, 32 * MIB)
        .await
        .expect("ensure");
    assert_eq!(again.ensured(), Ensured::AlreadyMounted);
    let devices = disk::loop_devices_backed_by(&canonical_image(&image));
    assert_eq!(devices.len(), 1, "{devices:?}");
    // A different size asked for later does not touch an existing image.
    let resized = SessionDisk::ensure(&image, &mount_point, 64 * MIB)
        .await
        .expect("ensure");
    assert_eq!(resized.quota(), &Quota::Enforced { size_bytes: 32 * MIB });

    assert_eq!(
        disk::unmount(&mount_point).await.expect("unmount"),
        Unmounted::Unmounted
    );
    assert!(!disk::is_mounted(&image, &mount_point).expect("state"));
    assert!(
        !mount_point.join("workspace").exists(),
        "unmounted: the files are in the image only"
    );
    assert_eq!(
        disk::unmount(&mount_point).await.expect("unmount"),
        Unmounted::NotMounted
    );
    assert!(matches!(first.usage(), Err(DiskError::NotMounted(_))));
    scratch.assert_no_loop_device_within(Duration::from_secs(10));

    let remounted = SessionDisk::ensure(&image, &mount_point, 32 * MIB)
        .await
        .expect("ensure");
    assert_eq!(remounted.ensured(), Ensured::Remounted);
    assert_eq!(
        std::fs::read_to_string(remounted.mount_point().join("workspace/kept.txt")).expect("kept"),
        "kept"
    );
    assert!(disk::is_mounted(&image, &mount_point).expect("state"));
    assert!(!remounted.usage().expect("usage").is_full());

    disk::remove(&image, &mount_point).await.expect("remove");
    scratch.assert_no_loop_device_within(Duration::from_secs(10));
    disk::remove(&image, &mount_point)
        .await
        .expect("removing twice is fine");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_default_disk_is_sparse_and_gives_deleted_space_back_and_ensure_is_fast() {
    if !as_root() {
        return;
    }
    let scratch = Scratch::new();
    let mut cold = Vec::new();
    let mut warm = Vec::new();
    let mut mounted = Vec::new();
    for n in 0..5 {
        let (image, mount_point) = scratch.session(&format!("ses {n}"));
        let started = Instant::now();
        let disk = SessionDisk::ensure(&image, &mount_point, disk::DEFAULT_DISK_BYTES)
            .await
            .expect("ensure");
        cold.push(started.elapsed());
        assert_eq!(disk.ensured(), Ensured::Created);
        let allocated = allocated_bytes(&image);
        assert!(allocated < 64 * MIB, "a new 10 GiB image holds {allocated} bytes");
        let usage = disk.usage().expect("usage");
        assert!(
            usage.total_bytes > 9 << 30 && usage.total_bytes <= 10 << 30,
            "{usage:?}"
        );

        let started = Instant::now();
        assert_eq!(
            SessionDisk::ensure(&image, &mount_point, disk::DEFAULT_DISK_BYTES)
                .await
                .expect("ensure")
                .ensured(),
            Ensured::AlreadyMounted
        );
        mounted.push(started.elapsed());

        disk::unmount(&mount_point).await.expect("unmount");
        let started = Instant::now();
        assert_eq!(
            SessionDisk::ensure(&image, &mount_point, disk::DEFAULT_DISK_BYTES)
                .await
                .expect("ensure")
                .ensured(),
            Ensured::Remounted
        );
        warm.push(started.elapsed());
    }
    let median = |times: &mut Vec<Duration>| {
        times.sort();
        times[times.len() / 2]
    };
    let (cold, warm, mounted) = (median(&mut cold), median(&mut warm), median(&mut mounted));
    eprintln!(
        "ensure() of a 10 GiB disk, median of 5: cold {cold:?}, warm (unmounted image) {warm:?}, already mounted {mounted:?}"
    );
    assert!(cold < Duration::from_secs(10), "cold ensure took {cold:?}");
    assert!(warm < Duration::from_secs(10), "warm ensure took {warm:?}");

    // `discard`: deleting a file punches its blocks out of the image.
    let (image, mount_point) = scratch.session("ses 0");
    let big = mount_point.join("big");
    let chunk = vec![0x5a_u8; MIB as usize];
    {
        use std::io::Write;
        let mut file = std::fs::File::create(&big).expect("create");
        for _ in 0..128 {
            file.write_all(&chunk).expect("write");
        }
        file.sync_all().expect("sync");
    }
    let full = allocated_bytes(&image);
    assert!(full >= 128 * MIB, "the image holds {full} bytes after a 128 MiB write");
    std::fs::remove_file(&big).expect("delete");
    nix::unistd::syncfs(std::fs::File::open(&mount_point).expect("open")).expect("syncfs");
    eventually(
        Duration::from_secs(10),
        "the deleted file's space goes back to the host",
        || allocated_bytes(&image) < full - 100 * MIB,
    )
    .await;

    for n in 0..5 {
        let (image, mount_point) = scratch.session(&format!("ses {n}"));
        disk::remove(&image, &mount_point).await.expect("remove");
    }
    scratch.assert_no_loop_device_within(Duration::from_secs(10));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn twenty_disks_mount_and_unmount_at_once_without_leaking_loop_devices() {
    if !as_root() {
        return;
    }
    let scratch = Scratch::new();
    assert!(scratch.loop_backing_files().is_empty());
    let sessions: Vec<(PathBuf, PathBuf)> = (0..20).map(|n| scratch.session(&format!("ses {n:02}"))).collect();
    let ensure_all = |sessions: Vec<(PathBuf, PathBuf)>| async move {
        let tasks: Vec<_> = sessions
            .into_iter()
            .map(|(image, mount_point)| {
                tokio::spawn(async move { SessionDisk::ensure(&image, &mount_point, 32 * MIB).await })
            })
            .collect();
        let mut disks = Vec::new();
        for task in tasks {
            disks.push(task.await.expect("task").expect("ensure"));
        }
        disks
    };

    let started = Instant::now();
    let disks = ensure_all(sessions.clone()).await;
    eprintln!("20 new disks at once: {:?}", started.elapsed());
    assert!(disks.iter().all(|disk| disk.ensured() == Ensured::Created));
    let mut devices: Vec<PathBuf> = sessions
        .iter()
        .flat_map(|(image, _)| disk::loop_devices_backed_by(&canonical_image(image)))
        .collect();
    devices.sort();
    devices.dedup();
    assert_eq!(devices.len(), 20, "one loop device per disk: {devices:?}");
    assert_eq!(scratch.loop_backing_files().len(), 20);
    for (n, disk) in disks.iter().enumerate() {
        std::fs::write(disk.mount_point().join("whose"), n.to_string()).expect("write");
    }

    let unmount_all = |sessions: Vec<(PathBuf, PathBuf)>| async move {
        let tasks: Vec<_> = sessions
            .into_iter()
            .map(|(_, mount_point)| tokio::spawn(async move { disk::unmount(&mount_point).await }))
            .collect();
        let mut outcomes = Vec::new();
        for task in tasks {
            outcomes.push(task.await.expect("task").expect("unmount"));
        }
        outcomes
    };
    let outcomes = unmount_all(sessions.clone()).await;
    assert!(
        outcomes.iter().all(|outcome| *outcome == Unmounted::Unmounted),
        "{outcomes:?}"
    );
    scratch.assert_no_loop_device_within(Duration::from_secs(20));

    let started = Instant::now();
    let disks = ensure_all(sessions.clone()).await;
    eprintln!("20 existing disks mounted again at once: {:?}", started.elapsed());
    for (n, disk) in disks.iter().enumerate() {
        assert_eq!(disk.ensured(), Ensured::Remounted);
        assert_eq!(
            std::fs::read_to_string(disk.mount_point().join("whose")).expect("whose"),
            n.to_string(),
            "each session sees its own disk"
        );
    }
    for (image, mount_point) in &sessions {
        disk::remove(image, mount_point).await.expect("remove");
    }
    scratch.assert_no_loop_device_within(Duration::from_secs(20));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_disk_a_sandbox_still_holds_is_joined_again_never_attached_twice() {
    if !as_root() {
        return;
    }
    let scratch = Scratch::new();
    let (image, mount_point) = scratch.session("ses held");
    let disk = SessionDisk::ensure(&image, &mount_point, 32 * MIB)
        .await
        .expect("ensure");
    let (workspace, home) = (disk.mount_point().join("workspace"), disk.mount_point().join("home"));
    let run_dir = scratch.root().join("ses held").join("run");
    let state = scratch.root().join("state");
    for dir in [&workspace, &home, &run_dir, &state] {
        std::fs::create_dir_all(dir).expect("dir");
    }
    let runtime = LocalRuntime::new(LocalConfig::new(state)).expect("runtime");
    let script = "while [ ! -e /workspace/go ]; do sleep 0.02; done; echo from-sandbox >/workspace/answer; sleep 60";
    runtime
        .create(sandbox_spec("disk-held", workspace.clone(), home, script))
        .await
        .expect("create");
    runtime.start("disk-held").await.expect("start");

    // The host lets go while the sandbox still has /workspace bound.
    let outcome = disk::unmount(&mount_point).await.expect("unmount");
    assert_ne!(outcome, Unmounted::NotMounted);
    assert!(!disk::is_mounted(&image, &mount_point).expect("state"));
    let held_by = disk::loop_devices_backed_by(&canonical_image(&image));
    assert_eq!(held_by.len(), 1, "the sandbox keeps the filesystem alive: {held_by:?}");

    let again = SessionDisk::ensure(&image, &mount_point, 32 * MIB)
        .await
        .expect("ensure");
    assert_eq!(again.ensured(), Ensured::Remounted);
    assert_eq!(
        disk::loop_devices_backed_by(&canonical_image(&image)),
        held_by,
        "the mount joined the sandbox's filesystem instead of attaching the image again"
    );
    // A live ext4 keeps `needs_recovery` on disk; e2fsck run under it would have replayed the journal and
    // cleared it, writing beneath the kernel.
    let header = std::process::Command::new("dumpe2fs")
        .arg("-h")
        .arg(&image)
        .output()
        .expect("dumpe2fs");
    let header = String::from_utf8_lossy(&header.stdout);
    assert!(
        header
            .lines()
            .any(|line| line.starts_with("Filesystem features:") && line.contains("needs_recovery")),
        "e2fsck must not touch a filesystem in use: {header}"
    );
    std::fs::write(workspace.join("go"), "").expect("go");
    let answer = workspace.join("answer");
    eventually(
        Duration::from_secs(10),
        "the sandbox answers on the same filesystem",
        || std::fs::read_to_string(&answer).is_ok_and(|text| text == "from-sandbox\n"),
    )
    .await;

    runtime.destroy("disk-held").await.expect("destroy");
    assert_eq!(
        disk::unmount(&mount_point).await.expect("unmount"),
        Unmounted::Unmounted
    );
    scratch.assert_no_loop_device_within(Duration::from_secs(10));
    let fsck = std::process::Command::new("e2fsck")
        .arg("-fn")
        .arg(&image)
        .output()
        .expect("e2fsck");
    assert!(
        fsck.status.success(),
        "the filesystem is consistent: {}{}",
        String::from_utf8_lossy(&fsck.stdout),
        String::from_utf8_lossy(&fsck.stderr)
    );
    disk::remove(&image, &mount_point).await.expect("remove");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_busy_disk_is_detached_lazily_and_joined_again() {
    if !as_root() {
        return;
    }
    let scratch = Scratch::new();
    let (image, mount_point) = scratch.session("ses busy");
    let disk = SessionDisk::ensure(&image, &mount_point, 32 * MIB)
        .await
        .expect("ensure");
    let workspace = disk.mount_point().join("workspace");
    std::fs::create_dir_all(&workspace).expect("dir");
    std::fs::write(workspace.join("kept"), "kept").expect("write");
    let mut busy = std::process::Command::new("sleep")
        .arg("60")
        .current_dir(&workspace)
        .spawn()
        .expect("sleep");

    let outcome = disk::unmount(&mount_point).await;
    let joined = SessionDisk::ensure(&image, &mount_point, 32 * MIB).await;
    let devices = disk::loop_devices_backed_by(&canonical_image(&image));
    let _ = busy.kill();
    let _ = busy.wait();
    assert_eq!(outcome.expect("unmount"), Unmounted::Detached);
    assert_eq!(joined.expect("ensure").ensured(), Ensured::Remounted);
    assert_eq!(devices.len(), 1, "{devices:?}");
    assert_eq!(std::fs::read_to_string(workspace.join("kept")).expect("kept"), "kept");

    disk::remove(&image, &mount_point).await.expect("remove");
    scratch.assert_no_loop_device_within(Duration::from_secs(10));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refusals_say_what_to_do() {
    if !as_root() {
        return;
    }
    let scratch = Scratch::new();

    let (image, mount_point) = scratch.session("ses small");
    let small = SessionDisk::ensure(&image, &mount_point, MIB)
        .await
        .expect_err("too small");
    assert!(small.to_string().contains("at least"), "{small}");
    let relative = SessionDisk::ensure(Path::new("disk.img"), &mount_point, 32 * MIB)
        .await
        .expect_err("relative");
    assert!(matches!(relative, DiskError::NotAbsolute(_)), "{relative}");

    let tools = DiskTools {
        mkfs_ext4: PathBuf::from("/nonexistent/mkfs.ext4"),
        ..DiskTools::default()
    };
    let missing = SessionDisk::ensure_with(&tools, &image, &mount_point, 32 * MIB)
        .await
        .expect_err("no mkfs");
    assert!(missing.to_string().contains("apt-get install e2fsprogs"), "{missing}");
    assert!(!image.exists(), "no half-made image is left");

    let (image, mount_point) = scratch.session("ses foreign");
    std::fs::create_dir_all(&mount_point).expect("dir");
    let mounted = std::process::Command::new("mount")
        .args(["-t", "tmpfs", "-o", "size=1m", "tmpfs"])
        .arg(&mount_point)
        .status()
        .expect("mount");
    assert!(mounted.success());
    let foreign = SessionDisk::ensure(&image, &mount_point, 32 * MIB)
        .await
        .expect_err("foreign");
    assert!(
        matches!(foreign, DiskError::ForeignMount { .. }) && foreign.to_string().contains("umount"),
        "{foreign}"
    );
    assert_eq!(
        disk::unmount(&mount_point).await.expect("unmount"),
        Unmounted::Unmounted
    );

    let (image, mount_point) = scratch.session("ses hidden");
    SessionDisk::ensure(&image, &mount_point, 32 * MIB)
        .await
        .expect("ensure");
    disk::unmount(&mount_point).await.expect("unmount");
    std::fs::write(mount_point.join("stray"), "written while unmounted").expect("write");
    let hidden = SessionDisk::ensure(&image, &mount_point, 32 * MIB)
        .await
        .expect_err("not empty");
    assert!(matches!(hidden, DiskError::MountPointNotEmpty { .. }), "{hidden}");
    assert!(hidden.to_string().contains("would hide them"), "{hidden}");

    let (image, mount_point) = scratch.session("ses legacy");
    std::fs::create_dir_all(mount_point.join("workspace")).expect("dir");
    let legacy = SessionDisk::ensure(&image, &mount_point, 32 * MIB)
        .await
        .expect("ensure");
    assert_eq!(legacy.ensured(), Ensured::PlainDirectory);
    assert!(
        matches!(legacy.quota(), Quota::Unenforced { reason } if reason.contains("predate")),
        "{:?}",
        legacy.quota()
    );
    assert!(!image.exists());
    assert!(legacy.usage().expect("usage").total_bytes > 0);

    let (image, mount_point) = scratch.session("ses dir image");
    std::fs::create_dir_all(&image).expect("dir");
    let not_image = SessionDisk::ensure(&image, &mount_point, 32 * MIB)
        .await
        .expect_err("a directory");
    assert!(matches!(not_image, DiskError::NotAnImage(_)), "{not_image}");

    scratch.assert_no_loop_device_within(Duration::from_secs(10));
}

/// A spare made ahead becomes one session's disk, once: a second session finds none left and makes its
/// own; a spare of another size is passed over, and neither replaces an image a session has already.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_spare_disk_becomes_one_sessions_disk_and_only_of_its_size() {
    if !as_root() {
        return;
    }
    let scratch = Scratch::new();
    let spares = scratch.root().join("spares");
    std::fs::create_dir_all(&spares).expect("spares");
    disk::make_spare(&spares.join("a.img"), 32 * MIB).await.expect("spare");
    disk::make_spare(&spares.join("other.img"), 64 * MIB)
        .await
        .expect("spare");
    assert!(disk::is_spare(&spares.join("a.img"), 32 * MIB));
    assert!(!disk::is_spare(&spares.join("other.img"), 32 * MIB));

    let (image, mount_point) = scratch.session("ses first");
    let first = SessionDisk::ensure_from_spares(&image, &mount_point, 32 * MIB, &spares)
        .await
        .expect("ensure");
    // The spare's image, mounted: not one made now.
    assert_eq!(first.ensured(), Ensured::Remounted);
    assert!(!spares.join("a.img").exists());
    assert_eq!(first.quota(), &Quota::Enforced { size_bytes: 32 * MIB });

    let (image, mount_point) = scratch.session("ses second");
    let second = SessionDisk::ensure_from_spares(&image, &mount_point, 32 * MIB, &spares)
        .await
        .expect("ensure");
    assert_eq!(second.ensured(), Ensured::Created);
    assert!(spares.join("other.img").exists(), "a spare of another size stays");

    // An image of its own is kept whatever spare there is.
    disk::unmount(&mount_point).await.expect("unmount");
    disk::make_spare(&spares.join("b.img"), 32 * MIB).await.expect("spare");
    let again = SessionDisk::ensure_from_spares(&image, &mount_point, 32 * MIB, &spares)
        .await
        .expect("ensure");
    assert_eq!(again.ensured(), Ensured::Remounted);
    assert!(spares.join("b.img").exists());
    for (_, mount_point) in [scratch.session("ses first"), scratch.session("ses second")] {
        disk::unmount(&mount_point).await.expect("unmount");
    }
}
