//! `sortie bench` as a user runs it: the installed binary as root, its own `serve`, real sandboxes.
//! Only that it runs and what it prints are checked here; its figures are the benchmark's business.

mod support;

use serde_json::Value;

#[test]
fn the_bench_measures_every_row() {
    if !nix::unistd::geteuid().is_root() {
        eprintln!("skipped: sortie bench runs real sandboxes as root");
        return;
    }
    let home = tempfile::tempdir().expect("temp");
    let work = tempfile::tempdir().expect("temp");
    let output = support::sortie(home.path())
        .args(["bench", "--quick", "--sessions", "2", "--json", "--work-dir"])
        .arg(work.path())
        .output()
        .expect("sortie bench");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{stderr}");
    let report: Value = serde_json::from_slice(&output.stdout).expect("JSON");
    let rows = report["rows"].as_array().expect("rows");
    let named = |name: &str| {
        rows.iter()
            .find(|row| row["name"] == name)
            .unwrap_or_else(|| panic!("no row {name}: {report}"))
    };
    for name in [
        "per-session memory",
        "claim latency after accept",
        "delivery, small repository",
        "workspace prep, small repository (mirrored)",
        "create → first part (cold: a new sandbox)",
        "create → idle, trivial scripted turn",
        "create → first part (warm pool)",
        "create → idle (warm pool), trivial scripted turn",
        "idle RSS of sortie serve",
        "sandbox start (sortie sandbox exec -- true)",
        "create-accept p99 under load",
        "git proxy clone (in a sandbox)",
        "gateway replay",
        "fan-out memory",
    ] {
        let row = named(name);
        // A claim can take under a millisecond: zero is a figure too.
        assert!(row["value"].as_f64().is_some_and(|v| v >= 0.0), "{row}");
        assert!(row["pass"].is_boolean(), "{row}");
    }
    // A baseline is measured beside the rows that have one.
    assert!(
        named("delivery, small repository")["baseline"]
            .as_str()
            .is_some_and(|b| b.contains("p50"))
    );
    assert!(
        named("sandbox start (sortie sandbox exec -- true)")["baseline"]
            .as_str()
            .is_some_and(|b| b.contains("bwrap --unshare-all")),
        "the bare bwrap is measured in the same run"
    );
    // Idle RSS is told in its two halves, which move apart (the binary's pages follow the page cache).
    let idle = named("idle RSS of sortie serve");
    assert!(
        idle["baseline"]
            .as_str()
            .is_some_and(|b| b.starts_with("anonymous ") && b.contains("pages")),
        "{idle}"
    );
    // The quick run attaches 1,000 clients, each of which read the turn's end.
    let fan_out = named("fan-out memory");
    assert!(
        fan_out["baseline"]
            .as_str()
            .is_some_and(|b| b.starts_with("1000 clients") && b.contains("finish")),
        "{fan_out}"
    );
    // The run leaves nothing behind in its work dir: the serve it started is gone with its sandboxes.
    let left: Vec<_> = std::fs::read_dir(work.path()).expect("work dir").collect();
    assert!(left.is_empty(), "{left:?}");
}
