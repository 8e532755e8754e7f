//! Lifecycle, concurrency and resource bounds of the engine over loopback, as a job running NCCL
//! exercises them: closes with requests in flight, a listener closed under a pending connect, 100,000
//! messages and 1,000 engine cycles with memory, descriptors and threads measured before and after,
//! 300 pairs at once, comms driven from several threads, small socket buffers, Ethereal batching.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{fds, net, pair, prism_threads, rss_kb, SharedRecv, VecSend};
use prism_transport::engine::{Net, RecvBuf, RecvComm, ReqId, SendComm, HANDLE_LEN};

/// The tests measure this process's memory, descriptors and threads, which a test running beside
/// them would move: one at a time.
fn serial() -> std::sync::MutexGuard<'static, ()> {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

fn pattern(seed: u64, len: usize) -> Vec<u8> {
    (0..len).map(|i| ((i as u64).wrapping_mul(2654435761).wrapping_add(seed * 97) >> 7) as u8).collect()
}

/// Pipelined: `n` messages of `len` bytes, up to `depth` in flight, each checked. Returns elapsed.
fn stream(s: &mut SendComm, r: &mut RecvComm, n: usize, len: usize, depth: usize, limit: Duration, seed: u64) -> Duration {
    let data = Arc::new(pattern(seed, len));
    let t0 = Instant::now();
    let mut posted_r = 0usize;
    let mut posted_s = 0usize;
    let mut done_r = 0usize;
    let mut done_s = 0usize;
    let mut rq: std::collections::VecDeque<(ReqId, SharedRecv)> = Default::default();
    let mut sq: std::collections::VecDeque<ReqId> = Default::default();
    while done_r < n || done_s < n {
        while posted_r < n && rq.len() < depth {
            let b = SharedRecv::filled(len.max(1), 0);
            match r.irecv(vec![(Box::new(b.clone()) as Box<dyn RecvBuf>, 0)]).unwrap() {
                Some(id) => {
                    rq.push_back((id, b));
                    posted_r += 1;
                }
                None => break,
            }
        }
        while posted_s < n && sq.len() < depth {
            match s.isend(Box::new(VecSend(data.clone())), 0).unwrap() {
                Some(id) => {
                    sq.push_back(id);
                    posted_s += 1;
                }
                None => break,
            }
        }
        if let Some(&id) = sq.front() {
            if s.test(id).unwrap().is_some() {
                sq.pop_front();
                done_s += 1;
            }
        }
        if let Some((id, b)) = rq.front() {
            if let Some(sizes) = r.test(*id).unwrap() {
                assert_eq!(sizes, vec![len]);
                assert!(b.0.lock().unwrap()[..len] == data[..], "wrong bytes in message {done_r}");
                rq.pop_front();
                done_r += 1;
            }
        }
        assert!(t0.elapsed() < limit, "stream stuck: sent {done_s}/{n}, received {done_r}/{n} after {:?}", t0.elapsed());
    }
    t0.elapsed()
}

/// 100,000 small messages on one comm: memory must plateau.
#[test]
fn hundred_thousand_small_messages_keep_memory_flat() {
    let _serial = serial();
    let net = net(&[("PRISM_SEED", "42")]);
    let (mut s, mut r) = pair(&net);
    stream(&mut s, &mut r, 10_000, 200, 32, Duration::from_secs(20), 1);
    let (rss0, fd0, th0) = (rss_kb(), fds(), prism_threads());
    let mut t = Duration::ZERO;
    for k in 0..9 {
        t += stream(&mut s, &mut r, 10_000, 200, 32, Duration::from_secs(20), 2 + k);
        eprintln!("after {} more: RSS {} KB fds {} threads {}", (k + 1) * 10_000, rss_kb(), fds(), prism_threads());
    }
    let (rss1, fd1, th1) = (rss_kb(), fds(), prism_threads());
    eprintln!("90,000 messages in {t:?}; RSS {rss0} -> {rss1} KB, fds {fd0} -> {fd1}, threads {th0} -> {th1}");
    assert!(rss1 < rss0 + 4096, "RSS grew {} KB over 90,000 messages", rss1 - rss0);
    assert_eq!(fd0, fd1);
}

/// 300 comm pairs open at once in one engine, data on every one.
#[test]
fn three_hundred_pairs_at_once_all_move_data() {
    let _serial = serial();
    let net = net(&[("PRISM_SEED", "42")]);
    let fd0 = fds();
    eprintln!("RSS before {} KB", rss_kb());
    let t0 = Instant::now();
    let mut pairs: Vec<(SendComm, RecvComm)> = (0..300).map(|_| pair(&net)).collect();
    eprintln!("300 pairs connected in {:?}; fds {fd0} -> {}, threads {}, RSS {} KB", t0.elapsed(), fds(), prism_threads(), rss_kb());
    let t1 = Instant::now();
    for round in 0..3 {
        let tr = Instant::now();
        for (i, (s, r)) in pairs.iter_mut().enumerate() {
            stream(s, r, 4, 70_000, 4, Duration::from_secs(10), (round * 1000 + i) as u64);
        }
        eprintln!("round {round}: {:?}", tr.elapsed());
    }
    eprintln!(
        "data on 300 pairs x3 in {:?}; RSS {} KB, VmData {}",
        t1.elapsed(),
        rss_kb(),
        std::fs::read_to_string("/proc/self/status").unwrap().lines().find(|l| l.starts_with("VmData")).unwrap()
    );
    drop(pairs);
    assert_eq!(fds(), fd0);
}

/// Several threads each drive their own comms at once (NCCL's progress threads of several
/// communicators in one process), while another thread opens and closes comms.
#[test]
fn threads_driving_their_own_comms_concurrently_all_finish() {
    let _serial = serial();
    let net = Arc::new(net(&[("PRISM_SEED", "42")]));
    let t0 = Instant::now();
    let workers: Vec<_> = (0..4)
        .map(|w| {
            let net = net.clone();
            std::thread::spawn(move || {
                let mut pairs: Vec<(SendComm, RecvComm)> = (0..8).map(|_| pair(&net)).collect();
                for round in 0..20 {
                    for (i, (s, r)) in pairs.iter_mut().enumerate() {
                        let len = if (i + round) % 3 == 0 { 300_000 } else { 1000 };
                        stream(s, r, 4, len, 4, Duration::from_secs(20), (w * 100_000 + round * 100 + i) as u64);
                    }
                }
            })
        })
        .collect();
    let churn = {
        let net = net.clone();
        std::thread::spawn(move || {
            for i in 0..100 {
                let (mut s, mut r) = pair(&net);
                stream(&mut s, &mut r, 2, 5000, 2, Duration::from_secs(20), i);
            }
        })
    };
    for w in workers {
        w.join().expect("worker");
    }
    churn.join().expect("churn");
    eprintln!("all done in {:?}", t0.elapsed());
}

/// Two threads each drive one half of pairs that cross between them: thread A owns the send
/// comms, thread B the receive comms (sender and receiver ranks' progress threads in one process).
#[test]
fn sender_and_receiver_on_different_threads() {
    let _serial = serial();
    let net = Arc::new(net(&[("PRISM_SEED", "42")]));
    let pairs: Vec<(SendComm, RecvComm)> = (0..16).map(|_| pair(&net)).collect();
    let (ss, rs): (Vec<_>, Vec<_>) = pairs.into_iter().unzip();
    let n = 2000usize;
    let len = 4096usize;
    let data = Arc::new(pattern(9, len));
    let d2 = data.clone();
    let t0 = Instant::now();
    let a = std::thread::spawn(move || {
        let mut ss = ss;
        let mut q: Vec<std::collections::VecDeque<ReqId>> = vec![Default::default(); ss.len()];
        let mut posted = vec![0usize; ss.len()];
        let mut done = vec![0usize; ss.len()];
        while done.iter().any(|&d| d < n) {
            for (i, s) in ss.iter_mut().enumerate() {
                while posted[i] < n && q[i].len() < 8 {
                    match s.isend(Box::new(VecSend(d2.clone())), 0).unwrap() {
                        Some(id) => {
                            q[i].push_back(id);
                            posted[i] += 1;
                        }
                        None => break,
                    }
                }
                if let Some(&id) = q[i].front() {
                    if s.test(id).unwrap().is_some() {
                        q[i].pop_front();
                        done[i] += 1;
                    }
                }
            }
            assert!(t0.elapsed() < Duration::from_secs(30), "senders stuck: {done:?}");
        }
    });
    let b = std::thread::spawn(move || {
        let mut rs = rs;
        let mut q: Vec<std::collections::VecDeque<(ReqId, SharedRecv)>> = (0..rs.len()).map(|_| Default::default()).collect();
        let mut posted = vec![0usize; rs.len()];
        let mut done = vec![0usize; rs.len()];
        while done.iter().any(|&d| d < n) {
            for (i, r) in rs.iter_mut().enumerate() {
                while posted[i] < n && q[i].len() < 8 {
                    let b = SharedRecv::filled(len, 0);
                    match r.irecv(vec![(Box::new(b.clone()) as Box<dyn RecvBuf>, 0)]).unwrap() {
                        Some(id) => {
                            q[i].push_back((id, b));
                            posted[i] += 1;
                        }
                        None => break,
                    }
                }
                if let Some((id, b)) = q[i].front() {
                    if let Some(sizes) = r.test(*id).unwrap() {
                        assert_eq!(sizes, vec![len]);
                        assert!(b.0.lock().unwrap()[..] == data[..], "wrong bytes on comm {i}");
                        q[i].pop_front();
                        done[i] += 1;
                    }
                }
            }
            assert!(t0.elapsed() < Duration::from_secs(30), "receivers stuck: {done:?}");
        }
    });
    a.join().expect("senders");
    b.join().expect("receivers");
    eprintln!("16 pairs x {n} msgs across threads in {:?}", t0.elapsed());
}

/// The receive side closes while a send is posted: the send must fail (or complete), never hang.
#[test]
fn a_pending_send_ends_when_the_receiver_closes() {
    let _serial = serial();
    let net = net(&[("PRISM_PEER_TIMEOUT_MS", "3000"), ("PRISM_STALL_TIMEOUT_MS", "3000")]);
    for len in [0usize, 1000, 1 << 20] {
        let (mut s, r) = pair(&net);
        let id = s.isend(Box::new(VecSend::new(pattern(1, len))), 0).unwrap().unwrap();
        // Let the send reach proto and wait for a CTS that never comes.
        for _ in 0..10 {
            let _ = s.test(id);
        }
        drop(r);
        let t0 = Instant::now();
        loop {
            match s.test(id) {
                Ok(Some(_)) => panic!("a send without a receive completed"),
                Ok(None) => {}
                Err(e) => {
                    eprintln!("len {len}: send failed after {:?}: {e}", t0.elapsed());
                    break;
                }
            }
            assert!(t0.elapsed() < Duration::from_secs(8), "len {len}: send still pending {:?} after the receiver closed", t0.elapsed());
        }
    }
}

/// The send side closes while a receive is posted: the receive must fail, never hang.
#[test]
fn a_pending_receive_ends_when_the_sender_closes() {
    let _serial = serial();
    let net = net(&[("PRISM_PEER_TIMEOUT_MS", "3000"), ("PRISM_STALL_TIMEOUT_MS", "3000")]);
    let (s, mut r) = pair(&net);
    let b = SharedRecv::filled(4096, 0);
    let id = r.irecv(vec![(Box::new(b) as Box<dyn RecvBuf>, 0)]).unwrap().unwrap();
    for _ in 0..10 {
        let _ = r.test(id);
    }
    drop(s);
    let t0 = Instant::now();
    loop {
        match r.test(id) {
            Ok(Some(_)) => panic!("a receive without a send completed"),
            Ok(None) => {}
            Err(e) => {
                eprintln!("receive failed after {:?}: {e}", t0.elapsed());
                break;
            }
        }
        assert!(t0.elapsed() < Duration::from_secs(8), "receive still pending after the sender closed");
    }
}

/// A sender closes with sends in flight, mid-transfer of a large message: the receiver's
/// receive ends (completes or fails), and a new pair on the same engine works.
#[test]
fn close_send_mid_transfer_then_receiver_ends_and_engine_still_works() {
    let _serial = serial();
    let net = net(&[("PRISM_PEER_TIMEOUT_MS", "3000"), ("PRISM_STALL_TIMEOUT_MS", "3000")]);
    let (mut s, mut r) = pair(&net);
    let len = 64 << 20;
    let b = SharedRecv::filled(len, 0);
    let rid = r.irecv(vec![(Box::new(b) as Box<dyn RecvBuf>, 0)]).unwrap().unwrap();
    let sid = s.isend(Box::new(VecSend::new(vec![5u8; len])), 0).unwrap().unwrap();
    let mut early = None;
    for _ in 0..3 {
        let _ = s.test(sid);
        match r.test(rid) {
            Ok(None) => {}
            other => {
                early = Some(format!("{other:?}"));
                break;
            }
        }
    }
    drop(s);
    if let Some(e) = early {
        eprintln!("the receive ended before the close: {e}");
    } else {
        let t0 = Instant::now();
        loop {
            match r.test(rid) {
                Ok(Some(_)) => panic!("completed a receive whose sender closed mid-way"),
                Ok(None) => {}
                Err(e) => {
                    eprintln!("receive ended after {:?}: {e}", t0.elapsed());
                    break;
                }
            }
            assert!(t0.elapsed() < Duration::from_secs(8), "receive still pending after the sender closed");
        }
    }
    let (mut s2, mut r2) = pair(&net);
    stream(&mut s2, &mut r2, 10, 100_000, 4, Duration::from_secs(10), 3);
}

/// Listen, start a connect, close the listener before accept: the connect fails, never hangs
/// and never returns a comm; fds come back.
#[test]
fn closing_the_listener_with_a_connect_pending_fails_the_connect() {
    let _serial = serial();
    let net = net(&[("PRISM_CONNECT_TIMEOUT_MS", "3000")]);
    let fd0 = fds();
    for _ in 0..20 {
        let mut handle = [0u8; HANDLE_LEN];
        let lis = net.listen(0, &mut handle).unwrap();
        assert!(net.connect(0, &mut handle).unwrap().is_none());
        assert!(net.connect(0, &mut handle).unwrap().is_none());
        drop(lis);
        let t0 = Instant::now();
        loop {
            match net.connect(0, &mut handle) {
                Ok(Some(_)) => panic!("connected to a closed listener"),
                Ok(None) => {}
                Err(_) => break,
            }
            assert!(t0.elapsed() < Duration::from_secs(6), "connect pending past its timeout");
            std::thread::sleep(Duration::from_millis(1));
        }
    }
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(fds(), fd0, "descriptors left behind");
}

/// An engine created, used by one pair and dropped, 300 times over: descriptors and Prism's threads
/// come back to what they were.
#[test]
fn three_hundred_engine_cycles_leave_no_descriptor_or_thread() {
    let _serial = serial();
    let fd0 = fds();
    let th0 = prism_threads();
    let rss0 = rss_kb();
    for i in 0..300 {
        let net: Net = net(&[("PRISM_SEED", "42")]);
        let (mut s, mut r) = pair(&net);
        stream(&mut s, &mut r, 2, 1000, 2, Duration::from_secs(10), i);
        drop((s, r));
        drop(net);
        if i == 50 {
            eprintln!("after 50 engines: RSS {} KB, fds {}, threads {}", rss_kb(), fds(), prism_threads());
        }
    }
    eprintln!("after 300 engines: RSS {rss0} -> {} KB, fds {fd0} -> {}, threads {th0} -> {}", rss_kb(), fds(), prism_threads());
    assert_eq!(fds(), fd0);
    assert_eq!(prism_threads(), th0);
}

/// CPU time (user + system, in clock ticks) of every thread of this process named `name`.
fn thread_ticks(name: &str) -> u64 {
    let mut total = 0;
    for e in std::fs::read_dir("/proc/self/task").unwrap().flatten() {
        let comm = std::fs::read_to_string(e.path().join("comm")).unwrap_or_default();
        if comm.trim() != name {
            continue;
        }
        let stat = std::fs::read_to_string(e.path().join("stat")).unwrap_or_default();
        let after = &stat[stat.rfind(')').unwrap() + 2..];
        let f: Vec<&str> = after.split_whitespace().collect();
        total += f[11].parse::<u64>().unwrap() + f[12].parse::<u64>().unwrap();
    }
    total
}

/// A send comm whose peer closed, left open and idle, must not make the progress thread spin.
#[test]
fn a_comm_whose_peer_closed_does_not_spin_the_progress_thread() {
    let _serial = serial();
    let net = net(&[("PRISM_SEED", "42")]);
    let (mut s, mut r) = pair(&net);
    stream(&mut s, &mut r, 1, 1000, 1, Duration::from_secs(10), 1);
    drop(r);
    for _ in 0..10 {
        let _ = s.isend(Box::new(VecSend::new(vec![1; 10])), 0).map(|q| q.map(|q| s.test(q)));
    }
    std::thread::sleep(Duration::from_millis(500));
    let t0 = thread_ticks("prism-progress");
    std::thread::sleep(Duration::from_secs(2));
    let t1 = thread_ticks("prism-progress");
    eprintln!("peer closed: progress thread used {} ticks of 200 in 2 s", t1 - t0);
    assert!(t1 - t0 < 40);
}

/// A receive (or a send) that waits longer than the peer and stall timeouts for its peer to post
/// is not a failure: the peer is alive (its progress thread answers) and merely late.
#[test]
fn a_late_peer_post_is_not_a_failure() {
    let _serial = serial();
    let net = net(&[("PRISM_PEER_TIMEOUT_MS", "500"), ("PRISM_STALL_TIMEOUT_MS", "500")]);
    let (mut s, mut r) = pair(&net);
    stream(&mut s, &mut r, 3, 100_000, 1, Duration::from_secs(5), 1);
    // Receive first, send 1.5 s later (the receiver tests all along, as NCCL's progress thread does).
    let b = SharedRecv::filled(100_000, 0);
    let rid = r.irecv(vec![(Box::new(b) as Box<dyn RecvBuf>, 0)]).unwrap().unwrap();
    let t0 = Instant::now();
    while t0.elapsed() < Duration::from_millis(1500) {
        assert!(r.test(rid).unwrap().is_none(), "receive failed while waiting for a late send");
        std::thread::sleep(Duration::from_micros(200));
    }
    let sid = s.isend(Box::new(VecSend::new(vec![3; 100_000])), 0).unwrap().unwrap();
    let (mut sd, mut rd) = (false, false);
    while !(sd && rd) {
        sd = sd || s.test(sid).expect("late send").is_some();
        rd = rd || r.test(rid).expect("late receive").is_some();
        assert!(t0.elapsed() < Duration::from_secs(5));
    }
    // Send first, receive 1.5 s later.
    let sid = s.isend(Box::new(VecSend::new(vec![4; 100_000])), 0).unwrap().unwrap();
    let t0 = Instant::now();
    while t0.elapsed() < Duration::from_millis(1500) {
        assert!(s.test(sid).unwrap().is_none(), "send failed while waiting for a late receive");
        std::thread::sleep(Duration::from_micros(200));
    }
    let b = SharedRecv::filled(100_000, 0);
    let rid = r.irecv(vec![(Box::new(b) as Box<dyn RecvBuf>, 0)]).unwrap().unwrap();
    let (mut sd, mut rd) = (false, false);
    while !(sd && rd) {
        sd = sd || s.test(sid).expect("late send").is_some();
        rd = rd || r.test(rid).expect("late receive").is_some();
        assert!(t0.elapsed() < Duration::from_secs(5));
    }
}

/// 100,000 zero-byte and tiny messages, grouped receives of 8 with tags: memory stays flat.
#[test]
fn many_grouped_zero_byte_messages_keep_memory_flat() {
    let _serial = serial();
    let net = net(&[("PRISM_SEED", "42")]);
    let (mut s, mut r) = pair(&net);
    let run = |s: &mut SendComm, r: &mut RecvComm, groups: usize| {
        let t0 = Instant::now();
        let mut rq: std::collections::VecDeque<ReqId> = Default::default();
        let mut sq: std::collections::VecDeque<ReqId> = Default::default();
        let (mut rp, mut sp, mut rd, mut sd) = (0, 0, 0, 0);
        while rd < groups || sd < groups * 8 {
            while rp < groups && rq.len() < 8 {
                let bufs: Vec<(Box<dyn RecvBuf>, i32)> =
                    (0..8).map(|t| (Box::new(SharedRecv::filled(16, 0)) as Box<dyn RecvBuf>, t)).collect();
                match r.irecv(bufs).unwrap() {
                    Some(id) => {
                        rq.push_back(id);
                        rp += 1;
                    }
                    None => break,
                }
            }
            while sp < groups * 8 && sq.len() < 64 {
                let len = if sp % 3 == 0 { 0 } else { 16 };
                match s.isend(Box::new(VecSend::new(vec![1; len])), (7 - sp % 8) as i32).unwrap() {
                    Some(id) => {
                        sq.push_back(id);
                        sp += 1;
                    }
                    None => break,
                }
            }
            if let Some(&id) = sq.front() {
                if s.test(id).unwrap().is_some() {
                    sq.pop_front();
                    sd += 1;
                }
            }
            if let Some(&id) = rq.front() {
                if r.test(id).unwrap().is_some() {
                    rq.pop_front();
                    rd += 1;
                }
            }
            assert!(t0.elapsed() < Duration::from_secs(25), "stuck: sends {sd} groups {rd}");
        }
    };
    run(&mut s, &mut r, 1000);
    let rss0 = rss_kb();
    let t0 = Instant::now();
    run(&mut s, &mut r, 12_500);
    eprintln!("100,000 sends in 12,500 groups in {:?}: RSS {rss0} -> {} KB", t0.elapsed(), rss_kb());
    assert!(rss_kb() < rss0 + 4096);
}

/// A send comm on device `sdev` of `a` connected to a listener on device `rdev` of `b`.
fn pair_devs(a: &Net, sdev: usize, b: &Net, rdev: usize) -> (SendComm, RecvComm) {
    let mut handle = [0u8; HANDLE_LEN];
    let mut lis = b.listen(rdev, &mut handle).unwrap();
    let (mut s, mut r) = (None, None);
    let t0 = Instant::now();
    while s.is_none() || r.is_none() {
        if s.is_none() {
            s = a.connect(sdev, &mut handle).unwrap();
        }
        if r.is_none() {
            r = lis.accept().unwrap();
        }
        assert!(t0.elapsed() < Duration::from_secs(10), "handshake did not finish");
    }
    (s.unwrap(), r.unwrap())
}

/// Ends on different devices, and engines with different rail counts, move data both ways.
#[test]
fn ends_on_different_devices_and_rail_counts_move_data() {
    let _serial = serial();
    let two = net(&[("PRISM_IFNAMES", "lo,lo"), ("PRISM_SEED", "1")]);
    let one = net(&[("PRISM_IFNAMES", "lo"), ("PRISM_SEED", "2")]);
    for (name, a, sdev, b, rdev) in [
        ("2 rails dev1 -> dev0", &two, 1, &two, 0),
        ("2 rails dev0 -> dev1", &two, 0, &two, 1),
        ("2 rails dev1 -> 1 rail dev0", &two, 1, &one, 0),
        ("1 rail dev0 -> 2 rails dev1", &one, 0, &two, 1),
        ("1 rail dev0 -> 2 rails dev0", &one, 0, &two, 0),
    ] {
        let (mut s, mut r) = pair_devs(a, sdev, b, rdev);
        let t = stream(&mut s, &mut r, 20, 1 << 20, 4, Duration::from_secs(20), 5);
        eprintln!("{name}: 20 MiB in {t:?}");
    }
}

/// Many pairs all streaming at once from one thread (round robin over the comms, as one NCCL
/// progress thread does), with small socket buffers so that the shared rail port overflows: every
/// message must arrive intact and nothing may fail or hang.
fn concurrent_streams(vars: &[(&str, &str)], npairs: usize, nmsgs: usize, len: usize, limit: Duration) {
    let net = net(vars);
    streams_on(&net, npairs, nmsgs, len, limit);
}

fn streams_on(net: &Net, npairs: usize, nmsgs: usize, len: usize, limit: Duration) {
    let mut pairs: Vec<(SendComm, RecvComm)> = (0..npairs).map(|_| pair(net)).collect();
    let datas: Vec<Arc<Vec<u8>>> = (0..npairs).map(|i| Arc::new(pattern(i as u64 + 100, len))).collect();
    struct St {
        rq: std::collections::VecDeque<(ReqId, SharedRecv)>,
        sq: std::collections::VecDeque<ReqId>,
        rp: usize,
        sp: usize,
        rd: usize,
        sd: usize,
    }
    let mut st: Vec<St> = (0..npairs).map(|_| St { rq: Default::default(), sq: Default::default(), rp: 0, sp: 0, rd: 0, sd: 0 }).collect();
    let t0 = Instant::now();
    loop {
        let mut all = true;
        for (i, (s, r)) in pairs.iter_mut().enumerate() {
            let x = &mut st[i];
            if x.rd == nmsgs && x.sd == nmsgs {
                continue;
            }
            all = false;
            while x.rp < nmsgs && x.rq.len() < 4 {
                let b = SharedRecv::filled(len, 0);
                match r.irecv(vec![(Box::new(b.clone()) as Box<dyn RecvBuf>, 0)]).unwrap() {
                    Some(id) => {
                        x.rq.push_back((id, b));
                        x.rp += 1;
                    }
                    None => break,
                }
            }
            while x.sp < nmsgs && x.sq.len() < 4 {
                match s.isend(Box::new(VecSend(datas[i].clone())), 0).unwrap() {
                    Some(id) => {
                        x.sq.push_back(id);
                        x.sp += 1;
                    }
                    None => break,
                }
            }
            if let Some(&id) = x.sq.front() {
                match s.test(id) {
                    Ok(Some(_)) => {
                        x.sq.pop_front();
                        x.sd += 1;
                    }
                    Ok(None) => {}
                    Err(e) => panic!("pair {i}: send {} failed after {:?}: {e}", x.sd, t0.elapsed()),
                }
            }
            if let Some((id, b)) = x.rq.front() {
                match r.test(*id) {
                    Ok(Some(sizes)) => {
                        assert_eq!(sizes, vec![len]);
                        assert!(b.0.lock().unwrap()[..] == datas[i][..], "pair {i}: wrong bytes in message {}", x.rd);
                        x.rq.pop_front();
                        x.rd += 1;
                    }
                    Ok(None) => {}
                    Err(e) => panic!("pair {i}: receive {} failed after {:?}: {e}", x.rd, t0.elapsed()),
                }
            }
        }
        if all {
            break;
        }
        let left: usize = st.iter().map(|x| 2 * nmsgs - x.rd - x.sd).sum();
        assert!(t0.elapsed() < limit, "stuck after {:?}: {left} completions missing", t0.elapsed());
    }
    let stats = net.stats_json();
    eprintln!(
        "{npairs} pairs x {nmsgs} x {len} B at once in {:?}; rails: {}",
        t0.elapsed(),
        serde_json::to_string(&stats["rails"]).unwrap().chars().take(600).collect::<String>()
    );
}

#[test]
fn many_pairs_streaming_at_once_with_small_socket_buffers() {
    let _serial = serial();
    concurrent_streams(&[("PRISM_SEED", "7"), ("PRISM_SOCKBUF", "262144")], 32, 10, 4 << 20, Duration::from_secs(28));
}

#[test]
fn many_pairs_streaming_at_once_default_buffers() {
    let _serial = serial();
    concurrent_streams(&[("PRISM_SEED", "7")], 64, 10, 2 << 20, Duration::from_secs(28));
}

#[test]
fn four_threads_streaming_at_once_with_small_socket_buffers() {
    let _serial = serial();
    let net = Arc::new(net(&[("PRISM_SEED", "7"), ("PRISM_SOCKBUF", "262144")]));
    let ws: Vec<_> = (0..4)
        .map(|_| {
            let net = net.clone();
            std::thread::spawn(move || streams_on(&net, 8, 10, 2 << 20, Duration::from_secs(28)))
        })
        .collect();
    for w in ws {
        w.join().expect("worker");
    }
}

fn net_with_lb(vars: &[(&str, &str)], lb: &[(&str, &str)]) -> Net {
    use std::collections::BTreeMap;
    let v: BTreeMap<String, String> = [("PRISM_IFNAMES", "lo")].iter().chain(vars).map(|(k, v)| (k.to_string(), v.to_string())).collect();
    let l: BTreeMap<String, String> = lb.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
    Net::new(prism_transport::engine::TransportConfig::from_vars(&v).unwrap(), prism_lb::LbConfig::from_vars(&l).unwrap()).unwrap()
}

/// Ethereal batching across comms driven by several threads, two rails, MCC, small socket buffers;
/// comms closed with held sends while the others go on.
#[test]
fn ethereal_batches_across_threads_and_closes_with_held_sends() {
    let _serial = serial();
    for (path, cc) in [("spray", "mcc"), ("pro", "none"), ("reps", "mcc"), ("dr", "none")] {
        let net = Arc::new(net_with_lb(
            &[("PRISM_IFNAMES", "lo,lo"), ("PRISM_SEED", "7"), ("PRISM_SOCKBUF", "262144")],
            &[
                ("PRISM_SPLIT", "ethereal"),
                ("PRISM_ETHEREAL_BATCH_US", "200"),
                ("PRISM_RAIL", "lpt"),
                ("PRISM_PATH", path),
                ("PRISM_CC", cc),
            ],
        ));
        let t0 = Instant::now();
        let ws: Vec<_> = (0..3)
            .map(|_| {
                let net = net.clone();
                std::thread::spawn(move || streams_on(&net, 6, 8, 1 << 20, Duration::from_secs(25)))
            })
            .collect();
        // Meanwhile: comms closed with sends held in the open batch.
        for i in 0..50 {
            let (mut s, r) = pair(&net);
            for _ in 0..3 {
                let _ = s.isend(Box::new(VecSend::new(pattern(i, 300_000))), 0).unwrap();
            }
            drop((s, r));
        }
        for w in ws {
            w.join().expect("worker");
        }
        eprintln!("{path}/{cc}: {:?}", t0.elapsed());
    }
}
