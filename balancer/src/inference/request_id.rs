//! Request ids: the client's when usable, else generated.

use http::HeaderValue;

/// Longest client-supplied request id kept; longer ones are replaced.
const MAX_REQUEST_ID_LEN: usize = 128;

/// A request's id, kept as the header value it is sent as (to the model
/// server when the balancer made it, and in the answer): the client's
/// value itself, or one built once, so that each header takes a shared
/// copy rather than a checked and copied string.
#[derive(Debug, Clone)]
pub struct RequestId(HeaderValue);

impl Default for RequestId {
    fn default() -> Self {
        RequestId(HeaderValue::from_static(""))
    }
}

impl RequestId {
    /// The id (only visible ASCII: [`RequestIds::for_request`] keeps no
    /// other).
    pub fn as_str(&self) -> &str {
        self.0.to_str().unwrap_or_default()
    }

    /// The id as a header value (a shared copy).
    pub fn header(&self) -> HeaderValue {
        self.0.clone()
    }
}

/// Request ids unique to this process run: a random-enough prefix fixed at
/// start-up and a counter, cheaper than a UUID per request.
pub struct RequestIds {
    prefix: u64,
    next: std::sync::atomic::AtomicU64,
}

impl Default for RequestIds {
    fn default() -> Self {
        Self::new()
    }
}

impl RequestIds {
    pub fn new() -> Self {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
        RequestIds {
            prefix: nanos ^ (u64::from(std::process::id()) << 32),
            next: std::sync::atomic::AtomicU64::new(0),
        }
    }

    /// The prefix in 16 hex digits, then the counter in at least 8 (as
    /// `format!("{:016x}{:08x}")` writes them, without its machinery: this
    /// runs for every request).
    fn next(&self) -> RequestId {
        let n = self.next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let counter_digits = (16 - n.leading_zeros() as usize / 4).max(8);
        let mut id = [0u8; 32];
        push_hex(&mut id[..16], self.prefix);
        push_hex(&mut id[16..16 + counter_digits], n);
        let value = HeaderValue::from_bytes(&id[..16 + counter_digits]);
        RequestId(value.expect("hex digits make a header value"))
    }

    /// The client's id when it is 1-128 visible ASCII characters, else a
    /// new one; and whether it is the client's.
    pub fn for_request(&self, given: Option<&HeaderValue>) -> (RequestId, bool) {
        match given {
            Some(id)
                if !id.is_empty()
                    && id.len() <= MAX_REQUEST_ID_LEN
                    && id.as_bytes().iter().all(u8::is_ascii_graphic) =>
            {
                (RequestId(id.clone()), true)
            }
            _ => (self.next(), false),
        }
    }
}

/// Writes the `out.len()` lowest hex digits of `n` into `out`, lower case.
fn push_hex(out: &mut [u8], n: u64) {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let digits = out.len();
    for (i, d) in out.iter_mut().enumerate() {
        *d = HEX[((n >> (4 * (digits - 1 - i))) & 0xf) as usize];
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_the_prefix_and_the_counter_in_hex() {
        let ids = RequestIds::new();
        for n in [0, 1, 0xabc, 0xffff_ffff, 0x1_0000_0000, u64::MAX - 1] {
            ids.next.store(n, std::sync::atomic::Ordering::Relaxed);
            assert_eq!(ids.next().as_str(), format!("{:016x}{n:08x}", ids.prefix));
        }
    }

    #[test]
    fn a_client_id_is_kept_only_when_it_is_visible_ascii() {
        let ids = RequestIds::new();
        let given = |v: &[u8]| {
            let v = HeaderValue::from_bytes(v).unwrap();
            let (id, kept) = ids.for_request(Some(&v));
            (id.as_str().to_owned(), kept)
        };
        assert_eq!(given(b"abc-123"), ("abc-123".to_owned(), true));
        for odd in [&b"two words"[..], b"", &[b'a'; 129], b"caf\xc3\xa9"] {
            let (id, kept) = given(odd);
            assert!(!kept && id.len() >= 24, "{odd:?} replaced by {id}");
        }
        assert!(given(&[b'a'; 128]).1, "128 characters are kept");
        assert_eq!(ids.for_request(None).0.header().len(), 24);
    }
}
