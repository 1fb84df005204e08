//! The allowlist and host rules on arbitrary strings: `check_host_name` and `validate_allowlist`
//! (sortie-protocol) and the gateway's per-request `check_name`, `Cidr` and `forbidden_address`
//! never panic, and what they accept has the properties the proxy relies on.
//!
//! The input is lines: the first is the requested host, the rest the allowlist.

#![no_main]

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use libfuzzer_sys::fuzz_target;
use sortie_gateway::egress::policy::{Cidr, check_name, forbidden_address};
use sortie_protocol::egress::{check_host_name, validate_allowlist};

/// Top-level names `check_host_name` must never accept (a sample of its list).
const NEVER_PUBLIC: &[&str] = &["localhost", "local", "internal", "test", "invalid", "arpa", "onion"];

fn check_accepted_name(entry: &str) {
    assert!(!entry.is_empty() && entry.len() <= 253, "{entry:?}");
    assert!(
        entry
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'.'),
        "{entry:?}"
    );
    assert!(
        entry.parse::<IpAddr>().is_err(),
        "an IP literal was accepted: {entry:?}"
    );
    let labels: Vec<&str> = entry.split('.').collect();
    assert!(labels.len() >= 2, "{entry:?}");
    for label in &labels {
        assert!(!label.is_empty() && label.len() <= 63, "{entry:?}");
        assert!(!label.starts_with('-') && !label.ends_with('-'), "{entry:?}");
    }
    let top = labels[labels.len() - 1];
    assert!(!top.bytes().all(|b| b.is_ascii_digit()), "{entry:?}");
    assert!(!NEVER_PUBLIC.contains(&top), "{entry:?}");
}

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    let mut lines = text.split('\n');
    let host = lines.next().unwrap_or_default();
    let entries: Vec<String> = lines.map(str::to_owned).collect();

    if check_host_name(host).is_ok() {
        check_accepted_name(host);
    }
    match validate_allowlist(&entries) {
        Ok(()) => {
            assert!(entries.len() <= 32);
            for (index, entry) in entries.iter().enumerate() {
                check_accepted_name(entry);
                assert!(!entries[..index].contains(entry), "a duplicate was accepted");
            }
        }
        Err(violations) => {
            assert!(!violations.is_empty());
            assert!(violations.windows(2).all(|w| w[0].index < w[1].index));
            for violation in &violations {
                assert_eq!(entries.get(violation.index), Some(&violation.entry));
                assert!(!violation.reason.is_empty());
            }
        }
    }

    // The proxy's check per request: only a listed name passes, never an address.
    if check_name(host, 443, &entries).is_ok() {
        let normalised = host.trim_end_matches('.').to_ascii_lowercase();
        assert!(entries.contains(&normalised), "{host:?} passed without being listed");
        assert!(normalised.parse::<IpAddr>().is_err() && !normalised.starts_with('['));
    }

    // Exempt ranges and the address vetting behind every resolution.
    let exempt: Vec<Cidr> = entries.iter().filter_map(|e| Cidr::parse(e)).collect();
    if let Some(cidr) = Cidr::parse(host) {
        assert!(cidr.prefix <= if cidr.network.is_ipv4() { 32 } else { 128 });
        assert!(cidr.contains(cidr.network));
    }
    if data.len() >= 16 {
        let mut octets = [0_u8; 16];
        octets.copy_from_slice(&data[..16]);
        let v6 = Ipv6Addr::from(octets);
        let _ = forbidden_address(IpAddr::V6(v6), &exempt);
        let v4 = Ipv4Addr::new(octets[0], octets[1], octets[2], octets[3]);
        assert_eq!(
            forbidden_address(IpAddr::V6(v4.to_ipv6_mapped()), &[]),
            forbidden_address(IpAddr::V4(v4), &[]),
            "an IPv4-mapped address is judged as the IPv4 address"
        );
        let [a, b, ..] = v4.octets();
        let never_public_v4 = v4.is_private()
            || v4.is_loopback()
            || v4.is_link_local()
            || v4.is_broadcast()
            || v4.is_unspecified()
            || v4.is_multicast()
            || a == 0
            || (a == 100 && (64..128).contains(&b));
        if never_public_v4 {
            assert!(forbidden_address(IpAddr::V4(v4), &[]).is_some(), "{v4} is not vetted");
        }
        let first = v6.segments()[0];
        let never_public_v6 = v6.is_loopback()
            || v6.is_unspecified()
            || v6.is_multicast()
            || first & 0xfe00 == 0xfc00
            || first & 0xffc0 == 0xfe80;
        if never_public_v6 {
            assert!(forbidden_address(IpAddr::V6(v6), &[]).is_some(), "{v6} is not vetted");
        }
    }
});
