//! Tests of the shim transport (against the reference plugin build.rs compiles) and of the pool.

use std::path::{Path, PathBuf};
use std::time::Duration;

use super::*;
use crate::coll::{self, Buffers, Collective, ExecConfig};
use crate::data;
use crate::rendezvous::Rendezvous;
use serde_json::{json, Value};

/// The reference plugin build.rs compiles from csrc/testnet.c.
fn test_plugin() -> PathBuf {
    Path::new(env!("OUT_DIR")).join("libprism-testnet.so")
}

#[test]
fn every_abi_version_loads_and_reports_its_own_properties_layout() {
    for abi in 9..=12 {
        let mut p = Plugin::open(&test_plugin(), abi).unwrap();
        assert_eq!((p.name(), p.version()), ("testnet", abi));
        p.init(42).unwrap();
        assert_eq!(p.devices().unwrap(), 2);
        let d1 = p.properties(1).unwrap();
        assert_eq!((d1.name.as_str(), d1.speed_mbps, d1.ptr_support, d1.max_recvs), ("testnet1", 100000, 1, 1));
        assert_eq!(d1.max_p2p_bytes, 1 << 40, "abi {abi}: maxP2pBytes read from the right offset");
        // railId exists only in v12's struct.
        assert_eq!(d1.rail_id, if abi == 12 { 1 } else { -1 }, "abi {abi}");
        p.finalize().unwrap();
    }
}

#[test]
fn a_missing_library_is_a_load_error_naming_the_path() {
    let err = Plugin::open(Path::new("./no-such-plugin.so"), 12).err().unwrap().to_string();
    assert!(err.contains("no-such-plugin.so"), "{err}");
}

#[test]
fn a_device_the_plugin_does_not_have_is_its_error_not_a_crash() {
    let mut p = Plugin::open(&test_plugin(), 12).unwrap();
    p.init(1).unwrap();
    let err = p.properties(7).unwrap_err().to_string();
    assert!(err.contains("getProperties") && err.contains("ncclInvalidArgument"), "{err}");
}

fn run_through_plugin(abi: u32, coll: Collective, n: usize, bytes: usize) -> Vec<usize> {
    let listener = Rendezvous::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let mut listener = Some(listener);
    let threads: Vec<_> = (0..n)
        .map(|rank| {
            let listener = listener.take();
            let addr = addr.clone();
            std::thread::spawn(move || {
                let timeout = Duration::from_secs(20);
                let mut rv = match listener {
                    Some(l) => Rendezvous::serve(l, n, timeout).unwrap(),
                    None => Rendezvous::join(&addr, rank, n, timeout).unwrap(),
                };
                let mut plugin = Plugin::open(&test_plugin(), abi).unwrap();
                plugin.init(7).unwrap();
                let (send_peers, recv_peers) = coll.peers(rank, n);
                let exchange = Box::new(|mine: Vec<(usize, Vec<u8>)>| {
                    let all = rv.allgather(json!(mine)).map_err(|e| e.to_string())?;
                    let mut theirs = Vec::new();
                    for &p in &send_peers {
                        let list: Vec<(usize, Vec<u8>)> = serde_json::from_value(all[p].clone()).map_err(|e| e.to_string())?;
                        let h = list.into_iter().find(|(q, _)| *q == rank).ok_or("no handle")?;
                        theirs.push((p, h.1));
                    }
                    Ok(theirs)
                });
                let place = Place { dev: 1, rank, nranks: n };
                let mut t = ShimTransport::establish(plugin, place, &send_peers, &recv_peers, exchange, timeout).unwrap();
                let counts = coll.counts(bytes, n);
                let bufs = Buffers::alloc(&mut t, coll, counts).unwrap();
                let p = coll::plan(coll, rank, n, counts, bufs, 100);
                let exec = ExecConfig { window: 4, max_inflight: 32, timeout };
                for pass in 0..2 {
                    data::prepare(&mut t, bufs, counts, pass).unwrap();
                    coll::execute(&mut t, &p, &exec).unwrap();
                }
                let wrong = data::count_wrong(&t, coll, bufs, counts, 1).unwrap();
                rv.allgather(Value::Null).unwrap();
                t.close().unwrap();
                wrong
            })
        })
        .collect();
    threads.into_iter().map(|t| t.join().expect("rank thread")).collect()
}

#[test]
fn collectives_are_exact_through_the_shim_for_every_abi_version() {
    for abi in 9..=12 {
        for coll in [Collective::AllReduce, Collective::AllToAll] {
            assert_eq!(run_through_plugin(abi, coll, 3, 4 * 1003), vec![0, 0, 0], "abi {abi} {}", coll.name());
        }
    }
}

#[test]
fn every_collective_is_exact_through_the_shim() {
    for coll in Collective::ALL {
        assert_eq!(run_through_plugin(12, coll, 2, 4 * 777), vec![0, 0], "{}", coll.name());
    }
}

fn pool_with(len: usize) -> (Pool, BufId) {
    let mut pool = Pool::new();
    let b = pool.alloc(len).unwrap();
    (pool, b)
}

#[test]
fn a_region_a_posted_receive_uses_cannot_be_read_or_written() {
    let (mut pool, b) = pool_with(100);
    pool.claim(ReqId(1), Region::new(b, 10, 10), true).unwrap();
    assert!(matches!(pool.read(Region::new(b, 15, 10)), Err(NetError::Busy(_))));
    assert!(matches!(pool.write(Region::new(b, 0, 11)), Err(NetError::Busy(_))));
    assert!(pool.read(Region::new(b, 20, 10)).is_ok(), "the bytes next to it are free");
    pool.release(ReqId(1));
    assert!(pool.write(Region::new(b, 10, 10)).is_ok());
}

#[test]
fn a_region_a_posted_send_uses_can_be_read_but_not_written_or_received_into() {
    let (mut pool, b) = pool_with(100);
    pool.claim(ReqId(1), Region::new(b, 0, 50), false).unwrap();
    assert!(pool.read(Region::new(b, 0, 50)).is_ok());
    pool.claim(ReqId(2), Region::new(b, 0, 50), false).unwrap();
    assert!(matches!(pool.write(Region::new(b, 49, 1)), Err(NetError::Busy(_))));
    assert!(matches!(pool.claim(ReqId(3), Region::new(b, 40, 20), true), Err(NetError::Busy(_))));
    assert!(!pool.is_idle(Region::new(b, 40, 20)));
}

#[test]
fn regions_outside_their_buffer_are_refused() {
    let (mut pool, b) = pool_with(10);
    assert!(matches!(pool.read(Region::new(b, 5, 6)), Err(NetError::OutOfBounds { .. })));
    assert!(matches!(pool.claim(ReqId(1), Region::new(b, usize::MAX, 2), true), Err(NetError::OutOfBounds { .. })));
    assert!(pool.read(Region::new(b, 10, 0)).is_ok(), "an empty region at the end is in bounds");
}

#[test]
fn a_sum_into_a_region_reads_a_disjoint_one() {
    let (mut pool, b) = pool_with(8);
    pool.write(Region::new(b, 0, 8)).unwrap().copy_from_slice(&[1.0, 2.0, 3.0, 4.0, 10.0, 20.0, 30.0, 40.0]);
    pool.add_assign(Region::new(b, 0, 4), Region::new(b, 4, 4)).unwrap();
    assert_eq!(pool.read(Region::new(b, 0, 4)).unwrap(), &[11.0, 22.0, 33.0, 44.0]);
    assert!(matches!(pool.add_assign(Region::new(b, 0, 4), Region::new(b, 2, 4)), Err(NetError::Overlap(..))));
}
