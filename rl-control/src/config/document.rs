//! The rule file as a document that the admin API edits.
//!
//! The TOML text stays the single source of truth: every API change is made
//! to the text, then validated by the same loader as a file reload
//! ([`crate::config::Config::from_str`]), and written back to the file. Adding
//! or removing one rule or ban edits the document in place (comments and
//! layout elsewhere survive); replacing the whole set takes the new text.
//!
//! JSON mirrors the file with two plural names: `rules` for `[[rule]]` and
//! `bans` for `[[ban]]`.

use toml_edit::{ArrayOfTables, DocumentMut, Item};

/// Why an edit was refused, by HTTP meaning.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EditError {
    /// The request itself is wrong (400).
    Invalid(String),
    /// A rule of that name exists (409).
    Conflict(String),
    /// No such rule or ban (404).
    NotFound(String),
}

/// File keys ➜ JSON keys.
const PLURALS: [(&str, &str); 2] = [("rule", "rules"), ("ban", "bans")];

fn rename(v: &mut serde_json::Value, to_json: bool) {
    if let Some(obj) = v.as_object_mut() {
        for (file, json) in PLURALS {
            let (from, to) = if to_json { (file, json) } else { (json, file) };
            if let Some(x) = obj.remove(from) {
                obj.insert(to.to_string(), x);
            }
        }
    }
}

/// The document as JSON (the text must parse: it was validated when set).
pub fn to_json(text: &str) -> serde_json::Value {
    let value: toml::Value = toml::from_str(text).unwrap_or(toml::Value::Table(Default::default()));
    let mut v = serde_json::to_value(value).unwrap_or_default();
    if let Some(obj) = v.as_object_mut() {
        for (_, json) in PLURALS {
            obj.entry(json)
                .or_insert_with(|| serde_json::Value::Array(vec![]));
        }
        for key in ["allow", "deny"] {
            obj.entry(key)
                .or_insert_with(|| serde_json::Value::Array(vec![]));
        }
    }
    rename(&mut v, true);
    // One admin token must not hand out the Redis password every host of
    // the cluster shares: shown as `***` ([`for_put`] puts it back).
    if let Some(urls) = v
        .pointer_mut("/cluster/redis")
        .and_then(|u| u.as_array_mut())
    {
        for u in urls {
            if let Some(url) = u.as_str() {
                *u = crate::cluster::settings::redacted(url).into();
            }
        }
    }
    v
}

/// What a `PUT /v1/rules` of `text` writes, against the running file
/// `current` (each parsed once, however large): `current`'s `[[ban]]`s
/// kept when `text` has no `ban` of its own ([`keep_bans`]), and each
/// `[cluster] redis` URL shown with its password starred given back
/// ([`give_secrets`]). A `text` that does not parse is left for the loader
/// to report.
pub fn for_put(text: String, current: &str) -> Result<String, EditError> {
    let Ok(mut doc) = text.parse::<DocumentMut>() else {
        return Ok(text);
    };
    let mut cur = parse(current)?;
    let given = give_secrets(&mut doc, &cur);
    let kept = keep_bans(&mut doc, &mut cur);
    Ok(if given || kept { doc.to_string() } else { text })
}

/// Gives each `[cluster] redis` URL of `doc` that reads as one of `cur`'s
/// with its password shown as `***` that URL back: what `GET /v1/rules`
/// answered can be put back as is. Whether any was.
fn give_secrets(doc: &mut DocumentMut, cur: &DocumentMut) -> bool {
    let known: Vec<String> = cur
        .get("cluster")
        .and_then(|c| c.get("redis"))
        .and_then(Item::as_array)
        .map(|a| {
            a.iter()
                .filter_map(|u| u.as_str().map(String::from))
                .collect()
        })
        .unwrap_or_default();
    let mut changed = false;
    if let Some(list) = doc
        .get_mut("cluster")
        .and_then(|c| c.get_mut("redis"))
        .and_then(Item::as_array_mut)
    {
        for u in list.iter_mut() {
            let Some(shown) = u.as_str().filter(|s| s.contains("***")) else {
                continue;
            };
            if let Some(real) = known
                .iter()
                .find(|k| crate::cluster::settings::redacted(k) == shown)
            {
                *u = real.as_str().into();
                changed = true;
            }
        }
    }
    changed
}

/// TOML text for a JSON document (validated afterwards by the caller):
/// objects become `[tables]`, lists of objects `[[tables]]`, anything
/// deeper inline values. Written directly: going through a TOML
/// serializer took 20 ms for 1,000 rules.
pub fn from_json(json: &serde_json::Value) -> Result<String, EditError> {
    let Some(obj) = json.as_object() else {
        return Err(EditError::Invalid(
            "the body must be a JSON object like the one GET /v1/rules returns".into(),
        ));
    };
    let file_key = |k: &str| {
        PLURALS
            .iter()
            .find(|(_, j)| *j == k)
            .map_or(k.to_string(), |(f, _)| f.to_string())
    };
    let key = |k: &str| toml_edit::Key::new(k).display_repr().into_owned();
    let line = |out: &mut String, k: &str, v: &serde_json::Value| -> Result<(), EditError> {
        let mut value = value_from_json(v).map_err(|e| match e {
            EditError::Invalid(m) => EditError::Invalid(format!("{k}: {m}")),
            other => other,
        })?;
        value.decor_mut().clear();
        out.push_str(&format!("{} = {value}\n", key(k)));
        Ok(())
    };
    let is_tables = |v: &serde_json::Value| {
        v.as_array()
            .is_some_and(|a| !a.is_empty() && a.iter().all(|x| x.is_object()))
    };
    let mut out = String::new();
    for (k, v) in obj.iter().filter(|(_, v)| !v.is_object() && !is_tables(v)) {
        line(&mut out, &file_key(k), v)?;
    }
    for (k, v) in obj {
        if let Some(t) = v.as_object() {
            out.push_str(&format!("\n[{}]\n", key(&file_key(k))));
            for (k2, v2) in t {
                line(&mut out, k2, v2)?;
            }
        }
    }
    for (k, v) in obj.iter().filter(|(_, v)| is_tables(v)) {
        for t in v.as_array().into_iter().flatten() {
            out.push_str(&format!("\n[[{}]]\n", key(&file_key(k))));
            for (k2, v2) in t.as_object().into_iter().flatten() {
                line(&mut out, k2, v2)?;
            }
        }
    }
    Ok(out)
}

/// `cur`'s `[[ban]]`s moved into `doc` when it has no `ban` of its own:
/// rules put from elsewhere (a config manager's file, which knows nothing
/// of bans) keep the bans in force; `ban = []` (JSON `"bans": []`, as `GET
/// /v1/rules` answers with none) lifts them. Whether any were.
fn keep_bans(doc: &mut DocumentMut, cur: &mut DocumentMut) -> bool {
    if doc.contains_key("ban") {
        return false;
    }
    let Some(bans) = cur.remove("ban") else {
        return false;
    };
    doc.insert("ban", bans);
    true
}

fn parse(text: &str) -> Result<DocumentMut, EditError> {
    text.parse::<DocumentMut>()
        .map_err(|e| EditError::Invalid(format!("the current rule file does not parse: {e}")))
}

/// The document's `[[key]]` tables, created empty if absent.
fn tables<'a>(doc: &'a mut DocumentMut, key: &str) -> Result<&'a mut ArrayOfTables, EditError> {
    // Absent, or an empty list (`ban = []`, as a PUT of what GET returned
    // writes for no bans): a list of tables to add to.
    if doc
        .get(key)
        .is_none_or(|i| i.as_array().is_some_and(|a| a.is_empty()))
    {
        doc.insert(key, Item::ArrayOfTables(ArrayOfTables::new()));
    }
    // An inline list of tables (`ban = [{ cidr = "…", until = … }]`,
    // which the loader takes): edited as the [[key]] tables it means.
    if let Some(item) = doc.get_mut(key) {
        if item.is_array() {
            let inline = std::mem::take(item);
            *item = match inline.into_array_of_tables() {
                Ok(tables) => Item::ArrayOfTables(tables),
                Err(other) => other,
            };
        }
    }
    doc.get_mut(key)
        .and_then(Item::as_array_of_tables_mut)
        .ok_or_else(|| {
            EditError::Invalid(format!(
                "`{key}` in the rule file is not a list of [[{key}]] tables"
            ))
        })
}

/// A TOML value for a JSON one (objects become inline tables, as in
/// `limits = [{ rate = 200, per = "10s" }]`).
fn value_from_json(v: &serde_json::Value) -> Result<toml_edit::Value, EditError> {
    use serde_json::Value as J;
    Ok(match v {
        J::Null => {
            return Err(EditError::Invalid(
                "null is not a value in the rule file: leave the field out".into(),
            ))
        }
        J::Bool(b) => (*b).into(),
        J::Number(n) => match (n.as_i64(), n.as_f64()) {
            (Some(i), _) => i.into(),
            (None, Some(f)) => f.into(),
            _ => return Err(EditError::Invalid(format!("{n} is out of range"))),
        },
        J::String(s) => s.as_str().into(),
        J::Array(a) => {
            let mut out = toml_edit::Array::new();
            for x in a {
                out.push(value_from_json(x)?);
            }
            out.into()
        }
        J::Object(o) => {
            let mut t = toml_edit::InlineTable::new();
            for (k, x) in o {
                t.insert(k, value_from_json(x)?);
            }
            t.into()
        }
    })
}

/// One `[[key]]` table made from a JSON object.
fn table_from_json(key: &str, json: &serde_json::Value) -> Result<toml_edit::Table, EditError> {
    let obj = json
        .as_object()
        .ok_or_else(|| EditError::Invalid(format!("the {key} must be a JSON object")))?;
    let mut t = toml_edit::Table::new();
    for (k, v) in obj {
        t.insert(k, toml_edit::value(value_from_json(v)?));
    }
    Ok(t)
}

fn name_of(t: &toml_edit::Table) -> Option<&str> {
    t.get("name").and_then(|n| n.as_str())
}

/// Appends one `[[rule]]` (last in file order, so it matches after every
/// existing rule).
pub fn add_rule(text: &str, rule: &serde_json::Value) -> Result<String, EditError> {
    let name = rule
        .get("name")
        .and_then(|n| n.as_str())
        .ok_or_else(|| EditError::Invalid("the rule needs a \"name\" (string)".into()))?
        .to_string();
    let table = table_from_json("rule", rule)?;
    let mut doc = parse(text)?;
    let rules = tables(&mut doc, "rule")?;
    if rules.iter().any(|t| name_of(t) == Some(name.as_str())) {
        return Err(EditError::Conflict(format!(
            "a rule named \"{name}\" exists: DELETE /v1/rules/{name} first, or PUT the whole set"
        )));
    }
    rules.push(table);
    Ok(doc.to_string())
}

/// Removes the `[[rule]]` named `name`.
pub fn remove_rule(text: &str, name: &str) -> Result<String, EditError> {
    let mut doc = parse(text)?;
    let rules = tables(&mut doc, "rule")?;
    let Some(i) = rules.iter().position(|t| name_of(t) == Some(name)) else {
        return Err(EditError::NotFound(format!("no rule named \"{name}\"")));
    };
    rules.remove(i);
    Ok(doc.to_string())
}

/// Sets the ban of `cidr` until `until`, replacing one of the same prefix
/// but never shortening it (a short automated ban must not lift a longer
/// one set by hand: DELETE it first to shorten it). Returns the text, and
/// the end and reason of the ban in force (the longer one's).
pub fn set_ban(
    text: &str,
    cidr: &str,
    until: u64,
    reason: &str,
) -> Result<(String, u64, String), EditError> {
    let mut doc = parse(text)?;
    let bans = tables(&mut doc, "ban")?;
    // The same prefix however it is written (`192.0.2.7` is `192.0.2.7/32`).
    let same = |t: &str| {
        t == cidr
            || super::units::parse_cidr(t)
                .ok()
                .zip(super::units::parse_cidr(cidr).ok())
                .is_some_and(|(a, b)| a == b)
    };
    let (mut until, mut reason) = (until, reason.to_string());
    bans.retain(|t| {
        let hit = t.get("cidr").and_then(|c| c.as_str()).is_some_and(same);
        let held = t
            .get("until")
            .and_then(|u| u.as_integer())
            .unwrap_or(0)
            .max(0) as u64;
        if hit && held > until {
            // The longer ban stays, with its own reason.
            until = held;
            reason = t
                .get("reason")
                .and_then(|r| r.as_str())
                .unwrap_or("")
                .to_string();
        }
        !hit
    });
    let mut t = toml_edit::Table::new();
    t.insert("cidr", toml_edit::value(cidr));
    t.insert("until", toml_edit::value(until as i64));
    if !reason.is_empty() {
        t.insert("reason", toml_edit::value(reason.as_str()));
    }
    bans.push(t);
    Ok((doc.to_string(), until, reason))
}

/// Removes the bans for which `lift(cidr, until)` holds; returns the new
/// text and how many were removed.
pub fn remove_bans(
    text: &str,
    lift: impl Fn(&str, u64) -> bool,
) -> Result<(String, usize), EditError> {
    let mut doc = parse(text)?;
    let bans = tables(&mut doc, "ban")?;
    let before = bans.len();
    bans.retain(|t| {
        let cidr = t.get("cidr").and_then(|c| c.as_str()).unwrap_or("");
        let until = t
            .get("until")
            .and_then(|u| u.as_integer())
            .unwrap_or(0)
            .max(0) as u64;
        !lift(cidr, until)
    });
    let removed = before - bans.len();
    if bans.is_empty() {
        doc.remove("ban");
    }
    Ok((doc.to_string(), removed))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;

    const FILE: &str = "# our limits\n[default]\nrate = 100 # per source\n\n[[rule]]\nname = \"ssh\"\nproto = \"tcp\"\ndst_ports = [22]\nrate = 5\n";

    /// The Redis password is not shown, and what was shown can be put back.
    #[test]
    fn redis_passwords_are_shown_as_stars_and_put_back() {
        let file = "[default]\nrate = 5\n[cluster]\nredis = [\"redis://rl:s3cret@10.0.0.5:6379\"]\nnode = \"a\"\n";
        let json = to_json(file);
        assert_eq!(json["cluster"]["redis"][0], "redis://rl:***@10.0.0.5:6379");
        assert!(!json.to_string().contains("s3cret"));
        let back = for_put(from_json(&json).unwrap(), file).unwrap();
        let c = Config::from_str(&back, "x").unwrap();
        assert_eq!(
            c.cluster.unwrap().redis,
            ["redis://rl:s3cret@10.0.0.5:6379"]
        );
        // Another host's URL with stars is not one of ours: left as sent.
        let other = "[cluster]\nredis = [\"redis://rl:***@10.0.0.6:6379\"]\n";
        assert_eq!(for_put(other.into(), file).unwrap(), other);
    }

    /// Rules put without bans keep the bans in force; `ban = []` (or a
    /// list of its own) replaces them; a body that does not parse is left
    /// for the loader to report.
    #[test]
    fn rules_put_without_bans_keep_the_bans_in_force() {
        let current = set_ban(FILE, "198.51.100.0/24", 4_000_000_000, "scan")
            .unwrap()
            .0;
        let kept = for_put("[default]\nrate = 7\n".into(), &current).unwrap();
        let c = Config::from_str(&kept, "x").unwrap();
        assert_eq!(c.bans.len(), 1, "{kept}");
        assert_eq!(c.bans[0].until, 4_000_000_000);
        let lifted = for_put("ban = []\n[default]\nrate = 7\n".into(), &current).unwrap();
        assert!(
            Config::from_str(&lifted, "x").unwrap().bans.is_empty(),
            "{lifted}"
        );
        let json = from_json(&serde_json::json!({"default": {"rate": 7}, "bans": []})).unwrap();
        let lifted = for_put(json, &current).unwrap();
        assert!(
            Config::from_str(&lifted, "x").unwrap().bans.is_empty(),
            "{lifted}"
        );
        assert_eq!(
            for_put("[default\n".into(), &current).unwrap(),
            "[default\n"
        );
        assert_eq!(
            for_put("[default]\nrate = 7\n".into(), FILE).unwrap(),
            "[default]\nrate = 7\n"
        );
    }

    #[test]
    fn adding_and_removing_a_rule_keeps_comments_and_validates() {
        let rule = serde_json::json!({"name": "dns", "proto": "udp", "dst_ports": [53, "5353-5354"], "limits": [{"rate": 100, "per": "10s"}]});
        let text = add_rule(FILE, &rule).unwrap();
        assert!(
            text.contains("# our limits") && text.contains("# per source"),
            "{text}"
        );
        let c = Config::from_str(&text, "x").unwrap();
        assert_eq!(
            c.rules.iter().map(|r| r.name.as_str()).collect::<Vec<_>>(),
            ["ssh", "dns"]
        );
        assert_eq!(
            add_rule(&text, &rule).unwrap_err(),
            EditError::Conflict(
                "a rule named \"dns\" exists: DELETE /v1/rules/dns first, or PUT the whole set"
                    .into()
            )
        );
        let text = remove_rule(&text, "ssh").unwrap();
        assert_eq!(Config::from_str(&text, "x").unwrap().rules.len(), 1);
        assert!(matches!(
            remove_rule(&text, "ssh"),
            Err(EditError::NotFound(_))
        ));
        assert!(matches!(
            add_rule(&text, &serde_json::json!({"proto": "tcp"})),
            Err(EditError::Invalid(_))
        ));
    }

    #[test]
    fn json_round_trips_through_the_file_form() {
        let json = to_json(FILE);
        assert_eq!(json["rules"][0]["name"], "ssh");
        assert_eq!(json["allow"], serde_json::json!([]));
        let back = from_json(&json).unwrap();
        assert_eq!(
            Config::from_str(&back, "x").unwrap(),
            Config::from_str(FILE, "x").unwrap()
        );
        assert!(matches!(
            from_json(&serde_json::json!([1])),
            Err(EditError::Invalid(_))
        ));
        assert!(matches!(
            from_json(&serde_json::json!({"default": {"rate": null}})),
            Err(EditError::Invalid(_))
        ));
    }

    #[test]
    fn bans_are_set_replaced_and_lifted() {
        let (text, _, _) = set_ban(FILE, "192.0.2.0/24", 2_000_000_000, "scanner").unwrap();
        let (text, until, _) =
            set_ban(&text, "192.0.2.0/24", 2_000_000_100, "scanner again").unwrap();
        assert_eq!(until, 2_000_000_100);
        // A shorter ban of the same prefix keeps the longer one's end.
        let (shorter, kept, reason) =
            set_ban(&text, "192.0.2.0/24", 2_000_000_050, "a tool's").unwrap();
        assert_eq!(
            (kept, shorter.as_str(), reason.as_str()),
            (2_000_000_100, text.as_str(), "scanner again"),
            "the longer ban stays as it was"
        );
        // Inline bans (the loader takes them) are edited as [[ban]] tables.
        let inline = "ban = [{ cidr = \"198.51.100.0/24\", until = 5 }]\n[default]\nrate = 1\n";
        assert_eq!(
            Config::from_str(inline, "x").unwrap().bans.len(),
            1,
            "{inline}"
        );
        let (lifted, n) = remove_bans(inline, |_, until| until <= 10).unwrap();
        assert_eq!(
            (n, Config::from_str(&lifted, "x").unwrap().bans.len()),
            (1, 0),
            "{lifted}"
        );
        let (added, _, _) = set_ban(inline, "203.0.113.0/24", 2_000_000_000, "").unwrap();
        assert_eq!(
            Config::from_str(&added, "x").unwrap().bans.len(),
            2,
            "{added}"
        );
        let c = Config::from_str(&text, "x").unwrap();
        assert_eq!(c.bans.len(), 1);
        assert_eq!(
            (c.bans[0].until, c.bans[0].reason.as_str()),
            (2_000_000_100, "scanner again")
        );
        assert_eq!(c.active_bans(2_000_000_099).count(), 1);
        assert_eq!(
            c.active_bans(2_000_000_100).count(),
            0,
            "a ban lifts at its `until`"
        );
        let (text, n) = remove_bans(&text, |cidr, _| cidr == "192.0.2.0/24").unwrap();
        assert_eq!(n, 1);
        assert!(Config::from_str(&text, "x").unwrap().bans.is_empty());
        // A ban written by hand in another form is the same prefix: replaced.
        let hand = format!("{FILE}\n[[ban]]\ncidr = \"2001:DB8::/32\"\nuntil = 2000000000\n");
        let (text, _, _) = set_ban(&hand, "2001:db8::/32", 2_100_000_000, "").unwrap();
        let c = Config::from_str(&text, "x").unwrap();
        assert_eq!(
            c.bans.iter().map(|b| b.until).collect::<Vec<_>>(),
            [2_100_000_000]
        );
    }

    /// A PUT of what GET returned writes `ban = []` and `rule = []` for
    /// none: adding a ban or a rule to that still works.
    #[test]
    fn a_document_put_back_as_read_still_takes_bans_and_rules() {
        let text = from_json(&to_json("[default]\nrate = 100\n")).unwrap();
        let (text, _, _) = set_ban(&text, "198.51.100.0/24", 2_000_000_000, "").unwrap();
        let text = add_rule(&text, &serde_json::json!({"name": "x", "rate": 1})).unwrap();
        let c = Config::from_str(&text, "x").unwrap();
        assert_eq!((c.bans.len(), c.rules.len()), (1, 1), "{text}");
    }
}
