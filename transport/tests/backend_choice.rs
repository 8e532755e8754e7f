//! `PRISM_TRANSPORT`: `verbs` fails with a clear error on a host without RDMA devices, `auto` falls back
//! to UDP and says so in exactly one log line, `udp` never looks for devices. On a host that has an
//! active RDMA device the same tests check the other side of each branch instead.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use prism_transport::engine::{Net, TransportConfig};

/// Records the message of every event (a minimal tracing subscriber).
#[derive(Clone, Default)]
struct Capture(Arc<Mutex<Vec<String>>>);

struct Msg<'a>(&'a mut String);
impl tracing::field::Visit for Msg<'_> {
    fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
        if field.name() == "message" {
            *self.0 = format!("{value:?}");
        }
    }
}

impl tracing::Subscriber for Capture {
    fn enabled(&self, _: &tracing::Metadata<'_>) -> bool {
        true
    }
    fn new_span(&self, _: &tracing::span::Attributes<'_>) -> tracing::span::Id {
        tracing::span::Id::from_u64(1)
    }
    fn record(&self, _: &tracing::span::Id, _: &tracing::span::Record<'_>) {}
    fn record_follows_from(&self, _: &tracing::span::Id, _: &tracing::span::Id) {}
    fn event(&self, e: &tracing::Event<'_>) {
        let mut m = String::new();
        e.record(&mut Msg(&mut m));
        self.0.lock().unwrap().push(m);
    }
    fn enter(&self, _: &tracing::span::Id) {}
    fn exit(&self, _: &tracing::span::Id) {}
}

fn vars(kv: &[(&str, &str)]) -> BTreeMap<String, String> {
    kv.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
}

/// Does this host have an RDMA device at all (as the kernel lists them)?
fn host_has_rdma() -> bool {
    std::fs::read_dir("/sys/class/infiniband").is_ok_and(|mut d| d.next().is_some())
}

fn make(kv: &[(&str, &str)]) -> (Result<Net, String>, Vec<String>) {
    let cap = Capture::default();
    let cfg = TransportConfig::from_vars(&vars(kv)).unwrap();
    let net = tracing::subscriber::with_default(cap.clone(), || Net::new(cfg, prism_lb::LbConfig::default()).map_err(|e| e.to_string()));
    let lines = cap.0.lock().unwrap().clone();
    (net, lines)
}

#[test]
fn verbs_without_a_device_is_a_clear_error() {
    let (net, _) = make(&[("PRISM_TRANSPORT", "verbs"), ("PRISM_IFNAMES", "lo")]);
    if host_has_rdma() {
        assert_eq!(net.unwrap().backend(), "verbs");
    } else {
        let e = net.err().expect("verbs must fail without RDMA devices");
        assert!(e.contains("PRISM_TRANSPORT=verbs"), "{e}");
        assert!(e.contains("libibverbs") || e.contains("RDMA device"), "{e}");
    }
}

#[test]
fn a_named_device_that_does_not_exist_is_an_error_naming_it() {
    let (net, _) = make(&[("PRISM_TRANSPORT", "verbs"), ("PRISM_IB_HCA", "nosuchhca9")]);
    let e = net.err().expect("a missing HCA cannot be used");
    assert!(e.contains("PRISM_TRANSPORT=verbs"), "{e}");
}

#[test]
fn auto_falls_back_to_udp_with_one_line_saying_why() {
    let (net, lines) = make(&[("PRISM_IFNAMES", "lo")]);
    let net = net.unwrap();
    let choice: Vec<&String> = lines.iter().filter(|l| l.starts_with("transport: ")).collect();
    assert_eq!(choice.len(), 1, "exactly one line about the choice: {lines:?}");
    if host_has_rdma() {
        assert!(choice[0].starts_with("transport: verbs"), "{}", choice[0]);
    } else {
        assert_eq!(net.backend(), "udp");
        assert!(choice[0].starts_with("transport: udp (no RDMA device: "), "{}", choice[0]);
    }
}

#[test]
fn udp_is_chosen_without_probing() {
    let (net, lines) = make(&[("PRISM_TRANSPORT", "udp"), ("PRISM_IFNAMES", "lo")]);
    assert_eq!(net.unwrap().backend(), "udp");
    let choice: Vec<&String> = lines.iter().filter(|l| l.starts_with("transport: ")).collect();
    assert_eq!(choice, vec!["transport: udp (PRISM_TRANSPORT=udp)"]);
}
