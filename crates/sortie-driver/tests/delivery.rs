//! Delivery against real repositories: the cases the driver's end-to-end tests do not reach (history
//! the agent committed itself, a first commit, a remote that cannot be reached).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use sortie_driver::delivery::{DeliveryConfig, DeliveryInput, Git, deliver};
use sortie_driver::secrets::KnownSecrets;
use sortie_testkit::git::git;

const BRANCH: &str = "sortie/ses_lib";

struct Setup {
    _temp: tempfile::TempDir,
    workspace: PathBuf,
    remote: PathBuf,
    git: Git,
}

/// An empty repository (no commit yet) and an empty bare remote.
fn setup() -> Setup {
    let temp = tempfile::tempdir().expect("temp");
    let workspace = temp.path().join("workspace");
    let home = temp.path().join("home");
    std::fs::create_dir_all(&workspace).expect("workspace");
    std::fs::create_dir_all(&home).expect("home");
    git(&workspace, &["init", "-q"]);
    git(temp.path(), &["init", "-q", "--bare", "remote.git"]);
    let path = std::env::var("PATH").unwrap_or_else(|_| "/usr/bin:/bin".into());
    Setup {
        remote: temp.path().join("remote.git"),
        git: Git {
            workspace: workspace.clone(),
            env: vec![
                ("HOME".into(), home.to_string_lossy().into_owned()),
                ("PATH".into(), path),
            ],
            timeout: Duration::from_secs(60),
        },
        workspace,
        _temp: temp,
    }
}

fn config(remote: &Path) -> DeliveryConfig {
    DeliveryConfig {
        branch: BRANCH.into(),
        remote: remote.to_string_lossy().into_owned(),
        author_name: "Sortie".into(),
        author_email: "sortie@localhost".into(),
        known_secrets: Arc::new(KnownSecrets::default()),
        known_secrets_file: None,
        git_timeout: Duration::from_secs(60),
        unreachable_wait: Duration::from_secs(2),
        keep: None,
    }
}

fn input<'a>(baseline: Option<&'a str>, start_head: Option<&'a str>) -> DeliveryInput<'a> {
    DeliveryInput {
        prompt: "Do the thing",
        session_id: "ses_lib",
        baseline,
        start_head,
        waiting: None,
        index_refreshed: false,
    }
}

#[tokio::test]
async fn a_first_commit_on_an_unborn_branch_is_delivered_whole() {
    let setup = setup();
    std::fs::write(setup.workspace.join("a.txt"), "one\ntwo\n").expect("write");
    let report = deliver(&config(&setup.remote), &setup.git, &input(None, None)).await;
    assert_eq!(report.error, None);
    assert!(report.pushed && report.changed);
    let head = report.head_sha.expect("head");
    assert_eq!(git(&setup.remote, &["show", &format!("{head}:a.txt")]), "one\ntwo");
    assert_eq!(
        git(&setup.remote, &["rev-parse", &format!("refs/heads/{BRANCH}")]),
        head
    );
    assert_eq!(
        git(&setup.remote, &["log", "--format=%B", "-1", &head]),
        "Do the thing\n\nSortie-Session: ses_lib"
    );
}

/// A turn that changed nothing commits nothing, on an unborn branch or after a commit, ignored files
/// beside it or not; the one after it that changes a file commits it once.
#[tokio::test]
async fn nothing_to_commit_is_told_from_a_change_and_commits_nothing() {
    let setup = setup();
    // Nothing at all on an unborn branch.
    let report = deliver(&config(&setup.remote), &setup.git, &input(None, None)).await;
    assert_eq!(report.error, None);
    assert!(
        !report.pushed && !report.changed && report.head_sha.is_none(),
        "{report:?}"
    );

    std::fs::write(setup.workspace.join(".gitignore"), "*.log\n").expect("write");
    std::fs::write(setup.workspace.join("a.txt"), "a\n").expect("write");
    let first = deliver(&config(&setup.remote), &setup.git, &input(None, None)).await;
    assert_eq!(first.error, None);
    let head = first.head_sha.clone().expect("head");
    assert!(first.pushed);

    // An ignored file only: nothing to commit, the head as it was.
    std::fs::write(setup.workspace.join("build.log"), "noise\n").expect("write");
    let again = deliver(&config(&setup.remote), &setup.git, &input(Some(&head), Some(&head))).await;
    assert_eq!(again.error, None);
    assert!(!again.changed && !again.pushed, "{again:?}");
    assert_eq!(again.head_sha.as_deref(), Some(head.as_str()));
    assert_eq!(git(&setup.workspace, &["rev-list", "--count", "HEAD"]), "1");

    std::fs::write(setup.workspace.join("a.txt"), "b\n").expect("write");
    let changed = deliver(&config(&setup.remote), &setup.git, &input(Some(&head), Some(&head))).await;
    assert_eq!(changed.error, None);
    assert!(changed.changed && changed.pushed, "{changed:?}");
    assert_eq!(git(&setup.workspace, &["rev-list", "--count", "HEAD"]), "2");
    let delivered = changed.head_sha.expect("head");
    assert_eq!(
        git(&setup.remote, &["diff", "--numstat", &head, &delivered]),
        "1\t1\ta.txt"
    );
}

#[tokio::test]
async fn a_secret_the_agent_committed_and_removed_again_is_still_found_in_the_history() {
    let setup = setup();
    std::fs::write(setup.workspace.join("README"), "base\n").expect("write");
    git(&setup.workspace, &["add", "README"]);
    git(&setup.workspace, &["commit", "-q", "-m", "base"]);
    let base = git(&setup.workspace, &["rev-parse", "HEAD"]);
    // The agent commits a key, then deletes it in a second commit of its own.
    let key = format!("ghp_{}", "a".repeat(36));
    std::fs::write(setup.workspace.join("token.txt"), format!("{key}\n")).expect("write");
    git(&setup.workspace, &["add", "token.txt"]);
    git(&setup.workspace, &["commit", "-q", "-m", "add token"]);
    git(&setup.workspace, &["rm", "-q", "token.txt"]);
    git(&setup.workspace, &["commit", "-q", "-m", "remove token"]);
    let agent_head = git(&setup.workspace, &["rev-parse", "HEAD"]);

    let report = deliver(&config(&setup.remote), &setup.git, &input(None, Some(&base))).await;
    let error = report.error.expect("refused");
    assert_eq!(error.code.as_str(), "SECRET_DETECTED");
    assert!(
        error.reason.contains("a GitHub token in token.txt") && !error.reason.contains(&key),
        "{}",
        error.reason
    );
    assert!(
        !error.reason.contains("undone"),
        "the agent's own commits stay: {}",
        error.reason
    );
    assert!(!report.pushed && report.head_sha.is_none());
    assert_eq!(git(&setup.workspace, &["rev-parse", "HEAD"]), agent_head);
    assert_eq!(git(&setup.remote, &["for-each-ref"]), "", "nothing reached the remote");
}

#[tokio::test]
async fn the_drivers_own_commit_of_a_secret_is_undone_to_where_head_was() {
    let key = format!("ghp_{}", "b".repeat(36));
    // On an unborn branch the commit was the first: HEAD is unborn again.
    let setup = setup();
    std::fs::write(setup.workspace.join("token.txt"), format!("{key}\n")).expect("write");
    let report = deliver(&config(&setup.remote), &setup.git, &input(None, None)).await;
    let error = report.error.expect("refused");
    assert_eq!(error.code.as_str(), "SECRET_DETECTED");
    assert!(error.reason.contains("undone"), "{}", error.reason);
    assert_eq!(
        setup.git.head().await.expect("HEAD"),
        None,
        "the branch is unborn again"
    );
    assert_eq!(
        git(&setup.workspace, &["diff", "--cached", "--name-only"]),
        "token.txt",
        "the work stays staged"
    );

    // After a commit of the agent's, HEAD is back at it.
    let setup = self::setup();
    std::fs::write(setup.workspace.join("README"), "base\n").expect("write");
    git(&setup.workspace, &["add", "README"]);
    git(&setup.workspace, &["commit", "-q", "-m", "base"]);
    let base = git(&setup.workspace, &["rev-parse", "HEAD"]);
    std::fs::write(setup.workspace.join("token.txt"), format!("{key}\n")).expect("write");
    let report = deliver(&config(&setup.remote), &setup.git, &input(None, Some(&base))).await;
    assert_eq!(report.error.expect("refused").code.as_str(), "SECRET_DETECTED");
    assert_eq!(git(&setup.workspace, &["rev-parse", "HEAD"]), base);
    assert_eq!(git(&setup.remote, &["for-each-ref"]), "", "nothing reached the remote");
}

#[tokio::test]
async fn an_unreachable_remote_fails_the_delivery_with_gits_words() {
    let setup = setup();
    std::fs::write(setup.workspace.join("a.txt"), "a\n").expect("write");
    let missing = setup.workspace.join("no-such-remote.git");
    let report = deliver(&config(&missing), &setup.git, &input(None, None)).await;
    let error = report.error.expect("failed");
    assert_eq!(error.code.as_str(), "DELIVERY_FAILED");
    assert!(
        // The push's own words: the read after it failed too, and says no more.
        error.reason.contains("push the branch") && error.reason.contains("no-such-remote.git"),
        "{}",
        error.reason
    );
    // The commit is made and kept for the next attempt.
    assert!(report.changed && !report.pushed);
    assert_eq!(report.head_sha, Some(git(&setup.workspace, &["rev-parse", "HEAD"])));
}

#[tokio::test]
async fn a_gateway_that_does_not_answer_is_tried_again_until_the_wait_runs_out() {
    let setup = setup();
    std::fs::write(setup.workspace.join("a.txt"), "a\n").expect("write");
    // A relay whose gateway is down: every connection is accepted and closed without a word.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = listener.local_addr().expect("addr").port();
    let accepted = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counter = accepted.clone();
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            counter.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            drop(stream);
        }
    });
    let remote = PathBuf::from(format!("http://127.0.0.1:{port}/_sortie/git/ses_lib.git"));
    let (waiting, mut notices) = tokio::sync::mpsc::unbounded_channel();
    let mut input = input(None, None);
    input.waiting = Some(waiting);
    let report = deliver(&config(&remote), &setup.git, &input).await;
    let error = report.error.expect("failed");
    assert_eq!(error.code.as_str(), "DELIVERY_FAILED");
    // A connection closed unread ends as either, depending on whether git's request was in flight.
    assert!(
        ["Empty reply from server", "Connection reset by peer"]
            .iter()
            .any(|said| error.reason.contains(said)),
        "{}",
        error.reason
    );
    assert!(accepted.load(std::sync::atomic::Ordering::SeqCst) >= 3, "tried again");
    let note = notices.try_recv().expect("told once");
    assert!(note.contains("cannot be reached"), "{note}");
    assert!(notices.try_recv().is_err(), "told only once");
    assert!(report.changed && !report.pushed);
}

#[test]
fn only_a_remote_that_cannot_be_reached_is_worth_trying_again() {
    use sortie_driver::delivery::GitError;
    let failed = |stderr: &str| GitError::Failed {
        what: "push the branch",
        status: std::os::unix::process::ExitStatusExt::from_raw(128 << 8),
        stderr: stderr.to_owned(),
    };
    for stderr in [
        "fatal: unable to access 'http://127.0.0.1:3128/_sortie/git/s.git/': Empty reply from server",
        "fatal: unable to access 'http://x/': Failed to connect to 127.0.0.1 port 3128 after 0 ms: Couldn't connect to server",
        "fatal: unable to access 'http://x/': Recv failure: Connection reset by peer",
        "fatal: unable to access 'http://x/': sortie: the repository's forge did not answer",
    ] {
        assert!(failed(stderr).is_unreachable(), "{stderr}");
    }
    for stderr in [
        "! [remote rejected] HEAD -> refs/heads/main (sortie: refs/heads/main may not be pushed)",
        "fatal: unable to access 'http://x/': sortie: upstream rejected the proxy's credentials",
        "! [rejected] HEAD -> sortie/s (stale info)",
        "error: RPC failed; curl 55 Send failure: Broken pipe",
        "To http://x\n!\tHEAD:refs/heads/sortie/s\t[remote rejected] (sortie: the repository's forge did not answer)",
        "fatal: 'origin' does not appear to be a git repository",
    ] {
        assert!(!failed(stderr).is_unreachable(), "{stderr}");
    }
    let timed_out = GitError::TimedOut {
        what: "push the branch",
        seconds: 120,
    };
    assert!(!timed_out.is_unreachable());
}

/// A pod keeps nothing once let go: what a failed delivery could not push goes to the session's WIP
/// ref, the session's next workspace is made from it, and the delivery that lands deletes it.
#[tokio::test]
async fn work_a_delivery_could_not_push_is_kept_at_the_wip_ref_and_let_go_once_delivered() {
    use sortie_driver::delivery::KeptWork;
    use std::sync::atomic::{AtomicBool, Ordering};
    let setup = setup();
    let wip_ref = sortie_protocol::ids::wip_ref("ses_lib");
    let kept = |outstanding: bool| {
        let mut config = config(&setup.remote);
        config.keep = Some(KeptWork {
            refname: wip_ref.clone(),
            outstanding: Arc::new(AtomicBool::new(outstanding)),
        });
        config
    };
    let first = kept(false);
    std::fs::write(setup.workspace.join("a.txt"), "one\n").expect("write");
    let report = deliver(&first, &setup.git, &input(None, None)).await;
    assert_eq!(report.error, None);
    let delivered = report.head_sha.expect("delivered");
    assert_eq!(
        git(&setup.remote, &["for-each-ref", "refs/sortie"]),
        "",
        "nothing to keep"
    );

    // A person moves the session's branch, so the next delivery conflicts.
    let tree = format!("{delivered}^{{tree}}");
    let theirs = git(&setup.remote, &["commit-tree", &tree, "-p", &delivered, "-m", "theirs"]);
    git(&setup.remote, &["update-ref", &format!("refs/heads/{BRANCH}"), &theirs]);
    std::fs::write(setup.workspace.join("b.txt"), "kept\n").expect("write");
    let report = deliver(&first, &setup.git, &input(Some(&delivered), None)).await;
    let error = report.error.expect("a conflict");
    assert_eq!(error.code.as_str(), "PUSH_CONFLICT");
    assert!(error.reason.contains(&wip_ref), "{}", error.reason);
    let kept_commit = git(&setup.workspace, &["rev-parse", "HEAD"]);
    assert_eq!(git(&setup.remote, &["rev-parse", &wip_ref]), kept_commit);
    assert!(
        first
            .keep
            .as_ref()
            .is_some_and(|k| k.outstanding.load(Ordering::SeqCst))
    );

    // The session's next workspace: the branch as delivered, with the kept files on top.
    let next = setup.workspace.parent().expect("temp").join("next");
    std::fs::create_dir_all(&next).expect("next");
    let next_git = Git {
        workspace: next.clone(),
        ..setup.git.clone()
    };
    let remote = setup.remote.to_string_lossy().into_owned();
    next_git.checkout(&remote, &delivered, BRANCH).await.expect("checkout");
    let moved = next_git.restore_kept(&wip_ref, &delivered).await;
    assert!(
        moved.as_ref().is_err_and(|e| e.to_string().contains("not at")),
        "a ref that is not where the host recorded it is not taken: {moved:?}"
    );
    next_git.restore_kept(&wip_ref, &kept_commit).await.expect("restore");
    assert_eq!(
        std::fs::read_to_string(next.join("b.txt")).expect("kept file"),
        "kept\n"
    );
    assert_eq!(git(&next, &["rev-parse", "HEAD"]), delivered);
    assert_eq!(git(&next, &["status", "--porcelain"]), "?? b.txt");

    // The person puts the branch back; the next delivery lands, with the kept work, and the ref goes.
    git(
        &setup.remote,
        &["update-ref", &format!("refs/heads/{BRANCH}"), &delivered],
    );
    let second = kept(true);
    let report = deliver(&second, &next_git, &input(Some(&delivered), None)).await;
    assert_eq!(report.error, None);
    let head = report.head_sha.expect("delivered");
    assert_eq!(
        git(&setup.remote, &["rev-parse", &format!("refs/heads/{BRANCH}")]),
        head
    );
    assert_eq!(git(&setup.remote, &["show", &format!("{head}:b.txt")]), "kept");
    assert_eq!(
        git(&setup.remote, &["for-each-ref", "refs/sortie"]),
        "",
        "the kept work's ref went"
    );
    assert!(
        second
            .keep
            .as_ref()
            .is_some_and(|k| !k.outstanding.load(Ordering::SeqCst))
    );
}
