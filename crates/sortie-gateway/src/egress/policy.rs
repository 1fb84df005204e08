//! Who may be reached (DESIGN §7.2), without I/O: a name must be on the session's allowlist (checked
//! before it is resolved), and every address it resolves to must be public — no private, loopback,
//! link-local, multicast, CGNAT, metadata or otherwise special address, unless the operator exempted
//! a CIDR (an internal registry; tests use it to reach servers on this machine).

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

/// A refused destination and the one-line reason the agent reads.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Denial {
    pub host: String,
    pub port: u16,
    pub reason: String,
}

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
