//! Where the async queue lives: the embedded store (default) or Redis
//! (`--queue-url`), behind one set of operations.

use super::redis_store::RedisStore;
use super::store::{Answer, Counts, Job, NewJob, Reclaimed, Result, Store};

pub enum Backend {
    Embedded(Store),
    Redis(Box<RedisStore>),
}

macro_rules! delegate {
    ($($name:ident($($arg:ident: $ty:ty),*) -> $ret:ty;)*) => {
        impl Backend {
            $(
                pub fn $name(&self, $($arg: $ty),*) -> $ret {
                    match self {
                        Backend::Embedded(s) => s.$name($($arg),*),
                        Backend::Redis(r) => r.$name($($arg),*),
                    }
                }
            )*
        }
    };
}

impl Backend {
    /// Queues one request (see `submit_many`).
    pub fn submit(&self, new: NewJob, id: String, now_ms: u64) -> Result<(Job, bool)> {
        let mut done = self.submit_many(vec![(new, id)], now_ms)?;
        Ok(done.pop().expect("one request in, one out"))
    }
}

delegate! {
    submit_many(new: Vec<(NewJob, String)>, now_ms: u64) -> Result<Vec<(Job, bool)>>;
    get(id: &str) -> Result<Option<Job>>;
    get_many(ids: &[String]) -> Result<Vec<Option<Job>>>;
    lease(n: usize, now_ms: u64) -> Result<Vec<Job>>;
    finish(id: &str, attempt: u32, answer: Answer, now_ms: u64) -> Result<Option<Job>>;
    retry(id: &str, attempt: u32, error: &str, counted: bool, now_ms: u64) -> Result<Option<Job>>;
    cancel(id: &str, now_ms: u64) -> Result<Option<Job>>;
    reclaim(now_ms: u64) -> Result<Reclaimed>;
    counts() -> Result<Counts>;
    finished_since(after: Option<&str>, limit: usize) -> Result<Vec<(String, Job)>>;
    put_blob(kind: &str, id: &str, bytes: &[u8]) -> Result<()>;
    get_blob(kind: &str, id: &str) -> Result<Option<Vec<u8>>>;
    delete_blob(kind: &str, id: &str) -> Result<()>;
    blob_ids(kind: &str) -> Result<Vec<String>>;
}
