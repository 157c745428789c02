//! The raw system calls rdmacomm makes outside the verbs layer, the SIMD kernels and the
//! shared-memory mapping, each behind a safe function: waiting on sockets, random bytes, the
//! user id, the descriptor limit, exit handlers, memory files.

use std::fs::File;
use std::io::{Error, ErrorKind, Result};
use std::os::fd::{FromRawFd, RawFd};

/// A socket to wait on, and what for.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Wait {
    /// The descriptor.
    pub fd: RawFd,
    /// Wake when it may be read.
    pub read: bool,
    /// Wake when it may be written.
    pub write: bool,
}

/// Waits up to `ms` milliseconds (at least 1) until one of `fds` is ready (`scratch` holds the
/// kernel's array between calls, so a repeated wait allocates nothing).
pub(crate) fn wait(fds: impl IntoIterator<Item = Wait>, ms: u64, scratch: &mut Vec<libc::pollfd>) {
    wait_for(fds, std::time::Duration::from_millis(ms.max(1)), scratch);
}

/// [`wait`] for up to `limit` (at microsecond grain: a nap between a completion's polls).
pub(crate) fn wait_for(
    fds: impl IntoIterator<Item = Wait>,
    limit: std::time::Duration,
    scratch: &mut Vec<libc::pollfd>,
) {
    scratch.clear();
    scratch.extend(fds.into_iter().map(|w| libc::pollfd {
        fd: w.fd,
        events: if w.read { libc::POLLIN } else { 0 } | if w.write { libc::POLLOUT } else { 0 },
        revents: 0,
    }));
    let ts = libc::timespec {
        tv_sec: limit.as_secs().min(i32::MAX as u64) as libc::time_t,
        tv_nsec: limit.subsec_nanos() as libc::c_long,
    };
    // SAFETY: as in `wait`; `ts` is a valid timeout and no signal mask is given.
    unsafe {
        libc::ppoll(
            scratch.as_mut_ptr(),
            scratch.len() as libc::nfds_t,
            &ts,
            std::ptr::null(),
        )
    };
}

/// `N` random bytes from the kernel (getrandom, which blocks only until the pool is first
/// seeded at boot).
pub(crate) fn random<const N: usize>() -> [u8; N] {
    let mut b = [0u8; N];
    let mut got = 0;
    while got < N {
        // SAFETY: writes at most N - got bytes into b at offset got.
        let r = unsafe { libc::getrandom(b[got..].as_mut_ptr().cast(), N - got, 0) };
        if r > 0 {
            got += r as usize;
        } else if Error::last_os_error().kind() != ErrorKind::Interrupted {
            // Only on a kernel before 3.17 (ENOSYS): nothing to keep a secret with.
            panic!("getrandom failed: {}", Error::last_os_error());
        }
    }
    b
}

/// This process's real user id.
pub(crate) fn uid() -> u32 {
    // SAFETY: getuid cannot fail and touches no memory.
    unsafe { libc::getuid() }
}

/// The descriptor limit: (soft, hard).
pub(crate) fn nofile() -> Result<(u64, u64)> {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes one rlimit to a valid, exclusively borrowed location.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } != 0 {
        return Err(Error::last_os_error());
    }
    Ok((lim.rlim_cur, lim.rlim_max))
}

/// Sets the descriptor limit (raising the soft one up to the hard one needs no privilege).
pub(crate) fn set_nofile(soft: u64, hard: u64) -> Result<()> {
    let lim = libc::rlimit {
        rlim_cur: soft,
        rlim_max: hard,
    };
    // SAFETY: setrlimit reads one valid rlimit.
    if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &lim) } != 0 {
        return Err(Error::last_os_error());
    }
    Ok(())
}

/// Registers `f` with C's exit handlers; `f` must not unwind (catch its panics).
#[cfg(any(feature = "nuvec", feature = "fuel"))]
pub(crate) fn at_exit(f: extern "C" fn()) {
    // SAFETY: registers a plain function pointer; it takes no arguments.
    unsafe { libc::atexit(f) };
}

/// A new, empty anonymous memory file named `name` (close-on-exec).
pub(crate) fn memory_file(name: &std::ffi::CStr) -> Result<File> {
    // SAFETY: a NUL-terminated name; the flags are valid.
    let fd = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC) };
    if fd < 0 {
        return Err(Error::last_os_error());
    }
    // SAFETY: fd was just opened and is owned by nobody else.
    Ok(unsafe { File::from_raw_fd(fd) })
}

/// Reserves `len` bytes of `file` now (posix_fallocate: on a full tmpfs a later first touch
/// would raise SIGBUS).
pub(crate) fn reserve(file: &File, len: usize) -> Result<()> {
    use std::os::fd::AsRawFd;
    let len = libc::off_t::try_from(len).map_err(|_| Error::from(ErrorKind::InvalidInput))?;
    // SAFETY: the descriptor is open for the call; posix_fallocate touches no user memory.
    match unsafe { libc::posix_fallocate(file.as_raw_fd(), 0, len) } {
        0 => Ok(()),
        e => Err(Error::from_raw_os_error(e)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_calls_answer() {
        let (a, b) = (random::<32>(), random::<32>());
        assert_ne!(a, b, "two draws differ");
        let (soft, hard) = nofile().unwrap();
        assert!(soft <= hard && soft > 0);
        let f = memory_file(c"rdmacomm-test").unwrap();
        reserve(&f, 8192).unwrap();
        assert_eq!(f.metadata().unwrap().len(), 8192);
        let mut scratch = Vec::new();
        let t = std::time::Instant::now();
        wait(std::iter::empty(), 5, &mut scratch);
        assert!(t.elapsed() >= std::time::Duration::from_millis(4));
        let _ = uid();
    }
}
