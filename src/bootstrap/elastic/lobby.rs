//! Where newcomers join a running group that grows (`Comm::grow`, `Comm::rejoin`).
//!
//! The group's rank 0 opens a lobby where newcomers look: the address it writes to
//! `RDMACOMM_COORDINATOR_FILE` (a filesystem both see), else the world's coordinator address.
//! It greets each connection with a challenge; a newcomer answers with a KNOCK (the protocol
//! version, its job identity, its nonce and, with a secret, a MAC over the challenge); rank 0
//! admits one of this job with a WELCOME (its rank, the grown size, the epoch and where the
//! grown group meets), MAC'd over the newcomer's nonce, so the newcomer knows it is the job's.
//! A newcomer learns nothing before it proves the secret (a nonce); a stranger is closed and
//! logged, never fatal.

use crate::bootstrap::rendezvous::outcome::resolve;
use crate::bootstrap::wire::auth::{mac, mac_ok, random, KEY};
use crate::bootstrap::wire::{
    listen, put_bytes, read_some, recv_frame, send_frame, whole_frame, Reader, CHALLENGE, VERSION,
};
use crate::config::Config;
use crate::error::{Error, Result};
use std::io::ErrorKind;
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

// Frame kinds of a lobby connection (its own connection).
const KNOCK: u8 = 45;
const WELCOME: u8 = 46;
/// The largest KNOCK read.
const LIMIT: usize = 4096;
/// Connections not yet admitted, at most (past it the oldest is closed).
const MAX_PENDING: usize = 64;
/// The largest group a welcome may name (what a newcomer allocates for).
pub(crate) const MAX_SIZE: usize = 1 << 20;

/// Rank 0's lobby, open.
pub(crate) struct Lobby {
    listener: TcpListener,
    /// Where it listens, as newcomers are told.
    pub(crate) addr: String,
}

/// What a newcomer is told once admitted.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Welcome {
    /// Its rank in the grown group, and the group's size.
    pub rank: usize,
    pub size: usize,
    /// The grown group's epoch.
    pub epoch: u32,
    /// Where the grown group meets.
    pub meet: String,
}

impl Welcome {
    fn encode(&self) -> Vec<u8> {
        let mut v = (self.rank as u32).to_le_bytes().to_vec();
        v.extend_from_slice(&(self.size as u32).to_le_bytes());
        v.extend_from_slice(&self.epoch.to_le_bytes());
        put_bytes(&mut v, self.meet.as_bytes());
        v
    }

    fn decode(b: &[u8]) -> Option<Welcome> {
        let mut r = Reader(b);
        let rank = r.u32().ok()? as usize;
        let size = r.u32().ok()? as usize;
        let epoch = r.u32().ok()?;
        let meet = String::from_utf8(r.bytes().ok()?.to_vec()).ok()?;
        (rank < size && size <= MAX_SIZE && r.0.is_empty()).then_some(Welcome {
            rank,
            size,
            epoch,
            meet,
        })
    }
}

fn secret(cfg: &Config) -> Option<&[u8]> {
    cfg.secret.as_ref().map(|s| s.bytes())
}

fn knock_body(cfg: &Config, nonce: &[u8; KEY]) -> Vec<u8> {
    let mut v = VERSION.to_le_bytes().to_vec();
    put_bytes(&mut v, cfg.job_id.as_bytes());
    v.extend_from_slice(nonce);
    v
}

/// The newcomer's nonce in a KNOCK of this job and version that proves the secret (if any)
/// against `challenge`; why not otherwise.
fn admits(
    cfg: &Config,
    challenge: &[u8; KEY],
    m: &[u8],
) -> std::result::Result<[u8; KEY], &'static str> {
    if m.len() < KEY {
        return Err("a short knock");
    }
    let (body, tag) = m.split_at(m.len() - KEY);
    let mut r = Reader(body);
    let version = r.take(2).map_err(|_| "a short knock")?;
    if version != VERSION.to_le_bytes() {
        return Err("another protocol version");
    }
    let job = r.bytes().map_err(|_| "a malformed knock")?;
    if job != cfg.job_id.as_bytes() {
        return Err("another job");
    }
    let nonce: [u8; KEY] = r
        .take(KEY)
        .ok()
        .filter(|_| r.0.is_empty())
        .and_then(|n| n.try_into().ok())
        .ok_or("a malformed knock")?;
    if let Some(k) = secret(cfg) {
        if !mac_ok(k, &[b"knock", challenge, body], tag) {
            return Err("no proof of the job's secret");
        }
    }
    Ok(nonce)
}

/// Whether the first bytes of a caller may begin a KNOCK of this protocol version (a stranger's
/// are dropped as they come, not when whole or timed out).
fn plausible(buf: &[u8]) -> bool {
    (buf.len() <= 4 || buf[4] == KNOCK) && (buf.len() < 7 || buf[5..7] == VERSION.to_le_bytes())
}

/// A connection in the lobby: its challenge and its bytes so far.
struct Guest {
    sock: TcpStream,
    challenge: [u8; KEY],
    buf: Vec<u8>,
    since: Instant,
}

impl Lobby {
    /// Opens the lobby for a group whose rank 0 binds `ip`: where the coordinator file says
    /// (rewritten to this lobby's address), else at the world's coordinator address.
    pub(crate) fn open(cfg: &Config, ip: IpAddr) -> Result<Lobby> {
        let listener = match &cfg.coordinator_file {
            Some(path) => {
                let l = listen(SocketAddr::new(ip, 0))
                    .map_err(|e| Error::Bootstrap(format!("cannot listen on {ip}: {e}")))?;
                let addr = l.local_addr()?.to_string();
                // Written whole, then renamed: a newcomer never reads half an address.
                let tmp = format!("{path}.{}.tmp", std::process::id());
                std::fs::write(&tmp, format!("{addr}\n"))
                    .and_then(|()| std::fs::rename(&tmp, path))
                    .map_err(|e| {
                        Error::Config(format!("RDMACOMM_COORDINATOR_FILE={path:?}: {e}"))
                    })?;
                l
            }
            None => {
                let at = resolve(&cfg.coordinator)?;
                listen(at).map_err(|e| {
                    Error::Bootstrap(format!(
                        "cannot open the lobby for newcomers at the coordinator address {at}: \
                         {e} (rank 0 of a shrunk group may be on another host: set \
                         RDMACOMM_COORDINATOR_FILE on every rank and newcomer)"
                    ))
                })?
            }
        };
        let addr = listener.local_addr()?.to_string();
        listener.set_nonblocking(true)?;
        Ok(Lobby { listener, addr })
    }

    /// Admits `k` newcomers of this job by `deadline`, the i-th as `welcome(i)`: an error
    /// saying how many came otherwise.
    pub(crate) fn admit(
        &self,
        cfg: &Config,
        k: usize,
        deadline: Instant,
        welcome: impl Fn(usize) -> Welcome,
    ) -> Result<()> {
        let mut guests: Vec<Guest> = Vec::new();
        let mut admitted = 0;
        while admitted < k {
            if Instant::now() >= deadline {
                return Err(Error::Bootstrap(format!(
                    "{admitted} of {k} newcomer(s) joined at {} within {:?}",
                    self.addr, cfg.timeout
                )));
            }
            let mut busy = false;
            // Bounded per round: a flood cannot keep rank 0 from its deadline.
            for _ in 0..MAX_PENDING {
                if guests.len() >= MAX_PENDING {
                    // Full: the oldest is closed (a newcomer writes its KNOCK whole as it gets
                    // the challenge; callers that send a byte each cannot hold the lobby).
                    if let Some(i) = (0..guests.len()).min_by_key(|&i| guests[i].since) {
                        guests.swap_remove(i);
                    }
                }
                let Ok((s, from)) = self.listener.accept() else {
                    break;
                };
                busy = true;
                let challenge = random::<KEY>();
                let _ = s.set_write_timeout(Some(Duration::from_millis(200)));
                if send_frame(&s, CHALLENGE, &challenge).is_err()
                    || s.set_nonblocking(true).is_err()
                {
                    continue;
                }
                log::debug!("lobby: a connection from {from}");
                guests.push(Guest {
                    sock: s,
                    challenge,
                    buf: Vec::new(),
                    since: Instant::now(),
                });
            }
            let mut i = 0;
            while i < guests.len() && admitted < k {
                let g = &mut guests[i];
                let (got, bad) = read_some(&g.sock, &mut g.buf, LIMIT);
                busy |= got;
                let whole = whole_frame(&g.buf, LIMIT);
                if bad.is_some() && whole != Ok(true) || whole.is_err() || !plausible(&g.buf) {
                    guests.swap_remove(i);
                    continue;
                }
                if whole != Ok(true) {
                    if g.since.elapsed() > Duration::from_secs(2) {
                        guests.swap_remove(i);
                    } else {
                        i += 1;
                    }
                    continue;
                }
                let g = guests.swap_remove(i);
                let len = u32::from_le_bytes(g.buf[..4].try_into().expect("4 bytes")) as usize;
                let (kind, m) = (g.buf[4], &g.buf[5..4 + len]);
                let nonce = if kind == KNOCK {
                    admits(cfg, &g.challenge, m)
                } else {
                    Err("no knock")
                };
                match nonce {
                    Ok(nonce) => {
                        let body = welcome(admitted).encode();
                        let tag =
                            secret(cfg).map_or([0; KEY], |k| mac(k, &[b"welcome", &nonce, &body]));
                        let mut w = body;
                        w.extend_from_slice(&tag);
                        let _ = g.sock.set_nonblocking(false);
                        if send_frame(&g.sock, WELCOME, &w).is_ok() {
                            admitted += 1;
                        }
                    }
                    Err(why) => {
                        let from = g
                            .sock
                            .peer_addr()
                            .map(|a| a.to_string())
                            .unwrap_or_default();
                        log::warn!("lobby: refused a connection from {from}: {why}");
                    }
                }
            }
            if !busy {
                std::thread::sleep(Duration::from_millis(2));
            }
        }
        Ok(())
    }
}

/// Where a newcomer looks for the lobby: the coordinator file's address (read afresh: an old
/// lobby's may be there until rank 0 writes its new one), else the coordinator address.
fn lobby_addr(cfg: &Config) -> std::result::Result<SocketAddr, String> {
    match &cfg.coordinator_file {
        Some(path) => {
            let text = std::fs::read_to_string(path).map_err(|e| format!("{path:?}: {e}"))?;
            resolve(text.trim()).map_err(|e| e.to_string())
        }
        None => resolve(&cfg.coordinator).map_err(|e| e.to_string()),
    }
}

/// A newcomer's side: finds the lobby, proves itself and is admitted, by `deadline`.
pub(crate) fn knock(cfg: &Config, deadline: Instant) -> Result<Welcome> {
    let mut last = String::from("nothing tried");
    loop {
        if Instant::now() >= deadline {
            return Err(Error::Bootstrap(format!(
                "no running group of this job admitted this newcomer within {:?} (members call \
                 grow to admit it): {last}",
                cfg.timeout
            )));
        }
        match try_knock(cfg, deadline) {
            Ok(w) => return Ok(w),
            Err(Knock::Again(why)) => last = why,
            Err(Knock::Forged) => {
                // A process that is not the group's answered there: never fatal, ask again.
                log::warn!("a lobby's welcome did not prove the job's secret; asking again");
                last = "a welcome that did not prove the job's secret".into();
            }
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

enum Knock {
    Again(String),
    Forged,
}

fn try_knock(cfg: &Config, deadline: Instant) -> std::result::Result<Welcome, Knock> {
    let again = |why: String| Knock::Again(why);
    let at = lobby_addr(cfg).map_err(again)?;
    let left = deadline.saturating_duration_since(Instant::now());
    let s = TcpStream::connect_timeout(
        &at,
        left.clamp(Duration::from_millis(1), Duration::from_secs(1)),
    )
    .map_err(|e| Knock::Again(format!("connecting to {at}: {e}")))?;
    let (kind, challenge) =
        recv_frame(&s, deadline).map_err(|e| Knock::Again(format!("{at}: no challenge: {e}")))?;
    let challenge: [u8; KEY] = challenge
        .try_into()
        .ok()
        .filter(|_| kind == CHALLENGE)
        .ok_or_else(|| Knock::Again(format!("{at} greets as no lobby does")))?;
    let nonce = random::<KEY>();
    let body = knock_body(cfg, &nonce);
    let tag = secret(cfg).map_or([0; KEY], |k| mac(k, &[b"knock", &challenge, &body]));
    let mut m = body;
    m.extend_from_slice(&tag);
    let _ = s.set_write_timeout(Some(Duration::from_secs(1)));
    send_frame(&s, KNOCK, &m).map_err(|e| Knock::Again(format!("{at}: {e}")))?;
    let (kind, w) = recv_frame(&s, deadline).map_err(|e| match e.kind() {
        ErrorKind::UnexpectedEof => Knock::Again(format!(
            "{at} closed the connection (another job's, or the secret differs)"
        )),
        _ => Knock::Again(format!("{at}: no welcome: {e}")),
    })?;
    if kind != WELCOME || w.len() < KEY {
        return Err(Knock::Again(format!("{at}: no welcome")));
    }
    let (body, tag) = w.split_at(w.len() - KEY);
    if let Some(k) = secret(cfg) {
        if !mac_ok(k, &[b"welcome", &nonce, body], tag) {
            return Err(Knock::Forged);
        }
    }
    Welcome::decode(body).ok_or_else(|| Knock::Again(format!("{at}: a malformed welcome")))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(secret: Option<&str>, job: &str, file: &str) -> Config {
        let mut c = Config::defaults(0, 1, "127.0.0.1:1");
        c.secret = secret.map(|s| crate::config::Secret(s.as_bytes().to_vec()));
        c.job_id = job.into();
        c.coordinator_file = Some(file.into());
        c
    }

    #[test]
    fn newcomers_of_the_job_are_admitted_and_strangers_are_not() {
        let file = std::env::temp_dir().join(format!("rdmacomm-lobby-{}", std::process::id()));
        let file = file.to_str().unwrap().to_string();
        let _ = std::fs::remove_file(&file);
        let members = cfg(Some("s3cret"), "job", &file);
        let t = Duration::from_secs(5);
        // Newcomers start before the lobby exists: they wait for the file.
        let knockers: Vec<_> = [("s3cret", "job"), ("wrong", "job"), ("s3cret", "other")]
            .into_iter()
            .map(|(s, j)| {
                let c = cfg(Some(s), j, &file);
                std::thread::spawn(move || knock(&c, Instant::now() + Duration::from_secs(2)))
            })
            .collect();
        std::thread::sleep(Duration::from_millis(100));
        let lobby = Lobby::open(&members, "127.0.0.1".parse().unwrap()).unwrap();
        lobby
            .admit(&members, 1, Instant::now() + t, |i| Welcome {
                rank: 3 + i,
                size: 4,
                epoch: 2,
                meet: "127.0.0.1:9".into(),
            })
            .unwrap();
        let got: Vec<_> = knockers.into_iter().map(|h| h.join().unwrap()).collect();
        assert_eq!(
            got[0].as_ref().unwrap(),
            &Welcome {
                rank: 3,
                size: 4,
                epoch: 2,
                meet: "127.0.0.1:9".into()
            }
        );
        assert!(got[1].is_err() && got[2].is_err(), "{:?}", &got[1..]);
        // Nobody else comes: the lobby says how many did.
        let e = lobby
            .admit(
                &members,
                1,
                Instant::now() + Duration::from_millis(300),
                |_| unreachable!(),
            )
            .unwrap_err();
        assert!(e.to_string().contains("0 of 1 newcomer"), "{e}");
        let _ = std::fs::remove_file(&file);
    }

    #[test]
    fn a_newcomer_is_admitted_through_a_flood_of_one_byte_strangers() {
        use std::io::Write;
        let file = std::env::temp_dir().join(format!("rdmacomm-flood-{}", std::process::id()));
        let file = file.to_str().unwrap().to_string();
        let members = cfg(None, "job", &file);
        let lobby = Lobby::open(&members, "127.0.0.1".parse().unwrap()).unwrap();
        let at: SocketAddr = lobby.addr.parse().unwrap();
        // A thousand connections that send one byte each (or a wrong kind) wait first.
        let strangers: Vec<TcpStream> = (0..1000)
            .filter_map(|i| {
                let mut s = TcpStream::connect(at).ok()?;
                let _ = s.write_all(if i % 2 == 0 { &[1] } else { &[9, 0, 0, 0, 7] });
                Some(s)
            })
            .collect();
        let newcomer = cfg(None, "job", &file);
        let h =
            std::thread::spawn(move || knock(&newcomer, Instant::now() + Duration::from_secs(5)));
        let start = Instant::now();
        lobby
            .admit(&members, 1, Instant::now() + Duration::from_secs(5), |i| {
                Welcome {
                    rank: 2 + i,
                    size: 3,
                    epoch: 1,
                    meet: "127.0.0.1:9".into(),
                }
            })
            .unwrap();
        assert_eq!(h.join().unwrap().unwrap().rank, 2);
        // Held by the strangers, it would have waited 2 s for each batch of them to time out.
        assert!(
            start.elapsed() < Duration::from_secs(2),
            "{:?}",
            start.elapsed()
        );
        drop(strangers);
        let _ = std::fs::remove_file(&file);
    }
}
