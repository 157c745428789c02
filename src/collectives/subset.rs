//! Some ranks of a link seen as a link of their own: rank i of the subset is `ranks[i]` of the
//! link. The hierarchy's host and cross-host steps run over one, and so does every operation of
//! a shared view (`Comm::split_shared`).

use crate::error::{Peer, Result};
use crate::transport::op::{OpDesc, Partners};
use crate::transport::{Lending, Link, Props};
use std::borrow::Cow;

/// The ranks `ranks` of `link`, as a link.
pub(crate) struct Subset<'a> {
    link: &'a mut dyn Link,
    ranks: &'a [usize],
    props: Cow<'a, Props>,
}

impl<'a> Subset<'a> {
    /// The ranks `ranks` of `link`, this rank being `ranks[me]`, all reached alike.
    pub(crate) fn new(link: &'a mut dyn Link, ranks: &'a [usize], me: usize) -> Subset<'a> {
        let props = Props {
            takes_return_credits: link.props().takes_return_credits,
            relays: link.props().relays,
            window: link.props().window,
            ..Props::new(me, ranks.len(), link.props().max_chunk, link.props().medium)
        };
        Subset {
            link,
            ranks,
            props: Cow::Owned(props),
        }
    }

    /// The ranks `ranks` of `link` as `props` describe them (worked out once, by the caller).
    pub(crate) fn with_props(
        link: &'a mut dyn Link,
        ranks: &'a [usize],
        props: &'a Props,
    ) -> Subset<'a> {
        Subset {
            link,
            ranks,
            props: Cow::Borrowed(props),
        }
    }
}

impl Link for Subset<'_> {
    fn props(&self) -> &Props {
        &self.props
    }
    fn peer(&self, rank: usize) -> Peer {
        self.link.peer(self.ranks[rank])
    }
    fn try_post(&mut self, peer: usize, data: &[u8]) -> Result<bool> {
        self.link.try_post(self.ranks[peer], data)
    }
    fn try_take(&mut self, peer: usize, f: &mut dyn FnMut(&[u8]) -> Result<()>) -> Result<bool> {
        self.link.try_take(self.ranks[peer], f)
    }
    fn try_take_into(&mut self, peer: usize, dst: &mut [u8]) -> Result<bool> {
        self.link.try_take_into(self.ranks[peer], dst)
    }
    fn try_relay(
        &mut self,
        from: usize,
        to: usize,
        len: usize,
        at: Option<usize>,
        f: &mut crate::transport::Relay<'_>,
    ) -> Result<bool> {
        self.link
            .try_relay(self.ranks[from], self.ranks[to], len, at, f)
    }
    fn relays_between(&self, from: usize, to: usize) -> bool {
        self.link.relays_between(self.ranks[from], self.ranks[to])
    }
    fn sends_in_place(&self, data: &[u8]) -> bool {
        self.link.sends_in_place(data)
    }
    fn lands(&self, peer: usize) -> bool {
        self.link.lands(self.ranks[peer])
    }
    fn try_offer(&mut self, peer: usize, dst: &[u8]) -> Result<bool> {
        self.link.try_offer(self.ranks[peer], dst)
    }
    fn try_accept(&mut self, peer: usize) -> Result<bool> {
        self.link.try_accept(self.ranks[peer])
    }
    fn try_post_at(&mut self, peer: usize, data: &[u8], at: usize) -> Result<bool> {
        self.link.try_post_at(self.ranks[peer], data, at)
    }
    fn try_take_landed(&mut self, peer: usize, dst: &mut [u8]) -> Result<bool> {
        self.link.try_take_landed(self.ranks[peer], dst)
    }
    fn ledger_mut(&mut self) -> Option<&mut crate::transport::Ledger> {
        self.link.ledger_mut()
    }
    fn progress(&mut self, waiting_on: usize) -> Result<()> {
        self.link.progress(self.ranks[waiting_on])
    }
    fn begin(&mut self) {
        self.link.begin()
    }
    fn resume(&mut self) {
        self.link.resume()
    }
    fn start(&mut self, _op: &OpDesc, _scope: Partners) {
        // The whole operation was started on the underlying link; its steps start nothing.
    }
    fn lending(&mut self) -> Option<&mut dyn Lending> {
        self.link.lending()
    }
    fn unsent(&mut self) -> Result<Option<usize>> {
        // A rank outside the subset has nothing of this operation queued: none is named.
        Ok(self
            .link
            .unsent()?
            .and_then(|p| self.ranks.iter().position(|&r| r == p)))
    }
    fn finish(&mut self) -> Result<()> {
        self.link.finish()
    }
}
