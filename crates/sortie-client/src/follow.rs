//! `sortie run --follow` and `sortie logs`: a session's turns in the terminal, rendered by
//! `sortie_term` (or, with `--json`, their raw parts one JSON object a line). A turn is read from the
//! gateway's stream with a fresh ticket, like any client; a dropped connection is attached again with
//! `Last-Event-ID` set to the last part shown, so nothing is shown twice or missed. Exits with the
//! outcome of the last turn shown.

use std::io::{IsTerminal, Write};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::Context;
use futures::StreamExt;
use reqwest::{Method, StatusCode};
use serde_json::Value;
use sortie_feed::sse::SseDecoder;
use sortie_protocol::TurnStatus;
use sortie_protocol::api::{AttachTicket, AttachTicketRequest, Session, Turn, TurnList};
use sortie_term::{Options, Renderer};

use crate::commands::refused;
use crate::http::{Answer, Client};

/// The turn failed (or was lost).
const EXIT_FAILED: u8 = 1;
/// The turn was stopped, or the session canceled.
const EXIT_STOPPED: u8 = 3;
/// Ctrl-C: the terminal let go; the session goes on.
const EXIT_DETACHED: u8 = 130;
/// The longest SSE line read from the gateway (a part is at most a few MiB).
const SSE_LINE_MAX: usize = 16 << 20;

/// What to show.
pub struct Follow {
    /// Follow active turns live (else only ended turns are shown).
    pub live: bool,
    /// Only this turn.
    pub turn: Option<u32>,
    pub full: bool,
}

/// `sortie logs ID [-f] [--turn N]`.
pub async fn logs(client: &Client, id: &str, follow: Follow) -> anyhow::Result<ExitCode> {
    let mut screen = Screen::new(client, id, follow.full);
    let detach = tokio::signal::ctrl_c();
    tokio::pin!(detach);
    tokio::select! {
        outcome = show_turns(client, id, &follow, &mut screen) => {
            screen.done();
            outcome
        }
        _ = &mut detach => {
            screen.done();
            eprintln!("detached; the session goes on (`sortie logs {id} -f` follows it again)");
            Ok(ExitCode::from(EXIT_DETACHED))
        }
    }
}

/// `sortie run --follow`: the new session's first turn, then whatever it queued behind it.
pub async fn run(client: &Client, session: &Session, full: bool) -> anyhow::Result<ExitCode> {
    eprintln!(
        "{}  {}\nbranch {}  (Ctrl-C detaches; the session goes on)",
        session.id, session.title, session.branch
    );
    let follow = Follow {
        live: true,
        turn: None,
        full,
    };
    logs(client, session.id.as_str(), follow).await
}

async fn show_turns(client: &Client, id: &str, follow: &Follow, screen: &mut Screen) -> anyhow::Result<ExitCode> {
    let mut shown: Option<u32> = None;
    let mut outcome = ExitCode::SUCCESS;
    loop {
        let turns = match client
            .call::<TurnList>(Method::GET, &format!("/v1/sessions/{id}/turns"))
            .await?
        {
            Answer::Ok(list, _) => list.turns,
            Answer::Refused(refusal) => return Ok(refused(client, &refusal)),
        };
        let next = turns.iter().find(|turn| {
            shown.is_none_or(|n| turn.n > n)
                && follow.turn.is_none_or(|n| turn.n == n)
                && (follow.live || turn.status.is_terminal())
        });
        let Some(turn) = next.cloned() else {
            // Nothing more to show now: done, unless a followed session has turns still coming.
            if follow.live && follow.turn.is_none() && still_working(client, id).await? {
                tokio::time::sleep(Duration::from_millis(200)).await;
                continue;
            }
            if !follow.live
                && let Some(running) = turns.iter().find(|t| !t.status.is_terminal())
            {
                eprintln!(
                    "turn {} is {}: `sortie logs {id} -f` follows it",
                    running.n, running.status
                );
            }
            return Ok(outcome);
        };
        screen.turn_heading(&turn);
        stream_turn(client, id, turn.n, screen).await?;
        let ended = ended_turn(client, id, turn.n).await?;
        outcome = screen.outcome(&ended);
        shown = Some(turn.n);
        if follow.turn.is_some() {
            return Ok(outcome);
        }
    }
}

/// Whether the session has a turn waiting or running.
async fn still_working(client: &Client, id: &str) -> anyhow::Result<bool> {
    match client
        .call::<Session>(Method::GET, &format!("/v1/sessions/{id}"))
        .await?
    {
        Answer::Ok(session, _) => Ok(session.phase.has_active_turn()),
        Answer::Refused(refusal) => anyhow::bail!("{}: {}", refusal.error.code, refusal.error.message),
    }
}

/// The turn once the store says it ended (its stream ends a moment before its status is written).
async fn ended_turn(client: &Client, id: &str, n: u32) -> anyhow::Result<Turn> {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Answer::Ok(list, _) = client
            .call::<TurnList>(Method::GET, &format!("/v1/sessions/{id}/turns"))
            .await?
            && let Some(turn) = list.turns.into_iter().find(|t| t.n == n)
            && (turn.status.is_terminal() || Instant::now() > deadline)
        {
            return Ok(turn);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Shows turn `n` from its stream, attaching again after a drop, until `[DONE]`.
async fn stream_turn(client: &Client, id: &str, n: u32, screen: &mut Screen) -> anyhow::Result<()> {
    let mut last: Option<u64> = None;
    let mut backoff = Duration::from_millis(200);
    loop {
        match attach_once(client, id, n, &mut last, screen).await {
            Ok(true) => return Ok(()),
            Ok(false) => {}
            Err(error) => tracing::debug!(%error, "the stream broke; attaching again"),
        }
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(Duration::from_secs(5));
    }
}

/// One connection to the turn's stream; `true` once it said `[DONE]`.
async fn attach_once(
    client: &Client,
    id: &str,
    n: u32,
    last: &mut Option<u64>,
    screen: &mut Screen,
) -> anyhow::Result<bool> {
    let ticket = match client
        .send::<AttachTicket>(
            Method::POST,
            &format!("/v1/sessions/{id}/attach-ticket"),
            &AttachTicketRequest::default(),
        )
        .await?
    {
        Answer::Ok(ticket, _) => ticket,
        Answer::Refused(refusal) => anyhow::bail!("{}: {}", refusal.error.code, refusal.error.message),
    };
    let mut request = client
        .http
        .get(format!("{}{}?turn={n}", client.server, ticket.stream_url))
        .header("authorization", format!("Ticket {}", ticket.ticket));
    if let Some(index) = last {
        request = request.header("last-event-id", index.to_string());
    }
    let response = request.send().await.context("cannot reach the stream")?;
    if response.status() != StatusCode::OK {
        anyhow::bail!("the stream answered {}", response.status());
    }
    let mut body = response.bytes_stream();
    let mut decoder = SseDecoder::new(SSE_LINE_MAX);
    let mut events = Vec::new();
    let mut tick = tokio::time::interval(Duration::from_millis(250));
    loop {
        let bytes = tokio::select! {
            next = body.next() => match next {
                Some(Ok(bytes)) => bytes,
                Some(Err(error)) => return Err(error).context("the stream broke"),
                None => return Ok(false),
            },
            _ = tick.tick() => {
                screen.tick();
                continue;
            }
        };
        decoder.feed(&bytes, &mut events).context("the stream is not SSE")?;
        for event in events.drain(..) {
            if event.data == "[DONE]" {
                return Ok(true);
            }
            let index = event.id.as_deref().and_then(|id| id.parse::<u64>().ok());
            // The gateway resumes after Last-Event-ID; a part at or before it is never shown twice.
            if let (Some(index), Some(seen)) = (index, *last)
                && index <= seen
            {
                continue;
            }
            screen.part(&event.data);
            if index.is_some() {
                *last = index;
            }
        }
    }
}

/// The terminal: rendered parts on stdout, and on a terminal a status line on stderr.
struct Screen {
    renderer: Renderer,
    json: bool,
    status: Option<indicatif::ProgressBar>,
    /// Text of a line not ended yet, held while a status line is drawn below it.
    pending: String,
    turn_started: Instant,
    phase: String,
}

impl Screen {
    fn new(client: &Client, session: &str, full: bool) -> Self {
        let terminal = std::io::stdout().is_terminal();
        let color = terminal && std::env::var_os("NO_COLOR").is_none() && !client.json;
        let status = (color && std::io::stderr().is_terminal()).then(|| {
            let bar = indicatif::ProgressBar::with_draw_target(None, indicatif::ProgressDrawTarget::stderr());
            if let Ok(style) = indicatif::ProgressStyle::with_template("{spinner} {msg}") {
                bar.set_style(style);
            }
            bar
        });
        Self {
            renderer: Renderer::new(Options {
                color,
                full,
                session: session.to_owned(),
            }),
            json: client.json,
            status,
            pending: String::new(),
            turn_started: Instant::now(),
            phase: String::new(),
        }
    }

    fn turn_heading(&mut self, turn: &Turn) {
        self.turn_started = Instant::now();
        // Until the host's first phase part: the turn waits for a worker, or runs.
        self.phase = match turn.status {
            TurnStatus::Accepted => "waiting for a worker".to_owned(),
            status => status.to_string(),
        };
        if self.json {
            return;
        }
        // The prompt's first line that says something (not a `#!` marker such as `#!scripted`).
        let prompt = turn
            .prompt
            .lines()
            .map(str::trim)
            .find(|l| !l.is_empty() && !l.starts_with("#!"))
            .unwrap_or_default();
        let mut out = String::new();
        self.renderer
            .heading(&format!("── turn {} ── {}", turn.n, truncate(prompt, 100)), &mut out);
        self.write(&out);
    }

    fn part(&mut self, data: &str) {
        if self.json {
            say!("{data}");
            return;
        }
        let Ok(chunk) = serde_json::from_str::<Value>(data) else {
            return;
        };
        if let Some(phase) = chunk.pointer("/data/phase").and_then(Value::as_str)
            && chunk["type"] == "data-sortie-phase"
        {
            self.phase = phase.to_owned();
        }
        let mut out = String::new();
        self.renderer.push(&chunk, &mut out);
        self.write(&out);
        self.tick();
    }

    /// The turn's outcome as an exit status, said in a last line.
    fn outcome(&mut self, turn: &Turn) -> ExitCode {
        let (line, code) = match turn.status {
            TurnStatus::Completed => (format!("turn {} completed", turn.n), 0),
            TurnStatus::Stopped | TurnStatus::Canceled => (format!("turn {} {}", turn.n, turn.status), EXIT_STOPPED),
            TurnStatus::Failed | TurnStatus::Lost => {
                let why = turn
                    .failure
                    .as_ref()
                    .map(|f| {
                        let code = serde_json::to_value(f.code).ok();
                        let code = code.as_ref().and_then(Value::as_str).unwrap_or("FAILED");
                        format!(": {code}: {}", f.reason)
                    })
                    .unwrap_or_default();
                (format!("turn {} {}{why}", turn.n, turn.status), EXIT_FAILED)
            }
            TurnStatus::Accepted | TurnStatus::Running => {
                (format!("turn {} is still {}", turn.n, turn.status), EXIT_FAILED)
            }
        };
        if !self.json {
            let mut out = String::new();
            self.renderer.heading(&line, &mut out);
            self.write(&out);
        }
        ExitCode::from(code)
    }

    fn tick(&self) {
        if let Some(bar) = &self.status {
            let mut message = format!("{} · {}", self.phase, sortie_term::seconds(self.turn_started.elapsed()));
            if let Some(activity) = self.renderer.activity() {
                message.push_str(&format!(" · {activity}"));
            }
            if let Some((input, output)) = self.renderer.tokens() {
                message.push_str(&format!(" · {input}↑ {output}↓ tokens"));
            }
            bar.set_message(message);
            bar.tick();
        }
    }

    /// Writes rendered text; under a status line only whole lines, so the two never mix.
    fn write(&mut self, text: &str) {
        if text.is_empty() {
            return;
        }
        match &self.status {
            None => print_now(text),
            Some(bar) => {
                self.pending.push_str(text);
                if let Some(end) = self.pending.rfind('\n') {
                    let lines: String = self.pending.drain(..=end).collect();
                    bar.suspend(|| print_now(&lines));
                }
            }
        }
    }

    fn done(&mut self) {
        if let Some(bar) = self.status.take() {
            bar.finish_and_clear();
        }
        if !self.pending.is_empty() {
            let rest = std::mem::take(&mut self.pending);
            print_now(&format!("{rest}\n"));
        } else if !self.renderer.at_line_start() && !self.json {
            print_now("\n");
        }
    }
}

/// Prints and flushes; a reader that went away ends the command quietly.
fn print_now(text: &str) {
    let mut stdout = std::io::stdout().lock();
    if let Err(error) = stdout.write_all(text.as_bytes()).and_then(|()| stdout.flush()) {
        if error.kind() == std::io::ErrorKind::BrokenPipe {
            std::process::exit(0);
        }
        eprintln!("error: cannot write to stdout: {error}");
        std::process::exit(1);
    }
}

fn truncate(text: &str, chars: usize) -> String {
    if text.chars().count() <= chars {
        text.to_owned()
    } else {
        let mut cut: String = text.chars().take(chars - 1).collect();
        cut.push('…');
        cut
    }
}
