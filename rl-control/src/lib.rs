//! rl-control: the daemon and CLI of rl, the XDP rate limiter.
//!
//! Data flows one way: [`config`] (parse and validate the rule file, with
//! [`rules`] for the rule language and [`units`] for its values) ➜
//! [`compile`] (rules ➜ map entries) ➜ [`datapath`] (aya: load, attach, maps)
//! ➜ [`daemon`] (run loop, signals, reload, periodic counters).

pub mod api;
pub mod apply;
pub mod client;
pub mod cluster;
pub mod compile;
pub mod config;
pub mod daemon;
pub mod datapath;
pub mod document;
pub mod l7;
pub mod rules;
pub mod state;
pub mod units;
