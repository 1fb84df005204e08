//! Priming a fresh agent process with the session's earlier context (DESIGN §6.4): pure, the turn
//! says what it knows and gets the rung and the prompt to send.

pub use sortie_protocol::driver::{PrimingContext, PrimingRung as Rung};

/// Where the agent process of a turn came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AgentOrigin {
    /// The process was started for this turn.
    pub fresh: bool,
    /// An earlier ACP session was known (persisted, or of an earlier process of this driver).
    pub had_session: bool,
    /// `session/load` of it succeeded.
    pub loaded: bool,
}

/// The rung for turn `n` and the prompt to send. `None`: the agent is warm, or it is the session's
/// first turn on its first agent; the prompt is sent as it is.
pub fn prime(n: u32, origin: AgentOrigin, context: &PrimingContext, prompt: &str) -> (Option<Rung>, String) {
    if !origin.fresh || (n <= 1 && !origin.had_session) {
        return (None, prompt.to_owned());
    }
    if origin.loaded {
        return (Some(Rung::SessionLoad), prompt.to_owned());
    }
    let given = |text: &Option<String>| text.as_deref().filter(|t| !t.trim().is_empty()).map(str::to_owned);
    if let Some(preamble) = given(&context.preamble) {
        // Marked, so that the agent takes it as context and not as the user's new message.
        let primed = format!(
            "<sortie-context>\nThe conversation so far in this session, for context (not a new request):\n\
             {}\n</sortie-context>\n\n{prompt}",
            preamble.trim_end()
        );
        return (Some(Rung::Transcript), primed);
    }
    if let Some(task) = given(&context.task) {
        return (
            Some(Rung::Task),
            format!("Original task:\n{}\n\nNow: {prompt}", task.trim_end()),
        );
    }
    (Some(Rung::None), prompt.to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_rung_that_applies_wins() {
        let origin = |fresh, had_session, loaded| AgentOrigin {
            fresh,
            had_session,
            loaded,
        };
        let both = PrimingContext {
            preamble: Some("user: a\nassistant: b\n".into()),
            task: Some("the task".into()),
        };
        let task_only = PrimingContext {
            preamble: Some("  ".into()),
            task: Some("the task".into()),
        };
        let nothing = PrimingContext::default();
        let transcript = "<sortie-context>\nThe conversation so far in this session, for context (not a new \
                          request):\nuser: a\nassistant: b\n</sortie-context>\n\nnext";
        let cases: Vec<(u32, AgentOrigin, &PrimingContext, Option<Rung>, &str)> = vec![
            (1, origin(true, false, false), &both, None, "next"),
            (2, origin(false, true, false), &both, None, "next"),
            (5, origin(false, true, true), &both, None, "next"),
            (2, origin(true, true, true), &both, Some(Rung::SessionLoad), "next"),
            (1, origin(true, true, true), &both, Some(Rung::SessionLoad), "next"),
            (2, origin(true, true, false), &both, Some(Rung::Transcript), transcript),
            (2, origin(true, false, false), &both, Some(Rung::Transcript), transcript),
            (1, origin(true, true, false), &both, Some(Rung::Transcript), transcript),
            (
                3,
                origin(true, false, false),
                &task_only,
                Some(Rung::Task),
                "Original task:\nthe task\n\nNow: next",
            ),
            (3, origin(true, false, false), &nothing, Some(Rung::None), "next"),
        ];
        for (n, origin, context, rung, prompt) in cases {
            assert_eq!(
                prime(n, origin, context, "next"),
                (rung, prompt.to_owned()),
                "turn {n} {origin:?} {context:?}"
            );
        }
    }
}
