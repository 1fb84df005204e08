//! `sortie bench`: the DESIGN §10 targets measured end to end on this machine, each beside a baseline
//! measured in the same run where one exists, printed as a table (or JSON, or the Markdown of
//! `docs/benchmarks.md`).
//!
//! It runs what a user runs: this binary's `serve` as a child (root, a data dir of its own, the scripted
//! agent, real sandboxes), repositories made for the run — a small one, and unless `--quick` a large one
//! of a real project's shape (~2,000 files, ~10,000 commits, ~100 MiB pack) written through
//! `git fast-import` — and plain git for the baselines.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Write};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use serde::Serialize;
use serde_json::{Value, json};

use crate::cli::BenchArgs;

/// How long the agent of a session on the large repository thinks before its last words: a real
/// agent's turn lasts tens of seconds (each model call alone takes seconds), long enough for the
/// driver to refresh a fresh checkout's index beside it (see `sortie_driver::refresh`).
const LARGE_THINK_MS: u64 = 3_000;

/// How long one session may take from create to idle before the bench gives up on it.
const SESSION_DEADLINE: Duration = Duration::from_secs(120);

/// One line of the table.
#[derive(Clone, Debug, Serialize)]
pub struct Row {
    pub name: String,
    /// The target, as DESIGN §10 states it.
    pub target: String,
    /// What was measured, in words (`p50 12.0 ms, p95 14.1 ms`), or why nothing was.
    pub measured: String,
    /// The figure the target is checked on.
    pub value: Option<f64>,
    pub unit: &'static str,
    /// The baseline measured in the same run, in words.
    pub baseline: String,
    /// `None`: not measured by this harness.
    pub pass: Option<bool>,
}

/// A target's ceiling, or its floor (a rate, a ratio of speeds).
#[derive(Clone, Copy)]
enum Bound {
    AtMost(f64),
    AtLeast(f64),
}

impl Row {
    /// A row checked on the median of `samples`.
    fn measured(name: &str, target: &str, bound: Bound, samples: &[f64], unit: &'static str, baseline: String) -> Self {
        Self::measured_at(name, target, bound, 0.5, samples, unit, baseline)
    }

    /// A row checked on the `quantile` of `samples` (the median, or a tail such as p99).
    fn measured_at(
        name: &str,
        target: &str,
        bound: Bound,
        quantile: f64,
        samples: &[f64],
        unit: &'static str,
        baseline: String,
    ) -> Self {
        let p50 = percentile(samples, 0.5);
        let tail_at = if quantile > 0.95 { quantile } else { 0.95 };
        let tail = percentile(samples, tail_at);
        let checked = percentile(samples, quantile);
        let pass = checked.map(|value| match bound {
            Bound::AtMost(limit) => value <= limit,
            Bound::AtLeast(floor) => value >= floor,
        });
        let tail_name = format!("p{}", (tail_at * 100.0).round());
        // A ratio well under one reads as nothing at one decimal.
        let digits = if unit == "×" { 2 } else { 1 };
        let measured = match (p50, tail) {
            (Some(p50), Some(tail)) if samples.len() > 1 => {
                format!(
                    "p50 {p50:.digits$} {unit}, {tail_name} {tail:.digits$} {unit} (n={})",
                    samples.len()
                )
            }
            (Some(p50), _) => format!("{p50:.digits$} {unit}"),
            _ => "no samples".to_owned(),
        };
        Self {
            name: name.to_owned(),
            target: target.to_owned(),
            measured,
            value: checked,
            unit,
            baseline,
            pass,
        }
    }
}

/// The ratio of two medians as the one sample of a row; none when either has no samples or the
/// divisor's median is not positive.
fn median_ratio(numerator: &[f64], denominator: &[f64]) -> Vec<f64> {
    match (percentile(numerator, 0.5), percentile(denominator, 0.5)) {
        (Some(top), Some(bottom)) if bottom > 0.0 => vec![top / bottom],
        _ => Vec::new(),
    }
}

/// The `q` quantile of `samples` (nearest rank), `None` when there are none.
pub fn percentile(samples: &[f64], q: f64) -> Option<f64> {
    if samples.is_empty() {
        return None;
    }
    let mut sorted = samples.to_vec();
    sorted.sort_by(|a, b| a.total_cmp(b));
    let rank = ((sorted.len() as f64 * q).ceil() as usize).clamp(1, sorted.len());
    Some(sorted[rank - 1])
}

/// The table as Markdown: what `docs/benchmarks.md` holds.
pub fn markdown(rows: &[Row], header: &str) -> String {
    let mut out = String::new();
    out.push_str(header);
    out.push_str("\n| target | measured | baseline (same run) | result |\n|---|---|---|---|\n");
    for row in rows {
        let result = match row.pass {
            Some(true) => "pass",
            Some(false) => "**miss**",
            None => "—",
        };
        out.push_str(&format!(
            "| {}: {} | {} | {} | {} |\n",
            row.name,
            row.target,
            row.measured,
            if row.baseline.is_empty() { "—" } else { &row.baseline },
            result
        ));
    }
    out
}

/// A temporary directory removed when dropped.
struct Scratch(PathBuf);

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// `sortie serve` as a child, killed when dropped.
struct Serve {
    child: Child,
    url: String,
    token: String,
}

impl Drop for Serve {
    fn drop(&mut self) {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(self.child.id() as i32),
            nix::sys::signal::Signal::SIGTERM,
        );
        // Its shutdown ends every warm sandbox it holds (a hundred, after the load row): give it time.
        let deadline = Instant::now() + Duration::from_secs(60);
        while Instant::now() < deadline {
            if matches!(self.child.try_wait(), Ok(Some(_))) {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn git(dir: &Path, args: &[&str]) -> anyhow::Result<String> {
    let output = Command::new("git")
        .args([
            "-c",
            "user.name=bench",
            "-c",
            "user.email=bench@localhost",
            "-c",
            "init.defaultBranch=main",
        ])
        .args(args)
        .current_dir(dir)
        .env("GIT_CONFIG_NOSYSTEM", "1")
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("cannot run git {}", args.join(" ")))?;
    if !output.status.success() {
        bail!(
            "git {} failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&output.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&output.stdout).trim().to_owned())
}

fn ms(since: Instant) -> f64 {
    since.elapsed().as_secs_f64() * 1000.0
}

/// A small repository: a README and 20 source files, one commit.
fn small_repository(root: &Path) -> anyhow::Result<PathBuf> {
    let seed = root.join("small-seed");
    std::fs::create_dir_all(seed.join("src"))?;
    git(&seed, &["init", "-q"])?;
    std::fs::write(seed.join("README.md"), "bench\n")?;
    for i in 0..20 {
        std::fs::write(seed.join(format!("src/f{i}.rs")), format!("pub fn f{i}() {{}}\n"))?;
    }
    git(&seed, &["add", "."])?;
    git(&seed, &["commit", "-q", "-m", "seed"])?;
    let bare = root.join("small.git");
    git(root, &["clone", "-q", "--bare", "small-seed", "small.git"])?;
    Ok(bare)
}

/// xorshift64: the same bytes in every run, and incompressible enough to give the pack its size.
struct Noise(u64);

impl Noise {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    /// 80 hex digits and a newline.
    fn line(&mut self, out: &mut Vec<u8>) {
        const HEX: &[u8; 16] = b"0123456789abcdef";
        for _ in 0..10 {
            for byte in self.next().to_le_bytes() {
                out.push(HEX[usize::from(byte >> 4)]);
            }
        }
        out.push(b'\n');
    }
}

/// A repository of a real project's shape: `files` files of 200 lines in 20 directories, then one
/// commit per change of 45 lines in one file, `commits` in all — through `git fast-import`.
fn large_repository(root: &Path, files: usize, commits: usize) -> anyhow::Result<PathBuf> {
    const LINES: usize = 200;
    const CHANGED: usize = 45;
    let bare = root.join("large.git");
    git(root, &["init", "-q", "--bare", "large.git"])?;
    let mut import = Command::new("git")
        .args(["fast-import", "--quiet"])
        .current_dir(&bare)
        .stdin(Stdio::piped())
        .spawn()
        .context("cannot run git fast-import")?;
    let Some(stdin) = import.stdin.take() else {
        bail!("git fast-import has no stdin");
    };
    let mut out = std::io::BufWriter::with_capacity(1 << 20, stdin);
    let mut noise = Noise(0x9E37_79B9_7F4A_7C15);
    let mut contents: Vec<Vec<Vec<u8>>> = (0..files)
        .map(|_| {
            (0..LINES)
                .map(|_| {
                    let mut line = Vec::with_capacity(81);
                    noise.line(&mut line);
                    line
                })
                .collect()
        })
        .collect();
    let path = |i: usize| format!("src/m{}/file{i}.rs", i % 20);
    let write_commit =
        |out: &mut dyn Write, n: usize, changed: &[usize], contents: &[Vec<Vec<u8>>]| -> std::io::Result<()> {
            let message = format!("change {n}");
            write!(
                out,
                "commit refs/heads/main\ncommitter Dev <dev@example.com> {} +0000\n",
                1_700_000_000 + n * 60
            )?;
            write!(out, "data {}\n{message}\n", message.len())?;
            for &i in changed {
                let body: usize = contents[i].iter().map(Vec::len).sum();
                write!(out, "M 100644 inline {}\ndata {body}\n", path(i))?;
                for line in &contents[i] {
                    out.write_all(line)?;
                }
                out.write_all(b"\n")?;
            }
            Ok(())
        };
    let all: Vec<usize> = (0..files).collect();
    write_commit(&mut out, 0, &all, &contents)?;
    for n in 1..commits {
        let seed = noise.next() as usize;
        let file = seed % files;
        let at = (seed / files) % (LINES - CHANGED);
        for line in &mut contents[file][at..at + CHANGED] {
            line.clear();
            noise.line(line);
        }
        write_commit(&mut out, n, &[file], &contents)?;
    }
    out.flush()?;
    drop(out);
    let status = import.wait()?;
    if !status.success() {
        bail!("git fast-import failed: {status}");
    }
    git(&bare, &["symbolic-ref", "HEAD", "refs/heads/main"])?;
    Ok(bare)
}

fn start_serve(root: &Path, data_dir: &str, extra: &[&str]) -> anyhow::Result<Serve> {
    let data_dir = root.join(data_dir);
    let mut child = sortie_command()?
        .args(["serve", "--listen", "127.0.0.1:0", "--sandboxes-per-workspace", "64"])
        .args(extra)
        .arg("--data-dir")
        .arg(&data_dir)
        .env("HOME", root)
        .env("SORTIE_LOG", "error")
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .context("cannot start sortie serve")?;
    let stdout = child.stdout.take().context("serve has no stdout")?;
    let mut lines = BufReader::new(stdout).lines();
    let mut url = String::new();
    for line in lines.by_ref().map_while(Result::ok) {
        if let Some(at) = line.strip_prefix("sortie listening on ") {
            url = at.to_owned();
            break;
        }
    }
    // serve prints more (the sign-in link); a closed pipe would fail its writes.
    std::thread::spawn(move || for _ in lines.map_while(Result::ok) {});
    if url.is_empty() {
        let _ = child.kill();
        bail!("sortie serve did not start");
    }
    let token = std::fs::read_to_string(data_dir.join("admin-token"))
        .context("serve wrote no admin token")?
        .trim()
        .to_owned();
    Ok(Serve { child, url, token })
}

/// What one session measured, in milliseconds from its create.
struct SessionRun {
    first_part: f64,
    /// The agent's last words → the delivery card on the stream (the driver's commit, scan and push,
    /// and the host's settling).
    delivery: f64,
    idle: f64,
    timings: BTreeMap<String, u64>,
}

async fn call(
    http: &reqwest::Client,
    serve: &Serve,
    method: reqwest::Method,
    path: &str,
    body: Option<Value>,
) -> anyhow::Result<Value> {
    let mut request = http
        .request(method, format!("{}{path}", serve.url))
        .bearer_auth(&serve.token);
    if let Some(body) = body {
        request = request.json(&body);
    }
    let response = request.send().await.with_context(|| format!("{path}: no answer"))?;
    let status = response.status();
    let value: Value = response.json().await.with_context(|| format!("{path}: not JSON"))?;
    if !status.is_success() {
        bail!("{path}: {status} {value}");
    }
    Ok(value)
}

/// A ticket to attach to session `id`, as the dashboard asks for one.
async fn attach_ticket(http: &reqwest::Client, serve: &Serve, id: &str) -> anyhow::Result<String> {
    let ticket = call(
        http,
        serve,
        reqwest::Method::POST,
        &format!("/v1/sessions/{id}/attach-ticket"),
        Some(json!({"action": "attach"})),
    )
    .await?;
    Ok(ticket["ticket"].as_str().context("no ticket")?.to_owned())
}

/// Session `id`'s stream with `ticket` (`query`: e.g. `?turn=1`).
async fn open_stream(
    http: &reqwest::Client,
    serve: &Serve,
    id: &str,
    ticket: &str,
    query: &str,
) -> anyhow::Result<reqwest::Response> {
    http.get(format!("{}/v1/sessions/{id}/stream{query}", serve.url))
        .header("authorization", format!("Ticket {ticket}"))
        .send()
        .await
        .context("cannot attach")
}

/// Creates a session of the scripted agent on `repo` with `task` and attaches to its stream, as the
/// dashboard does (a ticket, then the stream).
async fn create_and_attach(
    http: &reqwest::Client,
    serve: &Serve,
    repo: &Path,
    task: &str,
) -> anyhow::Result<(String, reqwest::Response)> {
    let created = call(
        http,
        serve,
        reqwest::Method::POST,
        "/v1/sessions",
        Some(json!({"repo": repo, "task": task, "agent": "scripted"})),
    )
    .await?;
    let id = created["id"].as_str().context("the create answered no id")?.to_owned();
    let ticket = attach_ticket(http, serve, &id).await?;
    let stream = open_stream(http, serve, &id, &ticket, "").await?;
    Ok((id, stream))
}

/// One session of a trivial scripted turn: it says hello, writes a file, thinks for `think_ms`, says bye.
async fn session(
    http: &reqwest::Client,
    serve: &Serve,
    repo: &Path,
    n: usize,
    think_ms: u64,
) -> anyhow::Result<SessionRun> {
    let think = if think_ms > 0 {
        format!("sleep: {think_ms}\n")
    } else {
        String::new()
    };
    let task = format!("#!scripted\nsay: bench-hello\nwrite: bench-{n}.txt\nbench {n}\n>>>\n{think}say: bench-bye");
    let began = Instant::now();
    let (id, mut stream) = create_and_attach(http, serve, repo, &task).await?;
    let (mut first_part, mut last_words, mut delivered) = (None, None, None);
    let mut seen = String::new();
    let deadline = tokio::time::Instant::now() + SESSION_DEADLINE;
    while delivered.is_none() {
        let chunk = tokio::time::timeout_at(deadline, stream.chunk())
            .await
            .context("the session's stream stalled")?
            .context("the stream broke")?;
        let Some(chunk) = chunk else { break };
        seen.push_str(&String::from_utf8_lossy(&chunk));
        if first_part.is_none() && seen.contains("bench-hello") {
            first_part = Some(ms(began));
        }
        if last_words.is_none() && seen.contains("bench-bye") {
            last_words = Some(ms(began));
        }
        if last_words.is_some() && seen.contains("data-sortie-delivery") {
            delivered = Some(ms(began));
        }
    }
    drop(stream);
    let (phase, now) = loop {
        let now = call(http, serve, reqwest::Method::GET, &format!("/v1/sessions/{id}"), None).await?;
        let phase = now["phase"].as_str().unwrap_or_default().to_owned();
        if ["idle", "failed", "canceled", "hibernated"].contains(&phase.as_str()) {
            break (phase, now);
        }
        if tokio::time::Instant::now() > deadline {
            bail!("session {id} stuck in {phase}");
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    };
    let idle = ms(began);
    if phase != "idle" {
        bail!(
            "session {id} ended {phase}, not idle ({}): the bench measures completed turns",
            now["failure"]
        );
    }
    let turns = call(
        http,
        serve,
        reqwest::Method::GET,
        &format!("/v1/sessions/{id}/turns"),
        None,
    )
    .await?;
    let timings = serde_json::from_value(turns["turns"][0]["timings"].clone()).unwrap_or_default();
    let (Some(first_part), Some(last_words), Some(delivered)) = (first_part, last_words, delivered) else {
        bail!("session {id}: the stream did not show the agent's words and the delivery");
    };
    Ok(SessionRun {
        first_part,
        delivery: delivered - last_words,
        idle,
        timings,
    })
}

/// One ended turn read back whole, as a client joining late reads it.
struct Replay {
    parts: u64,
    gateway_rate: f64,
    driver_rate: f64,
}

/// A session whose agent floods `parts` messages, then that ended turn read whole twice, as someone
/// opening the session just after it reads it: through the gateway (a ticket, then the stream of turn
/// 1, served from the copy the worker kept at the turn's end) and on the session's driver socket (the
/// driver's memory; the bench is root, as the host is).
async fn replay_rates(
    http: &reqwest::Client,
    serve: &Serve,
    data_dir: &Path,
    repo: &Path,
    parts: u64,
) -> anyhow::Result<Replay> {
    let task = format!("#!scripted\nflood: {parts}");
    let (id, stream) = create_and_attach(http, serve, repo, &task).await?;
    drop(stream);
    let deadline = tokio::time::Instant::now() + SESSION_DEADLINE;
    loop {
        let now = call(http, serve, reqwest::Method::GET, &format!("/v1/sessions/{id}"), None).await?;
        match now["phase"].as_str().unwrap_or_default() {
            "idle" => break,
            "failed" | "canceled" => bail!("the flood session ended {}: {}", now["phase"], now["failure"]),
            _ if tokio::time::Instant::now() > deadline => bail!("the flood session did not settle"),
            _ => tokio::time::sleep(Duration::from_millis(20)).await,
        }
    }
    let ticket = attach_ticket(http, serve, &id).await?;
    let began = Instant::now();
    let through = open_stream(http, serve, &id, &ticket, "?turn=1").await?;
    let via_gateway = count_parts(through).await?;
    let gateway_rate = via_gateway as f64 / began.elapsed().as_secs_f64();
    let socket = data_dir.join("work/sessions").join(&id).join("host/driver.sock");
    let driver = reqwest::Client::builder()
        .unix_socket(socket)
        .build()
        .context("a client for the driver's socket")?;
    let began = Instant::now();
    let direct = driver
        .get("http://driver/turns/1/stream")
        .send()
        .await
        .context("the driver's socket does not answer")?;
    let on_driver = count_parts(direct).await?;
    let driver_rate = on_driver as f64 / began.elapsed().as_secs_f64();
    if via_gateway < parts || on_driver < parts {
        bail!(
            "the flood of {parts} came back as {via_gateway} parts through the gateway and {on_driver} on the driver"
        );
    }
    Ok(Replay {
        parts: via_gateway,
        gateway_rate,
        driver_rate,
    })
}

/// What `clients` attached to one running turn cost `sortie serve`.
struct FanOut {
    clients: usize,
    /// serve's resident memory with them attached, less before (tickets already minted).
    serve_extra_mib: f64,
    /// The stop → the first client's `finish` (the turn's own stop).
    first_finish_ms: f64,
    /// The first client's `finish` → the last one's: the fan-out of one part to every client.
    finish_spread_ms: f64,
}

/// Clients attach from many addresses of 127.0.0.0/8, as many people's browsers would: each address
/// stays under serve's default cap per address (512).
const CLIENTS_PER_ADDRESS: usize = 400;
/// Clients between their connect and their first part at once; the rest wait their turn.
const ATTACHING_AT_ONCE: usize = 64;

/// `clients` attached to one session whose agent said a word and then hangs: each with a ticket of its
/// own, as the dashboard gets one, and each reading until it saw the word. serve's memory is read with
/// them all attached; then the turn is stopped and each must read its `finish`.
async fn fan_out(http: &reqwest::Client, serve: &Serve, repo: &Path, clients: usize) -> anyhow::Result<FanOut> {
    const HELLO: &[u8] = b"fan-out-hello";
    const FINISH: &[u8] = br#""type":"finish""#;
    let task = "#!scripted\nsay: fan-out-hello\nsleep: 600000";
    let (id, first) = create_and_attach(http, serve, repo, task).await?;
    let deadline = tokio::time::Instant::now() + SESSION_DEADLINE;
    let mut first = PartReader::new(first);
    tokio::time::timeout_at(deadline, first.until(HELLO))
        .await
        .context("the fan-out session said nothing")??;
    let mut tickets = Vec::with_capacity(clients);
    for _ in 0..clients {
        tickets.push(attach_ticket(http, serve, &id).await?);
    }
    let serve_pid = serve.child.id();
    let before = proc_kib(serve_pid, "status", "VmRSS:").unwrap_or(0.0);
    let mut from_address = Vec::new();
    for n in 0..clients.div_ceil(CLIENTS_PER_ADDRESS) {
        let source = std::net::Ipv4Addr::new(127, 0, 1 + (n / 250) as u8, 2 + (n % 250) as u8);
        from_address.push(
            reqwest::Client::builder()
                .local_address(std::net::IpAddr::V4(source))
                .build()
                .context("a client")?,
        );
    }
    let attaching = std::sync::Arc::new(tokio::sync::Semaphore::new(ATTACHING_AT_ONCE));
    let (attached_tx, mut attached_rx) = tokio::sync::mpsc::unbounded_channel();
    let mut watching = tokio::task::JoinSet::new();
    for (n, ticket) in tickets.into_iter().enumerate() {
        let client = from_address[n / CLIENTS_PER_ADDRESS].clone();
        let url = format!("{}/v1/sessions/{id}/stream", serve.url);
        let attaching = attaching.clone();
        let attached_tx = attached_tx.clone();
        watching.spawn(async move {
            let permit = attaching.acquire_owned().await.context("the bench's gate closed")?;
            let response = client
                .get(url)
                .header("authorization", format!("Ticket {ticket}"))
                .send()
                .await
                .context("cannot attach")?
                .error_for_status()
                .context("attach refused")?;
            let mut reader = PartReader::new(response);
            reader.until(HELLO).await?;
            drop(permit);
            let _ = attached_tx.send(());
            reader.until(FINISH).await?;
            Ok::<_, anyhow::Error>(Instant::now())
        });
    }
    drop(attached_tx);
    let mut attached = 0;
    while attached < clients {
        tokio::select! {
            Some(()) = attached_rx.recv() => attached += 1,
            Some(ended) = watching.join_next() => {
                ended.context("a client panicked")?.context("a client did not attach")?;
                bail!("a client's stream ended before the turn did");
            }
            _ = tokio::time::sleep_until(deadline) => bail!("{attached} of {clients} clients attached in time"),
        }
    }
    let after = proc_kib(serve_pid, "status", "VmRSS:").unwrap_or(0.0);
    let began = Instant::now();
    call(
        http,
        serve,
        reqwest::Method::POST,
        &format!("/v1/sessions/{id}/stop"),
        None,
    )
    .await?;
    let mut finishes = Vec::with_capacity(clients);
    while let Some(ended) = tokio::time::timeout_at(deadline, watching.join_next())
        .await
        .with_context(|| format!("{} of {clients} clients read the turn's finish in time", finishes.len()))?
    {
        finishes.push(
            ended
                .context("a client panicked")?
                .context("a client did not read the finish")?,
        );
    }
    drop(first);
    let (Some(first_finish), Some(last_finish)) = (finishes.iter().min(), finishes.iter().max()) else {
        bail!("no client read the turn's finish");
    };
    Ok(FanOut {
        clients,
        serve_extra_mib: (after - before).max(0.0) / 1024.0,
        first_finish_ms: first_finish.duration_since(began).as_secs_f64() * 1000.0,
        finish_spread_ms: last_finish.duration_since(*first_finish).as_secs_f64() * 1000.0,
    })
}

/// A stream read part by part until a marker, without holding what was read.
struct PartReader {
    response: reqwest::Response,
    carry: Vec<u8>,
}

impl PartReader {
    fn new(response: reqwest::Response) -> Self {
        Self {
            response,
            carry: Vec::new(),
        }
    }

    /// Reads until `marker` went by (a marker seen before is not seen again).
    async fn until(&mut self, marker: &[u8]) -> anyhow::Result<()> {
        loop {
            let Some(bytes) = self.response.chunk().await.context("the stream broke")? else {
                bail!("the stream ended before {}", String::from_utf8_lossy(marker));
            };
            self.carry.extend_from_slice(&bytes);
            if let Some(at) = self.carry.windows(marker.len()).position(|w| w == marker) {
                self.carry.drain(..at + marker.len());
                return Ok(());
            }
            // What could still begin the marker stays for the next read.
            let keep = self.carry.len().saturating_sub(marker.len() - 1);
            self.carry.drain(..keep);
        }
    }
}

/// The SSE events (`data: ` lines) of a stream, read to its end.
async fn count_parts(mut response: reqwest::Response) -> anyhow::Result<u64> {
    let mut parts = 0;
    let mut carry = Vec::new();
    while let Some(bytes) = response.chunk().await.context("the stream broke")? {
        carry.extend_from_slice(&bytes);
        parts += carry.windows(6).filter(|w| w == b"data: ").count() as u64;
        // Five bytes cannot hold a whole marker, only the start of one the next read completes.
        let keep = carry.len().saturating_sub(5);
        carry.drain(..keep);
    }
    Ok(parts)
}

/// `POST /v1/sessions` `creates` times, one after another on one connection, while the worker
/// provisions and runs the sessions made before (each a short scripted turn); beside each a
/// `GET /healthz` on the same connection, the floor of one round trip. Then waits for every session
/// to settle, so the rows after measure an idle worker again.
async fn accepts_under_load(
    http: &reqwest::Client,
    serve: &Serve,
    repo: &Path,
    creates: usize,
) -> anyhow::Result<(Vec<f64>, Vec<f64>)> {
    let (mut accepts, mut health) = (Vec::new(), Vec::new());
    let mut ids = Vec::new();
    for n in 0..creates {
        let task = format!("#!scripted\nsay: load {n}\nwrite: load-{n}.txt\nload {n}\n>>>\nsay: done");
        let began = Instant::now();
        let created = call(
            http,
            serve,
            reqwest::Method::POST,
            "/v1/sessions",
            Some(json!({"repo": repo, "task": task, "agent": "scripted"})),
        )
        .await?;
        accepts.push(ms(began));
        ids.push(created["id"].as_str().context("the create answered no id")?.to_owned());
        let began = Instant::now();
        http.get(format!("{}/healthz", serve.url))
            .send()
            .await
            .context("/healthz: no answer")?
            .error_for_status()?;
        health.push(ms(began));
    }
    let deadline = tokio::time::Instant::now() + SESSION_DEADLINE;
    for id in ids {
        loop {
            let now = call(http, serve, reqwest::Method::GET, &format!("/v1/sessions/{id}"), None).await?;
            let phase = now["phase"].as_str().unwrap_or_default();
            if ["idle", "failed", "canceled", "hibernated"].contains(&phase) {
                break;
            }
            if tokio::time::Instant::now() > deadline {
                bail!("session {id} stuck in {phase} under load");
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    Ok((accepts, health))
}

/// Inside one session's sandbox, clones of its repository `rounds` times each: straight from the
/// mirror (bound read-only into the sandbox for the workspace's alternates; `--no-local`, so git packs
/// as it would for a remote) and through the git proxy (the workspace's origin: the relay, the egress
/// socket, the proxy's checks, upload-pack on the host). Milliseconds, interleaved.
async fn proxy_clones(
    http: &reqwest::Client,
    serve: &Serve,
    repo: &Path,
    rounds: usize,
) -> anyhow::Result<(Vec<f64>, Vec<f64>)> {
    // One shell line; the marker is split in the command so only the output holds it whole. The mirror
    // belongs to root: the sandbox's git is told to trust it in its own home's config.
    let task = format!(
        "#!scripted\nrun: git config --global safe.directory '*' && m=$(sed 's#/objects$##' .git/objects/info/alternates) \
         && o=$(git remote get-url origin) && for i in $(seq {rounds}); do a=$(date +%s%N) \
         && git clone -q --bare --no-local \"$m\" /tmp/direct.git && b=$(date +%s%N) \
         && git clone -q --bare \"$o\" /tmp/proxied.git && c=$(date +%s%N) && rm -rf /tmp/direct.git /tmp/proxied.git \
         && echo \"CLONE\"\"-TIMES $((b-a)) $((c-b))\" || exit 1; done\nsay: clones-done"
    );
    let (id, mut stream) = create_and_attach(http, serve, repo, &task).await?;
    let mut seen = String::new();
    let deadline = tokio::time::Instant::now() + SESSION_DEADLINE;
    while !seen.contains("clones-done") {
        let chunk = tokio::time::timeout_at(deadline, stream.chunk())
            .await
            .context("the clones' stream stalled")?
            .context("the stream broke")?;
        let Some(chunk) = chunk else { break };
        seen.push_str(&String::from_utf8_lossy(&chunk));
    }
    let (mut direct, mut proxied) = (Vec::new(), Vec::new());
    for found in seen.split("CLONE-TIMES ").skip(1) {
        let mut figures = found
            .split(|c: char| !c.is_ascii_digit())
            .filter(|figure| !figure.is_empty())
            .map(|figure| figure.parse::<f64>().map(|ns| ns / 1e6));
        if let (Some(Ok(d)), Some(Ok(p))) = (figures.next(), figures.next()) {
            direct.push(d);
            proxied.push(p);
        }
    }
    if direct.len() != rounds {
        bail!("the clones in session {id} did not all finish: {}", tail_of(&seen, 600));
    }
    Ok((direct, proxied))
}

/// The last `max` bytes of `text` (on a character boundary), for an error.
fn tail_of(text: &str, max: usize) -> &str {
    let mut start = text.len().saturating_sub(max);
    while !text.is_char_boundary(start) {
        start += 1;
    }
    &text[start..]
}

/// Raises this process's hard open-files limit toward `wanted` where it may (root outside a container
/// that forbids it), then its soft limit as serve raises its own. Never lowers either.
fn raise_open_files_limit(wanted: u64) {
    use nix::sys::resource::{Resource, getrlimit, setrlimit};
    if let Ok((_, hard)) = getrlimit(Resource::RLIMIT_NOFILE) {
        let nr_open = std::fs::read_to_string("/proc/sys/fs/nr_open")
            .ok()
            .and_then(|text| text.trim().parse::<u64>().ok())
            .unwrap_or(wanted);
        let limit = wanted.min(nr_open);
        if limit > hard {
            let _ = setrlimit(Resource::RLIMIT_NOFILE, limit, limit);
        }
    }
    sortie_server::bootstrap::raise_open_files_limit();
}

/// `kB` of a `/proc/<pid>/status` or `smaps_rollup` field.
fn proc_kib(pid: u32, file: &str, field: &str) -> Option<f64> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/{file}")).ok()?;
    let line = text.lines().find(|line| line.starts_with(field))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

/// Every process descended from `root`.
fn descendants(root: u32) -> Vec<u32> {
    let mut parent_of = Vec::new();
    if let Ok(entries) = std::fs::read_dir("/proc") {
        for entry in entries.flatten() {
            let Some(pid) = entry.file_name().to_str().and_then(|name| name.parse::<u32>().ok()) else {
                continue;
            };
            let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
                continue;
            };
            // The command name (in parentheses) may hold spaces: fields count from its end.
            let ppid = stat
                .rsplit_once(')')
                .and_then(|(_, rest)| rest.split_whitespace().nth(1))
                .and_then(|ppid| ppid.parse::<u32>().ok());
            if let Some(ppid) = ppid {
                parent_of.push((pid, ppid));
            }
        }
    }
    let mut found = vec![root];
    let mut i = 0;
    while i < found.len() {
        let parent = found[i];
        found.extend(
            parent_of
                .iter()
                .filter(|(_, ppid)| *ppid == parent)
                .map(|(pid, _)| *pid),
        );
        i += 1;
    }
    found.remove(0);
    found
}

/// Plain git's delivery of the same change: add, commit and push of one small file to a local bare
/// repository, no sandbox, no proxy.
fn plain_git_delivery(root: &Path, repo: &Path, runs: usize) -> anyhow::Result<Vec<f64>> {
    let work = root.join("plain-delivery");
    git(root, &["clone", "-q", &repo.to_string_lossy(), &work.to_string_lossy()])?;
    let mut samples = Vec::new();
    for i in 0..runs {
        std::fs::write(work.join(format!("plain-{i}.txt")), format!("plain {i}\n"))?;
        let began = Instant::now();
        git(&work, &["add", "--all"])?;
        git(&work, &["commit", "-q", "-m", "plain"])?;
        git(&work, &["push", "-q", "origin", &format!("HEAD:refs/heads/plain-{i}")])?;
        samples.push(ms(began));
    }
    Ok(samples)
}

/// Plain git's workspace: `clone --shared` of a mirror with its checkout, as root.
fn plain_git_prep(root: &Path, repo: &Path, runs: usize) -> anyhow::Result<Vec<f64>> {
    let mirror = root.join(format!(
        "{}-mirror",
        repo.file_name().map(|n| n.to_string_lossy()).unwrap_or_default()
    ));
    git(
        root,
        &[
            "clone",
            "-q",
            "--mirror",
            "--no-local",
            &repo.to_string_lossy(),
            &mirror.to_string_lossy(),
        ],
    )?;
    let mut samples = Vec::new();
    for i in 0..runs {
        let dir = root.join(format!("plain-prep-{i}"));
        let began = Instant::now();
        git(
            root,
            &[
                "clone",
                "-q",
                "--shared",
                &mirror.to_string_lossy(),
                &dir.to_string_lossy(),
            ],
        )?;
        samples.push(ms(began));
        let _ = std::fs::remove_dir_all(&dir);
    }
    Ok(samples)
}

/// A command of this binary with none of the caller's `SORTIE_*` settings.
fn sortie_command() -> anyhow::Result<Command> {
    let mut command = Command::new(std::env::current_exe().context("cannot find the sortie binary")?);
    for (key, _) in std::env::vars() {
        if key.starts_with("SORTIE_") {
            command.env_remove(key);
        }
    }
    Ok(command)
}

/// Runs `command` to its end; fails with its stderr unless it exits 0.
fn run_quietly(command: &mut Command, what: &str) -> anyhow::Result<()> {
    let output = command
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .output()
        .with_context(|| format!("cannot run {what}"))?;
    if !output.status.success() {
        bail!(
            "{what} failed ({}): {}",
            output.status,
            String::from_utf8_lossy(&output.stderr).trim()
        );
    }
    Ok(())
}

/// `sortie sandbox exec -- true`, a bare bwrap of the same shape, and that bwrap in fresh cgroups
/// under the same parent, made, joined and removed by a shell: the floor a sandbox with limits has on
/// this kernel (a cgroup migration after a quiet spell waits out an RCU grace period), where cgroups
/// are there to make (as root, v1 or v2). Each after a quiet spell, as sandboxes start: one started
/// in the wake of another's migration would find the grace period already passed.
fn sandbox_starts(runs: usize) -> anyhow::Result<(Vec<f64>, Vec<f64>, Vec<f64>)> {
    const BWRAP: &str = "bwrap --unshare-all --ro-bind /usr /usr --symlink usr/bin /bin --symlink usr/lib /lib --symlink usr/lib64 /lib64 true";
    let hierarchies: Vec<String> = if Path::new("/sys/fs/cgroup/cgroup.controllers").is_file() {
        vec!["/sys/fs/cgroup/sortie".into()]
    } else {
        ["memory", "pids", "cpuacct", "cpu"]
            .iter()
            .map(|c| format!("/sys/fs/cgroup/{c}/sortie"))
            .collect()
    };
    let floor_script = format!(
        "n=bench-floor-$$; for h in {dirs}; do mkdir $h/$n || exit 1; done; \
         sh -c 'for h in {dirs}; do echo $$ > $h/$0/cgroup.procs; done; exec {BWRAP}' $n; s=$?; \
         for h in {dirs}; do rmdir $h/$n; done; exit $s",
        dirs = hierarchies.join(" ")
    );
    let (mut sortie, mut bare, mut floor) = (Vec::new(), Vec::new(), Vec::new());
    let quiet = || std::thread::sleep(Duration::from_millis(50));
    for _ in 0..runs {
        quiet();
        let mut command = sortie_command()?;
        command.args(["sandbox", "exec", "--", "true"]);
        let began = Instant::now();
        run_quietly(&mut command, "sortie sandbox exec -- true")?;
        sortie.push(ms(began));
        let words: Vec<&str> = BWRAP.split(' ').collect();
        let mut command = Command::new(words[0]);
        command.args(&words[1..]);
        quiet();
        let began = Instant::now();
        run_quietly(&mut command, "bwrap --unshare-all true")?;
        bare.push(ms(began));
        // Only once sortie made its parent group (the first sortie run, as root).
        if hierarchies.iter().all(|h| Path::new(h).is_dir()) {
            let mut command = Command::new("/bin/sh");
            command.args(["-c", &floor_script]);
            quiet();
            let began = Instant::now();
            if run_quietly(&mut command, "bwrap in fresh cgroups").is_ok() {
                floor.push(ms(began));
            }
        }
    }
    Ok((sortie, bare, floor))
}

/// Unmounts the session disks a `serve` under `root` left mounted (killed before its shutdown ended),
/// so that the run's directory can go; how many there were.
async fn unmount_left_disks(data_dir: &Path) -> usize {
    let Ok(sessions) = std::fs::read_dir(data_dir.join("work/sessions")) else {
        return 0;
    };
    let mut left = 0;
    for session in sessions.flatten() {
        let unmounted = sortie_sandbox::local::disk::unmount(&session.path().join("disk")).await;
        if !matches!(unmounted, Ok(sortie_sandbox::local::disk::Unmounted::NotMounted)) {
            left += 1;
        }
    }
    left
}

/// The agent and size of the warm pool the bench measures.
const WARM_AGENT: &str = "scripted";
const WARM_POOL_SIZE: usize = 2;

/// Waits until the serve's warm pool holds [`WARM_POOL_SIZE`] sandboxes (its gauge says so).
async fn pool_full(http: &reqwest::Client, serve: &Serve) -> anyhow::Result<()> {
    let series = format!("sortie_warm_sandboxes{{agent=\"{WARM_AGENT}\"}} {WARM_POOL_SIZE}");
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let metrics = http
            .get(format!("{}/metrics", serve.url))
            .send()
            .await
            .context("cannot read serve's metrics")?
            .text()
            .await
            .context("cannot read serve's metrics")?;
        if metrics.lines().any(|line| line.trim() == series) {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!("the warm pool did not fill within 60 s");
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Waits (30 s at most) until no loop device holds a session disk of `data_dir` any more: the kernel
/// frees them after the serve that used them is gone, and the next rows should not share the machine
/// with that.
async fn loop_devices_released(data_dir: &Path) {
    let images: Vec<PathBuf> = std::fs::read_dir(data_dir.join("work/sessions"))
        .map(|sessions| sessions.flatten().map(|s| s.path().join("disk.img")).collect())
        .unwrap_or_default();
    let deadline = Instant::now() + Duration::from_secs(30);
    while Instant::now() < deadline
        && images
            .iter()
            .any(|image| !sortie_sandbox::local::disk::loop_devices_backed_by(image).is_empty())
    {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Each run's workspace prep: its clone phase, named `primed_clone` when it adopted a workspace checked
/// out ahead.
fn prep(runs: &[SessionRun]) -> Vec<f64> {
    runs.iter()
        .filter_map(|run| run.timings.get("clone").or_else(|| run.timings.get("primed_clone")))
        .map(|v| *v as f64)
        .collect()
}

/// "k of n sessions adopted …": how many runs' workspaces were checked out ahead.
fn primed_share(runs: &[SessionRun]) -> String {
    let primed = runs
        .iter()
        .filter(|run| run.timings.contains_key("primed_clone"))
        .count();
    format!(
        "{primed} of {} sessions adopted a workspace checked out ahead",
        runs.len()
    )
}

fn timing(runs: &[SessionRun], key: &str) -> Vec<f64> {
    runs.iter()
        .filter_map(|run| run.timings.get(key))
        .map(|v| *v as f64)
        .collect()
}

pub async fn run(args: BenchArgs) -> anyhow::Result<ExitCode> {
    if !nix::unistd::geteuid().is_root() {
        bail!("sortie bench runs real sandboxes the way serve does as root: run it as root");
    }
    let total = Instant::now();
    // serve inherits it: 10,000 attached clients hold a descriptor each there, and one each here.
    raise_open_files_limit(1 << 20);
    let parent = args.work_dir.clone().unwrap_or_else(std::env::temp_dir);
    // Short: a session's driver socket lives deep under it, and a socket path has at most 107 bytes.
    let name = ulid::Ulid::generate().to_string().to_ascii_lowercase();
    let root = parent.join(format!("sortie-bench-{}", &name[name.len() - 8..]));
    std::fs::create_dir_all(&root).with_context(|| format!("cannot create {}", root.display()))?;
    let _scratch = Scratch(root.clone());
    // The sandbox uid reads the mirrors through it, as through /srv or a home that is not 0700.
    std::fs::set_permissions(&root, std::fs::Permissions::from_mode(0o755))?;
    let say = |what: &str| eprintln!("sortie bench: {what} ({:.0} s)", total.elapsed().as_secs_f64());

    let small = small_repository(&root)?;
    let large = if args.quick {
        None
    } else {
        say("writing the large repository (2,000 files, 10,000 commits)");
        Some(large_repository(&root, 2_000, 10_000)?)
    };
    // Before serve starts: nothing else runs beside them.
    say("sandbox starts");
    let (sandbox_start, bare_bwrap, bwrap_in_cgroups) = sandbox_starts(args.sessions.max(10))?;

    let http = reqwest::Client::new();
    let sessions = args.sessions.max(2);
    // First, before anything else has run on this machine's loop devices and cgroups (as the cold rows
    // come first on theirs): a serve with a warm pool, on a data dir of its own (a short name, like
    // `data`: a session's sockets live deep under it, and a socket path has at most 107 bytes). Each session is created
    // once the pool is full again, as when people create sessions at a person's pace.
    say("sessions taking a warm sandbox");
    let warm_serve = start_serve(
        &root,
        "dw",
        &["--warm-sandboxes", &format!("{WARM_AGENT}={WARM_POOL_SIZE}")],
    )?;
    // Its first session makes its mirror, as in the cold rows.
    pool_full(&http, &warm_serve).await?;
    session(&http, &warm_serve, &small, 1999, 0).await?;
    let mut warm_runs = Vec::new();
    let mut cold_in_warm = 0;
    for n in 0..sessions {
        pool_full(&http, &warm_serve).await?;
        let run = session(&http, &warm_serve, &small, 2000 + n, 0).await?;
        if run.timings.contains_key("warm_sandbox") {
            warm_runs.push(run);
        } else {
            cold_in_warm += 1;
        }
    }
    drop(warm_serve);
    let left = unmount_left_disks(&root.join("dw")).await;
    if left > 0 {
        eprintln!("sortie bench: serve left {left} session disks mounted when it ended; the bench unmounted them");
    }
    loop_devices_released(&root.join("dw")).await;

    // Room for every fan-out client: the cap on API connections (past the default, which a busy
    // server's operator raises), within the descriptors this process could get.
    let serve = start_serve(&root, "data", &["--max-connections", "12000"])?;
    let serve_pid = serve.child.id();
    // Idle: started, nothing asked of it yet; a moment for its first tasks to settle.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let idle_rss = proc_kib(serve_pid, "status", "VmRSS:").unwrap_or(0.0) / 1024.0;
    let idle_pss = proc_kib(serve_pid, "smaps_rollup", "Pss:").unwrap_or(0.0) / 1024.0;
    // The two halves move apart: the file-backed half is the binary's pages, and how many a fault maps
    // depends on how the file sits in the page cache (a copy's large folios are mapped whole).
    let idle_anon = proc_kib(serve_pid, "status", "RssAnon:").unwrap_or(0.0) / 1024.0;
    let idle_file = proc_kib(serve_pid, "status", "RssFile:").unwrap_or(0.0) / 1024.0;

    say(&format!("{sessions} sessions on the small repository"));
    // The first makes the mirror; the measured ones find it, as every session after a repository's first.
    let first = session(&http, &serve, &small, 0, 0).await?;
    let mut small_runs = Vec::new();
    for n in 1..=sessions {
        small_runs.push(session(&http, &serve, &small, n, 0).await?);
    }
    // Every session is idle now, its sandbox warm: sortie's memory for them, shared pages split (PSS).
    let warm = small_runs.len() + 1;
    let sandboxes_pss: f64 = descendants(serve_pid)
        .iter()
        .filter_map(|pid| proc_kib(*pid, "smaps_rollup", "Pss:"))
        .sum::<f64>()
        / 1024.0;
    let serve_pss = proc_kib(serve_pid, "smaps_rollup", "Pss:").unwrap_or(0.0) / 1024.0;
    let per_session = (sandboxes_pss + (serve_pss - idle_pss).max(0.0)) / warm as f64;

    let mut large_runs = Vec::new();
    let mut large_first = None;
    if let Some(large) = &large {
        say("sessions on the large repository");
        let made = session(&http, &serve, large, 1000, LARGE_THINK_MS).await?;
        large_first = Some(made.timings.get("clone").copied().unwrap_or(0));
        for n in 0..args.sessions.clamp(2, 5) {
            large_runs.push(session(&http, &serve, large, 1001 + n, LARGE_THINK_MS).await?);
        }
    }
    say("a flood replayed through the gateway and on the driver's socket");
    let replay = replay_rates(
        &http,
        &serve,
        &root.join("data"),
        &small,
        if args.quick { 20_000 } else { 90_000 },
    )
    .await?;
    let clients = if args.quick { 1_000 } else { 10_000 };
    say(&format!("{clients} clients attached to one session"));
    let fan_out = fan_out(&http, &serve, &small, clients).await?;
    say("clones through the git proxy");
    let (direct_clones, proxied_clones) = proxy_clones(&http, &serve, large.as_ref().unwrap_or(&small), 3).await?;

    // Last on this serve: it leaves many sessions behind.
    say("creates while the worker is busy");
    let (accepts, health) = accepts_under_load(&http, &serve, &small, if args.quick { 20 } else { 100 }).await?;
    drop(serve);
    let left = unmount_left_disks(&root.join("data")).await;
    if left > 0 {
        eprintln!("sortie bench: serve left {left} session disks mounted when it ended; the bench unmounted them");
    }

    say("baselines with plain git");
    let plain_delivery = plain_git_delivery(&root, &small, sessions)?;
    let plain_prep_small = plain_git_prep(&root, &small, 5)?;
    let plain_prep_large = match &large {
        Some(large) => Some(plain_git_prep(&root, large, 3)?),
        None => None,
    };
    let baseline = |samples: &[f64], what: &str| match percentile(samples, 0.5) {
        Some(p50) => format!("{what}: p50 {p50:.1} ms"),
        None => String::new(),
    };

    let mut rows = vec![
        Row::measured(
            "per-session memory",
            "≤ 15 MiB per warm idle session (driver, keeper, bwrap, serve's share)",
            Bound::AtMost(15.0),
            &[per_session],
            "MiB",
            format!(
                "{warm} warm sessions: {sandboxes_pss:.1} MiB in their processes (PSS), serve +{:.1} MiB",
                (serve_pss - idle_pss).max(0.0)
            ),
        ),
        Row::measured(
            "claim latency after accept",
            "≤ 10 ms (woken by the accept, no polling)",
            Bound::AtMost(10.0),
            &timing(&small_runs, "queued"),
            "ms",
            String::new(),
        ),
        Row::measured(
            "delivery, small repository",
            "≤ 60 ms (the agent's last words → the delivery card)",
            Bound::AtMost(60.0),
            &small_runs.iter().map(|run| run.delivery).collect::<Vec<_>>(),
            "ms",
            baseline(&plain_delivery, "git add, commit, push to a local bare repo"),
        ),
        Row::measured(
            "workspace prep, small repository (mirrored)",
            "≤ 50 ms",
            Bound::AtMost(50.0),
            &prep(&small_runs),
            "ms",
            format!(
                "{}; {}",
                baseline(&plain_prep_small, "git clone --shared of the mirror"),
                primed_share(&small_runs)
            ),
        ),
        Row::measured(
            "create → first part (cold: a new sandbox)",
            "≤ 100 ms",
            Bound::AtMost(100.0),
            &small_runs.iter().map(|run| run.first_part).collect::<Vec<_>>(),
            "ms",
            String::new(),
        ),
        Row::measured(
            "create → idle, trivial scripted turn",
            "≤ 250 ms",
            Bound::AtMost(250.0),
            &small_runs.iter().map(|run| run.idle).collect::<Vec<_>>(),
            "ms",
            format!(
                "the repository's first session (it made the mirror): {:.0} ms",
                first.idle
            ),
        ),
        Row::measured(
            "idle RSS of sortie serve",
            "< 30 MiB",
            Bound::AtMost(30.0),
            &[idle_rss],
            "MiB",
            format!("anonymous {idle_anon:.1} MiB; the binary and libraries' pages {idle_file:.1} MiB"),
        ),
    ];
    rows.push(Row::measured(
        "create → first part (warm pool)",
        "≤ 100 ms",
        Bound::AtMost(100.0),
        &warm_runs.iter().map(|run| run.first_part).collect::<Vec<_>>(),
        "ms",
        format!(
            "cold, this run: p50 {:.1} ms; {} of {} sessions took a warm sandbox (pool of {WARM_POOL_SIZE}); binding and \
             assigning it: p50 {:.0} ms",
            percentile(&small_runs.iter().map(|run| run.first_part).collect::<Vec<_>>(), 0.5).unwrap_or(0.0),
            warm_runs.len(),
            warm_runs.len() + cold_in_warm,
            percentile(&timing(&warm_runs, "warm_sandbox"), 0.5).unwrap_or(0.0)
        ),
    ));
    rows.push(Row::measured(
        "create → idle (warm pool), trivial scripted turn",
        "≤ 250 ms",
        Bound::AtMost(250.0),
        &warm_runs.iter().map(|run| run.idle).collect::<Vec<_>>(),
        "ms",
        String::new(),
    ));
    rows.push(Row::measured_at(
        "create-accept p99 under load",
        "≤ 2 ms on SQLite with the worker busy",
        Bound::AtMost(2.0),
        0.99,
        &accepts,
        "ms",
        format!(
            "GET /healthz on the same connection: p99 {:.1} ms",
            percentile(&health, 0.99).unwrap_or(0.0)
        ),
    ));
    rows.push(Row::measured(
        "git proxy clone (in a sandbox)",
        "≥ 0.95× direct (speed)",
        Bound::AtLeast(0.95),
        &median_ratio(&direct_clones, &proxied_clones),
        "×",
        format!(
            "{} repository, git clone --no-local of the mirror in the same sandbox: p50 {:.0} ms; through the proxy: \
             p50 {:.0} ms",
            if large.is_some() { "large" } else { "small" },
            percentile(&direct_clones, 0.5).unwrap_or(0.0),
            percentile(&proxied_clones, 0.5).unwrap_or(0.0)
        ),
    ));
    rows.push(Row::measured(
        "sandbox start (sortie sandbox exec -- true)",
        "≤ 2× a bare bwrap --unshare-all true",
        Bound::AtMost(2.0),
        &median_ratio(&sandbox_start, &bare_bwrap),
        "×",
        format!(
            "sortie sandbox exec: p50 {:.1} ms; bwrap --unshare-all, /usr bound, true: p50 {:.1} ms{}",
            percentile(&sandbox_start, 0.5).unwrap_or(0.0),
            percentile(&bare_bwrap, 0.5).unwrap_or(0.0),
            match percentile(&bwrap_in_cgroups, 0.5) {
                Some(p50) => format!(
                    "; the same bwrap in fresh cgroups a shell makes, joins and removes (this kernel's floor for a \
                     sandbox with limits): p50 {p50:.1} ms"
                ),
                None => String::new(),
            }
        ),
    ));
    if let Some(plain_prep_large) = &plain_prep_large {
        rows.push(Row::measured(
            "workspace prep, large repository (mirrored)",
            "≤ 100 ms",
            Bound::AtMost(100.0),
            &prep(&large_runs),
            "ms",
            format!(
                "{}; its first session's mirror: {} ms; {}",
                baseline(plain_prep_large, "git clone --shared of the mirror"),
                large_first.unwrap_or(0),
                primed_share(&large_runs)
            ),
        ));
        rows.push(Row::measured(
            "delivery, large repository (first turn)",
            "≤ 100 ms (a turn of 3 s)",
            Bound::AtMost(100.0),
            &large_runs.iter().map(|run| run.delivery).collect::<Vec<_>>(),
            "ms",
            String::new(),
        ));
    }
    rows.push(Row::measured(
        "gateway replay",
        "≥ 0.8× the driver socket",
        Bound::AtLeast(0.8),
        &[replay.gateway_rate / replay.driver_rate.max(1.0)],
        "×",
        format!(
            "an ended turn of {} parts read just after its end: through the gateway (the copy its worker kept in \
             memory; `cargo bench --bench gateway` times the store's) {:.0} parts/s; on the driver's socket (its \
             memory) {:.0} parts/s",
            replay.parts, replay.gateway_rate, replay.driver_rate
        ),
    ));
    // The quick run attaches a tenth of the clients: held to the first wave's target for 1,000.
    let (fan_out_target, fan_out_limit) = if fan_out.clients >= 10_000 {
        ("10,000 attached clients < 200 MiB", 200.0)
    } else {
        (
            "1,000 attached clients < 100 MiB (the full run attaches 10,000: < 200 MiB)",
            100.0,
        )
    };
    rows.push(Row::measured(
        "fan-out memory",
        fan_out_target,
        Bound::AtMost(fan_out_limit),
        &[fan_out.serve_extra_mib],
        "MiB",
        format!(
            "{} clients on one running turn, each with its own ticket and connection: sortie serve's extra \
             resident memory; then a stop: the first client read the turn's finish {:.0} ms after it, the last \
             {:.0} ms after the first",
            fan_out.clients, fan_out.first_finish_ms, fan_out.finish_spread_ms
        ),
    ));

    let took = total.elapsed().as_secs_f64();
    if args.json {
        println!(
            "{}",
            serde_json::to_string_pretty(&json!({"seconds": took, "rows": rows}))?
        );
    } else if args.markdown {
        let header = format!(
            "# Benchmarks\n\nWritten by `sortie bench --markdown` (as root, {:.0} s on this machine; {} sessions per row). \
             Each row is a DESIGN §10 target; the baseline is measured in the same run.\n",
            took, sessions
        );
        print!("{}", markdown(&rows, &header));
    } else {
        for row in &rows {
            let result = match row.pass {
                Some(true) => "pass",
                Some(false) => "MISS",
                None => "-",
            };
            println!("{result:<5} {}: {}", row.name, row.measured);
            println!("      target {}", row.target);
            if !row.baseline.is_empty() {
                println!("      baseline {}", row.baseline);
            }
        }
        println!("{took:.0} s");
    }
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_are_nearest_rank() {
        let samples = [5.0, 1.0, 4.0, 2.0, 3.0];
        assert_eq!(percentile(&samples, 0.5), Some(3.0));
        assert_eq!(percentile(&samples, 0.95), Some(5.0));
        assert_eq!(percentile(&[7.0], 0.5), Some(7.0));
        assert_eq!(percentile(&[], 0.5), None);
        assert_eq!(median_ratio(&[4.0, 6.0, 100.0], &[2.0, 3.0]), vec![3.0]);
        assert_eq!(median_ratio(&[4.0], &[0.0]), Vec::<f64>::new());
        assert_eq!(median_ratio(&[], &[1.0]), Vec::<f64>::new());
    }

    #[test]
    fn a_row_passes_on_its_median_against_its_bound() {
        let row = Row::measured(
            "r",
            "≤ 10 ms",
            Bound::AtMost(10.0),
            &[9.0, 30.0, 10.0],
            "ms",
            String::new(),
        );
        assert_eq!(row.pass, Some(true));
        let row = Row::measured("r", "≤ 0.4 s", Bound::AtMost(0.4), &[0.5], "s", String::new());
        assert_eq!(row.pass, Some(false));
        assert_eq!(
            Row::measured("r", "", Bound::AtMost(1.0), &[], "ms", String::new()).pass,
            None
        );
        // A tail target is checked on its tail: one slow sample in 100 is within p99, two are not.
        let mut samples = vec![1.0; 99];
        samples.push(5.0);
        let tail = Row::measured_at("t", "", Bound::AtMost(2.0), 0.99, &samples, "ms", String::new());
        assert_eq!((tail.pass, tail.value), (Some(true), Some(1.0)));
        assert!(tail.measured.contains("p99 1.0 ms"), "{}", tail.measured);
        samples[0] = 5.0;
        let tail = Row::measured_at("t", "", Bound::AtMost(2.0), 0.99, &samples, "ms", String::new());
        assert_eq!(tail.pass, Some(false));
        let unmeasured = Row::measured("e", "t", Bound::AtMost(1.0), &[], "ms", String::new());
        let table = markdown(&[row, unmeasured], "# B\n");
        assert!(table.contains("| r: ≤ 0.4 s | 0.5 s | — | **miss** |"), "{table}");
        assert!(table.contains("| e: t | no samples | — | — |"), "{table}");
    }
}
