//! The ACP side: handlers for the v1 methods this agent supports, and the sessions they share.

use std::collections::HashMap;
use std::path::Path;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use agent_client_protocol::schema::ProtocolVersion;
use agent_client_protocol::v1::schema::{
    self as acp, AgentCapabilities, CancelNotification, ContentBlock, ContentChunk, CurrentModeUpdate, Implementation,
    InitializeRequest, InitializeResponse, LoadSessionRequest, LoadSessionResponse, NewSessionRequest,
    NewSessionResponse, PromptRequest, PromptResponse, SessionId, SessionMode, SessionModeState, SessionNotification,
    SessionUpdate, SetSessionModeRequest, SetSessionModeResponse,
};
use agent_client_protocol::v1::{ConnectionTo, Responder};
use agent_client_protocol::{Agent, Client, Error, ErrorCode, Lines};
use futures::AsyncBufReadExt as _;
use tokio_util::compat::TokioAsyncReadCompatExt as _;
use tokio_util::sync::CancellationToken;

use crate::output::SharedStdout;
use crate::store::{SessionRecord, SessionStore, TurnRecord};
use crate::turn::{Turn, TurnEnd};

/// The name reported in `initialize` as `agentInfo.name`.
pub const AGENT_NAME: &str = "sortie-scripted-agent";

/// The mode every session starts in.
pub const DEFAULT_MODE: &str = "default";
/// The other mode; it changes nothing but the reported mode, which is all a driver can observe of modes.
pub const YOLO_MODE: &str = "yolo";

/// Serves ACP v1 on stdin/stdout until stdin closes.
///
/// Sessions are kept under `$HOME/.scripted-agent`; fails at once if `HOME` is not set.
pub async fn serve_stdio() -> anyhow::Result<()> {
    let store = SessionStore::in_home()?;
    let stdout = SharedStdout::new();
    let agent = ScriptedAgent {
        store,
        stdout: stdout.clone(),
        sessions: Arc::new(Mutex::new(HashMap::new())),
    };
    let incoming_lines = Box::pin(futures::io::BufReader::new(tokio::io::stdin().compat()).lines());
    let transport = Lines::new(stdout.json_rpc_sink(), incoming_lines);

    Agent
        .v1()
        .name(AGENT_NAME)
        .on_receive_request(
            async |_request: InitializeRequest, responder: Responder<InitializeResponse>, _connection| {
                responder.respond(initialize_response())
            },
            agent_client_protocol::on_receive_request!(),
        )
        .on_receive_request(
            {
                let agent = agent.clone();
                async move |request: NewSessionRequest, responder: Responder<NewSessionResponse>, _connection| {
                    match agent.new_session(request).await {
                        Ok(response) => responder.respond(response),
                        Err(error) => responder.respond_with_error(error),
                    }
                }
            },
            agent_client_protocol::on_receive_request!(),
        )
        .on_receive_request(
            {
                let agent = agent.clone();
                async move |request: LoadSessionRequest,
                            responder: Responder<LoadSessionResponse>,
                            connection: ConnectionTo<Client>| {
                    match agent.load_session(request, &connection).await {
                        Ok(response) => responder.respond(response),
                        Err(error) => responder.respond_with_error(error),
                    }
                }
            },
            agent_client_protocol::on_receive_request!(),
        )
        .on_receive_request(
            {
                let agent = agent.clone();
                async move |request: SetSessionModeRequest,
                            responder: Responder<SetSessionModeResponse>,
                            connection: ConnectionTo<Client>| {
                    match agent.set_mode(request, &connection).await {
                        Ok(()) => responder.respond(SetSessionModeResponse::new()),
                        Err(error) => responder.respond_with_error(error),
                    }
                }
            },
            agent_client_protocol::on_receive_request!(),
        )
        .on_receive_request(
            {
                let agent = agent.clone();
                async move |request: PromptRequest,
                            responder: Responder<PromptResponse>,
                            connection: ConnectionTo<Client>| {
                    agent.start_turn(request, responder, connection)
                }
            },
            agent_client_protocol::on_receive_request!(),
        )
        .on_receive_notification(
            {
                let agent = agent.clone();
                async move |notification: CancelNotification, _connection: ConnectionTo<Client>| {
                    agent.cancel_turn(&notification.session_id);
                    Ok(())
                }
            },
            agent_client_protocol::on_receive_notification!(),
        )
        .connect_to(transport)
        .await
        .map_err(|error| anyhow::anyhow!("ACP connection failed: {error:?}"))
}

fn initialize_response() -> InitializeResponse {
    // Only v1 exists in this agent, so it always answers v1 whatever the client asked for.
    InitializeResponse::new(ProtocolVersion::V1)
        .agent_capabilities(AgentCapabilities::new().load_session(true))
        .agent_info(Implementation::new(AGENT_NAME, env!("CARGO_PKG_VERSION")))
}

#[derive(Clone)]
struct ScriptedAgent {
    store: SessionStore,
    stdout: SharedStdout,
    sessions: Arc<Mutex<HashMap<SessionId, LiveSession>>>,
}

/// A session known to this process.
struct LiveSession {
    record: SessionRecord,
    /// Set while a prompt turn runs; cancelling it is how `session/cancel` reaches the turn.
    running_turn: Option<CancellationToken>,
}

impl ScriptedAgent {
    async fn new_session(&self, request: NewSessionRequest) -> Result<NewSessionResponse, Error> {
        require_absolute(&request.cwd)?;
        let session_id = SessionId::new(ulid::Ulid::generate().to_string());
        let record = SessionRecord {
            session_id: session_id.to_string(),
            cwd: request.cwd,
            mode_id: DEFAULT_MODE.to_owned(),
            turns: Vec::new(),
        };
        // Saved right away so that a session/load in a later process finds even a session without turns.
        self.store.save(&record).await.map_err(internal_error)?;
        self.sessions().insert(
            session_id.clone(),
            LiveSession {
                record,
                running_turn: None,
            },
        );
        Ok(NewSessionResponse::new(session_id).modes(mode_state(DEFAULT_MODE)))
    }

    async fn load_session(
        &self,
        request: LoadSessionRequest,
        connection: &ConnectionTo<Client>,
    ) -> Result<LoadSessionResponse, Error> {
        require_absolute(&request.cwd)?;
        let in_memory = self
            .sessions()
            .get(&request.session_id)
            .map(|session| session.record.clone());
        let mut record = match in_memory {
            Some(record) => record,
            None => self
                .store
                .load(&request.session_id.0)
                .await
                .map_err(internal_error)?
                .ok_or_else(|| Error::from(acp::Error::session_not_found(request.session_id.clone())))?,
        };
        // The client says where the session lives now; later turns run there.
        record.cwd = request.cwd;

        for turn in &record.turns {
            for block in &turn.prompt {
                let replayed = SessionUpdate::UserMessageChunk(ContentChunk::new(block.clone()));
                send_update(connection, &request.session_id, replayed)?;
            }
            for update in &turn.updates {
                send_update(connection, &request.session_id, update.clone())?;
            }
        }

        let response = LoadSessionResponse::new().modes(mode_state(&record.mode_id));
        self.sessions()
            .entry(request.session_id)
            .and_modify(|session| session.record.cwd = record.cwd.clone())
            .or_insert(LiveSession {
                record,
                running_turn: None,
            });
        Ok(response)
    }

    async fn set_mode(&self, request: SetSessionModeRequest, connection: &ConnectionTo<Client>) -> Result<(), Error> {
        let mode_id = request.mode_id.0.as_ref();
        if mode_id != DEFAULT_MODE && mode_id != YOLO_MODE {
            return Err(Error::new(
                ErrorCode::INVALID_PARAMS,
                format!("unknown mode `{mode_id}`; this agent has `{DEFAULT_MODE}` and `{YOLO_MODE}`"),
            ));
        }
        let record = {
            let mut sessions = self.sessions();
            let session = sessions
                .get_mut(&request.session_id)
                .ok_or_else(|| Error::from(acp::Error::session_not_found(request.session_id.clone())))?;
            session.record.mode_id = mode_id.to_owned();
            session.record.clone()
        };
        self.store.save(&record).await.map_err(internal_error)?;
        send_update(
            connection,
            &request.session_id,
            SessionUpdate::CurrentModeUpdate(CurrentModeUpdate::new(request.mode_id.clone())),
        )
    }

    /// Starts a turn on its own task (a whole turn must not hold the dispatch loop) and answers when it ends.
    fn start_turn(
        &self,
        request: PromptRequest,
        responder: Responder<PromptResponse>,
        connection: ConnectionTo<Client>,
    ) -> Result<(), Error> {
        let cancellation = CancellationToken::new();
        let started = {
            let mut sessions = self.sessions();
            match sessions.get_mut(&request.session_id) {
                None => Err(Error::from(acp::Error::session_not_found(request.session_id.clone()))),
                Some(session) if session.running_turn.is_some() => Err(Error::new(
                    ErrorCode::INVALID_REQUEST,
                    "a prompt turn is already running in this session",
                )),
                Some(session) => {
                    session.running_turn = Some(cancellation.clone());
                    Ok((session.record.cwd.clone(), session.record.turns.len() + 1))
                }
            }
        };
        let (cwd, turn_number) = match started {
            Ok(started) => started,
            Err(error) => return responder.respond_with_error(error),
        };

        let agent = self.clone();
        let task_connection = connection.clone();
        connection.spawn(async move {
            let PromptRequest { session_id, prompt, .. } = request;
            let mut turn = Turn::new(
                task_connection.clone(),
                agent.stdout.clone(),
                session_id.clone(),
                cwd,
                cancellation,
                turn_number,
            );
            let end = turn.run(&prompt_text(&prompt)).await;
            let finished = TurnRecord {
                prompt,
                updates: turn.into_sent_updates(),
            };
            agent.finish_turn(&session_id, finished).await;
            let answered = match end {
                TurnEnd::Stopped(stop_reason) => responder.respond(PromptResponse::new(stop_reason)),
                TurnEnd::Failed(error) => responder.respond_with_error(error),
                TurnEnd::Crash(code) => {
                    agent
                        .stdout
                        .wait_until_sent_messages_are_written(&task_connection)
                        .await;
                    std::process::exit(code);
                }
            };
            // An error here means the client is gone; it is not worth tearing down the connection for.
            if let Err(error) = answered {
                eprintln!("{AGENT_NAME}: could not answer session/prompt: {error:?}");
            }
            Ok(())
        })
    }

    /// Appends the turn to its session and saves it, so even a turn that failed or crashed can be replayed.
    async fn finish_turn(&self, session_id: &SessionId, finished: TurnRecord) {
        let record = {
            let mut sessions = self.sessions();
            let Some(session) = sessions.get_mut(session_id) else {
                return;
            };
            session.running_turn = None;
            session.record.turns.push(finished);
            session.record.clone()
        };
        if let Err(error) = self.store.save(&record).await {
            eprintln!("{AGENT_NAME}: could not save session {session_id}: {error}");
        }
    }

    fn cancel_turn(&self, session_id: &SessionId) {
        if let Some(running_turn) = self
            .sessions()
            .get(session_id)
            .and_then(|session| session.running_turn.as_ref())
        {
            running_turn.cancel();
        }
    }

    fn sessions(&self) -> MutexGuard<'_, HashMap<SessionId, LiveSession>> {
        // Every critical section leaves the map consistent, so a poisoned lock is still usable.
        self.sessions.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// The text of a prompt: its text blocks joined by newlines (other block kinds carry no script).
fn prompt_text(prompt: &[ContentBlock]) -> String {
    prompt
        .iter()
        .filter_map(|block| match block {
            ContentBlock::Text(text) => Some(text.text.as_str()),
            _ => None,
        })
        .collect::<Vec<_>>()
        .join("\n")
}

fn mode_state(current_mode: &str) -> SessionModeState {
    SessionModeState::new(
        current_mode.to_owned(),
        vec![
            SessionMode::new(DEFAULT_MODE, "Default").description("Behaves exactly as the script says.".to_owned()),
            SessionMode::new(YOLO_MODE, "YOLO")
                .description("Reported as the current mode; the script still decides everything.".to_owned()),
        ],
    )
}

fn send_update(connection: &ConnectionTo<Client>, session_id: &SessionId, update: SessionUpdate) -> Result<(), Error> {
    connection.send_notification(SessionNotification::new(session_id.clone(), update))
}

fn require_absolute(cwd: &Path) -> Result<(), Error> {
    if cwd.is_absolute() {
        Ok(())
    } else {
        Err(Error::new(
            ErrorCode::INVALID_PARAMS,
            format!("cwd must be an absolute path, got `{}`", cwd.display()),
        ))
    }
}

fn internal_error(error: impl std::fmt::Display) -> Error {
    Error::new(ErrorCode::INTERNAL_ERROR, error.to_string())
}
