//! Forwards `tracing` events to NCCL's logger.
//!
//! NCCL hands its logger to `init`; it does the filtering (`NCCL_DEBUG`, `NCCL_DEBUG_SUBSYS`) and the
//! prefix (host, pid, device). The logger is printf-style, so Prism always calls it with `fmt = "%s"` and
//! the finished message as the one argument: a `%` inside a message can never be read as a conversion.
//! Before `init`, or when NCCL passed no logger, warnings go to stderr and everything else is dropped.
//! `NCCL_DEBUG` is read once to skip formatting events NCCL would discard anyway.

use std::ffi::{c_char, c_int, CString};
use std::fmt::Write as _;
use std::sync::atomic::{AtomicPtr, Ordering};
use std::sync::Once;

use tracing::field::{Field, Visit};
use tracing::level_filters::LevelFilter;
use tracing::span::{Attributes, Id, Record as SpanRecord};
use tracing::subscriber::Interest;
use tracing::{Event, Level, Metadata, Subscriber};

use crate::abi::{Logger, LOG_INFO, LOG_TRACE, LOG_WARN, SUBSYS_INIT, SUBSYS_NET};

/// Events with this target go to NCCL's `INIT` subsystem; all others to `NET`.
pub const INIT_TARGET: &str = "prism::init";

/// One event, ready for NCCL's logger.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Record {
    /// `NCCL_LOG_WARN`, `NCCL_LOG_INFO` or `NCCL_LOG_TRACE`.
    pub level: c_int,
    /// `NCCL_INIT` or `NCCL_NET`.
    pub flags: std::ffi::c_ulong,
    /// Source file of the event.
    pub file: &'static str,
    /// Source line of the event.
    pub line: u32,
    /// The message with its fields appended as ` name=value`.
    pub message: String,
}

/// Where finished records go.
pub trait Sink: Send + Sync + 'static {
    /// Delivers one record.
    fn emit(&self, record: &Record);
}

/// A `tracing` subscriber that turns events into [`Record`]s for a [`Sink`]. Spans are accepted and
/// ignored: NCCL's logger has no notion of them.
pub struct NcclSubscriber<S: Sink> {
    sink: S,
    max_level: LevelFilter,
}

impl<S: Sink> NcclSubscriber<S> {
    /// A subscriber passing events up to `max_level` (more verbose ones are never formatted).
    pub fn new(sink: S, max_level: LevelFilter) -> Self {
        Self { sink, max_level }
    }
}

/// NCCL's level for a `tracing` level.
pub fn nccl_level(level: Level) -> c_int {
    match level {
        Level::ERROR | Level::WARN => LOG_WARN,
        Level::INFO => LOG_INFO,
        Level::DEBUG | Level::TRACE => LOG_TRACE,
    }
}

/// NCCL's subsystem flag for an event target.
pub fn nccl_subsys(target: &str) -> std::ffi::c_ulong {
    if target == INIT_TARGET {
        SUBSYS_INIT
    } else {
        SUBSYS_NET
    }
}

/// The most verbose level worth formatting for a given `NCCL_DEBUG` value.
pub fn level_for_nccl_debug(value: Option<&str>) -> LevelFilter {
    match value.map(|v| v.trim().to_ascii_uppercase()) {
        Some(v) if v == "TRACE" => LevelFilter::TRACE,
        Some(v) if v == "INFO" => LevelFilter::INFO,
        _ => LevelFilter::WARN,
    }
}

struct MessageVisitor {
    message: String,
    fields: String,
}

impl Visit for MessageVisitor {
    fn record_str(&mut self, field: &Field, value: &str) {
        if field.name() == "message" {
            self.message.push_str(value);
        } else {
            let _ = write!(self.fields, " {}={}", field.name(), value);
        }
    }

    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        if field.name() == "message" {
            let _ = write!(self.message, "{value:?}");
        } else {
            let _ = write!(self.fields, " {}={:?}", field.name(), value);
        }
    }
}

impl<S: Sink> Subscriber for NcclSubscriber<S> {
    fn register_callsite(&self, metadata: &'static Metadata<'static>) -> Interest {
        if self.enabled(metadata) {
            Interest::always()
        } else {
            Interest::never()
        }
    }

    fn enabled(&self, metadata: &Metadata<'_>) -> bool {
        *metadata.level() <= self.max_level
    }

    fn max_level_hint(&self) -> Option<LevelFilter> {
        Some(self.max_level)
    }

    fn new_span(&self, _span: &Attributes<'_>) -> Id {
        // Spans carry nothing NCCL can show; every span gets the same (valid, non-zero) id.
        Id::from_u64(1)
    }

    fn record(&self, _span: &Id, _values: &SpanRecord<'_>) {}

    fn record_follows_from(&self, _span: &Id, _follows: &Id) {}

    fn event(&self, event: &Event<'_>) {
        let meta = event.metadata();
        let mut visitor = MessageVisitor { message: String::new(), fields: String::new() };
        event.record(&mut visitor);
        visitor.message.push_str(&visitor.fields);
        self.sink.emit(&Record {
            level: nccl_level(*meta.level()),
            flags: nccl_subsys(meta.target()),
            file: meta.file().unwrap_or("prism"),
            line: meta.line().unwrap_or(0),
            message: visitor.message,
        });
    }

    fn enter(&self, _span: &Id) {}

    fn exit(&self, _span: &Id) {}
}

/// NCCL's logger, or null before the first `init` that passed one. Stored as a data pointer so that
/// every thread can read it without a lock.
static LOGGER: AtomicPtr<()> = AtomicPtr::new(std::ptr::null_mut());

/// Remembers NCCL's logger. `None` keeps the one a previous `init` passed (it lives as long as NCCL).
pub fn set_logger(logger: Option<Logger>) {
    if let Some(f) = logger {
        LOGGER.store(f as *mut (), Ordering::Release);
    }
}

/// Forgets NCCL's logger, e.g. when the library is unloaded and NCCL's code may be gone.
pub fn clear_logger() {
    LOGGER.store(std::ptr::null_mut(), Ordering::Release);
}

fn current_logger() -> Option<Logger> {
    let p = LOGGER.load(Ordering::Acquire);
    if p.is_null() {
        return None;
    }
    // SAFETY: LOGGER only ever holds null or a value stored by `set_logger` from a `Logger`, and a
    // function pointer round-trips through a data pointer unchanged on every platform Rust supports.
    Some(unsafe { std::mem::transmute::<*mut (), Logger>(p) })
}

/// Makes a C string of `s`, showing interior NULs as `\0` instead of cutting the message short.
fn c_string(s: &str) -> CString {
    CString::new(s.replace('\0', "\\0")).unwrap_or_default()
}

/// The production sink: NCCL's logger when there is one, stderr for warnings otherwise.
pub struct NcclSink;

impl Sink for NcclSink {
    fn emit(&self, record: &Record) {
        let text = format!("NET/Prism : {}", record.message);
        match current_logger() {
            Some(logger) => {
                let msg = c_string(&text);
                let file = c_string(record.file);
                let line = c_int::try_from(record.line).unwrap_or(c_int::MAX);
                // SAFETY: `logger` is NCCL's printf-style logger; the format is the literal "%s" and its
                // one argument is a NUL-terminated string that outlives the call.
                unsafe { logger(record.level, record.flags, file.as_ptr(), line, c"%s".as_ptr(), msg.as_ptr() as *const c_char) };
            }
            None if record.level == LOG_WARN => eprintln!("prism WARN {text}"),
            None => {}
        }
    }
}

static INSTALL: Once = Once::new();

/// Installs the NCCL-forwarding subscriber as this library's global one (once; later calls are free).
/// Every entry point calls it first, so even a call before `init` can report why it failed.
pub fn ensure_installed() {
    INSTALL.call_once(|| {
        let max = level_for_nccl_debug(std::env::var("NCCL_DEBUG").ok().as_deref());
        // Fails only if a subscriber was already set (a Rust program linking the rlib set its own);
        // that one then receives the events, which is what such a program wants.
        let _ = tracing::subscriber::set_global_default(NcclSubscriber::new(NcclSink, max));
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use parking_lot::Mutex;
    use std::sync::Arc;

    #[derive(Clone, Default)]
    struct Recorder(Arc<Mutex<Vec<Record>>>);

    impl Sink for Recorder {
        fn emit(&self, record: &Record) {
            self.0.lock().push(record.clone());
        }
    }

    fn capture(max: LevelFilter, f: impl FnOnce()) -> Vec<Record> {
        let rec = Recorder::default();
        tracing::subscriber::with_default(NcclSubscriber::new(rec.clone(), max), f);
        let out = rec.0.lock().clone();
        out
    }

    #[test]
    fn warn_and_error_become_nccl_warn_on_the_net_subsystem() {
        let recs = capture(LevelFilter::WARN, || {
            tracing::warn!("w");
            tracing::error!("e");
        });
        assert_eq!(recs.len(), 2);
        assert!(recs.iter().all(|r| r.level == LOG_WARN && r.flags == SUBSYS_NET), "{recs:?}");
    }

    #[test]
    fn info_becomes_nccl_info_and_debug_becomes_trace() {
        let recs = capture(LevelFilter::TRACE, || {
            tracing::info!("i");
            tracing::debug!("d");
            tracing::trace!("t");
        });
        let levels: Vec<c_int> = recs.iter().map(|r| r.level).collect();
        assert_eq!(levels, vec![LOG_INFO, LOG_TRACE, LOG_TRACE]);
    }

    #[test]
    fn init_target_goes_to_the_init_subsystem() {
        let recs = capture(LevelFilter::INFO, || tracing::info!(target: INIT_TARGET, "config"));
        assert_eq!(recs[0].flags, SUBSYS_INIT);
    }

    #[test]
    fn events_above_the_max_level_are_not_delivered() {
        let recs = capture(LevelFilter::WARN, || {
            tracing::info!("not shown");
            tracing::warn!("shown");
        });
        assert_eq!(recs.len(), 1);
        assert_eq!(recs[0].message, "shown");
    }

    #[test]
    fn fields_follow_the_message_and_percent_signs_stay_literal() {
        let recs = capture(LevelFilter::INFO, || tracing::info!(dev = 3, name = "eth0", "100% of %s {}", 7));
        assert_eq!(recs[0].message, "100% of %s 7 dev=3 name=eth0");
        assert!(recs[0].file.ends_with("log.rs"), "{}", recs[0].file);
        assert!(recs[0].line > 0);
    }

    #[test]
    fn nccl_debug_selects_the_most_verbose_level_formatted() {
        assert_eq!(level_for_nccl_debug(None), LevelFilter::WARN);
        assert_eq!(level_for_nccl_debug(Some("WARN")), LevelFilter::WARN);
        assert_eq!(level_for_nccl_debug(Some("info")), LevelFilter::INFO);
        assert_eq!(level_for_nccl_debug(Some("TRACE")), LevelFilter::TRACE);
        assert_eq!(level_for_nccl_debug(Some("VERSION")), LevelFilter::WARN);
    }

    #[test]
    fn interior_nul_is_shown_not_truncating() {
        assert_eq!(c_string("a\0b").to_str().unwrap(), "a\\0b");
    }
}
