//! The rl test lab: network namespaces, veth pairs, real traffic, hand-built
//! frames, and a guard for the `rl-control` daemon. Used by the end-to-end
//! tests, `cargo xtask demo` and `cargo xtask bench`.

pub mod daemon;
pub mod frames;
pub mod lab;
pub mod traffic;

use anyhow::{Context, Result};
use rl_control::{compile::compile, config::Config, datapath::Datapath};

/// Loads the limiter with the config in `toml` (not attached).
pub fn datapath(toml: &str) -> Result<Datapath> {
    let config = Config::from_str(toml, "<test>")?;
    Datapath::load(&compile(&config)).context("loading the datapath")
}

/// Loads the limiter with `toml` and attaches it to the lab's protected
/// interface in `mode`.
pub fn attach(
    lab: &lab::Lab,
    toml: &str,
    mode: rl_control::datapath::AttachMode,
) -> Result<Datapath> {
    let mut dp = datapath(toml)?;
    // Attaching resolves the interface name in the protected namespace; the
    // link is an fd and stays attached wherever the Datapath goes.
    lab.b.run(move || {
        dp.attach(lab::VB, mode)?;
        Ok(dp)
    })
}

/// `burst + rate × seconds`, the packets a limiter passes from a flood.
pub fn expected_passed(rate: u64, burst: u64, seconds: f64) -> f64 {
    burst as f64 + rate as f64 * seconds
}

/// The accuracy every flood test holds to: ±1% or ±2 packets, whichever is larger.
pub fn tolerance(expected: f64) -> f64 {
    (expected * 0.01).max(2.0)
}
