//! Pinning: the datapath's maps and XDP link live in bpffs under
//! `<pin_dir>/<iface>/`, so enforcement and every bucket outlive the daemon.
//! A daemon that finds them checks their layout against its own object, then
//! adopts them; `detach` removes them.

use std::{
    ffi::CString,
    os::fd::{AsFd, AsRawFd},
    path::{Path, PathBuf},
};

use aya::{
    maps::{Array, Map, MapData, MapInfo},
    programs::links::{FdLink, PinnedLink},
};
use rl_common::{LAYOUT_VERSION, MAP_LAYOUT};
use tracing::info;

use super::{chain, DatapathError};

/// `statfs` magic of bpffs.
const BPF_FS_MAGIC: i64 = 0xcafe_4a11;
/// The conventional bpffs mount point.
const SYS_FS_BPF: &str = "/sys/fs/bpf";
/// A link's pin inside the pin directory: `link-<mode>-<iface>`, the mode
/// (`native`, `skb`) being the one it was created in, which it keeps.
fn link_pin(iface: &str, mode: &str) -> String {
    format!("link-{mode}-{iface}")
}

/// The directory name for a set of interfaces: their names, sorted, joined
/// by `+` (`eth0`, `eth0+eth1`).
pub fn group_name(ifaces: &[String]) -> String {
    let mut v: Vec<&str> = ifaces.iter().map(String::as_str).collect();
    v.sort_unstable();
    v.dedup();
    v.join("+")
}

/// What the object expects of one map.
#[derive(Clone, Debug)]
pub(super) struct MapSpec {
    pub name: String,
    pub map_type: u32,
    pub key_size: u32,
    pub value_size: u32,
    pub max_entries: u32,
    /// `BPF_F_*` creation flags: the daemon mmaps the arrays made with
    /// `BPF_F_MMAPABLE`, and a map made without would not map.
    pub flags: u32,
}

/// The maps of `object` that are pinned (rl's own: `RL_*`), with the
/// capacities this load will give them (`sized`: name ➜ entries).
pub(super) fn specs(object: &[u8], sized: &[(&str, u32)]) -> Result<Vec<MapSpec>, DatapathError> {
    let obj = aya_obj::Object::parse(object)
        .map_err(|e| DatapathError::Load(format!("parsing the XDP object: {e}")))?;
    let mut out: Vec<MapSpec> = obj
        .maps
        .iter()
        .filter(|(name, _)| name.starts_with("RL_"))
        .map(|(name, m)| MapSpec {
            name: name.clone(),
            map_type: m.map_type(),
            key_size: m.key_size(),
            value_size: m.value_size(),
            max_entries: sized
                .iter()
                .find(|(n, _)| n == name)
                .map_or(m.max_entries(), |(_, e)| *e),
            flags: m.map_flags(),
        })
        .collect();
    out.sort_by(|a, b| a.name.cmp(&b.name));
    if !out.iter().any(|m| m.name == MAP_LAYOUT) {
        return Err(DatapathError::Load(format!(
            "the XDP object has no {MAP_LAYOUT} map"
        )));
    }
    Ok(out)
}

fn is_bpffs(path: &Path) -> bool {
    let Ok(c) = CString::new(path.as_os_str().as_encoded_bytes()) else {
        return false;
    };
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    unsafe { libc::statfs(c.as_ptr(), &mut st) == 0 && st.f_type as i64 == BPF_FS_MAGIC }
}

fn mount_bpffs(at: &Path) -> Result<(), DatapathError> {
    let target = CString::new(at.as_os_str().as_encoded_bytes()).map_err(|e| pin_error(at, e))?;
    let fs = c"bpf";
    // Root's alone: bpffs' own default is 1777, where anyone could make an
    // interface's directory first and then remove rl's pins.
    let data = c"mode=0700";
    let rc = unsafe {
        libc::mount(
            fs.as_ptr(),
            target.as_ptr(),
            fs.as_ptr(),
            0,
            data.as_ptr().cast(),
        )
    };
    if rc != 0 {
        let e = std::io::Error::last_os_error();
        if e.raw_os_error() == Some(libc::EPERM) {
            return Err(DatapathError::NoPrivilege { doing: "mounting bpffs for the pins (that takes CAP_SYS_ADMIN: mount it beforehand, e.g. `mount -t bpf -o mode=0700 bpf /sys/fs/bpf`)" });
        }
        return Err(pin_error(at, format!("mounting bpffs there: {e}")));
    }
    info!(at = %at.display(), "mounted bpffs for rl's pins");
    Ok(())
}

fn pin_error(at: &Path, cause: impl std::fmt::Display) -> DatapathError {
    DatapathError::Pin {
        at: at.to_path_buf(),
        cause: cause.to_string(),
    }
}

/// Makes `dir` (an interface's pin directory under `pin_dir`) exist on a
/// bpffs, mounting one if there is none: at /sys/fs/bpf when `pin_dir` is
/// under it, else at `pin_dir` itself.
pub fn prepare(pin_dir: &Path, dir: &Path) -> Result<(), DatapathError> {
    if !is_bpffs(pin_dir) {
        let sys = Path::new(SYS_FS_BPF);
        if pin_dir.starts_with(sys) && !is_bpffs(sys) {
            mount_bpffs(sys)?;
        }
        if !is_bpffs(pin_dir) {
            std::fs::create_dir_all(pin_dir).map_err(|e| pin_error(pin_dir, e))?;
            if !is_bpffs(pin_dir) {
                mount_bpffs(pin_dir)?;
            }
        }
    }
    own_dir(dir)?;
    safe_ancestors(dir)
}

/// Refuses pins under a directory of the bpffs that another user owns, or
/// that group or others may write (unless sticky): its owner, or any
/// writer, could rename rl's directory away and put one of their own in
/// its place (a user who made `/sys/fs/bpf/rl` on a bpffs mounted 1777,
/// say). Checked up to the bpffs' mount point.
fn safe_ancestors(dir: &Path) -> Result<(), DatapathError> {
    use std::os::unix::fs::MetadataExt;
    let me = unsafe { libc::geteuid() };
    for up in dir
        .ancestors()
        .skip(1)
        .filter(|a| !a.as_os_str().is_empty())
    {
        if !is_bpffs(up) {
            break;
        }
        let meta = std::fs::metadata(up).map_err(|e| pin_error(up, e))?;
        let writable = meta.mode() & 0o022 != 0 && meta.mode() & 0o1000 == 0;
        if meta.uid() != me || writable {
            return Err(pin_error(
                up,
                format!(
                    "it is owned by uid {} with mode {:o}: whoever owns or may write it can move rl's pins away; \
                     make it root's and not writable by others (chown root, chmod 0700), or pin elsewhere (--pin-dir)",
                    meta.uid(),
                    meta.mode() & 0o7777
                ),
            ));
        }
    }
    Ok(())
}

/// Makes `dir` exist as root's alone (0700, owned by this process's user),
/// or refuses one another user owns or may write: whoever may write there
/// may remove rl's pins and so turn the limits off, and whoever may open
/// it may take its lock and keep the daemon from starting.
fn own_dir(dir: &Path) -> Result<(), DatapathError> {
    use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
    // Another start may make it first: that is no error (the lock decides).
    match std::fs::DirBuilder::new().mode(0o700).create(dir) {
        Err(e) if e.kind() != std::io::ErrorKind::AlreadyExists => return Err(pin_error(dir, e)),
        _ => {}
    }
    let meta = std::fs::metadata(dir).map_err(|e| pin_error(dir, e))?;
    let me = unsafe { libc::geteuid() };
    if meta.uid() != me || meta.mode() & 0o022 != 0 {
        return Err(pin_error(
            dir,
            format!(
                "it is owned by uid {} with mode {:o}: only root may hold rl's pins; remove it (`rl-control detach`) or make it root's with mode 0700",
                meta.uid(),
                meta.mode() & 0o7777
            ),
        ));
    }
    // Pin directories of older builds were made 0755: readable, so lockable, by anyone.
    if meta.mode() & 0o077 != 0 {
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))
            .map_err(|e| pin_error(dir, e))?;
    }
    Ok(())
}

/// The cap of own buckets pinned in `dir` (`max_sources` of the datapath
/// made there), if its map is pinned (an older build may lack it).
pub(super) fn owned_cap(dir: &Path) -> Result<Option<u64>, DatapathError> {
    let path = dir.join(rl_common::MAP_OWNED);
    if !path.exists() {
        return Ok(None);
    }
    let map = aya::maps::MapData::from_pin(&path).map_err(|e| pin_error(&path, chain(&e)))?;
    let owned: aya::maps::Array<aya::maps::MapData, u64> =
        aya::maps::Array::try_from(aya::maps::Map::Array(map))
            .map_err(|e| pin_error(&path, chain(&e)))?;
    owned
        .get(&rl_common::OWNED_CAP, 0)
        .map(Some)
        .map_err(|e| pin_error(&path, chain(&e)))
}

/// Removes the pins an interrupted first start left in `dir`: maps, but no
/// link and no layout version (the daemon writes it just before it pins
/// its first link; a load alone writes it last),
/// so no datapath was ever in force there and no bucket is lost. The
/// directory stays (the caller holds its lock). `true` if it removed any.
pub(super) fn clear_interrupted(dir: &Path) -> Result<bool, DatapathError> {
    let names: Vec<String> = match std::fs::read_dir(dir) {
        Ok(rd) => rd
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect(),
        Err(_) => return Ok(false),
    };
    if names.is_empty() || names.iter().any(|n| n.starts_with("link-")) {
        return Ok(false);
    }
    if names.iter().any(|n| n == MAP_LAYOUT)
        && read_layout(dir).map_or(true, |(version, _)| version != 0)
    {
        return Ok(false);
    }
    remove_pins(dir)?;
    Ok(true)
}

/// Removes every pin in `dir` but no link (there is none) and not `dir`.
pub(super) fn remove_pins(dir: &Path) -> Result<(), DatapathError> {
    for e in std::fs::read_dir(dir)
        .map_err(|e| pin_error(dir, e))?
        .flatten()
    {
        let path = e.path();
        if !e.file_name().to_string_lossy().starts_with("link-") {
            std::fs::remove_file(&path).map_err(|e| pin_error(&path, e))?;
        }
    }
    Ok(())
}

/// Takes `dir` for this process (an advisory lock on the directory, held
/// while the returned fd lives): one daemon per pinned datapath.
pub(super) fn hold(dir: &Path) -> Result<std::os::fd::OwnedFd, DatapathError> {
    use std::os::fd::FromRawFd;
    let c = CString::new(dir.as_os_str().as_encoded_bytes()).map_err(|e| pin_error(dir, e))?;
    let fd = unsafe {
        libc::open(
            c.as_ptr(),
            libc::O_RDONLY | libc::O_DIRECTORY | libc::O_CLOEXEC,
        )
    };
    if fd < 0 {
        return Err(pin_error(dir, std::io::Error::last_os_error()));
    }
    let fd = unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) };
    if unsafe { libc::flock(fd.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
        let e = std::io::Error::last_os_error();
        if e.raw_os_error() == Some(libc::EWOULDBLOCK) {
            return Err(DatapathError::Held(dir.to_path_buf()));
        }
        return Err(pin_error(dir, format!("locking: {e}")));
    }
    Ok(fd)
}

/// Maps a setup of this layout version may lack because an older build did
/// not have them: they are created fresh, which is safe for each (a fresh
/// known-keys filter is "not valid" until the collector's first walk).
/// Prefix cells moved to arrays of their own, then to 16-byte ones with a
/// key array beside: empty ones are safe (a key with no cell is charged to
/// its rule's last resort), and the daemon moves the cells it finds in the
/// sources' tables or in the 64-byte arrays into them before its swap. A
/// fresh own-bucket count reads 0 until the collector's first walk sets it
/// (until then own buckets may take the last resorts' room, as they could
/// in the builds without it). Builds without a wide-cell count made no wide
/// cells: a fresh count of 0 is exact.
fn added_since_layout(name: &str) -> bool {
    name == rl_common::MAP_KNOWN
        || name == rl_common::MAP_OWNED
        || name == rl_common::MAP_WIDE_COUNT
        || name == rl_common::MAP_BANS_V4
        || name == rl_common::MAP_BANS_V6
        || rl_common::CELL_MAPS.contains(&name)
}

/// Whether `dir` holds a pinned datapath; if it does, checks that every map
/// matches `specs` and the layout version is this build's. Refuses with
/// what differs, never adopts a map it would misread.
pub(super) fn check(dir: &Path, specs: &[MapSpec]) -> Result<bool, DatapathError> {
    let present: Vec<&MapSpec> = specs
        .iter()
        .filter(|s| dir.join(&s.name).exists())
        .collect();
    if present.is_empty() {
        return Ok(false);
    }
    let mismatch = |what: String| DatapathError::Layout {
        dir: dir.to_path_buf(),
        what,
    };
    for s in specs {
        let path = dir.join(&s.name);
        if !path.exists() {
            if added_since_layout(&s.name) {
                continue;
            }
            return Err(mismatch(format!(
                "{} is not pinned (an incomplete or older setup)",
                s.name
            )));
        }
        let info = MapInfo::from_pin(&path)
            .map_err(|e| mismatch(format!("{} cannot be read: {}", s.name, chain(&e))))?;
        let (t, k, v, n) = (
            info_type(&info),
            info.key_size(),
            info.value_size(),
            info.max_entries(),
        );
        if t != s.map_type || k != s.key_size || v != s.value_size {
            return Err(mismatch(format!(
                "{} is a type-{t} map of {k}-byte keys and {v}-byte values, this build's is type {} with {} and {}",
                s.name, s.map_type, s.key_size, s.value_size
            )));
        }
        if info.map_flags() != s.flags {
            return Err(mismatch(format!(
                "{} was created with flags {:#x}, this build's are {:#x}",
                s.name,
                info.map_flags(),
                s.flags
            )));
        }
        if n != s.max_entries {
            return Err(mismatch(format!(
                "{} holds {n} entries, this configuration needs {} (datapath.max_sources or flood_prefixes changed?)",
                s.name, s.max_entries
            )));
        }
    }
    // The cell arrays and their key arrays go together: a cell array
    // adopted beside a fresh key array would hold cells the daemon cannot
    // name (never freed, never shared).
    let group = rl_common::CELL_STATE_MAPS;
    let pinned: Vec<&str> = group
        .iter()
        .copied()
        .filter(|n| dir.join(n).exists())
        .collect();
    if !pinned.is_empty() && pinned.len() < group.len() {
        return Err(mismatch(format!(
            "of the prefix cells' maps only {} are pinned (an interrupted setup, or a development build's)",
            pinned.join(", ")
        )));
    }
    let version = read_layout(dir)?.0;
    if version != LAYOUT_VERSION {
        return Err(mismatch(format!(
            "its layout version is {version}, this build's is {LAYOUT_VERSION}"
        )));
    }
    Ok(true)
}

fn info_type(info: &MapInfo) -> u32 {
    // The object gives the raw number; MapInfo an enum with those values.
    info.map_type().map_or(u32::MAX, |t| t as u32)
}

/// The configuration pinned in `dir` (`None`: none is pinned).
pub(super) fn config(dir: &Path) -> Result<Option<rl_common::DatapathConfig>, DatapathError> {
    let path = dir.join(rl_common::MAP_CONFIG);
    if !path.exists() {
        return Ok(None);
    }
    let bad = |cause: String| DatapathError::Layout {
        dir: dir.to_path_buf(),
        what: format!("{}: {cause}", rl_common::MAP_CONFIG),
    };
    let data = MapData::from_pin(&path).map_err(|e| bad(chain(&e)))?;
    let arr: Array<MapData, rl_common::DatapathConfig> =
        Array::try_from(Map::Array(data)).map_err(|e| bad(chain(&e)))?;
    arr.get(&0, 0).map(Some).map_err(|e| bad(chain(&e)))
}

/// The pinned `(layout version, XDP mode)`.
pub(super) fn read_layout(dir: &Path) -> Result<(u32, u32), DatapathError> {
    let path = dir.join(MAP_LAYOUT);
    let bad = |cause: String| DatapathError::Layout {
        dir: dir.to_path_buf(),
        what: format!("{MAP_LAYOUT}: {cause}"),
    };
    let data = MapData::from_pin(&path).map_err(|e| bad(chain(&e)))?;
    let arr: Array<MapData, u32> = Array::try_from(Map::Array(data)).map_err(|e| bad(chain(&e)))?;
    Ok((
        arr.get(&0, 0).map_err(|e| bad(chain(&e)))?,
        arr.get(&1, 0).map_err(|e| bad(chain(&e)))?,
    ))
}

/// The link pinned in `dir` for `iface`, with the mode it was made in.
pub(super) fn pinned_link(dir: &Path, iface: &str) -> Option<(PinnedLink, &'static str, PathBuf)> {
    ["native", "skb"].into_iter().find_map(|mode| {
        let path = dir.join(link_pin(iface, mode));
        let link = path
            .exists()
            .then(|| PinnedLink::from_pin(&path).ok())
            .flatten()?;
        Some((link, mode, path))
    })
}

/// What the kernel says of the XDP link pinned at `path`.
pub(super) struct LinkInfo {
    /// The program the link runs.
    pub prog_id: u32,
    /// The index of the interface it is attached to; 0 if none (the link
    /// is defunct).
    pub ifindex: u32,
}

pub(super) fn pinned_link_info(path: &Path) -> std::io::Result<LinkInfo> {
    use std::os::fd::AsRawFd;
    const BPF_OBJ_GET_INFO_BY_FD: libc::c_long = 15;
    let fd = obj_get(path)?;
    // `struct bpf_link_info`: type, id, prog_id, then (8-aligned) the
    // XDP link's ifindex.
    let mut info = [0u32; 32];
    let mut attr = [0u64; 16];
    attr[0] = fd.as_raw_fd() as u32 as u64 | (std::mem::size_of_val(&info) as u64) << 32;
    attr[1] = info.as_mut_ptr() as u64;
    super::bpf::bpf(BPF_OBJ_GET_INFO_BY_FD, &mut attr)?;
    Ok(LinkInfo {
        prog_id: info[2],
        ifindex: info[4],
    })
}

/// Pins `link` (attached to `iface` in `mode`) in `dir`; returns the link
/// (still held, still pinned) and its pin.
pub(super) fn pin_link(
    dir: &Path,
    iface: &str,
    mode: &str,
    link: FdLink,
) -> Result<(FdLink, PathBuf), DatapathError> {
    let path = dir.join(link_pin(iface, mode));
    let pinned = link.pin(&path).map_err(|e| pin_error(&path, chain(&e)))?;
    Ok((pinned.into(), path))
}

/// The pin directories under `pin_dir` that hold `iface` (a directory per
/// set of interfaces sharing one datapath). None when `pin_dir` does not
/// exist; an error when it cannot be read (not root: the directory is
/// 0700), never "nothing pinned".
pub fn dirs_with(pin_dir: &Path, iface: &str) -> std::io::Result<Vec<PathBuf>> {
    let entries = match std::fs::read_dir(pin_dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(e),
    };
    Ok(entries
        .flatten()
        .filter(|e| {
            // One interface of a group (`eth0+eth1`), or the group's whole
            // name, as the "does not fit" error names it.
            let name = e.file_name().to_string_lossy().into_owned();
            e.path().is_dir() && (name == iface || name.split('+').any(|i| i == iface))
        })
        .map(|e| e.path())
        .collect())
}

/// Removes rl from the interface whose pins are in `dir`: detaches its link
/// (at once, even while a daemon still holds it), then removes every pin
/// and the directory. `false` if nothing was pinned there.
pub fn detach(dir: &Path) -> Result<bool, DatapathError> {
    if !dir.exists() {
        return Ok(false);
    }
    let entries: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(|e| match e.kind() {
            std::io::ErrorKind::PermissionDenied => DatapathError::NoPrivilege {
                doing: "reading rl's pin directory",
            },
            _ => pin_error(dir, e),
        })?
        .map(|e| e.map(|e| e.path()).map_err(|e| pin_error(dir, e)))
        .collect::<Result<_, _>>()?;
    // Links first: the program leaves every interface before its maps go.
    let is_link = |p: &PathBuf| {
        p.file_name()
            .is_some_and(|n| n.to_string_lossy().starts_with("link-"))
    };
    for link in entries.iter().filter(|p| is_link(p)) {
        let fd = obj_get(link).map_err(|e| pin_error(link, e))?;
        // ENOLINK: the interface is gone and the link with it.
        if let Err(e) = link_detach(fd.as_fd().as_raw_fd()) {
            if e.raw_os_error() != Some(libc::ENOLINK) {
                return Err(pin_error(link, format!("detaching: {e}")));
            }
        }
    }
    for path in &entries {
        std::fs::remove_file(path).map_err(|e| pin_error(path, e))?;
    }
    std::fs::remove_dir(dir).map_err(|e| pin_error(dir, e))?;
    Ok(true)
}

/// Detaches the link pinned at `path` and removes the pin.
pub(super) fn detach_link(path: &Path) -> Result<(), DatapathError> {
    let fd = obj_get(path).map_err(|e| pin_error(path, e))?;
    link_detach(fd.as_fd().as_raw_fd()).map_err(|e| pin_error(path, format!("detaching: {e}")))?;
    std::fs::remove_file(path).map_err(|e| pin_error(path, e))
}

/// `BPF_OBJ_GET`: an fd for the object pinned at `path`.
fn obj_get(path: &Path) -> std::io::Result<std::os::fd::OwnedFd> {
    use std::os::fd::FromRawFd;
    const BPF_OBJ_GET: libc::c_long = 7;
    let c = CString::new(path.as_os_str().as_encoded_bytes())?;
    let mut attr = [0u64; 16];
    attr[0] = c.as_ptr() as u64;
    let fd = super::bpf::bpf(BPF_OBJ_GET, &mut attr)?;
    // SAFETY: a new file descriptor the kernel gave us.
    Ok(unsafe { std::os::fd::OwnedFd::from_raw_fd(fd as i32) })
}

/// `BPF_LINK_DETACH` on the link `fd`.
fn link_detach(fd: i32) -> std::io::Result<()> {
    const BPF_LINK_DETACH: libc::c_long = 34;
    let mut attr = [0u64; 16];
    attr[0] = fd as u32 as u64;
    super::bpf::bpf(BPF_LINK_DETACH, &mut attr).map(drop)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `detach --iface` finds a group's directory by any of its interfaces
    /// and by the group's name, which the "does not fit" error prints.
    #[test]
    fn a_groups_pins_are_found_by_each_interface_and_by_the_groups_name() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join("eth0+eth1")).unwrap();
        std::fs::create_dir(dir.path().join("eth10")).unwrap();
        for iface in ["eth0", "eth1", "eth0+eth1"] {
            assert_eq!(
                dirs_with(dir.path(), iface).unwrap(),
                [dir.path().join("eth0+eth1")],
                "{iface}"
            );
        }
        assert!(dirs_with(dir.path(), "eth").unwrap().is_empty());
    }
}
