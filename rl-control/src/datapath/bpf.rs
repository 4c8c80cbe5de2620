//! Raw `bpf(2)` calls for what aya does not offer (pins' objects and link
//! info, link detach, the grace-period map): a zeroed 128-byte
//! `union bpf_attr` of which each call fills the words it reads.

/// `bpf(cmd, attr)`: the call's result (a new fd for the commands that
/// make one), or the OS error.
pub(super) fn bpf(cmd: libc::c_long, attr: &mut [u64; 16]) -> std::io::Result<i64> {
    // SAFETY: a 128-byte attr, zero past the fields `cmd` reads; the
    // pointers its caller put in it are valid for the call.
    let r = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            cmd,
            attr.as_mut_ptr(),
            std::mem::size_of_val(attr),
        )
    };
    if r < 0 {
        Err(std::io::Error::last_os_error())
    } else {
        Ok(r)
    }
}
