//! rl-control: the daemon and CLI of rl, the XDP rate limiter.
//!
//! Data flows one way, one folder per room (see the house plan):
//! [`config`] (parse and validate the rule file: the rule language, its
//! values, the file as a document the API edits) ➜ [`compile`] (rules ➜ map
//! entries) ➜ [`datapath`] (aya: load, attach, install, read) ➜ [`daemon`]
//! (run loop, signals, reload, periodic jobs, the shared state). Beside
//! them: [`l7`] (request decisions), [`cluster`] (Redis), [`api`] (admin
//! HTTP) and [`cli`] (commands over the admin API).

pub mod api;
pub mod cli;
pub mod cluster;
pub mod compile;
pub mod config;
pub mod daemon;
pub mod datapath;
pub mod http1;
pub mod l7;
