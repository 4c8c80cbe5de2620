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
