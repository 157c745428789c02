//! Optional pinning of the calling thread to one core (`RDMACOMM_PIN`), through `core_affinity`.
//!
//! `off` (default) leaves scheduling alone; `auto` pins local rank i (its index among the ranks
//! on its host) to the i-th core of the process's allowed set, modulo its size; a comma-separated
//! list of core ids pins local rank i to the i-th entry. A rank that polls its completion queue
//! then keeps its cache and never migrates between the cores its peers' polling loops use.

use crate::error::{Error, Result};

/// Where the calling thread of each local rank runs.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum Pin {
    /// No pinning.
    #[default]
    Off,
    /// Local rank i on the i-th allowed core (modulo their number).
    Auto,
    /// Local rank i on core `cores[i]`.
    Cores(Vec<usize>),
}

/// The cores local rank `local` of `nlocal` owns: its equal share of the allowed ones (one at
/// least, shared where there are fewer cores than ranks).
pub(crate) fn share(local: usize, nlocal: usize) -> Vec<usize> {
    let all = allowed_cores();
    let (c, l) = (all.len(), nlocal.max(1));
    if c == 0 {
        return Vec::new();
    }
    if c < l {
        return vec![all[local % c]];
    }
    all[local * c / l..(local + 1) * c / l].to_vec()
}

/// The cores this process may run on, ascending.
pub fn allowed_cores() -> Vec<usize> {
    core_affinity::get_core_ids()
        .map(|v| v.into_iter().map(|c| c.id).collect())
        .unwrap_or_default()
}

impl Pin {
    /// Parses `RDMACOMM_PIN` (`off`, `auto`, or core ids such as `0,2,4,6`); every listed core
    /// must be one this process may run on.
    pub fn parse(v: &str) -> Result<Pin> {
        let v = v.trim();
        match v {
            "" | "off" => return Ok(Pin::Off),
            "auto" => return Ok(Pin::Auto),
            _ => {}
        }
        let allowed = allowed_cores();
        let mut cores = Vec::new();
        for part in v.split(',') {
            let c: usize = part.trim().parse().map_err(|_| {
                Error::Config(format!(
                    "RDMACOMM_PIN={v}: use off, auto, or core ids separated by commas, one per \
                     local rank (e.g. 0,2)"
                ))
            })?;
            if !allowed.contains(&c) {
                return Err(Error::Config(format!(
                    "RDMACOMM_PIN={v}: core {c} is not one this process may run on ({}); list \
                     cores from that set, or use RDMACOMM_PIN=auto",
                    list(&allowed)
                )));
            }
            cores.push(c);
        }
        Ok(Pin::Cores(cores))
    }

    /// The core for local rank `local` of `nlocal` on this host (None: no pinning).
    pub fn core_for(&self, local: usize, nlocal: usize) -> Result<Option<usize>> {
        match self {
            Pin::Off => Ok(None),
            Pin::Auto => {
                let allowed = allowed_cores();
                Ok(allowed.get(local % allowed.len().max(1)).copied())
            }
            Pin::Cores(c) => match c.get(local) {
                Some(&core) => Ok(Some(core)),
                None => Err(Error::Config(format!(
                    "RDMACOMM_PIN={}: {} core(s) listed but this host runs {nlocal} ranks \
                     (this is local rank {local}): list one core per local rank",
                    list(c),
                    c.len()
                ))),
            },
        }
    }

    /// Pins the calling thread for local rank `local` of `nlocal`; returns the core, if any.
    pub fn apply(&self, local: usize, nlocal: usize) -> Result<Option<usize>> {
        let Some(core) = self.core_for(local, nlocal)? else {
            return Ok(None);
        };
        if !core_affinity::set_for_current(core_affinity::CoreId { id: core }) {
            return Err(Error::Config(format!(
                "RDMACOMM_PIN: pinning local rank {local} to core {core} failed ({}); use \
                 RDMACOMM_PIN=off",
                std::io::Error::last_os_error()
            )));
        }
        Ok(Some(core))
    }
}

fn list(c: &[usize]) -> String {
    c.iter()
        .map(|x| x.to_string())
        .collect::<Vec<_>>()
        .join(",")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_maps_local_ranks() {
        assert_eq!(Pin::parse("off").unwrap(), Pin::Off);
        assert_eq!(Pin::parse("auto").unwrap(), Pin::Auto);
        let allowed = allowed_cores();
        assert!(!allowed.is_empty());
        let first = allowed[0];
        let p = Pin::parse(&format!("{first}, {first}")).unwrap();
        assert_eq!(p.core_for(1, 2).unwrap(), Some(first));
        let e = p.core_for(2, 3).unwrap_err().to_string();
        assert!(
            e.contains("2 core(s) listed but this host runs 3 ranks"),
            "{e}"
        );
        let n = allowed.len();
        assert_eq!(Pin::Auto.core_for(n, n + 1).unwrap(), Some(first), "wraps");
        assert_eq!(Pin::Off.core_for(0, 1).unwrap(), None);
        let e = Pin::parse("x").unwrap_err().to_string();
        assert!(e.contains("RDMACOMM_PIN=x: use off, auto"), "{e}");
        let e = Pin::parse("100000").unwrap_err().to_string();
        assert!(
            e.contains("core 100000 is not one this process may run on"),
            "{e}"
        );
    }
}
