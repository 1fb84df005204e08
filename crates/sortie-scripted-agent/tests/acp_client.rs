//! Drives the real `sortie-scripted-agent` binary as an ACP client, over its stdin/stdout, with a temporary
//! HOME and working directory.

use std::path::{Path, PathBuf};
use std::process::{ExitStatus, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use agent_client_protocol::schema::ProtocolVersion;
use agent_client_protocol::v1::ConnectionTo;
use agent_client_protocol::v1::schema::{
    CancelNotification, ContentBlock, ContentChunk, InitializeRequest, InitializeResponse, LoadSessionRequest,
    LoadSessionResponse, NewSessionRequest, PermissionOptionKind, PlanEntryStatus, PromptRequest, PromptResponse,
    RequestPermissionOutcome, RequestPermissionRequest, RequestPermissionResponse, SelectedPermissionOutcome,
    SessionId, SessionModeId, SessionNotification, SessionUpdate, SetSessionModeRequest, StopReason, TextContent,
    ToolCallContent, ToolCallStatus, ToolKind,
};
use agent_client_protocol::{Agent, ByteStreams, Client, ErrorCode};
use anyhow::{Context as _, anyhow, bail, ensure};
use tokio::io::{AsyncBufReadExt as _, AsyncWriteExt as _, BufReader};
use tokio::process::{Child, Command};
use tokio::sync::{oneshot, watch};
use tokio::task::JoinHandle;
use tokio_util::compat::{TokioAsyncReadCompatExt as _, TokioAsyncWriteCompatExt as _};

/// The longest any single wait may take before the test fails instead of hanging.
const DEADLINE: Duration = Duration::from_secs(30);

/// Everything the client saw, in arrival order.
#[derive(Debug, Default)]
struct Observed {
    updates: Vec<SessionUpdate>,
    permission_requests: Vec<RequestPermissionRequest>,
    /// Lines on the agent's stdout that are not JSON at all.
    raw_stdout_lines: Vec<String>,
    stderr_lines: Vec<String>,
}

/// How the client's permission handler answers.
#[derive(Debug, Clone, Copy)]
enum PermissionAnswer {
    Select(&'static str),
    Cancelled,
}

/// A running agent process and an ACP client connected to it.
struct ScriptedAgent {
    connection: ConnectionTo<Agent>,
    observed: watch::Receiver<Observed>,
    child: Child,
    stop_client: Option<oneshot::Sender<()>>,
    client: JoinHandle<Result<(), agent_client_protocol::Error>>,
}

impl ScriptedAgent {
    async fn start(home: &Path, permission_answer: PermissionAnswer) -> anyhow::Result<Self> {
        let mut child = Command::new(env!("CARGO_BIN_EXE_sortie-scripted-agent"))
            .env("HOME", home)
            .current_dir(home)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .context("spawn the agent binary")?;
        let child_stdin = child.stdin.take().context("agent stdin")?;
        let child_stdout = child.stdout.take().context("agent stdout")?;
        let child_stderr = child.stderr.take().context("agent stderr")?;

        let (observed_sender, observed) = watch::channel(Observed::default());
        let observed_sender = Arc::new(observed_sender);

        // The client reads the agent's stdout through a tee that also records non-JSON lines, which is how the
        // raw-output fault steps are observed; the bytes reach the client unchanged.
        let (mut tee_writer, client_reader) = tokio::io::duplex(64 * 1024);
        let tee_observed = observed_sender.clone();
        tokio::spawn(async move {
            let mut lines = BufReader::new(child_stdout).lines();
            while let Ok(Some(line)) = lines.next_line().await {
                if serde_json::from_str::<serde_json::Value>(&line).is_err() {
                    tee_observed.send_modify(|observed| observed.raw_stdout_lines.push(line.clone()));
                }
                let forwarded = async {
                    tee_writer.write_all(line.as_bytes()).await?;
                    tee_writer.write_all(b"\n").await
                };
                if forwarded.await.is_err() {
                    break;
                }
            }
        });
        let stderr_observed = observed_sender.clone();
        tokio::spawn(async move {
            let mut lines = BufReader::new(child_stderr).lines();
            while let Ok(Some(line)) = lines.next_line().await {
                stderr_observed.send_modify(|observed| observed.stderr_lines.push(line));
            }
        });

        let (connection_sender, connection_receiver) = oneshot::channel();
        let (stop_client, client_stopped) = oneshot::channel::<()>();
        let notification_observed = observed_sender.clone();
        let permission_observed = observed_sender;
        let transport = ByteStreams::new(child_stdin.compat_write(), client_reader.compat());
        let client = tokio::spawn(
            Client
                .v1()
                .name("scripted-agent-test-client")
                .on_receive_notification(
                    async move |notification: SessionNotification, _connection| {
                        notification_observed.send_modify(|observed| observed.updates.push(notification.update));
                        Ok(())
                    },
                    agent_client_protocol::on_receive_notification!(),
                )
                .on_receive_request(
                    async move |request: RequestPermissionRequest, responder, _connection| {
                        permission_observed.send_modify(|observed| observed.permission_requests.push(request));
                        let outcome = match permission_answer {
                            PermissionAnswer::Select(option_id) => {
                                RequestPermissionOutcome::Selected(SelectedPermissionOutcome::new(option_id))
                            }
                            PermissionAnswer::Cancelled => RequestPermissionOutcome::Cancelled,
                        };
                        responder.respond(RequestPermissionResponse::new(outcome))
                    },
                    agent_client_protocol::on_receive_request!(),
                )
                .connect_with(transport, async move |connection: ConnectionTo<Agent>| {
                    let _ = connection_sender.send(connection);
                    // Keep the connection open until the test is done with it.
                    let _ = client_stopped.await;
                    Ok(())
                }),
        );
        let connection = tokio::time::timeout(DEADLINE, connection_receiver)
            .await
            .context("client did not connect in time")?
            .context("client ended before connecting")?;
        Ok(ScriptedAgent {
            connection,
            observed,
            child,
            stop_client: Some(stop_client),
            client,
        })
    }

    async fn initialize(&self) -> anyhow::Result<InitializeResponse> {
        let request = self
            .connection
            .send_request(InitializeRequest::new(ProtocolVersion::V1));
        Ok(within_deadline("initialize", request.block_task()).await??)
    }

    async fn new_session(&self, cwd: &Path) -> anyhow::Result<SessionId> {
        let request = self.connection.send_request(NewSessionRequest::new(cwd));
        Ok(within_deadline("session/new", request.block_task()).await??.session_id)
    }

    async fn prompt(
        &self,
        session_id: &SessionId,
        text: &str,
    ) -> anyhow::Result<Result<PromptResponse, agent_client_protocol::Error>> {
        let request = self.connection.send_request(PromptRequest::new(
            session_id.clone(),
            vec![ContentBlock::Text(TextContent::new(text))],
        ));
        within_deadline("session/prompt", request.block_task()).await
    }

    /// Waits until `condition` holds for what the client observed, and returns its value.
    async fn wait_for<T>(&self, what: &str, condition: impl Fn(&Observed) -> Option<T>) -> anyhow::Result<T> {
        let mut observed = self.observed.clone();
        let mut found = None;
        within_deadline(
            what,
            observed.wait_for(|observed| {
                found = condition(observed);
                found.is_some()
            }),
        )
        .await?
        .map_err(|_| anyhow!("the client went away while waiting for {what}"))?;
        found.ok_or_else(|| anyhow!("{what} vanished"))
    }

    /// Waits until at least `count` session updates arrived and returns them all.
    async fn wait_for_updates(&self, count: usize) -> anyhow::Result<Vec<SessionUpdate>> {
        self.wait_for(&format!("{count} session updates"), |observed| {
            (observed.updates.len() >= count).then(|| observed.updates.clone())
        })
        .await
    }

    fn updates(&self) -> Vec<SessionUpdate> {
        self.observed.borrow().updates.clone()
    }

    /// Closes the client side (the agent's stdin) and waits for the agent to exit.
    async fn close_and_wait(mut self) -> anyhow::Result<ExitStatus> {
        if let Some(stop_client) = self.stop_client.take() {
            let _ = stop_client.send(());
        }
        let _ = within_deadline("the client to stop", &mut self.client).await;
        within_deadline("the agent to exit", self.child.wait())
            .await?
            .context("wait for the agent")
    }
}

async fn within_deadline<F: IntoFuture>(what: &str, future: F) -> anyhow::Result<F::Output> {
    tokio::time::timeout(DEADLINE, future)
        .await
        .map_err(|_| anyhow!("timed out after {DEADLINE:?} waiting for {what}"))
}

struct Dirs {
    home: tempfile::TempDir,
    workspace: tempfile::TempDir,
}

impl Dirs {
    fn new() -> anyhow::Result<Self> {
        Ok(Dirs {
            home: tempfile::tempdir()?,
            workspace: tempfile::tempdir()?,
        })
    }

    fn home(&self) -> &Path {
        self.home.path()
    }

    fn cwd(&self) -> PathBuf {
        self.workspace.path().to_path_buf()
    }
}

async fn started(dirs: &Dirs, permission_answer: PermissionAnswer) -> anyhow::Result<(ScriptedAgent, SessionId)> {
    let agent = ScriptedAgent::start(dirs.home(), permission_answer).await?;
    agent.initialize().await?;
    let session_id = agent.new_session(&dirs.cwd()).await?;
    Ok((agent, session_id))
}

fn text_of(chunk: &ContentChunk) -> Option<&str> {
    match &chunk.content {
        ContentBlock::Text(text) => Some(&text.text),
        _ => None,
    }
}

fn message_texts(updates: &[SessionUpdate]) -> Vec<String> {
    updates
        .iter()
        .filter_map(|update| match update {
            SessionUpdate::AgentMessageChunk(chunk) => text_of(chunk).map(str::to_owned),
            _ => None,
        })
        .collect()
}

/// A short name per update, so sequences can be compared as a whole.
fn kind_of(update: &SessionUpdate) -> &'static str {
    match update {
        SessionUpdate::UserMessageChunk(_) => "user_message_chunk",
        SessionUpdate::AgentMessageChunk(_) => "agent_message_chunk",
        SessionUpdate::AgentThoughtChunk(_) => "agent_thought_chunk",
        SessionUpdate::ToolCall(_) => "tool_call",
        SessionUpdate::ToolCallUpdate(_) => "tool_call_update",
        SessionUpdate::Plan(_) => "plan",
        SessionUpdate::CurrentModeUpdate(_) => "current_mode_update",
        _ => "other",
    }
}

#[tokio::test]
async fn initialize_advertises_load_session() -> anyhow::Result<()> {
    let dirs = Dirs::new()?;
    let agent = ScriptedAgent::start(dirs.home(), PermissionAnswer::Cancelled).await?;
    let response = agent.initialize().await?;
    assert_eq!(response.protocol_version, ProtocolVersion::V1);
    assert!(response.agent_capabilities.load_session);
    assert_eq!(
        response.agent_info.map(|info| info.name).as_deref(),
        Some("sortie-scripted-agent")
    );
    let status = agent.close_and_wait().await?;
    assert!(status.success(), "closing stdin ends the agent cleanly: {status}");
    Ok(())
}

#[tokio::test]
async fn a_prompt_that_is_not_a_script_is_echoed() -> anyhow::Result<()> {
    let dirs = Dirs::new()?;
    let (agent, session_id) = started(&dirs, PermissionAnswer::Cancelled).await?;
    let long_prompt = format!("please fix the bug {}", "z".repeat(300));
    let response = agent.prompt(&session_id, &long_prompt).await??;
    assert_eq!(response.stop_reason, StopReason::EndTurn);
    let updates = agent.wait_for_updates(1).await?;
    let expected: String = format!(
        "scripted agent received: {}",
        long_prompt.chars().take(200).collect::<String>()
    );
    assert_eq!(message_texts(&updates), vec![expected]);
    Ok(())
}

#[tokio::test]
async fn every_step_kind_produces_its_updates_in_order() -> anyhow::Result<()> {
    let dirs = Dirs::new()?;
    let (agent, session_id) = started(&dirs, PermissionAnswer::Select("allow_once")).await?;
    let long_text = "é".repeat(50); // 100 bytes: two chunks, never cut inside a character
    let script = format!(
        "#!scripted
plan: Write the notes | Check them
think: planning the work
say: {long_text}
write: notes/hello.txt
hello
world
>>>
done: 1
run: echo from-run; echo to-stderr >&2
ask: May I push?
sleep: 1
hang: 1
flood: 3
garbage: this is not json
bigline: 100000
stderr: a line on stderr
say: finished"
    );
    let response = agent.prompt(&session_id, &script).await??;
    assert_eq!(response.stop_reason, StopReason::EndTurn);

    let expected_kinds = [
        "plan",
        "agent_thought_chunk",
        "agent_message_chunk",
        "agent_message_chunk",
        "tool_call",
        "tool_call_update",
        "plan",
        "tool_call",
        "tool_call_update",
        "tool_call_update",
        "agent_message_chunk",
        "agent_message_chunk",
        "agent_message_chunk",
        "agent_message_chunk",
        "agent_message_chunk",
    ];
    let updates = agent.wait_for_updates(expected_kinds.len()).await?;
    assert_eq!(updates.iter().map(kind_of).collect::<Vec<_>>(), expected_kinds);

    let SessionUpdate::Plan(plan) = &updates[0] else {
        bail!("expected a plan first")
    };
    let entries: Vec<_> = plan
        .entries
        .iter()
        .map(|entry| (entry.content.as_str(), entry.status.clone()))
        .collect();
    assert_eq!(
        entries,
        [
            ("Write the notes", PlanEntryStatus::Pending),
            ("Check them", PlanEntryStatus::Pending)
        ]
    );
    let SessionUpdate::AgentThoughtChunk(thought) = &updates[1] else {
        bail!("expected a thought")
    };
    assert_eq!(text_of(thought), Some("planning the work"));
    let said: Vec<_> = updates[2..4]
        .iter()
        .filter_map(|update| match update {
            SessionUpdate::AgentMessageChunk(chunk) => text_of(chunk),
            _ => None,
        })
        .collect();
    assert_eq!(said.concat(), long_text);
    assert!(said.iter().all(|piece| piece.len() <= 64));

    let written = dirs.cwd().join("notes/hello.txt");
    let SessionUpdate::ToolCall(write_call) = &updates[4] else {
        bail!("expected the write tool call")
    };
    assert_eq!(write_call.kind, ToolKind::Edit);
    assert_eq!(write_call.status, ToolCallStatus::Pending);
    let [ToolCallContent::Diff(diff)] = write_call.content.as_slice() else {
        bail!("expected one diff")
    };
    assert_eq!(diff.path, written);
    assert_eq!(diff.old_text, None);
    assert_eq!(diff.new_text, "hello\nworld\n");
    assert_eq!(
        write_call.locations.first().map(|location| &location.path),
        Some(&written)
    );
    let SessionUpdate::ToolCallUpdate(write_done) = &updates[5] else {
        bail!("expected the write update")
    };
    assert_eq!(write_done.tool_call_id, write_call.tool_call_id);
    assert_eq!(write_done.fields.status, Some(ToolCallStatus::Completed));
    assert_eq!(std::fs::read_to_string(&written)?, "hello\nworld\n");

    let SessionUpdate::Plan(plan) = &updates[6] else {
        bail!("expected the plan again")
    };
    let statuses: Vec<_> = plan.entries.iter().map(|entry| entry.status.clone()).collect();
    assert_eq!(statuses, [PlanEntryStatus::Completed, PlanEntryStatus::Pending]);

    let SessionUpdate::ToolCall(run_call) = &updates[7] else {
        bail!("expected the run tool call")
    };
    assert_eq!(run_call.kind, ToolKind::Execute);
    assert_eq!(run_call.title, "echo from-run; echo to-stderr >&2");
    assert_eq!(
        run_call.raw_input,
        Some(serde_json::json!({ "command": "echo from-run; echo to-stderr >&2" }))
    );
    let SessionUpdate::ToolCallUpdate(running) = &updates[8] else {
        bail!("expected in_progress")
    };
    assert_eq!(running.fields.status, Some(ToolCallStatus::InProgress));
    let SessionUpdate::ToolCallUpdate(ran) = &updates[9] else {
        bail!("expected the run result")
    };
    assert_eq!(ran.tool_call_id, run_call.tool_call_id);
    assert_eq!(ran.fields.status, Some(ToolCallStatus::Completed));
    assert_eq!(ran.fields.raw_output, Some(serde_json::json!({ "exitCode": 0 })));
    let Some([ToolCallContent::Content(output)]) = ran.fields.content.as_deref() else {
        bail!("expected output")
    };
    assert_eq!(output.content, ContentBlock::from("from-run\nto-stderr\n"));

    let texts = message_texts(&updates[10..]);
    assert_eq!(
        texts,
        [
            "permission: allow_once",
            "flood 1\n",
            "flood 2\n",
            "flood 3\n",
            "finished"
        ]
    );

    let permission_requests = agent.observed.borrow().permission_requests.clone();
    let [permission_request] = permission_requests.as_slice() else {
        bail!("expected one permission request")
    };
    assert_eq!(permission_request.session_id, session_id);
    assert_eq!(
        permission_request.tool_call.fields.title.as_deref(),
        Some("May I push?")
    );
    let options: Vec<_> = permission_request
        .options
        .iter()
        .map(|option| (option.option_id.to_string(), option.name.as_str(), option.kind))
        .collect();
    assert_eq!(
        options,
        [
            ("allow_once".to_owned(), "Allow", PermissionOptionKind::AllowOnce),
            ("reject_once".to_owned(), "Reject", PermissionOptionKind::RejectOnce),
        ]
    );

    let raw_lines = agent
        .wait_for("the raw stdout lines", |observed| {
            (observed.raw_stdout_lines.len() >= 2).then(|| observed.raw_stdout_lines.clone())
        })
        .await?;
    assert_eq!(raw_lines[0], "this is not json");
    assert_eq!(raw_lines[1], "x".repeat(100_000));
    agent
        .wait_for("the stderr line", |observed| {
            observed
                .stderr_lines
                .iter()
                .any(|line| line == "a line on stderr")
                .then_some(())
        })
        .await?;
    Ok(())
}

#[tokio::test]
async fn a_failing_command_is_a_failed_tool_call() -> anyhow::Result<()> {
    let dirs = Dirs::new()?;
    let (agent, session_id) = started(&dirs, PermissionAnswer::Cancelled).await?;
    let response = agent
        .prompt(&session_id, "#!scripted\nrun: echo oops; exit 3")
        .await??;
    assert_eq!(
        response.stop_reason,
        StopReason::EndTurn,
        "a failed command does not fail the turn"
    );
    let updates = agent.wait_for_updates(3).await?;
    let SessionUpdate::ToolCallUpdate(result) = &updates[2] else {
        bail!("expected the run result")
    };
    assert_eq!(result.fields.status, Some(ToolCallStatus::Failed));
    assert_eq!(result.fields.raw_output, Some(serde_json::json!({ "exitCode": 3 })));
    let Some([ToolCallContent::Content(output)]) = result.fields.content.as_deref() else {
        bail!("expected output")
    };
    assert_eq!(output.content, ContentBlock::from("oops\n"));
    Ok(())
}

#[tokio::test]
async fn ask_reaches_the_permission_handler_and_reports_the_answer() -> anyhow::Result<()> {
    let dirs = Dirs::new()?;
    let (agent, session_id) = started(&dirs, PermissionAnswer::Select("reject_once")).await?;
    let response = agent
        .prompt(&session_id, "#!scripted\nask: Delete everything?")
        .await??;
    assert_eq!(response.stop_reason, StopReason::EndTurn);
    let updates = agent.wait_for_updates(1).await?;
    assert_eq!(message_texts(&updates), ["permission: reject_once"]);
    let titles: Vec<_> = agent
        .observed
        .borrow()
        .permission_requests
        .iter()
        .map(|request| request.tool_call.fields.title.clone())
        .collect();
    assert_eq!(titles, [Some("Delete everything?".to_owned())]);

    let (cancelling_agent, session_id) = started(&dirs, PermissionAnswer::Cancelled).await?;
    cancelling_agent
        .prompt(&session_id, "#!scripted\nask: Again?")
        .await??;
    let updates = cancelling_agent.wait_for_updates(1).await?;
    assert_eq!(message_texts(&updates), ["permission: cancelled"]);
    Ok(())
}

#[tokio::test]
async fn fail_and_script_mistakes_answer_with_errors() -> anyhow::Result<()> {
    let dirs = Dirs::new()?;
    let (agent, session_id) = started(&dirs, PermissionAnswer::Cancelled).await?;

    let Err(error) = agent
        .prompt(&session_id, "#!scripted\nsay: before\nfail: the model broke")
        .await?
    else {
        bail!("fail: must answer with an error");
    };
    assert_eq!(error.message, "the model broke");
    assert_eq!(error.code, ErrorCode::INTERNAL_ERROR);
    assert_eq!(message_texts(&agent.wait_for_updates(1).await?), ["before"]);

    let Err(error) = agent
        .prompt(&session_id, "#!scripted\nsay: never\nfrobnicate: x")
        .await?
    else {
        bail!("an unknown step must answer with an error");
    };
    assert_eq!(error.code, ErrorCode::INVALID_PARAMS);
    assert!(
        error.message.contains("line 3"),
        "the error names the line: {}",
        error.message
    );
    assert!(
        error.message.contains("frobnicate"),
        "the error names the step: {}",
        error.message
    );
    // Nothing of a broken script runs.
    assert_eq!(message_texts(&agent.updates()), ["before"]);
    Ok(())
}

#[tokio::test]
async fn crash_exits_with_the_code_after_flushing() -> anyhow::Result<()> {
    let dirs = Dirs::new()?;
    let (agent, session_id) = started(&dirs, PermissionAnswer::Cancelled).await?;
    let answer = agent
        .prompt(&session_id, "#!scripted\nsay: last words\ncrash: 7\nsay: never")
        .await?;
    assert!(answer.is_err(), "a crashed agent never answers the prompt: {answer:?}");
    assert_eq!(message_texts(&agent.updates()), ["last words"]);
    let status = agent.close_and_wait().await?;
    assert_eq!(status.code(), Some(7));
    Ok(())
}

#[tokio::test]
async fn cancel_interrupts_sleep() -> anyhow::Result<()> {
    let dirs = Dirs::new()?;
    let (agent, session_id) = started(&dirs, PermissionAnswer::Cancelled).await?;
    let prompt = agent.connection.send_request(PromptRequest::new(
        session_id.clone(),
        vec![ContentBlock::from("#!scripted\nsay: started\nsleep: 10000\nsay: never")],
    ));
    agent
        .wait_for("the turn to start", |observed| {
            (!observed.updates.is_empty()).then_some(())
        })
        .await?;
    let cancelled_at = Instant::now();
    agent
        .connection
        .send_notification(CancelNotification::new(session_id))?;
    let response = within_deadline("the cancelled prompt", prompt.block_task()).await??;
    assert_eq!(response.stop_reason, StopReason::Cancelled);
    assert!(
        cancelled_at.elapsed() < Duration::from_secs(5),
        "sleep must end at the cancel, took {:?}",
        cancelled_at.elapsed()
    );
    assert_eq!(message_texts(&agent.updates()), ["started"]);
    Ok(())
}

#[tokio::test]
async fn hang_ignores_cancel_until_it_is_over() -> anyhow::Result<()> {
    let dirs = Dirs::new()?;
    let (agent, session_id) = started(&dirs, PermissionAnswer::Cancelled).await?;
    let started_at = Instant::now();
    let prompt = agent.connection.send_request(PromptRequest::new(
        session_id.clone(),
        vec![ContentBlock::from("#!scripted\nsay: started\nhang: 600\nsay: never")],
    ));
    agent
        .wait_for("the turn to start", |observed| {
            (!observed.updates.is_empty()).then_some(())
        })
        .await?;
    agent
        .connection
        .send_notification(CancelNotification::new(session_id))?;
    let response = within_deadline("the hanging prompt", prompt.block_task()).await??;
    assert_eq!(
        response.stop_reason,
        StopReason::Cancelled,
        "the step boundary after hang sees the cancel"
    );
    assert!(
        started_at.elapsed() >= Duration::from_millis(600),
        "hang must not be interrupted"
    );
    assert_eq!(message_texts(&agent.updates()), ["started"]);
    Ok(())
}

#[tokio::test]
async fn load_in_a_new_process_replays_earlier_turns() -> anyhow::Result<()> {
    let dirs = Dirs::new()?;
    let script = "#!scripted\nsay: remember me\nrun: echo hi";
    let (first, session_id) = started(&dirs, PermissionAnswer::Cancelled).await?;
    first.prompt(&session_id, script).await??;
    let first_turn = first.wait_for_updates(4).await?;
    let mode_request = first
        .connection
        .send_request(SetSessionModeRequest::new(session_id.clone(), "yolo"));
    within_deadline("session/set_mode", mode_request.block_task()).await??;
    let with_mode = first.wait_for_updates(5).await?;
    let SessionUpdate::CurrentModeUpdate(mode_update) = &with_mode[4] else {
        bail!("expected the mode update")
    };
    assert_eq!(mode_update.current_mode_id, SessionModeId::new("yolo"));
    let unknown_mode = first
        .connection
        .send_request(SetSessionModeRequest::new(session_id.clone(), "turbo"));
    ensure!(
        within_deadline("session/set_mode", unknown_mode.block_task())
            .await?
            .is_err(),
        "an unknown mode is refused"
    );
    let status = first.close_and_wait().await?;
    assert!(status.success());

    let second = ScriptedAgent::start(dirs.home(), PermissionAnswer::Cancelled).await?;
    let initialized = second.initialize().await?;
    assert!(initialized.agent_capabilities.load_session);
    let load = second
        .connection
        .send_request(LoadSessionRequest::new(session_id.clone(), dirs.cwd()));
    let loaded: LoadSessionResponse = within_deadline("session/load", load.block_task()).await??;
    assert_eq!(
        loaded.modes.map(|modes| modes.current_mode_id),
        Some(SessionModeId::new("yolo"))
    );

    let replayed = second.wait_for_updates(1 + first_turn.len()).await?;
    let SessionUpdate::UserMessageChunk(user_chunk) = &replayed[0] else {
        bail!("the prompt is replayed first")
    };
    assert_eq!(text_of(user_chunk), Some(script));
    assert_eq!(
        &replayed[1..],
        first_turn.as_slice(),
        "the agent's updates are replayed as sent"
    );

    // The loaded session takes new turns.
    let response = second.prompt(&session_id, "#!scripted\nsay: back again").await??;
    assert_eq!(response.stop_reason, StopReason::EndTurn);
    let all = second.wait_for_updates(2 + first_turn.len()).await?;
    assert_eq!(message_texts(&all[1 + first_turn.len()..]), ["back again"]);

    // Unknown ids, and ids that could never name a session file, are not found.
    for unknown_id in ["no-such-session", "../../etc/passwd"] {
        let unknown = second
            .connection
            .send_request(LoadSessionRequest::new(unknown_id, dirs.cwd()));
        let Err(error) = within_deadline("session/load", unknown.block_task()).await? else {
            bail!("loading the unknown session {unknown_id} must fail");
        };
        assert_eq!(error.code, ErrorCode::RESOURCE_NOT_FOUND, "{unknown_id}");
    }
    Ok(())
}

#[tokio::test]
async fn cancel_kills_a_running_command() -> anyhow::Result<()> {
    let dirs = Dirs::new()?;
    let (agent, session_id) = started(&dirs, PermissionAnswer::Cancelled).await?;
    let prompt = agent.connection.send_request(PromptRequest::new(
        session_id.clone(),
        vec![ContentBlock::from("#!scripted\nrun: echo begun; sleep 20\nsay: never")],
    ));
    // tool_call, then in_progress: the command is running.
    agent.wait_for_updates(2).await?;
    let cancelled_at = Instant::now();
    agent
        .connection
        .send_notification(CancelNotification::new(session_id))?;
    let response = within_deadline("the cancelled prompt", prompt.block_task()).await??;
    assert_eq!(response.stop_reason, StopReason::Cancelled);
    assert!(
        cancelled_at.elapsed() < Duration::from_secs(5),
        "took {:?}",
        cancelled_at.elapsed()
    );
    let updates = agent.wait_for_updates(3).await?;
    let SessionUpdate::ToolCallUpdate(result) = &updates[2] else {
        bail!("expected the run result")
    };
    assert_eq!(result.fields.status, Some(ToolCallStatus::Failed));
    assert!(message_texts(&updates).is_empty());
    Ok(())
}
