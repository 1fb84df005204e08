//! Builds the dashboard in `web/` with the host's npm (`npm ci` when the lockfile changed, then
//! `npm run build` into OUT_DIR) and writes the manifest that embeds every built file.
//! `SORTIE_WEB_SKIP=1` embeds a one-line placeholder page instead (for hosts without Node.js).

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;

fn main() {
    let manifest_dir = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR"));
    let out_dir = PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    let web = manifest_dir.join("../../web");
    let web = web.canonicalize().unwrap_or(web);
    for input in [
        "src",
        "index.html",
        "package.json",
        "package-lock.json",
        "vite.config.ts",
        "tsconfig.json",
        "public",
    ] {
        // A path that does not exist would make cargo rerun this script on every build.
        if web.join(input).exists() {
            println!("cargo:rerun-if-changed={}", web.join(input).display());
        }
    }
    println!("cargo:rerun-if-env-changed=SORTIE_WEB_SKIP");

    let dist = out_dir.join("dist");
    if std::env::var_os("SORTIE_WEB_SKIP").is_some_and(|v| v == "1") {
        let _ = std::fs::remove_dir_all(&dist);
        std::fs::create_dir_all(&dist).expect("create OUT_DIR/dist");
        std::fs::write(
            dist.join("index.html"),
            "<!doctype html><title>sortie</title><p>This sortie was built with SORTIE_WEB_SKIP=1: no dashboard.</p>\n",
        )
        .expect("write the placeholder page");
    } else {
        build_with_npm(&web, &dist);
    }
    write_manifest(&dist, &out_dir.join("assets.rs"));
}

fn npm() -> Command {
    Command::new(if cfg!(windows) { "npm.cmd" } else { "npm" })
}

fn run(what: &str, command: &mut Command) {
    let status = match command.status() {
        Ok(status) => status,
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => panic!(
            "\n\nsortie's dashboard (web/) is built with npm, and npm was not found on PATH: install Node.js 20 or \
             newer with npm (or set SORTIE_WEB_SKIP=1 to build without the dashboard).\n"
        ),
        Err(error) => panic!("\n\ncannot run `{what}` for the dashboard in web/: {error}\n"),
    };
    if !status.success() {
        panic!("\n\n`{what}` in web/ failed ({status}); its output is above.\n");
    }
}

fn modified(path: &Path) -> Option<std::time::SystemTime> {
    std::fs::metadata(path).and_then(|m| m.modified()).ok()
}

fn build_with_npm(web: &Path, dist: &Path) {
    // npm leaves node_modules/.package-lock.json behind; an older one than the lockfile means reinstall.
    let installed = modified(&web.join("node_modules/.package-lock.json"));
    let locked = modified(&web.join("package-lock.json"));
    if installed.is_none() || installed < locked {
        // The host's npm settings (registry, cache, proxy from .npmrc and npm_config_*) apply as they are.
        run(
            "npm ci",
            npm()
                .current_dir(web)
                .args(["ci", "--no-audit", "--no-fund", "--loglevel=error"]),
        );
    }
    run(
        "npm run build",
        npm()
            .current_dir(web)
            .args(["run", "build", "--", "--outDir"])
            .arg(dist)
            .args(["--emptyOutDir", "--logLevel", "warn"]),
    );
}

fn collect(dir: &Path, root: &Path, files: &mut Vec<(String, PathBuf)>) {
    let mut entries: Vec<_> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", dir.display()))
        .map(|entry| entry.expect("a directory entry").path())
        .collect();
    entries.sort();
    for path in entries {
        if path.is_dir() {
            collect(&path, root, files);
        } else {
            let relative = path.strip_prefix(root).expect("under the root");
            let url = format!("/{}", relative.to_string_lossy().replace('\\', "/"));
            files.push((url, path));
        }
    }
}

fn write_manifest(dist: &Path, manifest: &Path) {
    let mut files = Vec::new();
    collect(dist, dist, &mut files);
    assert!(
        files.iter().any(|(url, _)| url == "/index.html"),
        "the dashboard build left no index.html in {}",
        dist.display()
    );
    let mut out = String::from(
        "/// Every built file of the dashboard: its URL path and its bytes.\npub static ASSETS: &[(&str, &[u8])] = &[\n",
    );
    for (url, path) in files {
        writeln!(out, "    ({url:?}, include_bytes!({:?})),", path.display().to_string()).expect("write to a String");
    }
    out.push_str("];\n");
    std::fs::write(manifest, out).expect("write the assets manifest");
}
