//! Diagnostics through the `log` facade: an application's logger (env_logger, or tracing with
//! its log bridge) receives rdmacomm's events under the target `rdmacomm`. `log` rather than
//! `tracing`: a library needs only the facade, and every logger of either kind takes its records.
//! `RDMACOMM_DEBUG=warn|info|debug` installs a minimal writer (to stderr, or to
//! `RDMACOMM_DEBUG_FILE`) only where the application set no logger of its own.

use crate::error::{Error, Result};
use std::io::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, Once};

/// How much the minimal writer shows (`RDMACOMM_DEBUG`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Level {
    /// What went wrong or was ignored (stray connections, a fallback to TCP).
    Warn,
    /// Also each communicator's summary: transports, device, slots, algorithms.
    Info,
    /// Also the details of connecting.
    Debug,
}

impl Level {
    /// Parses `RDMACOMM_DEBUG`'s value.
    pub fn parse(v: &str) -> Result<Level> {
        match v.trim().to_ascii_lowercase().as_str() {
            "warn" | "warning" => Ok(Level::Warn),
            "info" => Ok(Level::Info),
            "debug" | "trace" => Ok(Level::Debug),
            other => Err(Error::Config(format!(
                "RDMACOMM_DEBUG={other:?}: use warn, info or debug"
            ))),
        }
    }

    fn filter(self) -> log::LevelFilter {
        match self {
            Level::Warn => log::LevelFilter::Warn,
            Level::Info => log::LevelFilter::Info,
            Level::Debug => log::LevelFilter::Debug,
        }
    }
}

/// The minimal writer: one line an event, rdmacomm's only.
struct Writer {
    level: log::LevelFilter,
    out: Mutex<Box<dyn Write + Send>>,
}

impl log::Log for Writer {
    fn enabled(&self, m: &log::Metadata) -> bool {
        m.level() <= self.level && m.target().starts_with("rdmacomm")
    }

    fn log(&self, r: &log::Record) {
        if self.enabled(r.metadata()) {
            let mut out = self.out.lock().unwrap_or_else(|e| e.into_inner());
            let _ = writeln!(out, "rdmacomm {}: {}", r.level(), r.args());
        }
    }

    fn flush(&self) {
        let _ = self.out.lock().unwrap_or_else(|e| e.into_inner()).flush();
    }
}

/// Installs the minimal writer at `level` (to `file`, else stderr), once per process, unless
/// the application has a logger. A file that cannot be opened is an error naming it.
pub(crate) fn install(level: Option<Level>, file: Option<&str>) -> Result<()> {
    let Some(level) = level else {
        return Ok(());
    };
    let out: Box<dyn Write + Send> = match file {
        Some(path) => Box::new(
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(path)
                .map_err(|e| Error::Config(format!("RDMACOMM_DEBUG_FILE={path}: {e}")))?,
        ),
        None => Box::new(std::io::stderr()),
    };
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        let w = Writer {
            level: level.filter(),
            out: Mutex::new(out),
        };
        if log::set_boxed_logger(Box::new(w)).is_ok() {
            log::set_max_level(level.filter());
        }
    });
    Ok(())
}

/// A warning said often (a port scanner's connections): the first ten, then one in a thousand,
/// with the count.
pub(crate) struct Repeated(AtomicU64);

impl Repeated {
    /// A new counter.
    pub(crate) const fn new() -> Repeated {
        Repeated(AtomicU64::new(0))
    }

    /// How many times this was said before, if it is to be said now.
    pub(crate) fn allow(&self) -> Option<u64> {
        let n = self.0.fetch_add(1, Ordering::Relaxed);
        (n < 10 || n % 1000 == 0).then_some(n)
    }
}

/// A test's fault injection (debug builds only; release builds never read it): whether
/// `RDMACOMM_TEST_FAULT` names the point `what`, where the test has this process fail.
pub(crate) fn test_fault(what: &str) -> bool {
    cfg!(debug_assertions) && std::env::var("RDMACOMM_TEST_FAULT").is_ok_and(|v| v == what)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn levels_parse_and_repeats_thin_out() {
        assert_eq!(Level::parse(" INFO").unwrap(), Level::Info);
        assert!(Level::parse("loud")
            .unwrap_err()
            .to_string()
            .contains("RDMACOMM_DEBUG"));
        let r = Repeated::new();
        let said = (0..3000).filter(|_| r.allow().is_some()).count();
        assert_eq!(said, 10 + 2); // 0..10, then 1000 and 2000
    }
}
