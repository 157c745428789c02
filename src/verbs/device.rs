//! Device discovery and the choice of device, port and GID.
//!
//! Defaults work without tuning: the first device with an ACTIVE port; on InfiniBand GID 0 and the
//! port's LID; on Ethernet (RoCE, rxe) a RoCE v2 GID whose address is IPv4-mapped, then any RoCE v2
//! GID that is not link-local, then any non-zero GID (NCCL's preference). Overrides:
//! `RDMACOMM_IB_DEVICE`, `RDMACOMM_IB_PORT`, `RDMACOMM_GID_INDEX`.

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

fn mtu_bytes(m: Mtu) -> usize {
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
        })?;
        out.extend(ports_of(&name, &ctx)?);
    }
    Ok(out)
}

fn ports_of(name: &str, ctx: &Arc<DeviceContext>) -> Result<Vec<PortInfo>> {
    let attr = ctx.query_device().map_err(|e| Error::Verbs {
        op: "query device",
        detail: format!("{name}: {e}"),
    })?;
    let mut out = Vec::new();
    for port in 1..=attr.phys_port_cnt() {
        let pa = ctx.query_port(port).map_err(|e| Error::Verbs {
            op: "query port",
            detail: format!("{name} port {port}: {e}"),
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
    let mut names = Vec::new();
    let mut problems = Vec::new();
    for dev in list.iter() {
        let name = dev.name();
        names.push(name.clone());
        if choice.device.as_ref().is_some_and(|d| d != &name) {
            continue;
        }
        let ctx = dev.open().map_err(|e| Error::Verbs {
            op: "open device",
            detail: format!("{name}: {e}"),
        })?;
        let ports = ports_of(&name, &ctx)?;
        for p in &ports {
            if choice.port.is_some_and(|want| want != p.port) {
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
