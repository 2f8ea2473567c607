//! Request ids: the client's when usable, else generated.

/// Longest client-supplied request id kept; longer ones are replaced.
const MAX_REQUEST_ID_LEN: usize = 128;

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
    fn next(&self) -> String {
        let n = self.next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let counter_digits = (16 - n.leading_zeros() as usize / 4).max(8);
        let mut id = String::with_capacity(16 + counter_digits);
        push_hex(&mut id, self.prefix, 16);
        push_hex(&mut id, n, counter_digits);
        id
    }

    /// The client's id when it is 1-128 visible ASCII characters, else a
    /// new one.
    pub fn for_request(&self, given: Option<&http::HeaderValue>) -> (String, bool) {
        match given.map(|v| v.as_bytes()) {
            Some(id)
                if !id.is_empty()
                    && id.len() <= MAX_REQUEST_ID_LEN
                    && id.iter().all(u8::is_ascii_graphic) =>
            {
                (String::from_utf8_lossy(id).into_owned(), true)
            }
            _ => (self.next(), false),
        }
    }
}

/// Appends the `digits` lowest hex digits of `n`, lower case.
fn push_hex(out: &mut String, n: u64, digits: usize) {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    for i in (0..digits).rev() {
        out.push(char::from(HEX[((n >> (4 * i)) & 0xf) as usize]));
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
            assert_eq!(ids.next(), format!("{:016x}{n:08x}", ids.prefix));
        }
    }
}
