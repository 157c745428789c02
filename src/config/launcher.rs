//! Who this rank is, from the launcher's environment: rank, world size and coordinator
//! (rdmacomm's own variables, MLX's, torchrun's, Open MPI's, PMI's, Slurm's), the job's id, the
//! host's identity and the RDMA device asked for.

use super::{env, pair, parse_num, Discovery, Lookup};
use crate::error::{Error, Result};
use crate::verbs::DeviceChoice;

/// The job's identity from the launcher: `RDMACOMM_JOB_ID`, torchrun's `TORCHELASTIC_RUN_ID`,
/// Slurm's job and step ids, PMIx's namespace (Open MPI); empty when none is set. Ranks of
/// another job that reach this job's rendezvous are ignored.
pub fn job_id_from_env() -> String {
    job_id_from(&env)
}

pub(crate) fn job_id_from(get: Lookup) -> String {
    if let Some(v) = get("RDMACOMM_JOB_ID") {
        return v;
    }
    if let Some(v) = get("TORCHELASTIC_RUN_ID") {
        return format!("torchelastic:{v}");
    }
    if let Some(j) = get("SLURM_JOB_ID") {
        return format!("slurm:{j}.{}", get("SLURM_STEP_ID").unwrap_or_default());
    }
    if let Some(ns) = get("PMIX_NAMESPACE") {
        return format!("pmix:{ns}");
    }
    String::new()
}

/// This host's identity, as far as shared memory goes: the kernel's boot id, the host name, the
/// PID namespace and the user (an IP says nothing of which ranks share memory; a peer's memory
/// file opens only in its PID namespace and for its user, so containers that share a host name
/// and boot id but not a PID namespace are different hosts here).
pub fn host_id() -> String {
    let read = |p: &str| std::fs::read_to_string(p).unwrap_or_default();
    let pid_ns = std::fs::read_link("/proc/self/ns/pid")
        .map(|l| l.to_string_lossy().into_owned())
        .unwrap_or_default();
    let uid = crate::sys::uid();
    format!(
        "{}/{}/{pid_ns}/uid {uid}",
        read("/proc/sys/kernel/random/boot_id").trim(),
        read("/proc/sys/kernel/hostname").trim()
    )
}

/// The launcher's count of ranks on this host, if it gives one (see [`Config::local_world`]).
pub(crate) fn local_world_from_env(world_size: usize) -> Result<Option<usize>> {
    local_world_from(&env, world_size)
}

pub(crate) fn local_world_from(get: Lookup, world_size: usize) -> Result<Option<usize>> {
    for name in [
        "LOCAL_WORLD_SIZE",
        "OMPI_COMM_WORLD_LOCAL_SIZE",
        "MPI_LOCALNRANKS",
    ] {
        if let Some(v) = get(name) {
            return parse_num(name, &v).map(Some);
        }
    }
    Ok((get("SLURM_JOB_NUM_NODES").as_deref() == Some("1")).then_some(world_size))
}

/// Reads `RDMACOMM_IB_DEVICE`, `RDMACOMM_IB_PORT` and `RDMACOMM_GID_INDEX`.
pub fn device_from_env() -> Result<DeviceChoice> {
    let num =
        |name: &str| -> Result<Option<u32>> {
            match env(name) {
                Some(v) => v.trim().parse::<u32>().map(Some).map_err(|_| {
                    Error::Config(format!("{name}={v:?} is not a non-negative integer"))
                }),
                None => Ok(None),
            }
        };
    let port = match num("RDMACOMM_IB_PORT")? {
        Some(p) if (1..=255).contains(&p) => Some(p as u8),
        Some(p) => {
            return Err(Error::Config(format!(
                "RDMACOMM_IB_PORT={p}: ports are numbered from 1"
            )))
        }
        None => None,
    };
    let device = env("RDMACOMM_IB_DEVICE");
    let hca =
        match env("RDMACOMM_IB_HCA") {
            Some(_) if device.is_some() => return Err(Error::Config(
                "RDMACOMM_IB_DEVICE and RDMACOMM_IB_HCA are both set: name one device or a list"
                    .into(),
            )),
            Some(v) => Some(crate::verbs::HcaList::parse(&v)?),
            None => None,
        };
    Ok(DeviceChoice {
        device,
        port,
        gid_index: num("RDMACOMM_GID_INDEX")?,
        hca,
        local_rank: local_rank_from(&env)?,
    })
}

/// This rank's index among the ranks its launcher started on this host (torchrun's
/// `LOCAL_RANK`, Open MPI's `OMPI_COMM_WORLD_LOCAL_RANK`, MPICH's `MPI_LOCALRANKID`, Slurm's
/// `SLURM_LOCALID`); 0 when none says.
pub(crate) fn local_rank_from(get: Lookup) -> Result<usize> {
    for name in [
        "LOCAL_RANK",
        "OMPI_COMM_WORLD_LOCAL_RANK",
        "MPI_LOCALRANKID",
        "SLURM_LOCALID",
    ] {
        if let Some(v) = get(name) {
            return parse_num(name, &v);
        }
    }
    Ok(0)
}

/// The variables that name a rank, one per launcher [`identity_from`] knows.
pub(crate) const RANK_VARIABLES: [&str; 6] = [
    "RDMACOMM_RANK",
    "MLX_RANK",
    "RANK",
    "OMPI_COMM_WORLD_RANK",
    "PMI_RANK",
    "SLURM_PROCID",
];

/// This rank's identity from the launcher's variables as `get` reads them: rdmacomm's own,
/// torchrun's, Open MPI's, PMI's, then Slurm's; the coordinator from `RDMACOMM_COORDINATOR`,
/// else `MASTER_ADDR` and `MASTER_PORT` (29500).
pub(crate) fn identity_from(get: Lookup) -> Result<(usize, usize, String)> {
    let mut mlx_coordinator = None;
    let (rank, size) = if let Some(p) = pair(get, "RDMACOMM_RANK", "RDMACOMM_WORLD_SIZE")? {
        p
    } else if let Some(r) = get("MLX_RANK") {
        let path = get("MLX_HOSTFILE")
            .ok_or_else(|| Error::Config("MLX_RANK is set but MLX_HOSTFILE is not".to_string()))?;
        let text = std::fs::read_to_string(&path)
            .map_err(|e| Error::Config(format!("MLX_HOSTFILE={path}: {e}")))?;
        let (rank, size, c) = super::hostfile::identity(&r, &text)?;
        mlx_coordinator = Some(c);
        (rank, size)
    } else if let Some(p) = pair(get, "RANK", "WORLD_SIZE")? {
        p
    } else if let Some(p) = pair(get, "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE")? {
        p
    } else if let Some(p) = pair(get, "PMI_RANK", "PMI_SIZE")? {
        p
    } else {
        pair(get, "SLURM_PROCID", "SLURM_NTASKS")?.unwrap_or((0, 1))
    };
    let coordinator = match get("RDMACOMM_COORDINATOR") {
        Some(c) => c,
        None => match get("MASTER_ADDR") {
            Some(a) => {
                let port = get("MASTER_PORT").unwrap_or_else(|| "29500".into());
                // An IPv6 literal meets its port in brackets.
                if a.contains(':') && !a.starts_with('[') {
                    format!("[{a}]:{port}")
                } else {
                    format!("{a}:{port}")
                }
            }
            None if mlx_coordinator.is_some() => mlx_coordinator.unwrap_or_default(),
            None if size == 1 => String::new(),
            // Rank 0 publishes it in the launcher's store.
            None if get("PMIX_NAMESPACE").is_some() => String::new(),
            None => match slurm_coordinator(get)? {
                Some(c) => {
                    slurm_rank0_here(get, rank, &c)?;
                    c
                }
                None => {
                    return Err(Error::Config(format!(
                        "rank {rank} of {size}: no coordinator address, and no PMIx or Slurm \
                         launcher to learn it from; set RDMACOMM_COORDINATOR=host:port or \
                         MASTER_ADDR (and MASTER_PORT)"
                    )))
                }
            },
        },
    };
    Ok((rank, size, coordinator))
}

/// Under Slurm without PMIx: the step's first node (where rank 0 runs under Slurm's block
/// distribution) and `MASTER_PORT`, else a port in 20000..30000 derived from the job and step
/// ids (alike on every rank, apart for concurrent steps); `None` outside Slurm.
pub(crate) fn slurm_coordinator(get: Lookup) -> Result<Option<String>> {
    let Some(job) = get("SLURM_JOB_ID") else {
        return Ok(None);
    };
    let Some(list) = get("SLURM_STEP_NODELIST")
        .or_else(|| get("SLURM_JOB_NODELIST"))
        .or_else(|| get("SLURM_NODELIST"))
    else {
        return Ok(None);
    };
    let host = first_host(&list)
        .ok_or_else(|| Error::Config(format!("SLURM_STEP_NODELIST={list:?}: no host in it")))?;
    // Block, cyclic and plane distributions put rank 0 on the first node; an arbitrary one
    // (SLURM_HOSTFILE) may not: every rank says so instead of waiting on an empty address.
    if let Some(d) = get("SLURM_DISTRIBUTION").filter(|d| d.starts_with("arbitrary")) {
        return Err(Error::Config(format!(
            "SLURM_DISTRIBUTION={d}: rank 0 need not run on the step's first node ({host}), \
             where the ranks would look for it; set MASTER_ADDR to rank 0's host (and \
             MASTER_PORT), or launch with srun --mpi=pmix"
        )));
    }
    let port = match get("MASTER_PORT") {
        Some(p) => p,
        None => {
            let step = get("SLURM_STEP_ID").unwrap_or_default();
            let n = |v: &str| {
                v.bytes()
                    .fold(0u64, |h, b| h.wrapping_mul(31).wrapping_add(u64::from(b)))
            };
            let key = n(&job).wrapping_mul(1_000_003).wrapping_add(n(&step));
            (20000 + key % 10000).to_string()
        }
    };
    Ok(Some(format!("{host}:{port}")))
}

/// Rank 0 under Slurm's first-node address `coordinator`: fails, naming both, where Slurm says
/// this node (`SLURMD_NODENAME`) is another (the peers would wait on a node nobody listens on).
pub(crate) fn slurm_rank0_here(get: Lookup, rank: usize, coordinator: &str) -> Result<()> {
    let (Some(here), Some((first, _))) = (get("SLURMD_NODENAME"), coordinator.rsplit_once(':'))
    else {
        return Ok(());
    };
    let short = |h: &str| h.split('.').next().unwrap_or(h).to_string();
    if rank == 0 && short(&here) != short(first) {
        return Err(Error::Config(format!(
            "rank 0 runs on {here}, but the ranks look for it on the step's first node \
             ({first}); set MASTER_ADDR to {here} (and MASTER_PORT), or launch with srun \
             --mpi=pmix"
        )));
    }
    Ok(())
}

/// The first host of a Slurm host list (`node[01-04,07],gpu3` gives `node01`; a bracket in each
/// dimension, as in `rack[1-2]-n[3-4]`, gives its first value).
pub fn first_host(list: &str) -> Option<String> {
    let mut out = String::new();
    let mut chars = list.trim().chars();
    while let Some(c) = chars.next() {
        match c {
            ',' => break,
            '[' => {
                let inner: String = chars.by_ref().take_while(|&c| c != ']').collect();
                let first = inner.split([',', '-']).next()?.trim();
                if first.is_empty() {
                    return None;
                }
                out.push_str(first);
            }
            c => out.push(c),
        }
    }
    (!out.is_empty()).then_some(out)
}

/// How rank 0 is found when `coordinator` is what the identity gave.
pub(crate) fn discovery_from(get: Lookup, coordinator: &str, size: usize) -> Discovery {
    if size <= 1 {
        Discovery::Given
    } else if coordinator.is_empty() && get("PMIX_NAMESPACE").is_some() {
        Discovery::Pmix
    } else if get("RDMACOMM_COORDINATOR").is_none()
        && get("MASTER_ADDR").is_none()
        && slurm_coordinator(get).ok().flatten().as_deref() == Some(coordinator)
    {
        Discovery::Slurm
    } else {
        Discovery::Given
    }
}
