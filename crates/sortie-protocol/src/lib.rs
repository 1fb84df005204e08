//! Wire types of sortie: everything that crosses a process or trust boundary.
//!
//! Ids, session phases and turn statuses with their transition rules, error codes with their HTTP
//! status, REST request and response bodies, input limits, agent ids, the egress allowlist rules, the
//! attach-ticket codec, the driver API's bodies (`driver`), what the host takes of a sandbox's stream
//! (`agent_stream`) and sortie's own transcript parts (`sortie_data`). This crate does no I/O: every function takes values and returns values, so
//! the CLI, the driver and the dashboard's generated types can use it without the server.

pub mod acp_data;
pub mod agent_stream;
pub mod agents;
pub mod api;
pub mod chunk;
pub mod driver;
pub mod egress;
pub mod error;
pub mod evidence;
pub mod ids;
pub mod limits;
pub mod phase;
pub mod sortie_data;
pub mod ticket;
pub mod ui;
pub mod validate;

pub use error::{ApiErrorBody, ErrorCode, ErrorDetail, FailureCode};
pub use ids::{IdError, SessionId};
pub use phase::{SessionPhase, TurnStatus};
