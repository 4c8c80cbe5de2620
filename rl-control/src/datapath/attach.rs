//! Attaching: to one interface or several (all or nothing), adopting a
//! link pinned by an earlier daemon (its program replaced atomically), and
//! the bare `XDP_PASS` baseline the benchmarks attach in rl's place.

use aya::programs::{
    links::FdLink,
    xdp::{XdpLink, XdpLinkId},
    ProgramError, Xdp, XdpMode,
};
use rl_common::{PROG_LIMITER, PROG_PASS};
use tracing::{info, warn};

use super::{
    chain, errno, interface_index, netlink, pin, AttachMode, Attachment, Datapath, DatapathError,
};
use crate::compile::RuleSet;

/// How to undo an attachment made by this process.
enum Fresh {
    /// Owned by the program (not pinned): detach by id.
    Owned(XdpLinkId),
    /// Pinned at this path.
    Pinned(std::path::PathBuf),
}

/// An attachment made by this process, with how to undo it (`None`: a
/// pinned link taken over, which stays).
type Made = (Attachment, Option<Fresh>);

impl Datapath {
    /// Attaches the limiter to every interface of `ifaces`: one program, one
    /// rule set and one set of buckets for all, so a source's limit is per
    /// host. All or nothing: if one interface fails, the ones attached by
    /// this call are detached again and the error names the interface.
    pub fn attach_all(
        &mut self,
        ifaces: &[String],
        mode: AttachMode,
    ) -> Result<Vec<Attachment>, DatapathError> {
        let made = self.attach_made(ifaces, mode)?;
        Ok(made.into_iter().map(|(a, _)| a).collect())
    }

    /// [`Datapath::attach_all`], each attachment with how to undo it
    /// (`None`: a pinned link taken over, which stays).
    fn attach_made(
        &mut self,
        ifaces: &[String],
        mode: AttachMode,
    ) -> Result<Vec<Made>, DatapathError> {
        for iface in ifaces {
            interface_index(iface)?;
        }
        let mut made: Vec<Made> = Vec::new();
        for iface in ifaces {
            match self.attach_one(iface, mode) {
                Ok(one) => made.push(one),
                Err(e) => {
                    self.undo_fresh(made);
                    return Err(e);
                }
            }
        }
        Ok(made)
    }

    /// Puts `rules` in force on `ifaces` with this build's program. Fresh,
    /// both rule slots are written before the program first runs. Adopted,
    /// the pinned program goes on enforcing the pinned rules until this
    /// build's replaces it (an older build's cells moved first: this program
    /// looks for cells in its arrays only), and the rules are written only
    /// then: no program reads a table that another build's daemon is
    /// changing (the mark of a changing rule, `RULE_UNNAMED`, is heeded by
    /// this build's program only). A rule set too large is refused first.
    ///
    /// On failure nothing attached afresh here stays attached. Adopted: if
    /// no pinned link was taken over yet, the config entry is put back as
    /// it was found; if writing the rules fails after the swap, this
    /// build's program enforces the pinned rules where it took a pinned
    /// link over ([`DatapathError::AfterSwap`]). The second table's write
    /// failing only warns: the rules are in force, and that table is
    /// written whole at the next change.
    pub fn take_over(
        &mut self,
        rules: &RuleSet,
        ifaces: &[String],
        mode: AttachMode,
    ) -> Result<Vec<Attachment>, DatapathError> {
        let Some(pinned) = self.pinned_config else {
            // The same rules into the other slot too (from now on every
            // change writes only its differences), then the program.
            self.install(rules)?;
            return self.attach_all(ifaces, mode);
        };
        // (Again, if an earlier call failed and put the entry back.)
        let ready = self
            .refresh_config(&pinned, &rules.tuning)
            .and_then(|()| super::install::fits(rules));
        let made = ready
            .and_then(|()| self.move_cells_before_swap())
            .and_then(|()| self.attach_made(ifaces, mode));
        let made = match made {
            Ok(made) => made,
            Err(e) => {
                if !self.took_over {
                    self.put_back_config(pinned);
                }
                return Err(e);
            }
        };
        self.pinned_config = None;
        let first = self.cells_moved().and_then(|merged| {
            if merged > 0 {
                info!(cells = merged, "merged what the older build charged since the copy into the cell arrays, and unpinned its 64-byte arrays");
            }
            self.install(rules)
        });
        if let Err(e) = first {
            self.undo_fresh(made);
            return Err(DatapathError::AfterSwap(Box::new(e)));
        }
        if let Err(e) = self.install(rules) {
            warn!("writing the rules into the second rule table failed ({e}): the rules are in force, and that table is written whole at the next change");
        }
        Ok(made.into_iter().map(|(a, _)| a).collect())
    }

    /// An older build's cells into this build's arrays, if the pins hold
    /// any: before the swap (see [`Datapath::move_old_cells`]).
    fn move_cells_before_swap(&mut self) -> Result<(), DatapathError> {
        if self.cells_in_tables() || self.cells_in_old_arrays() {
            let moved = self.move_old_cells()?;
            if moved > 0 {
                info!(cells = moved, "copied the prefix cells an older build kept in the sources' tables or its 64-byte arrays into the cell arrays");
            }
        }
        Ok(())
    }

    /// [`Datapath::attach_all`] for one interface.
    pub fn attach(&mut self, iface: &str, mode: AttachMode) -> Result<Attachment, DatapathError> {
        self.attach_all(&[iface.to_string()], mode)
            .map(|mut v| v.remove(0))
    }

    /// Attaches to `iface`. In `Auto` mode, native is tried first; if the
    /// driver refuses it, skb mode is used and a warning says so.
    ///
    /// Pinned: a link pinned for `iface` by an earlier daemon is adopted, its
    /// program replaced by this one atomically (`bpf_link_update`: no packet
    /// goes unfiltered), in the mode it was created in; else the new link is
    /// pinned, so the program stays attached when this process exits or
    /// dies. Returns how to undo a fresh attachment (`None` if adopted).
    fn attach_one(&mut self, iface: &str, mode: AttachMode) -> Result<Made, DatapathError> {
        if let Some(dir) = self.pins.clone() {
            if let Some(a) = self.adopt_link(&dir, iface, PROG_LIMITER)? {
                self.attachments.push(a.clone());
                return Ok((a, None));
            }
        }
        let (used, id) = match mode {
            AttachMode::Auto => match self.attach_as(iface, AttachMode::Native, PROG_LIMITER) {
                Ok(id) => (AttachMode::Native, id),
                Err(
                    e @ (DatapathError::InterfaceBusy(_)
                    | DatapathError::PinnedElsewhere { .. }
                    | DatapathError::NoPrivilege { .. }),
                ) => return Err(e),
                Err(e) => {
                    warn!("native XDP is unavailable on {iface} ({e}); using skb (generic) mode, which is slower");
                    (
                        AttachMode::Skb,
                        self.attach_as(iface, AttachMode::Skb, PROG_LIMITER)?,
                    )
                }
            },
            m => (m, self.attach_as(iface, m, PROG_LIMITER)?),
        };
        let fresh = match self.pins.clone() {
            None => Fresh::Owned(id),
            Some(dir) => {
                // Held by us and pinned: on any failure here the link is
                // dropped, which detaches: nothing stays half-set-up.
                let link = self
                    .xdp(PROG_LIMITER)?
                    .take_link(id)
                    .map_err(|e| DatapathError::Load(chain(&e)))?;
                let fd = FdLink::try_from(link).map_err(|e| DatapathError::Attach {
                    iface: iface.into(),
                    mode: used,
                    cause: format!("the link cannot be pinned ({}): pinning needs bpf_link XDP attachment (Linux 5.9+)", chain(&e)),
                })?;
                // In force from here: a later start adopts these pins.
                if self.layout_pending {
                    self.write_layout()?;
                }
                let (fd, path) = pin::pin_link(&dir, iface, &used.to_string(), fd)?;
                self.links.push(fd);
                Fresh::Pinned(path)
            }
        };
        let a = Attachment {
            iface: iface.to_string(),
            mode: used,
        };
        self.attachments.push(a.clone());
        Ok((a, Some(fresh)))
    }

    /// Detaches what `made` attached afresh, last first (pinned links taken
    /// over stay).
    fn undo_fresh(&mut self, made: Vec<Made>) {
        for (a, fresh) in made.into_iter().rev() {
            if let Some(fresh) = fresh {
                self.undo(&a, fresh);
            }
        }
    }

    /// Detaches a fresh attachment again (a later interface failed).
    fn undo(&mut self, a: &Attachment, fresh: Fresh) {
        self.attachments.retain(|x| x != a);
        match fresh {
            Fresh::Owned(id) => {
                if let Ok(p) = self.xdp(PROG_LIMITER) {
                    let _ = p.detach(id);
                }
            }
            Fresh::Pinned(path) => {
                if let Err(e) = pin::detach_link(&path) {
                    warn!(iface = %a.iface, "could not detach again after a failure: {e}");
                }
            }
        }
    }

    fn xdp(&mut self, name: &'static str) -> Result<&mut Xdp, DatapathError> {
        self.ebpf
            .program_mut(name)
            .ok_or_else(|| DatapathError::Load(format!("program {name} is missing")))?
            .try_into()
            .map_err(|e: ProgramError| DatapathError::Load(chain(&e)))
    }

    /// Replaces the program of the link pinned in `dir` for `iface` with
    /// this one; `None` if there is no live pinned link (a defunct one's
    /// pin, left by an interface that was deleted, is removed).
    fn adopt_link(
        &mut self,
        dir: &std::path::Path,
        iface: &str,
        prog: &'static str,
    ) -> Result<Option<Attachment>, DatapathError> {
        let Some((pinned, mode, path)) = pin::pinned_link(dir, iface) else {
            return Ok(None);
        };
        let mode = if mode == "skb" {
            AttachMode::Skb
        } else {
            AttachMode::Native
        };
        let fd: FdLink = pinned.into();
        let refused = |cause: String| DatapathError::Attach {
            iface: iface.into(),
            mode,
            cause,
        };
        let failed = |cause: String| {
            refused(format!(
                "replacing the program of the XDP link pinned at {} failed ({cause}); it keeps its program: \
                 `rl-control detach --iface {iface}` removes it, and the buckets with it",
                path.display()
            ))
        };
        if let Some(cause) = elsewhere(&path, iface, interface_index(iface)?) {
            return Err(refused(cause));
        }
        let link = XdpLink::try_from(fd).map_err(|e| failed(chain(&e)))?;
        let swapped = match self.failpoint("swap") {
            // Tests: the kernel refuses the update for another reason than
            // a defunct link (the lab has no way to make it).
            Err(_) => Err(ProgramError::SyscallError(aya::sys::SyscallError {
                call: "bpf_link_update",
                io_error: std::io::Error::from_raw_os_error(libc::EPERM),
            })),
            Ok(()) => self.xdp(prog)?.attach_to_link(link),
        };
        let id = match swapped {
            Ok(id) => id,
            // The link's interface is gone (deleted, perhaps made again
            // under the same name): its pin is all that is left of it.
            Err(e) if errno(&e) == Some(libc::ENOLINK) => {
                warn!(
                    iface,
                    "the pinned XDP link is defunct ({}); attaching afresh",
                    chain(&e)
                );
                let _ = std::fs::remove_file(&path);
                return Ok(None);
            }
            Err(e) => return Err(failed(chain(&e))),
        };
        self.took_over = true;
        // Tests: a failure in this process's bookkeeping of a link whose
        // program the kernel has already swapped.
        self.failpoint("swapped")?;
        let link = self
            .xdp(prog)?
            .take_link(id)
            .map_err(|e| DatapathError::Load(chain(&e)))?;
        self.links
            .push(FdLink::try_from(link).map_err(|e| DatapathError::Load(chain(&e)))?);
        tracing::info!(
            iface,
            "swapped this build's program into the pinned XDP link"
        );
        Ok(Some(Attachment {
            iface: iface.to_string(),
            mode,
        }))
    }

    /// Attaches the bare `XDP_PASS` program to `iface` natively instead of
    /// the limiter: the baseline a benchmark compares rl's cost with.
    ///
    /// Pinned, on an interface whose link is pinned, it replaces the
    /// program there (as an upgrade to another program would): the test of
    /// an upgrade between two different programs.
    pub fn attach_baseline(&mut self, iface: &str) -> Result<(), DatapathError> {
        interface_index(iface)?;
        self.load_program(PROG_PASS)?;
        if let Some(dir) = self.pins.clone() {
            if self.adopt_link(&dir, iface, PROG_PASS)?.is_some() {
                return Ok(());
            }
        }
        self.attach_as(iface, AttachMode::Native, PROG_PASS)
            .map(|_| ())
    }

    fn attach_as(
        &mut self,
        iface: &str,
        mode: AttachMode,
        name: &'static str,
    ) -> Result<XdpLinkId, DatapathError> {
        let flags = match mode {
            AttachMode::Native => XdpMode::Driver,
            AttachMode::Skb => XdpMode::Skb,
            AttachMode::Auto => unreachable!("auto is resolved by attach"),
        };
        // rl's own datapath for another set of interfaces, pinned beside ours.
        let elsewhere = self
            .pins
            .as_deref()
            .and_then(|own| own.parent().map(|p| (p, own)))
            .and_then(|(p, own)| {
                super::pin::dirs_with(p, iface)
                    .ok()?
                    .into_iter()
                    .find(|d| d != own)
            });
        let prog: &mut Xdp = self
            .ebpf
            .program_mut(name)
            .expect("loaded before attaching")
            .try_into()
            .expect("an XDP program");
        prog.attach(iface, flags).map_err(|e| match errno(&e) {
            Some(libc::EBUSY) | Some(libc::EEXIST) => match elsewhere {
                Some(dir) => DatapathError::PinnedElsewhere {
                    iface: iface.into(),
                    dir,
                },
                None => DatapathError::InterfaceBusy(iface.into()),
            },
            Some(libc::EPERM) | Some(libc::EACCES) => DatapathError::NoPrivilege {
                doing: "attaching the XDP program",
            },
            _ => match e {
                ProgramError::UnknownInterface { .. } => {
                    DatapathError::UnknownInterface(iface.into())
                }
                e => DatapathError::Attach {
                    iface: iface.into(),
                    mode,
                    cause: chain(&e),
                },
            },
        })
    }
}

/// Why the XDP link pinned at `path` is not on `iface` (index `here`) of
/// this network namespace, if it is not: its interface was moved to
/// another namespace or renamed, and `iface` here is another interface,
/// perhaps under the same index (a moved interface keeps its index where
/// it is free, and the allocator may hand it out again here). Swapping the
/// link's program would leave `iface` without one while reporting one.
fn elsewhere(path: &std::path::Path, iface: &str, here: u32) -> Option<String> {
    let link = match pin::pinned_link_info(path) {
        Ok(link) if link.ifindex != 0 => link,
        // Defunct: the swap answers ENOLINK, and it is replaced.
        Ok(_) => return None,
        Err(e) => {
            warn!(iface, "could not read which interface the pinned XDP link is on ({e}); swapping all the same");
            return None;
        }
    };
    let seen = if link.ifindex != here {
        format!(
            "is on the interface of index {}, and `{iface}` here is index {here}",
            link.ifindex
        )
    } else {
        match netlink::xdp_programs(here) {
            Ok(ids) if ids.contains(&link.prog_id) => return None,
            Ok(ids) => format!(
                "runs program {}, and `{iface}` here (index {here}, the link's too) runs {}",
                link.prog_id,
                if ids.is_empty() {
                    "none".to_string()
                } else {
                    format!("{ids:?}")
                }
            ),
            Err(e) => {
                warn!(iface, "could not ask rtnetlink which XDP programs `{iface}` runs ({e}); swapping all the same");
                return None;
            }
        }
    };
    Some(format!(
        "the XDP link pinned at {} {seen}: its interface was moved to another network namespace or renamed; \
         move it back, or `rl-control detach --iface {iface}` removes the pins (the program goes off the moved \
         interface, and the buckets with it)",
        path.display()
    ))
}
