//! NCCL's tag matching of grouped receives through the engine over loopback UDP: both ends post in
//! their own order, retry a post that returns `Ok(None)` (NCCL's NULL request) and test everything
//! round-robin, as NCCL's proxy does. Every send has its own content, and every buffer is checked
//! against the send NCCL's rule puts there (per tag, the k-th send fills the k-th buffer of that tag in
//! posting order). Also: a post on a comm whose peer closed is accepted and fails in `test`.

mod common;

use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{pair, SharedRecv, VecSend};
use prism_transport::engine::{Net, RecvBuf, ReqId};

/// Content of send `k`: its own length and bytes.
fn payload(k: usize) -> Vec<u8> {
    let len = 1000 + 37 * k;
    (0..len).map(|i| ((i as u64).wrapping_mul(2654435761) >> 7) as u8 ^ (k as u8).wrapping_mul(31)).collect()
}

/// Post `groups` (buffer tags) on the receiver and `sends` (tags) on the sender, interleaved, with
/// retries; test to completion; check every byte. Returns how many posts were retried (sends, receives).
/// `sends_first`: the receiver posts nothing until the sender was told "later" (or posted everything),
/// so the sender's limit is reached before any CTS arrives.
fn run(net: &Net, groups: &[Vec<i32>], sends: &[i32], sends_first: bool) -> (usize, usize) {
    let (mut s, mut r) = pair(net);
    // The send each buffer must get.
    let mut by_tag: BTreeMap<i32, VecDeque<usize>> = BTreeMap::new();
    for (k, &t) in sends.iter().enumerate() {
        by_tag.entry(t).or_default().push_back(k);
    }
    let expected: Vec<Vec<usize>> =
        groups.iter().map(|g| g.iter().map(|t| by_tag.get_mut(t).unwrap().pop_front().expect("a send per buffer")).collect()).collect();
    let payloads: Vec<Arc<Vec<u8>>> = (0..sends.len()).map(|k| Arc::new(payload(k))).collect();
    // Buffers a little larger than their sends, filled with a marker.
    let rbufs: Vec<Vec<SharedRecv>> =
        expected.iter().map(|g| g.iter().map(|&k| SharedRecv::filled(payloads[k].len() + 16, 0xEE)).collect()).collect();
    let (mut next_send, mut next_recv, mut retries) = (0, 0, (0, 0));
    let mut sreqs: Vec<(usize, ReqId)> = Vec::new();
    let mut rreqs: Vec<(usize, ReqId)> = Vec::new();
    let mut rsizes: Vec<Option<Vec<usize>>> = vec![None; groups.len()];
    let mut sent = 0;
    let t0 = Instant::now();
    while sent < sends.len() || rsizes.iter().any(Option::is_none) {
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "deadlock: {next_send}/{} sends and {next_recv}/{} receives posted, {sent} sends done",
            sends.len(),
            groups.len()
        );
        let hold = sends_first && retries.0 == 0 && next_send < sends.len();
        if next_recv < groups.len() && !hold {
            let items: Vec<(Box<dyn RecvBuf>, i32)> =
                rbufs[next_recv].iter().zip(&groups[next_recv]).map(|(b, &t)| (Box::new(b.clone()) as Box<dyn RecvBuf>, t)).collect();
            match r.irecv(items).expect("irecv") {
                Some(id) => {
                    rreqs.push((next_recv, id));
                    next_recv += 1;
                }
                None => retries.1 += 1,
            }
        }
        if next_send < sends.len() {
            match s.isend(Box::new(VecSend(payloads[next_send].clone())), sends[next_send]).expect("isend") {
                Some(id) => {
                    sreqs.push((next_send, id));
                    next_send += 1;
                }
                None => retries.0 += 1,
            }
        }
        sreqs.retain(|&(k, id)| match s.test(id) {
            Ok(Some(n)) => {
                assert_eq!(n, payloads[k].len(), "send {k} size");
                sent += 1;
                false
            }
            Ok(None) => true,
            Err(e) => panic!("send {k} failed: {e}"),
        });
        rreqs.retain(|&(g, id)| match r.test(id) {
            Ok(Some(sizes)) => {
                rsizes[g] = Some(sizes);
                false
            }
            Ok(None) => true,
            Err(e) => panic!("receive {g} failed: {e}"),
        });
    }
    for (g, ks) in expected.iter().enumerate() {
        let want: Vec<usize> = ks.iter().map(|&k| payloads[k].len()).collect();
        assert_eq!(rsizes[g].as_ref().unwrap(), &want, "group {g}: sizes");
        for (j, &k) in ks.iter().enumerate() {
            let buf = rbufs[g][j].0.lock().unwrap();
            let n = payloads[k].len();
            assert!(buf[..n] == payloads[k][..], "group {g} buffer {j} (tag {}) does not hold send {k}", groups[g][j]);
            assert!(buf[n..].iter().all(|&b| b == 0xEE), "group {g} buffer {j}: written past send {k}");
        }
    }
    retries
}

#[test]
fn two_groups_of_two_tags_and_sends_tag0_tag0_tag1_tag1_all_complete() {
    let net = net();
    for _ in 0..5 {
        run(&net, &[vec![0, 1], vec![0, 1]], &[0, 0, 1, 1], false);
        run(&net, &[vec![0, 1], vec![0, 1]], &[0, 0, 1, 1], true);
    }
}

#[test]
fn interleaved_sends_across_two_groups_of_eight_tags_land_in_the_right_buffers() {
    let net = net();
    let tags: Vec<i32> = (0..8).collect();
    let sends = [0, 1, 2, 3, 4, 5, 6, 1, 7, 0, 2, 3, 4, 5, 6, 7];
    run(&net, &[tags.clone(), tags.clone()], &sends, false);
    run(&net, &[tags.clone(), tags], &sends, true);
}

#[test]
fn thirty_two_groups_of_eight_tags_and_256_sends_complete_with_retries() {
    let net = net();
    let groups: Vec<Vec<i32>> = (0..32).map(|_| (0..8).collect()).collect();
    // Tag-major order: all tag-7 sends first, then tag 6, ...: every group waits for its last tag.
    let sends: Vec<i32> = (0..8).rev().flat_map(|t| vec![t; 32]).collect();
    run(&net, &groups, &sends, false);
    run(&net, &groups, &sends, true);
    // 512 sends into 64 groups: beyond 256 sends in flight the engine says "later".
    let groups: Vec<Vec<i32>> = (0..64).map(|_| (0..8).collect()).collect();
    let sends: Vec<i32> = (0..8).rev().flat_map(|t| vec![t; 64]).collect();
    let (send_retries, _) = run(&net, &groups, &sends, true);
    assert!(send_retries > 0, "512 sends posted without a single retry");
}

#[test]
fn posts_after_the_peer_closed_are_accepted_and_fail_in_test() {
    let net = net();
    let (mut s, r) = pair(&net);
    drop(r);
    // Until the CLOSE arrives a send may just wait; once it has, each post is a request that fails.
    let t0 = Instant::now();
    let mut failed = 0;
    while failed < 3 {
        let id = s.isend(Box::new(VecSend::new(vec![1; 100])), 0).expect("a post after the peer closed is accepted");
        let id = id.expect("a request, not 'retry later'");
        loop {
            match s.test(id) {
                Ok(None) => {}
                Ok(Some(_)) => panic!("a send to a closed peer completed"),
                Err(e) => {
                    assert!(e.to_string().contains("closed"), "{e}");
                    failed += 1;
                    break;
                }
            }
            assert!(t0.elapsed() < Duration::from_secs(5), "no failure 5 s after the peer closed");
        }
    }
    let (s2, mut r2) = pair(&net);
    drop(s2);
    let t0 = Instant::now();
    let buf = SharedRecv::filled(64, 0xEE);
    for _ in 0..3 {
        let id = r2.irecv(vec![(Box::new(buf.clone()) as Box<dyn RecvBuf>, 0)]).expect("accepted").expect("a request");
        loop {
            match r2.test(id) {
                Ok(None) => {}
                Ok(Some(_)) => panic!("a receive from a closed peer completed"),
                Err(e) => {
                    assert!(e.to_string().contains("closed"), "{e}");
                    break;
                }
            }
            assert!(t0.elapsed() < Duration::from_secs(5), "no failure 5 s after the peer closed");
        }
    }
    assert!(buf.0.lock().unwrap().iter().all(|&b| b == 0xEE), "a failed receive wrote its buffer");
}

fn net() -> Net {
    common::net(&[("PRISM_SEED", "42"), ("PRISM_PATHS", "8")])
}
