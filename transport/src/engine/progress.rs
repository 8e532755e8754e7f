//! The progress thread. NCCL drives a comm only while it has requests to test, but a reliable
//! transport must keep answering after that: the receiver of the last message still owes its SACK,
//! a lost SACK needs the data retransmitted, keepalives and timers must fire. So while any comm is
//! open, one thread per engine wakes on datagrams (poll on the rails' sockets) or on the earliest
//! protocol timer and progresses every comm it can lock without waiting. It starts with the first comm
//! and is joined when the last one closes, so no thread outlives the comms (NCCL dlcloses the plugin
//! after closing them).

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use nix::poll::{PollFd, PollFlags};
use nix::sys::time::TimeSpec;
use parking_lot::Mutex;

use super::rail::Rail;

/// What the thread needs of the engine (implemented by `shared::NetInner`; a trait so that this
/// module depends on neither the engine nor the comms).
pub(crate) trait Host: Send + Sync {
    /// The engine's clock (µs).
    fn now_us(&self) -> u64;
    /// The registry of comms this thread serves.
    fn progress(&self) -> &Progress;
    /// The rails whose sockets wake the thread.
    fn rails(&self) -> &[Arc<Rail>];
}

/// What the thread does with a comm (implemented by `comm::CommCore`).
pub(crate) trait Driven: Send {
    /// The comm was closed (the registry forgets it).
    fn is_closed(&self) -> bool;
    /// Its owner drives it: it holds requests of the comm and drove it within the last `window_us`
    /// before `now`.
    fn owner_active(&self, now: u64, window_us: u64) -> bool;
    /// Progress it (receive, send, timers).
    fn progress(&mut self);
    /// When it next needs progress (engine clock, µs), if ever.
    fn next_wake(&mut self) -> Option<u64>;
}

/// A comm as both its owner and the thread hold it.
pub(crate) type Shared<T> = Arc<Mutex<T>>;
type DynDriven = Mutex<dyn Driven>;

/// Longest the thread sleeps with nothing due (bounds how stale an idle comm's timers can get).
const MAX_SLEEP_US: u64 = 1_000;

/// A comm whose owner holds requests of it and drove it this recently is the owner's business: the
/// thread skips it, so that on a busy host it does not compete with NCCL's own progress thread for
/// the CPU. Longer than a scheduler time slice (a few ms): an owner that the kernel preempted in favour
/// of another busy thread is still driving its comms, and a thread that took over every time woke on
/// every datagram and took the comm's lock from the owner (500 us cost a 2-rank 64 MiB loopback
/// sendrecv on 2 cores about a quarter of its throughput). Half the default retransmission-timeout
/// floor (`PRISM_RTO_MIN_US`), so that an owner that holds requests but stopped testing them delays
/// the comm's timers by less than one timeout.
const OWNER_ACTIVE_US: u64 = 10_000;

/// Longest `stop` waits, after the join, for the kernel to finish the thread's exit.
const REAP_TIMEOUT: Duration = Duration::from_secs(2);

/// Registry of open comms and the thread that serves them. One lock for both, so that a comm adopted
/// while the last one closes either keeps the thread or starts a new one, never finds a thread that
/// is about to stop.
#[derive(Default)]
pub(crate) struct Progress {
    state: Mutex<State>,
    /// Held by every close (and `stop`) from before it looks at the registry until any thread it took
    /// is gone, so that when two comms close at once, the one that does not stop the thread still
    /// returns only after it is gone. Taken before `state`, never while holding it.
    stopping: Mutex<()>,
}

#[derive(Default)]
struct State {
    comms: Vec<Weak<DynDriven>>,
    thread: Option<Worker>,
}

impl Progress {
    /// Serve `core` from now on, starting the thread if needed.
    pub fn adopt<H: Host + 'static, D: Driven + 'static>(&self, net: &Arc<H>, core: &Shared<D>) {
        let mut st = self.state.lock();
        let core: Arc<DynDriven> = core.clone();
        st.comms.push(Arc::downgrade(&core));
        if st.thread.is_none() {
            let net: Arc<dyn Host> = net.clone();
            let weak_net = Arc::downgrade(&net);
            match Worker::spawn("prism-progress", move |stop| run(weak_net, stop)) {
                Ok(w) => st.thread = Some(w),
                // The owner's own calls still progress the comm; the next adopt tries again.
                Err(e) => tracing::warn!("cannot start the progress thread ({e}); comms progress only when NCCL tests them"),
            }
        }
    }

    /// A comm closed: forget the dead ones and stop the thread when none is left.
    pub fn closed(&self) {
        let _stopping = self.stopping.lock();
        let last = {
            let mut st = self.state.lock();
            st.comms.retain(|w| w.upgrade().is_some_and(|c| !c.lock().is_closed()));
            if st.comms.is_empty() {
                st.thread.take()
            } else {
                None
            }
        };
        // Joined outside the lock: the thread itself takes it (`live`) until it sees the stop flag.
        if let Some(w) = last {
            w.stop();
        }
    }

    /// Stop and join the thread (idempotent).
    pub fn stop(&self) {
        let _stopping = self.stopping.lock();
        let t = self.state.lock().thread.take();
        if let Some(w) = t {
            w.stop();
        }
    }

    fn live(&self) -> Vec<Arc<DynDriven>> {
        self.state.lock().comms.iter().filter_map(Weak::upgrade).collect()
    }
}

/// A thread that runs until told to stop, and whose `stop` returns only once the kernel no longer
/// lists it. `JoinHandle::join` is not enough for that: it returns when the kernel clears the thread's
/// tid word (CLONE_CHILD_CLEARTID, early in the thread's exit), while the task stays in
/// `/proc/self/task` until its exit completes a moment later, a moment that a loaded host or an
/// emulated VM stretches. A caller that closes the last comm and then unloads the plugin (NCCL
/// dlcloses it after closing its comms) must find no Prism thread left.
pub(crate) struct Worker {
    stop: Arc<AtomicBool>,
    /// The thread's entry in procfs (`/proc/<pid>/task/<tid>`), recorded first thing by the thread.
    /// Read from `/proc/thread-self`, so the numbers are those of the procfs mounted here even when it
    /// belongs to another PID namespace; unset without procfs.
    task: Arc<OnceLock<PathBuf>>,
    handle: JoinHandle<()>,
}

impl Worker {
    /// Run `body(stop)` on a new thread named `name`; `body` returns once `stop` is set.
    pub fn spawn(name: &str, body: impl FnOnce(Arc<AtomicBool>) + Send + 'static) -> std::io::Result<Worker> {
        let stop = Arc::new(AtomicBool::new(false));
        let task = Arc::new(OnceLock::new());
        let (flag, own_task) = (stop.clone(), task.clone());
        let handle = std::thread::Builder::new().name(name.into()).spawn(move || {
            if let Ok(link) = std::fs::read_link("/proc/thread-self") {
                let _ = own_task.set(PathBuf::from("/proc").join(link));
            }
            body(flag);
        })?;
        Ok(Worker { stop, task, handle })
    }

    /// Tell the thread to stop, join it and wait (at most [`REAP_TIMEOUT`]) until the kernel has
    /// released it. Called on the thread itself, it only sets the flag (a thread cannot join itself)
    /// and the thread ends when it next looks; nothing does that today, as the thread never owns a comm
    /// (it holds only the shared cores, whose drop does not close anything).
    pub fn stop(self) {
        self.stop.store(true, Ordering::Release);
        if self.handle.thread().id() == std::thread::current().id() {
            return;
        }
        // A panic in the thread was already reported by the panic hook; there is nothing to add.
        let _ = self.handle.join();
        if let Some(task) = self.task.get() {
            wait_released(task, REAP_TIMEOUT);
        }
    }
}

/// Waits until the exited thread's procfs entry is gone, or `limit` has passed (then logs a warning:
/// something, e.g. a tracer, holds the exited thread).
fn wait_released(path: &std::path::Path, limit: Duration) {
    let start = Instant::now();
    let mut pause = Duration::from_micros(10);
    while path.exists() {
        if start.elapsed() >= limit {
            tracing::warn!("the stopped progress thread ({}) is still listed after {limit:?}; going on", path.display());
            return;
        }
        std::thread::sleep(pause);
        pause = (pause * 2).min(Duration::from_millis(1));
    }
}

/// Panics of `CommCore::progress` reported so far (a bug in Prism; the thread survives it).
const PANICS_REPORTED: u32 = 3;

fn panic_text(payload: &(dyn std::any::Any + Send)) -> &str {
    payload.downcast_ref::<&str>().copied().or_else(|| payload.downcast_ref::<String>().map(String::as_str)).unwrap_or("(no message)")
}

fn run(net: Weak<dyn Host>, stop: Arc<AtomicBool>) {
    let mut panics = 0u32;
    while !stop.load(Ordering::Acquire) {
        let Some(net) = net.upgrade() else { return };
        let start = net.now_us();
        let mut wake = start + MAX_SLEEP_US;
        let mut orphans = false;
        for core in net.progress().live() {
            if let Some(mut c) = core.try_lock() {
                if c.owner_active(start, OWNER_ACTIVE_US) {
                    wake = wake.min(start + OWNER_ACTIVE_US);
                    continue;
                }
                orphans = true;
                // A panic must not end the thread that keeps every other comm alive: it is reported
                // (the first few) and the loop goes on; the owner's own calls still reach the comm.
                if let Err(p) = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| c.progress())) {
                    panics += 1;
                    if panics <= PANICS_REPORTED {
                        tracing::error!("progress of a comm panicked (a Prism bug, please report it): {}", panic_text(&*p));
                    }
                }
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
        if net.rails().iter().any(|r| r.backend.udp().is_none()) {
            // Verbs completions have no descriptor here: poll the CQs often.
            std::thread::sleep(std::time::Duration::from_micros(sleep_us.min(100)));
            continue;
        }
        // Wake early when any rail has datagrams, on its rail port or on a send-only socket (those
        // are discarded here: nobody else reads them while every comm is idle).
        let udp_rails: Vec<_> = net.rails().iter().filter(|r| r.backend.udp().is_some()).collect();
        let mut fds: Vec<PollFd<'_>> = udp_rails
            .iter()
            .filter_map(|r| r.backend.udp())
            .flat_map(|u| [PollFd::new(u.rx_fd(), PollFlags::POLLIN), PollFd::new(u.stray_fd(), PollFlags::POLLIN)])
            .collect();
        let ts = TimeSpec::from_duration(std::time::Duration::from_micros(sleep_us));
        if nix::poll::ppoll(&mut fds, Some(ts), None).is_ok_and(|n| n > 0) {
            for (rail, pair) in udp_rails.iter().zip(fds.chunks(2)) {
                if pair[0].revents().is_some_and(|r| r.contains(PollFlags::POLLIN)) {
                    rail.rx_readable();
                }
                if pair[1].revents().is_some_and(|r| r.contains(PollFlags::POLLIN)) {
                    rail.drain_strays();
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The kernel lists an exited thread for a moment after `join` returns; the window is narrow, so
    /// the claim is checked over many threads stopped from several threads at once (which is what
    /// widens it: a stopper woken on another CPU races the exit). Without the wait after the join,
    /// 400 to 12,000 of these 80,000 stops found the thread still listed (2-core host, idle to loaded).
    #[test]
    fn a_stopped_worker_is_no_longer_listed_by_the_kernel() {
        const STOPPERS: usize = 8;
        const ROUNDS: usize = 10_000;
        assert!(std::path::Path::new("/proc/self/task").is_dir(), "the test needs procfs");
        let stoppers: Vec<_> = (0..STOPPERS)
            .map(|_| {
                std::thread::spawn(|| {
                    let mut listed = 0;
                    for _ in 0..ROUNDS {
                        let w = Worker::spawn("prism-test", |_| {}).expect("spawning a worker");
                        let task = w.task.clone();
                        w.stop();
                        let task = task.get().expect("the worker recorded its procfs entry");
                        assert!(task.starts_with("/proc") && task.to_string_lossy().contains("/task/"), "{}", task.display());
                        listed += usize::from(task.exists());
                    }
                    listed
                })
            })
            .collect();
        let listed: usize = stoppers.into_iter().map(|s| s.join().expect("stopper thread")).sum();
        assert_eq!(listed, 0, "{listed} of {} stopped workers were still listed in /proc/self/task", STOPPERS * ROUNDS);
    }

    #[test]
    fn stop_waits_for_the_worker_to_see_its_flag() {
        let seen = Arc::new(AtomicBool::new(false));
        let s = seen.clone();
        let w = Worker::spawn("prism-test", move |stop| {
            while !stop.load(Ordering::Acquire) {
                std::thread::sleep(Duration::from_millis(1));
            }
            s.store(true, Ordering::Release);
        })
        .expect("spawning a worker");
        std::thread::sleep(Duration::from_millis(20));
        assert!(!seen.load(Ordering::Acquire), "the worker ended before it was told to");
        w.stop();
        assert!(seen.load(Ordering::Acquire), "stop returned before the worker ended");
    }
}
