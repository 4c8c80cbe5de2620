//! A throwaway network lab: two network namespaces joined by a veth pair.
//!
//! `a` is the sender side (`va`), `b` the protected host (`vb`, where rl
//! attaches). Every piece of kernel state is owned by a guard whose `Drop`
//! removes it, so a failing test still leaves nothing behind. Traffic never
//! leaves these namespaces.

use std::{
    fs::File,
    net::IpAddr,
    os::fd::AsRawFd,
    process::Command,
    sync::atomic::{AtomicU32, Ordering},
};

use anyhow::{bail, Context, Result};

/// Fails with a sentence when the lab cannot run here (not root).
pub fn require_root() {
    if unsafe { libc::geteuid() } != 0 {
        panic!(
            "this test needs root (it creates network namespaces and attaches XDP programs); \
             run it with `sudo -E cargo xtask test`"
        );
    }
}

/// Runs `ip` with `args`, failing with its stderr.
pub fn ip(args: &[&str]) -> Result<String> {
    let out = Command::new("ip")
        .args(args)
        .output()
        .context("running `ip` (install iproute2, or run `cargo xtask bootstrap`)")?;
    if !out.status.success() {
        bail!(
            "`ip {}` failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// A named network namespace, deleted on drop.
pub struct Netns {
    pub name: String,
}

impl Netns {
    pub fn new(name: String) -> Result<Netns> {
        // A namespace left by a killed earlier run would make `add` fail.
        let _ = ip(&["netns", "del", &name]);
        ip(&["netns", "add", &name])?;
        let ns = Netns { name };
        ns.ip(&["link", "set", "lo", "up"])?;
        Ok(ns)
    }

    /// `ip -n NAME args…`
    pub fn ip(&self, args: &[&str]) -> Result<String> {
        let mut all = vec!["-n", self.name.as_str()];
        all.extend_from_slice(args);
        ip(&all)
    }

    /// The runtime directory (admin socket, pid file) of daemons and CLI
    /// commands run in this namespace (they get it as `RL_RUNTIME_DIR`);
    /// removed with the namespace.
    pub fn runtime_dir(&self) -> std::path::PathBuf {
        std::env::temp_dir().join(format!("rl-run-{}", self.name))
    }

    /// Runs `program args…` inside the namespace.
    pub fn exec(&self, program: &str, args: &[&str]) -> Result<()> {
        let out = Command::new("ip")
            .args(["netns", "exec", &self.name, program])
            .args(args)
            .output()?;
        if !out.status.success() {
            bail!(
                "{program} {} in {}: {}",
                args.join(" "),
                self.name,
                String::from_utf8_lossy(&out.stderr)
            );
        }
        Ok(())
    }

    /// Sets a sysctl inside the namespace.
    pub fn sysctl(&self, key: &str, value: &str) -> Result<()> {
        self.exec("sysctl", &["-qw", &format!("{key}={value}")])
    }

    /// Runs `f` on a new thread that has entered this namespace, and returns
    /// its result. The calling thread's namespace is never changed.
    pub fn run<T: Send + 'static>(
        &self,
        f: impl FnOnce() -> Result<T> + Send + 'static,
    ) -> Result<T> {
        self.spawn(f)
            .join()
            .map_err(|_| anyhow::anyhow!("a thread in namespace {} panicked", self.name))?
    }

    /// Like [`Netns::run`] but returns the join handle, for concurrent work.
    pub fn spawn<T: Send + 'static>(
        &self,
        f: impl FnOnce() -> Result<T> + Send + 'static,
    ) -> std::thread::JoinHandle<Result<T>> {
        let path = format!("/run/netns/{}", self.name);
        std::thread::spawn(move || -> Result<T> {
            enter(&path)?;
            f()
        })
    }
}

/// Moves the calling thread into the network namespace at `path`.
pub fn enter(path: &str) -> Result<()> {
    let f = File::open(path).with_context(|| format!("opening {path}"))?;
    if unsafe { libc::setns(f.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
        bail!("setns({path}): {}", std::io::Error::last_os_error());
    }
    Ok(())
}

/// Pins the calling thread to `cpu`.
pub fn pin_to_cpu(cpu: usize) -> Result<()> {
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        if libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) != 0 {
            bail!("pinning to CPU {cpu}: {}", std::io::Error::last_os_error());
        }
    }
    Ok(())
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(self.runtime_dir());
        if let Err(e) = ip(&["netns", "del", &self.name]) {
            eprintln!("warning: could not remove namespace {}: {e:#}", self.name);
        }
    }
}

static NEXT_LAB: AtomicU32 = AtomicU32::new(0);

/// Two namespaces and a veth pair: `a`/`va` (senders), `b`/`vb` (protected).
pub struct Lab {
    /// Lab number, used to keep addresses and names apart.
    pub id: u32,
    pub a: Netns,
    pub b: Netns,
}

/// Interface names inside the lab.
pub const VA: &str = "va";
pub const VB: &str = "vb";
/// The second pair's ends ([`Lab::second_pair`]).
pub const VA2: &str = "va2";
pub const VB2: &str = "vb2";

impl Lab {
    /// A new lab with `10.77.N.1/24` + `fd77:N::1/64` on `va` and `.2`/`::2`
    /// on `vb`. IPv6 duplicate address detection is off so addresses are
    /// usable at once.
    pub fn new() -> Result<Lab> {
        require_root();
        let id = NEXT_LAB.fetch_add(1, Ordering::Relaxed) + (std::process::id() % 50) * 4;
        let id = id % 250;
        let a = Netns::new(format!("rl-lab{id}-a"))?;
        let b = Netns::new(format!("rl-lab{id}-b"))?;
        // Create the pair inside `a` so no interface ever appears in the root
        // namespace, then move one end to `b`.
        a.ip(&["link", "add", VA, "type", "veth", "peer", "name", VB])?;
        a.ip(&["link", "set", VB, "netns", &b.name])?;
        let lab = Lab { id, a, b };
        for ns in [&lab.a, &lab.b] {
            ns.sysctl("net.ipv6.conf.all.accept_dad", "0")?;
            ns.sysctl("net.ipv6.conf.default.accept_dad", "0")?;
        }
        lab.a
            .ip(&["addr", "add", &format!("{}/24", lab.v4(1)), "dev", VA])?;
        lab.b
            .ip(&["addr", "add", &format!("{}/24", lab.v4(2)), "dev", VB])?;
        lab.a.ip(&[
            "addr",
            "add",
            &format!("{}/64", lab.v6(1)),
            "dev",
            VA,
            "nodad",
        ])?;
        lab.b.ip(&[
            "addr",
            "add",
            &format!("{}/64", lab.v6(2)),
            "dev",
            VB,
            "nodad",
        ])?;
        // A queue on the sending end: when the receiving veth's ring is full
        // the kernel then holds senders back (and their sockets block)
        // instead of silently dropping frames before XDP ever sees them, so
        // every packet a test sends reaches rl.
        lab.a.exec(
            "tc",
            &[
                "qdisc", "replace", "dev", VA, "root", "pfifo", "limit", "10000",
            ],
        )?;
        lab.a.ip(&["link", "set", VA, "up"])?;
        lab.b.ip(&["link", "set", VB, "up"])?;
        // Static neighbours: no ARP/ND exchange is needed (or counted).
        let mac_b = lab.mac(&lab.b, VB)?;
        let mac_a = lab.mac(&lab.a, VA)?;
        lab.a.ip(&[
            "neigh",
            "replace",
            &lab.v4(2).to_string(),
            "lladdr",
            &mac_b,
            "dev",
            VA,
        ])?;
        lab.a.ip(&[
            "neigh",
            "replace",
            &lab.v6(2).to_string(),
            "lladdr",
            &mac_b,
            "dev",
            VA,
        ])?;
        lab.b.ip(&[
            "neigh",
            "replace",
            &lab.v4(1).to_string(),
            "lladdr",
            &mac_a,
            "dev",
            VB,
        ])?;
        Ok(lab)
    }

    /// A second veth pair, `va2` (in `a`) to `vb2` (in `b`), up, without
    /// addresses: for forged frames, and for rl on two interfaces.
    pub fn second_pair(&self) -> Result<()> {
        self.a
            .ip(&["link", "add", VA2, "type", "veth", "peer", "name", VB2])?;
        self.a.ip(&["link", "set", VB2, "netns", &self.b.name])?;
        self.a.exec(
            "tc",
            &[
                "qdisc", "replace", "dev", VA2, "root", "pfifo", "limit", "10000",
            ],
        )?;
        self.a.ip(&["link", "set", VA2, "up"])?;
        self.b.ip(&["link", "set", VB2, "up"])?;
        Ok(())
    }

    /// `10.77.<id>.<host>`
    pub fn v4(&self, host: u8) -> IpAddr {
        format!("10.77.{}.{host}", self.id).parse().unwrap()
    }

    /// `fd77:<id>::<host>` (all in one /64)
    pub fn v6(&self, host: u16) -> IpAddr {
        format!("fd77:{:x}::{host:x}", self.id).parse().unwrap()
    }

    /// `fd77:<id>:0:<net>::<host>`: a different /64 for each `net`.
    pub fn v6_net(&self, net: u16, host: u16) -> IpAddr {
        format!("fd77:{:x}:0:{net:x}::{host:x}", self.id)
            .parse()
            .unwrap()
    }

    fn mac(&self, ns: &Netns, dev: &str) -> Result<String> {
        let out = ns.ip(&["-o", "link", "show", dev])?;
        out.split_whitespace()
            .skip_while(|w| *w != "link/ether")
            .nth(1)
            .map(str::to_string)
            .context("reading the veth MAC address")
    }

    /// Adds another source address on `va` (prefix length given in `cidr`).
    pub fn add_source(&self, cidr: &str) -> Result<()> {
        let mut args = vec!["addr", "add", cidr, "dev", VA];
        if cidr.contains(':') {
            args.push("nodad");
        }
        self.a.ip(&args)?;
        Ok(())
    }

    /// Is an XDP program attached to `vb`?
    pub fn xdp_attached(&self) -> Result<bool> {
        let out = self.b.ip(&["-d", "link", "show", VB])?;
        Ok(out.contains("prog/xdp"))
    }

    /// The ids of the XDP programs on `vb` (`ip -d link` shows one per mode).
    pub fn xdp_prog_ids(&self) -> Result<Vec<u32>> {
        let out = self.b.ip(&["-d", "link", "show", VB])?;
        let words: Vec<&str> = out.split_whitespace().collect();
        Ok(words
            .windows(3)
            .filter(|w| w[0].starts_with("prog/xdp") && w[1] == "id")
            .filter_map(|w| w[2].parse().ok())
            .collect())
    }
}

/// A bpffs mounted on a fresh directory outside `/sys` (which `ip netns
/// exec` remounts, taking any bpffs under it along), so pins made by a
/// daemon in a lab outlive that daemon. On drop, whatever rl pinned there is
/// detached and the bpffs unmounted, pins and all.
pub struct BpfFs {
    dir: tempfile::TempDir,
}

impl BpfFs {
    pub fn new() -> Result<BpfFs> {
        require_root();
        let dir = tempfile::Builder::new()
            .prefix("rl-bpffs-")
            .tempdir()
            .context("a directory for bpffs")?;
        let out = Command::new("mount")
            .args(["-t", "bpf", "bpf"])
            .arg(dir.path())
            .output()
            .context("running mount")?;
        if !out.status.success() {
            bail!(
                "mount -t bpf on {}: {}",
                dir.path().display(),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        Ok(BpfFs { dir })
    }

    pub fn path(&self) -> &std::path::Path {
        self.dir.path()
    }

    /// The path as an argument.
    pub fn arg(&self) -> &str {
        self.dir.path().to_str().expect("a UTF-8 temporary path")
    }
}

impl Drop for BpfFs {
    fn drop(&mut self) {
        if let Ok(entries) = std::fs::read_dir(self.dir.path()) {
            for e in entries.flatten().filter(|e| e.path().is_dir()) {
                if let Err(err) = rl_control::datapath::detach_pinned(&e.path()) {
                    eprintln!(
                        "warning: could not detach the pins in {}: {err}",
                        e.path().display()
                    );
                }
            }
        }
        let c = std::ffi::CString::new(self.dir.path().as_os_str().as_encoded_bytes()).unwrap();
        if unsafe { libc::umount2(c.as_ptr(), libc::MNT_DETACH) } != 0 {
            eprintln!(
                "warning: could not unmount bpffs at {}: {}",
                self.dir.path().display(),
                std::io::Error::last_os_error()
            );
        }
    }
}
