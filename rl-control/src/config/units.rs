//! The small value languages of the rule file: durations (`"10s"`, `"1h"`),
//! byte sizes (`"10MB"`, `"1GiB"`), CIDRs and port ranges. Each parser returns
//! a message that says what is allowed; the caller adds the place.

use std::net::IpAddr;

/// Seconds in a duration written `<whole number><unit>`, unit `s`, `m`, `h`
/// or `d` (`"1s"`, `"90s"`, `"10m"`, `"1d"`).
pub fn parse_duration(text: &str) -> Result<u64, String> {
    let allowed = "write a whole number of seconds, minutes, hours or days, e.g. \"1s\", \"10s\", \"1m\", \"1h\", \"1d\"";
    let (n, unit_secs) = whole_with_unit(
        text,
        &[("s", 1), ("m", 60), ("h", 3600), ("d", 86_400)],
        allowed,
    )?;
    if n == 0 {
        return Err(format!(
            "\"{text}\" is zero: a limit needs a period of at least 1s"
        ));
    }
    n.checked_mul(unit_secs)
        .filter(|&s| s <= 366 * 86_400)
        .ok_or_else(|| format!("\"{text}\" is too long: at most 366 days"))
}

/// Milliseconds in a short duration: `<n>ms`, `<n>s` or `<n>m` (at least
/// 1 ms, at most `max_ms`), for timers such as `[cluster] sync_interval`.
pub fn parse_millis(text: &str, max_ms: u64) -> Result<u64, String> {
    let allowed = "write a whole number of milliseconds, seconds or minutes, e.g. \"50ms\", \"1s\"";
    let (n, unit_ms) = whole_with_unit(text, &[("ms", 1), ("s", 1000), ("m", 60_000)], allowed)?;
    match n.checked_mul(unit_ms) {
        Some(0) => Err(format!("\"{text}\" is zero: at least 1ms")),
        Some(ms) if ms <= max_ms => Ok(ms),
        _ => Err(format!("\"{text}\" is too long: at most {max_ms}ms")),
    }
}

/// `text` as a whole number and one of `units` (its name and multiplier):
/// the number and the multiplier, else "not a duration" and `allowed`.
fn whole_with_unit(text: &str, units: &[(&str, u64)], allowed: &str) -> Result<(u64, u64), String> {
    let t = text.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let not_one = || format!("\"{text}\" is not a duration: {allowed}");
    let &(_, mult) = units
        .iter()
        .find(|(name, _)| *name == unit.trim())
        .ok_or_else(not_one)?;
    let n = num.parse().map_err(|_| not_one())?;
    Ok((n, mult))
}

/// Bytes in a size: an integer (bytes) or `<number><unit>` with unit `B`,
/// `KB`/`MB`/`GB`/`TB` (powers of 1000) or `KiB`/`MiB`/`GiB`/`TiB` (powers of
/// 1024). A fractional number is allowed when the result is whole bytes.
pub fn parse_size(text: &str) -> Result<u64, String> {
    let allowed = "write bytes as an integer or with a unit: B, KB, MB, GB, TB (×1000) or KiB, MiB, GiB, TiB (×1024), e.g. \"10MB\"";
    let t = text.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let mult: u64 = match unit.trim() {
        "" | "B" => 1,
        "KB" | "kB" => 1_000,
        "MB" => 1_000_000,
        "GB" => 1_000_000_000,
        "TB" => 1_000_000_000_000,
        "KiB" => 1 << 10,
        "MiB" => 1 << 20,
        "GiB" => 1 << 30,
        "TiB" => 1 << 40,
        _ => return Err(format!("\"{text}\" is not a size: {allowed}")),
    };
    let bytes = if let Some((whole, frac)) = num.split_once('.') {
        let whole: u64 = whole
            .parse()
            .map_err(|_| format!("\"{text}\" is not a size: {allowed}"))?;
        if frac.is_empty() || frac.len() > 9 || !frac.bytes().all(|b| b.is_ascii_digit()) {
            return Err(format!("\"{text}\" is not a size: {allowed}"));
        }
        let scale = 10u64.pow(frac.len() as u32);
        let frac: u64 = frac.parse().expect("digits");
        let frac_bytes = (frac as u128 * mult as u128) / scale as u128;
        if !(frac as u128 * mult as u128).is_multiple_of(scale as u128) {
            return Err(format!("\"{text}\" is not a whole number of bytes"));
        }
        whole
            .checked_mul(mult)
            .and_then(|w| w.checked_add(frac_bytes as u64))
    } else {
        let n: u64 = num
            .parse()
            .map_err(|_| format!("\"{text}\" is not a size: {allowed}"))?;
        n.checked_mul(mult)
    };
    match bytes {
        Some(0) => Err(format!(
            "\"{text}\" is zero: a byte limit needs at least 1 byte"
        )),
        Some(b) => Ok(b),
        None => Err(format!("\"{text}\" is too large")),
    }
}

/// An address block: the network address (host bits zero) and prefix length.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Cidr {
    pub addr: IpAddr,
    pub len: u8,
}

impl Cidr {
    /// The longest prefix length of this family (32 or 128).
    pub fn max_len(&self) -> u8 {
        if self.addr.is_ipv4() {
            32
        } else {
            128
        }
    }

    /// The address bytes (4 or 16).
    pub fn octets(&self) -> Vec<u8> {
        match self.addr {
            IpAddr::V4(a) => a.octets().to_vec(),
            IpAddr::V6(a) => a.octets().to_vec(),
        }
    }

    /// The one-address CIDR of `addr` (/32 or /128).
    pub fn host(addr: IpAddr) -> Cidr {
        Cidr {
            addr,
            len: if addr.is_ipv4() { 32 } else { 128 },
        }
    }

    /// Whether `self` contains every address of `other`.
    pub fn covers(&self, other: &Cidr) -> bool {
        self.addr.is_ipv4() == other.addr.is_ipv4()
            && self.len <= other.len
            && mask(&other.octets(), self.len) == self.octets()
    }
}

impl std::fmt::Display for Cidr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.addr, self.len)
    }
}

/// `bytes` with everything after the first `len` bits cleared.
pub fn mask(bytes: &[u8], len: u8) -> Vec<u8> {
    bytes
        .iter()
        .enumerate()
        .map(|(i, b)| {
            let keep = (len as i32 - 8 * i as i32).clamp(0, 8);
            if keep == 0 {
                0
            } else {
                b & (0xffu8 << (8 - keep))
            }
        })
        .collect()
}

/// `"198.51.100.0/24"`, `"2001:db8::/32"`, or a bare address (a /32 or /128).
/// Host bits must be zero: `10.0.0.1/8` is more likely a typo than an intent.
pub fn parse_cidr(text: &str) -> Result<Cidr, String> {
    let allowed = "write an IPv4 or IPv6 network such as \"198.51.100.0/24\" or \"2001:db8::/32\"";
    let (addr, len) = match text.split_once('/') {
        Some((a, l)) => (a, Some(l)),
        None => (text, None),
    };
    let addr: IpAddr = addr
        .trim()
        .parse()
        .map_err(|_| format!("\"{text}\" is not a CIDR: {allowed}"))?;
    let max = if addr.is_ipv4() { 32 } else { 128 };
    let len = match len {
        None => max,
        Some(l) => match l.trim().parse::<u8>() {
            Ok(n) if n <= max => n,
            _ => return Err(format!("\"{text}\": the prefix length must be 0..={max}")),
        },
    };
    let cidr = Cidr { addr, len };
    let masked = mask(&cidr.octets(), len);
    if masked != cidr.octets() {
        let net = bytes_to_addr(&masked);
        return Err(format!(
            "\"{text}\" has host bits set: did you mean \"{net}/{len}\"?"
        ));
    }
    // An IPv4-mapped block (::ffff:a.b.c.d) never matches: IPv4 packets
    // are IPv4 on the wire, and an IPv6 packet carrying such a source is
    // forged (an allow there would let it through).
    if let (IpAddr::V6(v6), 96..) = (addr, len) {
        if let Some(v4) = v6.to_ipv4_mapped() {
            return Err(format!("\"{text}\" is an IPv4-mapped IPv6 block, which no packet rl sees carries: write \"{v4}/{}\"", len - 96));
        }
    }
    Ok(cidr)
}

/// The address of 4 (IPv4) or 16 (IPv6) bytes.
pub fn bytes_to_addr(b: &[u8]) -> IpAddr {
    match b.len() {
        4 => IpAddr::from(<[u8; 4]>::try_from(b).expect("4 bytes")),
        _ => IpAddr::from(<[u8; 16]>::try_from(b).expect("16 bytes")),
    }
}

/// A port (`22`) or an inclusive range (`"8000-8080"`, or `"53"`).
pub fn parse_port_range(value: &toml::Value) -> Result<(u16, u16), String> {
    let allowed =
        "ports are 1..=65535, written as a number (22) or an inclusive range (\"8000-8080\")";
    let port = |n: i64| -> Result<u16, String> {
        if (1..=65535).contains(&n) {
            Ok(n as u16)
        } else {
            Err(format!("port {n} is out of range: {allowed}"))
        }
    };
    match value {
        toml::Value::Integer(n) => port(*n).map(|p| (p, p)),
        toml::Value::String(s) => {
            let num = |t: &str| -> Result<u16, String> {
                let n: i64 = t
                    .trim()
                    .parse()
                    .map_err(|_| format!("\"{s}\" is not a port or range: {allowed}"))?;
                port(n)
            };
            let (lo, hi) = match s.split_once('-') {
                Some((a, b)) => (num(a)?, num(b)?),
                None => {
                    let p = num(s)?;
                    (p, p)
                }
            };
            if lo > hi {
                return Err(format!(
                    "\"{s}\" is a reversed range: write the lower port first (\"{hi}-{lo}\")"
                ));
            }
            Ok((lo, hi))
        }
        other => Err(format!("{other} is not a port or range: {allowed}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations() {
        assert_eq!(parse_duration("1s"), Ok(1));
        assert_eq!(parse_duration("10s"), Ok(10));
        assert_eq!(parse_duration("1m"), Ok(60));
        assert_eq!(parse_duration("1h"), Ok(3600));
        assert_eq!(parse_duration("1d"), Ok(86_400));
        assert_eq!(parse_duration("90s"), Ok(90));
        for bad in ["", "s", "1", "1.5s", "1w", "-1s", "1 sec", "0s"] {
            assert!(parse_duration(bad).is_err(), "{bad:?}");
        }
        assert!(parse_duration("1.5s").unwrap_err().contains("e.g. \"1s\""));
        assert!(parse_duration("400d").unwrap_err().contains("366 days"));
    }

    #[test]
    fn short_durations() {
        assert_eq!(parse_millis("50ms", 60_000), Ok(50));
        assert_eq!(parse_millis(" 2s ", 60_000), Ok(2000));
        assert_eq!(parse_millis("1m", 60_000), Ok(60_000));
        for bad in ["", "ms", "50", "1.5s", "1h", "-1ms", "1 sec"] {
            assert!(
                parse_millis(bad, 60_000)
                    .unwrap_err()
                    .contains("e.g. \"50ms\""),
                "{bad:?}"
            );
        }
        assert!(parse_millis("0s", 60_000)
            .unwrap_err()
            .contains("at least 1ms"));
        assert!(parse_millis("61s", 60_000)
            .unwrap_err()
            .contains("at most 60000ms"));
        assert!(
            parse_millis("99999999999999999m", 60_000)
                .unwrap_err()
                .contains("at most"),
            "overflow is too long"
        );
    }

    #[test]
    fn sizes() {
        assert_eq!(parse_size("10MB"), Ok(10_000_000));
        assert_eq!(parse_size("1GiB"), Ok(1 << 30));
        assert_eq!(parse_size("1500"), Ok(1500));
        assert_eq!(parse_size("1500B"), Ok(1500));
        assert_eq!(parse_size("1.5KB"), Ok(1500));
        assert_eq!(parse_size("64KiB"), Ok(65_536));
        for bad in [
            "",
            "MB",
            "10 parsecs",
            "1.5B",
            "0MB",
            "1..5MB",
            "99999999999TB",
        ] {
            assert!(parse_size(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn cidrs() {
        let c = parse_cidr("198.51.100.0/24").unwrap();
        assert_eq!((c.to_string(), c.len), ("198.51.100.0/24".into(), 24));
        assert_eq!(parse_cidr("2001:db8::/32").unwrap().len, 32);
        assert_eq!(parse_cidr("192.0.2.7").unwrap().len, 32);
        assert_eq!(parse_cidr("::1").unwrap().len, 128);
        assert_eq!(parse_cidr("0.0.0.0/0").unwrap().len, 0);
        assert!(parse_cidr("10.0.0.1/8")
            .unwrap_err()
            .contains("did you mean \"10.0.0.0/8\""));
        assert!(parse_cidr("10.0.0.0/33").unwrap_err().contains("0..=32"));
        assert!(parse_cidr("2001:db8::/129")
            .unwrap_err()
            .contains("0..=128"));
        assert!(parse_cidr("10.0.0/8").unwrap_err().contains("not a CIDR"));
        let net = parse_cidr("10.0.0.0/8").unwrap();
        assert!(net.covers(&parse_cidr("10.2.0.0/16").unwrap()));
        assert!(!net.covers(&parse_cidr("11.0.0.0/16").unwrap()));
        assert!(!parse_cidr("10.2.0.0/16").unwrap().covers(&net));
        assert!(
            !parse_cidr("::/0").unwrap().covers(&net),
            "families never cover each other"
        );
        // IPv4-mapped blocks never match a packet: refused with the IPv4 form.
        assert!(parse_cidr("::ffff:198.51.100.0/120")
            .unwrap_err()
            .contains("write \"198.51.100.0/24\""));
        assert!(parse_cidr("::ffff:0:0/96")
            .unwrap_err()
            .contains("write \"0.0.0.0/0\""));
        assert!(parse_cidr("::ffff:192.0.2.7")
            .unwrap_err()
            .contains("write \"192.0.2.7/32\""));
        assert_eq!(
            parse_cidr("::/64").unwrap().len,
            64,
            "a wider block holding the mapped one is fine"
        );
    }

    #[test]
    fn ports() {
        use toml::Value::{Integer, String as S};
        assert_eq!(parse_port_range(&Integer(22)), Ok((22, 22)));
        assert_eq!(parse_port_range(&S("8000-8080".into())), Ok((8000, 8080)));
        assert_eq!(parse_port_range(&S("53".into())), Ok((53, 53)));
        assert!(parse_port_range(&Integer(0))
            .unwrap_err()
            .contains("out of range"));
        assert!(parse_port_range(&Integer(65536))
            .unwrap_err()
            .contains("out of range"));
        assert!(parse_port_range(&S("9000-8000".into()))
            .unwrap_err()
            .contains("reversed"));
        assert!(parse_port_range(&S("http".into())).is_err());
        assert!(parse_port_range(&toml::Value::Boolean(true)).is_err());
    }
}
