//! The egress proxy from inside a real sandbox: allowlisted names reach a local test server (through
//! a test resolver and an exempted 127.0.0.1), everything else is refused with a reason the agent can
//! read, names that resolve to special addresses are refused, and the allowlist can be amended while
//! the sandbox runs.

mod support;

use std::collections::HashMap;
use std::net::IpAddr;
use std::os::unix::fs::PermissionsExt;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use sortie_gateway::egress::policy::{Cidr, Denial};
use sortie_gateway::egress::proxy::{EgressProxy, FixedAllowlist, StaticResolver};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_allowlisted_public_names_are_reachable() {
    let temp = tempfile::tempdir().expect("temp");
    std::fs::set_permissions(temp.path(), std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let egress_dir = temp.path().join("egress");
    let work = temp.path().join("work");
    for dir in [&egress_dir, &work] {
        std::fs::create_dir_all(dir).expect("dir");
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    }

    // The "public" package server: a local HTTP server every allowed name resolves to.
    let server = sortie_testkit::http::respond("hello from the package server").await;
    let port = server.port();

    let names: HashMap<String, Vec<IpAddr>> = [
        ("pkg.sortie-test.dev", vec!["127.0.0.1"]),
        ("late.sortie-test.dev", vec!["127.0.0.1"]),
        ("rebind.sortie-test.dev", vec!["10.1.2.3"]),
        ("metadata.sortie-test.dev", vec!["169.254.169.254"]),
        ("loopback6.sortie-test.dev", vec!["::1"]),
        // Loopback beyond the one exempted test address.
        ("loopback4.sortie-test.dev", vec!["127.0.0.2"]),
        ("mixed.sortie-test.dev", vec!["127.0.0.1", "192.168.0.10"]),
    ]
    .into_iter()
    .map(|(name, ips)| {
        (
            name.to_owned(),
            ips.into_iter().map(|ip| ip.parse().expect("ip")).collect(),
        )
    })
    .collect();
    let allow: Vec<String> = ["pkg", "rebind", "metadata", "loopback6", "loopback4", "mixed"]
        .iter()
        .map(|n| format!("{n}.sortie-test.dev"))
        .collect();
    let denials: Arc<Mutex<Vec<Denial>>> = Arc::default();
    let seen = denials.clone();
    let allowlist = FixedAllowlist::new(allow.clone());
    let proxy = EgressProxy::new(
        allowlist.clone(),
        vec![Cidr::parse("127.0.0.1/32").expect("cidr")],
        Arc::new(StaticResolver(names)),
        None,
        Some(Arc::new(move |denial: &Denial| {
            seen.lock().expect("lock").push(denial.clone());
            Box::pin(async {})
        })),
    );
    let socket = egress_dir.join("egress.sock");
    let listener = tokio::net::UnixListener::bind(&socket).expect("egress socket");
    tokio::spawn(proxy.clone().serve(listener));

    let script = format!(
        r#"python3 - <<'PY'
import http.client, os, time, urllib.request, urllib.error
def get(name):
    try:
        return "ok " + urllib.request.urlopen("http://%s:{port}/" % name, timeout=10).read().decode()
    except urllib.error.HTTPError as error:
        return "refused %d %s" % (error.code, error.read().decode().strip())
    except Exception as error:
        return "error %r" % error
for name in ["pkg", "other", "rebind", "metadata", "loopback6", "loopback4", "mixed", "late"]:
    print(name, "->", get(name + ".sortie-test.dev"))
tunnel = http.client.HTTPConnection("127.0.0.1", 3128, timeout=10)
tunnel.set_tunnel("pkg.sortie-test.dev", {port})
tunnel.request("GET", "/")
print("tunnel ->", tunnel.getresponse().read().decode())
open("/workspace/waiting", "w").close()
deadline = time.time() + 20
while not os.path.exists("/workspace/go") and time.time() < deadline:
    time.sleep(0.05)
print("late-again ->", get("late.sortie-test.dev"))
PY"#
    );
    let child = support::sortie(temp.path())
        .args(["sandbox", "exec", "--dir"])
        .arg(&work)
        .arg("--egress-socket")
        .arg(&socket)
        .args(["--", "sh", "-c", &script])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("sandbox");
    let deadline = Instant::now() + Duration::from_secs(30);
    while !work.join("waiting").exists() {
        assert!(Instant::now() < deadline, "the sandbox never got to the amendment");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Amended while the sandbox runs: the next connection sees it.
    let mut amended = allow.clone();
    amended.push("late.sortie-test.dev".into());
    allowlist.set(amended);
    std::fs::write(work.join("go"), "").expect("go");
    let output = tokio::task::spawn_blocking(move || child.wait_with_output())
        .await
        .expect("join")
        .expect("output");
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );

    let line = |name: &str| {
        said.lines()
            .find(|l| l.starts_with(&format!("{name} ->")))
            .unwrap_or_default()
            .to_owned()
    };
    assert_eq!(line("pkg"), "pkg -> ok hello from the package server", "{said}");
    assert_eq!(line("tunnel"), "tunnel -> hello from the package server", "{said}");
    assert!(
        line("other").contains("refused 403") && line("other").contains("not on this session's egress allowlist"),
        "{said}"
    );
    assert!(
        line("rebind").contains("refused 403") && line("rebind").contains("private address"),
        "{said}"
    );
    assert!(
        line("metadata").contains("refused 403") && line("metadata").contains("metadata"),
        "{said}"
    );
    assert!(
        line("loopback6").contains("refused 403") && line("loopback6").contains("loopback"),
        "{said}"
    );
    assert!(
        line("loopback4").contains("refused 403") && line("loopback4").contains("loopback"),
        "{said}"
    );
    assert!(
        line("mixed").contains("refused 403") && line("mixed").contains("private address"),
        "{said}"
    );
    assert!(line("late").contains("refused 403"), "{said}");
    assert_eq!(
        line("late-again"),
        "late-again -> ok hello from the package server",
        "{said}"
    );
    let denied: Vec<String> = denials.lock().expect("lock").iter().map(|d| d.host.clone()).collect();
    for host in ["other", "rebind", "metadata", "loopback6", "loopback4", "mixed", "late"] {
        assert!(
            denied.contains(&format!("{host}.sortie-test.dev")),
            "{host} reported: {denied:?}"
        );
    }
}
