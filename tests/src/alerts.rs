//! The alerting rules rl ships (`dist/rl-alerts.yml`), read as Prometheus
//! reads them (YAML, then each `expr` through a PromQL parser) and evaluated
//! against a scrape of a running daemon's `/metrics`, so that a renamed
//! metric or label, or a condition that no longer fires when the state it
//! watches is reached, fails a test.
//!
//! The evaluator covers what one scrape can answer: selectors, numbers,
//! arithmetic and comparisons (one-to-one on identical label sets, as
//! Prometheus matches them by default), `or`, `absent` and `time()` (the
//! test's clock, which is the daemon's). Expressions over time
//! (`rate`, `increase`) are not evaluated, but their selectors must still
//! name series the daemon exports.

use std::{
    collections::{BTreeMap, HashMap},
    sync::OnceLock,
};

use promql_parser::{
    label::MatchOp,
    parser::{self, Expr, VectorSelector},
};
use serde::Deserialize;

/// Where the rules are, from this crate's folder.
const FILE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../dist/rl-alerts.yml");

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RuleFile {
    groups: Vec<Group>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Group {
    name: String,
    rules: Vec<RawAlert>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawAlert {
    alert: String,
    expr: String,
    #[serde(rename = "for")]
    for_: Option<String>,
    labels: BTreeMap<String, String>,
    annotations: BTreeMap<String, String>,
}

/// One shipped alert.
pub struct Alert {
    pub name: String,
    /// `daemon`, `datapath`, `l7` or `cluster`: cluster alerts' metrics
    /// exist only with a `[cluster]` section.
    pub component: String,
    expr: Expr,
}

/// The shipped alerts, read once; panics, saying what is wrong, on a file
/// Prometheus would refuse or that misses what an operator reads
/// (severity, component, summary, description).
pub fn shipped() -> &'static [Alert] {
    static SHIPPED: OnceLock<Vec<Alert>> = OnceLock::new();
    SHIPPED.get_or_init(read)
}

fn read() -> Vec<Alert> {
    let text = std::fs::read_to_string(FILE).unwrap_or_else(|e| panic!("reading {FILE}: {e}"));
    let file: RuleFile = serde_yaml::from_str(&text).unwrap_or_else(|e| panic!("{FILE}: {e}"));
    let mut alerts = Vec::new();
    for group in file.groups {
        assert!(
            !group.name.is_empty() && !group.rules.is_empty(),
            "{FILE}: group {:?} is empty",
            group.name
        );
        for r in group.rules {
            let who = format!("{FILE}: alert {}", r.alert);
            let expr =
                parser::parse(&r.expr).unwrap_or_else(|e| panic!("{who}: expr {:?}: {e}", r.expr));
            if let Some(d) = &r.for_ {
                promql_parser::util::parse_duration(d)
                    .unwrap_or_else(|e| panic!("{who}: for {d:?}: {e}"));
            }
            let severity = r.labels.get("severity").map(String::as_str);
            assert!(
                matches!(severity, Some("info" | "warning" | "critical")),
                "{who}: severity {severity:?}"
            );
            let component = r.labels.get("component").cloned().unwrap_or_default();
            assert!(
                ["daemon", "datapath", "l7", "cluster"].contains(&component.as_str()),
                "{who}: component {component:?}"
            );
            for a in ["summary", "description"] {
                assert!(
                    r.annotations.get(a).is_some_and(|t| !t.trim().is_empty()),
                    "{who}: no {a}"
                );
            }
            assert!(
                !alerts.iter().any(|x: &Alert| x.name == r.alert),
                "{who}: named twice"
            );
            alerts.push(Alert {
                name: r.alert,
                component,
                expr,
            });
        }
    }
    alerts
}

/// The shipped alert `name`.
pub fn alert(name: &str) -> &'static Alert {
    shipped()
        .iter()
        .find(|a| a.name == name)
        .unwrap_or_else(|| panic!("{FILE} has no alert {name}"))
}

/// A scrape by series: metric name, then its labels.
pub type Series = Vec<(String, BTreeMap<String, String>, f64)>;

/// A scrape as `http::parse_prometheus` returns it, by series.
pub fn series(scrape: &HashMap<String, f64>) -> Series {
    scrape
        .iter()
        .map(|(k, v)| {
            let (name, labels) = k
                .split_once('{')
                .map_or((k.as_str(), ""), |(n, l)| (n, l.trim_end_matches('}')));
            (name.to_string(), labels_of(labels), *v)
        })
        .collect()
}

/// `a="x",b="y"` (values as the exporter escapes them).
fn labels_of(text: &str) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    let mut rest = text;
    while let Some((name, after)) = rest.split_once("=\"") {
        let mut value = String::new();
        let mut chars = after.char_indices();
        let mut end = after.len();
        while let Some((i, c)) = chars.next() {
            match c {
                '\\' => value.extend(chars.next().map(|(_, c)| c)),
                '"' => {
                    end = i + 1;
                    break;
                }
                c => value.push(c),
            }
        }
        out.insert(name.trim_start_matches(',').to_string(), value);
        rest = &after[end..];
    }
    out
}

/// A value in the evaluation: a number, or samples by label set.
enum Value {
    Scalar(f64),
    Vector(Vec<(BTreeMap<String, String>, f64)>),
}

impl Alert {
    /// The selectors in the expression that match no series of `scrape`
    /// (each as written): a metric or label the daemon does not export.
    pub fn missing(&self, scrape: &Series) -> Vec<String> {
        let mut out = Vec::new();
        selectors(&self.expr, &mut |vs| {
            if select(vs, scrape).is_empty() {
                out.push(vs.to_string());
            }
        });
        out
    }

    /// Whether the alert's condition holds on `scrape` (before its `for`),
    /// or `None` if one scrape cannot tell (a function over time).
    pub fn holds(&self, scrape: &Series) -> Option<bool> {
        Some(match eval(&self.expr, scrape)? {
            Value::Scalar(v) => v != 0.0,
            Value::Vector(v) => !v.is_empty(),
        })
    }
}

fn selectors(e: &Expr, f: &mut dyn FnMut(&VectorSelector)) {
    match e {
        Expr::VectorSelector(vs) => f(vs),
        Expr::MatrixSelector(m) => f(&m.vs),
        Expr::Paren(p) => selectors(&p.expr, f),
        Expr::Unary(u) => selectors(&u.expr, f),
        Expr::Binary(b) => {
            selectors(&b.lhs, f);
            selectors(&b.rhs, f);
        }
        Expr::Aggregate(a) => selectors(&a.expr, f),
        Expr::Subquery(s) => selectors(&s.expr, f),
        Expr::Call(c) => c.args.args.iter().for_each(|a| selectors(a, f)),
        Expr::NumberLiteral(_) | Expr::StringLiteral(_) | Expr::Extension(_) => {}
    }
}

/// The samples `vs` selects (equality matchers only: the shipped rules
/// use no others, and a test that meets one says so).
fn select(vs: &VectorSelector, scrape: &Series) -> Vec<(BTreeMap<String, String>, f64)> {
    assert!(
        vs.offset.is_none() && vs.at.is_none() && vs.matchers.or_matchers.is_empty(),
        "{vs}: not evaluated here"
    );
    let name = vs
        .name
        .as_deref()
        .unwrap_or_else(|| panic!("{vs}: a selector without a metric name"));
    scrape
        .iter()
        .filter(|(n, labels, _)| {
            n == name
                && vs.matchers.matchers.iter().all(|m| match &m.op {
                    MatchOp::Equal => labels
                        .get(&m.name)
                        .map_or(m.value.is_empty(), |v| *v == m.value),
                    MatchOp::NotEqual => labels
                        .get(&m.name)
                        .map_or(!m.value.is_empty(), |v| *v != m.value),
                    other => panic!("{vs}: matcher {other:?} not evaluated here"),
                })
        })
        .map(|(_, labels, v)| (labels.clone(), *v))
        .collect()
}

fn eval(e: &Expr, scrape: &Series) -> Option<Value> {
    Some(match e {
        Expr::NumberLiteral(n) => Value::Scalar(n.val),
        Expr::VectorSelector(vs) => Value::Vector(select(vs, scrape)),
        Expr::Paren(p) => eval(&p.expr, scrape)?,
        Expr::Call(c) if c.func.name == "time" => Value::Scalar(
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .ok()?
                .as_secs_f64(),
        ),
        Expr::Call(c) if c.func.name == "absent" => {
            let Some(Value::Vector(v)) = eval(c.args.args.first()?, scrape) else {
                return None;
            };
            Value::Vector(if v.is_empty() {
                vec![(BTreeMap::new(), 1.0)]
            } else {
                Vec::new()
            })
        }
        // (A set operator's modifier only says many-to-many.)
        Expr::Binary(b) if b.modifier.is_none() || b.op.to_string() == "or" => {
            let (op, l, r) = (
                b.op.to_string(),
                eval(&b.lhs, scrape)?,
                eval(&b.rhs, scrape)?,
            );
            binary(&op, l, r)?
        }
        _ => return None,
    })
}

/// `l op r`: arithmetic gives the computed value, a comparison keeps the
/// left side's samples where it holds (Prometheus' filter semantics).
fn binary(op: &str, l: Value, r: Value) -> Option<Value> {
    if op == "or" {
        // The left side's samples, and the right side's whose labels the
        // left has not.
        let (Value::Vector(mut a), Value::Vector(b)) = (l, r) else {
            return None;
        };
        for (labels, y) in b {
            if !a.iter().any(|(l, _)| *l == labels) {
                a.push((labels, y));
            }
        }
        return Some(Value::Vector(a));
    }
    let apply = |a: f64, b: f64| -> Option<(f64, bool)> {
        Some(match op {
            "+" => (a + b, true),
            "-" => (a - b, true),
            "*" => (a * b, true),
            "/" => (a / b, true),
            "==" => (a, a == b),
            "!=" => (a, a != b),
            ">" => (a, a > b),
            "<" => (a, a < b),
            ">=" => (a, a >= b),
            "<=" => (a, a <= b),
            _ => return None,
        })
    };
    let comparison = ["==", "!=", ">", "<", ">=", "<="].contains(&op);
    Some(match (l, r) {
        (Value::Scalar(a), Value::Scalar(b)) => {
            let (v, keep) = apply(a, b)?;
            Value::Scalar(if comparison {
                f64::from(u8::from(keep))
            } else {
                v
            })
        }
        (Value::Vector(v), Value::Scalar(s)) => Value::Vector(filter_map(v, |x| apply(x, s))?),
        (Value::Scalar(s), Value::Vector(v)) => {
            // A comparison keeps the vector's own value, on whichever side.
            Value::Vector(filter_map(v, |x| {
                apply(s, x).map(|(r, keep)| (if comparison { x } else { r }, keep))
            })?)
        }
        (Value::Vector(a), Value::Vector(b)) => {
            let mut out = Vec::new();
            for (labels, x) in a {
                if let Some((_, y)) = b.iter().find(|(l, _)| *l == labels) {
                    let (r, keep) = apply(x, *y)?;
                    if keep {
                        out.push((labels, r));
                    }
                }
            }
            Value::Vector(out)
        }
    })
}

fn filter_map(
    v: Vec<(BTreeMap<String, String>, f64)>,
    f: impl Fn(f64) -> Option<(f64, bool)>,
) -> Option<Vec<(BTreeMap<String, String>, f64)>> {
    let mut out = Vec::new();
    for (labels, x) in v {
        let (r, keep) = f(x)?;
        if keep {
            out.push((labels, r));
        }
    }
    Some(out)
}

/// Checks the shipped alerts against a scrape of a daemon whose
/// components are `present` (the others' metrics are not exported): every
/// selector of theirs names a series it exports. Returns the names of the
/// alerts whose condition holds on it.
pub fn check(scrape: &HashMap<String, f64>, present: &[&str]) -> Vec<String> {
    // What Prometheus adds to every scrape it made (job "rl", as in the
    // README's scrape config): this one was made.
    let mut scrape = scrape.clone();
    scrape.insert("up{job=\"rl\"}".into(), 1.0);
    let series = series(&scrape);
    let mut firing = Vec::new();
    for a in shipped()
        .iter()
        .filter(|a| present.contains(&a.component.as_str()))
    {
        let missing = a.missing(&series);
        assert!(
            missing.is_empty(),
            "alert {} reads series the daemon does not export: {missing:?}",
            a.name
        );
        if a.holds(&series) == Some(true) {
            firing.push(a.name.clone());
        }
    }
    firing
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scrape(lines: &[(&str, f64)]) -> Series {
        series(&lines.iter().map(|(k, v)| (k.to_string(), *v)).collect())
    }

    #[test]
    fn the_shipped_file_parses_and_its_conditions_evaluate_as_prometheus_would() {
        let alerts = shipped();
        assert!(alerts.len() >= 8);
        let calm = scrape(&[
            ("up{job=\"rl\",instance=\"a:9101\"}", 1.0),
            ("rl_uptime_seconds", 5.0),
            ("rl_flood_mode", 0.0),
            (
                "rl_table_occupancy_ratio{table=\"sources\",family=\"ipv4\"}",
                0.5,
            ),
            ("rl_l7_keys", 10.0),
            ("rl_l7_max_keys", 100.0),
            ("rl_wide_cells{family=\"ipv4\"}", 0.0),
        ]);
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs_f64();
        let calm = [
            calm,
            scrape(&[
                ("rl_collector_up{reader=\"walk\"}", 1.0),
                (
                    "rl_collector_last_pass_timestamp_seconds{reader=\"walk\"}",
                    now - 1.0,
                ),
            ]),
        ]
        .concat();
        let hot = scrape(&[
            ("up{job=\"rl\",instance=\"a:9101\"}", 0.0),
            ("rl_collector_up{reader=\"flood_reading\"}", 0.0),
            (
                "rl_collector_last_pass_timestamp_seconds{reader=\"walk\"}",
                now - 90.0,
            ),
            ("rl_flood_mode", 1.0),
            ("rl_wide_cells{family=\"ipv4\"}", 3.0),
            (
                "rl_table_occupancy_ratio{table=\"cells\",family=\"ipv6\"}",
                0.95,
            ),
            ("rl_l7_keys", 91.0),
            ("rl_l7_max_keys", 100.0),
        ]);
        for (name, on_calm, on_hot) in [
            ("RlDown", false, true),
            ("RlFloodMode", false, true),
            ("RlWideCells", false, true),
            ("RlTableNearlyFull", false, true),
            ("RlRequestKeysNearlyFull", false, true),
            ("RlCollectorFailing", false, true),
            ("RlCollectorStalled", false, true),
        ] {
            let a = alert(name);
            assert_eq!(
                (a.holds(&calm), a.holds(&hot)),
                (Some(on_calm), Some(on_hot)),
                "{name}"
            );
        }
        // One Prometheus, two rl hosts, one of them down: RlDown holds for it
        // although the other still exports rl_uptime_seconds.
        let two = scrape(&[
            ("up{job=\"rl\",instance=\"a:9101\"}", 1.0),
            ("rl_uptime_seconds{job=\"rl\",instance=\"a:9101\"}", 5.0),
            ("up{job=\"rl\",instance=\"b:9101\"}", 0.0),
        ]);
        assert_eq!(
            alert("RlDown").holds(&two),
            Some(true),
            "one host of two down"
        );
        assert_eq!(
            alert("RlDown").holds(&scrape(&[("rl_uptime_seconds", 5.0)])),
            Some(true),
            "no rl target scraped at all (a job of another name)"
        );
        assert_eq!(
            alert("RlReloadFailed").holds(&calm),
            None,
            "increase() needs two scrapes"
        );
        assert_eq!(
            alert("RlFloodMode").missing(&scrape(&[("rl_flood_modes", 1.0)])),
            ["rl_flood_mode"]
        );
        assert_eq!(
            labels_of(r#"rule="a\"b",verdict="passed""#),
            BTreeMap::from([
                ("rule".into(), "a\"b".into()),
                ("verdict".into(), "passed".into())
            ])
        );
    }
}
