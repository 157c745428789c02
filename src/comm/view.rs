//! Shared views: a split whose communicators run over the link of the communicator they were
//! split from (no connections, buffers, rendezvous or side channel of their own), on its thread
//! and in one order with it (NCCL's `splitShare`).

use super::*;
use crate::collectives::subset::Subset;
use crate::transport::Props;
use std::sync::atomic::AtomicU16;

/// What makes a communicator a shared view of a link.
pub(super) struct View {
    /// Its number in its operations' descriptors, told apart from the link's other users'.
    pub(super) id: u16,
    /// The link's rank of each member, by this communicator's rank.
    pub(super) members: Vec<usize>,
    /// The members but this rank (link ranks): a collective's peers.
    others: Vec<usize>,
    /// The link as this communicator sees it.
    pub(super) props: Props,
    /// The thread that owns this view: it runs there, while that thread owns the link too.
    pub(super) owner: AtomicU64,
    /// Closed by a framework's adapter (`Comm::close`): this view refuses work, the link goes on.
    pub(super) closed: AtomicBool,
}

/// The highest view number a link has seen, per [`Core`] (a new view takes one past every
/// member's).
pub(super) type Views = AtomicU16;

impl View {
    /// The members `members` (link ranks, this rank being `members[me]`) of a link described
    /// by `link`, numbered `id`.
    fn new(id: u16, members: Vec<usize>, me: usize, link: &Props) -> View {
        // Hosts renumbered from 0 in the order the members meet them.
        let hosts = link.hosts.as_ref().map(|h| {
            let mut seen: Vec<usize> = Vec::new();
            members
                .iter()
                .map(|&m| {
                    let host = h.get(m).copied().unwrap_or(usize::MAX);
                    match seen.iter().position(|&x| x == host) {
                        Some(i) => i,
                        None => {
                            seen.push(host);
                            seen.len() - 1
                        }
                    }
                })
                .collect::<Vec<usize>>()
        });
        // Members all on this host are all reached through its shared memory, alike.
        let one_host = hosts.as_ref().is_some_and(|h| h.iter().all(|&x| x == 0));
        let props = Props {
            rank: me,
            size: members.len(),
            hosts: hosts.filter(|_| !one_host),
            shares_memory: link.shares_memory || one_host,
            medium: if one_host {
                crate::transport::Medium::SharedMemory
            } else {
                link.medium
            },
            ..link.clone()
        };
        let others = members
            .iter()
            .enumerate()
            .filter(|&(i, _)| i != me)
            .map(|(_, &m)| m)
            .collect();
        View {
            id,
            members,
            others,
            props,
            owner: AtomicU64::new(this_thread()),
            closed: AtomicBool::new(false),
        }
    }

    /// A link rank for member `r` (a rank past the members maps past the link's, which an
    /// operation's peers skip; arguments were checked before).
    pub(super) fn link_rank(&self, r: usize) -> usize {
        self.members.get(r).copied().unwrap_or(usize::MAX)
    }

    /// `scope` (in this view's ranks) in the link's ranks; `lists` holds a batch's.
    pub(super) fn scope<'a>(
        &'a self,
        scope: Partners<'_>,
        lists: &'a mut (Vec<usize>, Vec<usize>),
    ) -> Partners<'a> {
        match scope {
            Partners::All => Partners::Peers {
                to: &self.others,
                from: &self.others,
            },
            Partners::To(p) => Partners::To(self.link_rank(p)),
            Partners::From(p) => Partners::From(self.link_rank(p)),
            Partners::Peers { to, from } => {
                lists.0 = to.iter().map(|&p| self.link_rank(p)).collect();
                lists.1 = from.iter().map(|&p| self.link_rank(p)).collect();
                Partners::Peers {
                    to: &lists.0,
                    from: &lists.1,
                }
            }
        }
    }

    /// The link, as this view's operations see it.
    pub(super) fn over<'a>(&'a self, link: &'a mut dyn Link) -> Subset<'a> {
        Subset::with_props(link, &self.members, &self.props)
    }
}

impl Comm {
    /// Splits into subgroups as [`Comm::split_comm`] does, each a *shared view* of this
    /// communicator's link: no connection, buffer, rendezvous or side channel of its own, made in
    /// one all_gather. The price is order: a view runs on the thread that owns this
    /// communicator, and every rank must call this communicator's and its views' operations in
    /// one order (as on one communicator; a rank that does not is named by the descriptor
    /// check, never misread). Views refuse [`Comm::overlap`], and while this communicator has
    /// one open, their calls run its started operations first. A failure of any ends all that
    /// share the link; errors name ranks of the link. Either may be dropped first. Collective
    /// over every rank of this communicator; `color < 0` gives a world of one.
    pub fn split_shared(&self, color: i32, key: i32) -> Result<Comm> {
        if self.size == 1 {
            self.alone("split_shared")?;
            return Ok(Comm::with_link_of(self.cfg.clone(), None, self.algorithm()));
        }
        self.check_thread(&"split_shared")?;
        let n = self.size;
        let last = self.core.views.load(Ordering::Relaxed);
        let mut mine = [0u8; 12];
        mine[..4].copy_from_slice(&color.to_le_bytes());
        mine[4..8].copy_from_slice(&key.to_le_bytes());
        mine[8..].copy_from_slice(&u32::from(last).to_le_bytes());
        let mut all = vec![0u8; 12 * n];
        self.split_step(5, &mine, &mut all)?;
        let word = |q: usize, i: usize| {
            u32::from_le_bytes(all[12 * q + 4 * i..12 * q + 4 * i + 4].try_into().unwrap())
        };
        // One past every rank's last: no rank's link carries that number yet.
        let id = (0..n).map(|q| word(q, 2)).max().unwrap_or(0) + 1;
        let id = u16::try_from(id).map_err(|_| {
            Error::InvalidArgument(format!(
                "split_shared: this link has carried {} shared views, the most a descriptor \
                 numbers; use split_comm",
                u16::MAX
            ))
        })?;
        self.core.views.fetch_max(id, Ordering::Relaxed);
        let mut members: Vec<usize> = if color < 0 {
            vec![self.rank]
        } else {
            (0..n).filter(|&q| word(q, 0) as i32 == color).collect()
        };
        members.sort_by_key(|&q| (word(q, 1) as i32, q));
        let me = members
            .iter()
            .position(|&q| q == self.rank)
            .expect("a member of its own group");
        let mut cfg = self.cfg.clone();
        cfg.rank = me;
        cfg.world_size = members.len();
        if members.len() == 1 {
            return Ok(Comm::with_link_of(cfg, None, self.algorithm()));
        }
        let members: Vec<usize> = members.iter().map(|&q| self.link_rank(q)).collect();
        let props = {
            let g = self.lock();
            let link = g
                .link
                .as_ref()
                .ok_or_else(|| Error::Poisoned(format!("rank {} has no link", self.rank)))?;
            link.props().clone()
        };
        let view = View::new(id, members, me, &props);
        log::info!(
            "rank {me} of {}: shared view {id} of a link of {} ranks (this rank its {}): no \
             connection or buffer of its own",
            view.members.len(),
            props.size,
            view.members[me]
        );
        let medium = view.props.medium;
        Ok(Comm {
            rank: me,
            size: view.members.len(),
            core: self.core.clone(),
            layout: view
                .props
                .hosts
                .as_deref()
                .and_then(|h| hier::Layout::of(h, me)),
            view: Some(view),
            me: self.me.clone(),
            algo: Mutex::new(self.algorithm()),
            medium: Some(medium),
            peers_max: self.peers_max,
            described: self.described.clone(),
            rejoined: self.rejoined,
            cfg,
        })
    }

    /// A shared view of every rank ([`Comm::split_shared`] with one color): no connection or
    /// buffer of its own, on this communicator's thread and in one order with it.
    pub fn dup_shared(&self) -> Result<Comm> {
        self.split_shared(0, self.rank as i32)
    }

    /// Whether this is a shared view ([`Comm::split_shared`]).
    pub(crate) fn is_shared_view(&self) -> bool {
        self.view.is_some()
    }

    /// The link's rank of this communicator's rank `r`.
    pub(super) fn link_rank(&self, r: usize) -> usize {
        self.view.as_ref().map_or(r, |v| v.link_rank(r))
    }
}
