//! The egress allowlist rules (DESIGN §4): each entry is one exact public DNS name.
//!
//! The gateway resolves only names that pass these rules, so anything that could name a private,
//! local or wildcard destination is refused here, before it is ever stored. Once a name resolves, every
//! address it gives must be public ([`forbidden_address`]) unless an operator exempted its range.

use std::collections::HashSet;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use serde::{Deserialize, Serialize};

use crate::limits::EGRESS_ALLOW_MAX_ENTRIES;

/// One refused entry and why, as returned in `details.entries` of `EGRESS_ALLOWLIST_INVALID`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct AllowlistViolation {
    /// The entry as it was sent.
    pub entry: String,
    /// Its position in the list, 0-based.
    pub index: usize,
    /// A sentence saying what is wrong with it.
    pub reason: String,
}

/// Top-level names that never lead to a public host (special-use and private-use suffixes).
const NON_PUBLIC_SUFFIXES: &[&str] = &[
    "localhost",
    "local",
    "internal",
    "localdomain",
    "lan",
    "home",
    "corp",
    "intranet",
    "private",
    "arpa",
    "invalid",
    "test",
    "example",
    "onion",
];

const MAX_NAME_LEN: usize = 253;
const MAX_LABEL_LEN: usize = 63;

/// Checks a whole allowlist. Returns every offending entry with its reason, not just the first.
pub fn validate_allowlist(entries: &[String]) -> Result<(), Vec<AllowlistViolation>> {
    let mut violations = Vec::new();
    let mut seen = HashSet::new();
    for (index, entry) in entries.iter().enumerate() {
        let reason = if index >= EGRESS_ALLOW_MAX_ENTRIES {
            Some(format!(
                "the allowlist has more than {EGRESS_ALLOW_MAX_ENTRIES} entries"
            ))
        } else if let Err(reason) = check_host_name(entry) {
            Some(reason)
        } else if !seen.insert(entry.as_str()) {
            Some("duplicate entry".to_owned())
        } else {
            None
        };
        if let Some(reason) = reason {
            violations.push(AllowlistViolation {
                entry: entry.clone(),
                index,
                reason,
            });
        }
    }
    if violations.is_empty() { Ok(()) } else { Err(violations) }
}

/// Checks one entry: an exact, lowercase, public DNS name of at least two labels.
pub fn check_host_name(entry: &str) -> Result<(), String> {
    if entry.is_empty() {
        return Err("empty entry".into());
    }
    if entry.contains("://") {
        return Err("a host name only: no scheme such as https://".into());
    }
    if entry.contains('*') {
        return Err("wildcards are not allowed: list each host exactly".into());
    }
    if entry.starts_with('[') || entry.parse::<Ipv6Addr>().is_ok() {
        return Err("IP address literals are not allowed: use a DNS name".into());
    }
    if entry.contains('/') {
        return Err("a host name only: no path".into());
    }
    if entry.contains('@') {
        return Err("a host name only: no user information".into());
    }
    if entry.contains(':') {
        return Err("a host name only: no port (every port of an allowed host is reachable through the proxy)".into());
    }
    if entry.parse::<Ipv4Addr>().is_ok() {
        return Err("IP address literals are not allowed: use a DNS name".into());
    }
    if entry.bytes().any(|b| b.is_ascii_uppercase()) {
        return Err("host names must be lowercase".into());
    }
    if let Some(bad) = entry
        .chars()
        .find(|c| !(c.is_ascii_lowercase() || c.is_ascii_digit() || *c == '-' || *c == '.'))
    {
        return Err(format!(
            "character {bad:?} is not allowed: only lowercase letters, digits, hyphens and dots"
        ));
    }
    if entry.len() > MAX_NAME_LEN {
        return Err(format!("longer than {MAX_NAME_LEN} characters"));
    }
    let labels: Vec<&str> = entry.split('.').collect();
    if labels.iter().any(|label| label.is_empty()) {
        return Err("empty label (a leading, trailing or doubled dot)".into());
    }
    if labels.len() < 2 {
        return Err("a single-label name is not a public host: use the full name".into());
    }
    for label in &labels {
        if label.len() > MAX_LABEL_LEN {
            return Err(format!("label {label:?} is longer than {MAX_LABEL_LEN} characters"));
        }
        if label.starts_with('-') || label.ends_with('-') {
            return Err(format!("label {label:?} starts or ends with a hyphen"));
        }
    }
    let top = labels[labels.len() - 1];
    if top.bytes().all(|b| b.is_ascii_digit()) {
        return Err("the top-level label is numeric: this is not a DNS name".into());
    }
    if NON_PUBLIC_SUFFIXES.contains(&top) {
        return Err(format!(".{top} names are not public hosts"));
    }
    Ok(())
}

// Addresses: what may be connected to once a name resolved (the egress proxy, webhook deliveries).

/// An address range, e.g. `127.0.0.1/32`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Cidr {
    pub network: IpAddr,
    pub prefix: u8,
}

impl Cidr {
    /// Parses `ADDRESS/PREFIX` (a bare address is a single host).
    pub fn parse(text: &str) -> Option<Self> {
        let (address, prefix) = match text.split_once('/') {
            Some((address, prefix)) => (address, Some(prefix.parse::<u8>().ok()?)),
            None => (text, None),
        };
        let network: IpAddr = address.parse().ok()?;
        let max = if network.is_ipv4() { 32 } else { 128 };
        let prefix = prefix.unwrap_or(max);
        (prefix <= max).then_some(Self { network, prefix })
    }

    pub fn contains(&self, ip: IpAddr) -> bool {
        match (self.network, ip) {
            (IpAddr::V4(network), IpAddr::V4(ip)) => {
                let mask = if self.prefix == 0 {
                    0
                } else {
                    u32::MAX << (32 - u32::from(self.prefix))
                };
                u32::from(network) & mask == u32::from(ip) & mask
            }
            (IpAddr::V6(network), IpAddr::V6(ip)) => {
                let mask = if self.prefix == 0 {
                    0
                } else {
                    u128::MAX << (128 - u32::from(self.prefix))
                };
                u128::from(network) & mask == u128::from(ip) & mask
            }
            _ => false,
        }
    }
}

/// Why `ip` may not be connected to, if it may not.
pub fn forbidden_address(ip: IpAddr, exempt: &[Cidr]) -> Option<&'static str> {
    if exempt.iter().any(|cidr| cidr.contains(ip)) {
        return None;
    }
    match ip {
        IpAddr::V4(v4) => forbidden_v4(v4),
        IpAddr::V6(v6) => {
            // An IPv4-mapped or -compatible address is the IPv4 address it carries.
            if let Some(v4) = v6.to_ipv4_mapped() {
                return forbidden_address(IpAddr::V4(v4), exempt);
            }
            forbidden_v6(v6)
        }
    }
}

fn forbidden_v4(ip: Ipv4Addr) -> Option<&'static str> {
    let [a, b, ..] = ip.octets();
    if ip == Ipv4Addr::new(169, 254, 169, 254) {
        return Some("a cloud metadata address");
    }
    if ip.is_loopback() {
        return Some("a loopback address");
    }
    if ip.is_private() {
        return Some("a private address");
    }
    if ip.is_link_local() {
        return Some("a link-local address");
    }
    if ip.is_multicast() || ip.is_broadcast() {
        return Some("a multicast or broadcast address");
    }
    if ip.is_unspecified() || a == 0 {
        return Some("an unspecified address");
    }
    if a == 100 && (64..128).contains(&b) {
        return Some("a carrier-grade NAT address");
    }
    if a >= 240 || (a == 192 && b == 0 && ip.octets()[2] == 0) || (a == 198 && (b == 18 || b == 19)) {
        return Some("a reserved address");
    }
    None
}

fn forbidden_v6(ip: Ipv6Addr) -> Option<&'static str> {
    let first = ip.segments()[0];
    if ip == Ipv6Addr::new(0xfd00, 0xec2, 0, 0, 0, 0, 0, 0x254) {
        return Some("a cloud metadata address");
    }
    if ip.is_loopback() {
        return Some("a loopback address");
    }
    if ip.is_unspecified() {
        return Some("an unspecified address");
    }
    if ip.is_multicast() {
        return Some("a multicast address");
    }
    if first & 0xfe00 == 0xfc00 {
        return Some("a unique-local (private) address");
    }
    if first & 0xffc0 == 0xfe80 {
        return Some("a link-local address");
    }
    // NAT64, 6to4 and Teredo can wrap any IPv4 address; IPv4-compatible is deprecated.
    if first == 0x0064 || first == 0x2002 || (first == 0x2001 && ip.segments()[1] == 0) || ip.to_ipv4().is_some() {
        return Some("an address that embeds an IPv4 address");
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn one(entry: &str) -> Result<(), Vec<AllowlistViolation>> {
        validate_allowlist(&[entry.to_owned()])
    }

    #[test]
    fn good_forms_are_accepted() {
        for good in [
            "github.com",
            "api.github.com",
            "registry.example-mirror.io",
            "a.b.c.d.e.f.example.org",
            "x1.co",
            "xn--bcher-kva.de",
            "example.org",
            "0.pool.ntp.org",
        ] {
            assert_eq!(one(good), Ok(()), "{good} should be accepted");
        }
        let full: Vec<String> = (0..EGRESS_ALLOW_MAX_ENTRIES)
            .map(|i| format!("host{i}.example.com"))
            .collect();
        assert_eq!(validate_allowlist(&full), Ok(()));
        assert_eq!(validate_allowlist(&[]), Ok(()));
    }

    #[test]
    fn bad_forms_are_refused_with_the_entry_named() {
        let long_label = format!("{}.com", "a".repeat(64));
        let long_name = format!("{}.com", ["abcdefghij"; 25].join("."));
        let bad = [
            ("", "empty"),
            ("*.github.com", "wildcard"),
            ("*", "wildcard"),
            ("https://github.com", "scheme"),
            ("github.com:443", "port"),
            ("github.com/org/repo", "path"),
            ("user@github.com", "user information"),
            ("10.0.0.1", "IP address"),
            ("169.254.169.254", "IP address"),
            ("::1", "IP address"),
            ("[::1]", "IP address"),
            ("fd00::1", "IP address"),
            ("localhost", "single-label"),
            ("foo.localhost", ".localhost"),
            ("printer.local", ".local"),
            ("metadata.google.internal", ".internal"),
            ("intranet", "single-label"),
            (".github.com", "empty label"),
            ("github.com.", "empty label"),
            ("github..com", "empty label"),
            ("-github.com", "hyphen"),
            ("github-.com", "hyphen"),
            (long_label.as_str(), "longer than 63"),
            (long_name.as_str(), "longer than 253"),
            ("GitHub.com", "lowercase"),
            ("git_hub.com", "not allowed"),
            ("git hub.com", "not allowed"),
            ("bücher.de", "not allowed"),
            ("1.2.3", "numeric"),
            ("example.123", "numeric"),
            ("reverse.in-addr.arpa", ".arpa"),
        ];
        for (entry, reason_part) in bad {
            let violations = one(entry).expect_err(entry);
            assert_eq!(violations.len(), 1, "{entry}");
            assert_eq!(violations[0].entry, entry);
            assert_eq!(violations[0].index, 0);
            assert!(
                violations[0].reason.contains(reason_part),
                "{entry:?}: reason {:?} should mention {reason_part:?}",
                violations[0].reason
            );
        }
    }

    #[test]
    fn duplicates_name_the_second_occurrence() {
        let list = vec![
            "github.com".to_owned(),
            "example.org".to_owned(),
            "github.com".to_owned(),
        ];
        let violations = validate_allowlist(&list).expect_err("duplicate");
        assert_eq!(violations.len(), 1);
        assert_eq!((violations[0].entry.as_str(), violations[0].index), ("github.com", 2));
        assert!(violations[0].reason.contains("duplicate"));
    }

    #[test]
    fn thirty_three_entries_refuse_the_extra_one() {
        let list: Vec<String> = (0..EGRESS_ALLOW_MAX_ENTRIES + 1)
            .map(|i| format!("host{i}.example.com"))
            .collect();
        let violations = validate_allowlist(&list).expect_err("too many");
        assert_eq!(violations.len(), 1);
        assert_eq!(violations[0].index, EGRESS_ALLOW_MAX_ENTRIES);
        assert_eq!(violations[0].entry, "host32.example.com");
    }

    #[test]
    fn every_offending_entry_is_reported_not_just_the_first() {
        let list = vec![
            "*.a.com".to_owned(),
            "ok.com".to_owned(),
            "localhost".to_owned(),
            "10.1.1.1".to_owned(),
        ];
        let violations = validate_allowlist(&list).expect_err("bad");
        let named: Vec<usize> = violations.iter().map(|v| v.index).collect();
        assert_eq!(named, vec![0, 2, 3]);
    }
}
