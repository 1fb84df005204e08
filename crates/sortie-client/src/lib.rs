//! The command-line client of sortie's REST API: the commands that talk to a running server (`run`,
//! `ls`, `show`, `logs -f`, `steer`, `stop`, `keys`, `forge`, `webhook`, `login`, `mcp`), their
//! arguments, and the terminal view of a live turn. It is the command line's edge, not a library to
//! build on: it prints, reads stdin and answers exit codes, so its errors are `anyhow`'s like a
//! binary's.

/// `println!` for the client commands: a reader that went away (`sortie ls | head -1`) ends the
/// command quietly, as an ordinary end, instead of the panic `println!` makes of a closed pipe.
#[macro_export]
macro_rules! say {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        if let Err(error) = writeln!(std::io::stdout().lock(), $($arg)*) {
            if error.kind() == std::io::ErrorKind::BrokenPipe {
                std::process::exit(0);
            }
            eprintln!("error: cannot write to stdout: {error}");
            std::process::exit(1);
        }
    }};
}

mod args;
mod commands;
mod follow;
mod http;

pub use args::{ClientCommand, ForgeCommand, KeysCommand, LogsArgs, LsArgs, RunArgs, WebhookCommand};
pub use commands::run;
pub use http::{DEFAULT_SERVER, TOKEN_ENV, Target, login_file};
