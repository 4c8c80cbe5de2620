//! Config ➜ map entries: the only place that knows both the rule file and the
//! datapath's layouts.

use rl_common::{prefix_mask_words, DatapathConfig, Limit};

use crate::config::Config;

/// What the datapath needs from a [`Config`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Compiled {
    /// Capacity of the per-source LRU map (fixed at load time).
    pub max_sources: u32,
    /// Entry 0 of the config map.
    pub datapath: DatapathConfig,
}

pub fn compile(config: &Config) -> Compiled {
    let d = &config.datapath;
    let [v4_mask] = prefix_mask_words::<1>(d.ipv4_prefix);
    Compiled {
        max_sources: d.max_sources,
        datapath: DatapathConfig {
            default_limit: Limit::per_second(config.default.rate, config.default.burst)
                .expect("validated by config: rate and burst are representable"),
            v4_mask,
            enabled: 1,
            v6_mask: prefix_mask_words::<4>(d.ipv6_prefix),
            // Filled in by the datapath, which measures the kernel tick.
            ..DatapathConfig::default()
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn compiles_limit_and_masks() {
        let c = Config::from_str(
            "[datapath]\nipv4_prefix = 24\nipv6_prefix = 48\n[default]\nrate = 100\nburst = 7\n",
            "x",
        )
        .unwrap();
        let out = compile(&c);
        assert_eq!(out.datapath.default_limit.interval_ns, 10_000_000);
        assert_eq!(out.datapath.default_limit.burst_span_ns, 70_000_000);
        assert_eq!(out.datapath.v4_mask.to_ne_bytes(), [255, 255, 255, 0]);
        assert_eq!(out.datapath.v6_mask[1].to_ne_bytes(), [255, 255, 0, 0]);
        assert_eq!(out.datapath.enabled, 1);
        assert_eq!(out.max_sources, 1 << 20);
    }
}
