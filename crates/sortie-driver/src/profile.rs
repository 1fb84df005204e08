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
//! ```

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

/// The profiles every install knows (facts in `ref/acp.md` §3).
pub fn built_in() -> Vec<AgentProfile> {
    let some = |text: &str| Some(text.to_owned());
    vec![
        AgentProfile {
            env: env(&[
                ("CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC", "1"),
                ("CLAUDE_CODE_ENABLE_PROMPT_SUGGESTION", "false"),
                ("DISABLE_AUTOUPDATER", "1"),
            ]),
            base_url_env: some("ANTHROPIC_BASE_URL"),
            key_env: some("ANTHROPIC_API_KEY"),
            mode: some("bypassPermissions"),
            state_dirs: strings(&[".claude"]),
            ..base("claude-code", "claude-agent-acp", ModelApi::Anthropic)
        },
        AgentProfile {
            env: env(&[("NO_BROWSER", "1")]),
            key_env: some("OPENAI_API_KEY"),
            mode: some("agent-full-access"),
            state_dirs: strings(&[".codex"]),
            ..base("codex", "codex-acp", ModelApi::Openai)
        },
        AgentProfile {
            args: strings(&["--acp"]),
            base_url_env: some("GOOGLE_GEMINI_BASE_URL"),
            key_env: some("GEMINI_API_KEY"),
            mode: some("yolo"),
            state_dirs: strings(&[".gemini"]),
            ..base("gemini", "gemini", ModelApi::Gemini)
        },
        AgentProfile {
            args: strings(&["acp"]),
            env: env(&[
                ("OPENCODE_DISABLE_AUTOUPDATE", "1"),
                ("OPENCODE_DISABLE_MODELS_FETCH", "1"),
            ]),
            state_dirs: strings(&[".local/share/opencode"]),
            ..base("opencode", "opencode", ModelApi::Anthropic)
        },
        AgentProfile {
            mode: some("yolo"),
            state_dirs: strings(&[".scripted-agent"]),
            ..base("scripted", "sortie-scripted-agent", ModelApi::None)
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
