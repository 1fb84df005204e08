//! `sortie driver`: the driver's settings as the worker (or a person, outside any sandbox) gives them,
//! resolved into a running driver. The agent's environment policy lives here: nothing of the
//! driver's own environment reaches the agent but `PATH`.
//!
//! In a sandbox the driver serves on the listening socket the worker passes as its stdin, and makes
//! itself undumpable first: the agent (same uid) can then neither read its memory nor take its
//! descriptors.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use crate::agent::AgentLaunch;
use crate::delivery::{self, DeliveryConfig};
use crate::driver::{Driver, DriverConfig};
use crate::profile::{self, AgentProfile};
use crate::secrets::KnownSecrets;

/// The driver's settings (clap derive: `sortie driver …`).
#[derive(Clone, Debug, clap::Args)]
pub struct DriverSettings {
    /// The Unix socket to serve the driver API on (a stale file there is replaced).
    #[arg(long, required_unless_present_any = ["listen_on_stdin", "link"])]
    pub socket: Option<PathBuf>,
    /// Serve the driver API on the listening Unix socket passed as stdin (how the worker starts the
    /// driver in a sandbox: the socket's name is the host's, out of the sandbox's reach).
    #[arg(long, conflicts_with = "socket")]
    pub listen_on_stdin: bool,
    /// Dial the gateway at this `http://host:port` and serve the driver API on that link (a pod's
    /// driver, which no host socket reaches), identified by `--identity-token-file`.
    #[arg(long, conflicts_with_all = ["socket", "listen_on_stdin"], requires = "identity_token_file")]
    pub link: Option<String>,
    /// The driver's identity token for the link (a projected service-account token for audience
    /// `sortie-gateway`), read again at every dial.
    #[arg(long, requires = "link")]
    pub identity_token_file: Option<PathBuf>,
    /// The agent's working directory: the session's checkout.
    #[arg(long)]
    pub workspace: PathBuf,
    /// The agent's HOME (its state, kept across sandboxes).
    #[arg(long)]
    pub home: PathBuf,
    /// The agent profile to run.
    #[arg(long, required_unless_present = "await_assignment")]
    pub agent: Option<String>,
    /// Run no agent until the host assigns a session (`POST /assignment`: session, agent, model,
    /// branch): a generic pod's driver over its link, the same for every session, or a warm local
    /// sandbox's on the socket passed as stdin, whose workspace the host binds in before it assigns.
    #[arg(long, conflicts_with = "agent")]
    pub await_assignment: bool,
    /// An agent manifest (TOML) that adds or overrides profiles.
    #[arg(long)]
    pub profiles: Option<PathBuf>,
    /// The sortie session id; assistant messages are `<session>-t<n>`.
    #[arg(long, default_value = "ses_local")]
    pub session: String,
    /// Where turn logs go; default `<home>/.sortie/turns`.
    #[arg(long)]
    pub state_dir: Option<PathBuf>,
    /// A turn running longer than this many seconds fails with TURN_TIMEOUT.
    #[arg(long, default_value_t = 1800)]
    pub turn_timeout: u64,
    /// Seconds the agent has to finish the ACP handshake.
    #[arg(long, default_value_t = 60)]
    pub start_timeout: u64,
    /// Seconds between a cancel (or SIGTERM) and the next, harder step.
    #[arg(long, default_value_t = 5)]
    pub kill_grace: u64,
    /// Relay 127.0.0.1:3128 to this egress socket and point the agent's proxy variables at it.
    #[arg(long)]
    pub egress_socket: Option<PathBuf>,
    /// Relay 127.0.0.1:3128 to the gateway of `--link`, each connection with the pod's identity, and
    /// point the agent's proxy variables at it (a pod's only way out).
    #[arg(long, requires = "link", conflicts_with = "egress_socket")]
    pub egress_over_link: bool,
    /// A pod's (set at its assignment): what a failed delivery could not push is kept at the session's
    /// WIP ref; `true` when the workspace was made from work kept there already.
    #[arg(skip)]
    pub kept_work: Option<bool>,
    /// Deliver each turn's work to this branch (e.g. `sortie/ses_…`): commit, scan for secrets, push.
    /// Without it the work stays in the workspace.
    #[arg(long)]
    pub branch: Option<String>,
    /// The remote to push to: a name in the workspace's git config, a URL or a path.
    #[arg(long, default_value = "origin", requires = "branch")]
    pub remote: String,
    /// The author and committer name of delivered commits.
    #[arg(long, default_value = "sortie")]
    pub author_name: String,
    /// The author and committer email of delivered commits.
    #[arg(long, default_value = "sortie@localhost")]
    pub author_email: String,
    /// A file of known secret values' SHA-256 digests (lowercase hex, one a line): a delivery whose
    /// changes hold one of them fails SECRET_DETECTED.
    #[arg(long, requires = "branch")]
    pub secret_digests: Option<PathBuf>,
    /// The gateway's model proxy as the agent reaches it; `/<api>` is appended for the profile's API.
    #[arg(long, default_value = "http://127.0.0.1:3128/_sortie/model")]
    pub model_proxy: String,
    /// The model the agent uses; default: its profile's.
    #[arg(long)]
    pub model: Option<String>,
    /// Where `sortie agents install` put agents (`<dir>/<id>/node_modules/.bin`), searched first.
    #[arg(long)]
    pub agents_dir: Option<PathBuf>,
}

/// Why the driver does not run.
#[derive(Debug, thiserror::Error)]
pub enum LaunchError {
    /// The agent's program is nowhere this host looks (the worker maps this exit to
    /// `AGENT_NOT_FOUND`).
    #[error("agent {agent:?}: cannot find {command:?} among the installed agents, next to sortie or on PATH ({hint})")]
    AgentNotFound {
        agent: String,
        command: String,
        hint: String,
    },
    /// A setting is wrong (an unknown agent, a bad branch name, an unreadable digest file).
    #[error(transparent)]
    Refused(Box<dyn std::error::Error + Send + Sync>),
    #[error("{what}")]
    Failed {
        what: String,
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
}

fn failed<E: std::error::Error + Send + Sync + 'static>(what: impl Into<String>) -> impl FnOnce(E) -> LaunchError {
    let what = what.into();
    move |source| LaunchError::Failed {
        what,
        source: Box::new(source),
    }
}

fn refused<E: std::error::Error + Send + Sync + 'static>(error: E) -> LaunchError {
    LaunchError::Refused(Box::new(error))
}

impl DriverSettings {
    /// Runs the driver until `shutdown` resolves (or the API fails), then stops the agent.
    pub async fn serve(self, shutdown: impl Future<Output = ()> + Send + 'static) -> Result<(), LaunchError> {
        // Before anything else: from here on, a process of the same uid (the agent) cannot ptrace this
        // one, read its memory or environment, or take a descriptor from it.
        nix::sys::prctl::set_dumpable(false).map_err(failed("cannot make the driver undumpable"))?;
        if let (Some(url), Some(token_file)) = (&self.link, &self.identity_token_file)
            && self.await_assignment
        {
            let target = crate::link::LinkTarget::new(url, token_file).map_err(refused)?;
            if self.egress_over_link {
                // Up before the assignment: the workspace is cloned through it (a pod bound to no
                // session yet reaches nothing).
                crate::relay::start(crate::relay::Upstream::Link(target.clone()))
                    .await
                    .map_err(failed(format!("cannot listen on {}", crate::relay::RELAY_ADDRESS)))?;
            }
            let (router, driver) = crate::assignment::router(self.clone());
            crate::link::serve(target, router, shutdown).await;
            let driver = driver.lock().unwrap_or_else(|p| p.into_inner()).take();
            if let Some(driver) = driver {
                driver.shutdown().await;
            }
            return Ok(());
        }
        if self.await_assignment {
            if !self.listen_on_stdin {
                return Err(LaunchError::Refused(
                    "--await-assignment needs --link or --listen-on-stdin: the host assigns over one of them".into(),
                ));
            }
            if let Some(socket) = &self.egress_socket {
                // Up before the assignment, as a pod's is: the host puts `egress.sock` in its directory
                // when it assigns, and until then a connection finds nothing to reach.
                crate::relay::start(crate::relay::Upstream::Socket(socket.clone()))
                    .await
                    .map_err(failed(format!("cannot listen on {}", crate::relay::RELAY_ADDRESS)))?;
            }
            let listener = listener_from_stdin()?;
            let (router, driver) = crate::assignment::router(self.clone());
            axum::serve(listener, router)
                .with_graceful_shutdown(shutdown)
                .await
                .map_err(failed("the driver API failed"))?;
            let driver = driver.lock().unwrap_or_else(|p| p.into_inner()).take();
            if let Some(driver) = driver {
                driver.shutdown().await;
            }
            return Ok(());
        }
        let config = self.clone().resolve().await?;
        if let (Some(url), Some(token_file)) = (&self.link, &self.identity_token_file) {
            let target = crate::link::LinkTarget::new(url, token_file).map_err(refused)?;
            let driver = Driver::new(config);
            crate::link::serve(target, crate::api::router(driver.clone()), shutdown).await;
            driver.shutdown().await;
            return Ok(());
        }
        let listener = match &self.socket {
            Some(socket) => {
                if socket.exists() {
                    std::fs::remove_file(socket).map_err(failed(format!("cannot replace {}", socket.display())))?;
                }
                let listener = tokio::net::UnixListener::bind(socket)
                    .map_err(failed(format!("cannot listen on {}", socket.display())))?;
                println!("sortie driver listening on {}", socket.display());
                listener
            }
            None => listener_from_stdin()?,
        };
        let driver = Driver::new(config);
        crate::api::run(listener, driver.clone(), shutdown)
            .await
            .map_err(failed("the driver API failed"))?;
        driver.shutdown().await;
        Ok(())
    }

    /// Takes what the host assigned (a generic pod's driver): the session, the agent, where it delivers.
    pub fn apply(&mut self, assignment: &sortie_protocol::driver::Assignment) {
        self.session = assignment.session.clone();
        self.agent = Some(assignment.agent.clone());
        self.model = assignment.model.clone();
        if let Some(proxy) = &assignment.model_proxy {
            self.model_proxy = proxy.clone();
        }
        self.branch = assignment.branch.clone();
        if let Some(remote) = &assignment.remote {
            self.remote = remote.clone();
        }
        if let Some(seconds) = assignment.turn_timeout_secs {
            self.turn_timeout = seconds;
        }
        if let Some(path) = &assignment.secret_digests {
            self.secret_digests = Some(PathBuf::from(path));
        }
    }

    /// The agent's profile, its program, files, environment and delivery: a [`DriverConfig`].
    pub(crate) async fn resolve(self) -> Result<DriverConfig, LaunchError> {
        let profiles = profile::load(self.profiles.as_deref()).map_err(refused)?;
        let profile = profile::find(&profiles, self.agent.as_deref().unwrap_or_default())
            .map_err(refused)?
            .rendered(&profile::Render {
                model_proxy: self.model_proxy.clone(),
                model: self.model.clone(),
            });
        let path = std::env::var("PATH").unwrap_or_else(|_| "/usr/local/bin:/usr/bin:/bin".to_owned());
        let command = find_command(&profile, self.agents_dir.as_deref(), &path)?;
        let workspace = std::fs::canonicalize(&self.workspace).map_err(failed(format!(
            "--workspace {} does not exist",
            self.workspace.display()
        )))?;
        std::fs::create_dir_all(&self.home).map_err(failed(format!("cannot create --home {}", self.home.display())))?;
        let home = std::fs::canonicalize(&self.home).map_err(failed(format!("--home {}", self.home.display())))?;
        let turns_dir = self.state_dir.clone().unwrap_or_else(|| home.join(".sortie/turns"));
        profile.write_files(&home).map_err(failed(format!(
            "cannot write agent {:?}'s files under {}",
            profile.id,
            home.display()
        )))?;
        let delivery = self.delivery()?;

        // The agent's whole environment: nothing of the driver's leaks in but PATH.
        let mut env = vec![
            ("HOME".to_owned(), home.to_string_lossy().into_owned()),
            ("PATH".to_owned(), path),
            ("LANG".to_owned(), "C.UTF-8".to_owned()),
        ];
        env.extend(profile.env.iter().map(|(k, v)| (k.clone(), v.clone())));
        let upstream = match (&self.egress_socket, &self.link, &self.identity_token_file) {
            (Some(socket), _, _) => Some(crate::relay::Upstream::Socket(socket.clone())),
            (None, Some(url), Some(token_file)) if self.egress_over_link => Some(crate::relay::Upstream::Link(
                crate::link::LinkTarget::new(url, token_file).map_err(refused)?,
            )),
            _ => None,
        };
        // An assigned driver's relay runs already (`serve` started it before the assignment).
        let running = self.await_assignment && (self.egress_over_link || self.listen_on_stdin);
        if let Some(upstream) = upstream {
            if !running {
                crate::relay::start(upstream)
                    .await
                    .map_err(failed(format!("cannot listen on {}", crate::relay::RELAY_ADDRESS)))?;
            }
            env.extend(crate::relay::proxy_env(crate::relay::RELAY_ADDRESS));
        }
        Ok(DriverConfig {
            launch: AgentLaunch {
                command,
                args: profile.args.clone(),
                env,
                cwd: workspace,
                mode: profile.mode.clone(),
                resume_session: None,
            },
            turns_dir,
            session_id: self.session,
            turn_timeout: Duration::from_secs(self.turn_timeout.max(1)),
            start_timeout: Duration::from_secs(self.start_timeout.max(1)),
            kill_grace: Duration::from_secs(self.kill_grace),
            persist_dir: home.join(".sortie"),
            delivery,
        })
    }

    fn delivery(&self) -> Result<Option<DeliveryConfig>, LaunchError> {
        let Some(branch) = self.branch.clone() else {
            return Ok(None);
        };
        delivery::validate_branch(&branch).map_err(refused)?;
        let known_secrets = match &self.secret_digests {
            Some(path) => delivery::load_known_secrets(path).map_err(refused)?,
            None => KnownSecrets::default(),
        };
        Ok(Some(DeliveryConfig {
            branch,
            remote: self.remote.clone(),
            author_name: self.author_name.clone(),
            author_email: self.author_email.clone(),
            known_secrets: Arc::new(known_secrets),
            known_secrets_file: self.secret_digests.clone(),
            git_timeout: delivery::GIT_TIMEOUT,
            unreachable_wait: delivery::UNREACHABLE_WAIT,
            keep: self.kept_work.map(|outstanding| delivery::KeptWork {
                refname: sortie_protocol::ids::wip_ref(&self.session),
                outstanding: Arc::new(std::sync::atomic::AtomicBool::new(outstanding)),
            }),
        }))
    }
}

/// The agent's program: its install under `agents_dir`, else next to this binary, else on PATH.
fn find_command(profile: &AgentProfile, agents_dir: Option<&Path>, path: &str) -> Result<PathBuf, LaunchError> {
    let beside = std::env::current_exe()
        .ok()
        .and_then(|exe| exe.parent().map(ToOwned::to_owned));
    agents_dir
        .and_then(|dir| profile::installed_command(dir, profile))
        .or_else(|| profile::resolve_command(&profile.command, beside.as_deref(), Some(path)))
        .ok_or_else(|| LaunchError::AgentNotFound {
            agent: profile.id.clone(),
            command: profile.command.clone(),
            hint: profile::install_hint(profile),
        })
}

/// The listening socket the worker passed as stdin, taken over (its copy is close-on-exec) and stdin
/// pointed at /dev/null, so no child of the driver ever inherits the driver's socket.
fn listener_from_stdin() -> Result<tokio::net::UnixListener, LaunchError> {
    use std::os::fd::AsFd;
    let owned = std::io::stdin()
        .as_fd()
        .try_clone_to_owned()
        .map_err(failed("cannot take the driver socket from stdin"))?;
    let listener = std::os::unix::net::UnixListener::from(owned);
    // Not a listening Unix socket: a clear error instead of a driver that never answers.
    listener
        .local_addr()
        .map_err(failed("stdin is not the driver's listening socket"))?;
    listener
        .set_nonblocking(true)
        .map_err(failed("cannot serve the driver socket"))?;
    let null = std::fs::File::open("/dev/null").map_err(failed("cannot open /dev/null"))?;
    nix::unistd::dup2_stdin(&null).map_err(failed("cannot point stdin at /dev/null"))?;
    tokio::net::UnixListener::from_std(listener).map_err(failed("cannot serve the driver socket"))
}
