//! The batch map commands (aya 0.14 has no batch API).

/// The attribute block of the batch commands (`union bpf_attr`'s `batch`).
#[repr(C)]
#[derive(Default)]
struct BatchAttr {
    in_batch: u64,
    out_batch: u64,
    keys: u64,
    values: u64,
    count: u32,
    map_fd: u32,
    elem_flags: u64,
    flags: u64,
}

fn bpf_batch(cmd: libc::c_long, attr: &mut BatchAttr) -> std::io::Result<()> {
    let rc = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            cmd,
            attr as *mut BatchAttr,
            std::mem::size_of::<BatchAttr>() as u32,
        )
    };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// `BPF_MAP_LOOKUP_BATCH` over a whole hash map, handing each chunk of up
/// to 16,384 entries to `f` as it comes: memory stays bounded by a chunk.
pub(super) fn lookup_batch_each<
    K: aya::Pod + Default,
    V: aya::Pod + Default,
    E: From<std::io::Error>,
>(
    fd: std::os::fd::RawFd,
    mut f: impl FnMut(&[K], &[V]) -> Result<(), E>,
) -> Result<(), E> {
    const BPF_MAP_LOOKUP_BATCH: libc::c_long = 24;
    const CHUNK: usize = 16_384;
    let (mut keys, mut values) = (vec![K::default(); CHUNK], vec![V::default(); CHUNK]);
    let (mut token_in, mut token_out) = (0u64, 0u64);
    let mut first = true;
    loop {
        let mut attr = BatchAttr {
            in_batch: if first {
                0
            } else {
                &token_in as *const u64 as u64
            },
            out_batch: &mut token_out as *mut u64 as u64,
            keys: keys.as_mut_ptr() as u64,
            values: values.as_mut_ptr() as u64,
            count: CHUNK as u32,
            map_fd: fd as u32,
            ..Default::default()
        };
        let r = bpf_batch(BPF_MAP_LOOKUP_BATCH, &mut attr);
        // The kernel writes `count` back on success and at the end
        // (ENOENT); after another error it may not have, and the chunk
        // would be the last one's entries (or defaults) again.
        let last = match r {
            Ok(()) => false,
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => true,
            Err(e) => return Err(e.into()),
        };
        let n = (attr.count as usize).min(CHUNK);
        f(&keys[..n], &values[..n])?;
        if last {
            return Ok(());
        }
        token_in = token_out;
        first = false;
    }
}

/// `BPF_MAP_LOOKUP_BATCH` of `count` entries of an array from index
/// `start` on, in one system call.
pub(super) fn lookup_array<V: aya::Pod + Default>(
    fd: std::os::fd::RawFd,
    start: u32,
    count: u32,
) -> std::io::Result<Vec<V>> {
    const BPF_MAP_LOOKUP_BATCH: libc::c_long = 24;
    let (mut keys, mut values) = (
        vec![0u32; count as usize],
        vec![V::default(); count as usize],
    );
    // The batch goes on after the key it is given.
    let (before, mut next) = (start.wrapping_sub(1), 0u32);
    let mut attr = BatchAttr {
        in_batch: if start == 0 {
            0
        } else {
            &before as *const u32 as u64
        },
        out_batch: &mut next as *mut u32 as u64,
        keys: keys.as_mut_ptr() as u64,
        values: values.as_mut_ptr() as u64,
        count,
        map_fd: fd as u32,
        ..Default::default()
    };
    match bpf_batch(BPF_MAP_LOOKUP_BATCH, &mut attr) {
        Ok(()) => {}
        Err(e) if e.raw_os_error() == Some(libc::ENOENT) => {}
        Err(e) => return Err(e),
    }
    if attr.count != count || keys.first().is_some_and(|&k| k != start) {
        return Err(std::io::Error::other(format!(
            "a batch lookup of {count} entries from {start} returned {} from {:?}",
            attr.count,
            keys.first()
        )));
    }
    Ok(values)
}

/// `BPF_MAP_UPDATE_BATCH` of an array's `u32` keys and their values (aya
/// 0.14 has no batch API). Arrays accept batches since Linux 5.6.
pub(super) fn update_batch<V: aya::Pod>(
    fd: std::os::fd::RawFd,
    keys: &[u32],
    values: &[V],
) -> std::io::Result<()> {
    assert_eq!(keys.len(), values.len());
    const BPF_MAP_UPDATE_BATCH: libc::c_long = 26;
    let mut done = 0;
    while done < keys.len() {
        let mut attr = BatchAttr {
            keys: keys[done..].as_ptr() as u64,
            values: values[done..].as_ptr() as u64,
            count: (keys.len() - done) as u32,
            map_fd: fd as u32,
            ..Default::default()
        };
        bpf_batch(BPF_MAP_UPDATE_BATCH, &mut attr)?;
        // The kernel reports how many it wrote in `count`.
        if attr.count == 0 {
            return Err(std::io::Error::other("the kernel wrote no entries"));
        }
        done += attr.count as usize;
    }
    Ok(())
}

/// `BPF_MAP_DELETE_BATCH` of hash-map keys.
pub(super) fn delete_batch<K: aya::Pod>(fd: std::os::fd::RawFd, keys: &[K]) -> std::io::Result<()> {
    const BPF_MAP_DELETE_BATCH: libc::c_long = 27;
    for chunk in keys.chunks(16_384) {
        let mut attr = BatchAttr {
            keys: chunk.as_ptr() as u64,
            count: chunk.len() as u32,
            map_fd: fd as u32,
            ..Default::default()
        };
        bpf_batch(BPF_MAP_DELETE_BATCH, &mut attr)?;
    }
    Ok(())
}
