//! The two ends NCCL holds (`SendComm`, `RecvComm`): each posts into its `CommCore` and tests it.

use super::{Outcome, SharedCore};
use crate::engine::{RecvBuf, ReqId, SendBuf, TransportError, MAX_RECVS, MAX_RECV_REQUESTS, MAX_SEND_REQUESTS};
use crate::proto::{MsgError, RecvSpec};

/// Close a comm from its owner's thread and let the engine stop its progress thread if it was the last.
fn close_shared(core: &SharedCore) {
    let net = {
        let mut c = core.lock();
        c.shutdown();
        c.net.clone()
    };
    net.progress.closed();
}

fn failed(e: MsgError) -> TransportError {
    match e {
        MsgError::Truncated { .. } => TransportError::Truncated(e.to_string()),
        other => TransportError::RequestFailed(other.to_string()),
    }
}

/// The sending end of a connection (NCCL's sendComm).
pub struct SendComm {
    shared: SharedCore,
}

impl Drop for SendComm {
    fn drop(&mut self) {
        close_shared(&self.shared);
    }
}

impl SendComm {
    pub(crate) fn new(shared: SharedCore) -> Self {
        Self { shared }
    }

    /// Post a send of `buf` with `tag`. `Ok(None)`: too many outstanding, retry later. On a connection
    /// whose peer closed or died the send is accepted and its `test` reports why it failed.
    pub fn isend(&mut self, buf: Box<dyn SendBuf>, tag: i32) -> Result<Option<ReqId>, TransportError> {
        let mut core = self.shared.lock();
        let now = core.net.now_us();
        let addr = core.backend.buffer_addr(buf.addr(), buf.len())?;
        match core.conn.post_send(buf.len() as u64, tag, now) {
            Ok(msg) => {
                if let Err(e) = core.backend.send_posted(msg, addr, buf.len()) {
                    // proto has the send already; it cannot be moved without its memory.
                    core.conn.close(now);
                    return Err(e);
                }
                core.plan(msg, buf.len() as u64, now);
                core.lb.posted_at.insert(msg, now);
                core.requests.sends.insert(msg, buf);
                core.owner_progress();
                Ok(Some(core.new_req(msg)))
            }
            Err(e) => {
                core.owner_progress();
                core.post_error(e, "isend", MAX_SEND_REQUESTS)
            }
        }
    }

    /// Progress the comm; `Some(size)` once `req` is done (it is then forgotten), `Err` if it failed.
    pub fn test(&mut self, req: ReqId) -> Result<Option<usize>, TransportError> {
        match self.shared.lock().test(req)? {
            None => Ok(None),
            Some(Outcome::Sent(len)) => Ok(Some(len as usize)),
            Some(Outcome::Failed(e)) => Err(failed(e)),
            Some(Outcome::Received(_)) => Err(TransportError::UnknownRequest(req.0)),
        }
    }
}

/// The receiving end of a connection (NCCL's recvComm).
pub struct RecvComm {
    shared: SharedCore,
}

impl Drop for RecvComm {
    fn drop(&mut self) {
        close_shared(&self.shared);
    }
}

impl RecvComm {
    pub(crate) fn new(shared: SharedCore) -> Self {
        Self { shared }
    }

    /// Post a (grouped) receive into `bufs`, each with its tag. `Ok(None)`: retry later. On a
    /// connection whose peer closed or died the receive is accepted and its `test` reports why it failed.
    pub fn irecv(&mut self, bufs: Vec<(Box<dyn RecvBuf>, i32)>) -> Result<Option<ReqId>, TransportError> {
        if bufs.is_empty() || bufs.len() > MAX_RECVS {
            return Err(TransportError::InvalidArgument(format!("a grouped receive needs 1 to {MAX_RECVS} buffers, got {}", bufs.len())));
        }
        let mut core = self.shared.lock();
        let now = core.net.now_us();
        let specs: Vec<RecvSpec> = bufs.iter().map(|(b, tag)| RecvSpec { len: b.len() as u64, tag: *tag }).collect();
        let mut ranges = Vec::with_capacity(bufs.len());
        for (b, _) in &bufs {
            if let Some(a) = core.backend.buffer_addr(b.addr(), b.len())? {
                ranges.push((a, b.len()));
            }
        }
        match core.conn.post_recv(&specs, now) {
            Ok(msg) => {
                if let Err(e) = core.backend.recv_posted(msg, &ranges) {
                    core.conn.close(now);
                    return Err(e);
                }
                core.requests.recvs.insert(msg, bufs.into_iter().map(|(b, _)| b).collect());
                core.owner_progress();
                Ok(Some(core.new_req(msg)))
            }
            Err(e) => {
                core.owner_progress();
                core.post_error(e, "irecv", MAX_RECV_REQUESTS)
            }
        }
    }

    /// Progress the comm; the real received sizes once `req` is done, `Err` if it failed.
    pub fn test(&mut self, req: ReqId) -> Result<Option<Vec<usize>>, TransportError> {
        match self.shared.lock().test(req)? {
            None => Ok(None),
            Some(Outcome::Received(sizes)) => Ok(Some(sizes.into_iter().map(|s| s as usize).collect())),
            Some(Outcome::Failed(e)) => Err(failed(e)),
            Some(Outcome::Sent(_)) => Err(TransportError::UnknownRequest(req.0)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_truncated_request_says_so_once() {
        let text = failed(MsgError::Truncated { send_len: 10_000, recv_len: 4096 }).to_string();
        assert_eq!(text.matches("message truncated").count(), 1, "{text}");
        assert!(text.contains("10000") && text.contains("4096"), "{text}");
    }
}
