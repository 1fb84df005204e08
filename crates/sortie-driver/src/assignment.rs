//! A driver that awaits its assignment (`--await-assignment`, a generic pod's): until the host says which
//! session it serves (`POST /assignment`, over the link only the host holds), it runs no agent and
//! answers everything else `NOT_ASSIGNED`; then it is the driver the flags would have made, for good. The
//! same assignment again is a no-op (a host that retries); another one is refused `ALREADY_ASSIGNED`.

use std::sync::{Arc, Mutex};

use axum::Router;
use axum::body::Bytes;
use axum::extract::{Request, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use sortie_protocol::driver::{Assignment, Checkout, DriverErrorCode, HOME_PATH, HOME_SNAPSHOT_MAX_BYTES};
use tower::ServiceExt;

use crate::driver::Driver;
use crate::launch::DriverSettings;

#[derive(Clone)]
struct Awaiting {
    settings: DriverSettings,
    assigned: Arc<tokio::sync::Mutex<Option<(Assignment, Router)>>>,
    /// The driver made, for the shutdown to stop its agent.
    driver: Arc<Mutex<Option<Driver>>>,
}

/// The router of a driver awaiting its assignment, and the driver once it has one.
pub fn router(settings: DriverSettings) -> (Router, Arc<Mutex<Option<Driver>>>) {
    let driver = Arc::new(Mutex::new(None));
    let state = Awaiting {
        settings,
        assigned: Arc::default(),
        driver: driver.clone(),
    };
    let router = Router::new()
        .route("/assignment", post(assign))
        .route(
            HOME_PATH,
            get(give_home)
                .put(take_home)
                .layer(axum::extract::DefaultBodyLimit::max(HOME_SNAPSHOT_MAX_BYTES + 4096)),
        )
        .fallback(forward)
        .with_state(state);
    (router, driver)
}

async fn assign(State(state): State<Awaiting>, body: Bytes) -> Response {
    let assignment: Assignment = match serde_json::from_slice(&body) {
        Ok(assignment) => assignment,
        Err(error) => {
            return crate::api::refuse(
                StatusCode::BAD_REQUEST,
                DriverErrorCode::InvalidRequest,
                format!("the body is not an assignment: {error}"),
            );
        }
    };
    let mut assigned = state.assigned.lock().await;
    if let Some((held, _)) = assigned.as_ref() {
        return if *held == assignment {
            StatusCode::OK.into_response()
        } else {
            crate::api::refuse(
                StatusCode::CONFLICT,
                DriverErrorCode::AlreadyAssigned,
                format!("this driver serves session {}", held.session),
            )
        };
    }
    let mut settings = state.settings.clone();
    settings.apply(&assignment);
    if let Some(checkout) = &assignment.checkout {
        match check_out(&settings, checkout).await {
            Ok(restored) => settings.kept_work = Some(restored),
            Err(why) => {
                return crate::api::refuse(
                    StatusCode::UNPROCESSABLE_ENTITY,
                    DriverErrorCode::CheckoutFailed,
                    format!("the workspace could not be cloned: {why}"),
                );
            }
        }
    }
    let config = match settings.resolve().await {
        Ok(config) => config,
        Err(error) => {
            return crate::api::refuse(
                StatusCode::UNPROCESSABLE_ENTITY,
                DriverErrorCode::InvalidRequest,
                format!("the assignment cannot be served: {error}"),
            );
        }
    };
    let driver = Driver::new(config);
    *state.driver.lock().unwrap_or_else(|p| p.into_inner()) = Some(driver.clone());
    tracing::info!(session = %assignment.session, agent = %assignment.agent, "assigned");
    *assigned = Some((assignment, crate::api::router(driver)));
    StatusCode::OK.into_response()
}

/// Makes the pod's workspace: the session's repository through its git proxy, its branch at the
/// commit the host named, and the files the session's last pod kept on top. A workspace that has a
/// repository already is left as it is. `true` when kept work was restored; work that cannot be is
/// left at its ref (said in the log), and the workspace is the branch's.
async fn check_out(settings: &DriverSettings, checkout: &Checkout) -> Result<bool, String> {
    if !sortie_protocol::driver::is_commit_id(&checkout.commit) {
        return Err(format!("{:?} is not a full commit id", checkout.commit));
    }
    let Some(branch) = settings.branch.as_deref() else {
        return Err("the assignment names no branch".into());
    };
    if let Some(wip) = &checkout.wip
        && !sortie_protocol::driver::is_commit_id(wip)
    {
        return Err(format!("{wip:?} is not a full commit id"));
    }
    if settings.workspace.join(".git").exists() {
        return Ok(false);
    }
    let git = crate::delivery::Git {
        workspace: settings.workspace.clone(),
        env: vec![
            ("HOME".into(), settings.home.display().to_string()),
            // A home restored from the session's last pod is the agent's: its git config is not read.
            ("GIT_CONFIG_GLOBAL".into(), "/dev/null".into()),
            ("GIT_CONFIG_NOSYSTEM".into(), "1".into()),
            (
                "PATH".into(),
                std::env::var("PATH").unwrap_or_else(|_| "/usr/local/bin:/usr/bin:/bin".into()),
            ),
        ],
        timeout: crate::delivery::GIT_TIMEOUT,
    };
    git.checkout(&checkout.url, &checkout.commit, branch)
        .await
        .map_err(|error| error.to_string())?;
    let Some(wip) = &checkout.wip else {
        return Ok(false);
    };
    let refname = sortie_protocol::ids::wip_ref(&settings.session);
    match git.restore_kept(&refname, wip).await {
        Ok(()) => Ok(true),
        Err(error) => {
            tracing::warn!(%error, "the session's kept work was not restored; it stays at {refname}");
            Ok(false)
        }
    }
}

/// `GET /home`: the agent's home as a tar, for the session's next pod.
async fn give_home(State(state): State<Awaiting>) -> Response {
    let home = state.settings.home.clone();
    match tokio::task::spawn_blocking(move || crate::home::snapshot(&home)).await {
        Ok(Ok(tar)) => ([(axum::http::header::CONTENT_TYPE, "application/x-tar")], tar).into_response(),
        Ok(Err(crate::home::HomeError::TooLarge)) => crate::api::refuse(
            StatusCode::PAYLOAD_TOO_LARGE,
            DriverErrorCode::HomeTooLarge,
            format!("the agent's home is larger than {HOME_SNAPSHOT_MAX_BYTES} bytes"),
        ),
        Ok(Err(error)) => crate::api::refuse(
            StatusCode::INTERNAL_SERVER_ERROR,
            DriverErrorCode::InvalidRequest,
            format!("cannot read the agent's home: {error}"),
        ),
        Err(error) => crate::api::refuse(
            StatusCode::INTERNAL_SERVER_ERROR,
            DriverErrorCode::InvalidRequest,
            format!("cannot read the agent's home: {error}"),
        ),
    }
}

/// `PUT /home`: the home an earlier pod of the session gave up, before this one is assigned (the driver
/// reads the agent's persisted session when it is made).
async fn take_home(State(state): State<Awaiting>, body: Bytes) -> Response {
    let assigned = state.assigned.lock().await;
    if let Some((held, _)) = assigned.as_ref() {
        return crate::api::refuse(
            StatusCode::CONFLICT,
            DriverErrorCode::AlreadyAssigned,
            format!(
                "this driver serves session {} already; a home is restored before",
                held.session
            ),
        );
    }
    let home = state.settings.home.clone();
    let restored = tokio::task::spawn_blocking(move || crate::home::restore(&home, &body)).await;
    drop(assigned);
    match restored {
        Ok(Ok(())) => StatusCode::NO_CONTENT.into_response(),
        Ok(Err(error)) => crate::api::refuse(
            StatusCode::UNPROCESSABLE_ENTITY,
            DriverErrorCode::InvalidRequest,
            format!("the home could not be restored: {error}"),
        ),
        Err(error) => crate::api::refuse(
            StatusCode::INTERNAL_SERVER_ERROR,
            DriverErrorCode::InvalidRequest,
            format!("the home could not be restored: {error}"),
        ),
    }
}

async fn forward(State(state): State<Awaiting>, request: Request) -> Response {
    let router = state.assigned.lock().await.as_ref().map(|(_, router)| router.clone());
    match router {
        Some(router) => match router.oneshot(request).await {
            Ok(response) => response,
            Err(never) => match never {},
        },
        None => crate::api::refuse(
            StatusCode::CONFLICT,
            DriverErrorCode::NotAssigned,
            "this driver has no session yet: POST /assignment first",
        ),
    }
}
