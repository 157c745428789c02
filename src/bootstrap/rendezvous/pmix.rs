//! The launcher's PMIx key-value store (Open MPI's `mpirun`, Slurm's `srun --mpi=pmix`), through
//! which rank 0 publishes its rendezvous address when no `MASTER_ADDR` is set. libpmix is loaded
//! at run time, as verbs are: the crate neither links it nor needs it anywhere else.
//!
//! Only the five calls a publish-and-fetch needs are used (`PMIx_Init`, `PMIx_Put`,
//! `PMIx_Commit`, `PMIx_Get` with `PMIX_TIMEOUT`, `PMIx_Finalize`); the structures below are
//! PMIx's stable ABI from v2 on (`pmix_common.h`: 256-byte namespaces, 512-byte keys).

use crate::error::{Error, Result};
use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::time::Duration;

const NSPACE: usize = 256;
const KEY: usize = 512;
const SUCCESS: c_int = 0;
const NOT_FOUND: c_int = -46;
const TYPE_INT: u16 = 6;
const TYPE_STRING: u16 = 3;
const SCOPE_GLOBAL: u8 = 3;
const KEY_TIMEOUT: &[u8] = b"pmix.timeout";

/// `pmix_proc_t`.
#[repr(C)]
struct Proc {
    nspace: [c_char; NSPACE],
    rank: u32,
}

/// `pmix_value_t`: a type tag, then a 24-byte union aligned for pointers.
#[repr(C)]
struct Value {
    kind: u16,
    data: [u64; 3],
}

/// `pmix_info_t`.
#[repr(C)]
struct Info {
    key: [c_char; KEY],
    flags: u32,
    value: Value,
}

type InitFn = unsafe extern "C" fn(*mut Proc, *mut Info, usize) -> c_int;
type FinalizeFn = unsafe extern "C" fn(*const Info, usize) -> c_int;
type PutFn = unsafe extern "C" fn(u8, *const c_char, *mut Value) -> c_int;
type CommitFn = unsafe extern "C" fn() -> c_int;
type GetFn =
    unsafe extern "C" fn(*const Proc, *const c_char, *const Info, usize, *mut *mut Value) -> c_int;
type ErrorStringFn = unsafe extern "C" fn(c_int) -> *const c_char;
type DestructFn = unsafe extern "C" fn(*mut Value);

/// A PMIx client session of this process (finalized on drop).
pub struct Pmix {
    finalize: FinalizeFn,
    put: PutFn,
    commit: CommitFn,
    get: GetFn,
    error_string: ErrorStringFn,
    destruct: Option<DestructFn>,
    me: Proc,
}

/// The libraries tried, newest ABI first.
const LIBS: [&str; 2] = ["libpmix.so.2", "libpmix.so"];

/// Function `name` of `lib`, as an `F`.
///
/// # Safety
/// `F` must be the function pointer type of that symbol's C signature.
unsafe fn sym<F: Copy>(lib: *mut c_void, name: &str) -> Result<F> {
    assert_eq!(std::mem::size_of::<F>(), std::mem::size_of::<*mut c_void>());
    let c = CString::new(name).expect("a symbol name without NUL");
    // SAFETY: `lib` is a handle dlopen returned and never closed; `c` is NUL-terminated.
    let p = unsafe { libc::dlsym(lib, c.as_ptr()) };
    if p.is_null() {
        return Err(Error::Bootstrap(format!("libpmix lacks {name}")));
    }
    // SAFETY: the caller promises `F` is this symbol's function pointer type (pointer-sized).
    Ok(unsafe { std::mem::transmute_copy::<*mut c_void, F>(&p) })
}

impl Pmix {
    /// Connects to the launcher's PMIx server (the process's namespace and rank come from it),
    /// failing if it has not answered within `timeout`.
    pub fn init(timeout: Duration) -> Result<Pmix> {
        let mut lib = std::ptr::null_mut();
        for name in LIBS {
            let c = CString::new(name).expect("a library name without NUL");
            // SAFETY: a NUL-terminated name; the handle is kept for the process's life (PMIx
            // runs threads of its own, so it is never unloaded).
            lib = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_GLOBAL) };
            if !lib.is_null() {
                break;
            }
        }
        if lib.is_null() {
            return Err(Error::Bootstrap(format!(
                "launched under PMIx (PMIX_NAMESPACE is set) but none of {LIBS:?} loads; install \
                 libpmix or set MASTER_ADDR (or RDMACOMM_COORDINATOR)"
            )));
        }
        // SAFETY: each symbol is the PMIx function of that name, whose C signature the type
        // it is read as spells (pmix.h, stable from PMIx v2 on).
        let (init, finalize, put, commit, get, error_string, destruct) = unsafe {
            (
                sym::<InitFn>(lib, "PMIx_Init")?,
                sym::<FinalizeFn>(lib, "PMIx_Finalize")?,
                sym::<PutFn>(lib, "PMIx_Put")?,
                sym::<CommitFn>(lib, "PMIx_Commit")?,
                sym::<GetFn>(lib, "PMIx_Get")?,
                sym::<ErrorStringFn>(lib, "PMIx_Error_string")?,
                sym::<DestructFn>(lib, "PMIx_Value_destruct").ok(),
            )
        };
        // On a thread of its own: a server that accepts but never answers would hold it forever.
        let (tx, rx) = std::sync::mpsc::channel();
        let spawned = std::thread::Builder::new()
            .name("rdmacomm-pmix-init".into())
            .spawn(move || {
                let mut me = Proc {
                    nspace: [0; NSPACE],
                    rank: 0,
                };
                // SAFETY: `me` is a valid pmix_proc_t to fill; no info is passed.
                let rc = unsafe { init(&mut me, std::ptr::null_mut(), 0) };
                let _ = tx.send((rc, me));
            });
        if let Err(e) = spawned {
            return Err(Error::Bootstrap(format!(
                "PMIx_Init: no thread to run it: {e}"
            )));
        }
        let (rc, me) = rx.recv_timeout(timeout).map_err(|_| {
            Error::Bootstrap(format!(
                "PMIx_Init did not return within {timeout:?}: the launcher's PMIx server \
                 (PMIX_SERVER_URI*) does not answer; set RDMACOMM_TIMEOUT to wait longer, or \
                 MASTER_ADDR to rendezvous without PMIx"
            ))
        })?;
        let p = Pmix {
            finalize,
            put,
            commit,
            get,
            error_string,
            destruct,
            me,
        };
        if rc != SUCCESS {
            let why = p.says(rc);
            // Nothing to finalize.
            std::mem::forget(p);
            return Err(Error::Bootstrap(format!(
                "PMIx_Init failed: {why} (is the launcher's PMIx server running?)"
            )));
        }
        Ok(p)
    }

    /// PMIx's words for status `rc`.
    fn says(&self, rc: c_int) -> String {
        // SAFETY: PMIx_Error_string returns a static NUL-terminated string (or NULL).
        let s = unsafe { (self.error_string)(rc) };
        if s.is_null() {
            return format!("status {rc}");
        }
        // SAFETY: non-NULL, NUL-terminated, static.
        format!("{} ({rc})", unsafe { CStr::from_ptr(s) }.to_string_lossy())
    }

    /// This process's rank in its PMIx namespace.
    pub fn rank(&self) -> u32 {
        self.me.rank
    }

    /// This process's PMIx namespace.
    pub fn namespace(&self) -> String {
        // SAFETY: PMIx_Init filled a NUL-terminated namespace; the array ends in a zero byte.
        unsafe { CStr::from_ptr(self.me.nspace.as_ptr()) }
            .to_string_lossy()
            .into_owned()
    }

    /// Publishes `value` under `key` to every rank of the job (put, then commit).
    pub fn publish(&self, key: &str, value: &str) -> Result<()> {
        let k = CString::new(key).map_err(|_| Error::Bootstrap("a key with NUL".into()))?;
        let v = CString::new(value).map_err(|_| Error::Bootstrap("a value with NUL".into()))?;
        let mut val = Value {
            kind: TYPE_STRING,
            data: [v.as_ptr() as u64, 0, 0],
        };
        // SAFETY: `k` and `v` are NUL-terminated and outlive the call; PMIx copies the value.
        let rc = unsafe { (self.put)(SCOPE_GLOBAL, k.as_ptr(), &mut val) };
        if rc != SUCCESS {
            return Err(Error::Bootstrap(format!(
                "PMIx_Put({key}) failed: {}",
                self.says(rc)
            )));
        }
        // SAFETY: no arguments.
        let rc = unsafe { (self.commit)() };
        if rc != SUCCESS {
            return Err(Error::Bootstrap(format!(
                "PMIx_Commit failed: {}",
                self.says(rc)
            )));
        }
        Ok(())
    }

    /// The string rank `rank` of this namespace published under `key`, waiting for it up to
    /// `timeout`.
    pub fn fetch(&self, rank: u32, key: &str, timeout: Duration) -> Result<String> {
        let k = CString::new(key).map_err(|_| Error::Bootstrap("a key with NUL".into()))?;
        let of = Proc {
            nspace: self.me.nspace,
            rank,
        };
        let mut info = Info {
            key: [0; KEY],
            flags: 0,
            value: Value {
                kind: TYPE_INT,
                data: [0; 3],
            },
        };
        for (d, s) in info.key.iter_mut().zip(KEY_TIMEOUT) {
            *d = *s as c_char;
        }
        // An int in the union's first bytes: whole seconds, at least one (0 would mean never).
        let secs = timeout.as_secs().clamp(1, i32::MAX as u64) as i32;
        info.value.data[0] = u64::from(secs as u32);
        let mut out: *mut Value = std::ptr::null_mut();
        // Some servers answer "not found" at once instead of waiting for the put: ask again.
        let deadline = std::time::Instant::now() + timeout;
        let rc = loop {
            // SAFETY: valid proc, key and one info; PMIx stores a value it allocated in `out`.
            let rc = unsafe { (self.get)(&of, k.as_ptr(), &info, 1, &mut out) };
            if rc != NOT_FOUND || std::time::Instant::now() >= deadline {
                break rc;
            }
            std::thread::sleep(Duration::from_millis(5));
        };
        if rc != SUCCESS || out.is_null() {
            return Err(Error::Bootstrap(format!(
                "rank {rank}'s {key} did not come through PMIx within {timeout:?}: {}",
                self.says(rc)
            )));
        }
        // SAFETY: `out` is the value PMIx_Get allocated; for a string its union holds a
        // NUL-terminated char*.
        let got = unsafe {
            let v = &*out;
            let s = v.data[0] as *const c_char;
            let r = if v.kind == TYPE_STRING && !s.is_null() {
                Ok(CStr::from_ptr(s).to_string_lossy().into_owned())
            } else {
                Err(Error::Bootstrap(format!(
                    "rank {rank}'s {key} in PMIx is of type {}, not a string",
                    v.kind
                )))
            };
            // Freed as PMIX_VALUE_RELEASE does (without the destructor, the few bytes stay).
            if let Some(d) = self.destruct {
                d(out);
                libc::free(out.cast());
            }
            r
        };
        got
    }
}

impl Drop for Pmix {
    fn drop(&mut self) {
        // SAFETY: a session PMIx_Init opened; no info. (Sessions are counted: one Open MPI
        // holds in the same process stays open.)
        unsafe { (self.finalize)(std::ptr::null(), 0) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn structures_match_pmix_common_h() {
        // Sizes and offsets as gcc lays out pmix_proc_t, pmix_value_t and pmix_info_t.
        assert_eq!(std::mem::size_of::<Proc>(), 260);
        assert_eq!(std::mem::offset_of!(Proc, rank), 256);
        assert_eq!(std::mem::size_of::<Value>(), 32);
        assert_eq!(std::mem::offset_of!(Value, data), 8);
        assert_eq!(std::mem::size_of::<Info>(), 552);
        assert_eq!(std::mem::offset_of!(Info, flags), 512);
        assert_eq!(std::mem::offset_of!(Info, value), 520);
    }
}
