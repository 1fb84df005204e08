//! Identifiers: `ses_` followed by a lowercase ULID.

use std::fmt;
use std::str::FromStr;
use std::sync::{Mutex, PoisonError};

use serde::{Deserialize, Serialize};

/// The prefix every session id starts with.
pub const SESSION_ID_PREFIX: &str = "ses_";
const ULID_LEN: usize = 26;

/// A session id, `ses_` + a lowercase ULID (26 Crockford base32 characters). Sorting ids sorts sessions
/// by creation time: by millisecond across processes, and exactly within one.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(try_from = "String", into = "String")]
#[cfg_attr(feature = "openapi", schema(value_type = String, example = "ses_01jd8x3k4m5n6p7q8r9s0t1v2w"))]
pub struct SessionId(String);

/// Why a string is not a valid id.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IdError {
    #[error("a session id starts with `ses_`: {0:?}")]
    MissingPrefix(String),
    #[error("a session id is `ses_` followed by 26 lowercase ULID characters: {0:?}")]
    Malformed(String),
}

impl SessionId {
    /// A fresh id for a session created now, greater than every id this process made before (two
    /// plain ULIDs of one millisecond sort at random, and "oldest first" would lie).
    pub fn generate() -> Self {
        static GENERATOR: Mutex<ulid::Generator> = Mutex::new(ulid::Generator::new());
        let mut generator = GENERATOR.lock().unwrap_or_else(PoisonError::into_inner);
        let ulid = match generator.generate() {
            Ok(ulid) => ulid,
            // 2^80 ids in one millisecond: borrow the next one.
            Err(overflow) => overflow.commit_overflow_random(),
        };
        Self::from_ulid(ulid)
    }

    /// The id for a given ULID (tests and imports use it to make ids deterministic).
    pub fn from_ulid(ulid: ulid::Ulid) -> Self {
        Self(format!("{SESSION_ID_PREFIX}{}", ulid.to_string().to_ascii_lowercase()))
    }

    /// Parses and validates an id; uppercase is refused so that one session has exactly one spelling.
    pub fn parse(text: &str) -> Result<Self, IdError> {
        let Some(body) = text.strip_prefix(SESSION_ID_PREFIX) else {
            return Err(IdError::MissingPrefix(text.to_owned()));
        };
        let valid_char =
            |c: u8| matches!(c, b'0'..=b'9' | b'a'..=b'h' | b'j' | b'k' | b'm' | b'n' | b'p'..=b't' | b'v'..=b'z');
        // The first character carries the top 3 bits of a 128-bit value, so it is at most '7'.
        if body.len() != ULID_LEN || !body.bytes().all(valid_char) || body.as_bytes()[0] > b'7' {
            return Err(IdError::Malformed(text.to_owned()));
        }
        Ok(Self(text.to_owned()))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The branch the session's work is pushed to.
    pub fn branch(&self) -> String {
        format!("{SESSION_BRANCH_PREFIX}{}", self.0)
    }

    /// Where a session's pod keeps what a failed delivery could not push (a pod keeps nothing once let
    /// go): outside `refs/heads`, so no branch list shows it, and pushable by that session only.
    pub fn wip_ref(&self) -> String {
        wip_ref(&self.0)
    }

    /// The stable AI SDK message id of turn `n`'s assistant message.
    pub fn assistant_message_id(&self, n: u32) -> String {
        format!("{}-t{n}", self.0)
    }

    /// The AI SDK message id of turn `n`'s user prompt.
    pub fn user_message_id(&self, n: u32) -> String {
        format!("{}-u{n}", self.0)
    }
}

impl fmt::Display for SessionId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl FromStr for SessionId {
    type Err = IdError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::parse(s)
    }
}

impl TryFrom<String> for SessionId {
    type Error = IdError;
    fn try_from(value: String) -> Result<Self, Self::Error> {
        Self::parse(&value)
    }
}

impl From<SessionId> for String {
    fn from(id: SessionId) -> Self {
        id.0
    }
}

/// [`SessionId::wip_ref`] of the session named `session` (as the driver and the git proxy have it).
pub fn wip_ref(session: &str) -> String {
    format!("{SORTIE_REFS}wip/{session}")
}

/// Where sessions' branches are: `sortie/<session id>` (under `refs/heads/`).
pub const SESSION_BRANCH_PREFIX: &str = "sortie/";
/// sortie's refs outside `refs/heads` (what failed deliveries keep).
pub const SORTIE_REFS: &str = "refs/sortie/";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_made_in_a_row_sort_in_the_order_they_were_made() {
        let ids: Vec<SessionId> = (0..2000).map(|_| SessionId::generate()).collect();
        assert!(ids.windows(2).all(|pair| pair[0] < pair[1]));
    }

    #[test]
    fn generated_ids_round_trip_and_are_lowercase() {
        let id = SessionId::generate();
        assert!(id.as_str().starts_with("ses_"));
        assert_eq!(id.as_str().len(), 4 + 26);
        assert_eq!(id.as_str(), id.as_str().to_ascii_lowercase());
        assert_eq!(SessionId::parse(id.as_str()), Ok(id.clone()));
        assert_eq!(id.branch(), format!("sortie/{id}"));
    }

    #[test]
    fn malformed_ids_are_refused() {
        for bad in [
            "",
            "ses_",
            "01jd8x3k4m5n6p7q8r9s0t1v2w",
            "SES_01jd8x3k4m5n6p7q8r9s0t1v2w",
            "ses_01JD8X3K4M5N6P7Q8R9S0T1V2W",
            "ses_01jd8x3k4m5n6p7q8r9s0t1v2",
            "ses_01jd8x3k4m5n6p7q8r9s0t1v2ww",
            "ses_01jd8x3k4m5n6p7q8r9s0t1v2u",
            "ses_81jd8x3k4m5n6p7q8r9s0t1v2w",
            "ses_01jd8x3k4m5n6p7q8r9s0t1v2/",
            "ses_../../../../etc/passwd0000",
        ] {
            assert!(SessionId::parse(bad).is_err(), "{bad:?} should be refused");
        }
    }

    #[test]
    fn ids_sort_by_creation_time() {
        let earlier = SessionId::from_ulid(ulid::Ulid::from_parts(1_000, 5));
        let later = SessionId::from_ulid(ulid::Ulid::from_parts(2_000, 1));
        assert!(earlier < later);
    }
}
