//! Where the async queue's requests are kept: one set of operations
//! ([`JobStore`]) with two backends, the embedded store (default,
//! [`embedded`]) and Redis (`--queue-url`, shared by several balancers,
//! [`redis`]). Both pass one test suite (`suite.rs`); where they differ is
//! said in each backend's docs.

pub mod embedded;
pub mod redis;
#[cfg(test)]
mod suite;

pub use embedded::EmbeddedStore;
pub use redis::RedisStore;

use super::job::{Answer, Counts, Job, NewJob, Reclaimed, Result};

/// The async queue's storage. Every call is one atomic change (or read);
/// calls block (file sync, network), so the async code calls them off its
/// threads.
pub trait JobStore: Send + Sync {
    /// Queues requests (`id` each); a request whose idempotency key is
    /// known gives the existing one instead (`false`: not new). All or
    /// nothing: over `max_length` (without `auto_evict`) or a body over
    /// `max_payload_bytes`, none is queued.
    fn submit_many(&self, new: Vec<(NewJob, String)>, now_ms: u64) -> Result<Vec<(Job, bool)>>;

    /// Queues one request (see [`JobStore::submit_many`]).
    fn submit(&self, new: NewJob, id: String, now_ms: u64) -> Result<(Job, bool)> {
        let mut done = self.submit_many(vec![(new, id)], now_ms)?;
        Ok(done.pop().expect("one request in, one out"))
    }

    fn get(&self, id: &str) -> Result<Option<Job>>;
    fn get_many(&self, ids: &[String]) -> Result<Vec<Option<Job>>>;

    /// Leases up to `n` queued requests, highest priority first, for
    /// `max_idle`.
    fn lease(&self, n: usize, now_ms: u64) -> Result<Vec<Job>>;

    /// Ends delivery `attempt` of `id` with the fleet's answer (`None`: the
    /// request is no longer that delivery's).
    fn finish(&self, id: &str, attempt: u32, answer: Answer, now_ms: u64) -> Result<Option<Job>>;

    /// Delivery `attempt` of `id` failed (`counted`: it used up a delivery):
    /// queued again, expired or dead-lettered (see
    /// [`super::job::QueueConfig`]).
    fn retry(
        &self,
        id: &str,
        attempt: u32,
        error: &str,
        counted: bool,
        now_ms: u64,
    ) -> Result<Option<Job>>;

    /// Cancels a queued or dispatched request; a finished one stays as it
    /// is.
    fn cancel(&self, id: &str, now_ms: u64) -> Result<Option<Job>>;

    /// Lost leases delivered again (or dead-lettered), deadlines expired,
    /// finished requests past retention purged.
    fn reclaim(&self, now_ms: u64) -> Result<Reclaimed>;

    fn counts(&self) -> Result<Counts>;

    /// The results feed: finished requests in finish order after the
    /// cursor `after`, with their cursors.
    fn finished_since(&self, after: Option<&str>, limit: usize) -> Result<Vec<(String, Job)>>;

    /// The Batch API's files and batches, by kind and id.
    fn put_blob(&self, kind: &str, id: &str, bytes: &[u8]) -> Result<()>;
    fn get_blob(&self, kind: &str, id: &str) -> Result<Option<Vec<u8>>>;
    fn delete_blob(&self, kind: &str, id: &str) -> Result<()>;
    fn blob_ids(&self, kind: &str) -> Result<Vec<String>>;
}
