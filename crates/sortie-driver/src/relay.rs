//! The egress relay (DESIGN §6.2): `127.0.0.1:3128` inside the sandbox's network namespace, each
//! connection forwarded to the host's `egress.sock` — or, in a pod, carried to the gateway over an
//! upgraded request with the pod's identity ([`crate::link::dial_egress`]). The sandbox has no other
//! way out.

use std::path::PathBuf;
use std::sync::Arc;

use tokio::net::{TcpListener, UnixStream};

pub use sortie_protocol::driver::RELAY_ADDRESS;

use crate::link::LinkTarget;

/// Where the relay carries each connection.
#[derive(Clone, Debug)]
pub enum Upstream {
    /// The host's `egress.sock`, bound into the sandbox.
    Socket(PathBuf),
    /// The gateway the pod's driver links to.
    Link(LinkTarget),
}

/// Accepts connections forever and splices each onto a fresh connection to `upstream`.
pub async fn run(listener: TcpListener, upstream: Upstream) {
    let upstream = Arc::new(upstream);
    loop {
        let Ok((mut tcp, _)) = listener.accept().await else {
            continue;
        };
        // The relay passes on each piece as it comes; with Nagle a small piece after another waits for
        // the client's delayed ACK (40 ms), twice per HTTP exchange of a git push or fetch.
        let _ = tcp.set_nodelay(true);
        let upstream = upstream.clone();
        tokio::spawn(async move {
            match &*upstream {
                Upstream::Socket(socket) => match UnixStream::connect(socket).await {
                    Ok(mut unix) => {
                        let _ = tokio::io::copy_bidirectional(&mut tcp, &mut unix).await;
                    }
                    Err(error) => tracing::warn!(%error, socket = %socket.display(), "egress socket unreachable"),
                },
                Upstream::Link(target) => match crate::link::dial_egress(target).await {
                    Ok(mut upgraded) => {
                        let _ = tokio::io::copy_bidirectional(&mut tcp, &mut upgraded).await;
                    }
                    Err(error) => tracing::warn!(%error, "no way out through the gateway"),
                },
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

/// Binds the relay's listener (inside the sandbox) and starts relaying to `upstream`.
pub async fn start(upstream: Upstream) -> std::io::Result<()> {
    let listener = TcpListener::bind(RELAY_ADDRESS).await?;
    tokio::spawn(run(listener, upstream));
    Ok(())
}
