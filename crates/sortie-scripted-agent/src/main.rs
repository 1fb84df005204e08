//! The `sortie-scripted-agent` binary: an ACP agent on stdin/stdout whose prompts are scripts.

use std::process::ExitCode;

fn main() -> ExitCode {
    let runtime = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(runtime) => runtime,
        Err(error) => {
            eprintln!("sortie-scripted-agent: cannot start the async runtime: {error}");
            return ExitCode::FAILURE;
        }
    };
    let served = runtime.block_on(sortie_scripted_agent::serve_stdio());
    // Exit without dropping the runtime: dropping it would wait for the thread blocked reading stdin and for
    // turns still running (e.g. a `hang:`), while the client has already gone.
    let code = match served {
        Ok(()) => 0,
        Err(error) => {
            eprintln!("sortie-scripted-agent: {error:#}");
            1
        }
    };
    std::process::exit(code)
}
