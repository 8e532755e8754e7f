//! Engine cost without a network: CPU nanoseconds per 64 KiB chunk, both ends of a connection
//! together, and what that means in cores per 400 Gbit/s NIC. See `driver.rs` for what is measured.
//!
//! `cargo bench -p prism-transport --bench engine [-- --mib N --msg-kib N --depth N --shape verbs|udp|all]`
//!
//! Before the timed runs each shape runs once on 16 MiB with the wire copies done and every byte
//! compared (`Params::verify`); the timed runs skip both (they are neither engine's CPU work).

mod driver;

use driver::{Outcome, Params, Shape, CHUNK, NIC_BITS_PER_S};

const USAGE: &str = "usage: engine [--mib N] [--msg-kib N] [--depth N] [--shape verbs|udp|all]";

struct Args {
    mib: u64,
    msg_kib: usize,
    depth: usize,
    shapes: Vec<Shape>,
}

fn parse_args() -> Result<Args, String> {
    let mut a = Args { mib: 1024, msg_kib: 512, depth: 8, shapes: vec![Shape::Verbs, Shape::Udp] };
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        let mut value = |name: &str| it.next().ok_or_else(|| format!("{name} needs a value\n{USAGE}"));
        let num =
            |name: &str, v: String| v.parse::<u64>().ok().filter(|&n| n > 0).ok_or_else(|| format!("{name} {v}: not a positive integer"));
        match arg.as_str() {
            // cargo bench passes --bench to every harness-less bench.
            "--bench" => {}
            "--mib" => a.mib = num("--mib", value("--mib")?)?,
            "--msg-kib" => a.msg_kib = num("--msg-kib", value("--msg-kib")?)? as usize,
            "--depth" => a.depth = num("--depth", value("--depth")?)? as usize,
            "--shape" => {
                a.shapes = match value("--shape")?.as_str() {
                    "verbs" => vec![Shape::Verbs],
                    "udp" => vec![Shape::Udp],
                    "all" => vec![Shape::Verbs, Shape::Udp],
                    s => return Err(format!("--shape {s}: one of verbs, udp, all")),
                }
            }
            _ => return Err(format!("unknown argument {arg}\n{USAGE}")),
        }
    }
    Ok(a)
}

fn row(o: &Outcome) {
    println!(
        "{:<6} {:>7} {:<12} {:>9} {:>9} {:>9.1} {:>8.0} {:>9.0} {:>10.3} {:>9.1}",
        o.params.shape.name(),
        o.params.shape.payload(),
        o.params.shape.what(),
        o.data_pkts,
        o.other_pkts,
        o.cpu.as_secs_f64() * 1e3,
        o.ns_per_packet(),
        o.ns_per_chunk(),
        o.cores_per_nic(),
        o.gbit_per_cpu_s(),
    );
}

fn main() {
    let args = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("{e}");
            std::process::exit(2);
        }
    };
    let total = args.mib << 20;
    let msg = args.msg_kib << 10;
    // A verified run of each shape first (the bytes arrive intact; also warms caches and allocator).
    for &shape in &args.shapes {
        let o = driver::run(Params { shape, total: (16 << 20).min(total), msg, depth: args.depth, verify: true });
        assert!(o.checked_msgs == o.msgs && o.msgs > 0, "the check run compared {} of {} messages", o.checked_msgs, o.msgs);
    }
    let chunks_per_s = NIC_BITS_PER_S / 8.0 / CHUNK as f64;
    println!(
        "Engine cost without a network: two proto::Connections (sender, receiver) in one thread over a lossless \
         in-memory wire,\n{} MiB in {} KiB messages, {} outstanding; CPU = this thread's CPU time, both ends together \
         (bytes checked in a 16 MiB run first).",
        args.mib, args.msg_kib, args.depth
    );
    println!(
        "{:<6} {:>7} {:<12} {:>9} {:>9} {:>9} {:>8} {:>9} {:>10} {:>9}",
        "shape", "B/pkt", "payload", "data pkts", "other", "CPU ms", "ns/pkt", "ns/64KiB", "cores/400G", "Gb/s/core"
    );
    let mut wall_clock = false;
    for &shape in &args.shapes {
        let o = driver::run(Params { shape, total, msg, depth: args.depth, verify: false });
        wall_clock |= !o.thread_clock;
        row(&o);
    }
    let copy = driver::memcpy_ns_per_chunk(total);
    println!(
        "reference: one memcpy of 64 KiB (512 KiB source ring, 4 MiB destination ring) costs {copy:.0} ns, {:.3} cores per 400 Gbit/s",
        copy * chunks_per_s / 1e9
    );
    println!("goal (issue 13): at most 0.25 core per 400 Gbit/s NIC, i.e. {:.0} ns per 64 KiB", 0.25e9 / chunks_per_s);
    if wall_clock {
        println!("note: the thread CPU clock is missing here; times are wall-clock times");
    }
}
