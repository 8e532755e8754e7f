//! The hosts' part of a run: every flow piece is a pair of `proto::Connection` ends (sender and
//! receiver) fed with posted sends and receives; a NIC pulls datagrams from its ready connection ends
//! round-robin and hands arriving datagrams to the end their token names.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};

use prism_lb::{CcKind, FlowInfo, LbConfig, LbRuntime, MessageSample};
use prism_transport::proto::{Completion, Connection, MsgId, NoPlacement, PayloadSource, ProtoConfig, RecvSpec};
use prism_transport::wire::{self, data::FLAG_CE, DataPacket, Header, PacketType, DATA_HEADER_LEN};

use super::Sim;
use crate::events::{Event, Ps, PS_PER_US};
use crate::fabric::{Packet, PacketBody, PacketMeta, MAX_HDR};
use crate::host::{locked, PacketAimd, SharedAimd, SharedRate, SimPolicy};
use crate::scenario::{RateMode, SchemeSpec};

/// Tokens are `TOKEN_BASE + endpoint index`: the receiving host demultiplexes by the token in the
/// datagram, as the UDP engine does.
const TOKEN_BASE: u64 = 0x5052_4953_4d00_0000;
/// Receives posted ahead per connection (below `proto::MAX_OUTSTANDING_RECVS`).
const RECV_AHEAD: usize = 48;
/// Sends posted at once per connection.
const SEND_AHEAD: usize = 48;

/// The payload of a simulated send: its bytes are never looked at, so nothing is written; it notes which
/// message and offset the protocol last read (the DATA packet it is building).
#[derive(Default)]
struct NoPayload(Option<(MsgId, u64)>);
impl PayloadSource for NoPayload {
    fn read(&mut self, msg: MsgId, offset: u64, _out: &mut [u8]) {
        self.0 = Some((msg, offset));
    }
}

/// A send posted to the protocol and not yet complete.
struct PostedSend {
    id: MsgId,
    bytes: u64,
    /// When its first packet went on the wire (MCC's message RTT starts here).
    first_tx: Option<Ps>,
}

/// A DATA packet of `msg` at `offset` went on the wire at `now`: if it is the message's first packet
/// and the first time it is sent (a retransmission finds the message stamped), stamp the message.
fn note_first_tx(posted: &mut VecDeque<PostedSend>, msg: MsgId, offset: u64, now: Ps) {
    if offset == 0 {
        if let Some(m) = posted.iter_mut().find(|m| m.id == msg && m.first_tx.is_none()) {
            m.first_tx = Some(now);
        }
    }
}

/// Whether an end may be skipped by its NIC when idle (see `Endpoint::idle`): not a sender under the
/// per-packet window (`aimd`), whose window is set before each `poll_transmit`.
fn may_skip(aimd: bool, sender: bool) -> bool {
    !(aimd && sender)
}

/// What the simulator keeps about one end of a connection, on one NIC. Kept apart from the end's
/// `Connection` (in [`Hosts::conns`], same index): stale timers, deliveries and the NICs' round-robin
/// read only these few bytes, which stay in cache, instead of a line of a large connection.
pub(super) struct Endpoint {
    nic: u32,
    peer_nic: u32,
    pair: u32,
    sender: bool,
    timer_at: Option<Ps>,
    /// In its NIC's ready list.
    in_ready: bool,
    /// The connection had nothing to send when last asked (`Connection::transmit_idle`, asked while
    /// it was in the cache), and nothing was handed to it since (all that ends in `after_ep`, which
    /// asks again): the NIC skips it without a `poll_transmit` that would find nothing. It keeps its
    /// place in the ready list meanwhile, so the round-robin order is what it would be without this.
    idle: bool,
    /// Highest DATA PSN received (reorder distances).
    max_psn: Option<u64>,
}

/// Bytes of one transfer to move over one pair, ready from `ready_at`.
#[derive(Clone, Copy)]
pub(super) struct Piece {
    pub(super) transfer: u32,
    pub(super) bytes: u64,
    pub(super) ready_at: Ps,
}

/// A flow piece's two connection ends and the sends and receives waiting for them.
pub(super) struct Pair {
    ep_send: u32,
    ep_recv: u32,
    pub(super) pending_send: VecDeque<Piece>,
    pub(super) pending_recv: VecDeque<Piece>,
    /// Messages posted and not yet complete, in posting order (the order the protocol sends them).
    posted_send: VecDeque<PostedSend>,
    /// (message, transfer, bytes).
    posted_recv: VecDeque<(MsgId, u32, u64)>,
    out_bytes: u64,
    rate: Option<SharedRate>,
    aimd: Option<SharedAimd>,
    pub(super) pump_at: Option<Ps>,
}

/// Every host's load balancer and connections, and the NICs' ready lists.
pub(super) struct Hosts {
    pub(super) cfg: LbConfig,
    pub(super) scheme: SchemeSpec,
    proto: ProtoConfig,
    pub(super) runtimes: Vec<LbRuntime>,
    pub(super) eps: Vec<Endpoint>,
    /// `conns[i]`: endpoint `i`'s protocol state.
    conns: Vec<Connection>,
    /// Pairs carry a per-packet AIMD window (the scheme's rate mode; every pair or none).
    aimd: bool,
    pub(super) pairs: Vec<Pair>,
    /// (src, dst, rail, dst rail, pinned uplink or `u32::MAX`) → pair.
    pair_index: HashMap<(u32, u32, u16, u16, u32), u32>,
    /// Per NIC: the endpoints that may have a datagram to send, round-robin.
    ready: Vec<VecDeque<u32>>,
    txbuf: Vec<u8>,
    rxbuf: Vec<u8>,
}

impl Hosts {
    pub(super) fn new(
        cfg: LbConfig,
        scheme: SchemeSpec,
        proto: ProtoConfig,
        runtimes: Vec<LbRuntime>,
        nics: usize,
        payload: usize,
    ) -> Self {
        Self {
            cfg,
            aimd: matches!(scheme.rate, RateMode::PacketAimd | RateMode::PacketMprdma),
            scheme,
            proto,
            runtimes,
            eps: Vec::new(),
            conns: Vec::new(),
            pairs: Vec::new(),
            pair_index: HashMap::new(),
            ready: vec![VecDeque::new(); nics],
            txbuf: vec![0; DATA_HEADER_LEN + payload + 64],
            rxbuf: vec![0; DATA_HEADER_LEN + payload + 64],
        }
    }

    /// Read endpoint `ep`'s timer (see `Sim::touch_next`).
    #[inline]
    pub(super) fn touch(&self, ep: u32) {
        std::hint::black_box(self.eps[ep as usize].timer_at);
    }

    /// Every connection end, for the protocol counters.
    pub(super) fn connections(&self) -> impl Iterator<Item = &Connection> {
        self.conns.iter()
    }
}

impl Sim {
    /// The pair carrying `src`'s rail `rail` to `dst`'s rail `dst_rail`, pinned to uplink `pin`; made on
    /// first use.
    pub(super) fn pair_for(&mut self, src: u32, dst: u32, rail: u16, dst_rail: u16, pin: Option<u16>) -> u32 {
        let h = &mut self.hosts;
        let key = (src, dst, rail, dst_rail, pin.map_or(u32::MAX, u32::from));
        if let Some(&p) = h.pair_index.get(&key) {
            return p;
        }
        let idx = h.pairs.len() as u32;
        let rate: Option<SharedRate> = (h.cfg.cc == CcKind::Mcc).then(|| Arc::new(Mutex::new(h.cfg.rate_controller())));
        let init = h.scheme.aimd_init_pkts.unwrap_or(h.proto.window_pkts);
        let aimd: Option<SharedAimd> = match h.scheme.rate {
            RateMode::PacketAimd => Some(Arc::new(Mutex::new(PacketAimd::new(init, h.proto.window_pkts)))),
            RateMode::PacketMprdma => Some(Arc::new(Mutex::new(PacketAimd::per_mark(init, h.proto.window_pkts)))),
            RateMode::Lb => None,
        };
        let flow_seed = self.seed ^ (idx as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        let policy = h.runtimes[src as usize].flow_paths(FlowInfo { dst_host: dst as usize, rail }, flow_seed);
        let send_policy = Box::new(SimPolicy::new(policy, pin, rate.clone(), aimd.clone()));
        // The receiving end only sends control packets; its policy is never asked for data paths.
        let recv_policy = Box::new(SimPolicy::new(
            h.runtimes[dst as usize].flow_paths(FlowInfo { dst_host: src as usize, rail }, flow_seed ^ 1),
            None,
            None,
            None,
        ));
        let (es, er) = (h.eps.len() as u32, h.eps.len() as u32 + 1);
        let rails = self.net.fab.rails as u32;
        let src_nic = src * rails + rail as u32;
        let dst_nic = dst * rails + dst_rail as u32;
        let now_us = self.now / PS_PER_US;
        let end = |nic, peer_nic, sender| Endpoint {
            nic,
            peer_nic,
            pair: idx,
            sender,
            timer_at: None,
            in_ready: false,
            idle: false,
            max_psn: None,
        };
        let send = Connection::new(h.proto.clone(), TOKEN_BASE + es as u64, TOKEN_BASE + er as u64, send_policy, now_us);
        h.conns.push(send);
        h.eps.push(end(src_nic, dst_nic, true));
        let recv = Connection::new(h.proto.clone(), TOKEN_BASE + er as u64, TOKEN_BASE + es as u64, recv_policy, now_us);
        h.conns.push(recv);
        h.eps.push(end(dst_nic, src_nic, false));
        h.pairs.push(Pair {
            ep_send: es,
            ep_recv: er,
            pending_send: VecDeque::new(),
            pending_recv: VecDeque::new(),
            posted_send: VecDeque::new(),
            posted_recv: VecDeque::new(),
            out_bytes: 0,
            rate,
            aimd,
            pump_at: None,
        });
        h.pair_index.insert(key, idx);
        idx
    }

    /// Post the pair's waiting receives, up to `RECV_AHEAD` outstanding.
    pub(super) fn pump_recv(&mut self, pair: u32) {
        let now_us = self.now_us();
        let h = &mut self.hosts;
        let p = &mut h.pairs[pair as usize];
        let mut posted = false;
        while p.posted_recv.len() < RECV_AHEAD {
            let Some(piece) = p.pending_recv.front().copied() else {
                break;
            };
            match h.conns[p.ep_recv as usize].post_recv(&[RecvSpec { len: piece.bytes, tag: 0 }], now_us) {
                Ok(id) => {
                    p.pending_recv.pop_front();
                    p.posted_recv.push_back((id, piece.transfer, piece.bytes));
                    posted = true;
                }
                Err(e) => {
                    tracing::debug!("post_recv: {e}");
                    break;
                }
            }
        }
        if posted {
            let ep = p.ep_recv;
            self.after_ep(ep);
        }
    }

    /// Post the pair's waiting sends that are ready, up to `SEND_AHEAD` outstanding and within the MCC
    /// window; wake the pair when the next one becomes ready.
    pub(super) fn pump_send(&mut self, pair: u32) {
        let now = self.now;
        let now_us = self.now_us();
        let h = &mut self.hosts;
        let p = &mut h.pairs[pair as usize];
        let window = p.rate.as_ref().map(|r| locked(r).window_bytes());
        let mut posted = false;
        while p.posted_send.len() < SEND_AHEAD {
            let Some(piece) = p.pending_send.front().copied() else {
                break;
            };
            if piece.ready_at > now {
                if p.pump_at.is_none_or(|x| piece.ready_at < x) {
                    p.pump_at = Some(piece.ready_at);
                    self.q.push(piece.ready_at, Event::Pump { pair });
                }
                break;
            }
            if let Some(w) = window {
                if p.out_bytes > 0 && p.out_bytes + piece.bytes > w {
                    break;
                }
            }
            match h.conns[p.ep_send as usize].post_send(piece.bytes, 0, now_us) {
                Ok(id) => {
                    p.pending_send.pop_front();
                    p.posted_send.push_back(PostedSend { id, bytes: piece.bytes, first_tx: None });
                    p.out_bytes += piece.bytes;
                    posted = true;
                }
                Err(e) => {
                    tracing::debug!("post_send: {e}");
                    break;
                }
            }
        }
        if posted {
            let ep = p.ep_send;
            self.after_ep(ep);
        }
    }

    /// The protocol timer of endpoint `ep` fired (stale timers, re-armed earlier or later, are ignored).
    pub(super) fn on_timer(&mut self, ep: u32) {
        if self.hosts.eps[ep as usize].timer_at == Some(self.now) {
            self.hosts.eps[ep as usize].timer_at = None;
            let now_us = self.now_us();
            self.hosts.conns[ep as usize].handle_timeout(now_us);
            self.after_ep(ep);
        }
    }

    /// After anything happened to endpoint `ep`: handle its completions, re-arm its timer, and make sure
    /// its NIC will ask it for datagrams.
    fn after_ep(&mut self, ep: u32) {
        while let Some(c) = self.hosts.conns[ep as usize].poll_completion() {
            self.on_completion(ep, c);
        }
        self.rearm(ep);
        let h = &mut self.hosts;
        let e = &mut h.eps[ep as usize];
        e.idle = may_skip(h.aimd, e.sender) && h.conns[ep as usize].transmit_idle();
        if !e.in_ready {
            e.in_ready = true;
            let nic = e.nic;
            self.hosts.ready[nic as usize].push_back(ep);
            let port = self.net.fab.nic_port[nic as usize];
            if !self.net.fab.ports[port as usize].free_pending {
                self.nic_pull(nic);
            }
        }
    }

    fn rearm(&mut self, ep: u32) {
        let e = &mut self.hosts.eps[ep as usize];
        if let Some(us) = self.hosts.conns[ep as usize].poll_timeout() {
            let at = (us * PS_PER_US).max(self.now);
            if e.timer_at.is_none_or(|x| at < x) {
                e.timer_at = Some(at);
                self.q.push(at, Event::Timer { ep });
            }
        }
    }

    fn on_completion(&mut self, ep: u32, c: Completion) {
        let pair = self.hosts.eps[ep as usize].pair;
        match c {
            Completion::Sent { msg, len } => {
                let p = &mut self.hosts.pairs[pair as usize];
                if let Some(i) = p.posted_send.iter().position(|x| x.id == msg) {
                    let m = p.posted_send.remove(i).expect("index from position");
                    let in_flight = p.out_bytes;
                    p.out_bytes -= m.bytes;
                    if let Some(r) = &p.rate {
                        // MCC's message delay is the message's RTT: from its first packet on the wire to
                        // its last byte acknowledged, not from the post (a message posted behind a window
                        // of others waits for the NIC, which says nothing about the network).
                        let sent = m.first_tx.unwrap_or(self.now);
                        locked(r).message_done(&MessageSample {
                            bytes: len,
                            sent_us: sent / PS_PER_US,
                            done_us: self.now / PS_PER_US,
                            in_flight,
                        });
                    }
                }
                self.pump_send(pair);
            }
            Completion::Received { msg, sizes } => {
                let p = &mut self.hosts.pairs[pair as usize];
                if let Some(i) = p.posted_recv.iter().position(|x| x.0 == msg) {
                    let (_, t, _) = p.posted_recv.remove(i).expect("index from position");
                    self.transfer_received(t, sizes.iter().sum());
                }
                self.pump_recv(pair);
            }
            Completion::Failed { msg, error } => {
                self.metrics.failed_requests += 1;
                tracing::warn!(msg = msg.0, "request failed: {error}");
            }
        }
    }

    /// The NIC `nic` is free: send the next datagram of its connections, round-robin.
    pub(super) fn nic_pull(&mut self, nic: u32) {
        let port = self.net.fab.nic_port[nic as usize];
        let now_us = self.now_us();
        let h = &mut self.hosts;
        while let Some(ep) = h.ready[nic as usize].pop_front() {
            let e = &mut h.eps[ep as usize];
            if e.idle {
                e.in_ready = false;
                continue;
            }
            let conn = &mut h.conns[ep as usize];
            if h.aimd && e.sender {
                if let Some(a) = &h.pairs[e.pair as usize].aimd {
                    // The window limits new data as the plugin applies a rate controller's window (the
                    // connection's packet window), never the tail-loss probe, a retransmission that
                    // replaces a lost packet or control packets: gating the whole connection held a
                    // probe back until an RTO once every packet in flight was lost.
                    conn.set_window_pkts(locked(a).window_pkts());
                }
            }
            let mut payload = NoPayload::default();
            let Some(t) = conn.poll_transmit(now_us, &mut payload, &mut h.txbuf) else {
                e.in_ready = false;
                continue;
            };
            e.idle = may_skip(h.aimd, e.sender) && conn.transmit_idle();
            let len = t.len;
            let data = matches!(Header::new_unchecked(&h.txbuf[..len]).packet_type(), Ok(PacketType::Data));
            if let (true, Some((msg, offset))) = (e.sender, payload.0) {
                let p = &mut h.pairs[e.pair as usize];
                if p.rate.is_some() {
                    note_first_tx(&mut p.posted_send, msg, offset, self.now);
                }
            }
            // Only a DATA packet's header is kept; control packets are kept whole.
            let hdr_len = if data { DATA_HEADER_LEN } else { len };
            // Receives are posted one buffer at a time, so a CTS (the longest control packet) has 44 bytes.
            assert!(hdr_len <= MAX_HDR, "control packet of {len} bytes exceeds the simulator's {MAX_HDR}");
            let mut hdr = [0u8; MAX_HDR];
            hdr[..hdr_len].copy_from_slice(&h.txbuf[..hdr_len]);
            let pkt = Packet {
                meta: PacketMeta {
                    src_nic: e.nic,
                    dst_nic: e.peer_nic,
                    wire_bytes: (len + self.net.overhead) as u32,
                    entropy: t.entropy,
                    data,
                    ce: false,
                },
                body: PacketBody { dgram_len: len as u32, hdr_len: hdr_len as u8, hdr },
            };
            h.ready[nic as usize].push_back(ep);
            // A transmission only arms deadlines at least one minimum RTO away (RTO, CTS, probes) and
            // clears the delayed-SACK one, so an armed timer within that horizon stays correct.
            let horizon = self.now + h.proto.rto_min_us * PS_PER_US;
            if h.eps[ep as usize].timer_at.is_none_or(|t| t > horizon) {
                self.rearm(ep);
            }
            let wire_bytes = pkt.meta.wire_bytes;
            let id = self.net.pool.alloc(pkt);
            self.metrics.created += 1;
            self.start_tx(port, id, wire_bytes);
            return;
        }
    }

    /// Packet `pkt` reached its destination NIC: hand it to the connection end its token names.
    pub(super) fn deliver(&mut self, pkt: u32) {
        self.metrics.delivered += 1;
        let &PacketMeta { dst_nic, data, ce, .. } = self.net.pool.get(pkt);
        let h = &mut self.hosts;
        let p = self.net.pool.body(pkt);
        let ep = wire::peek_token(p.hdr_bytes())
            .and_then(|t| t.checked_sub(TOKEN_BASE))
            .filter(|&i| (i as usize) < h.eps.len() && h.eps[i as usize].nic == dst_nic);
        let Some(ep) = ep else {
            self.net.pool.release(pkt);
            return;
        };
        let ep = ep as u32;
        let len = p.dgram_len as usize;
        h.rxbuf[..p.hdr_bytes().len()].copy_from_slice(p.hdr_bytes());
        if ce {
            // The mark a switch made on the way (the DATA header is kept whole).
            let mut hdr = Header::new_unchecked(&mut h.rxbuf[..p.hdr_bytes().len()]);
            let flags = hdr.flags();
            hdr.set_flags(flags | FLAG_CE);
        }
        if data {
            let psn = DataPacket::new_unchecked(p.hdr_bytes()).psn();
            let e = &mut h.eps[ep as usize];
            match e.max_psn {
                Some(m) if psn < m => self.metrics.record_reorder(m - psn),
                _ => {
                    e.max_psn = Some(psn);
                    self.metrics.record_reorder(0);
                }
            }
        }
        self.net.pool.release(pkt);
        let now_us = self.now_us();
        self.hosts.conns[ep as usize].handle_datagram(&self.hosts.rxbuf[..len], now_us, &mut NoPlacement);
        self.after_ep(ep);
        // An acknowledgement may open the window of a gated sender or the MCC window of its pair.
        if self.hosts.eps[ep as usize].sender {
            let pair = self.hosts.eps[ep as usize].pair;
            if self.hosts.pairs[pair as usize].rate.is_some() {
                self.pump_send(pair);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_message_is_stamped_by_the_first_transmission_of_its_first_packet_only() {
        let (a, b) = (MsgId(1), MsgId(2));
        let mut posted: VecDeque<PostedSend> = [a, b].into_iter().map(|id| PostedSend { id, bytes: 65536, first_tx: None }).collect();
        note_first_tx(&mut posted, a, 4096, 5);
        assert_eq!(posted[0].first_tx, None, "not its first packet");
        note_first_tx(&mut posted, a, 0, 10);
        note_first_tx(&mut posted, a, 0, 30);
        assert_eq!(posted[0].first_tx, Some(10), "a retransmission of the first packet does not move the stamp");
        assert_eq!(posted[1].first_tx, None, "the next message is not stamped by the first one's packets");
        note_first_tx(&mut posted, b, 0, 40);
        assert_eq!(posted[1].first_tx, Some(40));
        note_first_tx(&mut posted, MsgId(9), 0, 50);
        assert!(posted.iter().all(|m| m.first_tx != Some(50)), "an unknown message stamps nothing");
    }
}
