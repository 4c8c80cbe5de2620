//! The rule language's tests: each field's validation with line:col, and
//! what rules compile to.

use super::*;
use crate::config::Config;

const HEAD: &str = "[default]\nrate = 100\n";

fn parse(body: &str) -> Result<Config, String> {
    Config::from_str(&format!("{HEAD}{body}"), "rules.toml").map_err(|e| e.to_string())
}

fn error_of(body: &str) -> String {
    parse(body).expect_err("must be rejected")
}

/// The error's `line:col` (the body starts on line 3) and message.
fn assert_error(body: &str, line: usize, col: usize, needle: &str) {
    let e = error_of(body);
    let want = format!("rules.toml:{line}:{col}: ");
    assert!(
        e.starts_with(&want),
        "expected an error at {line}:{col}, got: {e}"
    );
    assert!(e.contains(needle), "expected {needle:?} in: {e}");
}

/// A token bucket's byte cost must fit 64 bits for a whole frame: a
/// byte rate slower than a byte per 39 hours is refused (before, it
/// wrapped and admitted what it liked); windows count, and take it.
#[test]
fn a_byte_rate_too_slow_to_charge_a_frame_is_refused_with_its_place() {
    let rule = |limit: &str| format!("[[rule]]\nname = \"slow\"\n{limit}\n");
    assert_error(
        &rule("bytes = 1\nper = \"200d\""),
        5,
        9,
        "slower than one byte per 39 hours",
    );
    assert!(parse(&rule("bytes = 1\nper = \"1d\"")).is_ok());
    assert!(parse(&rule(
        "bytes = 1\nper = \"200d\"\nalgorithm = \"fixed_window\""
    ))
    .is_ok());
}

#[test]
fn the_issue_example_parses() {
    let c = parse(
        r#"
[[allow]]
cidr = "10.0.0.0/8"

[[deny]]
cidr = "198.51.100.0/24"

[[rule]]
name = "ssh-syn"
proto = "tcp"
dst_ports = [22, "8000-8080"]
tcp_flags = "syn"
src = ["0.0.0.0/0", "::/0"]
key = "prefix"
prefix_v4 = 24
prefix_v6 = 48
rate = 5
per = "1s"
burst = 10
algorithm = "token_bucket"
action = "drop"
mode = "soft"
soft_percent = 10

[[rule]]
name = "api"
limits = [{ rate = 200, per = "10s" }, { rate = 5000, per = "1h" }, { rate = 20000, per = "1d", bytes = "10MB" }]
mode = "elastic"
pool_rate = 1000

[[rule]]
name = "dns_24"
proto = "udp"
dst_ports = [53]
key = "global"
rate = 200000
algorithm = "sliding_window"
action = "shadow"
"#,
    )
    .unwrap();
    assert_eq!(c.allow[0].to_string(), "10.0.0.0/8");
    assert_eq!(c.deny[0].to_string(), "198.51.100.0/24");
    let r = &c.rules[0];
    assert_eq!(
        (r.proto, r.syn_only, r.dst_ports.clone()),
        (Proto::Tcp, true, vec![(22, 22), (8000, 8080)])
    );
    assert_eq!(r.key, KeyScope::Prefix { v4: 24, v6: 48 });
    assert_eq!(
        r.limits,
        vec![RuleLimit {
            unit: Unit::Packets,
            rate: Rate {
                amount: 5,
                per_secs: 1,
                burst: 10
            }
        }]
    );
    assert_eq!(r.mode, Mode::Soft { percent: 10 });
    let api = &c.rules[1];
    assert_eq!(
        api.limits.len(),
        4,
        "three packet limits and one byte limit"
    );
    assert_eq!(
        api.limits[3],
        RuleLimit {
            unit: Unit::Bytes,
            rate: Rate {
                amount: 10_000_000,
                per_secs: 86_400,
                burst: 10_000_000
            }
        }
    );
    assert_eq!(
        api.limits[1].rate,
        Rate {
            amount: 5000,
            per_secs: 3600,
            burst: 5000
        },
        "burst defaults to rate"
    );
    assert_eq!(
        api.mode,
        Mode::Elastic {
            pool: Rate {
                amount: 1000,
                per_secs: 1,
                burst: 1000
            }
        }
    );
    assert_eq!(
        (api.proto, api.key, api.algorithm, api.action),
        (
            Proto::Any,
            KeyScope::Source,
            Algorithm::TokenBucket,
            Action::Drop
        )
    );
    let dns = &c.rules[2];
    assert_eq!(
        (dns.key, dns.algorithm, dns.action),
        (KeyScope::Global, Algorithm::SlidingWindow, Action::Shadow)
    );
}

#[test]
fn duplicate_names_point_at_the_second_and_name_the_first() {
    assert_error(
        "[[rule]]\nname = \"a\"\nrate = 1\n[[rule]]\nname = \"a\"\nrate = 2\n",
        7,
        8,
        "rule name \"a\" is already used on line 4",
    );
}

#[test]
fn names_must_be_present_and_well_formed() {
    assert_error("[[rule]]\nrate = 1\n", 3, 1, "missing name");
    assert_error(
        "[[rule]]\nname = \"SSH\"\nrate = 1\n",
        4,
        8,
        "a-z, 0-9, _ and -",
    );
    assert_error(
        &format!("[[rule]]\nname = \"{}\"\nrate = 1\n", "a".repeat(49)),
        4,
        8,
        "1..=48",
    );
    // The per-rule counters' built-in rows: a rule of that name would
    // be summed with them.
    for n in ["default", "allow", "deny"] {
        assert_error(
            &format!("[[rule]]\nname = \"{n}\"\nrate = 1\n"),
            4,
            8,
            &format!("rule name \"{n}\" is reserved"),
        );
    }
}

#[test]
fn unknown_keys_are_located() {
    assert_error(
        "[[rule]]\nname = \"a\"\nrate = 1\nrat = 2\n",
        6,
        1,
        "unknown field `rat`",
    );
    assert_error(
        "[[rule]]\nname = \"a\"\nrate = 1\nflood_wide_cells = 1\n",
        6,
        20,
        "expected a boolean",
    );
    assert_error(
        "[[allow]]\ncidr = \"10.0.0.0/8\"\nport = 1\n",
        5,
        1,
        "unknown field `port`",
    );
    assert_error(
        "[[rule]]\nname = \"a\"\nlimits = [{ rate = 1, pre = \"1s\" }]\n",
        5,
        23,
        "unknown field `pre`",
    );
}

#[test]
fn unknown_protocol_lists_the_allowed() {
    assert_error(
        "[[rule]]\nname = \"a\"\nproto = \"sctp\"\nrate = 1\n",
        5,
        9,
        "proto = \"sctp\" is not allowed: use one of any, tcp, udp, icmp, icmpv6",
    );
}

#[test]
fn bad_ports_and_ranges() {
    let rule = |ports: &str| {
        format!("[[rule]]\nname = \"a\"\nproto = \"tcp\"\ndst_ports = {ports}\nrate = 1\n")
    };
    assert_error(&rule("[0]"), 6, 14, "port 0 is out of range");
    assert_error(&rule("[22, 65536]"), 6, 18, "port 65536 is out of range");
    assert_error(&rule("[\"9000-8000\"]"), 6, 14, "reversed range");
    assert_error(&rule("[\"http\"]"), 6, 14, "not a port or range");
    assert_error(&rule("[]"), 6, 13, "dst_ports is empty");
    let ports = |n: usize| {
        (0..n)
            .map(|p| (p * 2 + 1).to_string())
            .collect::<Vec<_>>()
            .join(", ")
    };
    assert_error(
        &rule(&format!("[{}]", ports(MAX_PORTS_PER_RULE + 1))),
        6,
        13,
        "dst_ports lists 257 entries, at most 256",
    );
    // Eight full lists fit; a ninth crosses the total.
    let rules: String = (0..9)
        .map(|i| format!("[[rule]]\nname = \"r{i}\"\nproto = \"udp\"\ndst_ports = [{}]\nsrc = [\"10.{i}.0.0/16\"]\nrate = 1\n", ports(256)))
        .collect();
    assert_error(
        &rules,
        2 + 8 * 6 + 4,
        13,
        "the rules list 2304 dst_ports entries so far, at most 2048 together",
    );
    assert_error(
        "[[rule]]\nname = \"a\"\nproto = \"icmp\"\ndst_ports = [1]\nrate = 1\n",
        6,
        13,
        "dst_ports needs proto",
    );
}

#[test]
fn bad_cidrs() {
    assert_error(
        "[[deny]]\ncidr = \"198.51.100.0/33\"\n",
        4,
        8,
        "deny[0].cidr: \"198.51.100.0/33\": the prefix length must be 0..=32",
    );
    assert_error(
        "[[allow]]\ncidr = \"10.0.0.1/8\"\n",
        4,
        8,
        "did you mean \"10.0.0.0/8\"",
    );
    assert_error("[[allow]]\ncidr = \"banana\"\n", 4, 8, "is not a CIDR");
    assert_error(
        "[[rule]]\nname = \"a\"\nsrc = [\"2001:db8::/129\"]\nrate = 1\n",
        5,
        8,
        "src: \"2001:db8::/129\": the prefix length must be 0..=128",
    );
    assert_error(
        "[[rule]]\nname = \"a\"\nsrc = []\nrate = 1\n",
        5,
        7,
        "src is empty",
    );
}

#[test]
fn tcp_flags_need_tcp_and_only_syn_exists() {
    assert_error(
        "[[rule]]\nname = \"a\"\ntcp_flags = \"syn\"\nrate = 1\n",
        5,
        13,
        "tcp_flags needs proto = \"tcp\"",
    );
    assert_error(
        "[[rule]]\nname = \"a\"\nproto = \"udp\"\ntcp_flags = \"syn\"\nrate = 1\n",
        6,
        13,
        "tcp_flags needs proto = \"tcp\"",
    );
    assert_error(
        "[[rule]]\nname = \"a\"\nproto = \"tcp\"\ntcp_flags = \"fin\"\nrate = 1\n",
        6,
        13,
        "use \"syn\"",
    );
}

#[test]
fn prefixes_in_range_and_only_with_prefix_keys() {
    let rule =
        |extra: &str| format!("[[rule]]\nname = \"a\"\nkey = \"prefix\"\n{extra}\nrate = 1\n");
    assert_error(
        &rule("prefix_v4 = 33"),
        6,
        13,
        "prefix_v4 = 33 is out of range: allowed 1..=32",
    );
    assert_error(
        &rule("prefix_v6 = 0"),
        6,
        13,
        "prefix_v6 = 0 is out of range: allowed 1..=128",
    );
    assert_error(
        "[[rule]]\nname = \"a\"\nprefix_v4 = 24\nrate = 1\n",
        5,
        13,
        "need key = \"prefix\"",
    );
    assert_error(
        "[[rule]]\nname = \"a\"\nkey = \"host\"\nrate = 1\n",
        5,
        7,
        "use one of source, prefix, global",
    );
}

#[test]
fn zero_rates_bursts_and_missing_limits() {
    assert_error(
        "[[rule]]\nname = \"a\"\nrate = 0\n",
        5,
        8,
        "rate = 0 is out of range",
    );
    assert_error(
        "[[rule]]\nname = \"a\"\nrate = 5\nburst = 0\n",
        6,
        9,
        "burst = 0 is out of range",
    );
    assert_error("[[rule]]\nname = \"a\"\nper = \"1s\"\n", 5, 7, "no limit");
    assert_error("[[rule]]\nname = \"a\"\n", 3, 1, "no limit");
    assert_error("[[rule]]\nname = \"a\"\nbytes = \"0MB\"\n", 5, 9, "is zero");
    assert_error(
        "[[rule]]\nname = \"a\"\nbytes = -5\n",
        5,
        9,
        "not a positive number of bytes",
    );
}

#[test]
fn unparsable_durations_and_sizes() {
    assert_error(
        "[[rule]]\nname = \"a\"\nrate = 5\nper = \"1 fortnight\"\n",
        6,
        7,
        "per: \"1 fortnight\" is not a duration",
    );
    assert_error(
        "[[rule]]\nname = \"a\"\nrate = 5\nper = \"1.5s\"\n",
        6,
        7,
        "is not a duration",
    );
    assert_error(
        "[[rule]]\nname = \"a\"\nbytes = \"10 parsecs\"\n",
        5,
        9,
        "is not a size",
    );
    assert_error("[[rule]]\nname = \"a\"\nmode = \"elastic\"\npool_rate = 5\npool_per = \"soon\"\nrate = 1\n", 7, 12, "pool_per: \"soon\" is not a duration");
}

#[test]
fn limits_and_modes_are_consistent() {
    assert_error(
        "[[rule]]\nname = \"a\"\nrate = 1\nlimits = [{ rate = 2 }]\n",
        6,
        10,
        "not both",
    );
    assert_error(
        "[[rule]]\nname = \"a\"\nlimits = [{ rate = 1 }, { rate = 2 }, { rate = 3 }, { rate = 4, bytes = 5 }]\n",
        5,
        10,
        "5 limits: at most 4",
    );
    assert_error(
        "[[rule]]\nname = \"a\"\nrate = 1\nalgorithm = \"fixed_window\"\nburst = 3\n",
        7,
        9,
        "burst applies to algorithm = \"token_bucket\" only",
    );
    assert_error(
        "[[rule]]\nname = \"a\"\nrate = 1\nalgorithm = \"leaky\"\n",
        6,
        13,
        "use one of token_bucket, fixed_window, sliding_window",
    );
    assert_error(
        "[[rule]]\nname = \"a\"\nrate = 1\naction = \"reject\"\n",
        6,
        10,
        "use one of drop, shadow",
    );
    assert_error(
        "[[rule]]\nname = \"a\"\nrate = 1\nmode = \"firm\"\n",
        6,
        8,
        "use one of hard, soft, elastic",
    );
    assert_error(
        "[[rule]]\nname = \"a\"\nrate = 1\nsoft_percent = 5\n",
        6,
        16,
        "soft_percent needs mode = \"soft\"",
    );
    assert_error(
        "[[rule]]\nname = \"a\"\nrate = 1\nmode = \"soft\"\nsoft_percent = 0\n",
        7,
        16,
        "soft_percent = 0 is out of range",
    );
    assert_error(
        "[[rule]]\nname = \"a\"\nrate = 1\nmode = \"elastic\"\n",
        6,
        8,
        "needs pool_rate",
    );
    assert_error(
        "[[rule]]\nname = \"a\"\nrate = 1\npool_rate = 5\n",
        6,
        13,
        "need mode = \"elastic\"",
    );
    // A sliding window counts at most 2^28 - 1 a window (it passed
    // half of a larger rate), with its soft margin too; bytes and the
    // other algorithms are not capped so.
    // A bucket holds at most 2^63 ns of burst: more was silently cut.
    assert_error(
        "[[rule]]\nname = \"a\"\nrate = 1\nper = \"366d\"\nburst = 300\n",
        5,
        8,
        "a burst lasting at most 292 years",
    );
    assert_error(
        "[[rule]]\nname = \"a\"\nbytes = \"1MB\"\nper = \"1d\"\nbyte_burst = \"1TB\"\n",
        7,
        14,
        "lasts more than 292 years",
    );
    let sliding = "is more than a sliding window counts (268435455 per window)";
    assert_error(
        "[[rule]]\nname = \"a\"\nrate = 300000000\nper = \"1h\"\nalgorithm = \"sliding_window\"\n",
        5,
        8,
        sliding,
    );
    assert_error("[[rule]]\nname = \"a\"\nlimits = [{ rate = 5 }, { rate = 268435456, per = \"1h\" }]\nalgorithm = \"sliding_window\"\n", 5, 10, sliding);
    assert_error("[[rule]]\nname = \"a\"\nrate = 250000000\nalgorithm = \"sliding_window\"\nmode = \"soft\"\n", 5, 8, "(275000000 with its soft margin)");
    for ok in [
        "rate = 268435455\nalgorithm = \"sliding_window\"\n",
        "rate = 300000000\nper = \"1h\"\nalgorithm = \"fixed_window\"\n",
        "bytes = \"1TB\"\nalgorithm = \"sliding_window\"\n",
    ] {
        let text = format!("[default]\nrate = 5\n[[rule]]\nname = \"a\"\n{ok}");
        assert!(Config::from_str(&text, "rules.toml").is_ok(), "{ok}");
    }
}

#[test]
fn more_src_cidrs_than_the_datapath_holds_are_located() {
    let list = |from: usize, n: usize| {
        (from..from + n)
            .map(|i| format!("\"{}.{}.{}.0/24\"", 10 + (i >> 16), (i >> 8) & 255, i & 255))
            .collect::<Vec<_>>()
            .join(", ")
    };
    let body = format!(
        "[[rule]]\nname = \"a\"\nrate = 1\nsrc = [{}]\n[[rule]]\nname = \"b\"\nrate = 1\nsrc = [{}]\n",
        list(0, MAX_SRC_CIDRS - 2),
        list(MAX_SRC_CIDRS, 3)
    );
    // b's third CIDR is the one past the limit.
    let col = body.lines().nth(7).unwrap().rfind("\"11.").unwrap() + 1;
    assert_error(
        &body,
        10,
        col,
        &format!(
            "{} src CIDRs over all rules: the datapath holds at most {MAX_SRC_CIDRS}",
            MAX_SRC_CIDRS + 1
        ),
    );
}

#[test]
fn more_rules_than_the_datapath_holds() {
    let body: String = (0..=MAX_RULES)
        .map(|i| format!("[[rule]]\nname = \"r{i}\"\nrate = 1\n"))
        .collect();
    let e = error_of(&body);
    assert!(
        e.contains(&format!(
            "{} rules: the datapath holds at most {MAX_RULES}",
            MAX_RULES + 1
        )),
        "{e}"
    );
    assert!(
        e.starts_with(&format!("rules.toml:{}:1:", 3 + 3 * MAX_RULES)),
        "{e}"
    );
    // Exactly the maximum is fine.
    let body: String = (0..MAX_RULES)
        .map(|i| format!("[[rule]]\nname = \"r{i}\"\nrate = 1\n"))
        .collect();
    assert_eq!(parse(&body).unwrap().rules.len(), MAX_RULES);
}
