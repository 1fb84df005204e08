//! Session phases and turn statuses (DESIGN §4.1) with their transition rules as data.
//!
//! The store applies every change as a compare-and-set (`UPDATE … WHERE phase = $expected`), and only
//! for pairs these tables allow, so two workers, a cancel racing a dispatch or a replayed callback all
//! converge on one history.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// Where a session is in its life.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum SessionPhase {
    /// A turn waits for a worker or for sandbox capacity.
    Queued,
    /// A worker is creating the sandbox, cloning and running the setup script.
    Provisioning,
    /// The agent is working on a turn.
    Running,
    /// The turn's work is being committed, scanned and pushed.
    Delivering,
    /// No turn runs; the sandbox is warm, so a steer starts at once.
    Idle,
    /// A finished session's sandbox was released; the workspace and agent state are kept for a later
    /// steer or resume.
    Hibernated,
    /// The last turn failed; a steer retries.
    Failed,
    /// Canceled by the user while a turn was in flight: the worker stops it, delivers what it did and
    /// tears the sandbox down, then says `canceled`.
    Canceling,
    /// Ended by the user; whatever work there was is on the branch. Terminal.
    Canceled,
}

impl SessionPhase {
    pub const ALL: [SessionPhase; 9] = [
        Self::Queued,
        Self::Provisioning,
        Self::Running,
        Self::Delivering,
        Self::Idle,
        Self::Hibernated,
        Self::Failed,
        Self::Canceling,
        Self::Canceled,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Queued => "queued",
            Self::Provisioning => "provisioning",
            Self::Running => "running",
            Self::Delivering => "delivering",
            Self::Idle => "idle",
            Self::Hibernated => "hibernated",
            Self::Failed => "failed",
            Self::Canceling => "canceling",
            Self::Canceled => "canceled",
        }
    }

    /// No transition leaves a terminal phase.
    pub fn is_terminal(self) -> bool {
        self == Self::Canceled
    }

    /// Whether a turn of the session is active: waiting, being provisioned, running or delivering.
    pub fn has_active_turn(self) -> bool {
        matches!(
            self,
            Self::Queued | Self::Provisioning | Self::Running | Self::Delivering | Self::Canceling
        )
    }

    /// Whether `self → to` is a legal session transition.
    pub fn can_become(self, to: SessionPhase) -> bool {
        SESSION_TRANSITIONS.contains(&(self, to))
    }

    /// The phase after a steer adds a turn, or `None` if the session takes no more turns. A session
    /// with a turn in flight keeps its phase (the new turn waits behind); a resting one queues.
    pub fn after_steer(self) -> Option<SessionPhase> {
        match self {
            Self::Queued | Self::Provisioning | Self::Running | Self::Delivering => Some(self),
            Self::Idle | Self::Hibernated | Self::Failed => Some(Self::Queued),
            Self::Canceling | Self::Canceled => None,
        }
    }
}

/// Every legal session transition. Anything not listed is refused.
pub const SESSION_TRANSITIONS: &[(SessionPhase, SessionPhase)] = {
    use SessionPhase::*;
    &[
        // A worker claims the waiting turn: cold (provision a sandbox) or warm (sandbox still up).
        (Queued, Provisioning),
        (Queued, Running),
        (Queued, Canceled),
        (Provisioning, Running),
        // A resume without a prompt ends provisioning with a warm, idle sandbox.
        (Provisioning, Idle),
        // Capacity vanished or the worker lost its claim: the turn waits again.
        (Provisioning, Queued),
        (Provisioning, Failed),
        (Provisioning, Canceled),
        (Provisioning, Canceling),
        (Running, Delivering),
        (Running, Failed),
        (Running, Canceled),
        (Running, Canceling),
        (Delivering, Idle),
        // Another turn was queued behind the one just delivered.
        (Delivering, Queued),
        (Delivering, Failed),
        (Delivering, Canceled),
        (Delivering, Canceling),
        // A steer (or a resume of a hibernated session) queues a turn.
        (Idle, Queued),
        (Idle, Hibernated),
        (Idle, Canceled),
        (Hibernated, Queued),
        (Hibernated, Canceled),
        (Failed, Queued),
        // A failed session stays failed when its sandbox is released (the view says so apart).
        (Failed, Canceled),
        // The canceled turn's delivery and teardown are done.
        (Canceling, Canceled),
    ]
};

impl fmt::Display for SessionPhase {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A string that names no phase or status.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown {kind} {value:?}")]
pub struct UnknownName {
    pub kind: &'static str,
    pub value: String,
}

impl FromStr for SessionPhase {
    type Err = UnknownName;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::ALL
            .into_iter()
            .find(|phase| phase.as_str() == s)
            .ok_or_else(|| UnknownName {
                kind: "phase",
                value: s.to_owned(),
            })
    }
}

/// Where a turn is in its life.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum TurnStatus {
    /// Written by the api; waits for a worker.
    Accepted,
    /// A worker claimed it; the agent works on it (this covers provisioning and delivery too).
    Running,
    /// The agent finished and the work was delivered.
    Completed,
    /// The turn failed; the session's `failure` says why.
    Failed,
    /// Stopped by the user; work so far was delivered.
    Stopped,
    /// The session was canceled before or while this turn ran.
    Canceled,
    /// Its worker or sandbox vanished and recovery could not finish it.
    Lost,
}

impl TurnStatus {
    pub const ALL: [TurnStatus; 7] = [
        Self::Accepted,
        Self::Running,
        Self::Completed,
        Self::Failed,
        Self::Stopped,
        Self::Canceled,
        Self::Lost,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Accepted => "accepted",
            Self::Running => "running",
            Self::Completed => "completed",
            Self::Failed => "failed",
            Self::Stopped => "stopped",
            Self::Canceled => "canceled",
            Self::Lost => "lost",
        }
    }

    pub fn is_terminal(self) -> bool {
        !matches!(self, Self::Accepted | Self::Running)
    }

    /// Whether `self → to` is a legal turn transition.
    pub fn can_become(self, to: TurnStatus) -> bool {
        TURN_TRANSITIONS.contains(&(self, to))
    }
}

/// Every legal turn transition. Anything not listed is refused.
pub const TURN_TRANSITIONS: &[(TurnStatus, TurnStatus)] = {
    use TurnStatus::*;
    &[
        (Accepted, Running),
        (Accepted, Canceled),
        // Claimed, but its worker stopped before the agent was given the prompt: it waits again.
        (Running, Accepted),
        (Running, Completed),
        (Running, Failed),
        (Running, Stopped),
        (Running, Canceled),
        (Running, Lost),
    ]
};

impl fmt::Display for TurnStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for TurnStatus {
    type Err = UnknownName;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::ALL
            .into_iter()
            .find(|status| status.as_str() == s)
            .ok_or_else(|| UnknownName {
                kind: "turn status",
                value: s.to_owned(),
            })
    }
}

/// How a steer treats a running turn.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum TurnMode {
    /// Wait for the running turn to finish (the first turn of a session is always `queue`).
    #[default]
    Queue,
    /// Stop the running turn first, then run this one.
    Interrupt,
}

impl TurnMode {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Queue => "queue",
            Self::Interrupt => "interrupt",
        }
    }
}

impl FromStr for TurnMode {
    type Err = UnknownName;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "queue" => Ok(Self::Queue),
            "interrupt" => Ok(Self::Interrupt),
            _ => Err(UnknownName {
                kind: "turn mode",
                value: s.to_owned(),
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use SessionPhase as P;
    use TurnStatus as T;

    /// The expected answer for every pair, written out in full so that a change to the table is a
    /// change to this test too.
    fn expected_session(from: P, to: P) -> bool {
        match from {
            P::Queued => matches!(to, P::Provisioning | P::Running | P::Canceled),
            P::Provisioning => matches!(
                to,
                P::Running | P::Idle | P::Queued | P::Failed | P::Canceled | P::Canceling
            ),
            P::Running => matches!(to, P::Delivering | P::Failed | P::Canceled | P::Canceling),
            P::Delivering => matches!(to, P::Idle | P::Queued | P::Failed | P::Canceled | P::Canceling),
            P::Idle => matches!(to, P::Queued | P::Hibernated | P::Canceled),
            P::Hibernated => matches!(to, P::Queued | P::Canceled),
            P::Failed => matches!(to, P::Queued | P::Canceled),
            P::Canceling => to == P::Canceled,
            P::Canceled => false,
        }
    }

    #[test]
    fn every_session_pair_is_decided_by_the_table() {
        for from in P::ALL {
            for to in P::ALL {
                assert_eq!(from.can_become(to), expected_session(from, to), "{from} -> {to}");
            }
        }
    }

    #[test]
    fn session_table_has_no_duplicates_or_self_loops() {
        for (i, pair) in SESSION_TRANSITIONS.iter().enumerate() {
            assert_ne!(pair.0, pair.1, "self loop {pair:?}");
            assert!(!SESSION_TRANSITIONS[i + 1..].contains(pair), "duplicate {pair:?}");
        }
    }

    #[test]
    fn canceled_is_reachable_from_every_live_phase_and_left_by_none() {
        for from in P::ALL {
            assert_eq!(from.can_become(P::Canceled), !from.is_terminal(), "{from}");
            assert!(!P::Canceled.can_become(from));
        }
    }

    #[test]
    fn a_steer_only_makes_legal_moves() {
        for from in P::ALL {
            match from.after_steer() {
                Some(to) if to != from => assert!(from.can_become(to), "{from} -> {to}"),
                Some(_) => assert!(
                    from.has_active_turn(),
                    "{from} keeps its phase only with a turn in flight"
                ),
                None => assert!(
                    matches!(from, P::Canceled | P::Canceling),
                    "{from} refuses steers only once canceled"
                ),
            }
        }
    }

    #[test]
    fn every_turn_pair_is_decided_by_the_table() {
        for from in T::ALL {
            for to in T::ALL {
                let expected = match from {
                    T::Accepted => matches!(to, T::Running | T::Canceled),
                    T::Running => to.is_terminal() || to == T::Accepted,
                    _ => false,
                };
                assert_eq!(from.can_become(to), expected, "{from} -> {to}");
            }
        }
    }

    #[test]
    fn names_round_trip_through_text_and_json() {
        for phase in P::ALL {
            assert_eq!(phase.as_str().parse::<P>(), Ok(phase));
            assert_eq!(
                serde_json::to_value(phase).ok(),
                Some(serde_json::json!(phase.as_str()))
            );
        }
        for status in T::ALL {
            assert_eq!(status.as_str().parse::<T>(), Ok(status));
            assert_eq!(
                serde_json::to_value(status).ok(),
                Some(serde_json::json!(status.as_str()))
            );
        }
        assert!("Queued".parse::<P>().is_err());
        assert_eq!("interrupt".parse::<TurnMode>(), Ok(TurnMode::Interrupt));
    }
}
