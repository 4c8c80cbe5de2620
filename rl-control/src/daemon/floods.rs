//! The flood detectors' reader: every second, apart from the tables'
//! walk (a long walk must not hide a short flood), it reads the CPUs'
//! detectors and raises `flood_started` and `flood_ended`.

use std::time::Duration;

use tracing::{info, warn};

use crate::{
    config::unix_now_ms,
    daemon::{
        collect::{outcome, tried, Reader},
        state::{lock, Shared, State},
    },
    datapath::{FloodReading, TableMaps},
};

/// How often the detectors are read: under `FLOOD_REPORT_HOLD_NS` (2 s),
/// so a spell of flood mode between two readings is still seen.
const READ_INTERVAL: Duration = Duration::from_secs(1);

/// Reads the flood detectors every second; a reading that fails is
/// reported (`pressure.collector.flood_reading`) and tried again.
pub(super) async fn watch_floods(state: Shared, ids: TableMaps) {
    let mut every = tokio::time::interval(READ_INTERVAL);
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        every.tick().await;
        let read = outcome(
            tokio::task::spawn_blocking({
                let ids = ids.clone();
                move || crate::datapath::flood_mode(&ids)
            })
            .await,
        );
        let mut s = lock(&state);
        match read {
            Ok(flood) => {
                record(&mut s, &flood);
                tried(&mut s, Reader::FloodReading, Ok(()));
            }
            Err(e) => tried(&mut s, Reader::FloodReading, Err(e)),
        }
    }
}

/// Records a reading: the figures, and an event when flood mode starts
/// or ends.
fn record(s: &mut State, flood: &FloodReading) {
    let p = &mut s.pressure;
    p.unseen_keys_per_sec =
        flood.unseen_last_window as f64 * 1e9 / (1u64 << rl_common::FLOOD_WINDOW_SHIFT) as f64;
    (p.flood_mode_cpus, p.cpus) = (flood.cpus_on, flood.cpus);
    if flood.on == p.flood_mode {
        return;
    }
    p.flood_mode = flood.on;
    p.flood_since_unix_ms = flood.on.then(unix_now_ms);
    let (event, unseen) = (
        if flood.on {
            "flood_started"
        } else {
            "flood_ended"
        },
        p.unseen_keys_per_sec,
    );
    if flood.on {
        let cpus = format!("{} of {}", flood.cpus_on, flood.cpus);
        warn!(
            event,
            unseen_keys_per_sec = unseen,
            cpus,
            "flood mode: unseen sources are charged to their prefix cells"
        );
    } else {
        info!(
            event,
            "flood mode ended: new sources get buckets of their own again"
        );
    }
    s.push_host_event(event, unix_now_ms());
}
