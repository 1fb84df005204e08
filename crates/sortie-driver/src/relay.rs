//! The egress relay (DESIGN §6.2): `127.0.0.1:3128` inside the sandbox's network namespace, each
//! connection forwarded to the host's `egress.sock`. The sandbox has no other way out.

use std::path::{Path, PathBuf};

use tokio::net::{TcpListener, UnixStream};

pub use sortie_protocol::driver::RELAY_ADDRESS;

/// Accepts connections forever and splices each onto a fresh connection to `socket`.
pub async fn run(listener: TcpListener, socket: PathBuf) {
    loop {
        let Ok((mut tcp, _)) = listener.accept().await else {
            continue;
        };
        let socket = socket.clone();
        tokio::spawn(async move {
            match UnixStream::connect(&socket).await {
                Ok(mut unix) => {
                    let _ = tokio::io::copy_bidirectional(&mut tcp, &mut unix).await;
                }
                Err(error) => tracing::warn!(%error, socket = %socket.display(), "egress socket unreachable"),
            }
        });
    }
}

/// The environment that sends a process's traffic through the relay: the proxy variables every
/// HTTP client (curl, git, npm, pip, node, Python) honours. Loopback is exempt: the sandbox has no other
/// network, so a direct connection reaches only the sandbox itself or the relay (which serves the
/// internal routes in origin form too), and agents that talk to a server of their own on 127.0.0.1
/// (opencode) break when that traffic is sent to a proxy.
pub fn proxy_env(relay: &str) -> Vec<(String, String)> {
    let url = format!("http://{relay}");
    let mut env: Vec<(String, String)> = [
        "HTTP_PROXY",
        "HTTPS_PROXY",
        "ALL_PROXY",
        "http_proxy",
        "https_proxy",
        "all_proxy",
        "npm_config_proxy",
        "npm_config_https_proxy",
        "PIP_PROXY",
    ]
    .iter()
    .map(|name| ((*name).to_owned(), url.clone()))
    .collect();
    let loopback = "127.0.0.1,localhost,::1".to_owned();
    env.push(("NO_PROXY".into(), loopback.clone()));
    env.push(("no_proxy".into(), loopback));
    env
}

/// Binds the relay's listener (inside the sandbox) and starts relaying to `socket`.
pub async fn start(socket: &Path) -> std::io::Result<()> {
    let listener = TcpListener::bind(RELAY_ADDRESS).await?;
    tokio::spawn(run(listener, socket.to_owned()));
    Ok(())
}
