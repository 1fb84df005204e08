//! The payloads of the `data-acp-*` parts the driver maps from an agent's ACP updates (DESIGN §5.1):
//! each a type, so no side writes them as JSON literals. The host admits them as the agent's chunks,
//! not as sortie's word. The agent's own values inside them (plan entries, commands, a mode id, exit
//! codes, a tool's raw output) pass through as the agent sent them, unparsed: an agent that strays
//! from the spec still renders.

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// `data-acp-terminal` (id `terminal:<terminalId>`): a command's output so far, and its exit.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct TerminalData {
    pub tool_call_id: String,
    pub terminal_id: String,
    pub output: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exit_status: Option<ExitStatus>,
    /// Only the tail of the output is kept.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub truncated: bool,
}

/// How a command ended, as the agent reported it (a number or null each).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ExitStatus {
    pub exit_code: Value,
    pub signal: Value,
}

/// `data-acp-plan` (id `plan`): the agent's plan entries.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PlanData {
    pub entries: Value,
}

/// `data-acp-commands` (transient): the slash commands the agent offers.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct CommandsData {
    pub available_commands: Value,
}

/// `data-acp-mode` (id `mode`): the agent's current mode.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ModeData {
    pub current_mode_id: Value,
}

/// `data-acp-permission` (id `permission:<toolCallId>`): how the driver answered a permission request
/// (`answer` is the chosen option's kind, or `cancelled`; `option` its name, or null).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PermissionData {
    pub tool_call_id: String,
    pub answer: Value,
    pub option: Value,
}

/// `data-acp-diff` (id `diff:<toolCallId>:<path>`): a file a tool changed. `oldText` null means the
/// file was created; it is always sent.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DiffData {
    pub tool_call_id: String,
    pub path: String,
    pub old_text: Value,
    pub new_text: Value,
}

/// A tool's output when the agent gave both text and a raw value.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CombinedOutput {
    pub text: String,
    pub raw: Value,
}

/// Any of these as the JSON a part carries. They hold strings and JSON values only, so encoding
/// cannot fail; `null` if it ever did.
pub fn to_data(payload: &impl Serialize) -> Value {
    serde_json::to_value(payload).unwrap_or_default()
}
