//! The real `git` client inside a real sandbox, through the relay and the egress socket to the git
//! proxy: clone and push of the session's own branch work, every other push is refused with git
//! printing why, the upstream is unchanged, and nothing inside holds a credential.

mod support;

use std::os::unix::fs::PermissionsExt;
use std::path::PathBuf;
use std::sync::Arc;

use sortie_gateway::egress::proxy::{EgressProxy, FixedAllowlist, SystemResolver};
use sortie_gateway::git::config::{GitProxyConfig, NoKnownSecrets, PushRecords};
use sortie_gateway::git::http::{Upstream, Upstreams, router};
use sortie_protocol::SessionId;
use sortie_testkit::git::rev;

struct OneRepo(SessionId, PathBuf);

impl Upstreams for OneRepo {
    fn upstream(&self, session_id: &SessionId) -> Option<Upstream> {
        (session_id == &self.0).then(|| Upstream::Local(self.1.clone()))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn git_inside_a_sandbox_pushes_only_its_own_branch() {
    let temp = tempfile::tempdir().expect("temp");
    std::fs::set_permissions(temp.path(), std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let root = temp.path().to_owned();
    let upstream = sortie_testkit::git::bare_with_main(&root, "upstream.git");
    let main_before = rev(&upstream, "refs/heads/main").expect("main");
    // The proxy runs in this process: its push decisions land in this recorder.
    let _ = sortie_server::render_metrics();

    let session = SessionId::generate();
    let egress_dir = root.join("egress");
    let work = root.join("work");
    for dir in [&egress_dir, &work] {
        std::fs::create_dir_all(dir).expect("dir");
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    }
    let git_routes = router(GitProxyConfig::new(
        Arc::new(OneRepo(session.clone(), upstream.clone())),
        PathBuf::from("git"),
        &root.join("git-state"),
        Arc::new(PushRecords::default()),
        Arc::new(NoKnownSecrets),
    ));
    let proxy = EgressProxy::new(
        FixedAllowlist::new(Vec::new()),
        Vec::new(),
        Arc::new(SystemResolver),
        Some(git_routes),
        None,
    );
    let socket = egress_dir.join("egress.sock");
    let listener = tokio::net::UnixListener::bind(&socket).expect("socket");
    tokio::spawn(proxy.serve(listener));

    let own = format!("refs/heads/sortie/{session}");
    let script = format!(
        r#"set -u
export GIT_TERMINAL_PROMPT=0
git clone -q http://127.0.0.1:3128/_sortie/git/{session}.git repo && echo "clone ok"
cd repo
git -c user.name=agent -c user.email=agent@sortie.invalid commit -q --allow-empty -m work
git push -q origin HEAD:{own} && echo "own push ok"
git -c user.name=agent -c user.email=agent@sortie.invalid commit -q --amend --allow-empty -m rewritten
git push -q --force origin HEAD:{own} && echo "force push ok"
head -c 3000000 /dev/urandom > big.bin && git add big.bin && git -c user.name=agent -c user.email=agent@sortie.invalid commit -q -m big
git push -q origin HEAD:{own} && echo "big push ok"
git -c user.name=agent -c user.email=agent@sortie.invalid commit -q --allow-empty -m mixed
git push origin HEAD:{own} HEAD:refs/heads/main 2>&1 | grep -q "sortie: refs/heads/main may not be pushed" && echo "mixed refused"
[ "$(git ls-remote origin {own} | cut -f1)" = "$(git rev-parse HEAD~1)" ] && echo "own untouched by the mixed push"
git reset -q --hard HEAD~1
git ls-remote origin refs/heads/main | cut -f1 > /tmp/main.sha
python3 - <<'PY'
import urllib.request
main = open("/tmp/main.sha").read().strip()
cert = ("push-cert\0 report-status side-band-64k\ncertificate version 0.1\npusher x 0 +0000\npushee x\nnonce 1\n\n"
        "%s %s refs/heads/main\npush-cert-end\n" % (main, "0" * 40)).encode()
body = b"%04x" % (len(cert) + 4) + cert + b"0000"
request = urllib.request.Request(
    "http://127.0.0.1:3128/_sortie/git/{session}.git/git-receive-pack",
    data=body,
    headers={{"content-type": "application/x-git-receive-pack-request"}},
)
answer = urllib.request.urlopen(request).read()
if b"ng (push) signed pushes (push-cert) are not accepted" in answer:
    print("raw push-cert refused")
PY
git push origin HEAD:refs/heads/main 2>&1 | grep -q "sortie: refs/heads/main may not be pushed; this session may only push {own}" && echo "main refused"
git push origin HEAD:refs/heads/sortie/ses_01jd8x3k4m5n6p7q8r9s0t1v2w 2>&1 | grep -q "sortie: refs/heads/sortie/ses_01jd8x3k4m5n6p7q8r9s0t1v2w may not be pushed" && echo "other session refused"
git tag v1 && git push origin v1 2>&1 | grep -q "sortie: refs/tags/v1 may not be pushed" && echo "tag refused"
git push origin :{own} 2>&1 | grep -q "sortie: {own} may not be deleted" && echo "delete refused"
git fetch -q origin && echo "fetch ok"
cd /
grep -rIl "Authorization\|x-access-token" /workspace /home/agent 2>/dev/null | head -1 | sed 's/^/CREDENTIAL IN /'
env | grep -i "token\|secret\|password" | sed 's/^/ENV /'
git -C /workspace/repo remote get-url origin
"#
    );
    let output = support::sortie(&root)
        .args(["sandbox", "exec", "--dir"])
        .arg(&work)
        .arg("--egress-socket")
        .arg(&socket)
        .args(["--", "sh", "-c", &script])
        .output()
        .expect("sandbox");
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    for line in [
        "clone ok",
        "own push ok",
        "force push ok",
        "big push ok",
        "mixed refused",
        "own untouched by the mixed push",
        "raw push-cert refused",
        "main refused",
        "other session refused",
        "tag refused",
        "delete refused",
        "fetch ok",
    ] {
        assert!(said.contains(line), "{line}: {said}");
    }
    assert!(!said.contains("CREDENTIAL IN") && !said.contains("ENV "), "{said}");
    assert!(
        said.contains(&format!("http://127.0.0.1:3128/_sortie/git/{session}.git")),
        "the remote holds no credential: {said}"
    );
    assert_eq!(
        rev(&upstream, "refs/heads/main").as_deref(),
        Some(main_before.as_str()),
        "main unchanged"
    );
    assert!(rev(&upstream, "refs/tags/v1").is_none());
    // The big push made git send its empty probe request first, and the proxy let it through.
    let metrics = sortie_server::render_metrics();
    assert!(
        metrics
            .lines()
            .any(|l| l.starts_with("sortie_git_pushes_total{decision=\"probe\"}")),
        "{metrics}"
    );
    assert!(rev(&upstream, "refs/heads/sortie/ses_01jd8x3k4m5n6p7q8r9s0t1v2w").is_none());
    assert_eq!(
        rev(&upstream, &own),
        rev(&work.join("repo"), "HEAD"),
        "the session's branch holds the rewritten work"
    );
}
