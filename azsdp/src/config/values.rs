//! Parsers for configuration values: sizes, durations, program globs,
//! address prefixes and port ranges. Each returns a message that says what
//! was expected.

use std::net::IpAddr;
use std::time::Duration;

/// `65536`, `"64KiB"`, `"64K"`, `"1MiB"`, `"1M"`, `"1GiB"` (binary multiples).
pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t
        .find(|c: char| !c.is_ascii_digit() && c != '_')
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let num = num.replace('_', "");
    if num.is_empty() {
        return Err(format!(
            "`{s}` is not a size (examples: 4096, \"64KiB\", \"1MiB\")"
        ));
    }
    let n: u64 = num.parse().map_err(|_| format!("`{s}` is too large"))?;
    let mult: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kb" | "kib" => 1 << 10,
        "m" | "mb" | "mib" => 1 << 20,
        "g" | "gb" | "gib" => 1 << 30,
        other => {
            return Err(format!(
                "unknown size unit `{other}` (use B, KiB, MiB or GiB)"
            ));
        }
    };
    n.checked_mul(mult)
        .ok_or_else(|| format!("`{s}` is too large"))
}

/// `"20us"`, `"10ms"`, `"30s"`, `"2m"`; `0` alone means zero.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let t = s.trim();
    if t == "0" {
        return Ok(Duration::ZERO);
    }
    let split = t
        .find(|c: char| !c.is_ascii_digit() && c != '_')
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let num = num.replace('_', "");
    let n: u64 = num
        .parse()
        .map_err(|_| format!("`{s}` is not a duration (examples: \"20us\", \"10ms\", \"30s\")"))?;
    let d = match unit.trim() {
        "ns" => Duration::from_nanos(n),
        "us" | "µs" => Duration::from_micros(n),
        "ms" => Duration::from_millis(n),
        "s" => Duration::from_secs(n),
        "m" | "min" => Duration::from_secs(n.saturating_mul(60)),
        "" => return Err(format!("`{s}` needs a unit (ns, us, ms, s or m)")),
        other => {
            return Err(format!(
                "unknown duration unit `{other}` (use ns, us, ms, s or m)"
            ));
        }
    };
    Ok(d)
}

/// A shell-style glob: `*`, `?`, and `[...]` classes (with `!` negation and ranges).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Glob(String);

impl Glob {
    pub fn new(pattern: &str) -> Result<Glob, String> {
        // Validate the classes once, so matching never meets a broken one.
        let b = pattern.as_bytes();
        let mut i = 0;
        while i < b.len() {
            if b[i] == b'[' {
                let close = b[i + 1..]
                    .iter()
                    .skip(1)
                    .position(|&c| c == b']')
                    .map(|p| i + 2 + p);
                match close {
                    Some(c) => i = c,
                    None => return Err(format!("unclosed `[` in pattern `{pattern}`")),
                }
            }
            i += 1;
        }
        Ok(Glob(pattern.to_string()))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }

    pub fn matches(&self, text: &str) -> bool {
        glob_match(self.0.as_bytes(), text.as_bytes())
    }
}

fn glob_match(p: &[u8], t: &[u8]) -> bool {
    // Iterative matcher with single-star backtracking: linear in practice.
    let (mut pi, mut ti) = (0usize, 0usize);
    let mut star: Option<(usize, usize)> = None;
    while ti < t.len() {
        if pi < p.len() {
            match p[pi] {
                b'*' => {
                    star = Some((pi, ti));
                    pi += 1;
                    continue;
                }
                b'?' => {
                    pi += 1;
                    ti += 1;
                    continue;
                }
                b'[' => {
                    if let Some((ok, next)) = class_match(p, pi, t[ti])
                        && ok
                    {
                        pi = next;
                        ti += 1;
                        continue;
                    }
                }
                c if c == t[ti] => {
                    pi += 1;
                    ti += 1;
                    continue;
                }
                _ => {}
            }
        }
        match star {
            Some((sp, st)) => {
                pi = sp + 1;
                ti = st + 1;
                star = Some((sp, st + 1));
            }
            None => return false,
        }
    }
    p[pi..].iter().all(|&c| c == b'*')
}

/// Match `c` against the class starting at `p[start] == '['`; returns
/// (matched, index after the class).
fn class_match(p: &[u8], start: usize, c: u8) -> Option<(bool, usize)> {
    let mut i = start + 1;
    let negate = p.get(i).is_some_and(|&x| x == b'!' || x == b'^');
    if negate {
        i += 1;
    }
    let mut matched = false;
    let mut first = true;
    while i < p.len() && (first || p[i] != b']') {
        first = false;
        if i + 2 < p.len() && p[i + 1] == b'-' && p[i + 2] != b']' {
            if p[i] <= c && c <= p[i + 2] {
                matched = true;
            }
            i += 3;
        } else {
            if p[i] == c {
                matched = true;
            }
            i += 1;
        }
    }
    if i >= p.len() {
        return None;
    }
    Some((matched != negate, i + 1))
}

/// An address prefix: `10.0.0.0/8`, `::1/128`, or a bare address.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Cidr {
    pub addr: IpAddr,
    pub prefix: u8,
}

impl Cidr {
    pub fn parse(s: &str) -> Result<Cidr, String> {
        let (a, p) = match s.split_once('/') {
            Some((a, p)) => (a, Some(p)),
            None => (s, None),
        };
        let addr: IpAddr = a
            .trim()
            .parse()
            .map_err(|_| format!("`{a}` is not an IPv4 or IPv6 address"))?;
        let max = if addr.is_ipv4() { 32 } else { 128 };
        let prefix = match p {
            None => max,
            Some(p) => p
                .trim()
                .parse::<u8>()
                .ok()
                .filter(|&n| n <= max)
                .ok_or_else(|| format!("prefix length `{p}` must be 0 to {max}"))?,
        };
        Ok(Cidr { addr, prefix })
    }

    pub fn contains(&self, ip: IpAddr) -> bool {
        // An IPv4-mapped IPv6 peer matches IPv4 prefixes.
        let ip = match ip {
            IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, IpAddr::V4),
            v4 => v4,
        };
        match (self.addr, ip) {
            (IpAddr::V4(net), IpAddr::V4(a)) => {
                let mask = u32::MAX
                    .checked_shl(32 - u32::from(self.prefix))
                    .unwrap_or(0);
                u32::from(net) & mask == u32::from(a) & mask
            }
            (IpAddr::V6(net), IpAddr::V6(a)) => {
                let mask = u128::MAX
                    .checked_shl(128 - u32::from(self.prefix))
                    .unwrap_or(0);
                u128::from(net) & mask == u128::from(a) & mask
            }
            _ => false,
        }
    }
}

/// A port or an inclusive port range: `6379`, `"1000-2000"`, `"*"`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PortRange {
    pub lo: u16,
    pub hi: u16,
}

impl PortRange {
    pub fn parse(s: &str) -> Result<PortRange, String> {
        let s = s.trim();
        if s == "*" {
            return Ok(PortRange {
                lo: 0,
                hi: u16::MAX,
            });
        }
        let port = |x: &str| {
            x.trim()
                .parse::<u16>()
                .map_err(|_| format!("`{x}` is not a port (0 to 65535)"))
        };
        let (lo, hi) = match s.split_once('-') {
            Some((a, b)) => (port(a)?, port(b)?),
            None => {
                let p = port(s)?;
                (p, p)
            }
        };
        if lo > hi {
            return Err(format!("port range `{s}` is backwards"));
        }
        Ok(PortRange { lo, hi })
    }

    pub fn contains(&self, p: u16) -> bool {
        self.lo <= p && p <= self.hi
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn sizes() {
        assert_eq!(parse_size("4096"), Ok(4096));
        assert_eq!(parse_size("64KiB"), Ok(65536));
        assert_eq!(parse_size("64k"), Ok(65536));
        assert_eq!(parse_size("1 MiB"), Ok(1 << 20));
        assert_eq!(parse_size("2G"), Ok(2 << 30));
        assert_eq!(parse_size("1_000"), Ok(1000));
        assert!(parse_size("12 parsecs").unwrap_err().contains("unit"));
        assert!(parse_size("MiB").is_err());
        assert!(parse_size("99999999999999999999").is_err());
        assert!(parse_size("17179869184GiB").is_err());
    }

    #[test]
    fn durations() {
        assert_eq!(parse_duration("20us"), Ok(Duration::from_micros(20)));
        assert_eq!(parse_duration("10ms"), Ok(Duration::from_millis(10)));
        assert_eq!(parse_duration("2m"), Ok(Duration::from_secs(120)));
        assert_eq!(parse_duration("0"), Ok(Duration::ZERO));
        assert!(parse_duration("10").unwrap_err().contains("needs a unit"));
        assert!(parse_duration("ten s").is_err());
    }

    #[test]
    fn globs() {
        let g = |p: &str| Glob::new(p).unwrap();
        assert!(g("redis-*").matches("redis-server"));
        assert!(!g("redis-*").matches("redis"));
        assert!(g("*").matches(""));
        assert!(g("iperf?").matches("iperf3"));
        assert!(g("[a-c]at").matches("bat"));
        assert!(!g("[!a-c]at").matches("bat"));
        assert!(g("*.py").matches("http.server.py"));
        assert!(g("a*b*c").matches("axxbyyc"));
        assert!(!g("a*b*c").matches("axxbyy"));
        assert!(Glob::new("[abc").is_err());
    }

    #[test]
    fn cidrs_and_ports() {
        let c = Cidr::parse("10.0.0.0/8").unwrap();
        assert!(c.contains("10.1.2.3".parse().unwrap()));
        assert!(!c.contains("11.1.2.3".parse().unwrap()));
        assert!(c.contains("::ffff:10.9.9.9".parse().unwrap()));
        assert!(
            Cidr::parse("0.0.0.0/0")
                .unwrap()
                .contains("1.2.3.4".parse().unwrap())
        );
        assert!(Cidr::parse("::1").unwrap().contains("::1".parse().unwrap()));
        assert!(Cidr::parse("10.0.0.0/33").is_err());
        assert!(Cidr::parse("ten").is_err());
        assert_eq!(
            PortRange::parse("1000-2000"),
            Ok(PortRange { lo: 1000, hi: 2000 })
        );
        assert!(PortRange::parse("2000-1000").is_err());
        assert!(PortRange::parse("70000").is_err());
        assert!(PortRange::parse("*").unwrap().contains(1));
    }

    proptest! {
        #[test]
        fn glob_never_panics(p in "[a-z*?\\[\\]!-]{0,12}", t in "[a-z]{0,12}") {
            if let Ok(g) = Glob::new(&p) {
                let _ = g.matches(&t);
            }
        }

        #[test]
        fn literal_glob_matches_itself(t in "[a-z0-9._-]{0,16}") {
            prop_assert!(Glob::new(&t).unwrap().matches(&t));
        }
    }
}
