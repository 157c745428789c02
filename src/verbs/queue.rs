//! Completion queues (polled without allocation) and reliable-connected queue pairs.

use crate::error::{Error, Result};
use crate::verbs::device::Selected;
use rdma_mummy_sys::{
    ibv_ack_cq_events, ibv_cq, ibv_get_cq_event, ibv_poll_cq, ibv_post_recv, ibv_post_send,
    ibv_recv_wr, ibv_req_notify_cq, ibv_resize_cq, ibv_send_flags, ibv_send_wr, ibv_sge, ibv_wc,
    ibv_wr_opcode, rdma_t,
};
use sideway::ibverbs::address::{AddressHandleAttribute, Gid};
use sideway::ibverbs::completion::{BasicCompletionQueue, CompletionChannel, CompletionQueue as _};
use sideway::ibverbs::device_context::{DeviceContext, Mtu};
use sideway::ibverbs::protection_domain::ProtectionDomain;
use sideway::ibverbs::queue_pair::{
    BasicQueuePair, QueuePair, QueuePairAttribute, QueuePairAttributeMask, QueuePairBuilder,
    QueuePairState,
};
use sideway::ibverbs::AccessFlags;
use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::time::Duration;

/// One work completion, copied out of the CQ.
#[derive(Debug, Clone, Copy)]
pub struct Completion {
    /// The work request's id.
    pub wr_id: u64,
    /// `ibv_wc_status` (0 = success).
    pub status: u32,
    /// Bytes received (receive completions).
    pub byte_len: u32,
    /// The immediate (host order; senders post it big-endian).
    pub imm: u32,
    /// The queue pair it completed on (valid for failed completions too).
    pub qp_num: u32,
}

/// A completion queue polled in batches into a preallocated array (the basic CQ: extended CQs
/// are broken on rxe before rdma-core 55).
pub struct CompletionQueue {
    cq: Arc<BasicCompletionQueue>,
    wcs: Vec<ibv_wc>,
    /// Where this CQ's events arrive (none where the device gave no channel: waits nap).
    channel: Option<Arc<CompletionChannel>>,
    /// An event was asked for and has not come.
    armed: bool,
    /// Completions it has room for, at least.
    depth: u32,
}

impl CompletionQueue {
    /// Creates a CQ with room for `depth` completions.
    pub fn new(ctx: &Arc<DeviceContext>, depth: u32) -> Result<Self> {
        // A non-blocking channel, so that a wait for its event is a bounded poll(2).
        let channel = CompletionChannel::new(ctx)
            .ok()
            .filter(|c| c.set_nonblocking(true).is_ok());
        let mut builder = ctx.create_cq_builder();
        builder.setup_cqe(depth);
        if let Some(c) = &channel {
            builder.setup_comp_channel(c, 0);
        }
        let cq = builder.build().map_err(|e| Error::Verbs {
            op: "create completion queue",
            detail: e.to_string(),
            source: Some(Box::new(e)),
        })?;
        // SAFETY: ibv_wc is plain old data; zero is a valid bit pattern.
        let wcs = (0..64)
            .map(|_| unsafe { std::mem::zeroed::<ibv_wc>() })
            .collect();
        Ok(CompletionQueue {
            cq,
            wcs,
            channel,
            armed: false,
            depth,
        })
    }

    /// Makes room for at least `depth` completions, resizing the CQ where it has less (its
    /// completions and queue pairs stay).
    pub fn reserve(&mut self, depth: u32) -> Result<()> {
        if depth <= self.depth {
            return Ok(());
        }
        // SAFETY: the CQ is alive (we hold its Arc); a resize keeps what it holds.
        let rc = unsafe { ibv_resize_cq(self.cq.cq().as_ptr(), depth.min(i32::MAX as u32) as i32) };
        if rc != 0 {
            return Err(Error::Verbs {
                op: "resize completion queue",
                detail: format!(
                    "to {depth} entries from {}: {}",
                    self.depth,
                    std::io::Error::from_raw_os_error(rc.abs())
                ),
                source: None,
            });
        }
        self.depth = depth;
        Ok(())
    }

    /// Completions it has room for, at least.
    pub fn depth(&self) -> u32 {
        self.depth
    }

    /// Which CQ this is, as its async events name it (its address).
    pub fn id(&self) -> usize {
        // SAFETY: the CQ is alive (we hold its Arc); only its address is taken.
        unsafe { self.cq.cq() }.as_ptr() as usize
    }

    /// The descriptor its events make readable (none without a completion channel).
    pub fn event_fd(&self) -> Option<std::os::fd::RawFd> {
        self.channel.as_ref().map(|c| c.as_raw_fd())
    }

    /// Asks for an event at the next completion; whether this CQ has events. Poll once more
    /// before [`CompletionQueue::block`]: a completion that came before the request raises none.
    pub fn arm(&mut self) -> Result<bool> {
        if self.channel.is_none() {
            return Ok(false);
        }
        if !self.armed {
            // SAFETY: the CQ is alive (we hold its Arc) and has a completion channel.
            let rc = unsafe { ibv_req_notify_cq(self.cq.cq().as_ptr(), 0) };
            if rc != 0 {
                return Err(Error::Verbs {
                    op: "request a completion event",
                    detail: std::io::Error::from_raw_os_error(rc).to_string(),
                    source: None,
                });
            }
            self.armed = true;
        }
        Ok(true)
    }

    /// Sleeps until the armed CQ's event or `limit` (just `limit` without a channel); whether
    /// an event came (it is acknowledged here, so the CQ can be destroyed at any time).
    pub fn block(&mut self, limit: Duration) -> Result<bool> {
        let Some(ch) = &self.channel else {
            std::thread::sleep(limit);
            return Ok(false);
        };
        let mut pfd = libc::pollfd {
            fd: ch.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        let ts = libc::timespec {
            tv_sec: limit.as_secs() as libc::time_t,
            tv_nsec: limit.subsec_nanos() as libc::c_long,
        };
        // SAFETY: one valid pollfd and a valid timeout; no signal mask.
        let n = unsafe { libc::ppoll(&mut pfd, 1, &ts, std::ptr::null()) };
        if n <= 0 {
            return Ok(false);
        }
        let mut cq: *mut ibv_cq = std::ptr::null_mut();
        let mut ctx: *mut std::ffi::c_void = std::ptr::null_mut();
        // SAFETY: the channel is alive and non-blocking (so this cannot block); the out
        // pointers are valid.
        let rc = unsafe { ibv_get_cq_event(ch.comp_channel().as_ptr(), &mut cq, &mut ctx) };
        if rc != 0 {
            return Ok(false);
        }
        // SAFETY: `cq` is the CQ the event was for (ours), alive; one event to acknowledge.
        unsafe { ibv_ack_cq_events(cq, 1) };
        self.armed = false;
        Ok(true)
    }

    /// The underlying CQ, for attaching QPs.
    pub fn handle(&self) -> Arc<BasicCompletionQueue> {
        Arc::clone(&self.cq)
    }

    /// Polls once; calls `f` for each completion. Returns how many there were.
    pub fn poll(&mut self, mut f: impl FnMut(Completion)) -> Result<usize> {
        // SAFETY: the CQ is alive (we hold its Arc); wcs has room for wcs.len() entries.
        let n = unsafe {
            ibv_poll_cq(
                self.cq.cq().as_ptr(),
                self.wcs.len() as i32,
                self.wcs.as_mut_ptr(),
            )
        };
        if n < 0 {
            return Err(Error::Verbs {
                op: "poll completion queue",
                detail: format!("returned {n}"),
                source: None,
            });
        }
        for wc in &self.wcs[..n as usize] {
            f(Completion {
                wr_id: wc.wr_id,
                status: wc.status,
                byte_len: wc.byte_len,
                // SAFETY: a union of two u32s; reading either is defined.
                imm: u32::from_be(unsafe { wc.imm_data_invalidated_rkey_union.imm_data }),
                qp_num: wc.qp_num,
            });
        }
        Ok(n as usize)
    }
}

/// `ibv_wc_status` in words, with a hint for the ones that mean "the peer is gone".
pub fn status_str(status: u32) -> String {
    let s = match status {
        0 => "success",
        1 => "local length error",
        2 => "local QP operation error",
        4 => "local protection error",
        5 => "work request flushed (the queue pair went to the error state)",
        7 => "bad response",
        8 => "local access error",
        9 => "remote invalid request",
        10 => "remote access error (bad rkey or address)",
        11 => "remote operation error",
        12 => "transport retry counter exceeded (the peer is unreachable or dead)",
        13 => "RNR retry counter exceeded (the peer posted no receive)",
        16 => "remote aborted",
        19 => "fatal error",
        20 => "response timeout",
        21 => "general error",
        _ => return format!("work completion status {status}"),
    };
    s.to_string()
}

/// What a peer needs to connect to one of our queue pairs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Endpoint {
    /// Queue pair number.
    pub qpn: u32,
    /// Initial packet sequence number of our send queue.
    pub psn: u32,
    /// Port LID (InfiniBand).
    pub lid: u16,
    /// Port GID.
    pub gid: [u8; 16],
    /// Active MTU, as the verbs enum value (1 = 256 .. 5 = 4096).
    pub mtu: u8,
}

impl Endpoint {
    /// Length of [`Endpoint::to_bytes`].
    pub const BYTES: usize = 32;

    /// The endpoint as sent to a peer: QP number, PSN, LID and MTU as little-endian u32s, then
    /// the GID.
    pub fn to_bytes(self) -> [u8; Self::BYTES] {
        let mut b = [0u8; Self::BYTES];
        b[0..4].copy_from_slice(&self.qpn.to_le_bytes());
        b[4..8].copy_from_slice(&self.psn.to_le_bytes());
        b[8..12].copy_from_slice(&u32::from(self.lid).to_le_bytes());
        b[12..16].copy_from_slice(&u32::from(self.mtu).to_le_bytes());
        b[16..].copy_from_slice(&self.gid);
        b
    }

    /// Reads what [`Endpoint::to_bytes`] wrote (the first [`Endpoint::BYTES`] of `b`); `None`
    /// if `b` is shorter.
    pub fn from_bytes(b: &[u8]) -> Option<Endpoint> {
        let b = b.get(..Self::BYTES)?;
        let u = |i: usize| u32::from_le_bytes(b[i..i + 4].try_into().expect("4 bytes"));
        Some(Endpoint {
            qpn: u(0),
            psn: u(4),
            lid: u(8) as u16,
            mtu: u(12) as u8,
            gid: b[16..].try_into().expect("16 bytes"),
        })
    }
}

/// The QP's timeout and retry settings. With `timeout` t and `retry` r, an unreachable peer is
/// reported (RETRY_EXC_ERR) after about (r+1) x 4.096 us x 2^t. Retry 7 would mean "forever" on
/// rxe, so at most 6 is used.
#[derive(Debug, Clone, Copy)]
pub struct RetryPolicy {
    /// Local ACK timeout exponent.
    pub timeout: u8,
    /// Transport retry count (0..=6 here; 7 is infinite on some providers).
    pub retry: u8,
}

impl RetryPolicy {
    /// Seconds until an unreachable peer is reported (RETRY_EXC_ERR).
    pub fn report_after(&self) -> f64 {
        (self.retry as f64 + 1.0) * 4.096e-6 * f64::from(1u32 << self.timeout)
    }

    /// The policy for a communicator whose waits time out after `limit`: timeout exponent 18
    /// (~1.07 s per try) and 6 retries, so an unreachable peer is reported in ~7.5 s (NCCL uses
    /// the same exponent), lowered until that fits in half of `limit`. `timeout` and `retry`
    /// (`RDMACOMM_IB_TIMEOUT`, `RDMACOMM_IB_RETRY`, validated by the config) override. (Dead
    /// processes are noticed sooner, through the side channel; a cut link at once, through
    /// local errors.)
    pub fn for_limit(limit: std::time::Duration, timeout: Option<u8>, retry: Option<u8>) -> Self {
        let retry = retry.unwrap_or(6).min(6);
        let mut p = RetryPolicy { timeout: 18, retry };
        if let Some(t) = timeout {
            p.timeout = t.clamp(1, 31);
            return p;
        }
        while p.timeout > 12 && p.report_after() > limit.as_secs_f64() / 2.0 {
            p.timeout -= 1;
        }
        p
    }
}

impl Default for RetryPolicy {
    fn default() -> Self {
        RetryPolicy::for_limit(std::time::Duration::from_secs(30), None, None)
    }
}

fn mtu_from_u8(v: u8) -> Mtu {
    match v {
        1 => Mtu::Mtu256,
        2 => Mtu::Mtu512,
        3 => Mtu::Mtu1024,
        4 => Mtu::Mtu2048,
        _ => Mtu::Mtu4096,
    }
}

/// A reliable-connected queue pair.
pub struct RcQueuePair {
    qp: BasicQueuePair,
    sel: Selected,
    psn: u32,
}

/// Largest payload we post inline.
pub const MAX_INLINE: u32 = 64;

/// Most gather entries in one write (a header from our buffer, then the data).
pub const MAX_SGE: usize = 2;

/// One local range of a write: `len` bytes at `addr` in the memory region of `lkey`.
#[derive(Debug, Clone, Copy)]
pub struct Sge {
    /// The local key of the region holding the range.
    pub lkey: u32,
    /// The range's address.
    pub addr: u64,
    /// Its length.
    pub len: u32,
}

impl RcQueuePair {
    /// Creates an RC QP on `cq` (send and receive) and moves it to INIT.
    pub fn new(
        pd: &Arc<ProtectionDomain>,
        cq: &CompletionQueue,
        sel: &Selected,
        send_depth: u32,
        recv_depth: u32,
    ) -> Result<Self> {
        let mut b = QueuePairBuilder::new(pd);
        b.setup_send_cq(cq.handle())
            .setup_recv_cq(cq.handle())
            .setup_max_send_wr(send_depth)
            .setup_max_recv_wr(recv_depth)
            .setup_max_send_sge(MAX_SGE as u32)
            .setup_max_recv_sge(1)
            .setup_max_inline_data(MAX_INLINE);
        let mut qp = b.build().map_err(|e| Error::Verbs {
            op: "create queue pair",
            detail: e.to_string(),
            source: Some(Box::new(e)),
        })?;
        let mut attr = QueuePairAttribute::new();
        attr.setup_state(QueuePairState::Init)
            .setup_pkey_index(0)
            .setup_port(sel.port)
            .setup_access_flags(AccessFlags::LocalWrite | AccessFlags::RemoteWrite);
        qp.modify(&attr).map_err(|e| Error::Verbs {
            op: "modify QP to INIT",
            detail: e.to_string(),
            source: Some(Box::new(e)),
        })?;
        // A PSN from the clock and the QP number: different per QP and per run.
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.subsec_nanos())
            .unwrap_or(0);
        let psn = (nanos ^ qp.qp_number().wrapping_mul(2654435761)) & 0xff_ffff;
        Ok(RcQueuePair {
            qp,
            sel: sel.clone(),
            psn,
        })
    }

    /// Our endpoint, to send to the peer.
    pub fn endpoint(&self) -> Endpoint {
        Endpoint {
            qpn: self.qp.qp_number(),
            psn: self.psn,
            lid: self.sel.lid,
            gid: self.sel.gid.raw,
            mtu: self.sel.mtu as u8,
        }
    }

    /// Moves the QP through RTR to RTS, connected to `remote`.
    pub fn connect(&mut self, remote: &Endpoint, policy: RetryPolicy) -> Result<()> {
        let mtu = mtu_from_u8(remote.mtu.min(self.sel.mtu as u8));
        let mut attr = QueuePairAttribute::new();
        attr.setup_state(QueuePairState::ReadyToReceive)
            .setup_path_mtu(mtu)
            .setup_dest_qp_num(remote.qpn)
            .setup_rq_psn(remote.psn)
            .setup_max_dest_read_atomic(1)
            .setup_min_rnr_timer(1);
        let mut ah = AddressHandleAttribute::new();
        ah.setup_dest_lid(remote.lid)
            .setup_port(self.sel.port)
            .setup_service_level(0);
        if self.sel.ethernet || remote.lid == 0 {
            ah.setup_grh_src_gid_index(self.sel.gid_index as u8)
                .setup_grh_dest_gid(&Gid { raw: remote.gid })
                .setup_grh_hop_limit(64);
        }
        attr.setup_address_vector(&ah);
        self.qp.modify(&attr).map_err(|e| Error::Verbs {
            op: "modify QP to RTR",
            detail: e.to_string(),
            source: Some(Box::new(e)),
        })?;
        let mut attr = QueuePairAttribute::new();
        attr.setup_state(QueuePairState::ReadyToSend)
            .setup_sq_psn(self.psn)
            .setup_timeout(policy.timeout)
            .setup_retry_cnt(policy.retry.min(6))
            .setup_rnr_retry(6)
            .setup_max_read_atomic(1);
        self.qp.modify(&attr).map_err(|e| Error::Verbs {
            op: "modify QP to RTS",
            detail: e.to_string(),
            source: Some(Box::new(e)),
        })
    }

    /// Posts an RDMA WRITE of the local ranges `sges` (at most [`MAX_SGE`], each in the MR of
    /// its lkey), gathered in order, to the peer's `remote_addr` (in its MR of `rkey`), with an
    /// immediate when `imm` is set. Up to [`MAX_INLINE`] bytes in all go inline (copied at post
    /// time). No allocation.
    ///
    /// # Safety
    /// The local ranges must stay valid and unmodified, and the remote range must belong to the
    /// peer's registered buffer, until this work request completes.
    pub unsafe fn post_write(
        &mut self,
        wr_id: u64,
        sges: &[Sge],
        rkey: u32,
        remote_addr: u64,
        imm: Option<u32>,
        signaled: bool,
    ) -> Result<()> {
        assert!(sges.len() <= MAX_SGE, "at most {MAX_SGE} gather entries");
        let mut list = [ibv_sge {
            addr: 0,
            length: 0,
            lkey: 0,
        }; MAX_SGE];
        let mut m = 0;
        let mut len = 0u32;
        for s in sges.iter().filter(|s| s.len > 0) {
            list[m] = ibv_sge {
                addr: s.addr,
                length: s.len,
                lkey: s.lkey,
            };
            len += s.len;
            m += 1;
        }
        // SAFETY: an all-zero ibv_send_wr is valid (null pointers, zero unions); fields set below.
        let mut wr: ibv_send_wr = unsafe { std::mem::zeroed() };
        wr.wr_id = wr_id;
        if m > 0 {
            wr.sg_list = list.as_mut_ptr();
            wr.num_sge = m as i32;
        }
        wr.opcode = if imm.is_some() {
            ibv_wr_opcode::IBV_WR_RDMA_WRITE_WITH_IMM
        } else {
            ibv_wr_opcode::IBV_WR_RDMA_WRITE
        };
        let mut flags = 0;
        if signaled {
            flags |= ibv_send_flags::IBV_SEND_SIGNALED.0;
        }
        if len > 0 && len <= MAX_INLINE {
            flags |= ibv_send_flags::IBV_SEND_INLINE.0;
        }
        wr.send_flags = flags;
        wr.imm_data_invalidated_rkey_union.imm_data = imm.unwrap_or(0).to_be();
        wr.wr.rdma = rdma_t { remote_addr, rkey };
        let mut bad: *mut ibv_send_wr = std::ptr::null_mut();
        // SAFETY: the QP is alive (owned by self); wr and the gather list live on this stack
        // frame for the call (inline data is copied during it); the caller guarantees the
        // ranges (see above).
        let rc = unsafe { ibv_post_send(self.qp.qp().as_ptr(), &mut wr, &mut bad) };
        if rc != 0 {
            let why = match rc {
                libc::ENOMEM => "send queue full".to_string(),
                e => std::io::Error::from_raw_os_error(e).to_string(),
            };
            return Err(Error::Verbs {
                op: "post RDMA write",
                detail: why,
                source: None,
            });
        }
        Ok(())
    }

    /// Posts a receive with no buffer: it only takes a WRITE_WITH_IMM's immediate.
    pub fn post_recv(&mut self, wr_id: u64) -> Result<()> {
        let mut wr = ibv_recv_wr {
            wr_id,
            next: std::ptr::null_mut(),
            sg_list: std::ptr::null_mut(),
            num_sge: 0,
        };
        let mut bad: *mut ibv_recv_wr = std::ptr::null_mut();
        // SAFETY: the QP is alive (owned by self); wr is valid for the call and has no SGE.
        let rc = unsafe { ibv_post_recv(self.qp.qp().as_ptr(), &mut wr, &mut bad) };
        if rc != 0 {
            let e = std::io::Error::from_raw_os_error(rc);
            return Err(Error::Verbs {
                op: "post receive",
                detail: e.to_string(),
                source: Some(Box::new(e)),
            });
        }
        Ok(())
    }

    /// The QP's real state, queried from the device (the cached one can be stale).
    pub fn query_state(&self) -> Result<QueuePairState> {
        let (attr, _) = self
            .qp
            .query(QueuePairAttributeMask::State)
            .map_err(|e| Error::Verbs {
                op: "query QP",
                detail: e.to_string(),
                source: Some(Box::new(e)),
            })?;
        Ok(attr.state())
    }

    /// Moves the QP to the error state: every outstanding work request is flushed.
    #[cfg_attr(not(feature = "unstable"), allow(dead_code))]
    pub fn set_error(&mut self) {
        let mut attr = QueuePairAttribute::new();
        attr.setup_state(QueuePairState::Error);
        let _ = self.qp.modify(&attr);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoint_bytes_round_trip_and_short_input_is_refused() {
        let e = Endpoint {
            qpn: 0x0012_3456,
            psn: 0x00ab_cdef,
            lid: 0xbeef,
            gid: std::array::from_fn(|i| (i * 17 + 3) as u8),
            mtu: 5,
        };
        let b = e.to_bytes();
        assert_eq!(Endpoint::from_bytes(&b), Some(e));
        // The layout peers of other builds read: u32 LE fields, then the GID.
        assert_eq!(&b[0..4], &0x0012_3456u32.to_le_bytes());
        assert_eq!(&b[8..12], &0xbeefu32.to_le_bytes());
        assert_eq!(&b[16..], &e.gid);
        assert_eq!(Endpoint::from_bytes(&b[..Endpoint::BYTES - 1]), None);
    }
}
