//! Who may be reached (DESIGN §7.2), without I/O: a name must be on the session's allowlist (checked
//! before it is resolved), and every address it resolves to must be public — no private, loopback,
//! link-local, multicast, CGNAT, metadata or otherwise special address, unless the operator exempted
//! a CIDR (an internal registry; tests use it to reach servers on this machine).

use std::net::IpAddr;

pub use sortie_protocol::egress::{Cidr, forbidden_address};

/// A refused destination and the one-line reason the agent reads.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Denial {
    pub host: String,
    pub port: u16,
    pub reason: String,
}

/// Checks a requested host (before any resolution) against the allowlist.
pub fn check_name(host: &str, port: u16, allowlist: &[String]) -> Result<(), Denial> {
    let deny = |reason: &str| {
        Err(Denial {
            host: host.to_owned(),
            port,
            reason: reason.to_owned(),
        })
    };
    let host = host.trim_end_matches('.').to_ascii_lowercase();
    if host.parse::<IpAddr>().is_ok() || host.starts_with('[') {
        return deny("IP addresses are not allowed; ask for the host by its name");
    }
    if !allowlist.contains(&host) {
        return deny("the host is not on this session's egress allowlist");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(text: &str) -> IpAddr {
        text.parse().expect("ip")
    }

    #[test]
    fn names_must_be_on_the_allowlist() {
        let allow = vec!["example.org".to_owned(), "github.com".to_owned()];
        assert_eq!(check_name("example.org", 443, &allow), Ok(()));
        assert_eq!(check_name("Example.ORG.", 443, &allow), Ok(()));
        for (host, part) in [
            ("evil.com", "not on"),
            ("api.github.com", "not on"),
            ("10.0.0.1", "IP addresses"),
            ("[::1]", "IP addresses"),
            ("::1", "IP addresses"),
        ] {
            let denial = check_name(host, 443, &allow).expect_err(host);
            assert!(denial.reason.contains(part), "{host}: {}", denial.reason);
        }
    }

    #[test]
    fn special_addresses_are_refused() {
        for bad in [
            "127.0.0.1",
            "127.1.2.3",
            "10.0.0.1",
            "172.16.5.4",
            "192.168.1.1",
            "169.254.169.254",
            "169.254.1.1",
            "100.64.0.1",
            "224.0.0.1",
            "255.255.255.255",
            "0.0.0.0",
            "0.1.2.3",
            "240.0.0.1",
            "198.18.0.1",
            "::1",
            "::",
            "fc00::1",
            "fd12:3456::1",
            "fe80::1",
            "ff02::1",
            "::ffff:127.0.0.1",
            "::ffff:10.1.1.1",
            "64:ff9b::a00:1",
            "2002:a00:1::",
            "2001:0::1",
            "fd00:ec2::254",
        ] {
            assert!(forbidden_address(ip(bad), &[]).is_some(), "{bad} must be refused");
        }
        for good in [
            "93.184.216.34",
            "140.82.112.3",
            "2606:4700::1111",
            "::ffff:93.184.216.34",
        ] {
            assert_eq!(forbidden_address(ip(good), &[]), None, "{good} is public");
        }
    }

    #[test]
    fn exempted_ranges_pass() {
        let exempt = [
            Cidr::parse("127.0.0.1/32").expect("cidr"),
            Cidr::parse("10.20.0.0/16").expect("cidr"),
        ];
        assert_eq!(forbidden_address(ip("127.0.0.1"), &exempt), None);
        assert_eq!(forbidden_address(ip("10.20.3.4"), &exempt), None);
        assert!(forbidden_address(ip("127.0.0.2"), &exempt).is_some());
        assert!(forbidden_address(ip("10.21.0.1"), &exempt).is_some());
        assert_eq!(
            Cidr::parse("::1"),
            Some(Cidr {
                network: ip("::1"),
                prefix: 128
            })
        );
        assert_eq!(Cidr::parse("10.0.0.0/33"), None);
        assert_eq!(Cidr::parse("nope"), None);
    }
}
