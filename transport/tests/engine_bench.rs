//! The engine benchmark's driver (`benches/engine/`), run small: it must move every byte it claims to
//! time, intact, on both packet shapes, so that the benchmark cannot silently measure nothing.

#[path = "../benches/engine/driver.rs"]
#[allow(dead_code)]
mod driver;

use driver::{Params, Shape};

const MIB: u64 = 1 << 20;

fn run(shape: Shape, total: u64, msg: usize, verify: bool) -> driver::Outcome {
    driver::run(Params { shape, total, msg, depth: 4, verify })
}

#[test]
fn verbs_shaped_run_delivers_every_byte_intact_in_64_kib_packets() {
    let o = run(Shape::Verbs, 8 * MIB, 256 << 10, true);
    assert_eq!((o.msgs, o.bytes, o.checked_msgs), (32, 8 * MIB, 32));
    assert_eq!(o.data_pkts, 8 * MIB / (64 << 10), "one DATA packet per 64 KiB");
    // CTS and SACKs come back, but far fewer than DATA packets.
    assert!(o.other_pkts > 0 && o.other_pkts < o.data_pkts, "{} control packets", o.other_pkts);
    assert!(o.ns_per_chunk() > 0.0 && o.cores_per_nic() > 0.0);
}

#[test]
fn udp_shaped_run_delivers_every_byte_intact_in_jumbo_datagrams() {
    let o = run(Shape::Udp, 8 * MIB, 256 << 10, true);
    assert_eq!((o.msgs, o.bytes, o.checked_msgs), (32, 8 * MIB, 32));
    let per_msg = (256u64 << 10).div_ceil(Shape::Udp.payload() as u64);
    assert_eq!(Shape::Udp.payload(), 8832);
    assert_eq!(o.data_pkts, 32 * per_msg);
    assert!(o.ns_per_packet() > 0.0);
}

#[test]
fn messages_that_are_not_whole_packets_arrive_intact() {
    for shape in [Shape::Verbs, Shape::Udp] {
        let o = run(shape, 3 * 100_003, 100_003, true);
        assert_eq!((o.msgs, o.checked_msgs), (3, 3), "{shape:?}");
    }
}

#[test]
fn timed_runs_move_the_same_packets_as_checked_ones() {
    for shape in [Shape::Verbs, Shape::Udp] {
        let checked = run(shape, 4 * MIB, 512 << 10, true);
        let timed = run(shape, 4 * MIB, 512 << 10, false);
        assert_eq!(timed.checked_msgs, 0);
        assert_eq!((timed.msgs, timed.bytes, timed.data_pkts), (checked.msgs, checked.bytes, checked.data_pkts), "{shape:?}");
    }
}
