//! A session's conversation for a terminal: [`Renderer`] turns the AI SDK UI message stream's chunks
//! (as the gateway serves them) into text — the agent's words as they stream, reasoning dimmed and
//! folded to a line, each tool call on one line with its status and duration and, for commands, the
//! output's last lines, diffs coloured, the plan as a checklist, egress denials with the command that
//! lifts them, and the delivery. Pure: chunks in, text out; the caller owns the terminal.
//!
//! Everything in a stream came from a sandbox, which is untrusted: control characters (escape
//! sequences that could rewrite the user's terminal) are dropped from anything shown.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::time::{Duration, SystemTime};

use serde_json::Value;

/// How to render.
#[derive(Clone, Debug)]
pub struct Options {
    /// ANSI colours and dimming (a terminal); plain text otherwise.
    pub color: bool,
    /// Every line of command output and diffs, not only the last ones.
    pub full: bool,
    /// The session, for the commands suggested (`sortie allow <session> <host>`).
    pub session: String,
}

/// Where a sandbox mounts the session's checkout.
const WORKSPACE_MOUNT: &str = "/workspace/";
/// How many lines of a command's output are shown without [`Options::full`].
pub const OUTPUT_TAIL_LINES: usize = 10;
/// How many lines of a diff are shown without [`Options::full`].
pub const DIFF_LINES: usize = 40;
/// How much of a reasoning block is kept to fold into its line.
const REASONING_KEPT: usize = 4096;
/// The longest line a folded reasoning block or an error summary shows.
const SUMMARY_CHARS: usize = 120;

/// What the agent is doing now, for a status line.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Activity {
    Thinking,
    Writing,
    /// A tool call runs (its title), since when.
    Tool {
        title: String,
        since: SystemTime,
    },
    Delivering,
}

impl std::fmt::Display for Activity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Thinking => f.write_str("thinking"),
            Self::Writing => f.write_str("writing"),
            Self::Delivering => f.write_str("delivering"),
            Self::Tool { title, since } => {
                let running = SystemTime::now().duration_since(*since).unwrap_or_default();
                write!(f, "{title} ({})", seconds(running))
            }
        }
    }
}

#[derive(Debug, Default)]
struct ToolCall {
    name: String,
    title: Option<String>,
    input: Value,
    /// A terminal's output the agent attached to the call.
    terminal: Option<(String, Option<i64>)>,
    started: Option<SystemTime>,
}

/// Renders one turn's chunks (or several turns' in a row).
#[derive(Debug)]
pub struct Renderer {
    options: Options,
    at_line_start: bool,
    reasoning: Option<String>,
    tools: HashMap<String, ToolCall>,
    /// Diffs by part id (a later version replaces an earlier one), shown when their call ends.
    diffs: Vec<(String, String, Value)>,
    plan: Option<Vec<(String, String)>>,
    activity: Option<Activity>,
    tokens: Option<(u64, u64)>,
}

impl Renderer {
    pub fn new(options: Options) -> Self {
        Self {
            options,
            at_line_start: true,
            reasoning: None,
            tools: HashMap::new(),
            diffs: Vec::new(),
            plan: None,
            activity: None,
            tokens: None,
        }
    }

    /// What the agent is doing now, if anything.
    pub fn activity(&self) -> Option<&Activity> {
        self.activity.as_ref()
    }

    /// The turn's tokens so far (input, output), as the model proxy counted them.
    pub fn tokens(&self) -> Option<(u64, u64)> {
        self.tokens
    }

    /// Whether the text written so far ends a line.
    pub fn at_line_start(&self) -> bool {
        self.at_line_start
    }

    /// A line of the caller's own (a turn's header, a note), styled as a heading.
    pub fn heading(&mut self, text: &str, out: &mut String) {
        self.line_start(out);
        let text = clean(text);
        self.line(out, &self.paint(Paint::Bold, &text));
    }

    /// Renders one chunk, appending what it shows to `out`.
    pub fn push(&mut self, chunk: &Value, out: &mut String) {
        let kind = chunk.get("type").and_then(Value::as_str).unwrap_or_default();
        match kind {
            "text-start" => {
                self.line_start(out);
                self.activity = Some(Activity::Writing);
            }
            "text-delta" => {
                let delta = clean(str_field(chunk, "delta"));
                if !delta.is_empty() {
                    out.push_str(&delta);
                    self.at_line_start = delta.ends_with('\n');
                }
            }
            "text-end" => {
                self.line_start(out);
                self.activity = None;
            }
            "reasoning-start" => {
                self.reasoning = Some(String::new());
                self.activity = Some(Activity::Thinking);
            }
            "reasoning-delta" => {
                if let Some(kept) = &mut self.reasoning
                    && kept.len() < REASONING_KEPT
                {
                    kept.push_str(str_field(chunk, "delta"));
                }
            }
            "reasoning-end" => {
                let text = self.reasoning.take().unwrap_or_default();
                let text = clean(&text);
                let mut lines = text.lines().map(str::trim).filter(|l| !l.is_empty());
                if let Some(first) = lines.next() {
                    let folded = lines.next().is_some() || first.chars().count() > SUMMARY_CHARS;
                    let shown = format!("∴ {}{}", truncate(first, SUMMARY_CHARS), if folded { " …" } else { "" });
                    self.line_start(out);
                    self.line(out, &self.paint(Paint::Dim, &shown));
                }
            }
            "tool-input-start" | "tool-input-available" => self.tool_input(chunk),
            "tool-output-available" => self.tool_output(chunk, out),
            "tool-output-error" => self.tool_error(chunk, out),
            "error" => {
                self.line_start(out);
                let text = format!("✗ {}", clean(str_field(chunk, "errorText")));
                self.line(out, &self.paint(Paint::Red, &text));
            }
            "finish" => {
                self.flush_diffs(None, out);
                self.line_start(out);
                self.activity = None;
            }
            "data-acp-diff" => {
                let id = chunk.get("id").and_then(Value::as_str).unwrap_or_default().to_owned();
                let data = chunk.get("data").cloned().unwrap_or(Value::Null);
                let call = str_field(&data, "toolCallId").to_owned();
                match self.diffs.iter_mut().find(|(known, _, _)| *known == id) {
                    Some(entry) => entry.2 = data,
                    None => self.diffs.push((id, call, data)),
                }
            }
            "data-acp-terminal" => {
                let data = chunk.get("data").cloned().unwrap_or(Value::Null);
                let call = str_field(&data, "toolCallId").to_owned();
                let exit = data.pointer("/exitStatus/exitCode").and_then(Value::as_i64);
                let output = str_field(&data, "output").to_owned();
                self.tools.entry(call).or_default().terminal = Some((output, exit));
            }
            "data-acp-plan" => self.plan(chunk, out),
            "data-sortie-egress-denied" => {
                let data = chunk.get("data").cloned().unwrap_or(Value::Null);
                let host = clean(str_field(&data, "host"));
                let port = data.get("port").and_then(Value::as_u64).unwrap_or_default();
                self.line_start(out);
                let text = format!("⊘ blocked {host}:{port}: {}", clean(str_field(&data, "reason")));
                self.line(out, &self.paint(Paint::Yellow, &text));
                let hint = format!("  allow it: sortie allow {} {host}", self.options.session);
                self.line(out, &self.paint(Paint::Dim, &hint));
            }
            "data-sortie-delivery" => self.delivery(chunk.get("data").unwrap_or(&Value::Null), out),
            "data-sortie-phase" if chunk.pointer("/data/phase").and_then(Value::as_str) == Some("delivering") => {
                self.flush_diffs(None, out);
                self.activity = Some(Activity::Delivering);
            }
            "data-sortie-usage" => {
                let input = chunk
                    .pointer("/data/inputTokens")
                    .and_then(Value::as_u64)
                    .unwrap_or_default();
                let output = chunk
                    .pointer("/data/outputTokens")
                    .and_then(Value::as_u64)
                    .unwrap_or_default();
                self.tokens = Some((input, output));
            }
            "data-sortie-notice" => {
                let data = chunk.get("data").unwrap_or(&Value::Null);
                self.line_start(out);
                let text = format!(
                    "! {}: {}",
                    clean(str_field(data, "code")),
                    clean(str_field(data, "message"))
                );
                self.line(out, &self.paint(Paint::Yellow, &text));
            }
            _ => {}
        }
    }

    fn tool_input(&mut self, chunk: &Value) {
        let id = str_field(chunk, "toolCallId").to_owned();
        let call = self.tools.entry(id).or_default();
        if let Some(name) = chunk.get("toolName").and_then(Value::as_str) {
            call.name = clean(name);
        }
        if let Some(title) = chunk.get("title").and_then(Value::as_str) {
            call.title = Some(clean(title));
        }
        if let Some(input) = chunk.get("input") {
            call.input = input.clone();
        }
        if call.started.is_none() {
            call.started = Some(at(chunk, "at").unwrap_or_else(SystemTime::now));
        }
        let title = label(call);
        let since = call.started.unwrap_or_else(SystemTime::now);
        self.activity = Some(Activity::Tool { title, since });
    }

    fn tool_output(&mut self, chunk: &Value, out: &mut String) {
        let id = str_field(chunk, "toolCallId").to_owned();
        let call = self.tools.remove(&id).unwrap_or_default();
        let output = chunk.get("output").unwrap_or(&Value::Null);
        let (text, exit) = output_text(output, call.terminal.as_ref());
        let mut head = format!("✓ {}", label(&call));
        if let Some(took) = duration(chunk) {
            let _ = write!(head, " ({})", seconds(took));
        }
        if let Some(code) = exit {
            let _ = write!(head, " · exit {code}");
        }
        self.line_start(out);
        let paint = if exit.is_some_and(|c| c != 0) {
            Paint::Red
        } else {
            Paint::Green
        };
        self.line(out, &self.paint(paint, &head));
        if let Some(text) = text {
            self.output_block(&text, out);
        }
        self.flush_diffs(Some(&id), out);
        self.activity = None;
    }

    fn tool_error(&mut self, chunk: &Value, out: &mut String) {
        let id = str_field(chunk, "toolCallId").to_owned();
        let call = self.tools.remove(&id).unwrap_or_default();
        let mut head = format!("✗ {}", label(&call));
        if let Some(took) = duration(chunk) {
            let _ = write!(head, " ({})", seconds(took));
        }
        self.line_start(out);
        self.line(out, &self.paint(Paint::Red, &head));
        let text = clean(str_field(chunk, "errorText"));
        let text = match call.terminal {
            Some((output, _)) if !output.trim().is_empty() => clean(&output),
            _ => text,
        };
        self.output_block(&text, out);
        self.flush_diffs(Some(&id), out);
        self.activity = None;
    }

    /// A command's output, indented, its last lines unless everything is asked for.
    fn output_block(&mut self, text: &str, out: &mut String) {
        let lines: Vec<&str> = text.lines().collect();
        let skip = if self.options.full {
            0
        } else {
            lines.len().saturating_sub(OUTPUT_TAIL_LINES)
        };
        if skip > 0 {
            let note = format!("  │ … {skip} earlier lines (--full shows them)");
            self.line(out, &self.paint(Paint::Dim, &note));
        }
        for line in &lines[skip..] {
            self.line(out, &format!("  │ {line}"));
        }
    }

    fn flush_diffs(&mut self, call: Option<&str>, out: &mut String) {
        let (now, later): (Vec<_>, Vec<_>) = std::mem::take(&mut self.diffs)
            .into_iter()
            .partition(|(_, owner, _)| call.is_none_or(|c| c == owner));
        self.diffs = later;
        for (_, _, data) in now {
            self.diff(&data, out);
        }
    }

    fn diff(&mut self, data: &Value, out: &mut String) {
        // Paths as the user's checkout names them, not under the sandbox's mount point.
        let path = clean(str_field(data, "path"));
        let path = path.strip_prefix(WORKSPACE_MOUNT).unwrap_or(&path).to_owned();
        let old = clean(data.get("oldText").and_then(Value::as_str).unwrap_or_default());
        let new = clean(data.get("newText").and_then(Value::as_str).unwrap_or_default());
        let created = data.get("oldText").is_none_or(Value::is_null);
        let diff = similar::TextDiff::from_lines(&old, &new);
        let (mut added, mut removed) = (0usize, 0usize);
        let mut body = Vec::new();
        for hunk in diff.unified_diff().context_radius(3).iter_hunks() {
            body.push((Paint::Cyan, hunk.header().to_string()));
            for change in hunk.iter_changes() {
                let (sign, paint) = match change.tag() {
                    similar::ChangeTag::Insert => {
                        added += 1;
                        ('+', Paint::Green)
                    }
                    similar::ChangeTag::Delete => {
                        removed += 1;
                        ('-', Paint::Red)
                    }
                    similar::ChangeTag::Equal => (' ', Paint::None),
                };
                let text = change.as_str().unwrap_or_default().trim_end_matches('\n');
                body.push((paint, format!("{sign}{text}")));
            }
        }
        self.line_start(out);
        let head = format!(
            "{} {path} +{added} −{removed}",
            if created { "new file" } else { "edited" }
        );
        self.line(out, &self.paint(Paint::Bold, &head));
        let shown = if self.options.full {
            body.len()
        } else {
            body.len().min(DIFF_LINES)
        };
        for (paint, text) in &body[..shown] {
            self.line(out, &format!("  {}", self.paint(*paint, text)));
        }
        if shown < body.len() {
            let note = format!("  … {} more lines (--full shows them)", body.len() - shown);
            self.line(out, &self.paint(Paint::Dim, &note));
        }
    }

    fn plan(&mut self, chunk: &Value, out: &mut String) {
        let entries: Vec<(String, String)> = chunk
            .pointer("/data/entries")
            .and_then(Value::as_array)
            .map(|entries| {
                entries
                    .iter()
                    .map(|e| (clean(str_field(e, "content")), str_field(e, "status").to_owned()))
                    .collect()
            })
            .unwrap_or_default();
        if entries.is_empty() || self.plan.as_ref() == Some(&entries) {
            return;
        }
        self.line_start(out);
        self.line(out, &self.paint(Paint::Bold, "plan"));
        for (content, status) in &entries {
            let (mark, paint) = match status.as_str() {
                "completed" => ("[x]", Paint::Green),
                "in_progress" => ("[~]", Paint::Yellow),
                _ => ("[ ]", Paint::None),
            };
            self.line(out, &format!("  {} {content}", self.paint(paint, mark)));
        }
        self.plan = Some(entries);
    }

    fn delivery(&mut self, data: &Value, out: &mut String) {
        self.flush_diffs(None, out);
        self.line_start(out);
        let branch = clean(str_field(data, "branch"));
        if let Some(error) = data.get("error").filter(|e| !e.is_null()) {
            let text = format!(
                "✗ delivery to {branch} failed: {}: {}",
                clean(str_field(error, "code")),
                clean(str_field(error, "reason"))
            );
            self.line(out, &self.paint(Paint::Red, &text));
            return;
        }
        let pushed = data.get("pushed").and_then(Value::as_bool).unwrap_or(false);
        if !pushed {
            let text = format!("→ nothing new for {branch}");
            self.line(out, &self.paint(Paint::Dim, &text));
            return;
        }
        let sha = clean(str_field(data, "headSha"));
        let stat = |key: &str| {
            data.pointer(&format!("/diffStat/{key}"))
                .and_then(Value::as_u64)
                .unwrap_or_default()
        };
        let text = format!(
            "→ delivered {branch} at {}: {} files +{} −{}",
            truncate(&sha, 12),
            stat("files"),
            stat("insertions"),
            stat("deletions")
        );
        self.line(out, &self.paint(Paint::Green, &text));
        if let Some(pr) = data.get("prUrl").and_then(Value::as_str) {
            self.line(out, &format!("  pull request: {}", clean(pr)));
        }
        self.activity = None;
    }

    fn line_start(&mut self, out: &mut String) {
        if !self.at_line_start {
            out.push('\n');
            self.at_line_start = true;
        }
    }

    fn line(&mut self, out: &mut String, text: &str) {
        out.push_str(text);
        out.push('\n');
        self.at_line_start = true;
    }

    fn paint(&self, paint: Paint, text: &str) -> String {
        let code = match paint {
            Paint::None => return text.to_owned(),
            Paint::Bold => "1",
            Paint::Dim => "2",
            Paint::Red => "31",
            Paint::Green => "32",
            Paint::Yellow => "33",
            Paint::Cyan => "36",
        };
        if self.options.color {
            format!("\x1b[{code}m{text}\x1b[0m")
        } else {
            text.to_owned()
        }
    }
}

#[derive(Clone, Copy, Debug)]
enum Paint {
    None,
    Bold,
    Dim,
    Red,
    Green,
    Yellow,
    Cyan,
}

fn str_field<'a>(value: &'a Value, key: &str) -> &'a str {
    value.get(key).and_then(Value::as_str).unwrap_or_default()
}

/// A call's one-line label: a command as `$ command`, else its title, else its tool's name.
fn label(call: &ToolCall) -> String {
    let command = match call.input.get("command") {
        Some(Value::String(command)) => Some(command.clone()),
        Some(Value::Array(words)) => Some(words.iter().filter_map(Value::as_str).collect::<Vec<_>>().join(" ")),
        _ => None,
    };
    let text = match (command, &call.title) {
        (Some(command), _) if !command.is_empty() => format!("$ {}", clean(&command)),
        (_, Some(title)) if !title.is_empty() => title.clone(),
        _ if !call.name.is_empty() => call.name.clone(),
        _ => "tool".to_owned(),
    };
    truncate(text.lines().next().unwrap_or_default(), SUMMARY_CHARS)
}

/// A tool's output as text and its exit code, from whichever shape the agent gave it: a string,
/// `{text, raw: {exitCode}}`, an object with `output`/`stdout`, or a terminal the call carried.
fn output_text(output: &Value, terminal: Option<&(String, Option<i64>)>) -> (Option<String>, Option<i64>) {
    let exit = output
        .pointer("/raw/exitCode")
        .or_else(|| output.get("exitCode"))
        .or_else(|| output.pointer("/metadata/exit"))
        .and_then(Value::as_i64)
        .or_else(|| terminal.and_then(|(_, exit)| *exit));
    let text = match output {
        Value::String(text) => Some(text.clone()),
        Value::Object(map) => ["text", "output", "stdout"]
            .iter()
            .find_map(|key| map.get(*key).and_then(Value::as_str))
            .map(str::to_owned),
        _ => None,
    }
    .or_else(|| terminal.map(|(output, _)| output.clone()))
    .map(|text| clean(&text))
    .filter(|text| !text.trim().is_empty());
    (text, exit)
}

/// A call's duration from its `providerMetadata.sortie` stamps.
fn duration(chunk: &Value) -> Option<Duration> {
    let stamps = chunk.pointer("/providerMetadata/sortie")?;
    let start = at(stamps, "at")?;
    let end = at(stamps, "endedAt")?;
    end.duration_since(start).ok()
}

fn at(value: &Value, key: &str) -> Option<SystemTime> {
    let text = value
        .get(key)
        .or_else(|| value.pointer(&format!("/providerMetadata/sortie/{key}")))?
        .as_str()?;
    humantime::parse_rfc3339_weak(text).ok()
}

/// A duration as people read it: `850 ms`, `4.2 s`, `3 m 05 s`.
pub fn seconds(took: Duration) -> String {
    let ms = took.as_millis();
    if ms < 1000 {
        format!("{ms} ms")
    } else if ms < 60_000 {
        format!("{:.1} s", took.as_secs_f64())
    } else {
        let secs = took.as_secs();
        format!("{} m {:02} s", secs / 60, secs % 60)
    }
}

/// Text from a sandbox made safe to print: no escape sequences or other control characters (tabs and
/// newlines stay), and a carriage return keeps what a terminal would show of its line (the text after it).
pub fn clean(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for (i, line) in text.split('\n').enumerate() {
        if i > 0 {
            out.push('\n');
        }
        let line = line.trim_end_matches('\r');
        let shown = line.rsplit('\r').next().unwrap_or_default();
        let mut chars = shown.chars().peekable();
        while let Some(c) = chars.next() {
            if c == '\x1b' {
                // An escape sequence: drop it whole (CSI `ESC [ … final`, or ESC and one character).
                if chars.peek() == Some(&'[') {
                    chars.next();
                    for next in chars.by_ref() {
                        if ('\x40'..='\x7e').contains(&next) {
                            break;
                        }
                    }
                } else {
                    chars.next();
                }
            } else if c == '\t' || !c.is_control() {
                out.push(c);
            }
        }
    }
    out
}

fn truncate(text: &str, chars: usize) -> String {
    if text.chars().count() <= chars {
        text.to_owned()
    } else {
        let mut cut: String = text.chars().take(chars.saturating_sub(1)).collect();
        cut.push('…');
        cut
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn render(chunks: &[Value], color: bool, full: bool) -> String {
        let mut renderer = Renderer::new(Options {
            color,
            full,
            session: "ses_x".into(),
        });
        let mut out = String::new();
        for chunk in chunks {
            renderer.push(chunk, &mut out);
        }
        out
    }

    const AT: &str = "2026-12-05T10:00:00.000Z";
    const LATER: &str = "2026-12-05T10:00:01.500Z";

    #[test]
    fn words_stream_and_blocks_start_on_their_own_line() {
        let out = render(
            &[
                json!({"type": "text-start", "id": "t1"}),
                json!({"type": "text-delta", "id": "t1", "delta": "Hello, "}),
                json!({"type": "text-delta", "id": "t1", "delta": "world."}),
                json!({"type": "text-end", "id": "t1"}),
                json!({"type": "reasoning-start", "id": "r1"}),
                json!({"type": "reasoning-delta", "id": "r1", "delta": "first thought\nsecond thought"}),
                json!({"type": "reasoning-end", "id": "r1"}),
            ],
            false,
            false,
        );
        assert_eq!(out, "Hello, world.\n∴ first thought …\n");
    }

    #[test]
    fn a_command_shows_its_exit_code_duration_and_last_lines() {
        let output: String = (1..=15).map(|i| format!("line {i}\n")).collect();
        let chunks = [
            json!({"type": "tool-input-start", "toolCallId": "c1", "toolName": "execute", "title": "Run", "dynamic": true}),
            json!({"type": "tool-input-available", "toolCallId": "c1", "toolName": "execute", "input": {"command": "npm test"}, "dynamic": true}),
            json!({"type": "tool-output-available", "toolCallId": "c1", "output": {"text": output, "raw": {"exitCode": 1}},
                   "providerMetadata": {"sortie": {"at": AT, "endedAt": LATER}}}),
        ];
        let out = render(&chunks, false, false);
        assert!(
            out.starts_with("✓ $ npm test (1.5 s) · exit 1\n  │ … 5 earlier lines (--full shows them)\n  │ line 6\n"),
            "{out}"
        );
        assert!(out.ends_with("  │ line 15\n"), "{out}");
        let full = render(&chunks, false, true);
        assert!(
            full.contains("  │ line 1\n") && !full.contains("earlier lines"),
            "{full}"
        );
    }

    #[test]
    fn a_failed_tool_says_why() {
        let out = render(
            &[
                json!({"type": "tool-input-start", "toolCallId": "c1", "toolName": "read", "title": "Read a.txt"}),
                json!({"type": "tool-output-error", "toolCallId": "c1", "errorText": "no such file"}),
            ],
            false,
            false,
        );
        assert_eq!(out, "✗ Read a.txt\n  │ no such file\n");
    }

    #[test]
    fn diffs_show_when_their_call_ends_coloured_on_a_terminal() {
        let chunks = [
            json!({"type": "tool-input-start", "toolCallId": "w", "toolName": "edit", "title": "Write a.txt"}),
            json!({"type": "data-acp-diff", "id": "diff:w:a.txt", "data": {"toolCallId": "w", "path": "a.txt", "oldText": "one\ntwo\n", "newText": "one\nthree\n"}}),
            json!({"type": "tool-output-available", "toolCallId": "w", "output": null}),
        ];
        let plain = render(&chunks, false, false);
        assert_eq!(
            plain,
            "✓ Write a.txt\nedited a.txt +1 −1\n  @@ -1,2 +1,2 @@\n   one\n  -two\n  +three\n"
        );
        let coloured = render(&chunks, true, false);
        assert!(
            coloured.contains("\x1b[32m+three\x1b[0m") && coloured.contains("\x1b[31m-two\x1b[0m"),
            "{coloured:?}"
        );
    }

    #[test]
    fn plan_denials_delivery_and_errors_are_lines_of_their_own() {
        let out = render(
            &[
                json!({"type": "data-acp-plan", "id": "plan", "data": {"entries": [{"content": "a", "status": "completed"}, {"content": "b", "status": "pending"}]}}),
                json!({"type": "data-acp-plan", "id": "plan", "data": {"entries": [{"content": "a", "status": "completed"}, {"content": "b", "status": "pending"}]}}),
                json!({"type": "data-sortie-egress-denied", "data": {"host": "example.com", "port": 443, "reason": "not on the allowlist"}}),
                json!({"type": "data-sortie-delivery", "id": "delivery", "data": {"branch": "sortie/ses_x", "pushed": true, "changed": true,
                       "headSha": "0123456789abcdef0123", "diffStat": {"files": 2, "insertions": 14, "deletions": 1}}}),
                json!({"type": "error", "errorText": "TURN_TIMEOUT: the turn ran past 1800 s"}),
            ],
            false,
            false,
        );
        assert_eq!(
            out,
            "plan\n  [x] a\n  [ ] b\n⊘ blocked example.com:443: not on the allowlist\n  allow it: sortie allow ses_x example.com\n\
             → delivered sortie/ses_x at 0123456789a…: 2 files +14 −1\n✗ TURN_TIMEOUT: the turn ran past 1800 s\n"
        );
    }

    #[test]
    fn plain_output_has_no_escape_codes_even_when_the_agent_sends_them() {
        let out = render(
            &[
                json!({"type": "text-start", "id": "t"}),
                json!({"type": "text-delta", "id": "t", "delta": "\u{1b}]0;owned\u{7}\u{1b}[2Jclear\u{1b}[31mred\rover\n"}),
                json!({"type": "tool-input-start", "toolCallId": "c", "toolName": "x\u{1b}[1A"}),
                json!({"type": "tool-output-available", "toolCallId": "c", "output": "progress 10%\rprogress 100%\n"}),
            ],
            false,
            false,
        );
        assert!(!out.contains('\u{1b}') && !out.contains('\u{7}'), "{out:?}");
        assert!(out.contains("over\n") && out.contains("  │ progress 100%\n"), "{out:?}");
    }

    #[test]
    fn activity_follows_the_turn() {
        let mut renderer = Renderer::new(Options {
            color: false,
            full: false,
            session: "s".into(),
        });
        let mut out = String::new();
        renderer.push(&json!({"type": "reasoning-start", "id": "r"}), &mut out);
        assert_eq!(renderer.activity(), Some(&Activity::Thinking));
        renderer.push(
            &json!({"type": "tool-input-start", "toolCallId": "c", "toolName": "read", "title": "Read x"}),
            &mut out,
        );
        assert!(matches!(renderer.activity(), Some(Activity::Tool { title, .. }) if title == "Read x"));
        renderer.push(
            &json!({"type": "data-sortie-phase", "id": "phase", "data": {"phase": "delivering", "timings": {}}}),
            &mut out,
        );
        assert_eq!(renderer.activity(), Some(&Activity::Delivering));
        renderer.push(&json!({"type": "data-sortie-usage", "id": "tokens", "data": {"api": "anthropic", "model": "m", "inputTokens": 5, "outputTokens": 7}}), &mut out);
        assert_eq!(renderer.tokens(), Some((5, 7)));
    }
}
