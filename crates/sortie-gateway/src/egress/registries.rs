//! The setup phase's package registries (DESIGN §7.2): no registry hostname is written into sortie;
//! the list comes from configuration, or is derived from the host's own package-manager settings
//! (npm, pip, cargo, apt), so private mirrors just work. Parsers are pure; [`from_host`] reads files.

use std::future::Future;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use crate::egress::proxy::AllowlistSource;
use sortie_protocol::egress::check_host_name;

/// The host of a URL (`scheme://[user@]host[:port]/…`), lowercase, if it is a public DNS name.
pub fn host_of(url: &str) -> Option<String> {
    let url = url.trim().trim_matches(['"', '\'']);
    let url = url.strip_prefix("sparse+").unwrap_or(url);
    let rest = url.split_once("://")?.1;
    let authority = rest.split(['/', '?', '#']).next()?;
    let host = authority.rsplit_once('@').map_or(authority, |(_, host)| host);
    let host = host.rsplit_once(':').map_or(host, |(host, port)| {
        if port.bytes().all(|b| b.is_ascii_digit()) {
            host
        } else {
            authority
        }
    });
    let host = host.to_ascii_lowercase();
    check_host_name(&host).is_ok().then_some(host)
}

fn value_after<'a>(line: &'a str, keys: &[&str]) -> Option<&'a str> {
    let (key, value) = line.split_once(['=', ':'])?;
    let key = key.trim();
    keys.iter()
        .any(|k| key == *k || key.ends_with(&format!(":{k}")))
        .then_some(value.trim())
}

/// `.npmrc`: `registry=…` and `@scope:registry=…`.
pub fn from_npmrc(text: &str) -> Vec<String> {
    text.lines()
        .filter_map(|line| line.split_once('='))
        .filter(|(key, _)| key.trim() == "registry" || key.trim().ends_with(":registry"))
        .filter_map(|(_, url)| host_of(url))
        .collect()
}

/// `pip.conf`: `index-url` and `extra-index-url` (which may list several).
pub fn from_pip_conf(text: &str) -> Vec<String> {
    text.lines()
        .filter_map(|line| value_after(line, &["index-url", "extra-index-url"]))
        .flat_map(|value| value.split_whitespace().filter_map(host_of).collect::<Vec<_>>())
        .collect()
}

/// Cargo's `config.toml`: any `registry`, `index` or `replace-with` URL in it.
pub fn from_cargo_config(text: &str) -> Vec<String> {
    text.lines()
        .filter_map(|line| value_after(line, &["registry", "index"]))
        .filter_map(host_of)
        .collect()
}

/// apt sources: one-line `deb [options] URI suite …` and deb822 `URIs: URI …`.
pub fn from_apt_sources(text: &str) -> Vec<String> {
    let mut hosts = Vec::new();
    for line in text.lines().map(str::trim) {
        if let Some(uris) = line.strip_prefix("URIs:") {
            hosts.extend(uris.split_whitespace().filter_map(host_of));
        } else if line.starts_with("deb ") || line.starts_with("deb-src ") {
            hosts.extend(
                line.split_whitespace()
                    .filter(|word| word.contains("://"))
                    .filter_map(host_of),
            );
        }
    }
    hosts
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_default()
}

/// The registries the host's package managers are configured to use, deduplicated and sorted.
pub fn from_host(home: &Path) -> Vec<String> {
    let mut hosts = Vec::new();
    for path in [
        home.join(".npmrc"),
        PathBuf::from("/etc/npmrc"),
        PathBuf::from("/usr/etc/npmrc"),
    ] {
        hosts.extend(from_npmrc(&read(&path)));
    }
    for variable in ["NPM_CONFIG_REGISTRY", "npm_config_registry", "PIP_INDEX_URL"] {
        if let Ok(url) = std::env::var(variable) {
            hosts.extend(host_of(&url));
        }
    }
    for path in [
        PathBuf::from("/etc/pip.conf"),
        home.join(".config/pip/pip.conf"),
        home.join(".pip/pip.conf"),
    ] {
        hosts.extend(from_pip_conf(&read(&path)));
    }
    let cargo_home = std::env::var("CARGO_HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|_| home.join(".cargo"));
    for path in [cargo_home.join("config.toml"), cargo_home.join("config")] {
        hosts.extend(from_cargo_config(&read(&path)));
    }
    hosts.extend(from_apt_sources(&read(Path::new("/etc/apt/sources.list"))));
    if let Ok(entries) = std::fs::read_dir("/etc/apt/sources.list.d") {
        for entry in entries.flatten() {
            hosts.extend(from_apt_sources(&read(&entry.path())));
        }
    }
    hosts.sort();
    hosts.dedup();
    hosts
}

/// A session's allowlist plus, until [`PhasedAllowlist::end_setup`], the setup phase's extra hosts
/// (the registries and the forge host).
pub struct PhasedAllowlist {
    inner: Arc<dyn AllowlistSource>,
    setup_hosts: Vec<String>,
    in_setup: AtomicBool,
}

impl PhasedAllowlist {
    pub fn new(inner: Arc<dyn AllowlistSource>, setup_hosts: Vec<String>) -> Arc<Self> {
        Arc::new(Self {
            inner,
            setup_hosts,
            in_setup: AtomicBool::new(true),
        })
    }

    /// The agent phase begins: only the session's own allowlist from now on.
    pub fn end_setup(&self) {
        self.in_setup.store(false, Ordering::SeqCst);
    }
}

impl AllowlistSource for PhasedAllowlist {
    fn allowlist(&self) -> Pin<Box<dyn Future<Output = Vec<String>> + Send + '_>> {
        Box::pin(async move {
            let mut list = self.inner.allowlist().await;
            if self.in_setup.load(Ordering::SeqCst) {
                list.extend(self.setup_hosts.iter().cloned());
            }
            list
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::egress::proxy::FixedAllowlist;

    #[test]
    fn urls_yield_public_hosts_only() {
        assert_eq!(
            host_of("https://npm.mirror.corp-example.com/repository/npm/"),
            Some("npm.mirror.corp-example.com".into())
        );
        assert_eq!(
            host_of("sparse+https://Cargo.Mirror.Dev-Example.org/index/"),
            Some("cargo.mirror.dev-example.org".into())
        );
        assert_eq!(
            host_of("https://user:pw@pkgs.build-example.net:8443/simple"),
            Some("pkgs.build-example.net".into())
        );
        for internal in [
            "http://localhost:4873/",
            "http://10.0.0.5/pypi",
            "http://nexus/",
            "not a url",
            "http://mirror.local/",
        ] {
            assert_eq!(host_of(internal), None, "{internal}");
        }
    }

    #[test]
    fn each_package_manager_format_is_read() {
        let npmrc = "registry=https://npm.one-example.com/\n@corp:registry=https://npm.two-example.com/\n//npm.one-example.com/:_authToken=secret\n";
        assert_eq!(
            from_npmrc(npmrc),
            vec!["npm.one-example.com".to_owned(), "npm.two-example.com".to_owned()]
        );
        let pip = "[global]\nindex-url = https://pypi.one-example.com/simple\nextra-index-url = https://pypi.two-example.com/simple https://pypi.three-example.com/simple\n";
        assert_eq!(
            from_pip_conf(pip),
            vec!["pypi.one-example.com", "pypi.two-example.com", "pypi.three-example.com"]
        );
        let cargo = "[source.mirror]\nregistry = \"sparse+https://crates.one-example.com/index/\"\n[registries.corp]\nindex = \"https://crates.two-example.com/git/index\"\n";
        assert_eq!(
            from_cargo_config(cargo),
            vec!["crates.one-example.com", "crates.two-example.com"]
        );
        let apt = "deb [signed-by=/x.gpg] https://deb.one-example.com/debian bookworm main\n# deb https://commented.example.com/ x\nTypes: deb\nURIs: https://deb.two-example.com/debian https://deb.three-example.com/debian\n";
        assert_eq!(
            from_apt_sources(apt),
            vec!["deb.one-example.com", "deb.two-example.com", "deb.three-example.com"]
        );
    }

    #[tokio::test]
    async fn registries_are_allowed_only_during_setup() {
        let session = FixedAllowlist::new(vec!["api.one-example.com".into()]);
        let phased = PhasedAllowlist::new(session, vec!["npm.one-example.com".into()]);
        assert_eq!(
            phased.allowlist().await,
            vec!["api.one-example.com".to_owned(), "npm.one-example.com".to_owned()]
        );
        phased.end_setup();
        assert_eq!(phased.allowlist().await, vec!["api.one-example.com".to_owned()]);
    }
}
