//! The totals of retired rules, kept across daemon restarts.
//!
//! A rule's counters live in the pinned maps while it keeps its place in
//! the rule table; an install that moves or changes it zeroes its entry
//! and adds what it had counted to the daemon's totals by name (see
//! `datapath::counters`). Those totals were the process's alone, so a
//! restart after a reload lowered every such rule's counters (and the
//! host's) without taking them to 0: Prometheus reads a drop as a reset
//! and counts the whole total again. They are now written to
//! `<runtime dir>/rule-counters.json` with the kernel id of the pinned
//! counters map, within a second of any change and at stop; a daemon that
//! adopts that same datapath adds them back. Another datapath (a fresh
//! load, after a detach or a reboot) has another id: the file is ignored,
//! then replaced.

use std::{collections::BTreeMap, path::Path};

use rl_common::RuleStats;
use serde::{Deserialize, Serialize};
use tracing::{info, warn};

use crate::{
    daemon::state::{lock, Shared},
    datapath::Datapath,
};

/// The file's name in the runtime directory.
pub const FILE: &str = "rule-counters.json";

#[derive(Serialize, Deserialize, PartialEq, Debug, Default)]
struct Kept {
    /// The kernel id of the rule counters' map the totals belong to.
    counters_map: u32,
    /// Per rule name: passed packets, passed bytes, dropped packets,
    /// dropped bytes, shadow packets, shadow bytes.
    retired: BTreeMap<String, [u64; 6]>,
}

fn kept_of(dp: &Datapath) -> Option<Kept> {
    let counters_map = dp.counters_map_id().ok()?;
    let retired = dp
        .retired_totals()
        .iter()
        .map(|(name, r)| {
            let v = [
                r.passed_pkts,
                r.passed_bytes,
                r.dropped_pkts,
                r.dropped_bytes,
                r.shadow_pkts,
                r.shadow_bytes,
            ];
            (name.clone(), v)
        })
        .collect();
    Some(Kept {
        counters_map,
        retired,
    })
}

/// At start, once the datapath is loaded or adopted: adds the totals an
/// earlier daemon kept of this same datapath's retired rules.
pub fn restore(dp: &mut Datapath, runtime_dir: &Path) {
    let path = runtime_dir.join(FILE);
    let Ok(text) = std::fs::read_to_string(&path) else {
        return;
    };
    let kept: Kept = match serde_json::from_str(&text) {
        Ok(k) => k,
        Err(e) => {
            warn!(file = %path.display(), "the kept rule counters are unreadable ({e}): rules retired before this start count from 0 again");
            return;
        }
    };
    if !dp.adopted() || dp.counters_map_id().ok() != Some(kept.counters_map) {
        // Another datapath's: replaced by this one's at the first save.
        return;
    }
    let n = kept.retired.len();
    dp.restore_retired(kept.retired.into_iter().map(|(name, v)| {
        let r = RuleStats {
            passed_pkts: v[0],
            passed_bytes: v[1],
            dropped_pkts: v[2],
            dropped_bytes: v[3],
            shadow_pkts: v[4],
            shadow_bytes: v[5],
        };
        (name, r)
    }));
    info!("the counters of {n} rules the daemon before retired go on from where it left them");
}

/// One save (or removal) at a time: the keeper's, already running on the
/// blocking pool when it is aborted at stop, and the last one at stop write
/// the same temporary file.
static SAVING: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Writes the totals if they differ from `last` (atomically: a temporary
/// file renamed over): what it wrote, or why it could not.
fn save(state: &Shared, runtime_dir: &Path, last: Option<&Kept>) -> Result<Option<Kept>, String> {
    let _one = SAVING.lock().unwrap_or_else(|e| e.into_inner());
    let Some(now) = kept_of(&lock(state).dp) else {
        return Ok(None);
    };
    if last == Some(&now) {
        return Ok(None);
    }
    let (path, tmp) = (
        runtime_dir.join(FILE),
        runtime_dir.join(format!("{FILE}.tmp")),
    );
    serde_json::to_vec(&now)
        .map_err(std::io::Error::other)
        .and_then(|bytes| std::fs::write(&tmp, bytes))
        .and_then(|()| std::fs::rename(&tmp, &path))
        .map_err(|e| format!("writing {}: {e}", path.display()))?;
    Ok(Some(now))
}

/// Keeps the file current: checked every second (and written at stop,
/// [`save_now`]); a failure is warned about once per failing spell.
pub async fn keep(state: Shared, runtime_dir: std::path::PathBuf) {
    let (mut last, mut warned) = (None::<Kept>, false);
    let mut every = tokio::time::interval(std::time::Duration::from_secs(1));
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        every.tick().await;
        let (st, dir) = (state.clone(), runtime_dir.clone());
        let (was, outcome) = tokio::task::spawn_blocking(move || {
            let outcome = save(&st, &dir, last.as_ref());
            (last, outcome)
        })
        .await
        .unwrap_or((None, Ok(None)));
        last = was;
        match outcome {
            Ok(Some(k)) => (last, warned) = (Some(k), false),
            Ok(None) => {}
            Err(e) => {
                if !warned {
                    warn!("{e}: the counters of rules retired since the daemon started would drop at a restart; tried again every second");
                    warned = true;
                }
            }
        }
    }
}

/// At stop: the last write, while the datapath is still loaded; or, when
/// the datapath is detached, the file removed (its counters go with it).
pub fn at_stop(state: &Shared, runtime_dir: &Path, detached: bool) {
    if detached {
        let _one = SAVING.lock().unwrap_or_else(|e| e.into_inner());
        let _ = std::fs::remove_file(runtime_dir.join(FILE));
    } else if let Err(e) = save(state, runtime_dir, None) {
        warn!("{e}: the counters of rules retired since the daemon started start from 0 at the next start");
    }
}
