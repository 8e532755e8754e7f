//! The opaque pointers Prism hands to NCCL and gets back: contexts, comms, requests, memory handles,
//! and the 128-byte connection handle NCCL exchanges between ranks.
//!
//! Every object NCCL holds is a [`Tagged`] value whose first word is a per-kind magic number, and whose
//! address is in a registry of live objects from the moment it is handed out until it is closed. A
//! pointer coming back is checked for NULL and alignment, then looked up in the registry, and only then
//! read (the magic is checked once more): a request passed as a comm, a double close, a request or comm
//! used after its comm was closed, an mhandle from another plugin, or a pointer into unmapped memory is
//! refused without being dereferenced.
//!
//! What cannot be detected: a closed object's address that the allocator has already given to a new
//! object of the same kind (the stale pointer then names the new object), and a close racing with another
//! call on the same object (NCCL's contract: nothing is in progress on an object it closes). Objects are
//! only ever shared (`&T`): state that changes lives behind a lock inside.

use std::collections::BTreeMap;
use std::ffi::c_void;
use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::RwLock;

use prism_transport::engine::HANDLE_LEN;

use crate::error::{invalid, PluginError};

/// A kind of object NCCL may hold a pointer to.
pub trait Kind {
    /// Distinct per kind; never zero, never [`DEAD`].
    const MAGIC: u64;
    /// Name used in error messages.
    const NAME: &'static str;
}

/// Magic left in an object when it is freed, so a second close is recognised while the memory is
/// still untouched.
pub const DEAD: u64 = 0xDEAD_DEAD_DEAD_DEAD;

/// A run of live objects of one kind at consecutive addresses (one object, or a comm's request tokens).
#[derive(Debug, Clone, Copy)]
struct Span {
    magic: u64,
    name: &'static str,
    /// Bytes from one object to the next.
    stride: usize,
    count: usize,
    /// A single object from [`Tagged::into_raw`], which [`Tagged::take`] may free.
    owned: bool,
}

/// Every live object NCCL may hold a pointer to, by the address of the first of its run.
static LIVE: RwLock<BTreeMap<usize, Span>> = RwLock::new(BTreeMap::new());

/// Why a pointer is not a live object of the kind asked for, or `None` if it is one.
fn not_live(live: &BTreeMap<usize, Span>, addr: usize, magic: u64, stride: usize) -> Option<String> {
    let Some((&base, span)) = live.range(..=addr).next_back() else {
        return Some("never returned by Prism, or already closed".into());
    };
    let off = addr - base;
    if off >= span.stride.saturating_mul(span.count) || !off.is_multiple_of(span.stride) {
        return Some("never returned by Prism, or already closed".into());
    }
    if span.magic != magic || span.stride != stride {
        return Some(format!("it is a Prism {}", span.name));
    }
    None
}

/// A value with its kind's magic in front.
#[repr(C)]
pub struct Tagged<T: Kind> {
    magic: AtomicU64,
    /// The object itself.
    pub value: T,
}

impl<T: Kind> Tagged<T> {
    /// Wraps a value with its magic (for objects that live inside another allocation).
    pub fn new(value: T) -> Self {
        Self { magic: AtomicU64::new(T::MAGIC), value }
    }

    /// Moves `value` to the heap, registers it as live, and returns the pointer NCCL will hold.
    pub fn into_raw(value: T) -> *mut c_void {
        let p = Box::into_raw(Box::new(Self::new(value)));
        // SAFETY: fresh from Box::into_raw: valid, and not shared with anyone yet.
        Self::register_span(std::slice::from_ref(unsafe { &*p }), true);
        p.cast()
    }

    /// Registers objects that live inside another allocation (a comm's request tokens) as live. They
    /// must be unregistered with [`Tagged::unregister`] before that allocation is freed.
    pub fn register(objs: &[Self]) {
        if objs.is_empty() {
            return;
        }
        Self::register_span(objs, false);
    }

    fn register_span(objs: &[Self], owned: bool) {
        let span = Span { magic: T::MAGIC, name: T::NAME, stride: std::mem::size_of::<Self>(), count: objs.len(), owned };
        LIVE.write().insert(objs.as_ptr() as usize, span);
    }

    /// Forgets objects registered with [`Tagged::register`]: pointers to them are refused from now on.
    pub fn unregister(objs: &[Self]) {
        if objs.is_empty() {
            return;
        }
        for o in objs {
            o.magic.store(DEAD, Ordering::Release);
        }
        LIVE.write().remove(&(objs.as_ptr() as usize));
    }

    /// Whether the magic is intact.
    pub fn is_live(&self) -> bool {
        self.magic.load(Ordering::Acquire) == T::MAGIC
    }

    /// The first checks of a pointer NCCL passed, which need not read it.
    fn non_null_aligned(ptr: *mut c_void, what: &str) -> Result<*mut Self, PluginError> {
        if ptr.is_null() {
            return Err(invalid(format!("{what} is NULL")));
        }
        let p = ptr.cast::<Self>();
        if !p.is_aligned() {
            return Err(invalid(format!("{what} {ptr:p} is not a Prism {} (misaligned)", T::NAME)));
        }
        Ok(p)
    }

    /// Borrows the object behind a pointer NCCL passed.
    ///
    /// # Safety
    /// `ptr` may hold any value: it is read only if it is registered as a live `Tagged<T>`, and then it
    /// must stay alive for `'a` (nobody closes it meanwhile).
    pub unsafe fn from_ptr<'a>(ptr: *mut c_void, what: &str) -> Result<&'a T, PluginError> {
        // SAFETY: forwarded contract.
        unsafe { Self::tagged_from_ptr(ptr, what) }.map(|t| &t.value)
    }

    /// Like [`Tagged::from_ptr`], but the wrapper itself.
    ///
    /// # Safety
    /// As for [`Tagged::from_ptr`].
    pub unsafe fn tagged_from_ptr<'a>(ptr: *mut c_void, what: &str) -> Result<&'a Self, PluginError> {
        let p = Self::non_null_aligned(ptr, what)?;
        if let Some(why) = not_live(&LIVE.read(), ptr as usize, T::MAGIC, std::mem::size_of::<Self>()) {
            return Err(invalid(format!("{what} {ptr:p} is not a live Prism {} ({why})", T::NAME)));
        }
        // SAFETY: non-null, aligned, and registered as a live Tagged<T>, so readable; an AtomicU64 may
        // be read whatever bytes it holds.
        let magic = unsafe { (*p.cast::<AtomicU64>()).load(Ordering::Acquire) };
        if magic == DEAD {
            return Err(invalid(format!("{what} {ptr:p} is a {} that was already closed", T::NAME)));
        }
        if magic != T::MAGIC {
            return Err(invalid(format!("{what} {ptr:p} is not a Prism {}", T::NAME)));
        }
        // SAFETY: the magic matches, so by the caller's contract this is a live Tagged<T>.
        Ok(unsafe { &*p })
    }

    /// Takes back ownership of an object NCCL is done with, marking it dead first.
    ///
    /// # Safety
    /// As for [`Tagged::from_ptr`], and the object must have come from [`Tagged::into_raw`] and not be
    /// in use by another thread.
    pub unsafe fn take(ptr: *mut c_void, what: &str) -> Result<T, PluginError> {
        let p = Self::non_null_aligned(ptr, what)?;
        {
            // Checked and removed under one lock, before anything is read: of two threads closing one
            // object, one wins and the other is refused.
            let mut live = LIVE.write();
            if let Some(why) = not_live(&live, ptr as usize, T::MAGIC, std::mem::size_of::<Self>()) {
                return Err(invalid(format!("{what} {ptr:p} is not a live Prism {} ({why})", T::NAME)));
            }
            if !live.get(&(ptr as usize)).is_some_and(|s| s.owned) {
                return Err(invalid(format!("{what} {ptr:p} is a Prism {} inside another object; it cannot be closed", T::NAME)));
            }
            live.remove(&(ptr as usize));
        }
        // SAFETY: it was registered as a live, boxed Tagged<T> (from into_raw), and unregistering it
        // made this call its only owner; by the caller's contract nobody else uses it now.
        let boxed = unsafe { Box::from_raw(p) };
        boxed.magic.store(DEAD, Ordering::Release);
        Ok(boxed.value)
    }
}

/// Borrows NCCL's connection handle (`NCCL_NET_HANDLE_MAXSIZE` bytes).
///
/// # Safety
/// `ptr` must be NULL or point to `HANDLE_LEN` bytes that nobody else touches during `'a`.
pub unsafe fn conn_handle<'a>(ptr: *mut c_void) -> Result<&'a mut [u8; HANDLE_LEN], PluginError> {
    if ptr.is_null() {
        return Err(invalid("connection handle is NULL"));
    }
    // SAFETY: non-null, alignment 1, and the caller guarantees HANDLE_LEN exclusive bytes.
    Ok(unsafe { &mut *ptr.cast::<[u8; HANDLE_LEN]>() })
}

/// Checks an out-pointer NCCL passed and clears what it points to, so NCCL sees NULL whatever happens.
///
/// # Safety
/// `ptr` must be NULL or valid for a pointer-sized write.
pub unsafe fn out_ptr<'a, T>(ptr: *mut *mut T, what: &str) -> Result<&'a mut *mut T, PluginError> {
    if ptr.is_null() {
        return Err(invalid(format!("{what} is NULL")));
    }
    if !ptr.is_aligned() {
        return Err(invalid(format!("{what} {ptr:p} is misaligned")));
    }
    // SAFETY: non-null and aligned; the caller guarantees it is writable. A write, not a read: NCCL may
    // have left anything there (irecv's `*request` may even be the 0x1 hint).
    unsafe { ptr.write(std::ptr::null_mut()) };
    // SAFETY: as above; the slot now holds a valid (null) pointer.
    Ok(unsafe { &mut *ptr })
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Apple(u32);
    impl Kind for Apple {
        const MAGIC: u64 = 0xA991E;
        const NAME: &'static str = "apple";
    }
    struct Pear;
    impl Kind for Pear {
        const MAGIC: u64 = 0xBEA2;
        const NAME: &'static str = "pear";
    }

    #[test]
    fn an_object_comes_back_as_itself() {
        let p = Tagged::into_raw(Apple(7));
        // SAFETY: p came from into_raw and is live.
        assert_eq!(unsafe { Tagged::<Apple>::from_ptr(p, "comm") }.unwrap().0, 7);
        // SAFETY: as above; taken once.
        assert_eq!(unsafe { Tagged::<Apple>::take(p, "comm") }.unwrap().0, 7);
    }

    #[test]
    fn an_object_of_another_kind_is_rejected() {
        let p = Tagged::into_raw(Pear);
        // SAFETY: p points to a live Tagged<Pear>, readable.
        let err = unsafe { Tagged::<Apple>::from_ptr(p, "comm") }.err().unwrap();
        assert!(err.to_string().contains("not a live Prism apple (it is a Prism pear)"), "{err}");
        // SAFETY: p came from into_raw.
        unsafe { Tagged::<Pear>::take(p, "comm") }.unwrap();
    }

    #[test]
    fn null_is_rejected_with_the_argument_name() {
        // SAFETY: null is allowed by the contract.
        let err = unsafe { Tagged::<Apple>::from_ptr(std::ptr::null_mut(), "sendComm") }.err().unwrap();
        assert!(err.to_string().contains("sendComm is NULL"), "{err}");
    }

    #[test]
    fn a_dead_magic_is_reported_as_already_closed() {
        // Kept inside another allocation so the memory stays readable after "closing".
        let slot = Tagged::new(Apple(1));
        slot.magic.store(DEAD, Ordering::Release);
        let p = &slot as *const Tagged<Apple> as *mut c_void;
        // SAFETY: p points to readable memory of the right shape.
        let err = unsafe { Tagged::<Apple>::from_ptr(p, "comm") }.err().unwrap();
        assert!(err.to_string().contains("already closed"), "{err}");
    }

    #[test]
    fn a_closed_object_is_refused_and_cannot_be_taken_twice() {
        let p = Tagged::into_raw(Apple(3));
        // SAFETY: p came from into_raw; taken once.
        unsafe { Tagged::<Apple>::take(p, "comm") }.unwrap();
        // SAFETY: p is no longer registered, so it is refused before it is read.
        let err = unsafe { Tagged::<Apple>::from_ptr(p, "comm") }.err().unwrap();
        assert!(err.to_string().contains("already closed"), "{err}");
        // SAFETY: as above.
        assert!(unsafe { Tagged::<Apple>::take(p, "comm") }.is_err());
    }

    #[test]
    fn a_pointer_to_unmapped_memory_is_refused_without_reading() {
        // An aligned address in the first page, which is never mapped.
        let p = std::ptr::without_provenance_mut::<c_void>(0x800);
        // SAFETY: the registry refuses p before anything reads it.
        assert!(unsafe { Tagged::<Apple>::from_ptr(p, "comm") }.is_err());
    }

    #[test]
    fn objects_inside_a_registered_run_are_found_and_only_at_their_own_addresses() {
        let run: Box<[Tagged<Apple>]> = (0..4).map(|i| Tagged::new(Apple(i))).collect();
        Tagged::register(&run);
        let second = std::ptr::from_ref(&run[2]).cast_mut().cast::<c_void>();
        // SAFETY: a registered, live element.
        assert_eq!(unsafe { Tagged::<Apple>::from_ptr(second, "request") }.unwrap().0, 2);
        let inside = second.cast::<u8>().wrapping_add(8).cast::<c_void>();
        // SAFETY: refused by the registry (not at an element's start) before it is read.
        assert!(unsafe { Tagged::<Apple>::from_ptr(inside, "request") }.is_err());
        let past = std::ptr::from_ref(&run[3]).cast::<Tagged<Apple>>().wrapping_add(1).cast_mut().cast::<c_void>();
        // SAFETY: one past the run: refused before it is read.
        assert!(unsafe { Tagged::<Apple>::from_ptr(past, "request") }.is_err());
        // SAFETY: an element of a run is not a boxed object: take refuses it.
        assert!(unsafe { Tagged::<Apple>::take(second, "request") }.is_err());
        Tagged::unregister(&run);
        // SAFETY: no longer registered: refused.
        assert!(unsafe { Tagged::<Apple>::from_ptr(second, "request") }.is_err());
    }

    #[test]
    fn a_misaligned_pointer_is_rejected_without_reading() {
        let words = [0u64; 4];
        let p = (words.as_ptr() as *mut u8).wrapping_add(1).cast::<c_void>();
        // SAFETY: readable memory; the alignment check comes first.
        assert!(unsafe { Tagged::<Apple>::from_ptr(p, "comm") }.is_err());
    }

    #[test]
    fn an_out_pointer_is_cleared_even_when_it_held_the_optional_completion_hint() {
        let mut request: *mut c_void = std::ptr::without_provenance_mut(crate::abi::OPTIONAL_RECV_COMPLETION);
        // SAFETY: &mut request is valid for writes.
        let out = unsafe { out_ptr(&mut request, "request") }.unwrap();
        assert!(out.is_null());
        assert!(request.is_null());
    }
}
