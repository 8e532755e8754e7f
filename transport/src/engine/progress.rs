//! The progress thread. NCCL drives a comm only while it has requests to test, but a reliable
//! transport must keep answering after that: the receiver of the last message still owes its SACK,
//! a lost SACK needs the data retransmitted, keepalives and timers must fire. So while any comm is
//! open, one thread per engine wakes on datagrams (poll on the rails' sockets) or on the earliest
//! protocol timer and progresses every comm it can lock without waiting. It starts with the first comm
//! and is joined when the last one closes, so no thread outlives the comms (NCCL dlcloses the plugin
//! after closing them).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};
use std::thread::JoinHandle;

use nix::poll::{PollFd, PollFlags};
use nix::sys::time::TimeSpec;
use parking_lot::Mutex;

use super::comm::SharedCore;
use super::net::NetInner;

/// Longest the thread sleeps with nothing due (bounds how stale an idle comm's timers can get).
const MAX_SLEEP_US: u64 = 1_000;

/// A comm whose owner drove it this recently is the owner's business: the thread skips it, so that
/// on a busy host it does not compete with NCCL's own progress thread for the CPU.
const OWNER_ACTIVE_US: u64 = 500;

/// Registry of open comms and the thread that serves them.
#[derive(Default)]
pub(crate) struct Progress {
    comms: Mutex<Vec<Weak<Mutex<super::comm::CommCore>>>>,
    thread: Mutex<Option<(Arc<AtomicBool>, JoinHandle<()>)>>,
}

impl Progress {
    /// Serve `core` from now on, starting the thread if needed.
    pub fn adopt(&self, net: &Arc<NetInner>, core: &SharedCore) {
        self.comms.lock().push(Arc::downgrade(core));
        let mut t = self.thread.lock();
        if t.is_none() {
            let stop = Arc::new(AtomicBool::new(false));
            let weak_net = Arc::downgrade(net);
            let flag = stop.clone();
            let handle = std::thread::Builder::new()
                .name("prism-progress".into())
                .spawn(move || run(weak_net, flag))
                .expect("spawning the progress thread");
            *t = Some((stop, handle));
        }
    }

    /// A comm closed: forget the dead ones and stop the thread when none is left.
    pub fn closed(&self) {
        let empty = {
            let mut comms = self.comms.lock();
            comms.retain(|w| w.upgrade().is_some_and(|c| !c.lock().is_closed()));
            comms.is_empty()
        };
        if empty {
            self.stop();
        }
    }

    /// Stop and join the thread (idempotent).
    pub fn stop(&self) {
        let t = self.thread.lock().take();
        if let Some((flag, handle)) = t {
            flag.store(true, Ordering::Release);
            if handle.thread().id() != std::thread::current().id() {
                let _ = handle.join();
            }
        }
    }

    fn live(&self) -> Vec<SharedCore> {
        self.comms.lock().iter().filter_map(Weak::upgrade).collect()
    }
}

fn run(net: Weak<NetInner>, stop: Arc<AtomicBool>) {
    while !stop.load(Ordering::Acquire) {
        let Some(net) = net.upgrade() else { return };
        let start = net.now_us();
        let mut wake = start + MAX_SLEEP_US;
        let mut orphans = false;
        for core in net.progress.live() {
            if let Some(mut c) = core.try_lock() {
                if c.owner_active(start, OWNER_ACTIVE_US) {
                    wake = wake.min(start + OWNER_ACTIVE_US);
                    continue;
                }
                orphans = true;
                c.progress();
                if let Some(t) = c.next_wake() {
                    wake = wake.min(t);
                }
            }
        }
        let now = net.now_us();
        let sleep_us = wake.saturating_sub(now);
        if sleep_us == 0 {
            continue;
        }
        if !orphans {
            // Every comm has an active owner: just check back later.
            std::thread::sleep(std::time::Duration::from_micros(sleep_us));
            continue;
        }
        if net.rails.iter().any(|r| r.udp.is_none()) {
            // Verbs completions have no descriptor here: poll the CQs often.
            std::thread::sleep(std::time::Duration::from_micros(sleep_us.min(100)));
            continue;
        }
        // Wake early when any rail has datagrams.
        let mut fds: Vec<PollFd<'_>> = net.rails.iter().filter_map(|r| r.udp.as_ref()).map(|u| PollFd::new(u.rx_fd(), PollFlags::POLLIN)).collect();
        let ts = TimeSpec::from_duration(std::time::Duration::from_micros(sleep_us));
        let _ = nix::poll::ppoll(&mut fds, Some(ts), None);
    }
}
