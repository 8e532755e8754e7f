//! The out-of-band exchange between ranks (NCCL's bootstrap, much reduced): rank 0 listens on TCP, every
//! other rank connects; an all-gather of JSON values through rank 0 carries connection handles,
//! barriers, and each rank's timings and error counts. One JSON object per line.

use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

/// Errors of the rendezvous.
#[derive(Debug, thiserror::Error)]
pub enum RendezvousError {
    /// A socket operation failed.
    #[error("rendezvous: {what}: {error}")]
    Io {
        /// What was being done.
        what: String,
        /// The OS error (in the message, so not also a `source`).
        error: std::io::Error,
    },
    /// A peer sent something that is not the protocol.
    #[error("rendezvous: {0}")]
    Protocol(String),
    /// Another rank gave up and said why.
    #[error("rendezvous: rank {rank} aborted: {msg}")]
    Aborted {
        /// The rank that failed.
        rank: usize,
        /// Its reason.
        msg: String,
    },
    /// Not every rank arrived in time.
    #[error("rendezvous: {0} (-T)")]
    Timeout(String),
}

fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> RendezvousError {
    let what = what.into();
    move |error| RendezvousError::Io { what, error }
}

struct Link {
    rank: usize,
    reader: BufReader<TcpStream>,
    writer: TcpStream,
}

impl Link {
    fn new(stream: TcpStream, rank: usize, timeout: Duration) -> Result<Self, RendezvousError> {
        stream.set_nodelay(true).map_err(io("set TCP_NODELAY"))?;
        stream.set_read_timeout(Some(timeout)).map_err(io("set read timeout"))?;
        let writer = stream.try_clone().map_err(io("clone socket"))?;
        Ok(Self { rank, reader: BufReader::new(stream), writer })
    }

    fn send(&mut self, v: &Value) -> Result<(), RendezvousError> {
        let mut line = v.to_string();
        line.push('\n');
        self.writer.write_all(line.as_bytes()).map_err(io(format!("send to rank {}", self.rank)))
    }

    fn recv(&mut self) -> Result<Value, RendezvousError> {
        let mut line = String::new();
        let n = self.reader.read_line(&mut line).map_err(|e| match e.kind() {
            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => {
                RendezvousError::Timeout(format!("nothing from rank {} within the timeout", self.rank))
            }
            _ => RendezvousError::Io { what: format!("receive from rank {}", self.rank), error: e },
        })?;
        if n == 0 {
            return Err(RendezvousError::Protocol(format!(
                "rank {} closed its connection (it probably failed: see its messages)",
                self.rank
            )));
        }
        let v: Value =
            serde_json::from_str(&line).map_err(|e| RendezvousError::Protocol(format!("bad message from rank {}: {e}", self.rank)))?;
        if let Some(msg) = v.get("abort") {
            let rank = v.get("rank").and_then(Value::as_u64).map_or(self.rank, |r| r as usize);
            return Err(RendezvousError::Aborted { rank, msg: msg.as_str().unwrap_or("?").to_string() });
        }
        Ok(v)
    }
}

enum Role {
    Single,
    Root(Vec<Link>),
    Member(Link),
}

/// This rank's end of the rendezvous.
pub struct Rendezvous {
    rank: usize,
    nranks: usize,
    role: Role,
}

impl Rendezvous {
    /// A job of one rank: every exchange is local.
    pub fn single() -> Self {
        Self { rank: 0, nranks: 1, role: Role::Single }
    }

    /// Rank 0's listening socket (bind it early so its port can be announced).
    pub fn bind(addr: &str) -> Result<TcpListener, RendezvousError> {
        TcpListener::bind(addr).map_err(io(format!("listen on {addr}")))
    }

    /// Rank 0: waits for ranks 1..nranks on `listener`.
    pub fn serve(listener: TcpListener, nranks: usize, timeout: Duration) -> Result<Self, RendezvousError> {
        listener.set_nonblocking(true).map_err(io("make the listener non-blocking"))?;
        let deadline = Instant::now() + timeout;
        let mut links: Vec<Link> = Vec::new();
        while links.len() + 1 < nranks {
            match listener.accept() {
                Ok((stream, from)) => {
                    stream.set_nonblocking(false).map_err(io("make a connection blocking"))?;
                    let mut link = Link::new(stream, usize::MAX, timeout)?;
                    let hello = link.recv()?;
                    let rank = hello.get("rank").and_then(Value::as_u64).map(|r| r as usize);
                    let their_n = hello.get("nranks").and_then(Value::as_u64).map(|r| r as usize);
                    match (rank, their_n) {
                        (Some(r), Some(n)) if n == nranks && r > 0 && r < nranks && !links.iter().any(|l| l.rank == r) => {
                            link.rank = r;
                            links.push(link);
                        }
                        _ => {
                            let msg = format!("unexpected hello {hello} from {from} (this job has {nranks} ranks)");
                            let _ = link.send(&json!({"abort": msg, "rank": 0}));
                            return Err(RendezvousError::Protocol(msg));
                        }
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    if Instant::now() > deadline {
                        let mut missing: Vec<usize> = (1..nranks).filter(|r| !links.iter().any(|l| l.rank == *r)).collect();
                        missing.sort_unstable();
                        return Err(RendezvousError::Timeout(format!("ranks {missing:?} did not connect")));
                    }
                    std::thread::sleep(Duration::from_millis(5));
                }
                Err(e) => return Err(RendezvousError::Io { what: "accept".into(), error: e }),
            }
        }
        links.sort_by_key(|l| l.rank);
        Ok(Self { rank: 0, nranks, role: Role::Root(links) })
    }

    /// Ranks 1..: connects to rank 0 at `addr`, retrying until `timeout` (rank 0 may start later).
    pub fn join(addr: &str, rank: usize, nranks: usize, timeout: Duration) -> Result<Self, RendezvousError> {
        let deadline = Instant::now() + timeout;
        let stream = loop {
            let attempt = addr
                .to_socket_addrs()
                .map_err(io(format!("resolve {addr}")))?
                .find_map(|a| TcpStream::connect_timeout(&a, Duration::from_secs(1)).ok());
            if let Some(s) = attempt {
                break s;
            }
            if Instant::now() > deadline {
                return Err(RendezvousError::Timeout(format!("rank 0 not reachable at {addr}")));
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        let mut link = Link::new(stream, 0, timeout)?;
        link.send(&json!({"rank": rank, "nranks": nranks}))?;
        Ok(Self { rank, nranks, role: Role::Member(link) })
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Ranks in the job.
    pub fn nranks(&self) -> usize {
        self.nranks
    }

    /// Every rank contributes `v`; every rank gets all contributions in rank order.
    pub fn allgather(&mut self, v: Value) -> Result<Vec<Value>, RendezvousError> {
        match &mut self.role {
            Role::Single => Ok(vec![v]),
            Role::Member(link) => {
                link.send(&json!({ "v": v }))?;
                let reply = link.recv()?;
                match reply.get("all").and_then(Value::as_array) {
                    Some(all) if all.len() == self.nranks => Ok(all.clone()),
                    _ => Err(RendezvousError::Protocol(format!("bad all-gather reply from rank 0: {reply}"))),
                }
            }
            Role::Root(links) => {
                let mut all = vec![v];
                for link in links.iter_mut() {
                    let msg = match link.recv() {
                        Ok(m) => m,
                        Err(e) => {
                            let text = e.to_string();
                            let failed = match &e {
                                RendezvousError::Aborted { rank, .. } => *rank,
                                _ => link.rank,
                            };
                            for other in links.iter_mut() {
                                let _ = other.send(&json!({"abort": text, "rank": failed}));
                            }
                            return Err(e);
                        }
                    };
                    let v = msg
                        .get("v")
                        .cloned()
                        .ok_or_else(|| RendezvousError::Protocol(format!("bad message from rank {}: {msg}", link.rank)))?;
                    all.push(v);
                }
                let reply = json!({ "all": all });
                for link in links.iter_mut() {
                    link.send(&reply)?;
                }
                Ok(all)
            }
        }
    }

    /// Returns once every rank got here.
    pub fn barrier(&mut self) -> Result<(), RendezvousError> {
        self.allgather(Value::Null).map(|_| ())
    }

    /// Tells the other ranks this one failed (best effort: they may already be gone).
    pub fn abort(&mut self, msg: &str) {
        let m = json!({"abort": msg, "rank": self.rank});
        match &mut self.role {
            Role::Single => {}
            Role::Member(link) => {
                let _ = link.send(&m);
            }
            Role::Root(links) => {
                for link in links.iter_mut() {
                    let _ = link.send(&m);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn start(n: usize) -> Vec<Rendezvous> {
        let listener = Rendezvous::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let joins: Vec<_> = (1..n)
            .map(|r| {
                let addr = addr.clone();
                std::thread::spawn(move || Rendezvous::join(&addr, r, n, Duration::from_secs(10)).unwrap())
            })
            .collect();
        let mut all = vec![Rendezvous::serve(listener, n, Duration::from_secs(10)).unwrap()];
        all.extend(joins.into_iter().map(|j| j.join().unwrap()));
        all
    }

    #[test]
    fn allgather_returns_every_contribution_in_rank_order_on_every_rank() {
        let ranks = start(4);
        let threads: Vec<_> =
            ranks.into_iter().map(|mut rv| std::thread::spawn(move || rv.allgather(json!(rv.rank() * 10)).unwrap())).collect();
        for t in threads {
            assert_eq!(t.join().unwrap(), vec![json!(0), json!(10), json!(20), json!(30)]);
        }
    }

    #[test]
    fn an_abort_reaches_the_other_ranks_with_its_reason() {
        let ranks = start(3);
        let threads: Vec<_> = ranks
            .into_iter()
            .map(|mut rv| {
                std::thread::spawn(move || {
                    if rv.rank() == 2 {
                        rv.abort("plugin init failed");
                        return None;
                    }
                    Some(rv.allgather(json!(null)).unwrap_err().to_string())
                })
            })
            .collect();
        for t in threads {
            if let Some(err) = t.join().unwrap() {
                assert!(err.contains("rank 2") && err.contains("plugin init failed"), "{err}");
            }
        }
    }

    #[test]
    fn a_missing_rank_times_out_naming_it() {
        let listener = Rendezvous::bind("127.0.0.1:0").unwrap();
        let err = Rendezvous::serve(listener, 2, Duration::from_millis(100)).err().unwrap().to_string();
        assert!(err.contains("[1]"), "{err}");
    }

    #[test]
    fn a_single_rank_job_needs_no_network() {
        let mut rv = Rendezvous::single();
        assert_eq!(rv.allgather(json!("x")).unwrap(), vec![json!("x")]);
    }
}
