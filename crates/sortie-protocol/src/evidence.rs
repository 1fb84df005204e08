//! A session's evidence (`GET /v1/sessions/{id}/evidence`, and the body of its pull request): the task,
//! each turn's outcome and summary (the agent's final message), the commands it ran with their exit
//! codes and the tail of their output, the files the branch changes, timings and what it used.
//!
//! Pure: [`TurnEvidenceBuilder`] reads a turn's stored UI-message parts one at a time and keeps only
//! bounded pieces of them, so a turn of any size makes evidence of a bounded size; [`SessionEvidence::markdown`]
//! renders it for a pull request. The commands and summaries are what the agent's own stream said: the
//! evidence shows them as the agent's account, beside the diff the host read itself.

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// The most commands kept per turn (the rest are counted).
pub const COMMANDS_PER_TURN_MAX: usize = 50;
/// The most characters kept of a command line.
pub const COMMAND_MAX_CHARS: usize = 500;
/// The most lines, and characters, kept of the end of a command's output.
pub const OUTPUT_TAIL_LINES: usize = 15;
pub const OUTPUT_TAIL_MAX_CHARS: usize = 2_000;
/// The most characters kept of a turn's summary and prompt.
pub const SUMMARY_MAX_CHARS: usize = 3_000;
pub const PROMPT_MAX_CHARS: usize = 1_000;
/// The most lines of a steering prompt the description quotes.
const PROMPT_QUOTE_LINES: usize = 8;
/// The most files listed (the counts cover all of them).
pub const FILES_MAX: usize = 100;

/// `GET /v1/sessions/{id}/evidence`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct SessionEvidence {
    pub session: String,
    pub title: String,
    /// The first turn's prompt.
    pub task: String,
    pub repo: String,
    pub branch: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pr_url: Option<String>,
    /// Where the session is on the dashboard, when its address is configured.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dashboard_url: Option<String>,
    pub turns: Vec<TurnEvidence>,
    /// The branch against the commit it started from, as the host read it.
    pub files: Vec<FileEvidence>,
    pub files_changed: u64,
    pub insertions: u64,
    pub deletions: u64,
    pub input_tokens: u64,
    pub output_tokens: u64,
    pub compute_seconds: u64,
}

/// One turn of the evidence.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct TurnEvidence {
    pub n: u32,
    pub prompt: String,
    /// The turn's status (`completed`, `failed`, …).
    pub status: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failure: Option<String>,
    /// The agent's final message.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub summary: Option<String>,
    pub commands: Vec<CommandEvidence>,
    /// Commands run past the first [`COMMANDS_PER_TURN_MAX`].
    #[serde(default)]
    pub commands_omitted: u32,
    /// From claimed to ended, as the host measured it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub duration_ms: Option<u64>,
}

/// A command the agent ran.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct CommandEvidence {
    pub command: String,
    /// Its exit code, when the agent reported one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exit_code: Option<i64>,
    /// Whether the agent reported it failed (an exit code other than 0, or its tool call failed).
    pub failed: bool,
    /// The last lines of its output.
    pub output_tail: String,
}

/// A file the branch changes.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct FileEvidence {
    pub path: String,
    pub insertions: u64,
    pub deletions: u64,
}

fn cut(text: &str, max: usize) -> String {
    if text.chars().count() <= max {
        return text.to_owned();
    }
    let mut kept: String = text.chars().take(max).collect();
    kept.push('…');
    kept
}

/// The last [`OUTPUT_TAIL_LINES`] lines of `text`, at most [`OUTPUT_TAIL_MAX_CHARS`] characters.
fn tail(text: &str) -> String {
    let text = text.trim_end();
    let lines: Vec<&str> = text.lines().collect();
    let kept = lines[lines.len().saturating_sub(OUTPUT_TAIL_LINES)..].join("\n");
    let count = kept.chars().count();
    if count <= OUTPUT_TAIL_MAX_CHARS {
        kept
    } else {
        kept.chars().skip(count - OUTPUT_TAIL_MAX_CHARS).collect()
    }
}

/// An exit code in a tool's output: `{exitCode}`, `{exit_code}`, or under `raw` (a text and raw
/// output together) or `exitStatus`.
fn exit_code_in(value: &Value) -> Option<i64> {
    for key in ["exitCode", "exit_code"] {
        if let Some(code) = value.get(key).and_then(Value::as_i64) {
            return Some(code);
        }
    }
    ["raw", "exitStatus"]
        .iter()
        .find_map(|key| value.get(*key).and_then(exit_code_in))
}

/// The text of a tool's output: a string, or the `text` / `output` / `stdout` of an object.
fn text_in(value: &Value) -> String {
    match value {
        Value::String(text) => text.clone(),
        Value::Object(_) => ["text", "output", "stdout"]
            .iter()
            .find_map(|key| value.get(*key).and_then(Value::as_str))
            .unwrap_or_default()
            .to_owned(),
        _ => String::new(),
    }
}

/// Reads one turn's parts into its evidence, keeping bounded pieces only.
#[derive(Debug, Default)]
pub struct TurnEvidenceBuilder {
    /// Tool call id → index in `commands`, for the shell commands being followed.
    open: Vec<(String, usize)>,
    commands: Vec<CommandEvidence>,
    omitted: u32,
    /// The text of the message being written, and of the last one finished.
    text: String,
    last_text: Option<String>,
}

impl TurnEvidenceBuilder {
    /// Reads one stored part (the JSON of a UI-message chunk). Unknown or malformed parts are skipped.
    pub fn read(&mut self, part: &Value) {
        let kind = part.get("type").and_then(Value::as_str).unwrap_or_default();
        let call = || {
            part.get("toolCallId")
                .and_then(Value::as_str)
                .unwrap_or_default()
                .to_owned()
        };
        match kind {
            "text-start" => self.text.clear(),
            "text-delta" => {
                if let Some(delta) = part.get("delta").and_then(Value::as_str)
                    && self.text.len() <= SUMMARY_MAX_CHARS * 4
                {
                    self.text.push_str(delta);
                }
            }
            "text-end" => {
                if !self.text.trim().is_empty() {
                    self.last_text = Some(cut(self.text.trim(), SUMMARY_MAX_CHARS));
                }
                self.text.clear();
            }
            "tool-input-start" | "tool-input-available" => {
                let is_shell = part.get("toolName").and_then(Value::as_str) == Some("execute");
                let id = call();
                if !is_shell && !self.open.iter().any(|(open, _)| *open == id) {
                    return;
                }
                let command = part
                    .get("input")
                    .and_then(|input| input.get("command"))
                    .and_then(|command| match command {
                        Value::String(text) => Some(text.clone()),
                        Value::Array(words) => {
                            Some(words.iter().filter_map(Value::as_str).collect::<Vec<_>>().join(" "))
                        }
                        _ => None,
                    })
                    .or_else(|| part.get("title").and_then(Value::as_str).map(str::to_owned));
                match self.open.iter().find(|(open, _)| *open == id) {
                    Some((_, index)) => {
                        if let Some(command) = command {
                            self.commands[*index].command = cut(&command, COMMAND_MAX_CHARS);
                        }
                    }
                    None if self.commands.len() < COMMANDS_PER_TURN_MAX => {
                        self.commands.push(CommandEvidence {
                            command: cut(&command.unwrap_or_default(), COMMAND_MAX_CHARS),
                            ..Default::default()
                        });
                        self.open.push((id, self.commands.len() - 1));
                    }
                    // Every call opens with a start (the driver's mapping): counted once.
                    None if kind == "tool-input-start" => self.omitted = self.omitted.saturating_add(1),
                    None => {}
                }
            }
            "tool-output-available" | "tool-output-error" => {
                let id = call();
                let Some(index) = self.open.iter().find(|(open, _)| *open == id).map(|(_, i)| *i) else {
                    return;
                };
                let command = &mut self.commands[index];
                if kind == "tool-output-error" {
                    let text = part.get("errorText").and_then(Value::as_str).unwrap_or_default();
                    command.failed = true;
                    command.exit_code = command
                        .exit_code
                        .or_else(|| serde_json::from_str::<Value>(text).ok().as_ref().and_then(exit_code_in));
                    // A bare `{"exitCode": 1}` says nothing more than the exit code.
                    if serde_json::from_str::<Value>(text).is_err() {
                        command.output_tail = tail(text);
                    }
                } else {
                    let output = part.get("output").cloned().unwrap_or(Value::Null);
                    if let Some(code) = exit_code_in(&output) {
                        command.exit_code = Some(code);
                        command.failed = code != 0;
                    }
                    let text = text_in(&output);
                    if !text.is_empty() {
                        command.output_tail = tail(&text);
                    }
                }
            }
            "data-acp-terminal" => {
                let data = part.get("data").cloned().unwrap_or(Value::Null);
                let id = data.get("toolCallId").and_then(Value::as_str).unwrap_or_default();
                let Some(index) = self.open.iter().find(|(open, _)| open == id).map(|(_, i)| *i) else {
                    return;
                };
                let command = &mut self.commands[index];
                if let Some(code) = data.get("exitStatus").and_then(exit_code_in) {
                    command.exit_code = Some(code);
                    command.failed = code != 0;
                }
                if let Some(output) = data.get("output").and_then(Value::as_str) {
                    command.output_tail = tail(output);
                }
            }
            _ => {}
        }
    }

    /// The turn's evidence, with the host's own facts about it.
    pub fn finish(
        self,
        n: u32,
        prompt: &str,
        status: &str,
        failure: Option<String>,
        duration_ms: Option<u64>,
    ) -> TurnEvidence {
        TurnEvidence {
            n,
            prompt: cut(prompt, PROMPT_MAX_CHARS),
            status: status.to_owned(),
            failure,
            summary: self.last_text,
            commands: self.commands,
            commands_omitted: self.omitted,
            duration_ms,
        }
    }
}

/// `text` with its `@name` mentions and `#n` references made inert (a word joiner after the sign): words
/// quoted outside a code block must not notify people or link issues from a pull request's description.
fn inert(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut chars = text.chars().peekable();
    while let Some(c) = chars.next() {
        out.push(c);
        if (c == '@' || c == '#') && chars.peek().is_some_and(|next| next.is_ascii_alphanumeric()) {
            out.push('\u{2060}');
        }
    }
    out
}

/// `text` as one Markdown table cell or code span: no pipes, no newlines, no backticks to break out.
fn cell(text: &str) -> String {
    text.replace('|', "\\|").replace(['\n', '\r'], " ").replace('`', "'")
}

/// A fence longer than any run of backticks in `text`, so the text cannot close it.
fn fence(text: &str) -> String {
    let longest = text.split(|c| c != '`').map(str::len).max().unwrap_or(0);
    "`".repeat(longest.max(2) + 1)
}

fn seconds(ms: u64) -> String {
    if ms < 1000 {
        format!("{ms} ms")
    } else {
        format!("{:.1} s", ms as f64 / 1000.0)
    }
}

impl SessionEvidence {
    /// The evidence as a pull request's description.
    pub fn markdown(&self) -> String {
        let mut out = String::new();
        let task_fence = fence(&self.task);
        out.push_str(&format!(
            "**Task**\n\n{task_fence}text\n{}\n{task_fence}\n\n",
            self.task.trim()
        ));
        for turn in &self.turns {
            let took = turn
                .duration_ms
                .map(|ms| format!(", {}", seconds(ms)))
                .unwrap_or_default();
            out.push_str(&format!("### Turn {} — {}{took}\n\n", turn.n, turn.status));
            if turn.n > 1 {
                // The request, quoted: its first lines.
                for line in turn.prompt.lines().take(PROMPT_QUOTE_LINES) {
                    out.push_str(&format!("> {}\n", inert(&line.replace('<', "&lt;"))));
                }
                if turn.prompt.lines().count() > PROMPT_QUOTE_LINES {
                    out.push_str("> …\n");
                }
                out.push('\n');
            }
            // What the agent said is shown as text, never rendered: it cannot hide or fake the host's
            // sections, link, mention, or close an issue.
            if let Some(failure) = &turn.failure {
                out.push_str(&format!("**Failed:** `{}`\n\n", cell(failure)));
            }
            if let Some(summary) = &turn.summary {
                let summary_fence = fence(summary);
                out.push_str(&format!("{summary_fence}text\n{}\n{summary_fence}\n\n", summary.trim()));
            }
            if !turn.commands.is_empty() {
                // The agent's own account: its stream said it ran these and how they ended.
                out.push_str("| command (as the agent reported it) | exit |\n|---|---|\n");
                for command in &turn.commands {
                    let exit = match (command.exit_code, command.failed) {
                        (Some(code), _) => code.to_string(),
                        (None, true) => "failed".into(),
                        (None, false) => "—".into(),
                    };
                    out.push_str(&format!("| `{}` | {exit} |\n", cell(&command.command)));
                }
                if turn.commands_omitted > 0 {
                    out.push_str(&format!("| … and {} more | |\n", turn.commands_omitted));
                }
                out.push('\n');
                if let Some(last) = turn.commands.iter().rev().find(|c| !c.output_tail.is_empty()) {
                    let output_fence = fence(&last.output_tail);
                    out.push_str(&format!(
                        "<details><summary>Output of <code>{}</code> (last lines)</summary>\n\n{output_fence}text\n{}\n{output_fence}\n\n</details>\n\n",
                        cell(&last.command).replace('<', "&lt;"),
                        last.output_tail
                    ));
                }
            }
        }
        if self.files_changed > 0 {
            out.push_str(&format!(
                "### Files changed: {} (+{} −{})\n\n",
                self.files_changed, self.insertions, self.deletions
            ));
            for file in self.files.iter().take(FILES_MAX) {
                out.push_str(&format!(
                    "- `{}` +{} −{}\n",
                    cell(&file.path),
                    file.insertions,
                    file.deletions
                ));
            }
            if self.files_changed as usize > self.files.len().min(FILES_MAX) {
                out.push_str("- …\n");
            }
            out.push('\n');
        }
        out.push_str(&format!(
            "---\nsortie session `{}` on `{}` · {} tokens in, {} out · {} s compute",
            self.session, self.branch, self.input_tokens, self.output_tokens, self.compute_seconds
        ));
        if let Some(link) = &self.dashboard_url {
            out.push_str(&format!(" · [dashboard]({link})"));
        }
        out.push_str("\n\nEvery push to the branch updates this description.\n");
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn shell(builder: &mut TurnEvidenceBuilder, id: &str, command: &str, output: Value, failed: bool) {
        builder.read(&json!({"type": "tool-input-start", "toolCallId": id, "toolName": "execute", "title": command}));
        builder.read(&json!({"type": "tool-input-available", "toolCallId": id, "toolName": "execute", "input": {"command": command}}));
        if failed {
            builder.read(&json!({"type": "tool-output-error", "toolCallId": id, "errorText": output}));
        } else {
            builder.read(&json!({"type": "tool-output-available", "toolCallId": id, "output": output}));
        }
    }

    #[test]
    fn commands_keep_their_exit_codes_and_the_last_message_is_the_summary() {
        let mut builder = TurnEvidenceBuilder::default();
        builder.read(&json!({"type": "text-start", "id": "a"}));
        builder.read(&json!({"type": "text-delta", "id": "a", "delta": "Looking."}));
        builder.read(&json!({"type": "text-end", "id": "a"}));
        shell(
            &mut builder,
            "c1",
            "cargo test",
            json!({"text": "ok\ntest result: ok. 3 passed", "raw": {"exitCode": 0}}),
            false,
        );
        shell(&mut builder, "c2", "false", json!("boom"), true);
        shell(&mut builder, "c3", "exit 3", json!({"exitCode": 3}), false);
        builder.read(&json!({"type": "tool-input-start", "toolCallId": "e1", "toolName": "edit", "title": "Write a"}));
        builder.read(&json!({"type": "tool-output-available", "toolCallId": "e1", "output": "ok"}));
        builder.read(&json!({"type": "text-start", "id": "b"}));
        builder.read(&json!({"type": "text-delta", "id": "b", "delta": "Added the entry "}));
        builder.read(&json!({"type": "text-delta", "id": "b", "delta": "and a test."}));
        builder.read(&json!({"type": "text-end", "id": "b"}));
        let turn = builder.finish(1, "do it", "completed", None, Some(1500));
        assert_eq!(turn.summary.as_deref(), Some("Added the entry and a test."));
        let seen: Vec<_> = turn
            .commands
            .iter()
            .map(|c| (c.command.as_str(), c.exit_code, c.failed))
            .collect();
        assert_eq!(
            seen,
            vec![
                ("cargo test", Some(0), false),
                ("false", None, true),
                ("exit 3", Some(3), true)
            ]
        );
        assert_eq!(turn.commands[0].output_tail, "ok\ntest result: ok. 3 passed");
        let mut hostile = turn.clone();
        hostile.n = 2;
        hostile.summary = Some("<!-- hide\n```\n### Files changed: 0\nFixes #1 @octocat".into());
        let markdown = SessionEvidence {
            session: "s1".into(),
            task: "do it ``` now".into(),
            turns: vec![turn, hostile],
            ..Default::default()
        }
        .markdown();
        assert!(
            markdown.contains("````text\n<!-- hide\n```\n### Files changed: 0\nFixes #1 @octocat\n````"),
            "the agent's words stay in their block: {markdown}"
        );
        assert!(markdown.contains("| `cargo test` | 0 |"), "{markdown}");
        assert!(
            markdown.contains("```text\nAdded the entry and a test.\n```"),
            "{markdown}"
        );
        assert!(markdown.contains("| `false` | failed |"), "{markdown}");
        assert!(markdown.contains("| `exit 3` | 3 |"), "{markdown}");
        assert!(markdown.contains("````text\ndo it ``` now\n````"), "{markdown}");
        assert_eq!(
            inert("ask @octocat about #12, mail a@b or # 3"),
            "ask @\u{2060}octocat about #\u{2060}12, mail a@\u{2060}b or # 3"
        );
    }

    #[test]
    fn a_turn_of_any_size_makes_bounded_evidence() {
        let mut builder = TurnEvidenceBuilder::default();
        let long = "x".repeat(100_000);
        for i in 0..500 {
            shell(
                &mut builder,
                &format!("c{i}"),
                &long,
                json!({"text": long.repeat(2), "exitCode": 0}),
                false,
            );
        }
        builder.read(&json!({"type": "text-start", "id": "t"}));
        for _ in 0..100 {
            builder.read(&json!({"type": "text-delta", "id": "t", "delta": long}));
        }
        builder.read(&json!({"type": "text-end", "id": "t"}));
        let turn = builder.finish(1, &long, "completed", None, None);
        assert_eq!(turn.commands.len(), COMMANDS_PER_TURN_MAX);
        assert_eq!(turn.commands_omitted, 450);
        let size = serde_json::to_string(&turn).expect("json").len();
        assert!(size < 400_000, "{size}");
    }
}
