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

    fn next(&self) -> String {
        let n = self.next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        format!("{:016x}{n:08x}", self.prefix)
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
