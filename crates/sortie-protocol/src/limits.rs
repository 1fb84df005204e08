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

// Transcripts (security review S8). One ACP message chunk becomes one part, so a long real turn (hours,
// hundreds of model calls, each streamed in many small deltas) stores tens of thousands of parts of
// about 100 bytes, plus a few large tool outputs; the review's flood stored 400,000 parts in 48 s.
// The caps leave real turns whole and keep the worst case of every read small: folding a capped turn
// takes tens of milliseconds, and a capped session is at most a few hundred MiB on the host's disk.

/// The most parts one turn's transcript holds, a truncation note included. The recorder stores no
/// part past it (the turn fails or is truncated with a note), and `GET /messages` reads no further.
pub const TURN_PARTS_MAX: u32 = 100_000;
/// The most bytes of stored part payloads (their JSON text) one turn's transcript holds. Enforced
/// like [`TURN_PARTS_MAX`]; a single part is bounded far below it by the host's line limits.
pub const TURN_PART_BYTES_MAX: u64 = 64 * 1024 * 1024;
/// The most parts one session's transcript holds over all its turns: ten capped turns.
pub const SESSION_PARTS_MAX: u64 = 1_000_000;
/// The most bytes of stored part payloads one session holds over all its turns: eight capped turns.
pub const SESSION_PART_BYTES_MAX: u64 = 512 * 1024 * 1024;

/// The most turns one page of `GET /v1/sessions/{id}/messages` holds when the client names no
/// `limit`. A session with no more turns than this comes back whole, as it did before pages.
pub const MESSAGES_PAGE_TURNS_DEFAULT: u32 = 20;
/// The most turns a client may ask one page of `GET /v1/sessions/{id}/messages` for.
pub const MESSAGES_PAGE_TURNS_MAX: u32 = 100;
/// The stored bytes (prompts and part payloads) after which a page of `GET /v1/sessions/{id}/messages`
/// takes no further turn. The turn that reaches it is still whole, so a page holds at least one turn
/// and reads at most this plus one turn's cap ([`TURN_PART_BYTES_MAX`]).
pub const MESSAGES_PAGE_MAX_BYTES: u64 = 16 * 1024 * 1024;

/// Files a session's stored branch diff lists (`GET /v1/sessions/{id}/diff`); a branch that changes
/// more is listed up to here and marked truncated.
pub const DIFF_FILES_MAX: usize = 3000;
/// The most of one file's unified diff kept; a longer one is cut at a line end and marked.
pub const DIFF_FILE_PATCH_MAX_BYTES: usize = 64 * 1024;
/// The most unified diff kept for a whole branch; files past it are listed with their counts only.
pub const DIFF_PATCH_MAX_BYTES: usize = 2 * 1024 * 1024;
/// Files in one page of `GET /v1/sessions/{id}/diff` (default, most).
pub const DIFF_PAGE_FILES_DEFAULT: u32 = 50;
pub const DIFF_PAGE_FILES_MAX: u32 = 200;
