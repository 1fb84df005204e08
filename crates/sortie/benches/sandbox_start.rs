//! Sandbox start to driver-ready (DESIGN §6.1 target: p50 < 150 ms) and teardown, over 50 starts,
//! beside a baseline measured in the same run: the same `sortie driver` started on the host, with no
//! sandbox. Ready = `GET /status` answers on `driver.sock`.
//!
//! `cargo bench -p sortie --bench sandbox_start` (as root for the real layout; `SORTIE_BENCH_STARTS`).

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use sortie_sandbox::local::{LocalConfig, LocalRuntime};
use sortie_sandbox::{Limits, SandboxRuntime, SandboxSpec, SandboxStdio, inside};

const SORTIE: &str = env!("CARGO_BIN_EXE_sortie");

async fn wait_ready(socket: &Path) -> Duration {
    let started = Instant::now();
    loop {
        if let Ok(mut stream) = tokio::net::UnixStream::connect(socket).await {
            use tokio::io::{AsyncReadExt, AsyncWriteExt};
            if stream
                .write_all(b"GET /status HTTP/1.1\r\nhost: driver\r\nconnection: close\r\n\r\n")
                .await
                .is_ok()
            {
                let mut answer = Vec::new();
                let _ = stream.read_to_end(&mut answer).await;
                if answer.starts_with(b"HTTP/1.1 200") {
                    return started.elapsed();
                }
            }
        }
        assert!(started.elapsed() < Duration::from_secs(20), "never ready");
        tokio::time::sleep(Duration::from_micros(500)).await;
    }
}

fn percentile(samples: &mut [Duration], q: f64) -> Duration {
    samples.sort_unstable();
    samples[((samples.len() as f64 * q).ceil() as usize)
        .saturating_sub(1)
        .min(samples.len() - 1)]
}

fn ms(d: Duration) -> String {
    format!("{:.1} ms", d.as_secs_f64() * 1000.0)
}

fn open_dir(path: PathBuf) -> PathBuf {
    std::fs::create_dir_all(&path).expect("dir");
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    path
}

fn main() {
    let starts: usize = std::env::var("SORTIE_BENCH_STARTS")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(50);
    let runtime_tokio = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    runtime_tokio.block_on(async move {
        let temp = tempfile::tempdir().expect("temp");
        let root = open_dir(temp.path().to_owned());
        let runtime = LocalRuntime::new(LocalConfig::new(root.join("state"))).expect("local runtime");
        let bin_dir = Path::new(SORTIE).parent().expect("bin dir").to_owned();

        let mut sandboxed = Vec::new();
        let mut teardown = Vec::new();
        for i in 0..starts {
            let base = open_dir(root.join(format!("s{i}")));
            let (workspace, home, run_dir) = (
                open_dir(base.join("ws")),
                open_dir(base.join("home")),
                open_dir(base.join("run")),
            );
            let command = [
                SORTIE,
                "driver",
                "--listen-on-stdin",
                "--workspace",
                inside::WORKSPACE,
                "--home",
                inside::HOME,
                "--agent",
                "scripted",
            ];
            let spec = SandboxSpec {
                name: format!("bench-{i}"),
                workspace,
                home,
                egress_dir: None,
                read_only: vec![bin_dir.clone()],
                read_only_at: Vec::new(),
                late_binds: false,
                env: Vec::new(),
                command: command.iter().map(|s| (*s).to_owned()).collect(),
                limits: Limits::default(),
                stdio: SandboxStdio::Listener(std::sync::Arc::new(
                    std::os::unix::net::UnixListener::bind(run_dir.join("driver.sock")).expect("bind"),
                )),
            };
            let started = Instant::now();
            runtime.create(spec).await.expect("create");
            runtime.start(&format!("bench-{i}")).await.expect("start");
            wait_ready(&run_dir.join("driver.sock")).await;
            sandboxed.push(started.elapsed());
            let stopping = Instant::now();
            runtime.destroy(&format!("bench-{i}")).await.expect("destroy");
            teardown.push(stopping.elapsed());
        }

        let mut host = Vec::new();
        for i in 0..starts {
            let base = open_dir(root.join(format!("h{i}")));
            let socket = base.join("driver.sock");
            let started = Instant::now();
            let mut child = std::process::Command::new(SORTIE)
                .args(["driver", "--agent", "scripted", "--socket"])
                .arg(&socket)
                .arg("--workspace")
                .arg(open_dir(base.join("ws")))
                .arg("--home")
                .arg(open_dir(base.join("home")))
                .stdout(std::process::Stdio::null())
                .spawn()
                .expect("driver");
            wait_ready(&socket).await;
            host.push(started.elapsed());
            let _ = child.kill();
            let _ = child.wait();
        }

        println!("{starts} starts each; ready = GET /status answers on driver.sock");
        println!("{:<44} {:>10} {:>10}", "path", "p50", "p95");
        println!(
            "{:<44} {:>10} {:>10}",
            "sandbox create + start → driver ready",
            ms(percentile(&mut sandboxed, 0.5)),
            ms(percentile(&mut sandboxed, 0.95))
        );
        println!(
            "{:<44} {:>10} {:>10}",
            "baseline: driver on the host → ready",
            ms(percentile(&mut host, 0.5)),
            ms(percentile(&mut host, 0.95))
        );
        println!(
            "{:<44} {:>10} {:>10}",
            "teardown (destroy)",
            ms(percentile(&mut teardown, 0.5)),
            ms(percentile(&mut teardown, 0.95))
        );
        let verdict = if percentile(&mut sandboxed, 0.5) < Duration::from_millis(150) {
            "met"
        } else {
            "MISSED"
        };
        println!("target: sandbox start to driver-ready p50 < 150 ms: {verdict}");
    });
}
