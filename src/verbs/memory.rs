//! Page-aligned memory registered with the HCA: the allocation and its MR, owned together.

use crate::error::{Error, Result};
use sideway::ibverbs::memory_region::{
    MemoryRegion, RegisterMemoryRegionError, RegisterMemoryRegionErrorKind,
};
use sideway::ibverbs::protection_domain::ProtectionDomain;
use sideway::ibverbs::AccessFlags;
use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::ptr::NonNull;
use std::sync::Arc;

/// A zeroed, page-aligned buffer registered as one or more memory regions over disjoint ranges:
/// windows a peer may write (each with its own remote key), the rest for local access only;
/// nothing is ever remotely readable. The MRs are released before the memory, and the owner of
/// every QP that may point into it must drop those QPs first (see `transport::rdma`).
pub struct RegisteredBuffer {
    /// (start, end, MR) in offset order, covering the whole buffer.
    mrs: Vec<(usize, usize, Arc<MemoryRegion>)>,
    ptr: NonNull<u8>,
    layout: Layout,
}

// SAFETY: the buffer is plain memory owned by this value; access is through &/&mut self or raw
// pointers whose use the owner synchronizes.
unsafe impl Send for RegisteredBuffer {}
// SAFETY: as above; shared references only read the MR's keys and the base address.
unsafe impl Sync for RegisteredBuffer {}

#[cfg_attr(not(feature = "unstable"), allow(dead_code))]
impl RegisteredBuffer {
    /// Allocates `len` zeroed bytes (rounded up to a page; the RDMA transport's mailboxes rely on
    /// the zeros) and registers them on `pd` as one region that peers may write.
    pub fn new(pd: &Arc<ProtectionDomain>, len: usize) -> Result<Self> {
        let len = len.max(1).next_multiple_of(4096);
        Self::with_windows(pd, len, std::slice::from_ref(&(0..len)))
    }

    /// Allocates `len` zeroed bytes (rounded up to a page) and registers each of `windows`
    /// (sorted, disjoint, non-empty ranges of offsets) as a region peers may write, with a key of
    /// its own, and the ranges between them for local access only.
    pub fn with_windows(
        pd: &Arc<ProtectionDomain>,
        len: usize,
        windows: &[std::ops::Range<usize>],
    ) -> Result<Self> {
        let len = len.max(1).next_multiple_of(4096);
        let mut cuts: Vec<(usize, usize, bool)> = Vec::with_capacity(2 * windows.len() + 1);
        let mut at = 0;
        for w in windows {
            if w.start < at || w.end <= w.start || w.end > len {
                return Err(Error::InvalidArgument(format!(
                    "window {w:?} of a {len}-byte buffer: windows must be sorted, disjoint, \
                     non-empty and inside it"
                )));
            }
            if w.start > at {
                cuts.push((at, w.start, false));
            }
            cuts.push((w.start, w.end, true));
            at = w.end;
        }
        if at < len {
            cuts.push((at, len, false));
        }
        let layout = Layout::from_size_align(len, 4096)
            .map_err(|e| Error::InvalidArgument(format!("buffer of {len} bytes: {e}")))?;
        // SAFETY: layout has non-zero size.
        let raw = unsafe { alloc_zeroed(layout) };
        let ptr = NonNull::new(raw).ok_or_else(|| Error::Verbs {
            op: "allocate",
            detail: format!("out of memory allocating {len} bytes"),
            source: None,
        })?;
        let mut buf = RegisteredBuffer {
            mrs: Vec::with_capacity(cuts.len()),
            ptr,
            layout,
        };
        for (a, b, remote) in cuts {
            let access = if remote {
                AccessFlags::LocalWrite | AccessFlags::RemoteWrite
            } else {
                AccessFlags::LocalWrite
            };
            // SAFETY: a..b lies in the allocation, which outlives the MR (Drop deregisters
            // first); on failure Drop releases what was registered, then the memory.
            let mr = unsafe { pd.reg_mr(ptr.as_ptr() as usize + a, b - a, access) }
                .map_err(|e| registration_failed(len, e))?;
            buf.mrs.push((a, b, mr));
        }
        Ok(buf)
    }

    /// The region holding bytes `off..off+len` (panics if they span two).
    fn region(&self, off: usize, len: usize) -> &MemoryRegion {
        let i = self.mrs.partition_point(|m| m.1 <= off);
        let m = self.mrs.get(i).expect("offset past the registered buffer");
        assert!(
            off + len <= m.1,
            "bytes {off}..{} span two regions",
            off + len
        );
        &m.2
    }

    /// Local key of the region holding bytes `off..off+len`.
    pub fn lkey_at(&self, off: usize, len: usize) -> u32 {
        self.region(off, len).lkey()
    }

    /// Remote key of the region (window) holding byte `off`.
    pub fn rkey_at(&self, off: usize) -> u32 {
        self.region(off, 0).rkey()
    }

    /// The base address (what a peer writes to).
    pub fn addr(&self) -> u64 {
        self.ptr.as_ptr() as u64
    }

    /// Local key of the region holding byte 0 (the whole buffer, from [`RegisteredBuffer::new`]).
    pub fn lkey(&self) -> u32 {
        self.lkey_at(0, 0)
    }

    /// Remote key of the region holding byte 0 (the whole buffer, from [`RegisteredBuffer::new`]).
    pub fn rkey(&self) -> u32 {
        self.rkey_at(0)
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.layout.size()
    }

    /// Whether the buffer is empty (never: at least a page).
    pub fn is_empty(&self) -> bool {
        false
    }

    /// A raw pointer to byte `off` (at most the length; panics past it).
    pub fn ptr_at(&self, off: usize) -> *mut u8 {
        assert!(off <= self.len(), "offset {off} past the registered buffer");
        // SAFETY: off is within the allocation or one past its end (asserted).
        unsafe { self.ptr.as_ptr().add(off) }
    }

    /// Panics unless `off..off+len` lies in the buffer (without overflow).
    fn check_range(&self, off: usize, len: usize) {
        let end = off.checked_add(len);
        assert!(
            end.is_some_and(|e| e <= self.len()),
            "bytes {off}..+{len} out of the {}-byte registered buffer",
            self.len()
        );
    }

    /// Bytes `off..off+len` as a slice (panics past the buffer).
    ///
    /// # Safety
    /// Peers may write the buffer's windows at any time: no device or peer may write these
    /// bytes while the slice lives (for a transport's slots, its credit protocol ensures it;
    /// for a test, a completed write and no other writer).
    pub unsafe fn slice(&self, off: usize, len: usize) -> &[u8] {
        self.check_range(off, len);
        // SAFETY: in bounds (checked); no concurrent writer by the caller's contract.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr().add(off), len) }
    }

    /// Bytes `off..off+len` as a mutable slice (panics past the buffer).
    ///
    /// # Safety
    /// As for [`RegisteredBuffer::slice`]: no device or peer may write or read these bytes
    /// while the slice lives (`&mut self` keeps every other local view out).
    pub unsafe fn slice_mut(&mut self, off: usize, len: usize) -> &mut [u8] {
        self.check_range(off, len);
        // SAFETY: in bounds (checked); &mut self and the caller's contract: no other access.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr().add(off), len) }
    }
}

impl Drop for RegisteredBuffer {
    fn drop(&mut self) {
        // Deregister first (the Arcs are never cloned out of this value), then free the memory.
        self.mrs.clear();
        // SAFETY: allocated in new() with this layout; the MR covering it is gone.
        unsafe { dealloc(self.ptr.as_ptr(), self.layout) };
    }
}

/// The current RLIMIT_MEMLOCK in words.
pub fn memlock_limit() -> String {
    let mut rl = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes into rl.
    if unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut rl) } != 0 {
        return "unknown".into();
    }
    if rl.rlim_cur == libc::RLIM_INFINITY {
        "unlimited".into()
    } else {
        format!("{} KiB", rl.rlim_cur / 1024)
    }
}

/// A failed `ibv_reg_mr` of `len` bytes as an error that says what to fix: a locked-memory
/// problem (ENOMEM, EPERM, EAGAIN under a limit) names the limit.
fn registration_failed(len: usize, e: RegisterMemoryRegionError) -> Error {
    let os = match &e.0 {
        RegisterMemoryRegionErrorKind::Ibverbs(io) => io.raw_os_error(),
        #[allow(unreachable_patterns)]
        _ => None,
    };
    let detail = format!("{e}: {:?}", e.0);
    let limit = memlock_limit();
    let lock_problem = matches!(
        os,
        Some(libc::ENOMEM) | Some(libc::EPERM) | Some(libc::EAGAIN)
    );
    if lock_problem && limit != "unlimited" {
        Error::MemLock {
            bytes: len,
            limit,
            detail,
        }
    } else {
        Error::Verbs {
            op: "register memory",
            detail: format!("{len} bytes: {detail} (locked-memory limit {limit})"),
            source: None,
        }
    }
}

/// A caller's memory registered for as long as this value lives: the source of zero-copy sends,
/// and where `writable`, a window peers' RDMA writes may land in. Unlike [`RegisteredBuffer`]
/// it does not own the memory.
pub struct LentRegion {
    mr: Arc<MemoryRegion>,
    start: usize,
    end: usize,
    writable: bool,
}

impl LentRegion {
    /// Registers `len` bytes at `addr` on `pd`, for peers' writes too where `writable`.
    ///
    /// # Safety
    /// The memory must stay allocated until this value is dropped, and no work request may use
    /// [`LentRegion::lkey`] after that. Where `writable`, a peer holding [`LentRegion::rkey`]
    /// may write it at any time until then: the caller hands the key out only for ranges it
    /// lets peers write.
    pub unsafe fn new(
        pd: &Arc<ProtectionDomain>,
        addr: usize,
        len: usize,
        writable: bool,
    ) -> Result<Self> {
        let access = if writable {
            AccessFlags::LocalWrite | AccessFlags::RemoteWrite
        } else {
            AccessFlags::LocalWrite
        };
        // SAFETY: the caller keeps addr..addr+len allocated while the MR lives (contract above).
        let mr =
            unsafe { pd.reg_mr(addr, len, access) }.map_err(|e| registration_failed(len, e))?;
        Ok(LentRegion {
            mr,
            start: addr,
            end: addr + len,
            writable,
        })
    }

    /// The remote key peers write with, where registered for their writes.
    pub fn rkey(&self) -> Option<u32> {
        self.writable.then(|| self.mr.rkey())
    }

    /// Local key.
    pub fn lkey(&self) -> u32 {
        self.mr.lkey()
    }

    /// Whether `data` lies inside the region.
    pub fn contains(&self, data: &[u8]) -> bool {
        let a = data.as_ptr() as usize;
        a >= self.start && a + data.len() <= self.end
    }
}
