//! ACP → UI message chunks: a pure state machine (no I/O), fed the raw JSON of each `session/update`
//! and `session/request_permission` in the order the agent wrote them.
//!
//! Rules (DESIGN §5.1, `ref/acp.md` §3): text and thought chunks open and close text and reasoning
//! blocks; `tool_call` is an upsert (agents send it twice, or never before a permission request, or
//! send `tool_call_update` for an id never announced); diffs and terminals become `data-acp-*` parts
//! keyed so that later versions replace earlier ones; the plan is replaced in place; empty text is
//! dropped; anything unknown is reported back so that the caller keeps it raw in the turn log.

use std::collections::HashMap;

use serde_json::Value;
use sortie_protocol::acp_data::{
    CombinedOutput, CommandsData, DiffData, ExitStatus, ModeData, PermissionData, PlanData, TerminalData, to_data,
};
use sortie_protocol::chunk::{FinishMetadata, UiChunk};

/// What became of one update.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mapped {
    /// Turned into chunks (possibly none, e.g. an empty text chunk).
    Chunks,
    /// Understood and deliberately not shown (e.g. the echo of the user's prompt).
    Ignored,
    /// A kind this mapper does not know: keep it raw in the log.
    Unknown,
}

/// How a turn ended, as far as the stream is concerned.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TurnEnd {
    /// The agent answered `session/prompt` with this stop reason (`end_turn`, `cancelled`, …).
    Stopped { stop_reason: String },
    /// The turn failed; `reason` is shown to the user.
    Failed { code: String, reason: String },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum BlockKind {
    Text,
    Reasoning,
}

#[derive(Debug)]
struct OpenBlock {
    kind: BlockKind,
    id: String,
    acp_message_id: Option<String>,
    /// When it opened.
    at: String,
}

#[derive(Debug)]
struct Tool {
    /// When the call was first seen.
    at: String,
    name: String,
    title: Option<String>,
    input: Value,
    text_output: String,
    raw_output: Option<Value>,
    /// The agent sent a diff for it.
    diffed: bool,
    /// Its terminal, for agents that report a command's output as one (`content` of type `terminal`,
    /// the output and exit in `_meta`).
    terminal: Option<Terminal>,
    finished: bool,
}

/// A tool's terminal as the updates so far described it.
#[derive(Debug, Default)]
struct Terminal {
    id: String,
    /// The output so far, its last [`TERMINAL_OUTPUT_MAX_BYTES`] (the tail is where results and errors are).
    output: String,
    /// Earlier output was dropped to keep the cap.
    cut: bool,
    /// `{exitCode, signal}`, once the command ended.
    exit: Option<ExitStatus>,
    /// How much output the last part carried: more is sent as the output grows by
    /// [`TERMINAL_PART_STEP_BYTES`], so a chatty command costs the stream linear bytes, not quadratic.
    sent: Option<usize>,
}

/// Output growth that earns a running terminal a new part (its exit always does).
const TERMINAL_PART_STEP_BYTES: usize = 16 * 1024;

/// The most of one terminal's output a part carries.
const TERMINAL_OUTPUT_MAX_BYTES: usize = 256 * 1024;

impl Terminal {
    /// Applies what an update's `_meta` says: `terminal_output` (the output so far: Codex's old adapter),
    /// `terminal_output_delta` (more of it: the new adapter) and `terminal_exit`; `true` if a new part
    /// is due: the first output, the exit, or output grown by a step (never again once cut, until the
    /// exit).
    fn apply_meta(&mut self, meta: Option<&Value>) -> bool {
        let Some(meta) = meta else { return false };
        let text = |v: &Value| v.get("data").or(Some(v)).and_then(Value::as_str).map(str::to_owned);
        let mut changed = false;
        if let Some(whole) = meta.get("terminal_output").and_then(text) {
            self.output = whole;
            changed = true;
        }
        if let Some(more) = meta.get("terminal_output_delta").and_then(text) {
            self.output.push_str(&more);
            changed = true;
        }
        if self.output.len() > TERMINAL_OUTPUT_MAX_BYTES {
            let mut from = self.output.len() - TERMINAL_OUTPUT_MAX_BYTES;
            while !self.output.is_char_boundary(from) {
                from += 1;
            }
            self.output.drain(..from);
            self.cut = true;
        }
        if let Some(exit) = meta.get("terminal_exit").filter(|v| v.is_object()) {
            let code = exit
                .get("exitCode")
                .or_else(|| exit.get("exit_code"))
                .cloned()
                .unwrap_or(Value::Null);
            let signal = exit.get("signal").cloned().unwrap_or(Value::Null);
            self.exit = Some(ExitStatus {
                exit_code: code,
                signal,
            });
            return true;
        }
        changed
            && match self.sent {
                None | Some(0) => true,
                Some(_) if self.cut => false,
                Some(sent) => self.output.len() >= sent + TERMINAL_PART_STEP_BYTES,
            }
    }

    fn part(&mut self, tool_call_id: &str) -> UiChunk {
        self.sent = Some(self.output.len());
        let body = TerminalData {
            tool_call_id: tool_call_id.to_owned(),
            terminal_id: self.id.clone(),
            output: self.output.clone(),
            exit_status: self.exit.clone(),
            truncated: self.cut,
        };
        data("acp-terminal", Some(format!("terminal:{}", self.id)), to_data(&body))
    }
}

/// The state of one turn's stream.
#[derive(Debug)]
pub struct Mapper {
    message_id: String,
    open: Option<OpenBlock>,
    blocks_opened: u32,
    tools: HashMap<String, Tool>,
    started: bool,
    finished: bool,
    /// When the latest update arrived: what ends a block or a call ended it then.
    last_at: Option<String>,
}

impl Mapper {
    /// A mapper for the assistant message `message_id` (`<session>-t<n>`).
    pub fn new(message_id: impl Into<String>) -> Self {
        Self {
            message_id: message_id.into(),
            open: None,
            blocks_opened: 0,
            tools: HashMap::new(),
            started: false,
            finished: false,
            last_at: None,
        }
    }

    /// The first chunks of the turn: `start` (stable message id) and `start-step`.
    pub fn start(&mut self, out: &mut Vec<UiChunk>) {
        if self.started {
            return;
        }
        self.started = true;
        out.push(UiChunk::Start {
            message_id: self.message_id.clone(),
            metadata: None,
        });
        out.push(UiChunk::StartStep);
    }

    /// Whether `finish` has been emitted.
    pub fn is_finished(&self) -> bool {
        self.finished
    }

    /// Maps the `update` object of one `session/update` notification. `at` is the RFC 3339 time it
    /// arrived, stamped on the blocks it opens.
    pub fn on_update(&mut self, update: &Value, at: &str, out: &mut Vec<UiChunk>) -> Mapped {
        if self.finished {
            return Mapped::Ignored;
        }
        self.note_time(at);
        self.start(out);
        let Some(kind) = update.get("sessionUpdate").and_then(Value::as_str) else {
            return Mapped::Unknown;
        };
        match kind {
            "agent_message_chunk" => self.on_content(BlockKind::Text, update, at, out),
            "agent_thought_chunk" => self.on_content(BlockKind::Reasoning, update, at, out),
            // The prompt is shown from the turn ledger; the echo (and a load's replay) is not a part.
            "user_message_chunk" => return Mapped::Ignored,
            "tool_call" | "tool_call_update" => self.upsert_tool(update, at, out),
            "plan" => {
                self.close_block(out);
                out.push(data(
                    "acp-plan",
                    Some("plan".into()),
                    to_data(&PlanData {
                        entries: update.get("entries").cloned().unwrap_or(Value::Array(Vec::new())),
                    }),
                ));
            }
            "available_commands_update" => out.push(UiChunk::Data {
                name: "acp-commands".into(),
                id: None,
                data: to_data(&CommandsData {
                    available_commands: update
                        .get("availableCommands")
                        .cloned()
                        .unwrap_or(Value::Array(Vec::new())),
                }),
                transient: true,
            }),
            "current_mode_update" => {
                out.push(data(
                    "acp-mode",
                    Some("mode".into()),
                    to_data(&ModeData {
                        current_mode_id: update.get("currentModeId").cloned().unwrap_or(Value::Null),
                    }),
                ));
            }
            "usage_update" => out.push(data("acp-usage", Some("usage".into()), without_discriminator(update))),
            _ => return Mapped::Unknown,
        }
        Mapped::Chunks
    }

    /// Maps the params of a `session/request_permission`: its tool call is announced (or updated) here,
    /// because some agents send no `tool_call` before asking.
    pub fn on_permission_request(&mut self, params: &Value, at: &str, out: &mut Vec<UiChunk>) {
        if self.finished {
            return;
        }
        self.note_time(at);
        self.start(out);
        if let Some(tool_call) = params.get("toolCall") {
            self.upsert_tool(tool_call, at, out);
        }
        // How the driver answers (crate::agent answers every request the same way: allow once, else
        // allow always, else cancel), so a reader sees what the agent was let do.
        let tool_call_id = params
            .pointer("/toolCall/toolCallId")
            .and_then(Value::as_str)
            .unwrap_or("");
        let options = params
            .get("options")
            .and_then(Value::as_array)
            .map(Vec::as_slice)
            .unwrap_or(&[]);
        let chosen = ["allow_once", "allow_always"].iter().find_map(|kind| {
            options
                .iter()
                .find(|o| o.get("kind").and_then(Value::as_str) == Some(kind))
        });
        let answer = chosen
            .and_then(|o| o.get("kind"))
            .cloned()
            .unwrap_or_else(|| Value::from("cancelled"));
        let option = chosen.and_then(|o| o.get("name")).cloned().unwrap_or(Value::Null);
        out.push(data(
            "acp-permission",
            Some(format!("permission:{tool_call_id}")),
            to_data(&PermissionData {
                tool_call_id: tool_call_id.to_owned(),
                answer,
                option,
            }),
        ));
    }

    /// Token usage reported in the `session/prompt` response.
    pub fn on_prompt_usage(&mut self, usage: &Value, out: &mut Vec<UiChunk>) {
        if !self.finished && !usage.is_null() {
            self.start(out);
            out.push(data("acp-usage", Some("usage".into()), usage.clone()));
        }
    }

    /// Any chunk of the caller's own (priming, delivery, egress denials) in stream order.
    pub fn push_own(&mut self, chunk: UiChunk, out: &mut Vec<UiChunk>) {
        if self.finished {
            return;
        }
        self.start(out);
        self.close_block(out);
        out.push(chunk);
    }

    /// Closes the message: open blocks end, unfinished tools of a failed or cancelled turn are marked
    /// failed, then `error` (for a failure), `finish-step` and `finish`.
    pub fn finish(&mut self, end: &TurnEnd, out: &mut Vec<UiChunk>) {
        if self.finished {
            return;
        }
        self.start(out);
        self.close_block(out);
        let (finish_reason, metadata) = match end {
            TurnEnd::Stopped { stop_reason } => {
                let reason = match stop_reason.as_str() {
                    "end_turn" => "stop",
                    "max_tokens" | "max_turn_requests" => "length",
                    "refusal" => "content-filter",
                    _ => "other",
                };
                (
                    reason,
                    FinishMetadata::<String>::stopped(stop_reason.as_str()).to_value(),
                )
            }
            TurnEnd::Failed { code, .. } => ("error", FinishMetadata::failed(code.as_str()).to_value()),
        };
        let interrupted = !matches!(end, TurnEnd::Stopped { stop_reason } if stop_reason == "end_turn");
        if interrupted {
            let mut unfinished: Vec<&String> = self
                .tools
                .iter()
                .filter(|(_, tool)| !tool.finished)
                .map(|(id, _)| id)
                .collect();
            unfinished.sort();
            for id in unfinished {
                out.push(UiChunk::ToolOutputError {
                    tool_call_id: id.clone(),
                    error_text: "the turn ended before the tool finished".into(),
                    at: self.tools.get(id).map(|tool| tool.at.clone()),
                    ended_at: self.last_at.clone(),
                });
            }
            self.tools.values_mut().for_each(|tool| tool.finished = true);
        }
        if let TurnEnd::Failed { reason, .. } = end {
            out.push(UiChunk::Error {
                error_text: reason.clone(),
            });
        }
        out.push(UiChunk::FinishStep);
        out.push(UiChunk::Finish {
            finish_reason,
            metadata: Some(metadata),
        });
        self.finished = true;
    }

    fn on_content(&mut self, kind: BlockKind, update: &Value, at: &str, out: &mut Vec<UiChunk>) {
        let Some(text) = content_text(update.get("content")) else {
            return;
        };
        if text.is_empty() {
            return;
        }
        let acp_message_id = update.get("messageId").and_then(Value::as_str);
        let continues = self.open.as_ref().is_some_and(|open| {
            open.kind == kind && (acp_message_id.is_none() || open.acp_message_id.as_deref() == acp_message_id)
        });
        if !continues {
            self.close_block(out);
            let id = format!(
                "{}{}",
                if kind == BlockKind::Text { "t" } else { "r" },
                self.blocks_opened
            );
            self.blocks_opened += 1;
            out.push(match kind {
                BlockKind::Text => UiChunk::TextStart {
                    id: id.clone(),
                    at: Some(at.to_owned()),
                },
                BlockKind::Reasoning => UiChunk::ReasoningStart {
                    id: id.clone(),
                    at: Some(at.to_owned()),
                },
            });
            self.open = Some(OpenBlock {
                kind,
                id,
                acp_message_id: acp_message_id.map(str::to_owned),
                at: at.to_owned(),
            });
        }
        if let Some(open) = &self.open {
            let id = open.id.clone();
            out.push(match kind {
                BlockKind::Text => UiChunk::TextDelta { id, delta: text },
                BlockKind::Reasoning => UiChunk::ReasoningDelta { id, delta: text },
            });
        }
    }

    /// Remembers when the latest update arrived, reusing the buffer: this runs for every update.
    fn note_time(&mut self, at: &str) {
        let last = self.last_at.get_or_insert_with(String::new);
        last.clear();
        last.push_str(at);
    }

    fn close_block(&mut self, out: &mut Vec<UiChunk>) {
        if let Some(open) = self.open.take() {
            out.push(match open.kind {
                BlockKind::Text => UiChunk::TextEnd { id: open.id },
                BlockKind::Reasoning => UiChunk::ReasoningEnd {
                    id: open.id,
                    at: Some(open.at),
                    ended_at: self.last_at.clone(),
                },
            });
        }
    }

    fn upsert_tool(&mut self, fields: &Value, at: &str, out: &mut Vec<UiChunk>) {
        let Some(id) = fields.get("toolCallId").and_then(Value::as_str) else {
            return;
        };
        self.close_block(out);
        let title = fields
            .get("title")
            .and_then(Value::as_str)
            .filter(|t| !t.is_empty())
            .map(str::to_owned);
        let raw_input = fields.get("rawInput").filter(|v| !v.is_null()).cloned();
        match self.tools.get_mut(id) {
            None => {
                let name = fields.get("kind").and_then(Value::as_str).unwrap_or("other").to_owned();
                let input = raw_input.unwrap_or(Value::Null);
                out.push(UiChunk::ToolInputStart {
                    tool_call_id: id.to_owned(),
                    tool_name: name.clone(),
                    title: title.clone(),
                    at: Some(at.to_owned()),
                });
                out.push(UiChunk::ToolInputAvailable {
                    tool_call_id: id.to_owned(),
                    tool_name: name.clone(),
                    title: title.clone(),
                    input: input.clone(),
                });
                self.tools.insert(
                    id.to_owned(),
                    Tool {
                        at: at.to_owned(),
                        name,
                        title,
                        input,
                        text_output: String::new(),
                        raw_output: None,
                        diffed: false,
                        terminal: None,
                        finished: false,
                    },
                );
            }
            Some(tool) => {
                let title_changed = title.is_some() && title != tool.title;
                let input_changed = raw_input.as_ref().is_some_and(|input| *input != tool.input);
                if title_changed {
                    tool.title = title;
                }
                if let Some(input) = raw_input {
                    tool.input = input;
                }
                if (title_changed || input_changed) && !tool.finished {
                    out.push(UiChunk::ToolInputAvailable {
                        tool_call_id: id.to_owned(),
                        tool_name: tool.name.clone(),
                        title: tool.title.clone(),
                        input: tool.input.clone(),
                    });
                }
            }
        }
        let Some(tool) = self.tools.get_mut(id) else { return };
        if let Some(content) = fields.get("content").and_then(Value::as_array) {
            let mut texts = Vec::new();
            for item in content {
                match item.get("type").and_then(Value::as_str) {
                    Some("diff") => {
                        tool.diffed = true;
                        let path = item.get("path").and_then(Value::as_str).unwrap_or_default();
                        out.push(data(
                            "acp-diff",
                            Some(format!("diff:{id}:{path}")),
                            to_data(&DiffData {
                                tool_call_id: id.to_owned(),
                                path: path.to_owned(),
                                old_text: item.get("oldText").cloned().unwrap_or(Value::Null),
                                new_text: item.get("newText").cloned().unwrap_or(Value::Null),
                            }),
                        ));
                    }
                    Some("terminal") => {
                        let terminal_id = item.get("terminalId").and_then(Value::as_str).unwrap_or_default();
                        tool.terminal.get_or_insert_with(|| Terminal {
                            id: terminal_id.to_owned(),
                            ..Terminal::default()
                        });
                    }
                    Some("content") => {
                        if let Some(text) = content_text(item.get("content")) {
                            texts.push(text);
                        }
                    }
                    _ => {}
                }
            }
            tool.text_output = texts.join("");
        }
        // A terminal's output and exit may come in updates without `content` (Codex's new adapter
        // sends them with the completion only).
        let meta = fields.get("_meta");
        if tool.terminal.is_none()
            && let Some(terminal_id) = meta
                .and_then(|m| m.get("terminal_output_delta").or_else(|| m.get("terminal_exit")))
                .and_then(|t| t.get("terminal_id"))
                .and_then(Value::as_str)
        {
            tool.terminal = Some(Terminal {
                id: terminal_id.to_owned(),
                ..Terminal::default()
            });
        }
        if let Some(terminal) = &mut tool.terminal {
            let announced = fields.get("content").and_then(Value::as_array).is_some_and(|content| {
                content
                    .iter()
                    .any(|item| item.get("type").and_then(Value::as_str) == Some("terminal"))
            });
            if terminal.apply_meta(meta) || (announced && terminal.sent.is_none()) {
                out.push(terminal.part(id));
            }
        }
        if let Some(raw_output) = fields.get("rawOutput").filter(|v| !v.is_null()) {
            tool.raw_output = Some(raw_output.clone());
        }
        if tool.finished {
            return;
        }
        match fields.get("status").and_then(Value::as_str) {
            Some("completed") => {
                tool.finished = true;
                if !tool.diffed
                    && tool.name == "edit"
                    && let Some((path, content)) = created_file(&tool.input, tool.raw_output.as_ref())
                {
                    out.push(data(
                        "acp-diff",
                        Some(format!("diff:{id}:{path}")),
                        to_data(&DiffData {
                            tool_call_id: id.to_owned(),
                            path: path.to_owned(),
                            old_text: Value::Null,
                            new_text: Value::from(content),
                        }),
                    ));
                }
                let output = match (tool.text_output.is_empty(), &tool.raw_output) {
                    (true, None) => Value::Null,
                    (true, Some(raw)) => raw.clone(),
                    (false, None) => Value::String(tool.text_output.clone()),
                    (false, Some(raw)) => to_data(&CombinedOutput {
                        text: tool.text_output.clone(),
                        raw: raw.clone(),
                    }),
                };
                out.push(UiChunk::ToolOutputAvailable {
                    tool_call_id: id.to_owned(),
                    output,
                    at: Some(tool.at.clone()),
                    ended_at: Some(at.to_owned()),
                });
            }
            Some("failed") => {
                tool.finished = true;
                let error_text = if !tool.text_output.is_empty() {
                    tool.text_output.clone()
                } else if let Some(raw) = &tool.raw_output {
                    raw.to_string()
                } else {
                    "the tool failed".to_owned()
                };
                out.push(UiChunk::ToolOutputError {
                    tool_call_id: id.to_owned(),
                    error_text,
                    at: Some(tool.at.clone()),
                    ended_at: Some(at.to_owned()),
                });
            }
            _ => {}
        }
    }
}

/// The path and content of a whole-file write that created its file, when the call says both: some
/// agents (opencode's `write`) send no diff for it. The old text of a file that existed is unknown
/// here, so an overwrite gets none rather than a made-up one.
fn created_file<'a>(input: &'a Value, raw_output: Option<&Value>) -> Option<(&'a str, &'a str)> {
    let path = ["filePath", "file_path", "path"]
        .iter()
        .find_map(|key| input.get(*key).and_then(Value::as_str))?;
    let content = input.get("content").and_then(Value::as_str)?;
    let output = raw_output?;
    let existed = output
        .get("metadata")
        .and_then(|metadata| metadata.get("exists"))
        .or_else(|| output.get("existed"))
        .and_then(Value::as_bool)?;
    (!existed).then_some((path, content))
}

fn data(name: &str, id: Option<String>, data: Value) -> UiChunk {
    UiChunk::Data {
        name: name.to_owned(),
        id,
        data,
        transient: false,
    }
}

/// `data-acp-usage` is the agent's `usage_update` as it sent it, less its discriminator: passed
/// through unparsed (ACP's type would drop the fields an agent adds).
fn without_discriminator(update: &Value) -> Value {
    let mut copy = update.clone();
    if let Some(object) = copy.as_object_mut() {
        object.remove("sessionUpdate");
    }
    copy
}

/// The text a content block shows: its text, or a short stand-in for non-text content.
fn content_text(content: Option<&Value>) -> Option<String> {
    let content = content?;
    match content.get("type").and_then(Value::as_str)? {
        "text" => content.get("text").and_then(Value::as_str).map(str::to_owned),
        "resource_link" => {
            let name = content.get("name").and_then(Value::as_str).unwrap_or("link");
            let uri = content.get("uri").and_then(Value::as_str).unwrap_or_default();
            Some(format!("[{name}]({uri})"))
        }
        "resource" => content
            .get("resource")
            .and_then(|r| r.get("text"))
            .and_then(Value::as_str)
            .map(str::to_owned),
        "image" => Some("[image]".to_owned()),
        "audio" => Some("[audio]".to_owned()),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    const AT: &str = "2026-12-02T00:00:00.000Z";

    /// An input to the mapper, in the order an agent would send it.
    enum Input {
        Update(Value),
        Permission(Value),
        End(TurnEnd),
    }
    use Input::*;

    fn run(inputs: Vec<Input>) -> (Vec<Value>, Vec<Mapped>) {
        let mut mapper = Mapper::new("ses_x-t1");
        let mut chunks = Vec::new();
        let mut verdicts = Vec::new();
        for input in inputs {
            match input {
                Update(update) => verdicts.push(mapper.on_update(&update, AT, &mut chunks)),
                Permission(params) => mapper.on_permission_request(&params, AT, &mut chunks),
                End(end) => mapper.finish(&end, &mut chunks),
            }
        }
        let encoded = chunks
            .iter()
            .map(|c| serde_json::from_str(&c.to_json()).expect("json"))
            .collect();
        (encoded, verdicts)
    }

    fn text(kind: &str, text: &str) -> Value {
        json!({"sessionUpdate": kind, "content": {"type": "text", "text": text}})
    }

    fn types(chunks: &[Value]) -> Vec<&str> {
        chunks.iter().map(|c| c["type"].as_str().unwrap_or_default()).collect()
    }

    fn end_turn() -> Input {
        End(TurnEnd::Stopped {
            stop_reason: "end_turn".into(),
        })
    }

    #[test]
    fn text_and_thoughts_open_and_close_blocks() {
        let (chunks, _) = run(vec![
            Update(text("agent_thought_chunk", "Let me ")),
            Update(text("agent_thought_chunk", "think.")),
            Update(text("agent_message_chunk", "Hello")),
            Update(text("agent_message_chunk", "")),
            Update(text("agent_message_chunk", " world")),
            end_turn(),
        ]);
        assert_eq!(
            types(&chunks),
            vec![
                "start",
                "start-step",
                "reasoning-start",
                "reasoning-delta",
                "reasoning-delta",
                "reasoning-end",
                "text-start",
                "text-delta",
                "text-delta",
                "text-end",
                "finish-step",
                "finish"
            ]
        );
        assert_eq!(chunks[0], json!({"type": "start", "messageId": "ses_x-t1"}));
        assert_eq!(
            chunks[2],
            json!({"type": "reasoning-start", "id": "r0", "providerMetadata": {"sortie": {"at": AT}}})
        );
        assert_eq!(chunks[7], json!({"type": "text-delta", "id": "t1", "delta": "Hello"}));
        assert_eq!(
            chunks[11],
            json!({"type": "finish", "finishReason": "stop", "messageMetadata": {"sortie": {"stopReason": "end_turn"}}})
        );
    }

    #[test]
    fn empty_text_opens_nothing_and_a_new_acp_message_opens_a_new_block() {
        let (chunks, verdicts) = run(vec![
            Update(text("agent_message_chunk", "")),
            Update(
                json!({"sessionUpdate": "agent_message_chunk", "messageId": "m1", "content": {"type": "text", "text": "a"}}),
            ),
            Update(
                json!({"sessionUpdate": "agent_message_chunk", "messageId": "m1", "content": {"type": "text", "text": "b"}}),
            ),
            Update(
                json!({"sessionUpdate": "agent_message_chunk", "messageId": "m2", "content": {"type": "text", "text": "c"}}),
            ),
        ]);
        assert_eq!(verdicts, vec![Mapped::Chunks; 4]);
        assert_eq!(
            types(&chunks),
            vec![
                "start",
                "start-step",
                "text-start",
                "text-delta",
                "text-delta",
                "text-end",
                "text-start",
                "text-delta"
            ]
        );
    }

    #[test]
    fn tool_call_is_an_upsert() {
        let call = json!({"sessionUpdate": "tool_call", "toolCallId": "c1", "title": "Write a.txt", "kind": "edit", "status": "pending", "rawInput": {"path": "a.txt"}});
        let (chunks, _) = run(vec![
            Update(text("agent_message_chunk", "Writing")),
            Update(call.clone()),
            Update(call),
            Update(json!({"sessionUpdate": "tool_call_update", "toolCallId": "c1", "status": "in_progress"})),
            Update(
                json!({"sessionUpdate": "tool_call_update", "toolCallId": "c1", "status": "completed", "content": [{"type": "content", "content": {"type": "text", "text": "ok"}}]}),
            ),
            end_turn(),
        ]);
        assert_eq!(
            types(&chunks),
            vec![
                "start",
                "start-step",
                "text-start",
                "text-delta",
                "text-end",
                "tool-input-start",
                "tool-input-available",
                "tool-output-available",
                "finish-step",
                "finish"
            ]
        );
        assert_eq!(
            chunks[5],
            json!({"type": "tool-input-start", "toolCallId": "c1", "toolName": "edit", "dynamic": true, "title": "Write a.txt", "providerMetadata": {"sortie": {"at": AT}}})
        );
        assert_eq!(chunks[6]["input"], json!({"path": "a.txt"}));
        assert_eq!(
            chunks[7],
            json!({"type": "tool-output-available", "toolCallId": "c1", "output": "ok", "providerMetadata": {"sortie": {"at": AT, "endedAt": AT}}})
        );
    }

    #[test]
    fn a_whole_file_write_without_a_diff_gets_one_when_it_created_the_file() {
        // opencode's `write`: input only once running, no diff content, `exists` in the output's metadata.
        let write = |id: &str, exists: bool| {
            let mut mapper = Mapper::new("ses_x-t1");
            let mut out = Vec::new();
            let updates = [
                json!({"sessionUpdate": "tool_call", "toolCallId": id, "kind": "edit", "status": "pending", "rawInput": {}}),
                json!({"sessionUpdate": "tool_call_update", "toolCallId": id, "kind": "edit", "status": "in_progress",
                       "rawInput": {"filePath": "/workspace/hello.txt", "content": "hello\n"}}),
                json!({"sessionUpdate": "tool_call_update", "toolCallId": id, "status": "completed",
                       "content": [{"type": "content", "content": {"type": "text", "text": "Wrote file successfully."}}],
                       "rawOutput": {"output": "Wrote file successfully.", "metadata": {"filepath": "/workspace/hello.txt", "exists": exists}}}),
            ];
            for update in &updates {
                mapper.on_update(update, AT, &mut out);
            }
            out.iter()
                .map(|c| serde_json::to_value(c).expect("json"))
                .filter(|c| c["type"] == "data-acp-diff")
                .collect::<Vec<_>>()
        };
        assert_eq!(
            write("w1", false),
            vec![json!({"type": "data-acp-diff", "id": "diff:w1:/workspace/hello.txt",
                        "data": {"toolCallId": "w1", "path": "/workspace/hello.txt", "oldText": null, "newText": "hello\n"}})]
        );
        // Over a file that existed, the old text is unknown: no diff rather than a wrong one.
        assert_eq!(write("w2", true), Vec::<Value>::new());
    }

    #[test]
    fn a_call_that_sent_its_diff_gets_no_second_one() {
        let mut mapper = Mapper::new("ses_x-t1");
        let mut out = Vec::new();
        let done = json!({"sessionUpdate": "tool_call", "toolCallId": "e1", "kind": "edit", "status": "completed",
            "rawInput": {"filePath": "a.txt", "content": "new"},
            "content": [{"type": "diff", "path": "a.txt", "oldText": null, "newText": "new"}],
            "rawOutput": {"metadata": {"exists": false}}});
        mapper.on_update(&done, AT, &mut out);
        let diffs = out
            .iter()
            .filter(|c| serde_json::to_value(c).expect("json")["type"] == "data-acp-diff")
            .count();
        assert_eq!(diffs, 1);
    }

    #[test]
    fn reasoning_and_tool_calls_carry_when_they_began_and_ended() {
        let mut mapper = Mapper::new("ses_x-t1");
        let mut out = Vec::new();
        let at = |s: u32| format!("2026-12-02T00:00:{s:02}.000Z");
        mapper.on_update(&text("agent_thought_chunk", "hm"), &at(1), &mut out);
        mapper.on_update(&text("agent_thought_chunk", " more"), &at(2), &mut out);
        let call = json!({"sessionUpdate": "tool_call", "toolCallId": "c1", "kind": "execute", "status": "pending"});
        mapper.on_update(&call, &at(4), &mut out);
        let done = json!({"sessionUpdate": "tool_call_update", "toolCallId": "c1", "status": "completed"});
        mapper.on_update(&done, &at(9), &mut out);
        let json: Vec<Value> = out.iter().map(|c| serde_json::to_value(c).expect("json")).collect();
        let of = |kind: &str| json.iter().find(|c| c["type"] == kind).cloned().expect(kind);
        // The thought ran from its first chunk until what ended it (the tool call) arrived.
        assert_eq!(
            of("reasoning-end")["providerMetadata"],
            json!({"sortie": {"at": at(1), "endedAt": at(4)}})
        );
        assert_eq!(
            of("tool-output-available")["providerMetadata"],
            json!({"sortie": {"at": at(4), "endedAt": at(9)}})
        );
    }

    #[test]
    fn a_changed_input_or_title_is_sent_again_until_the_output() {
        let (chunks, _) = run(vec![
            Update(json!({"sessionUpdate": "tool_call", "toolCallId": "c1", "title": "Preparing…", "kind": "edit"})),
            Update(
                json!({"sessionUpdate": "tool_call_update", "toolCallId": "c1", "title": "Write b.txt", "rawInput": {"file_path": "b.txt"}}),
            ),
            Update(
                json!({"sessionUpdate": "tool_call_update", "toolCallId": "c1", "status": "completed", "rawOutput": {"bytes": 3}}),
            ),
            Update(json!({"sessionUpdate": "tool_call_update", "toolCallId": "c1", "title": "late title"})),
        ]);
        assert_eq!(
            types(&chunks),
            vec![
                "start",
                "start-step",
                "tool-input-start",
                "tool-input-available",
                "tool-input-available",
                "tool-output-available"
            ]
        );
        assert_eq!(chunks[3]["input"], Value::Null);
        assert_eq!(
            (chunks[4]["title"].clone(), chunks[4]["input"].clone()),
            (json!("Write b.txt"), json!({"file_path": "b.txt"}))
        );
        assert_eq!(chunks[5]["output"], json!({"bytes": 3}));
    }

    #[test]
    fn an_update_for_an_unannounced_tool_announces_it() {
        let (chunks, _) = run(vec![Update(
            json!({"sessionUpdate": "tool_call_update", "toolCallId": "ghost", "status": "failed", "rawOutput": {"exitCode": 2}}),
        )]);
        assert_eq!(
            types(&chunks),
            vec![
                "start",
                "start-step",
                "tool-input-start",
                "tool-input-available",
                "tool-output-error"
            ]
        );
        assert_eq!(chunks[2]["toolName"], "other");
        assert_eq!(
            chunks[4],
            json!({"type": "tool-output-error", "toolCallId": "ghost", "errorText": "{\"exitCode\":2}", "providerMetadata": {"sortie": {"at": AT, "endedAt": AT}}})
        );
    }

    #[test]
    fn a_permission_request_may_come_first() {
        let (chunks, _) = run(vec![
            Permission(
                json!({"sessionId": "s", "toolCall": {"toolCallId": "w1", "title": "write_file", "kind": "edit", "content": [{"type": "diff", "path": "/w/a.txt", "oldText": null, "newText": "hi\n"}]}, "options": []}),
            ),
            Update(json!({"sessionUpdate": "tool_call_update", "toolCallId": "w1", "status": "completed"})),
        ]);
        assert_eq!(
            types(&chunks),
            vec![
                "start",
                "start-step",
                "tool-input-start",
                "tool-input-available",
                "data-acp-diff",
                "data-acp-permission",
                "tool-output-available"
            ]
        );
        assert_eq!(
            chunks[4],
            json!({"type": "data-acp-diff", "id": "diff:w1:/w/a.txt", "data": {"toolCallId": "w1", "path": "/w/a.txt", "oldText": null, "newText": "hi\n"}})
        );
        assert_eq!(
            chunks[5],
            json!({"type": "data-acp-permission", "id": "permission:w1", "data": {"toolCallId": "w1", "answer": "cancelled", "option": null}}),
            "no option to allow: cancelled"
        );
    }

    #[test]
    fn a_permission_request_says_how_it_was_answered() {
        let (chunks, _) = run(vec![Permission(
            json!({"sessionId": "s", "toolCall": {"toolCallId": "b1", "title": "rm -rf build", "kind": "execute"},
            "options": [{"optionId": "r", "name": "Reject", "kind": "reject_once"}, {"optionId": "a", "name": "Always", "kind": "allow_always"}, {"optionId": "o", "name": "Allow", "kind": "allow_once"}]}),
        )]);
        let permission = chunks
            .iter()
            .find(|c| c["type"] == "data-acp-permission")
            .expect("a permission part");
        assert_eq!(
            permission["data"],
            json!({"toolCallId": "b1", "answer": "allow_once", "option": "Allow"})
        );
    }

    #[test]
    fn terminals_without_terminal_create_are_shown() {
        let (chunks, _) = run(vec![Update(json!({
            "sessionUpdate": "tool_call", "toolCallId": "call_1", "kind": "execute", "title": "ls",
            "content": [{"type": "terminal", "terminalId": "call_1"}],
            "_meta": {"terminal_output": {"data": "a.txt\n"}, "terminal_exit": {"exitCode": 0}}
        }))]);
        assert_eq!(
            chunks[4],
            json!({"type": "data-acp-terminal", "id": "terminal:call_1", "data": {"toolCallId": "call_1", "terminalId": "call_1", "output": "a.txt\n", "exitStatus": {"exitCode": 0, "signal": null}}})
        );
    }

    #[test]
    fn a_terminal_whose_output_comes_with_the_completion_is_shown() {
        // Codex's new adapter (recorded from a real run): the output as a delta and the exit, both
        // in the completing update, which has no `content`.
        let (chunks, _) = run(vec![
            Update(
                json!({"sessionUpdate": "tool_call", "toolCallId": "call_fake_1", "name": "exec_command", "kind": "execute",
                "title": "printf ok", "status": "in_progress", "content": [{"type": "terminal", "terminalId": "call_fake_1"}],
                "rawInput": {"command": "printf ok", "cwd": "/workspace"}, "_meta": {"terminal_info": {"cwd": "/workspace", "terminal_id": "call_fake_1"}}}),
            ),
            Update(
                json!({"sessionUpdate": "tool_call_update", "toolCallId": "call_fake_1", "status": "completed",
                "_meta": {"terminal_output_delta": {"data": "sortie-shell-ok\n", "terminal_id": "call_fake_1"}}}),
            ),
            Update(json!({"sessionUpdate": "tool_call_update", "toolCallId": "call_fake_1",
                "_meta": {"terminal_output_delta": {"data": "second line\n", "terminal_id": "call_fake_1"},
                          "terminal_exit": {"exit_code": 0, "signal": null, "terminal_id": "call_fake_1"}}})),
        ]);
        let last = chunks
            .iter()
            .rev()
            .find(|c| c["type"] == "data-acp-terminal")
            .expect("a terminal part");
        assert_eq!(
            last["data"],
            json!({"toolCallId": "call_fake_1", "terminalId": "call_fake_1", "output": "sortie-shell-ok\nsecond line\n", "exitStatus": {"exitCode": 0, "signal": null}})
        );
        assert_eq!(
            chunks.iter().filter(|c| c["type"] == "data-acp-terminal").count(),
            3,
            "announced, its first output, its exit"
        );
    }

    #[test]
    fn a_terminal_keeps_the_tail_of_long_output() {
        let line = "x".repeat(1023) + "\n";
        let mut updates = vec![Update(
            json!({"sessionUpdate": "tool_call", "toolCallId": "t", "kind": "execute",
            "content": [{"type": "terminal", "terminalId": "t"}]}),
        )];
        for _ in 0..300 {
            updates.push(Update(json!({"sessionUpdate": "tool_call_update", "toolCallId": "t", "_meta": {"terminal_output_delta": {"data": line}}})));
        }
        updates.push(Update(json!({"sessionUpdate": "tool_call_update", "toolCallId": "t", "_meta": {"terminal_output_delta": {"data": "the end\n"}}})));
        updates.push(Update(json!({"sessionUpdate": "tool_call_update", "toolCallId": "t", "status": "completed", "_meta": {"terminal_exit": {"exit_code": 1}}})));
        let (chunks, _) = run(updates);
        let parts: Vec<&Value> = chunks.iter().filter(|c| c["type"] == "data-acp-terminal").collect();
        let last = parts.last().expect("a terminal part");
        let output = last["data"]["output"].as_str().expect("output");
        assert!(output.len() <= TERMINAL_OUTPUT_MAX_BYTES && output.ends_with("the end\n"));
        assert_eq!(
            (&last["data"]["truncated"], &last["data"]["exitStatus"]["exitCode"]),
            (&json!(true), &json!(1))
        );
        // 300 KiB of output in 301 updates: a part per 16 KiB until the cap, then only the exit.
        let sent: usize = parts.iter().map(|p| p.to_string().len()).sum();
        assert!(
            parts.len() <= 2 + TERMINAL_OUTPUT_MAX_BYTES / TERMINAL_PART_STEP_BYTES + 1,
            "{} parts",
            parts.len()
        );
        assert!(sent < 3 << 20, "{sent} bytes of terminal parts for 300 KiB of output");
    }

    #[test]
    fn plans_modes_usage_and_commands_are_data_parts() {
        let (chunks, verdicts) = run(vec![
            Update(
                json!({"sessionUpdate": "plan", "entries": [{"content": "a", "priority": "medium", "status": "pending"}]}),
            ),
            Update(
                json!({"sessionUpdate": "plan", "entries": [{"content": "a", "priority": "medium", "status": "completed"}]}),
            ),
            Update(json!({"sessionUpdate": "current_mode_update", "currentModeId": "yolo"})),
            Update(json!({"sessionUpdate": "usage_update", "used": 10, "size": 100})),
            Update(
                json!({"sessionUpdate": "available_commands_update", "availableCommands": [{"name": "init", "description": "d"}]}),
            ),
            Update(json!({"sessionUpdate": "user_message_chunk", "content": {"type": "text", "text": "the prompt"}})),
            Update(json!({"sessionUpdate": "brand_new_kind", "x": 1})),
            Update(json!({"no": "discriminator"})),
        ]);
        assert_eq!(
            verdicts,
            vec![
                Mapped::Chunks,
                Mapped::Chunks,
                Mapped::Chunks,
                Mapped::Chunks,
                Mapped::Chunks,
                Mapped::Ignored,
                Mapped::Unknown,
                Mapped::Unknown
            ]
        );
        assert_eq!(
            types(&chunks),
            vec![
                "start",
                "start-step",
                "data-acp-plan",
                "data-acp-plan",
                "data-acp-mode",
                "data-acp-usage",
                "data-acp-commands"
            ]
        );
        assert_eq!(chunks[2]["id"], "plan");
        assert_eq!(chunks[3]["data"]["entries"][0]["status"], "completed");
        assert_eq!(
            chunks[5],
            json!({"type": "data-acp-usage", "id": "usage", "data": {"used": 10, "size": 100}})
        );
        assert_eq!(chunks[6]["transient"], true);
    }

    #[test]
    fn a_failed_turn_ends_with_error_then_finish_and_closes_open_tools() {
        let (chunks, _) = run(vec![
            Update(json!({"sessionUpdate": "tool_call", "toolCallId": "c1", "kind": "execute", "title": "make"})),
            Update(text("agent_message_chunk", "still talking")),
            End(TurnEnd::Failed {
                code: "AGENT_ERROR".into(),
                reason: "the agent exited with code 7".into(),
            }),
            Update(text("agent_message_chunk", "after the end")),
        ]);
        assert_eq!(
            types(&chunks),
            vec![
                "start",
                "start-step",
                "tool-input-start",
                "tool-input-available",
                "text-start",
                "text-delta",
                "text-end",
                "tool-output-error",
                "error",
                "finish-step",
                "finish"
            ]
        );
        assert_eq!(
            chunks[8],
            json!({"type": "error", "errorText": "the agent exited with code 7"})
        );
        assert_eq!(chunks[10]["finishReason"], "error");
    }

    #[test]
    fn stop_reasons_map_to_finish_reasons() {
        for (stop_reason, finish_reason) in [
            ("end_turn", "stop"),
            ("max_tokens", "length"),
            ("max_turn_requests", "length"),
            ("refusal", "content-filter"),
            ("cancelled", "other"),
        ] {
            let (chunks, _) = run(vec![End(TurnEnd::Stopped {
                stop_reason: stop_reason.into(),
            })]);
            assert_eq!(types(&chunks), vec!["start", "start-step", "finish-step", "finish"]);
            assert_eq!(chunks[3]["finishReason"], finish_reason, "{stop_reason}");
        }
    }

    #[test]
    fn every_stream_assembles_into_finished_parts() {
        let (chunks, _) = run(vec![
            Update(text("agent_thought_chunk", "plan")),
            Update(
                json!({"sessionUpdate": "tool_call", "toolCallId": "c1", "kind": "edit", "title": "w", "status": "pending"}),
            ),
            Update(text("agent_message_chunk", "done")),
            end_turn(),
        ]);
        let parts = sortie_protocol::ui::assemble_parts(&chunks);
        let kinds: Vec<&str> = parts.iter().map(|p| p["type"].as_str().unwrap_or_default()).collect();
        assert_eq!(kinds, vec!["step-start", "reasoning", "dynamic-tool", "text"]);
        assert!(
            parts
                .iter()
                .all(|p| p["state"] != "streaming" && p["state"] != "input-streaming"),
            "{parts:?}"
        );
    }
}
