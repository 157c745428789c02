//! What a new communicator logs at `info` (the `NCCL_DEBUG=INFO` of rdmacomm).

use super::*;

/// Each rank's summary of a new communicator at `info` (as `NCCL_DEBUG=INFO` prints), and rank
/// 0's line for the job.
pub(super) fn summarise(
    cfg: &Config,
    (local, nlocal): (usize, usize),
    described: &str,
    algo: Algo,
    peers_max: usize,
    holds: crate::transport::Holdings,
) {
    if !log::log_enabled!(log::Level::Info) {
        return;
    }
    let peers = if peers_max == usize::MAX {
        "no peer bound".to_string()
    } else {
        format!("trees past {peers_max} peers")
    };
    if cfg.rank == 0 {
        let job = if cfg.job_id.is_empty() {
            "(no job id)".to_string()
        } else {
            format!("{:?}", cfg.job_id)
        };
        log::info!(
            "job {job}: {} ranks, coordinator {}, timeout {:?}, secret {}",
            cfg.world_size,
            cfg.coordinator,
            cfg.timeout,
            if cfg.secret.is_some() { "yes" } else { "no" }
        );
    }
    log::info!(
        "rank {} of {}: {described}; {nlocal} ranks on this host (local rank {local}), host id \
         {:?}; RDMA slots {} x {} B, TCP chunk {} B, zero-copy from {} B; all_reduce {algo:?} \
         (recursive doubling up to {} B), broadcast {:?}; all_to_all, gather and scatter: \
         {peers}; progress {:?}, polling {:?}; holds {holds}",
        cfg.rank,
        cfg.world_size,
        cfg.host_id,
        cfg.slots,
        cfg.slot_bytes,
        cfg.tcp_chunk,
        cfg.zero_copy_min,
        crate::collectives::DOUBLING_MAX_BYTES,
        cfg.bcast,
        cfg.progress,
        cfg.poll
    );
}

/// This process's resident memory, threads and open descriptors, for the `info` lines (from
/// /proc; empty where it is not mounted).
pub(super) fn process() -> String {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .map(|v| v.trim().to_string())
    };
    let fds = std::fs::read_dir("/proc/self/fd").map(|d| d.count());
    match (field("VmRSS:"), field("Threads:"), fds) {
        (Some(rss), Some(threads), Ok(fds)) => {
            format!("; the process: {rss} resident, {threads} threads, {fds} descriptors")
        }
        _ => String::new(),
    }
}
