//! Decoding hostile messages allocates memory in proportion to the limits, not to what the
//! encoding can express: messages packed with the smallest possible repeated elements (2 bytes
//! on the wire each, 30-100 times that decoded) are refused before prost builds them.
//!
//! A counting global allocator measures the peak during each decode. This binary holds one test
//! so that nothing else allocates meanwhile.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

use bytes::Bytes;
use hivemesh::dht::{DhtValue, DhtValueError, ValidationLimits};

struct Counting;

static CURRENT: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

// SAFETY: forwards to the system allocator and only counts.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the caller's contract is passed on unchanged.
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            let now = CURRENT.fetch_add(layout.size(), Ordering::Relaxed) + layout.size();
            PEAK.fetch_max(now, Ordering::Relaxed);
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: as above.
        unsafe { System.dealloc(ptr, layout) };
        CURRENT.fetch_sub(layout.size(), Ordering::Relaxed);
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// The most `f` allocated at once beyond what was allocated when it began.
fn peak_during<T>(f: impl FnOnce() -> T) -> (T, usize) {
    let base = CURRENT.load(Ordering::Relaxed);
    PEAK.store(base, Ordering::Relaxed);
    let out = f();
    (out, PEAK.load(Ordering::Relaxed) - base)
}

fn varint(mut v: usize, out: &mut Vec<u8>) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

/// Field `field` (length-delimited) holding `body`.
fn wrap(field: u32, body: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(body.len() + 16);
    varint(((field << 3) | 2) as usize, &mut out);
    varint(body.len(), &mut out);
    out.extend_from_slice(body);
    out
}

/// `count` empty occurrences of message field `field`: 2 bytes each.
fn empty_elements(field: u32, count: usize) -> Vec<u8> {
    [((field << 3) | 2) as u8, 0].repeat(count)
}

#[test]
fn hostile_repeated_fields_cost_memory_in_proportion_to_the_limits() {
    // Matchmaking: a leader's reply with 2 million empty members in 4 MiB (the message limit).
    let members = empty_elements(5, ((4 << 20) - 16) / 2);
    let frame = wrap(2, &members);
    assert!(frame.len() <= hivemesh::matchmaking::wire::MAX_MESSAGE_BYTES);
    let (got, peak) = peak_during(|| hivemesh::matchmaking::wire::decode(&frame));
    assert!(got.is_err());
    assert!(
        peak <= 2 * frame.len(),
        "matchmaking: decoding {} bytes allocated {peak} at its peak",
        frame.len()
    );

    // State sharing: metadata with 16 million empty tensor descriptions in 32 MiB.
    let tensors = empty_elements(3, ((32 << 20) - 16) / 2);
    let response = Bytes::from(wrap(1, &tensors));
    let len = response.len();
    assert!(len <= hivemesh::averager::state::wire::MAX_RESPONSE_BYTES);
    let (got, peak) = peak_during(|| hivemesh::averager::state::wire::decode_response(response));
    assert!(got.is_err());
    assert!(
        peak <= len,
        "state: decoding {len} bytes allocated {peak} at its peak"
    );

    // The DHT: a value with 390,000 empty entries in 768 KiB.
    let limits = ValidationLimits::default();
    let value = empty_elements(2, (limits.max_value_bytes - 16) / 2);
    let (got, peak) = peak_during(|| DhtValue::from_bytes(&value, &limits));
    assert!(matches!(got, Err(DhtValueError::TooManySubkeys { .. })));
    assert!(
        peak <= value.len(),
        "dht: decoding {} bytes allocated {peak} at its peak",
        value.len()
    );
}
