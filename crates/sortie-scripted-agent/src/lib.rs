//! `sortie-scripted-agent`: a real ACP (Agent Client Protocol) agent whose behaviour is a script in its
//! prompt, so tests can drive the whole platform, sandbox and driver included, without a model.
//!
//! The binary speaks ACP v1 as newline-delimited JSON-RPC on stdin/stdout, like every ACP agent. A prompt
//! with a line `#!scripted` is a script with one step per line after it (what comes before is context it
//! ignores); any other prompt gets one message
//! chunk `scripted agent received: <first 200 characters>`.
//!
//! ```text
//! #!scripted
//! plan: Write the file | Test it
//! think: starting
//! write: src/hello.txt
//! hello
//! >>>
//! done: 1
//! run: cat src/hello.txt
//! ask: Push the branch?
//! say: all done
//! ```
//!
//! The steps are `think:`, `say:`, `plan:`, `done:`, `write:` … `>>>`, `run:`, `ask:`, `sleep:`, `flood:`,
//! `fail:` and `crash:`, plus the fault injections `hang:`, `garbage:`, `bigline:` and `stderr:`; the crate's
//! README describes what each one sends. [`script::parse_script`] turns a prompt into [`script::Step`]s
//! without any I/O, and a script with a mistake fails the turn (JSON-RPC error -32602 naming the line)
//! before any step runs.
//!
//! Between steps the turn checks for `session/cancel` and then ends with stop reason `cancelled`; `sleep:`
//! is interrupted by it, `hang:` is not. Sessions are stored in `$HOME/.scripted-agent/<sessionId>.json`
//! (the prompts and every update sent per turn), `initialize` advertises `loadSession`, and `session/load`
//! in a later process replays the earlier turns. `session/set_mode` accepts `default` and `yolo`. The
//! client's fs/terminal capabilities are ignored: the agent edits files and runs commands itself.

mod agent;
mod output;
pub mod script;
mod store;
mod turn;

pub use agent::{AGENT_NAME, DEFAULT_MODE, YOLO_MODE, serve_stdio};
