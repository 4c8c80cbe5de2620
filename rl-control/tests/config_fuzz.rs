//! Fuzz targets for the config parser and the rule compiler (proptest, with
//! shrinking): no input may panic or hang. Inputs are rule files assembled
//! from the real keys with hostile values (out of range, wrong types,
//! extreme numbers, odd CIDRs, port ranges, durations, sizes), mutated
//! byte-wise, and arbitrary text. A valid file must also compile.
//!
//! `PROPTEST_CASES` sets the number of cases (`cargo xtask fuzz` raises it).

use std::time::{Duration, Instant};

use proptest::prelude::*;
use rl_control::{compile::compile, config::Config};

/// A value a key might be given: sensible, extreme or of the wrong type.
fn value() -> impl Strategy<Value = String> {
    prop_oneof![
        (-5i64..200_000).prop_map(|n| n.to_string()),
        prop::sample::select(vec![
            "0",
            "1",
            "-1",
            "32",
            "33",
            "128",
            "129",
            "65535",
            "65536",
            "4294967295",
            "9223372036854775807",
            "-9223372036854775808",
            "1e9",
            "3.5",
            "true",
            "\"\"",
            "\"1s\"",
            "\"0s\"",
            "\"1d\"",
            "\"99999999999d\"",
            "\"10MB\"",
            "\"1GB\"",
            "\"0B\"",
            "\"18446744073709551615B\"",
            "\"syn\"",
            "\"udp\"",
            "\"any\"",
            "\"icmpv6\"",
            "\"global\"",
            "\"prefix\"",
            "\"source\"",
            "\"sliding_window\"",
            "\"fixed_window\"",
            "\"token_bucket\"",
            "\"shadow\"",
            "\"soft\"",
            "\"elastic\"",
            "\"drop\"",
            "\"10.0.0.0/8\"",
            "\"::/0\"",
            "\"0.0.0.0/0\"",
            "\"1.2.3.4/33\"",
            "\"fe80::1%eth0/64\"",
            "[]",
            "[53]",
            "[0]",
            "[65536]",
            "[\"1-65535\"]",
            "[\"9-3\"]",
            "[\"10.0.0.0/8\", \"::/0\"]",
            "[{ rate = 5 }]",
            "[{ bytes = \"1MB\", per = \"1h\" }, { rate = 1, per = \"1d\" }]",
            "{ rate = 1 }",
            "[[1]]",
        ])
        .prop_map(str::to_string),
    ]
}

const KEYS: &[&str] = &[
    "name",
    "proto",
    "dst_ports",
    "tcp_flags",
    "src",
    "key",
    "prefix_v4",
    "prefix_v6",
    "rate",
    "per",
    "burst",
    "bytes",
    "byte_burst",
    "limits",
    "algorithm",
    "action",
    "mode",
    "soft_percent",
    "pool_rate",
    "pool_per",
    "cidr",
    "max_sources",
    "ipv4_prefix",
    "ipv6_prefix",
    "flood_new_keys_per_sec",
    "flood_prefix_v4",
    "flood_prefix_v6",
    "flood_prefixes",
    "fragment_ttl_ms",
    "fragment_orphans",
    "expires",
    "reason",
];

const TABLES: &[&str] = &[
    "[datapath]",
    "[default]",
    "[[rule]]",
    "[[allow]]",
    "[[deny]]",
    "[[ban]]",
    "[other]",
];

/// A rule file: tables with key = value lines.
fn document() -> impl Strategy<Value = String> {
    let line = (prop::sample::select(KEYS), value()).prop_map(|(k, v)| format!("{k} = {v}\n"));
    let table = (
        prop::sample::select(TABLES),
        prop::collection::vec(line, 0..8),
    )
        .prop_map(|(t, lines)| format!("{t}\n{}", lines.concat()));
    prop::collection::vec(table, 0..8).prop_map(|t| t.concat())
}

const RULE_KEYS: &[&str] = &[
    "proto",
    "dst_ports",
    "tcp_flags",
    "src",
    "key",
    "prefix_v4",
    "prefix_v6",
    "rate",
    "per",
    "burst",
    "bytes",
    "byte_burst",
    "limits",
    "algorithm",
    "action",
    "mode",
    "soft_percent",
    "pool_rate",
    "pool_per",
];

/// Rules made of rule keys only, after a valid `[default]`: many of these
/// are valid, so the compiler sees hostile values that pass validation.
fn rules_document() -> impl Strategy<Value = String> {
    let line =
        (prop::sample::select(RULE_KEYS), value()).prop_map(|(k, v)| (k, format!("{k} = {v}\n")));
    let rule = (1i64..100_000, prop::collection::vec(line, 0..3)).prop_map(|(rate, lines)| {
        let mut seen: std::collections::HashSet<&str> = ["rate"].into();
        let rest: String = lines
            .into_iter()
            .filter(|(k, _)| seen.insert(*k))
            .map(|(_, l)| l)
            .collect();
        format!("rate = {rate}\n{rest}")
    });
    prop::collection::vec(rule, 1..6).prop_map(|rules| {
        let named = rules
            .iter()
            .enumerate()
            .map(|(i, body)| format!("[[rule]]\nname = \"r{i}\"\n{body}"));
        format!("[default]\nrate = 10\n{}", named.collect::<String>())
    })
}

/// A valid base file, so mutations land near real rules.
const BASE: &str = "[datapath]\nmax_sources = 4096\n[default]\nrate = 100\n\
    [[rule]]\nname = \"dns\"\nproto = \"udp\"\ndst_ports = [53, \"60-70\"]\nsrc = [\"10.0.0.0/8\"]\nrate = 5\nper = \"1m\"\n\
    [[rule]]\nname = \"api\"\nlimits = [{ rate = 200, per = \"10s\" }, { bytes = \"1MB\", per = \"1h\" }]\nmode = \"elastic\"\npool_rate = 1000\n\
    [[allow]]\ncidr = \"192.0.2.0/24\"\n";

/// Parses and, if valid, compiles; neither may panic or take long. On a
/// thread of its own, so that a hang fails the case (within 2 s) instead
/// of stalling the run.
fn check(text: &str) {
    let started = Instant::now();
    let (done, finished) = std::sync::mpsc::channel();
    let input = text.to_string();
    std::thread::spawn(move || {
        if let Ok(config) = Config::from_str(&input, "fuzz") {
            let _ = compile(&config);
        }
        let _ = done.send(());
    });
    match finished.recv_timeout(Duration::from_secs(2)) {
        Ok(()) => {}
        Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
            panic!("no answer within 2 s on {text:?}")
        }
        Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {
            panic!("panicked on {text:?} (after {:?})", started.elapsed())
        }
    }
}

proptest! {
    #[test]
    fn assembled_rule_files_never_panic(doc in document()) {
        check(&doc);
    }

    #[test]
    fn mutated_rule_files_never_panic(edits in prop::collection::vec((0usize..BASE.len(), any::<u8>(), 0u8..3), 1..6)) {
        let mut bytes = BASE.as_bytes().to_vec();
        for (at, b, op) in edits {
            let at = at.min(bytes.len());
            match op {
                0 if at < bytes.len() => bytes[at] = b,
                1 => bytes.insert(at, b),
                _ if at < bytes.len() => { bytes.remove(at); }
                _ => {}
            }
        }
        check(&String::from_utf8_lossy(&bytes));
    }

    #[test]
    fn hostile_rules_never_panic(doc in rules_document()) {
        check(&doc);
    }

    #[test]
    fn arbitrary_text_never_panics(text in ".{0,400}") {
        check(&text);
    }
}

/// The generator is not all noise: a fair share of its rule files are valid
/// and reach the compiler.
#[test]
fn hostile_rule_files_often_reach_the_compiler() {
    use proptest::strategy::ValueTree;
    let mut runner = proptest::test_runner::TestRunner::deterministic();
    let strategy = rules_document();
    let valid = (0..2000)
        .filter(|_| {
            Config::from_str(&strategy.new_tree(&mut runner).unwrap().current(), "fuzz").is_ok()
        })
        .count();
    assert!(
        valid >= 40,
        "only {valid} of 2000 generated rule files were valid"
    );
}

#[test]
fn the_base_file_is_valid_so_mutations_start_from_real_rules() {
    let c = Config::from_str(BASE, "base").unwrap();
    assert_eq!(c.rules.len(), 2);
    compile(&c);
}
