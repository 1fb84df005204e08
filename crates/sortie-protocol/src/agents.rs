//! The built-in agent ids (DESIGN §6.3). Operators can add more through a profile manifest; the server
//! checks a requested agent against the ids it knows.

/// The agent used when a request names none and the operator configured no other default.
pub const DEFAULT_AGENT: &str = "claude-code";

/// Agents every install knows.
pub const BUILT_IN_AGENTS: &[&str] = &["claude-code", "codex", "gemini", "opencode", "scripted"];

/// Whether `id` is well formed for an agent id: lowercase letters, digits and hyphens, 1 to 64 bytes.
/// Well formed is not known: the server also checks its profile list.
pub fn is_well_formed_agent_id(id: &str) -> bool {
    (1..=64).contains(&id.len())
        && id
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !id.starts_with('-')
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn built_ins_are_well_formed_and_include_the_default() {
        assert!(BUILT_IN_AGENTS.contains(&DEFAULT_AGENT));
        assert!(BUILT_IN_AGENTS.iter().all(|id| is_well_formed_agent_id(id)));
        assert!(!is_well_formed_agent_id("Claude"));
        assert!(!is_well_formed_agent_id(""));
        assert!(!is_well_formed_agent_id("-x"));
    }
}
