//! Agent profiles (DESIGN §6.3): how to start each agent. Built-in defaults, overridable and
//! extendable by an operator-owned TOML manifest:
//!
//! ```toml
//! [[agent]]
//! id = "my-agent"
//! command = "/opt/agents/my-agent"
//! args = ["--acp"]
//! env = { MY_AGENT_QUIET = "1" }
//! model_api = "anthropic"          # anthropic | openai | gemini | none
//! base_url_env = "ANTHROPIC_BASE_URL"
//! key_env = "ANTHROPIC_API_KEY"
//! mode = "bypassPermissions"
//! read_only_paths = ["/opt/agents"]
//! state_dirs = [".my-agent"]
//! npm_package = "my-agent@1.2.3"  # what `sortie agents install my-agent` installs
//! default_model = "some-model"
//! [[agent.files]]                  # written under $HOME before the agent starts
//! path = ".my-agent/config.json"
//! content = '{"baseUrl": "{model_base_url}", "model": "{model}"}'
//! ```
//!
//! Values of `args`, `env` and `files` may name `{model_base_url}` (the gateway's model proxy for the
//! profile's API, as the sandbox reaches it), `{model}` (the session's model, else `default_model`) and
//! `{api_key}` (a placeholder: the proxy replaces whatever key the agent sends; no key enters a sandbox).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::Deserialize;

/// Which vendor API an agent speaks (the gateway's model proxy injects that vendor's key).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ModelApi {
    Anthropic,
    Openai,
    Gemini,
    #[default]
    None,
}

#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AgentProfile {
    pub id: String,
    /// A program name (looked up on PATH, and next to the `sortie` binary) or an absolute path.
    pub command: String,
    #[serde(default)]
    pub args: Vec<String>,
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    #[serde(default)]
    pub model_api: ModelApi,
    /// The environment variable that carries the model API's base URL.
    #[serde(default)]
    pub base_url_env: Option<String>,
    /// The environment variable that carries the model API key (the sandbox only ever gets a placeholder).
    #[serde(default)]
    pub key_env: Option<String>,
    /// The ACP mode set after the session starts.
    #[serde(default)]
    pub mode: Option<String>,
    /// Paths the sandbox binds read-only for this agent (its install dir).
    #[serde(default)]
    pub read_only_paths: Vec<String>,
    /// Directories under $HOME that hold the agent's state (kept across hibernation, for `session/load`).
    #[serde(default)]
    pub state_dirs: Vec<String>,
    /// The pinned npm package `sortie agents install` puts under the data dir (`name@version`).
    #[serde(default)]
    pub npm_package: Option<String>,
    /// The model when the session names none.
    #[serde(default)]
    pub default_model: Option<String>,
    /// Files written under $HOME before the agent starts (its config pointing at the model proxy).
    #[serde(default)]
    pub files: Vec<BootstrapFile>,
}

/// A file a profile writes into the agent's $HOME.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BootstrapFile {
    /// Relative to $HOME; no `..`.
    pub path: String,
    pub content: String,
}

/// The key every agent is given: a placeholder the model proxy replaces with the workspace's key.
pub const API_KEY_PLACEHOLDER: &str = "sortie-proxy-injects-the-key";

/// What `{…}` in a profile's args, env and files stand for.
#[derive(Clone, Debug, Default)]
pub struct Render {
    /// The model proxy's base URL for all APIs (`…/_sortie/model`); the profile's API is appended.
    pub model_proxy: String,
    /// The session's model, if it named one.
    pub model: Option<String>,
}

impl AgentProfile {
    fn substitute(&self, text: &str, render: &Render) -> String {
        let api = match self.model_api {
            ModelApi::Anthropic => "anthropic",
            ModelApi::Openai => "openai",
            ModelApi::Gemini => "gemini",
            ModelApi::None => "none",
        };
        let model = render
            .model
            .clone()
            .or_else(|| self.default_model.clone())
            .unwrap_or_default();
        text.replace(
            "{model_base_url}",
            &format!("{}/{api}", render.model_proxy.trim_end_matches('/')),
        )
        .replace("{model}", &model)
        .replace("{api_key}", API_KEY_PLACEHOLDER)
    }

    /// The profile with every placeholder of its args, env and files filled in.
    pub fn rendered(&self, render: &Render) -> AgentProfile {
        let mut out = self.clone();
        out.args = self.args.iter().map(|a| self.substitute(a, render)).collect();
        out.env = self
            .env
            .iter()
            .map(|(k, v)| (k.clone(), self.substitute(v, render)))
            .collect();
        // A manifest agent may name its variables instead of spelling out their values.
        if let Some(name) = &self.base_url_env {
            out.env
                .entry(name.clone())
                .or_insert_with(|| self.substitute("{model_base_url}", render));
        }
        if let Some(name) = &self.key_env {
            out.env
                .entry(name.clone())
                .or_insert_with(|| API_KEY_PLACEHOLDER.to_owned());
        }
        out.files = self
            .files
            .iter()
            .map(|f| BootstrapFile {
                path: f.path.clone(),
                content: self.substitute(&f.content, render),
            })
            .collect();
        out
    }

    /// Writes the profile's files under `home` (no path may leave it).
    pub fn write_files(&self, home: &Path) -> std::io::Result<()> {
        for file in &self.files {
            let relative = Path::new(&file.path);
            if relative.is_absolute()
                || relative
                    .components()
                    .any(|c| matches!(c, std::path::Component::ParentDir))
            {
                return Err(std::io::Error::other(format!(
                    "profile file {:?} must stay under $HOME",
                    file.path
                )));
            }
            let path = home.join(relative);
            if let Some(parent) = path.parent() {
                std::fs::create_dir_all(parent)?;
            }
            std::fs::write(&path, &file.content)?;
        }
        Ok(())
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Manifest {
    #[serde(default)]
    agent: Vec<AgentProfile>,
}

#[derive(Debug, thiserror::Error)]
pub enum ProfileError {
    #[error("cannot read the agent manifest {path}: {source}")]
    Read { path: PathBuf, source: std::io::Error },
    #[error("the agent manifest {path} is not valid: {message}")]
    Invalid { path: PathBuf, message: String },
    #[error("no agent profile {id:?}; known: {known}")]
    Unknown { id: String, known: String },
}

fn base(id: &str, command: &str, model_api: ModelApi) -> AgentProfile {
    AgentProfile {
        id: id.to_owned(),
        command: command.to_owned(),
        args: Vec::new(),
        env: BTreeMap::new(),
        model_api,
        base_url_env: None,
        key_env: None,
        mode: None,
        read_only_paths: Vec::new(),
        state_dirs: Vec::new(),
        npm_package: None,
        default_model: None,
        files: Vec::new(),
    }
}

fn strings(items: &[&str]) -> Vec<String> {
    items.iter().map(|item| (*item).to_owned()).collect()
}

fn env(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
    pairs
        .iter()
        .map(|(key, value)| ((*key).to_owned(), (*value).to_owned()))
        .collect()
}

/// The profiles every install knows (facts in `ref/acp.md` §3): each points its agent at the model
/// proxy with a placeholder key and turns off the traffic the agent would otherwise make.
pub fn built_in() -> Vec<AgentProfile> {
    let some = |text: &str| Some(text.to_owned());
    vec![
        AgentProfile {
            env: env(&[
                ("ANTHROPIC_BASE_URL", "{model_base_url}"),
                ("ANTHROPIC_API_KEY", "{api_key}"),
                ("ANTHROPIC_MODEL", "{model}"),
                ("CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC", "1"),
                ("CLAUDE_CODE_ENABLE_PROMPT_SUGGESTION", "false"),
                ("DISABLE_AUTOUPDATER", "1"),
                ("DISABLE_TELEMETRY", "1"),
                ("DISABLE_ERROR_REPORTING", "1"),
            ]),
            base_url_env: some("ANTHROPIC_BASE_URL"),
            key_env: some("ANTHROPIC_API_KEY"),
            mode: some("bypassPermissions"),
            state_dirs: strings(&[".claude"]),
            npm_package: some("@agentclientprotocol/claude-agent-acp@0.101.0"),
            default_model: some("claude-sonnet-4-5"),
            ..base("claude-code", "claude-agent-acp", ModelApi::Anthropic)
        },
        AgentProfile {
            env: env(&[("NO_BROWSER", "1"), ("OPENAI_API_KEY", "{api_key}")]),
            key_env: some("OPENAI_API_KEY"),
            mode: some("agent-full-access"),
            state_dirs: strings(&[".codex"]),
            npm_package: some("@agentclientprotocol/codex-acp@2.6.0"),
            default_model: some("gpt-5.5"),
            files: vec![BootstrapFile {
                path: ".codex/config.toml".into(),
                content:
                    "model = \"{model}\"\nmodel_provider = \"sortie\"\n\n[model_providers.sortie]\nname = \"sortie\"\n\
                          base_url = \"{model_base_url}/v1\"\nenv_key = \"OPENAI_API_KEY\"\nwire_api = \"responses\"\n"
                        .into(),
            }],
            ..base("codex", "codex-acp", ModelApi::Openai)
        },
        AgentProfile {
            args: strings(&["--acp", "--model", "{model}"]),
            env: env(&[
                ("GOOGLE_GEMINI_BASE_URL", "{model_base_url}"),
                ("GEMINI_API_KEY", "{api_key}"),
            ]),
            base_url_env: some("GOOGLE_GEMINI_BASE_URL"),
            key_env: some("GEMINI_API_KEY"),
            mode: some("yolo"),
            state_dirs: strings(&[".gemini"]),
            npm_package: some("@google/gemini-cli@0.61.0"),
            default_model: some("gemini-2.5-pro"),
            files: vec![BootstrapFile {
                path: ".gemini/settings.json".into(),
                content: "{\"privacy\": {\"usageStatisticsEnabled\": false}}\n".into(),
            }],
            ..base("gemini", "gemini", ModelApi::Gemini)
        },
        AgentProfile {
            args: strings(&["acp"]),
            env: env(&[
                ("OPENCODE_DISABLE_AUTOUPDATE", "1"),
                ("OPENCODE_DISABLE_MODELS_FETCH", "1"),
                ("OPENCODE_DISABLE_DEFAULT_PLUGINS", "1"),
                (
                    "OPENCODE_CONFIG_CONTENT",
                    "{\"model\": \"anthropic/{model}\", \"small_model\": \"anthropic/{model}\", \"autoupdate\": false, \
                     \"share\": \"disabled\", \"provider\": {\"anthropic\": {\"options\": {\"baseURL\": \"{model_base_url}/v1\", \
                     \"apiKey\": \"{api_key}\"}}}}",
                ),
            ]),
            state_dirs: strings(&[".local/share/opencode"]),
            npm_package: some("opencode-ai@1.18.33"),
            default_model: some("claude-sonnet-4-5"),
            ..base("opencode", "opencode", ModelApi::Anthropic)
        },
        AgentProfile {
            // Built into the `sortie` binary, so an install of sortie alone can run it.
            args: strings(&["scripted-agent"]),
            mode: some("yolo"),
            state_dirs: strings(&[".scripted-agent"]),
            ..base("scripted", "sortie", ModelApi::None)
        },
    ]
}

/// The built-in profiles, with those of `manifest` (if any) replacing same-id ones and adding new ones.
pub fn load(manifest: Option<&Path>) -> Result<Vec<AgentProfile>, ProfileError> {
    let mut profiles = built_in();
    if let Some(path) = manifest {
        let text = std::fs::read_to_string(path).map_err(|source| ProfileError::Read {
            path: path.to_owned(),
            source,
        })?;
        let parsed: Manifest = toml::from_str(&text).map_err(|error| ProfileError::Invalid {
            path: path.to_owned(),
            message: error.to_string(),
        })?;
        for profile in parsed.agent {
            if !sortie_protocol::agents::is_well_formed_agent_id(&profile.id) {
                return Err(ProfileError::Invalid {
                    path: path.to_owned(),
                    message: format!("agent id {:?} is not lowercase letters, digits and hyphens", profile.id),
                });
            }
            profiles.retain(|p| p.id != profile.id);
            profiles.push(profile);
        }
    }
    Ok(profiles)
}

/// The profile `id`, or an error naming the known ones.
pub fn find(profiles: &[AgentProfile], id: &str) -> Result<AgentProfile, ProfileError> {
    profiles
        .iter()
        .find(|p| p.id == id)
        .cloned()
        .ok_or_else(|| ProfileError::Unknown {
            id: id.to_owned(),
            known: profiles.iter().map(|p| p.id.as_str()).collect::<Vec<_>>().join(", "),
        })
}

/// Where `sortie agents install` puts a profile's npm package: `<agents_dir>/<id>`; its programs are in
/// `node_modules/.bin` there.
pub fn install_dir(agents_dir: &Path, id: &str) -> PathBuf {
    agents_dir.join(id)
}

/// The installed program of `profile` under `agents_dir`, if it is installed there.
pub fn installed_command(agents_dir: &Path, profile: &AgentProfile) -> Option<PathBuf> {
    let candidate = install_dir(agents_dir, &profile.id)
        .join("node_modules/.bin")
        .join(&profile.command);
    candidate.exists().then_some(candidate)
}

/// Where this host runs `agent` from: its install under `agents_dir`, else its command next to the
/// running binary or on PATH; `None` when it has none (what `agents list` and `/v1/agents` report).
pub fn locate(agents_dir: &Path, agent: &AgentProfile) -> Option<PathBuf> {
    let path = std::env::var("PATH").unwrap_or_default();
    let beside = std::env::current_exe()
        .ok()
        .and_then(|exe| exe.parent().map(ToOwned::to_owned));
    installed_command(agents_dir, agent).or_else(|| resolve_command(&agent.command, beside.as_deref(), Some(&path)))
}

/// What a host without `agent` does to get it.
pub fn install_hint(agent: &AgentProfile) -> String {
    match &agent.npm_package {
        Some(_) => format!("sortie agents install {}", agent.id),
        None => format!("put {} on PATH", agent.command),
    }
}

/// The model key `agent` needs, as a person would be told.
pub fn needs(agent: &AgentProfile) -> &'static str {
    match agent.model_api {
        ModelApi::Anthropic => "an anthropic key (sortie keys set anthropic)",
        ModelApi::Openai => "an openai key (sortie keys set openai)",
        ModelApi::Gemini => "a gemini key (sortie keys set gemini)",
        ModelApi::None => "no model key",
    }
}

/// A pinned npm spec split into package name and version: `@scope/name@1.2.3` → (`@scope/name`, `1.2.3`).
pub fn split_npm_spec(spec: &str) -> (&str, Option<&str>) {
    match spec.get(1..).and_then(|rest| rest.rfind('@')) {
        Some(at) => (&spec[..at + 1], Some(&spec[at + 2..])),
        None => (spec, None),
    }
}

/// The version of `profile`'s npm package installed under `agents_dir`, read from its `package.json`.
pub fn installed_version(agents_dir: &Path, profile: &AgentProfile) -> Option<String> {
    let (name, _) = split_npm_spec(profile.npm_package.as_deref()?);
    let manifest = install_dir(agents_dir, &profile.id)
        .join("node_modules")
        .join(name)
        .join("package.json");
    let manifest: serde_json::Value = serde_json::from_slice(&std::fs::read(manifest).ok()?).ok()?;
    manifest["version"].as_str().map(ToOwned::to_owned)
}

/// Whether the install under `agents_dir` is another version than the profile pins (a pin changed
/// since `sortie agents install` ran): the install should run again.
pub fn install_outdated(agents_dir: &Path, profile: &AgentProfile) -> bool {
    let pinned = profile.npm_package.as_deref().and_then(|spec| split_npm_spec(spec).1);
    match (pinned, installed_version(agents_dir, profile)) {
        (Some(pinned), Some(installed)) => pinned != installed,
        (Some(_), None) => installed_command(agents_dir, profile).is_some(),
        (None, _) => false,
    }
}

/// Resolves a profile's command: an absolute path as is; a bare name next to `beside` (the running
/// binary's directory) first, then on `path` (a PATH value).
pub fn resolve_command(command: &str, beside: Option<&Path>, path: Option<&str>) -> Option<PathBuf> {
    let candidate = Path::new(command);
    if candidate.is_absolute() {
        return candidate.is_file().then(|| candidate.to_owned());
    }
    let dirs = beside.map(Path::to_owned).into_iter().chain(
        path.unwrap_or_default()
            .split(':')
            .filter(|d| !d.is_empty())
            .map(PathBuf::from),
    );
    dirs.map(|dir| dir.join(command)).find(|full| full.is_file())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn npm_specs_split_into_name_and_version() {
        assert_eq!(
            split_npm_spec("@agentclientprotocol/codex-acp@2.6.0"),
            ("@agentclientprotocol/codex-acp", Some("2.6.0"))
        );
        assert_eq!(split_npm_spec("opencode-ai@1.18.33"), ("opencode-ai", Some("1.18.33")));
        assert_eq!(split_npm_spec("@scope/unpinned"), ("@scope/unpinned", None));
        assert_eq!(split_npm_spec("plain"), ("plain", None));
        assert_eq!(split_npm_spec(""), ("", None));
    }

    #[test]
    fn an_install_of_another_version_than_the_pin_is_outdated() {
        let dir = tempfile::tempdir().expect("temp");
        let mut agent = find(&built_in(), "opencode").expect("opencode");
        assert!(
            !install_outdated(dir.path(), &agent),
            "nothing installed is not outdated"
        );
        let package = install_dir(dir.path(), "opencode").join("node_modules/opencode-ai");
        std::fs::create_dir_all(&package).expect("dirs");
        std::fs::write(
            package.join("package.json"),
            r#"{"name":"opencode-ai","version":"1.18.33"}"#,
        )
        .expect("write");
        agent.npm_package = Some("opencode-ai@1.18.33".into());
        assert_eq!(installed_version(dir.path(), &agent).as_deref(), Some("1.18.33"));
        assert!(!install_outdated(dir.path(), &agent));
        agent.npm_package = Some("opencode-ai@1.19.0".into());
        assert!(install_outdated(dir.path(), &agent));
    }

    #[test]
    fn built_ins_cover_the_protocol_list() {
        let ids: Vec<String> = built_in().into_iter().map(|p| p.id).collect();
        for id in sortie_protocol::agents::BUILT_IN_AGENTS {
            assert!(ids.contains(&(*id).to_owned()), "{id}");
        }
    }

    #[test]
    fn a_manifest_overrides_and_adds_profiles() {
        let dir = tempfile::tempdir().expect("temp");
        let path = dir.path().join("agents.toml");
        std::fs::write(&path, "[[agent]]\nid = \"scripted\"\ncommand = \"/opt/x\"\n\n[[agent]]\nid = \"mine\"\ncommand = \"mine\"\nargs = [\"--acp\"]\nenv = { A = \"1\" }\nmodel_api = \"openai\"\n").expect("write");
        let profiles = load(Some(&path)).expect("load");
        assert_eq!(find(&profiles, "scripted").expect("scripted").command, "/opt/x");
        let mine = find(&profiles, "mine").expect("mine");
        assert_eq!(
            (mine.args.clone(), mine.model_api, mine.env.get("A").cloned()),
            (vec!["--acp".to_owned()], ModelApi::Openai, Some("1".to_owned()))
        );
        assert!(matches!(find(&profiles, "nope"), Err(ProfileError::Unknown { .. })));
        std::fs::write(&path, "[[agent]]\nid = \"Bad Id\"\ncommand = \"x\"\n").expect("write");
        assert!(matches!(load(Some(&path)), Err(ProfileError::Invalid { .. })));
        std::fs::write(&path, "[[agent]]\nid = \"x\"\ncommand = \"x\"\nsurprise = 1\n").expect("write");
        assert!(matches!(load(Some(&path)), Err(ProfileError::Invalid { .. })));
    }

    #[test]
    fn a_manifest_agent_that_names_its_variables_gets_the_proxy_and_the_placeholder() {
        let dir = tempfile::tempdir().expect("temp");
        let path = dir.path().join("agents.toml");
        std::fs::write(
            &path,
            "[[agent]]\nid = \"mine\"\ncommand = \"mine\"\nmodel_api = \"openai\"\nbase_url_env = \"MINE_URL\"\n\
             key_env = \"MINE_KEY\"\nenv = { MINE_KEY = \"{api_key}\", OTHER = \"2\" }\nread_only_paths = [\"/opt/mine\"]\n",
        )
        .expect("write");
        let render = Render {
            model_proxy: "http://127.0.0.1:3128/_sortie/model".into(),
            model: None,
        };
        let mine = find(&load(Some(&path)).expect("load"), "mine")
            .expect("mine")
            .rendered(&render);
        assert_eq!(
            mine.env.get("MINE_URL").map(String::as_str),
            Some("http://127.0.0.1:3128/_sortie/model/openai")
        );
        assert_eq!(mine.env.get("MINE_KEY").map(String::as_str), Some(API_KEY_PLACEHOLDER));
        assert_eq!(mine.env.get("OTHER").map(String::as_str), Some("2"));
        assert_eq!(mine.read_only_paths, vec!["/opt/mine".to_owned()]);
    }

    #[test]
    fn profiles_point_agents_at_the_model_proxy_with_a_placeholder_key() {
        let render = Render {
            model_proxy: "http://127.0.0.1:3128/_sortie/model".into(),
            model: None,
        };
        let profiles = built_in();
        let claude = find(&profiles, "claude-code").expect("claude").rendered(&render);
        assert_eq!(
            claude.env.get("ANTHROPIC_BASE_URL").map(String::as_str),
            Some("http://127.0.0.1:3128/_sortie/model/anthropic")
        );
        assert_eq!(
            claude.env.get("ANTHROPIC_API_KEY").map(String::as_str),
            Some(API_KEY_PLACEHOLDER)
        );
        assert_eq!(
            claude.env.get("ANTHROPIC_MODEL").map(String::as_str),
            Some("claude-sonnet-4-5")
        );
        let codex = find(&profiles, "codex").expect("codex").rendered(&Render {
            model: Some("gpt-x".into()),
            ..render.clone()
        });
        let config = &codex.files[0].content;
        assert!(
            config.contains("base_url = \"http://127.0.0.1:3128/_sortie/model/openai/v1\""),
            "{config}"
        );
        assert!(config.contains("model = \"gpt-x\""), "{config}");
        let gemini = find(&profiles, "gemini").expect("gemini").rendered(&render);
        assert_eq!(gemini.args, vec!["--acp", "--model", "gemini-2.5-pro"]);
        let opencode = find(&profiles, "opencode").expect("opencode").rendered(&render);
        let content: serde_json::Value =
            serde_json::from_str(opencode.env.get("OPENCODE_CONFIG_CONTENT").expect("config")).expect("json");
        assert_eq!(
            content["provider"]["anthropic"]["options"]["baseURL"],
            "http://127.0.0.1:3128/_sortie/model/anthropic/v1"
        );
        for profile in &profiles {
            let rendered = profile.rendered(&render);
            let all = format!("{:?}{:?}{:?}", rendered.args, rendered.env, rendered.files);
            assert!(!all.contains("{model") && !all.contains("{api_key}"), "{all}");
        }
    }

    #[test]
    fn bootstrap_files_stay_under_home() {
        let dir = tempfile::tempdir().expect("temp");
        let mut profile = base("x", "x", ModelApi::None);
        profile.files = vec![BootstrapFile {
            path: "../escape".into(),
            content: String::new(),
        }];
        assert!(profile.write_files(dir.path()).is_err());
        profile.files[0].path = ".x/config".into();
        profile.write_files(dir.path()).expect("write");
        assert!(dir.path().join(".x/config").is_file());
    }

    #[test]
    fn commands_resolve_beside_the_binary_then_on_path() {
        let dir = tempfile::tempdir().expect("temp");
        let beside = dir.path().join("bin");
        let on_path = dir.path().join("path");
        std::fs::create_dir_all(&beside).expect("dir");
        std::fs::create_dir_all(&on_path).expect("dir");
        std::fs::write(on_path.join("tool"), "").expect("write");
        let path_value = on_path.to_string_lossy().into_owned();
        assert_eq!(
            resolve_command("tool", Some(&beside), Some(&path_value)),
            Some(on_path.join("tool"))
        );
        std::fs::write(beside.join("tool"), "").expect("write");
        assert_eq!(
            resolve_command("tool", Some(&beside), Some(&path_value)),
            Some(beside.join("tool"))
        );
        assert_eq!(resolve_command("missing", Some(&beside), Some(&path_value)), None);
    }
}
