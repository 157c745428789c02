//! Every `RDMACOMM_*` setting, declared once: its variable and how a value of it applies to a
//! [`Config`]. The table drives [`Config::new`]'s parsing (over [`Config::defaults`], the one
//! place defaults live), the typo check ([`super::VARIABLES`] is its names) and the test that
//! the GUIDE's environment table lists these and no others.

use super::*;

/// One variable and what a value of it does.
pub(crate) struct Setting {
    /// The variable.
    pub(crate) name: &'static str,
    /// Applies a value (set, not blank) to the config; `Err` says why it cannot be used.
    /// Variables read as a group (the secret) re-read the group. `None`: read elsewhere, by
    /// the rank's identity ([`Config::identity_from_env`]) before any config exists, or with
    /// the launcher's facts (the device choice, which needs the local rank).
    apply: Option<fn(&mut Config, &str) -> Result<()>>,
}

const fn elsewhere(name: &'static str) -> Setting {
    Setting { name, apply: None }
}

const fn set(name: &'static str, apply: fn(&mut Config, &str) -> Result<()>) -> Setting {
    Setting {
        name,
        apply: Some(apply),
    }
}

/// Every setting; applied in this order (`RDMACOMM_SLOTS` before `RDMACOMM_SLOT_BYTES`, whose
/// default follows it).
pub(crate) const SETTINGS: [Setting; 36] = [
    set("RDMACOMM_JOB_ID", |c, _| {
        c.job_id = job_id_from_env();
        Ok(())
    }),
    set("RDMACOMM_SECRET", |c, _| {
        c.secret = secret_from_env()?;
        Ok(())
    }),
    set("RDMACOMM_SECRET_FILE", |c, _| {
        c.secret = secret_from_env()?;
        Ok(())
    }),
    elsewhere("RDMACOMM_RANK"),
    elsewhere("RDMACOMM_WORLD_SIZE"),
    elsewhere("RDMACOMM_COORDINATOR"),
    set("RDMACOMM_COORDINATOR_FILE", |c, v| {
        c.coordinator_file = Some(v.to_string());
        Ok(())
    }),
    set("RDMACOMM_REPLACEMENT", |c, v| {
        c.replacement = match v.trim() {
            "1" => true,
            "0" => false,
            _ => return Err(bad("RDMACOMM_REPLACEMENT", v, "use 1 or 0")),
        };
        Ok(())
    }),
    set("RDMACOMM_BIND_ADDR", |c, v| {
        c.bind_addr = Some(v.to_string());
        Ok(())
    }),
    set("RDMACOMM_TIMEOUT", |c, v| {
        c.timeout = timeout_of("RDMACOMM_TIMEOUT", v)?;
        Ok(())
    }),
    set("RDMACOMM_TRANSPORT", |c, v| {
        c.transport = TransportKind::parse(v)?;
        Ok(())
    }),
    set("RDMACOMM_SHM", |c, v| {
        c.shm = match v.trim() {
            "1" => Some(true),
            "0" => Some(false),
            _ => return Err(bad("RDMACOMM_SHM", v, "use 1 or 0")),
        };
        Ok(())
    }),
    set("RDMACOMM_HOST_ID", |c, v| {
        c.host_id = v.to_string();
        Ok(())
    }),
    elsewhere("RDMACOMM_IB_DEVICE"),
    elsewhere("RDMACOMM_IB_PORT"),
    elsewhere("RDMACOMM_GID_INDEX"),
    elsewhere("RDMACOMM_IB_HCA"),
    set("RDMACOMM_IB_TIMEOUT", |c, v| {
        c.ib_timeout = Some(small("RDMACOMM_IB_TIMEOUT", v, 1..=31)?);
        Ok(())
    }),
    set("RDMACOMM_IB_RETRY", |c, v| {
        c.ib_retry = Some(small("RDMACOMM_IB_RETRY", v, 0..=6)?);
        Ok(())
    }),
    set("RDMACOMM_SLOTS", |c, v| {
        c.slots = parse_num("RDMACOMM_SLOTS", v)?;
        c.slot_bytes = default_slot_bytes(c.world_size, c.slots);
        Ok(())
    }),
    set("RDMACOMM_SLOT_BYTES", |c, v| {
        c.slot_bytes = parse_num("RDMACOMM_SLOT_BYTES", v)?;
        Ok(())
    }),
    set("RDMACOMM_TCP_CHUNK", |c, v| {
        c.tcp_chunk = parse_num("RDMACOMM_TCP_CHUNK", v)?;
        Ok(())
    }),
    set("RDMACOMM_ALGO", |c, v| {
        c.algo = Algo::parse(v.trim())?;
        Ok(())
    }),
    set("RDMACOMM_BCAST", |c, v| {
        c.bcast = Bcast::parse(v.trim())?;
        Ok(())
    }),
    set("RDMACOMM_POLL", |c, v| {
        c.poll = Poll::parse(v.trim())?;
        Ok(())
    }),
    set("RDMACOMM_CONNECT", |c, v| {
        c.connect = Connect::parse(v.trim())?;
        Ok(())
    }),
    set("RDMACOMM_PEERS_MAX", |c, v| {
        c.peers_max = Some(v.trim().parse().map_err(|_| {
            bad(
                "RDMACOMM_PEERS_MAX",
                v,
                "a number of peers (0: always trees)",
            )
        })?);
        Ok(())
    }),
    set("RDMACOMM_ZERO_COPY_MIN", |c, v| {
        c.zero_copy_min = v.trim().parse().map_err(|_| {
            bad(
                "RDMACOMM_ZERO_COPY_MIN",
                v,
                "a byte count (0 turns zero-copy sends off)",
            )
        })?;
        Ok(())
    }),
    set("RDMACOMM_PIN", |c, v| {
        c.pin = crate::pin::Pin::parse(v)?;
        Ok(())
    }),
    set("RDMACOMM_PROGRESS_CPU", |c, v| {
        c.progress_cpu = Some(parse_num("RDMACOMM_PROGRESS_CPU", v)?);
        Ok(())
    }),
    set("RDMACOMM_PROGRESS", |c, v| {
        c.progress = Progress::parse(v.trim())?;
        Ok(())
    }),
    set("RDMACOMM_COPY", |c, v| {
        c.copy = crate::copy::parse(v)?;
        Ok(())
    }),
    set("RDMACOMM_SIMD", |c, v| {
        c.simd_baseline = match v.trim() {
            "auto" => false,
            "baseline" => true,
            _ => return Err(bad("RDMACOMM_SIMD", v, "use baseline or auto")),
        };
        Ok(())
    }),
    set("RDMACOMM_REDUCE_THREADS", |c, v| {
        let n: usize = parse_num("RDMACOMM_REDUCE_THREADS", v)?;
        if !(1..=64).contains(&n) {
            return Err(bad("RDMACOMM_REDUCE_THREADS", v, "use 1 to 64 threads"));
        }
        c.reduce_threads = Some(n);
        Ok(())
    }),
    set("RDMACOMM_DEBUG", |c, v| {
        c.debug = Some(crate::diag::Level::parse(v)?);
        Ok(())
    }),
    set("RDMACOMM_DEBUG_FILE", |c, v| {
        c.debug_file = Some(v.to_string());
        Ok(())
    }),
];

/// A whole number in `range`.
fn small(name: &str, v: &str, range: std::ops::RangeInclusive<u8>) -> Result<u8> {
    match v.trim().parse::<u8>() {
        Ok(x) if range.contains(&x) => Ok(x),
        _ => Err(bad(
            name,
            v,
            &format!(
                "must be a whole number in {}..={}",
                range.start(),
                range.end()
            ),
        )),
    }
}

/// The error for `name`'s value `v`, which cannot be used for `reason`.
pub(crate) fn bad(name: &str, v: &str, reason: &str) -> Error {
    Error::BadSetting {
        variable: name.to_string(),
        value: v.to_string(),
        reason: reason.to_string(),
    }
}

/// Applies every setting `get` finds (set and not blank) to `cfg`, in the table's order. A
/// value that cannot be used is an [`Error::BadSetting`] naming the variable, the value and why.
pub(crate) fn apply(cfg: &mut Config, get: Lookup) -> Result<()> {
    for s in &SETTINGS {
        let (Some(apply), Some(v)) = (s.apply, get(s.name)) else {
            continue;
        };
        apply(cfg, &v).map_err(|e| structured(s.name, &v, e))?;
    }
    Ok(())
}

/// A parser's error about `name=v` as [`Error::BadSetting`] (its words after `name=v: `).
fn structured(name: &str, v: &str, e: Error) -> Error {
    match e {
        Error::Config(m) => {
            let head = format!("{name}={v:?}: ");
            match m.strip_prefix(&head) {
                Some(reason) => bad(name, v, reason),
                None => Error::Config(m),
            }
        }
        e => e,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table(vars: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let vars: Vec<(String, String)> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |name: &str| vars.iter().find(|(k, _)| k == name).map(|(_, v)| v.clone())
    }

    #[test]
    fn every_setting_applies_or_is_named_with_its_value_and_reason() {
        let mut c = Config::defaults(0, 2, "127.0.0.1:1");
        let get = table(&[
            ("RDMACOMM_SLOTS", "8"),
            ("RDMACOMM_TIMEOUT", "2.5"),
            ("RDMACOMM_POLL", "spin"),
            ("RDMACOMM_SHM", "0"),
            ("RDMACOMM_IB_RETRY", "3"),
            ("RDMACOMM_CONNECT", "eager"),
            ("RDMACOMM_PEERS_MAX", "12"),
        ]);
        apply(&mut c, &get).unwrap();
        assert_eq!(c.connect, Connect::Eager);
        assert_eq!(c.peers_max, Some(12));
        assert_eq!(c.slots, 8);
        assert_eq!(c.slot_bytes, default_slot_bytes(2, 8), "follows the slots");
        assert_eq!(c.timeout, Duration::from_millis(2500));
        assert_eq!(
            (c.poll, c.shm, c.ib_retry),
            (Poll::Spin, Some(false), Some(3))
        );
        for (name, v, why) in [
            ("RDMACOMM_POLL", "fast", "auto, spin or yield"),
            ("RDMACOMM_IB_RETRY", "9", "0..=6"),
            ("RDMACOMM_SHM", "yes", "1 or 0"),
            ("RDMACOMM_TIMEOUT", "0", "0.001 to 1e9"),
            ("RDMACOMM_SLOTS", "many", "number"),
            ("RDMACOMM_CONNECT", "later", "on-demand or eager"),
            ("RDMACOMM_PEERS_MAX", "-1", "number of peers"),
        ] {
            let mut c = Config::defaults(0, 2, "127.0.0.1:1");
            match apply(&mut c, &table(&[(name, v)])) {
                Err(Error::BadSetting {
                    variable,
                    value,
                    reason,
                }) => {
                    assert_eq!((variable.as_str(), value.as_str()), (name, v));
                    assert!(reason.contains(why), "{name}={v}: {reason}");
                }
                other => panic!("{name}={v}: {other:?}"),
            }
        }
    }

    #[test]
    fn the_names_are_unique_and_all_rdmacomm_s() {
        let mut names: Vec<&str> = SETTINGS.iter().map(|s| s.name).collect();
        assert!(names.iter().all(|n| n.starts_with("RDMACOMM_")));
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), SETTINGS.len());
    }
}
