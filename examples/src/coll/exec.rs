//! The executor: drives a [`Plan`] through a [`Transport`] the way NCCL's proxy does (post what the
//! window allows, test every outstanding request, repeat).

use std::time::{Duration, Instant};

use super::Plan;
use crate::net::{NetError, ReqId, Transport, MAX_REQUESTS_PER_COMM};

/// How the executor posts and waits.
#[derive(Debug, Clone, Copy)]
pub struct ExecConfig {
    /// Requests in flight per comm (per direction and peer); NCCL keeps 8 (NCCL_STEPS).
    pub window: usize,
    /// Requests in flight on all comms together.
    pub max_inflight: usize,
    /// Fail when nothing completed or got posted for this long.
    pub timeout: Duration,
}

impl Default for ExecConfig {
    fn default() -> Self {
        Self { window: 8, max_inflight: 256, timeout: Duration::from_secs(60) }
    }
}

/// Errors of a collective run.
#[derive(Debug, thiserror::Error)]
pub enum CollError {
    /// The transport refused or failed an operation.
    #[error("rank {rank}: {op}: {error}")]
    Net {
        /// This rank.
        rank: usize,
        /// What was being done.
        op: String,
        /// The transport's error (in the message, so not also a `source`).
        error: NetError,
    },
    /// A receive completed with a size other than the one sent.
    #[error("rank {rank}: receive #{index} from rank {peer} completed with {got} bytes, expected {expected}")]
    SizeMismatch {
        /// This rank.
        rank: usize,
        /// Source rank.
        peer: usize,
        /// Receive index in the plan.
        index: usize,
        /// Bytes reported by test.
        got: usize,
        /// Bytes posted (and sent).
        expected: usize,
    },
    /// Nothing progressed for the configured timeout.
    #[error("rank {rank}: no progress for {secs:.1} s (-T); pending: {pending}")]
    Timeout {
        /// This rank.
        rank: usize,
        /// Seconds without progress.
        secs: f64,
        /// What was posted and what could not be posted yet.
        pending: String,
    },
    /// A schedule refers to peers this transport has no rank for.
    #[error("rank {rank}: schedule names peer {peer} but the job has {nranks} ranks")]
    BadPeer {
        /// This rank.
        rank: usize,
        /// The peer.
        peer: usize,
        /// Ranks in the job.
        nranks: usize,
    },
}

/// Counters of one execution.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ExecStats {
    /// isend/irecv calls answered "retry later".
    pub retries: u64,
    /// test calls made.
    pub tests: u64,
}

/// A posted request: a send or a receive, by index in the plan.
#[derive(Debug, Clone, Copy)]
pub(super) enum Op {
    Send(usize),
    Recv(usize),
}

struct PeerQueues {
    peer: usize,
    sends: Vec<usize>,
    recvs: Vec<usize>,
    next_send: usize,
    next_recv: usize,
    sends_in_flight: usize,
    recvs_in_flight: usize,
    send_retries: u64,
    recv_retries: u64,
    recv_waits_for_send: bool,
}

/// Runs `plan` to completion on `t`.
pub fn execute(t: &mut dyn Transport, plan: &Plan, cfg: &ExecConfig) -> Result<ExecStats, CollError> {
    let rank = t.rank();
    let nranks = t.nranks();
    let net = |op: String| move |error: NetError| CollError::Net { rank, op, error };
    for (dst, src) in &plan.copies {
        t.pool_mut().copy(*dst, *src).map_err(net(format!("local copy {src:?} -> {dst:?}")))?;
    }
    let mut queues: Vec<PeerQueues> = Vec::new();
    let queue_of = |queues: &mut Vec<PeerQueues>, peer: usize| -> usize {
        if let Some(i) = queues.iter().position(|q| q.peer == peer) {
            return i;
        }
        queues.push(PeerQueues {
            peer,
            sends: Vec::new(),
            recvs: Vec::new(),
            next_send: 0,
            next_recv: 0,
            sends_in_flight: 0,
            recvs_in_flight: 0,
            send_retries: 0,
            recv_retries: 0,
            recv_waits_for_send: false,
        });
        queues.len() - 1
    };
    for (i, s) in plan.sends.iter().enumerate() {
        if s.peer >= nranks {
            return Err(CollError::BadPeer { rank, peer: s.peer, nranks });
        }
        let q = queue_of(&mut queues, s.peer);
        queues[q].sends.push(i);
    }
    for (i, r) in plan.recvs.iter().enumerate() {
        if r.peer >= nranks {
            return Err(CollError::BadPeer { rank, peer: r.peer, nranks });
        }
        let q = queue_of(&mut queues, r.peer);
        queues[q].recvs.push(i);
    }
    let window = cfg.window.clamp(1, MAX_REQUESTS_PER_COMM);
    let max_inflight = cfg.max_inflight.max(1);
    let mut recv_done = vec![false; plan.recvs.len()];
    let mut send_done = vec![false; plan.sends.len()];
    let mut done = 0usize;
    let total = plan.sends.len() + plan.recvs.len();
    let mut outstanding: Vec<(ReqId, Op)> = Vec::new();
    let mut stats = ExecStats::default();
    let mut last_progress = Instant::now();
    let mut round = 0usize;
    while done < total {
        let mut progress = false;
        let nq = queues.len();
        for k in 0..nq {
            // Rotate the starting peer so a full global window does not always starve the same one.
            let q = &mut queues[(k + round) % nq];
            // Receives first: posting them is what lets the peers' sends go (the receiver-driven CTS).
            while q.next_recv < q.recvs.len() && q.recvs_in_flight < window && outstanding.len() < max_inflight {
                let idx = q.recvs[q.next_recv];
                let op = plan.recvs[idx];
                // A ring receives a block again (all-gather) that it is maybe still forwarding from the
                // reduce-scatter: the new data may only land once that send has let go of the bytes.
                if op.after_send.is_some_and(|a| !send_done[a]) || !t.pool().is_idle(op.region) {
                    q.recv_waits_for_send = true;
                    break;
                }
                q.recv_waits_for_send = false;
                match t.irecv(op.peer, op.region).map_err(|e| net(format!("irecv #{idx} from rank {}", op.peer))(e))? {
                    Some(id) => {
                        outstanding.push((id, Op::Recv(idx)));
                        q.next_recv += 1;
                        q.recvs_in_flight += 1;
                        progress = true;
                    }
                    None => {
                        q.recv_retries += 1;
                        stats.retries += 1;
                        break;
                    }
                }
            }
            while q.next_send < q.sends.len() && q.sends_in_flight < window && outstanding.len() < max_inflight {
                let idx = q.sends[q.next_send];
                let op = plan.sends[idx];
                if op.after.is_some_and(|a| !recv_done[a]) {
                    break;
                }
                match t.isend(op.peer, op.region).map_err(|e| net(format!("isend #{idx} to rank {}", op.peer))(e))? {
                    Some(id) => {
                        outstanding.push((id, Op::Send(idx)));
                        q.next_send += 1;
                        q.sends_in_flight += 1;
                        progress = true;
                    }
                    None => {
                        q.send_retries += 1;
                        stats.retries += 1;
                        break;
                    }
                }
            }
        }
        round = round.wrapping_add(1);
        let mut i = 0;
        while i < outstanding.len() {
            let (id, op) = outstanding[i];
            stats.tests += 1;
            // The error's text is made only on an error: this loop runs millions of times.
            let what = || match op {
                Op::Send(idx) => format!("test of isend #{idx} to rank {}", plan.sends[idx].peer),
                Op::Recv(idx) => format!("test of irecv #{idx} from rank {}", plan.recvs[idx].peer),
            };
            let Some(bytes) = t.test(id).map_err(|e| net(what())(e))? else {
                i += 1;
                continue;
            };
            outstanding.swap_remove(i);
            progress = true;
            done += 1;
            match op {
                Op::Send(idx) => {
                    let qi = queues.iter().position(|q| q.peer == plan.sends[idx].peer).expect("queue exists");
                    queues[qi].sends_in_flight -= 1;
                    send_done[idx] = true;
                }
                Op::Recv(idx) => {
                    let r = plan.recvs[idx];
                    let qi = queues.iter().position(|q| q.peer == r.peer).expect("queue exists");
                    queues[qi].recvs_in_flight -= 1;
                    if bytes != r.region.bytes() {
                        return Err(CollError::SizeMismatch { rank, peer: r.peer, index: idx, got: bytes, expected: r.region.bytes() });
                    }
                    if let Some(src) = r.add_from {
                        t.pool_mut().add_assign(r.region, src).map_err(net(format!("sum after irecv #{idx}")))?;
                    }
                    recv_done[idx] = true;
                }
            }
        }
        if progress {
            last_progress = Instant::now();
        } else if last_progress.elapsed() >= cfg.timeout {
            return Err(CollError::Timeout {
                rank,
                secs: last_progress.elapsed().as_secs_f64(),
                pending: describe_pending(plan, &queues, &outstanding, &recv_done, window),
            });
        } else {
            // Two cores are shared by every rank and the plugin's threads: give them the CPU.
            std::thread::yield_now();
        }
    }
    Ok(stats)
}

fn describe_pending(plan: &Plan, queues: &[PeerQueues], outstanding: &[(ReqId, Op)], recv_done: &[bool], window: usize) -> String {
    let mut parts: Vec<String> = outstanding
        .iter()
        .take(8)
        .map(|(_, op)| match *op {
            Op::Send(i) => format!("isend #{i} to rank {} ({} B) posted, not done", plan.sends[i].peer, plan.sends[i].region.bytes()),
            Op::Recv(i) => format!("irecv #{i} from rank {} ({} B) posted, not done", plan.recvs[i].peer, plan.recvs[i].region.bytes()),
        })
        .collect();
    if outstanding.len() > 8 {
        parts.push(format!("... {} posted requests in all", outstanding.len()));
    }
    for q in queues {
        if q.next_recv < q.recvs.len() {
            let reason = if q.recvs_in_flight >= window {
                "window full".to_string()
            } else if q.recv_waits_for_send {
                "next waits for a send from the same bytes".to_string()
            } else {
                format!("{} retry-later answers", q.recv_retries)
            };
            parts.push(format!("{} irecvs from rank {} not posted yet ({reason})", q.recvs.len() - q.next_recv, q.peer));
        }
        if q.next_send < q.sends.len() {
            let next = plan.sends[q.sends[q.next_send]];
            let reason = match next.after {
                Some(a) if !recv_done[a] => format!("next waits for irecv #{a}"),
                _ if q.sends_in_flight >= window => "window full".to_string(),
                _ => format!("{} retry-later answers", q.send_retries),
            };
            parts.push(format!("{} isends to rank {} not posted yet ({reason})", q.sends.len() - q.next_send, q.peer));
        }
    }
    parts.join("; ")
}
