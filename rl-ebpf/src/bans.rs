//! Bans end in the kernel: a source the trie denies by bans alone
//! ([`DENY_BY_BANS`]) is denied only while the longest ban covering it,
//! which carries the latest end of the bans around it, has not ended. A
//! ban's end needs no daemon running at that time.

use aya_ebpf::{
    bindings::BPF_F_NO_PREALLOC, helpers::bpf_ktime_get_ns, macros::map, maps::LpmTrie,
};
use rl_common::{CidrEntry, DENY_BY_BANS, LIST_DENY};

use crate::limit::{key4, key6};

#[map(name = "RL_BANS4")]
static RL_BANS4: LpmTrie<[u8; 5], u64> =
    LpmTrie::with_max_entries(2 * rl_common::LPM_SLOT_LEN, BPF_F_NO_PREALLOC);
#[map(name = "RL_BANS6")]
static RL_BANS6: LpmTrie<[u8; 17], u64> =
    LpmTrie::with_max_entries(2 * rl_common::LPM_SLOT_LEN, BPF_F_NO_PREALLOC);

/// Whether trie value `v` denies the source `src`: a `[[deny]]` always, a
/// ban until it ends (no end found: denied, failing closed).
#[inline(always)]
pub fn denies(v: u32, slot: u32, is_v6: bool, src: &[u32; 4]) -> bool {
    if CidrEntry::list(v) != LIST_DENY {
        return false;
    }
    if v & DENY_BY_BANS == 0 {
        return true;
    }
    let end = if is_v6 {
        RL_BANS6.get(&key6(slot, src))
    } else {
        RL_BANS4.get(&key4(slot, src))
    };
    end.is_none_or(|&end| unsafe { bpf_ktime_get_ns() } < end)
}
