//! The worker role's settings in two stages: [`WorkerSettings`] is what the operator wrote (flags and
//! environment, parsed by clap, no I/O), [`WorkerSettings::resolve`] turns it into a [`Worker`] on
//! the local sandbox runtime after checking everything it can check once, at start, rather than as
//! a failure of every session.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use sortie_gateway::egress::policy::Cidr;
use sortie_gateway::egress::proxy::{Resolver, StaticResolver, SystemResolver};
use sortie_sandbox::local::{Keeper, LocalConfig, LocalRuntime};
use sortie_store::{KeyRing, Store};

use crate::{Worker, WorkerConfig};

/// The data dir of a server run as root: sandboxes run as an unprivileged uid that must reach the
/// work dir inside it, which a home (0700 on most systems) would not let it.
pub const SYSTEM_DATA_DIR: &str = "/var/lib/sortie";

/// The environment variables of the worker's settings.
pub mod env {
    /// Mirrors, session workspaces and homes, sandbox state (`--work-dir`); default `<data dir>/work`.
    pub const WORK_DIR: &str = "SORTIE_WORK_DIR";
    /// Live sandboxes per workspace; more turns wait in `queued` (`--sandboxes-per-workspace`).
    pub const SANDBOXES_PER_WORKSPACE: &str = "SORTIE_SANDBOXES_PER_WORKSPACE";
    /// Seconds a turn may run before `TURN_TIMEOUT` (`--turn-timeout`).
    pub const TURN_TIMEOUT: &str = "SORTIE_TURN_TIMEOUT";
    /// Seconds a warm sandbox may idle before its session is hibernated (`--idle-grace`).
    pub const IDLE_GRACE: &str = "SORTIE_IDLE_GRACE";
    /// Seconds the model proxy holds an agent's request at its session's token budget, waiting for a
    /// raise, before the turn ends `BUDGET_EXCEEDED` (`--budget-wait`).
    pub const BUDGET_WAIT: &str = "SORTIE_BUDGET_WAIT";
    /// What ended longer ago than this is pruned every hour (`--retention`, `30d`); unset: never.
    pub const RETENTION: &str = "SORTIE_RETENTION";
    /// Seconds a sandbox outlives `serve`, waiting to be adopted (`--sandbox-orphan-grace`).
    pub const SANDBOX_ORPHAN_GRACE: &str = "SORTIE_SANDBOX_ORPHAN_GRACE";
    /// MiB of each session's own disk, its `/workspace` and `$HOME` together (`--sandbox-disk-mib`);
    /// a sparse image, so a session costs only what it writes. Needs root; without it, no quota.
    pub const SANDBOX_DISK_MIB: &str = "SORTIE_SANDBOX_DISK_MIB";
    /// Seconds a setup script may run (`--setup-timeout`).
    pub const SETUP_TIMEOUT: &str = "SORTIE_SETUP_TIMEOUT";
    /// Hosts reachable during the setup phase only, comma-separated (`--setup-hosts`); default: the
    /// registries of the host's npm, pip, cargo and apt settings.
    pub const SETUP_HOSTS: &str = "SORTIE_SETUP_HOSTS";
    /// CIDRs the egress proxy may reach although private (an internal registry), comma-separated.
    pub const EGRESS_EXEMPT: &str = "SORTIE_EGRESS_EXEMPT";
    /// Fixed answers for the egress proxy's resolver, `name=ip` comma-separated (internal names; tests).
    pub const EGRESS_HOSTS: &str = "SORTIE_EGRESS_HOSTS";
    /// An agent manifest (TOML) adding or overriding profiles (`--agent-profiles`).
    pub const AGENT_PROFILES: &str = "SORTIE_AGENT_PROFILES";
    /// Where installed agents live (`--agents-dir`); default `<data dir>/agents`.
    pub const AGENTS_DIR: &str = "SORTIE_AGENTS_DIR";
    /// The host uid sandboxes run as when sortie runs as root (default 61000; needs no passwd entry).
    pub const SANDBOX_UID: &str = "SORTIE_SANDBOX_UID";
    /// Warm sandboxes kept started per agent, `agent=n` comma-separated (`--warm-sandboxes`; the local
    /// runtime's, as `SORTIE_WARM_POOL` is the Kubernetes runtime's pods).
    pub const WARM_SANDBOXES: &str = "SORTIE_WARM_SANDBOXES";
    /// How many repositories keep a workspace checked out ahead (`--primed-workspaces`; 0: none).
    pub const PRIMED_WORKSPACES: &str = "SORTIE_PRIMED_WORKSPACES";
    /// The model proxy's upstream for Anthropic (`--upstream-anthropic`).
    pub const UPSTREAM_ANTHROPIC: &str = "SORTIE_UPSTREAM_ANTHROPIC";
    /// The model proxy's upstream for OpenAI (`--upstream-openai`).
    pub const UPSTREAM_OPENAI: &str = "SORTIE_UPSTREAM_OPENAI";
    /// The model proxy's upstream for Gemini (`--upstream-gemini`).
    pub const UPSTREAM_GEMINI: &str = "SORTIE_UPSTREAM_GEMINI";
    /// PEM roots trusted for forges (`https://` repositories) besides the platform's (`--forge-ca-file`).
    pub const FORGE_CA_FILE: &str = "SORTIE_FORGE_CA_FILE";
    /// Where the worker serves its feed to gateways on other hosts, `ip:port` (`--feed-listen`).
    pub const FEED_LISTEN: &str = "SORTIE_FEED_LISTEN";
    /// The `http://host:port` gateways reach that listener at (`--feed-url`).
    pub const FEED_URL: &str = "SORTIE_FEED_URL";
}

/// How the worker role runs sandboxes, as the operator gave it.
#[derive(Clone, Debug, clap::Args)]
pub struct WorkerSettings {
    /// Mirrors, session workspaces and homes, sandbox state; default `<data dir>/work`.
    #[arg(long, env = env::WORK_DIR)]
    pub work_dir: Option<PathBuf>,
    /// Live sandboxes per workspace; more turns wait in `queued`.
    #[arg(long, env = env::SANDBOXES_PER_WORKSPACE, default_value_t = 4)]
    pub sandboxes_per_workspace: usize,
    /// Seconds a turn may run before it fails with TURN_TIMEOUT (never disabled).
    #[arg(long, env = env::TURN_TIMEOUT, default_value_t = 1800)]
    pub turn_timeout: u64,
    /// Seconds a warm sandbox may idle before its session is hibernated.
    #[arg(long, env = env::IDLE_GRACE, default_value_t = 600)]
    pub idle_grace: u64,
    /// Seconds an agent's request waits at its session's token budget for a raise; then the turn
    /// ends BUDGET_EXCEEDED with its work delivered.
    #[arg(long, env = env::BUDGET_WAIT, default_value_t = 900)]
    pub budget_wait: u64,
    /// Prune, every hour, the transcripts and directories of sessions that ended (or were archived)
    /// longer ago than this (`30d`), and mirrors unused as long: `sortie gc` on a timer. Unset: never.
    #[arg(long, env = env::RETENTION, value_parser = humantime::parse_duration)]
    pub retention: Option<Duration>,
    /// Seconds a setup script may run.
    #[arg(long, env = env::SETUP_TIMEOUT, default_value_t = 600)]
    pub setup_timeout: u64,
    /// MiB of each session's disk (its /workspace and $HOME together); writes past it fail with
    /// ENOSPC and the turn with DISK_QUOTA_EXCEEDED. At least 16.
    #[arg(long, env = env::SANDBOX_DISK_MIB, default_value_t = 10 * 1024, value_parser = clap::value_parser!(u64).range(16..))]
    pub sandbox_disk_mib: u64,
    /// Seconds a sandbox runs on after `serve` is gone, waiting for the next `serve` to adopt it.
    #[arg(long, env = env::SANDBOX_ORPHAN_GRACE, default_value_t = 120)]
    pub sandbox_orphan_grace: u64,
    /// Hosts reachable during the setup phase only; default: the host's package registries.
    #[arg(long, env = env::SETUP_HOSTS, value_delimiter = ',')]
    pub setup_hosts: Option<Vec<String>>,
    /// CIDRs the egress proxy may reach although private (an internal registry).
    #[arg(long, env = env::EGRESS_EXEMPT, value_delimiter = ',')]
    pub egress_exempt: Vec<String>,
    /// Fixed resolver answers for the egress proxy, `name=ip` (internal names).
    #[arg(long, env = env::EGRESS_HOSTS, value_delimiter = ',')]
    pub egress_hosts: Vec<String>,
    /// An agent manifest (TOML) adding or overriding profiles.
    #[arg(long, env = env::AGENT_PROFILES)]
    pub agent_profiles: Option<PathBuf>,
    /// The host uid sandboxes run as when sortie runs as root.
    #[arg(long, env = env::SANDBOX_UID, default_value_t = sortie_sandbox::local::DEFAULT_SANDBOX_UID)]
    pub sandbox_uid: u32,
    /// Sandboxes kept started for an agent, its driver up and awaiting a session, `AGENT=N` (e.g.
    /// `claude-code=2`; repeat or comma-separate for more agents). A session of that agent takes one
    /// and skips the sandbox's start. At most the workspace's sandbox limit in all; local runtime as
    /// root only. Default: none.
    #[arg(long, env = env::WARM_SANDBOXES, value_delimiter = ',', value_parser = parse_warm_sandboxes)]
    pub warm_sandboxes: Vec<(String, usize)>,
    /// For how many repositories (those sessions used last) a session disk is kept with the repository
    /// checked out, which the repository's next new session adopts instead of checking it out (on a
    /// large repository, most of the clone phase). Each costs the host's disk what its checkout holds.
    /// 0: none. Local runtime as root only.
    #[arg(long, env = env::PRIMED_WORKSPACES, default_value_t = crate::spares::PRIMED_WORKSPACES)]
    pub primed_workspaces: usize,
    /// Where `sortie agents install` put the agents; default `<data dir>/agents`.
    #[arg(long, env = env::AGENTS_DIR)]
    pub agents_dir: Option<PathBuf>,
    /// Where the model proxy sends Anthropic requests (default: Anthropic's public API).
    #[arg(long, env = env::UPSTREAM_ANTHROPIC)]
    pub upstream_anthropic: Option<String>,
    /// Where the model proxy sends OpenAI requests (default: OpenAI's public API).
    #[arg(long, env = env::UPSTREAM_OPENAI)]
    pub upstream_openai: Option<String>,
    /// Where the model proxy sends Gemini requests (default: Google's public Gemini API).
    #[arg(long, env = env::UPSTREAM_GEMINI)]
    pub upstream_gemini: Option<String>,
    /// PEM certificates trusted as roots for forges besides the platform's (an internal forge's CA).
    #[arg(long, env = env::FORGE_CA_FILE)]
    pub forge_ca_file: Option<PathBuf>,
    /// Serve the live copies of this worker's turns to gateways on other hosts (and `/metrics`,
    /// `/healthz`) on this address: replicas of the gateway then serve any live tail.
    #[arg(long, env = env::FEED_LISTEN)]
    pub feed_listen: Option<std::net::SocketAddr>,
    /// The `http://host:port` gateways reach the feed listener at; default `http://<--feed-listen>`
    /// when that names one address (an unspecified address, `0.0.0.0`, needs this).
    #[arg(long, env = env::FEED_URL, requires = "feed_listen")]
    pub feed_url: Option<String>,
}

/// Why the worker cannot start with these settings on this host.
#[derive(Debug, thiserror::Error)]
pub enum SettingsError {
    /// A setting is wrong, or the host lacks what it needs; the sentence says which and the fix.
    #[error("{0}")]
    Refused(String),
    #[error("{what}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
}

fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> SettingsError {
    let what = what.into();
    move |source| SettingsError::Io { what, source }
}

impl WorkerSettings {
    /// The address gateways reach the feed listener at, once it is bound at `bound`.
    pub fn advertised_feed(&self, bound: std::net::SocketAddr) -> Result<sortie_gateway::live::FeedUrl, SettingsError> {
        let text = match &self.feed_url {
            Some(url) => url.clone(),
            None if bound.ip().is_unspecified() => {
                return Err(SettingsError::Refused(format!(
                    "--feed-listen {bound} listens on every address: give --feed-url (or {}), the http://host:port \
                     gateways on other hosts reach this worker at",
                    env::FEED_URL
                )));
            }
            None => format!("http://{bound}"),
        };
        sortie_gateway::live::FeedUrl::parse(&text).map_err(|e| SettingsError::Refused(format!("--feed-url {e}")))
    }

    /// `--work-dir`, else `<data dir>/work`.
    pub fn work_dir(&self, data_dir: &Path) -> PathBuf {
        self.work_dir.clone().unwrap_or_else(|| data_dir.join("work"))
    }

    /// `--agents-dir`, else `<data dir>/agents`.
    pub fn agents_dir(&self, data_dir: &Path) -> PathBuf {
        self.agents_dir.clone().unwrap_or_else(|| data_dir.join("agents"))
    }

    /// The worker these settings describe, on the local sandbox runtime. `sortie_exe` is the binary
    /// the sandboxes run (the driver, the scripted agent and the sandbox keeper are in it).
    pub fn resolve(
        &self,
        data_dir: &Path,
        sortie_exe: PathBuf,
        store: Arc<dyn Store>,
        keyring: Arc<KeyRing>,
    ) -> Result<Worker, SettingsError> {
        use std::os::unix::fs::PermissionsExt;
        if !nix::unistd::geteuid().is_root() {
            return Err(SettingsError::Refused(
                "the worker runs sandboxes, which needs root: sortie joins each sandbox's cgroups and drops it to an \
                 unprivileged uid itself. Run `sudo sortie serve`, or `sortie serve --roles api,gateway` to serve \
                 without the worker (a worker elsewhere runs the sessions)"
                    .into(),
            ));
        }
        let work_dir = self.work_dir(data_dir);
        std::fs::create_dir_all(&work_dir).map_err(io(format!("cannot create {}", work_dir.display())))?;
        std::fs::set_permissions(&work_dir, std::fs::Permissions::from_mode(0o755))
            .map_err(io(format!("cannot open {} to the sandbox uid", work_dir.display())))?;
        let runtime = self.runtime(&work_dir, sortie_exe.clone())?;
        // Runs as root on the host, so this binary itself (not the sandboxes' copy).
        let git_launcher = sortie_gateway::git::config::GitLauncher {
            program: sortie_exe.clone(),
            args: vec!["git-launch".into()],
        };

        let mut exe = sortie_exe;
        if !runtime.is_reachable(&exe) {
            // The sandbox uid cannot reach where this binary lives (`~/.cargo/bin` under a 0700 home, a
            // private checkout): the sandboxes run a copy (the scripted agent is in it).
            let bin = work_dir.join("bin");
            std::fs::create_dir_all(&bin).map_err(io(format!("cannot create {}", bin.display())))?;
            std::fs::copy(&exe, bin.join("sortie")).map_err(io("cannot copy sortie for the sandboxes"))?;
            exe = bin.join("sortie");
        }

        let mut config = self.config(data_dir, work_dir, exe, keyring)?;
        config.git_launcher = Some(git_launcher);
        Ok(Worker::new(config, store, Arc::new(runtime)))
    }

    /// The worker these settings describe, its sandboxes pods claimed through `pods`
    /// (`--runtime kubernetes`): no root, no bubblewrap; its work dir holds the mirrors and the git
    /// proxies' state only.
    pub fn resolve_on_pods(
        &self,
        data_dir: &Path,
        store: Arc<dyn Store>,
        keyring: Arc<KeyRing>,
        pods: Arc<crate::pods::Pods>,
    ) -> Result<Worker, SettingsError> {
        let work_dir = self.work_dir(data_dir);
        std::fs::create_dir_all(&work_dir).map_err(io(format!("cannot create {}", work_dir.display())))?;
        // No sandbox binds anything of this host: the binary is the pods' image's.
        let exe = PathBuf::from("sortie");
        let config = self.config(data_dir, work_dir, exe, keyring)?;
        Ok(Worker::on_pods(config, store, pods))
    }

    fn config(
        &self,
        data_dir: &Path,
        work_dir: PathBuf,
        exe: PathBuf,
        keyring: Arc<KeyRing>,
    ) -> Result<WorkerConfig, SettingsError> {
        let mut config = WorkerConfig::new(work_dir, exe);
        config.sandboxes_per_workspace = self.sandboxes_per_workspace.max(1);
        config.turn_timeout = Duration::from_secs(self.turn_timeout.max(1));
        config.idle_grace = Duration::from_secs(self.idle_grace);
        config.retention = self.retention;
        config.budget_wait = Duration::from_secs(self.budget_wait);
        config.setup_timeout = Duration::from_secs(self.setup_timeout.max(1));
        config.limits.disk_bytes = self.sandbox_disk_mib << 20;
        config.agent_profiles = self.agent_profiles.clone();
        if !self.warm_sandboxes.is_empty() {
            let profiles = sortie_profile::load(self.agent_profiles.as_deref())
                .map_err(|error| SettingsError::Refused(format!("--warm-sandboxes: {error}")))?;
            for (agent, _) in &self.warm_sandboxes {
                sortie_profile::find(&profiles, agent)
                    .map_err(|error| SettingsError::Refused(format!("--warm-sandboxes {agent}: {error}")))?;
            }
            config.warm_pool = self.warm_sandboxes.clone();
        }
        config.primed_workspaces = self.primed_workspaces;
        config.agents_dir = Some(self.agents_dir(data_dir));
        config.keyring = Some(keyring);
        self.model_upstreams(&mut config.model_upstreams)?;
        self.forge_roots(&mut config)?;
        config.setup_hosts = match &self.setup_hosts {
            Some(hosts) => hosts.iter().filter(|h| !h.is_empty()).cloned().collect(),
            None => {
                let home = std::env::var_os("HOME").map(PathBuf::from).unwrap_or_default();
                sortie_gateway::egress::registries::from_host(&home)
            }
        };
        for text in self.egress_exempt.iter().filter(|t| !t.is_empty()) {
            let cidr = Cidr::parse(text)
                .ok_or_else(|| SettingsError::Refused(format!("--egress-exempt {text:?} is not an address or CIDR")))?;
            config.egress_exempt.push(cidr);
        }
        if let Some(table) = self.egress_table()? {
            config.resolver = Arc::new(TableFirst(table));
        }
        Ok(config)
    }

    /// The local runtime: bwrap as the operator's PATH names it, sandboxes kept by this
    /// binary so they outlive a restart of `serve`, and a work dir the sandbox uid can reach.
    fn runtime(&self, work_dir: &Path, sortie_exe: PathBuf) -> Result<LocalRuntime, SettingsError> {
        let mut local = LocalConfig::new(work_dir.join("state"));
        local.bwrap = crate::host::on_path("bwrap").unwrap_or_else(|| PathBuf::from("bwrap"));
        local.sandbox_uid = self.sandbox_uid;
        local.sandbox_gid = self.sandbox_uid;
        local.keeper = Some(Keeper {
            program: sortie_exe,
            args: vec!["sandbox".into(), "keep".into()],
            orphan_grace: Duration::from_secs(self.sandbox_orphan_grace.max(1)),
        });
        let runtime = LocalRuntime::new(local).map_err(|error| {
            SettingsError::Refused(format!(
                "the worker cannot run sandboxes on this host: {error} (`sortie doctor` says what is missing; \
                 `sortie serve --roles api,gateway` runs without the worker)"
            ))
        })?;
        if let Some(blocked) = runtime.unreachable_parent(&work_dir.join("sessions")) {
            return Err(SettingsError::Refused(format!(
                "the work dir {} is not reachable by the sandbox uid {}: {} is not searchable by it. Use the default \
                 data dir as root ({SYSTEM_DATA_DIR}), put --data-dir or --work-dir under a directory others may \
                 search, or `chmod o+x {}`",
                work_dir.display(),
                self.sandbox_uid,
                blocked.display(),
                blocked.display()
            )));
        }
        Ok(runtime)
    }

    fn model_upstreams(&self, upstreams: &mut sortie_gateway::model::Upstreams) -> Result<(), SettingsError> {
        let slots = [
            ("anthropic", &self.upstream_anthropic, &mut upstreams.anthropic),
            ("openai", &self.upstream_openai, &mut upstreams.openai),
            ("gemini", &self.upstream_gemini, &mut upstreams.gemini),
        ];
        for (api, value, slot) in slots {
            let Some(url) = value.as_ref().filter(|u| !u.is_empty()) else {
                continue;
            };
            if !(url.starts_with("https://") || url.starts_with("http://")) {
                return Err(SettingsError::Refused(format!(
                    "the {api} upstream {url:?} is not an http(s) URL"
                )));
            }
            slot.clone_from(url);
        }
        Ok(())
    }

    /// `--forge-ca-file`: the forge client trusts it besides the platform's roots, and host-side git
    /// gets one bundle of both (it takes a bundle instead of its own, so a missing platform bundle
    /// stops the start rather than the first clone).
    fn forge_roots(&self, config: &mut WorkerConfig) -> Result<(), SettingsError> {
        let Some(ca_file) = self.forge_ca_file.as_ref().filter(|p| !p.as_os_str().is_empty()) else {
            return Ok(());
        };
        let extra =
            std::fs::read(ca_file).map_err(io(format!("cannot read the forge CA file {}", ca_file.display())))?;
        let tls = sortie_gateway::git::http::ForgeTls {
            extra_roots_pem: extra.clone(),
        };
        let client = sortie_gateway::git::http::forge_client(&tls)
            .map_err(|error| SettingsError::Refused(format!("the forge CA file {}: {error}", ca_file.display())))?;
        config.forge_http = Some(client);
        let platform = std::env::var_os("SSL_CERT_FILE")
            .map(PathBuf::from)
            .unwrap_or_else(|| "/etc/ssl/certs/ca-certificates.crt".into());
        let mut bundle = std::fs::read(&platform).map_err(io(format!(
            "--forge-ca-file needs the platform's CA bundle at {} (set SSL_CERT_FILE to it)",
            platform.display()
        )))?;
        bundle.push(b'\n');
        bundle.extend_from_slice(&extra);
        let path = config.work_dir.join("forge-ca-bundle.pem");
        std::fs::write(&path, bundle).map_err(io(format!("cannot write {}", path.display())))?;
        config.forge_ca_bundle = Some(path);
        Ok(())
    }

    /// `--egress-hosts name=ip,…` as a resolver table, if any.
    fn egress_table(&self) -> Result<Option<StaticResolver>, SettingsError> {
        let mut table: HashMap<String, Vec<std::net::IpAddr>> = HashMap::new();
        for pair in self.egress_hosts.iter().filter(|t| !t.is_empty()) {
            let refused = || SettingsError::Refused(format!("--egress-hosts {pair:?} is not name=ip"));
            let (name, ip) = pair.split_once('=').ok_or_else(refused)?;
            let ip = ip
                .parse()
                .map_err(|_| SettingsError::Refused(format!("--egress-hosts {pair:?}: {ip:?} is not an IP address")))?;
            table.entry(name.to_ascii_lowercase()).or_default().push(ip);
        }
        Ok((!table.is_empty()).then_some(StaticResolver(table)))
    }
}

/// Fixed answers first (operator-configured internal names), then the host's resolver.
struct TableFirst(StaticResolver);

impl Resolver for TableFirst {
    fn resolve<'a>(
        &'a self,
        host: &'a str,
        port: u16,
    ) -> std::pin::Pin<Box<dyn Future<Output = std::io::Result<Vec<std::net::SocketAddr>>> + Send + 'a>> {
        Box::pin(async move {
            match self.0.resolve(host, port).await {
                Ok(found) => Ok(found),
                Err(_) => SystemResolver.resolve(host, port).await,
            }
        })
    }
}

/// One `--warm-sandboxes` entry: `agent=n`.
fn parse_warm_sandboxes(text: &str) -> Result<(String, usize), String> {
    let (agent, size) = text
        .split_once('=')
        .ok_or_else(|| format!("{text:?} is not AGENT=N (e.g. claude-code=2)"))?;
    let size = size
        .trim()
        .parse::<usize>()
        .map_err(|_| format!("{text:?}: {size:?} is not a number of sandboxes"))?;
    let agent = agent.trim();
    if agent.is_empty() {
        return Err(format!("{text:?} names no agent"));
    }
    Ok((agent.to_owned(), size))
}
