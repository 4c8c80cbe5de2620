//! The daemon's background readers (the tables' walk, the flood
//! detectors' reading) when their passes fail: reported in `/v1/status`,
//! `/metrics` (and the shipped alert), the log and the events, tried again
//! every second, and recovered from. Before, one failed pass stopped the
//! collector for good and every pressure figure froze without a word.
//!
//! The failure is a real one: the running daemon's open-files limit is
//! lowered to 0 (`prlimit`), so every map a pass opens by id fails with
//! EMFILE, while the admin connection the test opened before keeps
//! answering.

use std::{
    io::{BufRead, BufReader, Read, Write},
    os::unix::net::UnixStream,
    time::{Duration, Instant},
};

use rl_tests::{
    alerts,
    daemon::{write, Daemon},
    http::{get, parse_prometheus},
    lab::Lab,
    traffic::{flood, join},
};

/// One keep-alive connection to the admin socket: its requests need no
/// new file descriptor in the daemon.
struct KeptOpen(BufReader<UnixStream>);

impl KeptOpen {
    fn get(&mut self, path: &str) -> (u16, String) {
        let s = self.0.get_mut();
        write!(s, "GET {path} HTTP/1.1\r\nHost: rl\r\n\r\n").unwrap();
        let (mut status, mut length, mut line) = (0u16, 0usize, String::new());
        loop {
            line.clear();
            self.0.read_line(&mut line).unwrap();
            let l = line.trim_end();
            if l.is_empty() {
                break;
            }
            if let Some(code) = l.strip_prefix("HTTP/1.1 ") {
                status = code[..3].parse().unwrap();
            } else if let Some((name, value)) = l.split_once(':') {
                assert_ne!(
                    status, 0,
                    "GET {path}: a header before the status line: {l:?}"
                );
                if name.eq_ignore_ascii_case("content-length") {
                    length = value.trim().parse().unwrap();
                }
                assert!(
                    !name.eq_ignore_ascii_case("transfer-encoding"),
                    "GET {path}: {l:?} is not read here"
                );
            } else {
                panic!("GET {path}: not an HTTP answer: {l:?}");
            }
        }
        let mut body = vec![0u8; length];
        self.0.read_exact(&mut body).unwrap();
        (status, String::from_utf8(body).unwrap())
    }

    fn status(&mut self) -> serde_json::Value {
        let (code, body) = self.get("/v1/status");
        assert_eq!(code, 200, "{body}");
        serde_json::from_str(&body).unwrap()
    }
}

/// Sets the daemon's soft open-files limit; the old one.
fn nofile(pid: u32, soft: u64) -> u64 {
    let mut old = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    let mut new = old;
    let r = unsafe { libc::prlimit(pid as i32, libc::RLIMIT_NOFILE, std::ptr::null(), &mut old) };
    assert_eq!(
        r,
        0,
        "reading the daemon's limit: {}",
        std::io::Error::last_os_error()
    );
    (new.rlim_cur, new.rlim_max) = (soft, old.rlim_max);
    let r = unsafe { libc::prlimit(pid as i32, libc::RLIMIT_NOFILE, &new, std::ptr::null_mut()) };
    assert_eq!(
        r,
        0,
        "setting the daemon's limit: {}",
        std::io::Error::last_os_error()
    );
    old.rlim_cur
}

/// Waits up to `within` for `cond` on the daemon's status.
fn until(
    c: &mut KeptOpen,
    within: Duration,
    what: &str,
    cond: impl Fn(&serde_json::Value) -> bool,
) -> serde_json::Value {
    let start = Instant::now();
    loop {
        let v = c.status();
        if cond(&v) {
            return v;
        }
        assert!(
            start.elapsed() < within,
            "{what} within {within:?}: {}",
            v["pressure"]["collector"]
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// The collector's readers fail, say so and why everywhere an operator
/// looks, and recover by themselves when the cause goes.
#[test]
fn a_failing_collector_is_reported_tried_again_and_recovers() {
    let lab = Lab::new().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let cfg = write(&dir, "rules.toml", "[datapath]\nmax_sources = 1024\n[default]\nrate = 100\n[[rule]]\nname = \"slow\"\nproto = \"any\"\nrate = 1\nper = \"1h\"\n");
    let mut d = Daemon::serving(&lab, &cfg, &[]).unwrap();
    // A bucket to walk, charged for an hour (a fresh one would be
    // collected): with one held, the walk runs every few passes.
    join(flood(
        &lab.a,
        lab.v4(1),
        lab.v4(2),
        Duration::from_millis(300),
        None,
    ))
    .unwrap();
    let mut c = KeptOpen(BufReader::new(
        UnixStream::connect(lab.b.runtime_dir().join(rl_control::cli::API_SOCKET)).unwrap(),
    ));
    let ok = |r: &serde_json::Value| r["last_ok_unix_ms"].is_u64() && r.get("error").is_none();
    until(
        &mut c,
        Duration::from_secs(10),
        "every reader passes",
        |v| {
            let h = &v["pressure"]["collector"];
            ok(&h["walk"])
                && ok(&h["flood_reading"])
                && ok(&h["events"])
                && v["pressure"]["buckets_ipv4"].as_u64() > Some(0)
        },
    );
    let (_, text) = c.get("/metrics");
    let m = parse_prometheus(&text);
    assert_eq!(
        m.get("rl_collector_up{reader=\"events\"}"),
        Some(&1.0),
        "the events feed is up"
    );

    let old = nofile(d.pid(), 0);
    let failing = |r: &serde_json::Value| {
        r["error"]
            .as_str()
            .is_some_and(|e| e.contains("Too many open files"))
            && r["failing_since_unix_ms"].is_u64()
    };
    let v = until(
        &mut c,
        Duration::from_secs(12),
        "both readers fail with EMFILE",
        |v| {
            let h = &v["pressure"]["collector"];
            failing(&h["walk"]) && failing(&h["flood_reading"])
        },
    );
    let (code, text) = c.get("/metrics");
    assert_eq!(code, 200, "{text}");
    let m = parse_prometheus(&text);
    for reader in ["walk", "flood_reading"] {
        assert_eq!(
            m.get(&format!("rl_collector_up{{reader=\"{reader}\"}}")),
            Some(&0.0),
            "{reader}"
        );
    }
    assert!(
        alerts::check(&m, &["daemon", "datapath", "l7"])
            .contains(&"RlCollectorFailing".to_string()),
        "the shipped alert holds"
    );
    // Still failing some passes later: tried again, not stopped, and
    // reported once, not at every pass.
    let since = v["pressure"]["collector"]["flood_reading"]["failing_since_unix_ms"].clone();
    std::thread::sleep(Duration::from_secs(3));
    let v = c.status();
    assert_eq!(
        v["pressure"]["collector"]["flood_reading"]["failing_since_unix_ms"], since,
        "one failing spell"
    );
    nofile(d.pid(), old);

    // Recovered by itself: both pass again, and the events tell the story.
    until(
        &mut c,
        Duration::from_secs(12),
        "both readers recover",
        |v| {
            let h = &v["pressure"]["collector"];
            ok(&h["walk"]) && ok(&h["flood_reading"])
        },
    );
    let events = get(&lab.b, "/v1/events?limit=50").json();
    let names: Vec<&str> = events["events"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|e| e["event"].as_str())
        .collect();
    for e in [
        "walk_failing",
        "walk_recovered",
        "flood_reading_failing",
        "flood_reading_recovered",
    ] {
        assert_eq!(
            names.iter().filter(|n| **n == e).count(),
            1,
            "{e} raised once: {names:?}"
        );
    }
    let m = parse_prometheus(&get(&lab.b, "/metrics").body);
    assert!(
        !alerts::check(&m, &["daemon", "datapath", "l7"])
            .iter()
            .any(|a| a.starts_with("RlCollector")),
        "the alerts clear"
    );
    let log = d.log();
    assert_eq!(
        log.matches("the collector's flood reading fails").count(),
        1,
        "logged once:\n{log}"
    );
    assert!(
        log.contains("Too many open files") && log.contains("the collector's walk works again"),
        "{log}"
    );
    d.wait_for("works again", Duration::from_secs(1)).unwrap();
}
