//! The async queue in Redis (`--queue-url redis://…`), so that several
//! balancers share one queue: a stream with a consumer group holds the
//! queued and dispatched requests, the consumer group's pending list is the
//! set of leases. Same semantics as the embedded store ([`super::EmbeddedStore`]),
//! with these differences: a request delivered again goes to the back of the
//! queue, `auto_evict` drops the oldest request of the lowest priority, and two
//! balancers that change one request at the same moment (a cancel racing an
//! answer) may both win; the last write stays.
//!
//! Keys, under `flowgate:{queue}:`: `queue:{priority}` (a stream per
//! priority, field `id`, group `dispatchers`; `priorities` is the sorted
//! set of them, highest first), `job:{id}` (JSON), `key:{idempotency key}` (id),
//! `finished` (stream of finished ids: the results feed), `deadlines` (a
//! sorted set of queued ids by deadline), `blob:{kind}:{id}` and
//! `blobs:{kind}` (a sorted set of ids) for the Batch API.
//!
//! Time: leases run out and finished requests age out by the Redis
//! server's clock (a consumer group's idle time, key expiry), so several
//! balancers agree on them whatever their own clocks say; deadlines are
//! checked against the caller's `now_ms`.

use std::sync::Mutex;
use std::time::Duration;

use redis::{Connection, Value};

use super::JobStore;
use crate::asyncq::job::{
    Answer, Counts, Job, NewJob, QueueConfig, Reclaimed, Redelivery, Result, Status, StoreError,
    LEASE_LOST,
};

const GROUP: &str = "dispatchers";

impl From<redis::RedisError> for StoreError {
    fn from(e: redis::RedisError) -> Self {
        StoreError::Storage(format!("redis: {e}"))
    }
}

pub struct RedisStore {
    client: redis::Client,
    conn: Mutex<Option<Connection>>,
    config: QueueConfig,
    prefix: String,
    /// This balancer's name in the consumer group.
    consumer: String,
}

fn bulk(v: &Value) -> Option<String> {
    match v {
        Value::BulkString(b) => Some(String::from_utf8_lossy(b).into_owned()),
        Value::SimpleString(s) => Some(s.clone()),
        _ => None,
    }
}

/// Stream entries `[[entry id, [field, value, …]], …]` as (entry id, the
/// `id` field).
fn entries(v: &Value) -> Vec<(String, String)> {
    let Value::Array(items) = v else {
        return Vec::new();
    };
    items
        .iter()
        .filter_map(|item| {
            let Value::Array(pair) = item else {
                return None;
            };
            let entry = bulk(pair.first()?)?;
            let Value::Array(fields) = pair.get(1)? else {
                return None;
            };
            let id = fields
                .chunks(2)
                .find(|kv| bulk(&kv[0]).as_deref() == Some("id"))
                .and_then(|kv| kv.get(1).and_then(bulk))?;
            Some((entry, id))
        })
        .collect()
}

impl RedisStore {
    /// Connects and creates the consumer group (checked at start-up).
    pub fn open(url: &str, config: QueueConfig, consumer: String) -> Result<RedisStore> {
        let client = redis::Client::open(url)
            .map_err(|e| StoreError::Storage(format!("bad --queue-url {url}: {e}")))?;
        let store = RedisStore {
            client,
            conn: Mutex::new(None),
            config,
            prefix: "flowgate:default:".into(),
            consumer,
        };
        // Reachable now, or a clear error at start-up.
        store.run(|c| redis::cmd("PING").query::<String>(c))?;
        Ok(store)
    }

    /// The stream of queued requests of `priority`.
    fn queue_key(&self, priority: i32) -> String {
        self.key(&format!("queue:{priority}"))
    }

    /// The priorities with a queue stream, highest first.
    fn priorities(&self, c: &mut Connection) -> redis::RedisResult<Vec<i32>> {
        let found: Vec<String> = redis::cmd("ZRANGE")
            .arg(self.key("priorities"))
            .arg(0)
            .arg(-1)
            .query(c)?;
        Ok(found.iter().filter_map(|p| p.parse().ok()).collect())
    }

    fn key(&self, name: &str) -> String {
        format!("{}{name}", self.prefix)
    }

    /// Runs `f` on the connection, connecting (again) when needed.
    fn run<T>(&self, f: impl FnOnce(&mut Connection) -> redis::RedisResult<T>) -> Result<T> {
        let mut guard = self.conn.lock().expect("redis connection lock");
        if guard.is_none() {
            let conn = self
                .client
                .get_connection_with_timeout(Duration::from_secs(5))?;
            conn.set_read_timeout(Some(Duration::from_secs(10)))?;
            *guard = Some(conn);
        }
        let result = f(guard.as_mut().expect("connected"));
        if let Err(e) = &result {
            if e.is_io_error() || e.is_connection_dropped() || e.is_timeout() {
                *guard = None;
            }
        }
        Ok(result?)
    }

    fn load(&self, c: &mut Connection, id: &str) -> redis::RedisResult<Option<Job>> {
        let raw: Option<String> = redis::cmd("GET")
            .arg(self.key(&format!("job:{id}")))
            .query(c)?;
        Ok(raw.and_then(|r| serde_json::from_str(&r).ok()))
    }

    fn save(&self, c: &mut Connection, job: &Job) -> redis::RedisResult<()> {
        let key = self.key(&format!("job:{}", job.id));
        let json = serde_json::to_string(job).expect("a job serializes");
        let mut cmd = redis::cmd("SET");
        cmd.arg(&key).arg(json);
        if job.status.is_final() {
            cmd.arg("PX").arg(self.config.retention.as_millis() as u64);
        }
        cmd.query(c)
    }

    /// Adds the request to the back of its priority's queue.
    fn enqueue(&self, c: &mut Connection, job: &mut Job) -> redis::RedisResult<()> {
        let added: i64 = redis::cmd("ZADD")
            .arg(self.key("priorities"))
            .arg("NX")
            .arg(-i64::from(job.priority))
            .arg(job.priority)
            .query(c)?;
        if added == 1 {
            let created = redis::cmd("XGROUP")
                .arg("CREATE")
                .arg(self.queue_key(job.priority))
                .arg(GROUP)
                .arg("0")
                .arg("MKSTREAM")
                .query::<()>(c);
            if let Err(e) = created {
                if e.code() != Some("BUSYGROUP") {
                    return Err(e);
                }
            }
        }
        let entry: String = redis::cmd("XADD")
            .arg(self.queue_key(job.priority))
            .arg("*")
            .arg("id")
            .arg(&job.id)
            .query(c)?;
        job.stream_entry = Some(entry);
        job.status = Status::Queued;
        if let Some(deadline) = job.deadline_ms {
            // Found by `reclaim` once it passes, as the embedded store does.
            redis::cmd("ZADD")
                .arg(self.key("deadlines"))
                .arg(deadline)
                .arg(&job.id)
                .query::<()>(c)?;
        }
        self.save(c, job)
    }

    /// Queued requests whose deadline passed by `now_ms` end `expired`
    /// (one under way is left to its delivery, whose failure expires it).
    fn expire_deadlines(
        &self,
        c: &mut Connection,
        now_ms: u64,
        done: &mut Reclaimed,
    ) -> redis::RedisResult<()> {
        let due: Vec<String> = redis::cmd("ZRANGE")
            .arg(self.key("deadlines"))
            .arg("-inf")
            .arg(now_ms)
            .arg("BYSCORE")
            .arg("LIMIT")
            .arg(0)
            .arg(1000)
            .query(c)?;
        for id in due {
            redis::cmd("ZREM")
                .arg(self.key("deadlines"))
                .arg(&id)
                .query::<()>(c)?;
            let Some(mut job) = self.load(c, &id)? else {
                continue;
            };
            if job.status != Status::Queued || job.deadline_ms.is_none_or(|d| d > now_ms) {
                continue;
            }
            // Whoever takes the entry off the queue first expires it.
            if !self.dequeue(c, &mut job)? {
                continue;
            }
            job.status = Status::Expired;
            job.updated_ms = now_ms;
            self.finished(c, &job)?;
            done.expired.push(job.id);
        }
        Ok(())
    }

    /// Takes the request's entry off the queue (acknowledged and deleted).
    fn dequeue(&self, c: &mut Connection, job: &mut Job) -> redis::RedisResult<bool> {
        let Some(entry) = job.stream_entry.take() else {
            return Ok(false);
        };
        let acked: i64 = redis::cmd("XACK")
            .arg(self.queue_key(job.priority))
            .arg(GROUP)
            .arg(&entry)
            .query(c)?;
        let deleted: i64 = redis::cmd("XDEL")
            .arg(self.queue_key(job.priority))
            .arg(&entry)
            .query(c)?;
        Ok(acked + deleted > 0)
    }

    fn finished(&self, c: &mut Connection, job: &Job) -> redis::RedisResult<()> {
        self.save(c, job)?;
        let retention_start =
            crate::asyncq::now_ms().saturating_sub(self.config.retention.as_millis() as u64);
        redis::cmd("XADD")
            .arg(self.key("finished"))
            .arg("MINID")
            .arg(retention_start)
            .arg("*")
            .arg("id")
            .arg(&job.id)
            .query::<String>(c)
            .map(drop)
    }

    fn queued(&self, c: &mut Connection) -> redis::RedisResult<(u64, u64)> {
        let (mut queued, mut dispatched) = (0, 0);
        for priority in self.priorities(c)? {
            let len: u64 = redis::cmd("XLEN").arg(self.queue_key(priority)).query(c)?;
            let pending: Value = redis::cmd("XPENDING")
                .arg(self.queue_key(priority))
                .arg(GROUP)
                .query(c)?;
            let pending = match pending {
                Value::Array(v) => match v.first() {
                    Some(Value::Int(n)) => *n as u64,
                    _ => 0,
                },
                _ => 0,
            };
            queued += len.saturating_sub(pending);
            dispatched += pending;
        }
        Ok((queued, dispatched))
    }

    /// Drops the oldest queued request of the lowest priority (marked
    /// `evicted`) to make room.
    fn evict_one(&self, c: &mut Connection, now_ms: u64) -> redis::RedisResult<()> {
        for priority in self.priorities(c)?.into_iter().rev() {
            let reply: Value = redis::cmd("XREADGROUP")
                .arg("GROUP")
                .arg(GROUP)
                .arg(&self.consumer)
                .arg("COUNT")
                .arg(1)
                .arg("STREAMS")
                .arg(self.queue_key(priority))
                .arg(">")
                .query(c)?;
            let Value::Array(streams) = &reply else {
                continue;
            };
            let Some(Value::Array(pair)) = streams.first() else {
                continue;
            };
            let Some((entry, id)) = pair
                .get(1)
                .and_then(|items| entries(items).into_iter().next())
            else {
                continue;
            };
            let mut job = match self.load(c, &id)? {
                Some(job) => job,
                None => Job::new(
                    NewJob {
                        priority,
                        ..NewJob::default()
                    },
                    id,
                    now_ms,
                ),
            };
            job.stream_entry = Some(entry);
            self.dequeue(c, &mut job)?;
            if !job.status.is_final() {
                job.status = Status::Evicted;
                job.updated_ms = now_ms;
                self.finished(c, &job)?;
            }
            return Ok(());
        }
        Ok(())
    }

    /// Ends a lease held by `attempt`, then `update` (which returns
    /// whether the request is final).
    fn end_lease(
        &self,
        id: &str,
        attempt: u32,
        now_ms: u64,
        update: impl FnOnce(&Self, &mut Connection, &mut Job) -> redis::RedisResult<()>,
    ) -> Result<Option<Job>> {
        self.run(|c| {
            let Some(mut job) = self.load(c, id)? else {
                return Ok(None);
            };
            if job.status != Status::Dispatched || job.attempts != attempt {
                return Ok(None);
            }
            self.dequeue(c, &mut job)?;
            job.lease_until_ms = None;
            job.updated_ms = now_ms;
            update(self, c, &mut job)?;
            Ok(Some(job))
        })
    }

    /// Carries out [`QueueConfig::redelivery`]'s decision (in Redis both
    /// kinds of requeue go to the back of the queue).
    fn redeliver(
        &self,
        c: &mut Connection,
        job: &mut Job,
        next: Redelivery,
    ) -> redis::RedisResult<()> {
        match next {
            Redelivery::Finished => self.finished(c, job),
            Redelivery::Again | Redelivery::Rear => self.enqueue(c, job),
        }
    }
}

impl JobStore for RedisStore {
    fn submit_many(&self, new: Vec<(NewJob, String)>, now_ms: u64) -> Result<Vec<(Job, bool)>> {
        self.config.check_payloads(&new)?;
        self.run(|c| {
            let (queued, _) = self.queued(c)?;
            let over = (queued as usize + new.len()).saturating_sub(self.config.max_length);
            if over > 0 {
                if !self.config.auto_evict || new.len() > self.config.max_length {
                    return Ok(Err(StoreError::Full(self.config.max_length)));
                }
                for _ in 0..over {
                    self.evict_one(c, now_ms)?;
                }
            }
            let mut out = Vec::with_capacity(new.len());
            for (n, id) in new {
                if let Some(k) = &n.idempotency_key {
                    let claimed: Option<String> = redis::cmd("SET")
                        .arg(self.key(&format!("key:{k}")))
                        .arg(&id)
                        .arg("NX")
                        .arg("GET")
                        .query(c)?;
                    if let Some(existing) = claimed {
                        if let Some(job) = self.load(c, &existing)? {
                            out.push((job, false));
                            continue;
                        }
                    }
                }
                let mut job = Job::new(n, id, now_ms);
                self.enqueue(c, &mut job)?;
                out.push((job, true));
            }
            Ok(Ok(out))
        })?
    }

    fn get(&self, id: &str) -> Result<Option<Job>> {
        self.run(|c| self.load(c, id))
    }

    fn get_many(&self, ids: &[String]) -> Result<Vec<Option<Job>>> {
        self.run(|c| ids.iter().map(|id| self.load(c, id)).collect())
    }

    fn lease(&self, n: usize, now_ms: u64) -> Result<Vec<Job>> {
        if n == 0 {
            return Ok(Vec::new());
        }
        self.run(|c| {
            // Highest priority first, each stream in arrival order.
            let mut delivered = Vec::new();
            for priority in self.priorities(c)? {
                if delivered.len() >= n {
                    break;
                }
                let reply: Value = redis::cmd("XREADGROUP")
                    .arg("GROUP")
                    .arg(GROUP)
                    .arg(&self.consumer)
                    .arg("COUNT")
                    .arg(n - delivered.len())
                    .arg("STREAMS")
                    .arg(self.queue_key(priority))
                    .arg(">")
                    .query(c)?;
                if let Value::Array(streams) = &reply {
                    for stream in streams {
                        if let Value::Array(pair) = stream {
                            if let Some(items) = pair.get(1) {
                                delivered.extend(
                                    entries(items).into_iter().map(|(e, id)| (priority, e, id)),
                                );
                            }
                        }
                    }
                }
            }
            let mut leased = Vec::new();
            for (priority, entry, id) in delivered {
                let Some(mut job) = self.load(c, &id)? else {
                    let gone = NewJob {
                        priority,
                        ..NewJob::default()
                    };
                    let mut gone = Job::new(gone, id, now_ms);
                    gone.stream_entry = Some(entry);
                    self.dequeue(c, &mut gone)?;
                    continue;
                };
                job.stream_entry = Some(entry);
                if job.status.is_final() {
                    // Cancelled while queued.
                    self.dequeue(c, &mut job)?;
                    continue;
                }
                if job.deadline_ms.is_some_and(|d| d <= now_ms) {
                    self.dequeue(c, &mut job)?;
                    job.status = Status::Expired;
                    job.updated_ms = now_ms;
                    self.finished(c, &job)?;
                    continue;
                }
                job.status = Status::Dispatched;
                job.attempts += 1;
                job.updated_ms = now_ms;
                job.lease_until_ms = Some(now_ms + self.config.max_idle.as_millis() as u64);
                self.save(c, &job)?;
                leased.push(job);
            }
            Ok(leased)
        })
    }

    fn finish(&self, id: &str, attempt: u32, answer: Answer, now_ms: u64) -> Result<Option<Job>> {
        self.end_lease(id, attempt, now_ms, |s, c, job| {
            job.status = answer.outcome();
            job.answer = Some(answer);
            s.finished(c, job)
        })
    }

    fn retry(
        &self,
        id: &str,
        attempt: u32,
        error: &str,
        counted: bool,
        now_ms: u64,
    ) -> Result<Option<Job>> {
        self.end_lease(id, attempt, now_ms, |s, c, job| {
            let next = s.config.redelivery(job, error, counted, now_ms);
            s.redeliver(c, job, next)
        })
    }

    fn cancel(&self, id: &str, now_ms: u64) -> Result<Option<Job>> {
        self.run(|c| {
            let Some(mut job) = self.load(c, id)? else {
                return Ok(None);
            };
            if job.status.is_final() {
                return Ok(Some(job));
            }
            self.dequeue(c, &mut job)?;
            job.status = Status::Cancelled;
            job.updated_ms = now_ms;
            job.lease_until_ms = None;
            self.finished(c, &job)?;
            Ok(Some(job))
        })
    }

    /// Delivers again what any balancer leased and did not finish in time.
    fn reclaim(&self, now_ms: u64) -> Result<Reclaimed> {
        let idle = self.config.max_idle.as_millis() as u64;
        self.run(|c| {
            let mut done = Reclaimed::default();
            for priority in self.priorities(c)? {
                let stream = self.queue_key(priority);
                let pending: Value = redis::cmd("XPENDING")
                    .arg(&stream)
                    .arg(GROUP)
                    .arg("IDLE")
                    .arg(idle)
                    .arg("-")
                    .arg("+")
                    .arg(100)
                    .query(c)?;
                let Value::Array(rows) = pending else {
                    continue;
                };
                for row in rows {
                    let Value::Array(fields) = row else { continue };
                    let Some(entry) = fields.first().and_then(bulk) else {
                        continue;
                    };
                    // Whoever acknowledges the entry first delivers it again.
                    let acked: i64 = redis::cmd("XACK")
                        .arg(&stream)
                        .arg(GROUP)
                        .arg(&entry)
                        .query(c)?;
                    if acked == 0 {
                        continue;
                    }
                    let range: Value = redis::cmd("XRANGE")
                        .arg(&stream)
                        .arg(&entry)
                        .arg(&entry)
                        .query(c)?;
                    redis::cmd("XDEL")
                        .arg(&stream)
                        .arg(&entry)
                        .query::<i64>(c)?;
                    let Some((_, id)) = entries(&range).into_iter().next() else {
                        continue;
                    };
                    let Some(mut job) = self.load(c, &id)? else {
                        continue;
                    };
                    if job.status != Status::Dispatched {
                        continue;
                    }
                    job.stream_entry = None;
                    job.lease_until_ms = None;
                    let next = self.config.redelivery(&mut job, LEASE_LOST, true, now_ms);
                    self.redeliver(c, &mut job, next)?;
                    done.record(&job);
                }
            }
            self.expire_deadlines(c, now_ms, &mut done)?;
            Ok(done)
        })
    }

    fn counts(&self) -> Result<Counts> {
        self.run(|c| {
            let (queued, dispatched) = self.queued(c)?;
            let finished: u64 = redis::cmd("XLEN").arg(self.key("finished")).query(c)?;
            Ok(Counts {
                queued,
                dispatched,
                finished,
                oldest_queued_ms: None,
            })
        })
    }

    fn finished_since(&self, after: Option<&str>, limit: usize) -> Result<Vec<(String, Job)>> {
        let start = match after {
            None => "-".to_string(),
            Some(a)
                if a.split_once('-')
                    .is_some_and(|(l, r)| l.parse::<u64>().is_ok() && r.parse::<u64>().is_ok()) =>
            {
                format!("({a}")
            }
            Some(_) => return Err(StoreError::BadCursor),
        };
        self.run(|c| {
            let range: Value = redis::cmd("XRANGE")
                .arg(self.key("finished"))
                .arg(&start)
                .arg("+")
                .arg("COUNT")
                .arg(limit)
                .query(c)?;
            let mut out = Vec::new();
            for (entry, id) in entries(&range) {
                if let Some(job) = self.load(c, &id)? {
                    out.push((entry, job));
                }
            }
            Ok(out)
        })
    }

    fn put_blob(&self, kind: &str, id: &str, bytes: &[u8]) -> Result<()> {
        self.run(|c| {
            redis::cmd("SET")
                .arg(self.key(&format!("blob:{kind}:{id}")))
                .arg(bytes)
                .query::<()>(c)?;
            redis::cmd("ZADD")
                .arg(self.key(&format!("blobs:{kind}")))
                .arg(0)
                .arg(id)
                .query::<i64>(c)?;
            Ok(())
        })
    }

    fn delete_blob(&self, kind: &str, id: &str) -> Result<()> {
        self.run(|c| {
            redis::cmd("ZREM")
                .arg(self.key(&format!("blobs:{kind}")))
                .arg(id)
                .query::<i64>(c)?;
            redis::cmd("DEL")
                .arg(self.key(&format!("blob:{kind}:{id}")))
                .query::<i64>(c)?;
            Ok(())
        })
    }

    fn get_blob(&self, kind: &str, id: &str) -> Result<Option<Vec<u8>>> {
        self.run(|c| {
            redis::cmd("GET")
                .arg(self.key(&format!("blob:{kind}:{id}")))
                .query(c)
        })
    }

    /// The ids of `kind`, in id order (all scores are 0: lexicographic).
    fn blob_ids(&self, kind: &str) -> Result<Vec<String>> {
        self.run(|c| {
            redis::cmd("ZRANGE")
                .arg(self.key(&format!("blobs:{kind}")))
                .arg(0)
                .arg(-1)
                .query(c)
        })
    }
}
