//! Input limits. Every breach is refused with its own error code and nothing is written.

/// The largest prompt (task or steer), in bytes of UTF-8.
pub const PROMPT_MAX_BYTES: usize = 100 * 1024;
/// The most all prompts of one session may add up to, in bytes.
pub const SESSION_PROMPTS_MAX_BYTES: u64 = 8 * 1024 * 1024;
/// The longest title, in characters.
pub const TITLE_MAX_CHARS: usize = 200;
/// The most entries an egress allowlist may have.
pub const EGRESS_ALLOW_MAX_ENTRIES: usize = 32;
/// The most turns that may wait (`accepted`) in one session.
pub const TURN_QUEUE_MAX: u32 = 8;
/// The largest setup script, in bytes.
pub const SETUP_MAX_BYTES: usize = 64 * 1024;
/// The longest repository URL or path, in bytes.
pub const REPO_MAX_BYTES: usize = 4096;
/// The longest base branch name, in bytes.
pub const BASE_MAX_BYTES: usize = 255;
/// The longest model name, in bytes.
pub const MODEL_MAX_BYTES: usize = 200;
/// The largest JSON request body the control plane reads. Room for a full prompt, setup script and
/// allowlist with JSON escaping; anything past it is refused before it is parsed.
pub const REQUEST_BODY_MAX_BYTES: usize = 1024 * 1024;
/// The most sessions one list page returns.
pub const LIST_LIMIT_MAX: u32 = 200;
/// The page size when the client names none.
pub const LIST_LIMIT_DEFAULT: u32 = 50;
/// How long an attach ticket is valid after minting, in seconds (DESIGN §5 caps it at 90).
pub const TICKET_TTL_SECONDS: i64 = 60;
