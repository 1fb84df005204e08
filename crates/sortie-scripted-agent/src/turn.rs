//! One prompt turn: performs the steps of a script and reports them as ACP session updates.

use std::io::Write as _;
use std::os::unix::process::ExitStatusExt as _;
use std::path::{Path, PathBuf};
use std::process::{ExitStatus, Stdio};
use std::time::Duration;

use agent_client_protocol::v1::ConnectionTo;
use agent_client_protocol::v1::schema::{
    ContentBlock, ContentChunk, Diff, MessageId, PermissionOption, PermissionOptionKind, Plan, PlanEntry,
    PlanEntryPriority, PlanEntryStatus, RequestPermissionOutcome, RequestPermissionRequest, SessionId,
    SessionNotification, SessionUpdate, StopReason, ToolCall, ToolCallContent, ToolCallId, ToolCallLocation,
    ToolCallStatus, ToolCallUpdate, ToolCallUpdateFields, ToolKind,
};
use agent_client_protocol::{Client, Error, ErrorCode};
use tokio::io::AsyncReadExt as _;
use tokio_util::sync::CancellationToken;

use crate::output::SharedStdout;
use crate::script::{Step, is_script, parse_script};

/// `say:` text is sent in pieces of at most this many bytes, so clients see real streaming.
pub(crate) const SAY_CHUNK_BYTES: usize = 64;

/// How much of a command's combined output is reported; the rest is read and dropped.
pub(crate) const RUN_OUTPUT_LIMIT: usize = 64 * 1024;

/// How many characters of a non-script prompt are echoed back.
const ECHO_CHARS: usize = 200;

/// After a command exits, how long to keep reading output that a background child may still be writing.
const OUTPUT_DRAIN_GRACE: Duration = Duration::from_millis(500);

/// After `session/cancel`, how long `ask:` still waits for the client's (mandatory) `cancelled` answer.
const PERMISSION_CANCEL_GRACE: Duration = Duration::from_secs(2);

/// `flood:` yields to the runtime this often so the writer can drain while chunks are produced.
const FLOOD_YIELD_EVERY: u64 = 64;

/// The option ids offered by `ask:`; the chosen id is reported back verbatim.
const ALLOW_ONCE: &str = "allow_once";
const REJECT_ONCE: &str = "reject_once";

/// How a turn ended.
pub(crate) enum TurnEnd {
    /// Answer the prompt with this stop reason.
    Stopped(StopReason),
    /// Answer the prompt with this JSON-RPC error.
    Failed(Error),
    /// Exit the process with this code without answering.
    Crash(i32),
}

/// Whether the script goes on after a step.
enum Flow {
    Continue,
    End(TurnEnd),
}

/// The state of one running turn.
pub(crate) struct Turn {
    connection: ConnectionTo<Client>,
    stdout: SharedStdout,
    session_id: SessionId,
    cwd: PathBuf,
    cancellation: CancellationToken,
    /// 1-based position of this turn in its session; part of every id so ids never repeat across turns.
    turn_number: usize,
    tool_calls_started: usize,
    messages_started: usize,
    plan: Vec<PlanEntry>,
    sent_updates: Vec<SessionUpdate>,
}

impl Turn {
    pub(crate) fn new(
        connection: ConnectionTo<Client>,
        stdout: SharedStdout,
        session_id: SessionId,
        cwd: PathBuf,
        cancellation: CancellationToken,
        turn_number: usize,
    ) -> Self {
        Turn {
            connection,
            stdout,
            session_id,
            cwd,
            cancellation,
            turn_number,
            tool_calls_started: 0,
            messages_started: 0,
            plan: Vec::new(),
            sent_updates: Vec::new(),
        }
    }

    /// The updates sent so far, in order, for the session record.
    pub(crate) fn into_sent_updates(self) -> Vec<SessionUpdate> {
        self.sent_updates
    }

    /// Runs the prompt: a script step by step, anything else gets a short echo.
    pub(crate) async fn run(&mut self, prompt_text: &str) -> TurnEnd {
        if !is_script(prompt_text) {
            let received: String = prompt_text.chars().take(ECHO_CHARS).collect();
            let message_id = self.new_message_id();
            return match self.send_message_chunk(&message_id, format!("scripted agent received: {received}")) {
                Ok(()) => TurnEnd::Stopped(StopReason::EndTurn),
                Err(error) => TurnEnd::Failed(error),
            };
        }
        let steps = match parse_script(prompt_text) {
            Ok(steps) => steps,
            Err(error) => return TurnEnd::Failed(Error::new(ErrorCode::INVALID_PARAMS, error.to_string())),
        };
        for step in steps {
            if self.cancellation.is_cancelled() {
                return TurnEnd::Stopped(StopReason::Cancelled);
            }
            match self.perform(step).await {
                Ok(Flow::Continue) => {}
                Ok(Flow::End(end)) => return end,
                Err(error) => return TurnEnd::Failed(error),
            }
        }
        // ACP requires `cancelled` once the client cancelled, even if the last step finished anyway.
        if self.cancellation.is_cancelled() {
            TurnEnd::Stopped(StopReason::Cancelled)
        } else {
            TurnEnd::Stopped(StopReason::EndTurn)
        }
    }

    async fn perform(&mut self, step: Step) -> Result<Flow, Error> {
        match step {
            Step::Think(text) => {
                let message_id = self.new_message_id();
                let chunk = ContentChunk::new(ContentBlock::from(text)).message_id(message_id);
                self.send(SessionUpdate::AgentThoughtChunk(chunk))?;
            }
            Step::Say(text) => {
                let message_id = self.new_message_id();
                for piece in split_at_char_boundaries(&text, SAY_CHUNK_BYTES) {
                    self.send_message_chunk(&message_id, piece.to_owned())?;
                }
            }
            Step::Plan(entries) => {
                self.plan = entries
                    .into_iter()
                    .map(|entry| PlanEntry::new(entry, PlanEntryPriority::Medium, PlanEntryStatus::Pending))
                    .collect();
                self.send(SessionUpdate::Plan(Plan::new(self.plan.clone())))?;
            }
            Step::Done(entry_number) => {
                let entry = entry_number
                    .checked_sub(1)
                    .and_then(|index| self.plan.get_mut(index))
                    .ok_or_else(|| internal_error(format!("done: {entry_number} names no plan entry")))?;
                entry.status = PlanEntryStatus::Completed;
                self.send(SessionUpdate::Plan(Plan::new(self.plan.clone())))?;
            }
            Step::Write { path, content } => self.write_file(&path, content).await?,
            Step::Run(command) => self.run_command(&command).await?,
            Step::Ask(question) => self.ask_permission(question).await?,
            Step::Sleep { millis } => {
                // Only the wait is interruptible; the step boundary after it ends the turn as cancelled.
                tokio::select! {
                    () = tokio::time::sleep(Duration::from_millis(millis)) => {}
                    () = self.cancellation.cancelled() => {}
                }
            }
            Step::Hang { millis } => tokio::time::sleep(Duration::from_millis(millis)).await,
            Step::Flood(count) => {
                let message_id = self.new_message_id();
                for number in 1..=count {
                    if self.cancellation.is_cancelled() {
                        break;
                    }
                    self.send_message_chunk(&message_id, format!("flood {number}\n"))?;
                    if number % FLOOD_YIELD_EVERY == 0 {
                        tokio::task::yield_now().await;
                    }
                }
            }
            Step::Fail(message) => return Ok(Flow::End(TurnEnd::Failed(internal_error(message)))),
            Step::Crash(code) => return Ok(Flow::End(TurnEnd::Crash(code))),
            Step::Garbage(text) => self
                .stdout
                .write_raw_line(&self.connection, &text)
                .await
                .map_err(|error| internal_error(format!("garbage: cannot write stdout: {error}")))?,
            Step::BigLine(length) => self
                .stdout
                .write_filler_line(&self.connection, length)
                .await
                .map_err(|error| internal_error(format!("bigline: cannot write stdout: {error}")))?,
            Step::Stderr(text) => {
                let mut stderr = std::io::stderr().lock();
                writeln!(stderr, "{text}")
                    .and_then(|()| stderr.flush())
                    .map_err(|error| internal_error(format!("stderr: cannot write stderr: {error}")))?;
            }
        }
        Ok(Flow::Continue)
    }

    async fn write_file(&mut self, path: &str, content: String) -> Result<(), Error> {
        // Absolute paths and `..` are honoured on purpose: containment is the sandbox's job, and tests of the
        // sandbox need an agent that tries to escape it.
        let target = self.cwd.join(path);
        // A missing file is a new file (`oldText` null); an unreadable one is treated the same and the write
        // below reports the real problem.
        let old_text = tokio::fs::read(&target)
            .await
            .ok()
            .map(|bytes| String::from_utf8_lossy(&bytes).into_owned());
        let tool_call_id = self.new_tool_call_id();
        let diff = Diff::new(target.clone(), content.clone()).old_text(old_text);
        self.send(SessionUpdate::ToolCall(
            ToolCall::new(tool_call_id.clone(), format!("Write {path}"))
                .kind(ToolKind::Edit)
                .status(ToolCallStatus::Pending)
                .content(vec![ToolCallContent::from(diff)])
                .locations(vec![ToolCallLocation::new(target.clone())]),
        ))?;
        let fields = match write_creating_parents(&target, &content).await {
            Ok(()) => ToolCallUpdateFields::new().status(ToolCallStatus::Completed),
            Err(error) => {
                ToolCallUpdateFields::new()
                    .status(ToolCallStatus::Failed)
                    .content(vec![ToolCallContent::from(format!(
                        "cannot write {}: {error}",
                        target.display()
                    ))])
            }
        };
        self.send(SessionUpdate::ToolCallUpdate(ToolCallUpdate::new(tool_call_id, fields)))
    }

    async fn run_command(&mut self, command: &str) -> Result<(), Error> {
        let tool_call_id = self.new_tool_call_id();
        self.send(SessionUpdate::ToolCall(
            ToolCall::new(tool_call_id.clone(), command)
                .kind(ToolKind::Execute)
                .status(ToolCallStatus::Pending)
                .raw_input(raw(&ShellInput { command })),
        ))?;
        self.send(SessionUpdate::ToolCallUpdate(ToolCallUpdate::new(
            tool_call_id.clone(),
            ToolCallUpdateFields::new().status(ToolCallStatus::InProgress),
        )))?;
        let fields = match run_shell(command, &self.cwd, &self.cancellation).await {
            Ok(CommandOutcome::Exited { status, output }) => ToolCallUpdateFields::new()
                .status(if status.success() {
                    ToolCallStatus::Completed
                } else {
                    ToolCallStatus::Failed
                })
                .content(vec![ToolCallContent::from(output)])
                .raw_output(exit_status_json(status)),
            Ok(CommandOutcome::Cancelled { output }) => ToolCallUpdateFields::new()
                .status(ToolCallStatus::Failed)
                .content(vec![ToolCallContent::from(format!("{output}[cancelled]"))])
                .raw_output(raw(&ShellExit {
                    exit_code: None,
                    signal: None,
                    cancelled: true,
                })),
            Err(error) => ToolCallUpdateFields::new()
                .status(ToolCallStatus::Failed)
                .content(vec![ToolCallContent::from(format!("cannot run `sh -c`: {error}"))]),
        };
        self.send(SessionUpdate::ToolCallUpdate(ToolCallUpdate::new(tool_call_id, fields)))
    }

    async fn ask_permission(&mut self, question: String) -> Result<(), Error> {
        let request = RequestPermissionRequest::new(
            self.session_id.clone(),
            ToolCallUpdate::new(self.new_tool_call_id(), ToolCallUpdateFields::new().title(question)),
            vec![
                PermissionOption::new(ALLOW_ONCE, "Allow", PermissionOptionKind::AllowOnce),
                PermissionOption::new(REJECT_ONCE, "Reject", PermissionOptionKind::RejectOnce),
            ],
        );
        let answer = self.connection.send_request(request).block_task();
        // A client must answer `cancelled` after session/cancel; the grace only guards against one that doesn't.
        let cancelled_without_answer = async {
            self.cancellation.cancelled().await;
            tokio::time::sleep(PERMISSION_CANCEL_GRACE).await;
        };
        let outcome = tokio::select! {
            answer = answer => answer
                .map_err(|error| internal_error(format!("session/request_permission failed: {}", error.message)))?
                .outcome,
            () = cancelled_without_answer => RequestPermissionOutcome::Cancelled,
        };
        let reported = match outcome {
            RequestPermissionOutcome::Selected(selected) => selected.option_id.to_string(),
            // Any outcome this schema version does not know is reported as cancelled.
            _ => "cancelled".to_owned(),
        };
        let message_id = self.new_message_id();
        self.send_message_chunk(&message_id, format!("permission: {reported}"))
    }

    fn send_message_chunk(&mut self, message_id: &MessageId, text: String) -> Result<(), Error> {
        let chunk = ContentChunk::new(ContentBlock::from(text)).message_id(message_id.clone());
        self.send(SessionUpdate::AgentMessageChunk(chunk))
    }

    fn send(&mut self, update: SessionUpdate) -> Result<(), Error> {
        self.connection
            .send_notification(SessionNotification::new(self.session_id.clone(), update.clone()))?;
        self.sent_updates.push(update);
        Ok(())
    }

    fn new_tool_call_id(&mut self) -> ToolCallId {
        self.tool_calls_started += 1;
        ToolCallId::new(format!("turn{}-call{}", self.turn_number, self.tool_calls_started))
    }

    fn new_message_id(&mut self) -> MessageId {
        self.messages_started += 1;
        MessageId::new(format!("turn{}-message{}", self.turn_number, self.messages_started))
    }
}

fn internal_error(message: impl Into<String>) -> Error {
    Error::new(ErrorCode::INTERNAL_ERROR, message)
}

/// Splits `text` into pieces of at most `max_bytes` bytes without cutting a character; empty text is one empty
/// piece, so `say:` with nothing still sends a chunk. A character longer than `max_bytes` gets a piece of its own.
pub(crate) fn split_at_char_boundaries(text: &str, max_bytes: usize) -> Vec<&str> {
    if text.is_empty() {
        return vec![text];
    }
    let mut pieces = Vec::new();
    let mut rest = text;
    while !rest.is_empty() {
        let mut end = rest.len().min(max_bytes);
        while !rest.is_char_boundary(end) {
            end -= 1;
        }
        if end == 0 {
            end = rest.chars().next().map_or(rest.len(), char::len_utf8);
        }
        let (piece, remainder) = rest.split_at(end);
        pieces.push(piece);
        rest = remainder;
    }
    pieces
}

async fn write_creating_parents(target: &Path, content: &str) -> std::io::Result<()> {
    if let Some(parent) = target.parent() {
        tokio::fs::create_dir_all(parent).await?;
    }
    tokio::fs::write(target, content).await
}

enum CommandOutcome {
    Exited { status: ExitStatus, output: String },
    Cancelled { output: String },
}

/// Output kept up to a limit; anything beyond is counted, not stored, so a chatty command cannot exhaust memory.
struct CappedOutput {
    kept: Vec<u8>,
    dropped_bytes: usize,
}

impl CappedOutput {
    fn new() -> Self {
        CappedOutput {
            kept: Vec::new(),
            dropped_bytes: 0,
        }
    }

    fn push(&mut self, bytes: &[u8]) {
        let room = RUN_OUTPUT_LIMIT.saturating_sub(self.kept.len());
        let kept = bytes.len().min(room);
        self.kept.extend_from_slice(&bytes[..kept]);
        self.dropped_bytes += bytes.len() - kept;
    }

    fn into_text(self) -> String {
        let mut text = String::from_utf8_lossy(&self.kept).into_owned();
        if self.dropped_bytes > 0 {
            text.push_str(&format!(
                "\n[output truncated to {RUN_OUTPUT_LIMIT} bytes; {} more dropped]\n",
                self.dropped_bytes
            ));
        }
        text
    }
}

/// Runs `sh -c command` with stdout and stderr on one pipe, so the output keeps its real interleaving.
async fn run_shell(command: &str, cwd: &Path, cancellation: &CancellationToken) -> std::io::Result<CommandOutcome> {
    let (pipe_writer, mut pipe_reader) = tokio::net::unix::pipe::pipe()?;
    let stdout_end = pipe_writer.into_blocking_fd()?;
    let stderr_end = stdout_end.try_clone()?;
    let mut child = {
        // The command (and its copies of the pipe's write end) is dropped right after spawning, so the read
        // end sees EOF once the child and its descendants are done with it.
        let mut shell = tokio::process::Command::new("sh");
        shell
            .arg("-c")
            .arg(command)
            .current_dir(cwd)
            .stdin(Stdio::null())
            .stdout(Stdio::from(stdout_end))
            .stderr(Stdio::from(stderr_end))
            .kill_on_drop(true);
        shell.spawn()?
    };

    let mut output = CappedOutput::new();
    let mut buffer = vec![0_u8; 16 * 1024];
    let mut exit_status = None;
    let drain_deadline = tokio::time::sleep(Duration::MAX);
    tokio::pin!(drain_deadline);
    loop {
        tokio::select! {
            read = pipe_reader.read(&mut buffer) => match read {
                Ok(0) => break,
                Ok(count) => output.push(&buffer[..count]),
                // A broken pipe only loses output; the exit status still decides the outcome.
                Err(_) => break,
            },
            status = child.wait(), if exit_status.is_none() => {
                exit_status = Some(status?);
                // A background process may hold the pipe open forever; don't wait for its EOF.
                drain_deadline.as_mut().reset(tokio::time::Instant::now() + OUTPUT_DRAIN_GRACE);
            }
            () = &mut drain_deadline => break,
            () = cancellation.cancelled() => {
                let _ = child.start_kill();
                let _ = child.wait().await;
                return Ok(CommandOutcome::Cancelled { output: output.into_text() });
            }
        }
    }
    let status = match exit_status {
        Some(status) => status,
        None => tokio::select! {
            status = child.wait() => status?,
            () = cancellation.cancelled() => {
                let _ = child.start_kill();
                let _ = child.wait().await;
                return Ok(CommandOutcome::Cancelled { output: output.into_text() });
            }
        },
    };
    Ok(CommandOutcome::Exited {
        status,
        output: output.into_text(),
    })
}

/// A shell tool's `rawInput`, as the real agents send it (ACP leaves raw input free-form).
#[derive(serde::Serialize)]
struct ShellInput<'a> {
    command: &'a str,
}

/// A shell tool's `rawOutput`: its exit code (null when it has none), its signal, whether it was
/// cancelled.
#[derive(serde::Serialize)]
#[serde(rename_all = "camelCase")]
struct ShellExit {
    exit_code: Option<i32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    signal: Option<i32>,
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    cancelled: bool,
}

/// Numbers, strings and flags: encoding cannot fail.
fn raw(value: &impl serde::Serialize) -> serde_json::Value {
    serde_json::to_value(value).unwrap_or_default()
}

fn exit_status_json(status: ExitStatus) -> serde_json::Value {
    raw(&ShellExit {
        exit_code: status.code(),
        signal: status.signal(),
        cancelled: false,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splits_text_on_char_boundaries() {
        let cases: Vec<(&str, usize, Vec<&str>)> = vec![
            ("", 4, vec![""]),
            ("abc", 4, vec!["abc"]),
            ("abcd", 4, vec!["abcd"]),
            ("abcdefghij", 4, vec!["abcd", "efgh", "ij"]),
            // "é" is two bytes: never cut in half.
            ("aéé", 2, vec!["a", "é", "é"]),
            ("ééé", 3, vec!["é", "é", "é"]),
            // A four-byte character wider than the limit still goes out whole.
            ("🦀x", 2, vec!["🦀", "x"]),
        ];
        for (text, max_bytes, expected) in cases {
            assert_eq!(
                split_at_char_boundaries(text, max_bytes),
                expected,
                "text {text:?} max {max_bytes}"
            );
        }
    }

    #[test]
    fn long_text_is_split_into_pieces_that_join_back() {
        let text = "ü".repeat(100);
        let pieces = split_at_char_boundaries(&text, SAY_CHUNK_BYTES);
        assert!(pieces.len() > 1);
        assert!(pieces.iter().all(|piece| piece.len() <= SAY_CHUNK_BYTES));
        assert_eq!(pieces.concat(), text);
    }

    #[test]
    fn caps_command_output() {
        let mut output = CappedOutput::new();
        output.push(&vec![b'a'; RUN_OUTPUT_LIMIT - 1]);
        output.push(b"bcd");
        let text = output.into_text();
        assert!(text.starts_with(&"a".repeat(RUN_OUTPUT_LIMIT - 1)));
        assert!(text.contains("[output truncated to 65536 bytes; 2 more dropped]"));

        let mut small = CappedOutput::new();
        small.push(b"hello\n");
        assert_eq!(small.into_text(), "hello\n");
    }
}
