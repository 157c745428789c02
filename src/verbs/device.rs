//! Device discovery and the choice of device, port and GID.
//!
//! Defaults work without tuning: the first device with an ACTIVE port; on InfiniBand GID 0 and the
//! port's LID; on Ethernet (RoCE, rxe) a RoCE v2 GID whose address is IPv4-mapped, then any RoCE v2
//! GID that is not link-local, then any non-zero GID (NCCL's preference). Overrides:
//! `RDMACOMM_IB_DEVICE`, `RDMACOMM_IB_PORT`, `RDMACOMM_GID_INDEX`, or a device list
//! (`RDMACOMM_IB_HCA`, as NCCL_IB_HCA) that the ranks of a host spread over by local rank.

use crate::error::{Error, Result};
use sideway::ibverbs::address::Gid;
use sideway::ibverbs::device::{DeviceInfo, DeviceList, GetDeviceListErrorKind};
use sideway::ibverbs::device_context::{DeviceContext, LinkLayer, Mtu, PortState};
use std::sync::Arc;

/// sysfs GID type of a RoCE v2 GID (`ibv_query_gid_type`).
const GID_TYPE_SYSFS_ROCE_V2: u32 = 1;

/// Where to look for a device; `None` fields are chosen automatically.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DeviceChoice {
    /// Device name (`mlx5_0`, `rxe0`).
    pub device: Option<String>,
    /// Port number, from 1.
    pub port: Option<u8>,
    /// GID index.
    pub gid_index: Option<u32>,
    /// The devices a rank may use, NCCL_IB_HCA-style (`RDMACOMM_IB_HCA`).
    pub hca: Option<HcaList>,
    /// This rank's index among the ranks of its host: with `hca`, local rank i starts at the
    /// i-th usable device of the list (mod its length), so ranks of one host spread over NICs.
    pub local_rank: usize,
}

/// A device list as NCCL_IB_HCA writes it: `mlx5_0:1,mlx5_1` (names match as prefixes, `:port`
/// picks a port), `=mlx5_0` (exact names), `^mlx5_2` (every device but these).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HcaList {
    exclude: bool,
    exact: bool,
    entries: Vec<(String, Option<u8>)>,
}

impl HcaList {
    /// Parses a list; an empty one, an empty name or a bad port is an error naming it.
    pub fn parse(spec: &str) -> Result<HcaList> {
        let bad = |why: &str| Error::Config(format!("RDMACOMM_IB_HCA={spec:?}: {why}"));
        let mut rest = spec.trim();
        let exclude = rest.starts_with('^');
        rest = rest.trim_start_matches('^');
        let exact = rest.starts_with('=');
        rest = rest.trim_start_matches('=');
        let mut entries = Vec::new();
        for item in rest.split(',').map(str::trim).filter(|i| !i.is_empty()) {
            let (name, port) = match item.split_once(':') {
                Some((n, p)) => match p.parse::<u8>() {
                    Ok(p) if p >= 1 => (n, Some(p)),
                    _ => return Err(bad(&format!("{p:?} is not a port (from 1)"))),
                },
                None => (item, None),
            };
            if name.is_empty() {
                return Err(bad("an entry has no device name"));
            }
            entries.push((name.to_string(), port));
        }
        if entries.is_empty() {
            return Err(bad("no device named"));
        }
        if exclude {
            if let Some((name, Some(p))) = entries.iter().find(|(_, p)| p.is_some()) {
                return Err(bad(&format!(
                    "{name}:{p}: an exclusion list leaves out whole devices; drop the port"
                )));
            }
        }
        Ok(HcaList {
            exclude,
            exact,
            entries,
        })
    }

    fn matches(&self, entry: &str, device: &str) -> bool {
        if self.exact {
            device == entry
        } else {
            device.starts_with(entry)
        }
    }

    /// The devices of `present` (in the system's order) this list allows, in the order to try,
    /// each with the port its entry names.
    pub fn order(&self, present: &[String]) -> Vec<(String, Option<u8>)> {
        if self.exclude {
            return present
                .iter()
                .filter(|d| !self.entries.iter().any(|(e, _)| self.matches(e, d)))
                .map(|d| (d.clone(), None))
                .collect();
        }
        let mut out: Vec<(String, Option<u8>)> = Vec::new();
        for (e, port) in &self.entries {
            for d in present.iter().filter(|d| self.matches(e, d)) {
                if !out.iter().any(|(o, p)| o == d && p == port) {
                    out.push((d.clone(), *port));
                }
            }
        }
        out
    }
}

/// Makes registered memory safe across `fork()` (a data-loader worker, a `Command`) before the
/// first verbs object exists: libibverbs then keeps registered pages out of children (kernels
/// since 5.13 copy them on fork and need nothing; the call then changes nothing).
fn fork_safe() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        // SAFETY: no arguments; called once, before any other verbs call of this process's
        // (every device access starts from device_list), as libibverbs asks. Its failure only
        // means fork is not made safe: the same as not calling it.
        let _ = unsafe { rdma_mummy_sys::ibv_fork_init() };
    });
}

/// One port of one device, as listed.
#[derive(Debug, Clone)]
#[cfg_attr(not(feature = "unstable"), allow(dead_code))]
pub struct PortInfo {
    /// Device name.
    pub device: String,
    /// Port number.
    pub port: u8,
    /// Whether the port is ACTIVE.
    pub active: bool,
    /// InfiniBand or Ethernet.
    pub link_layer: &'static str,
    /// The port's LID (InfiniBand).
    pub lid: u16,
    /// Active MTU in bytes.
    pub mtu: usize,
    /// The GID table: (index, gid, is RoCE v2).
    pub gids: Vec<(u32, Gid, bool)>,
}

/// The device, port and GID this rank will use.
#[derive(Debug, Clone)]
pub struct Selected {
    /// Device name.
    pub device: String,
    /// Port number.
    pub port: u8,
    /// GID index (meaningful on Ethernet; 0 on InfiniBand).
    pub gid_index: u32,
    /// The GID.
    pub gid: Gid,
    /// The port's LID.
    pub lid: u16,
    /// Whether the link layer is Ethernet (RoCE): then the GRH is required.
    pub ethernet: bool,
    /// The active MTU.
    pub mtu: Mtu,
}

/// Opens the device list; "no RDMA here" (ENOSYS, EOPNOTSUPP, no libibverbs, empty) is [`Error::NoDevice`].
fn device_list() -> Result<DeviceList> {
    fork_safe();
    match DeviceList::new() {
        Ok(list) if list.is_empty() => Err(Error::NoDevice(
            "libibverbs lists no RDMA device (load a driver, or create a soft-RoCE device: tools/setup-rxe)".into(),
        )),
        Ok(list) => Ok(list),
        Err(e) => {
            let io = match &e.0 {
                GetDeviceListErrorKind::Ibverbs(io) => io,
                #[allow(unreachable_patterns)]
                _ => return Err(Error::NoDevice(format!("listing RDMA devices failed: {e}"))),
            };
            let why = match io.raw_os_error() {
                Some(libc::ENOSYS) => "the kernel has no RDMA support (ENOSYS)".to_string(),
                Some(libc::EOPNOTSUPP) => {
                    "libibverbs is not installed or has no provider (EOPNOTSUPP): install rdma-core and ibverbs-providers".to_string()
                }
                _ => format!("listing RDMA devices failed: {io}"),
            };
            Err(Error::NoDevice(why))
        }
    }
}

/// An MTU in bytes.
pub(crate) fn mtu_bytes(m: Mtu) -> usize {
    match m {
        Mtu::Mtu256 => 256,
        Mtu::Mtu512 => 512,
        Mtu::Mtu1024 => 1024,
        Mtu::Mtu2048 => 2048,
        Mtu::Mtu4096 => 4096,
    }
}

/// Lists every device's ports and GIDs (for tools and diagnostics).
pub fn list_ports() -> Result<Vec<PortInfo>> {
    let list = device_list()?;
    let mut out = Vec::new();
    for dev in list.iter() {
        let name = dev.name();
        let ctx = dev.open().map_err(|e| Error::Verbs {
            op: "open device",
            detail: format!("{name}: {e}"),
            source: Some(Box::new(e)),
        })?;
        out.extend(ports_of(&name, &ctx)?);
    }
    Ok(out)
}

fn ports_of(name: &str, ctx: &Arc<DeviceContext>) -> Result<Vec<PortInfo>> {
    let attr = ctx.query_device().map_err(|e| Error::Verbs {
        op: "query device",
        detail: format!("{name}: {e}"),
        source: Some(Box::new(e)),
    })?;
    let mut out = Vec::new();
    for port in 1..=attr.phys_port_cnt() {
        let pa = ctx.query_port(port).map_err(|e| Error::Verbs {
            op: "query port",
            detail: format!("{name} port {port}: {e}"),
            source: Some(Box::new(e)),
        })?;
        let ethernet = pa.link_layer() == LinkLayer::Ethernet;
        let mut gids = Vec::new();
        for idx in 0..pa.gid_tbl_len().max(0) as u32 {
            let Ok(gid) = ctx.query_gid(port, idx) else {
                continue;
            };
            if gid.is_zero() {
                continue;
            }
            let v2 = ethernet
                && ctx
                    .query_gid_type(port, idx)
                    .is_ok_and(|t| t == GID_TYPE_SYSFS_ROCE_V2);
            gids.push((idx, gid, v2));
        }
        out.push(PortInfo {
            device: name.to_string(),
            port,
            active: pa.port_state() == PortState::Active,
            link_layer: if ethernet { "Ethernet" } else { "InfiniBand" },
            lid: pa.lid(),
            mtu: mtu_bytes(pa.active_mtu()),
            gids,
        });
    }
    Ok(out)
}

fn is_ipv4_mapped(g: &Gid) -> bool {
    g.raw[..10].iter().all(|&b| b == 0) && g.raw[10] == 0xff && g.raw[11] == 0xff
}

/// Picks the GID index on an Ethernet port by NCCL's preference.
fn pick_gid(gids: &[(u32, Gid, bool)]) -> Option<(u32, Gid)> {
    let by = |f: &dyn Fn(&(u32, Gid, bool)) -> bool| gids.iter().find(|e| f(e)).map(|e| (e.0, e.1));
    by(&|e| e.2 && is_ipv4_mapped(&e.1))
        .or_else(|| by(&|e| e.2 && !e.1.is_unicast_link_local()))
        .or_else(|| by(&|e| !e.1.is_unicast_link_local()))
        .or_else(|| by(&|_| true))
}

/// Opens the chosen (or the first usable) device and resolves port and GID.
pub fn open(choice: &DeviceChoice) -> Result<(Arc<DeviceContext>, Selected)> {
    let list = device_list()?;
    let devs: Vec<_> = list.iter().collect();
    let names: Vec<String> = devs.iter().map(|d| d.name()).collect();
    // The devices to try, in order, each with the port it must use (if any).
    let tries: Vec<(usize, Option<u8>)> = match &choice.hca {
        Some(hca) => {
            let allowed = hca.order(&names);
            if allowed.is_empty() {
                return Err(Error::NoDevice(format!(
                    "RDMACOMM_IB_HCA allows none of the devices present: {names:?}"
                )));
            }
            // Local rank i starts at the i-th allowed device and falls back to the next ones.
            let k = allowed.len();
            (0..k)
                .map(|j| &allowed[(choice.local_rank + j) % k])
                .map(|(d, p)| (names.iter().position(|n| n == d).expect("present"), *p))
                .collect()
        }
        None => (0..devs.len()).map(|i| (i, None)).collect(),
    };
    let mut problems = Vec::new();
    for (i, want_port) in tries {
        let (dev, name) = (&devs[i], names[i].clone());
        if choice.device.as_ref().is_some_and(|d| d != &name) {
            continue;
        }
        let ctx = dev.open().map_err(|e| Error::Verbs {
            op: "open device",
            detail: format!("{name}: {e}"),
            source: Some(Box::new(e)),
        })?;
        let ports = ports_of(&name, &ctx)?;
        for p in &ports {
            if choice.port.or(want_port).is_some_and(|want| want != p.port) {
                continue;
            }
            if !p.active {
                problems.push(format!("{name} port {} is not ACTIVE", p.port));
                continue;
            }
            let ethernet = p.link_layer == "Ethernet";
            let (gid_index, gid) = match choice.gid_index {
                Some(idx) => match p.gids.iter().find(|e| e.0 == idx) {
                    Some(e) => (e.0, e.1),
                    None => {
                        return Err(Error::Config(format!(
                        "RDMACOMM_GID_INDEX={idx}: {name} port {} has no such GID (valid: {:?}); \
                             see `ibv_devinfo -v` or `show_gids`",
                        p.port,
                        p.gids.iter().map(|e| e.0).collect::<Vec<_>>()
                    )))
                    }
                },
                None if !ethernet => (0, p.gids.first().map(|e| e.1).unwrap_or_default()),
                None => match pick_gid(&p.gids) {
                    Some(g) => g,
                    None => {
                        problems.push(format!(
                            "{name} port {} has no GID (is its netdev up with an IP address?)",
                            p.port
                        ));
                        continue;
                    }
                },
            };
            let pa = ctx.query_port(p.port).map_err(|e| Error::Verbs {
                op: "query port",
                detail: e.to_string(),
                source: None,
            })?;
            return Ok((
                ctx,
                Selected {
                    device: name,
                    port: p.port,
                    gid_index,
                    gid,
                    lid: p.lid,
                    ethernet,
                    mtu: pa.active_mtu(),
                },
            ));
        }
        if ports
            .iter()
            .all(|p| choice.port.is_some_and(|w| w != p.port))
        {
            problems.push(format!("{name} has no port {:?}", choice.port.unwrap_or(0)));
        }
    }
    if let Some(d) = &choice.device {
        if !names.contains(d) {
            return Err(Error::NoDevice(format!(
                "RDMACOMM_IB_DEVICE={d} is not among the devices present: {names:?}"
            )));
        }
    }
    Err(Error::NoDevice(format!(
        "no usable port: {}",
        problems.join("; ")
    )))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::Ipv6Addr;

    fn gid(a: &str) -> Gid {
        Gid::from(a.parse::<Ipv6Addr>().unwrap())
    }

    #[test]
    fn device_lists_as_nccl_ib_hca_writes_them() {
        let present: Vec<String> = ["mlx5_0", "mlx5_1", "mlx5_10", "rxe0"]
            .map(String::from)
            .into();
        let names = |spec: &str| -> Vec<(String, Option<u8>)> {
            HcaList::parse(spec).unwrap().order(&present)
        };
        let d = |n: &str, p: Option<u8>| (n.to_string(), p);
        assert_eq!(
            names("mlx5_1:1,rxe0"),
            vec![d("mlx5_1", Some(1)), d("mlx5_10", Some(1)), d("rxe0", None)],
            "names are prefixes"
        );
        assert_eq!(names("=mlx5_1"), vec![d("mlx5_1", None)]);
        assert_eq!(
            names("rxe0,mlx5_0"),
            vec![d("rxe0", None), d("mlx5_0", None)],
            "list order"
        );
        assert_eq!(names("^mlx5"), vec![d("rxe0", None)]);
        assert_eq!(
            names("^=mlx5_1"),
            vec![d("mlx5_0", None), d("mlx5_10", None), d("rxe0", None)]
        );
        assert!(names("=mlx5").is_empty());
        for bad in ["", "^", "mlx5_0:0", "mlx5_0:x", ":1", "^mlx5_0:1"] {
            let e = HcaList::parse(bad).unwrap_err().to_string();
            assert!(e.contains("RDMACOMM_IB_HCA="), "{bad:?}: {e}");
        }
    }

    #[test]
    fn gids_are_preferred_as_nccl_does() {
        let link_local = gid("fe80::1");
        let v4 = gid("::ffff:192.0.2.1");
        let global = gid("2001:db8::1");
        // (index, GID, RoCE v2): a v2 IPv4-mapped GID first, wherever it stands.
        let table = [
            (0, link_local, false),
            (1, link_local, true),
            (2, global, false),
            (3, global, true),
            (4, v4, false),
            (5, v4, true),
        ];
        assert_eq!(pick_gid(&table).map(|g| g.0), Some(5));
        // Then RoCE v2 not link-local, then any not link-local, then the first.
        assert_eq!(pick_gid(&table[..5]).map(|g| g.0), Some(3));
        assert_eq!(
            pick_gid(&[table[0], table[1], table[2], table[4]]).map(|g| g.0),
            Some(2)
        );
        assert_eq!(pick_gid(&table[..2]).map(|g| g.0), Some(0));
        assert!(pick_gid(&[]).is_none());
    }
}
