//! The OpenAI Batch API on the async queue: `POST /v1/files` (JSONL, purpose
//! `batch`), `POST /v1/batches`, `GET /v1/batches[/{id}]`,
//! `POST /v1/batches/{id}/cancel`, `GET /v1/files/{id}[/content]`.
//!
//! A batch's lines become async requests (one transaction, idempotency key
//! `batch:<batch id>:<custom_id>`), so they are dispatched under the same
//! budget, in the same band, with the same redelivery. The batch's state is
//! derived from its requests whenever it is read; once all are final, its
//! output file (every answer, with its status code) and error file (requests
//! that got none: dead-lettered, expired, cancelled, evicted) are written and
//! the batch is `completed` (or `cancelled`).

use std::sync::Arc;

use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use super::job::{Job, NewJob, StoreError};
use super::{now_ms, AsyncQueue, Caller};

/// Blob kinds: file metadata (JSON), file content, batch records (JSON).
const FILES: &str = "files";
const FILE_DATA: &str = "file_data";
const BATCHES: &str = "batches";

/// The endpoints a batch may target (OpenAI's list, less moderations).
const BATCH_ENDPOINTS: [&str; 4] = [
    "/v1/responses",
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/embeddings",
];

/// An error the API answers with: status, code, message.
#[derive(Debug, PartialEq)]
pub struct ApiError(pub u16, pub &'static str, pub String);

impl From<StoreError> for ApiError {
    fn from(e: StoreError) -> Self {
        match e {
            StoreError::Full(n) => ApiError(
                429,
                "async_queue_full",
                format!("the async queue cannot take this batch: it holds at most {n} requests"),
            ),
            StoreError::TooLarge(n) => ApiError(
                413,
                "request_too_large",
                format!("a request of the batch exceeds {n} bytes"),
            ),
            StoreError::BadCursor => ApiError(400, "bad_cursor", e.to_string()),
            StoreError::Storage(e) => ApiError(500, "queue_error", e),
        }
    }
}

type Result<T> = std::result::Result<T, ApiError>;

/// The tenant of files and batches stored before they recorded one.
fn default_owner() -> String {
    flowgate::flow::DEFAULT_FAIRNESS_ID.to_string()
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct FileMeta {
    pub id: String,
    pub bytes: u64,
    pub created_at: u64,
    pub filename: String,
    pub purpose: String,
    /// The tenant that uploaded it (or whose batch wrote it).
    #[serde(default = "default_owner")]
    pub owner: String,
    /// Unix seconds after which it is deleted.
    #[serde(default)]
    pub expires_at: Option<u64>,
}

impl FileMeta {
    pub fn view(&self) -> Value {
        json!({
            "id": self.id, "object": "file", "bytes": self.bytes,
            "created_at": self.created_at, "filename": self.filename,
            "purpose": self.purpose, "status": "processed",
            "expires_at": self.expires_at,
        })
    }
}

/// Where a batch stands (OpenAI's names; stored as them).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
enum BatchStatus {
    InProgress,
    /// Cancelled while requests were under way: `Cancelled` once they end.
    Cancelling,
    Cancelled,
    Completed,
    /// Refused at validation: no request was queued.
    Failed,
}

impl BatchStatus {
    fn as_str(self) -> &'static str {
        match self {
            BatchStatus::InProgress => "in_progress",
            BatchStatus::Cancelling => "cancelling",
            BatchStatus::Cancelled => "cancelled",
            BatchStatus::Completed => "completed",
            BatchStatus::Failed => "failed",
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
struct BatchRecord {
    id: String,
    /// The tenant that created it.
    #[serde(default = "default_owner")]
    owner: String,
    endpoint: String,
    input_file_id: String,
    completion_window: String,
    metadata: Option<Value>,
    status: BatchStatus,
    created_at: u64,
    in_progress_at: Option<u64>,
    cancelling_at: Option<u64>,
    cancelled_at: Option<u64>,
    completed_at: Option<u64>,
    failed_at: Option<u64>,
    output_file_id: Option<String>,
    error_file_id: Option<String>,
    /// Validation errors (the batch failed before any request was queued).
    errors: Vec<Value>,
    /// (custom_id, async request id), in input order.
    requests: Vec<(String, String)>,
    completed: u64,
    failed: u64,
}

impl BatchRecord {
    fn view(&self) -> Value {
        json!({
            "id": self.id, "object": "batch", "endpoint": self.endpoint,
            "input_file_id": self.input_file_id,
            "completion_window": self.completion_window,
            "status": self.status.as_str(), "created_at": self.created_at,
            "in_progress_at": self.in_progress_at, "cancelling_at": self.cancelling_at,
            "cancelled_at": self.cancelled_at, "completed_at": self.completed_at,
            "failed_at": self.failed_at,
            "expires_at": self.created_at + 24 * 3600,
            "output_file_id": self.output_file_id, "error_file_id": self.error_file_id,
            "errors": if self.errors.is_empty() { Value::Null } else {
                json!({"object": "list", "data": self.errors})
            },
            "request_counts": {
                "total": self.requests.len(), "completed": self.completed, "failed": self.failed,
            },
            "metadata": self.metadata,
        })
    }

    fn is_open(&self) -> bool {
        matches!(
            self.status,
            BatchStatus::InProgress | BatchStatus::Cancelling
        )
    }
}

fn now_s() -> u64 {
    now_ms() / 1000
}

impl AsyncQueue {
    fn new_object_id(&self, prefix: &str) -> Result<String> {
        // Time first: ids sort by creation, also across balancers.
        super::random_id(prefix, Some(now_ms())).map_err(|e| ApiError(500, "queue_error", e))
    }

    /// Stores an uploaded file (purpose `batch`, JSONL) of `caller`'s
    /// tenant, deleted after `expires_after` (else the configured file
    /// retention).
    pub fn create_file(
        &self,
        filename: &str,
        purpose: &str,
        data: &[u8],
        expires_after: Option<u64>,
        caller: &Caller,
    ) -> Result<FileMeta> {
        if purpose != "batch" {
            return Err(ApiError(
                400,
                "invalid_purpose",
                format!("purpose {purpose:?} is not supported: only \"batch\""),
            ));
        }
        let meta = self.new_file(filename, purpose, data, expires_after, &caller.tenant)?;
        self.put_file(&meta, data)?;
        Ok(meta)
    }

    /// A file's record: its id, its owner, when it expires.
    fn new_file(
        &self,
        filename: &str,
        purpose: &str,
        data: &[u8],
        expires_after: Option<u64>,
        owner: &str,
    ) -> Result<FileMeta> {
        let created_at = now_s();
        let keep = expires_after.unwrap_or(self.config.queue.file_retention.as_secs());
        Ok(FileMeta {
            id: self.new_object_id("file-")?,
            bytes: data.len() as u64,
            created_at,
            filename: filename.to_string(),
            purpose: purpose.to_string(),
            owner: owner.to_string(),
            expires_at: Some(created_at.saturating_add(keep)),
        })
    }

    fn put_file(&self, meta: &FileMeta, data: &[u8]) -> Result<()> {
        let bytes = serde_json::to_vec(meta).expect("file meta serializes");
        // Content first: a file is listed only once it is whole.
        self.store.put_blob(FILE_DATA, &meta.id, data)?;
        self.store.put_blob(FILES, &meta.id, &bytes)?;
        Ok(())
    }

    /// The file `id`'s record, if `caller` may see it (another tenant's
    /// file answers exactly as an unknown one).
    pub fn file_meta(&self, id: &str, caller: &Caller) -> Result<FileMeta> {
        let meta = self.store.get_blob(FILES, id)?.ok_or_else(|| no_file(id))?;
        let meta: FileMeta = serde_json::from_slice(&meta)
            .map_err(|e| ApiError(500, "queue_error", e.to_string()))?;
        if !caller.sees(&meta.owner) {
            return Err(no_file(id));
        }
        Ok(meta)
    }

    /// The file `id`'s content, if `caller` may see it.
    pub fn file_content(&self, id: &str, caller: &Caller) -> Result<Vec<u8>> {
        self.file_meta(id, caller)?;
        Ok(self.store.get_blob(FILE_DATA, id)?.unwrap_or_default())
    }

    /// `caller`'s files, newest first (OpenAI's list).
    pub fn list_files(&self, limit: usize, caller: &Caller) -> Result<Value> {
        // Newest first; ids sort by creation time.
        let ids = self.store.blob_ids(FILES)?;
        list_page(ids.iter().rev(), limit, |id| {
            self.file_meta(id, caller).map(|m| m.view())
        })
    }

    /// Deletes the file `id` if `caller` may see it (OpenAI's answer).
    pub fn delete_file(&self, id: &str, caller: &Caller) -> Result<Value> {
        self.file_meta(id, caller)?;
        self.remove_file(id)?;
        Ok(json!({"id": id, "object": "file", "deleted": true}))
    }

    /// Record first: a file is gone for readers before its content is.
    fn remove_file(&self, id: &str) -> Result<()> {
        self.store.delete_blob(FILES, id)?;
        self.store.delete_blob(FILE_DATA, id)?;
        Ok(())
    }

    /// Deletes files past their `expires_at`, and finished batches whose
    /// retention (the file retention, from their creation) ended. Returns
    /// how many of each went.
    pub fn purge_expired_files(&self, now_s: u64) -> Result<(usize, usize)> {
        let mut files = 0;
        for id in self.store.blob_ids(FILES)? {
            let Some(raw) = self.store.get_blob(FILES, &id)? else {
                continue;
            };
            let expired = serde_json::from_slice::<FileMeta>(&raw)
                .map(|m| m.expires_at.is_some_and(|t| t <= now_s))
                .unwrap_or(false);
            if expired {
                self.remove_file(&id)?;
                files += 1;
            }
        }
        let keep = self.config.queue.file_retention.as_secs();
        let mut batches = 0;
        for id in self.store.blob_ids(BATCHES)? {
            let Ok(record) = self.load_batch(&id) else {
                continue;
            };
            if !record.is_open() && record.created_at.saturating_add(keep) <= now_s {
                self.store.delete_blob(BATCHES, &id)?;
                batches += 1;
            }
        }
        Ok((files, batches))
    }

    /// Validates the input file and queues its requests.
    pub fn create_batch(
        self: &Arc<Self>,
        input_file_id: &str,
        endpoint: &str,
        completion_window: &str,
        metadata: Option<Value>,
        caller: &Caller,
        priority: i32,
    ) -> Result<Value> {
        if !BATCH_ENDPOINTS.contains(&endpoint) {
            return Err(ApiError(
                400,
                "invalid_endpoint",
                format!("endpoint must be one of {BATCH_ENDPOINTS:?}"),
            ));
        }
        if completion_window != "24h" {
            return Err(ApiError(
                400,
                "invalid_completion_window",
                "completion_window must be \"24h\"".into(),
            ));
        }
        let input = self.file_content(input_file_id, caller)?;
        let now = now_s();
        let mut record = BatchRecord {
            id: self.new_object_id("batch_")?,
            owner: caller.tenant.clone(),
            endpoint: endpoint.to_string(),
            input_file_id: input_file_id.to_string(),
            completion_window: completion_window.to_string(),
            metadata,
            status: BatchStatus::InProgress,
            created_at: now,
            in_progress_at: Some(now),
            cancelling_at: None,
            cancelled_at: None,
            completed_at: None,
            failed_at: None,
            output_file_id: None,
            error_file_id: None,
            errors: Vec::new(),
            requests: Vec::new(),
            completed: 0,
            failed: 0,
        };
        let jobs = read_input(
            &mut record,
            &String::from_utf8_lossy(&input),
            caller,
            priority,
        );
        if record.requests.is_empty() && record.errors.is_empty() {
            record
                .errors
                .push(json!({"code": "empty_file", "message": "the input file holds no request"}));
        }
        if !record.errors.is_empty() {
            record.status = BatchStatus::Failed;
            record.failed_at = Some(now);
            record.in_progress_at = None;
            record.requests.clear();
        } else {
            self.store.submit_many(jobs, now_ms())?;
            self.submitted.notify_one();
        }
        self.put_batch(&record)?;
        Ok(record.view())
    }

    fn put_batch(&self, record: &BatchRecord) -> Result<()> {
        let bytes = serde_json::to_vec(record).expect("batch serializes");
        self.store.put_blob(BATCHES, &record.id, &bytes)?;
        Ok(())
    }

    fn load_batch(&self, id: &str) -> Result<BatchRecord> {
        let record = self
            .store
            .get_blob(BATCHES, id)?
            .ok_or_else(|| no_batch(id))?;
        serde_json::from_slice(&record).map_err(|e| ApiError(500, "queue_error", e.to_string()))
    }

    /// The batch `id`, if `caller` may see it (another tenant's batch
    /// answers exactly as an unknown one).
    fn visible_batch(&self, id: &str, caller: &Caller) -> Result<BatchRecord> {
        let record = self.load_batch(id)?;
        if !caller.sees(&record.owner) {
            return Err(no_batch(id));
        }
        Ok(record)
    }

    /// The batch, brought up to date with its requests (finalized when all
    /// are done).
    pub fn batch(&self, id: &str, caller: &Caller) -> Result<Value> {
        let mut record = self.visible_batch(id, caller)?;
        if record.is_open() {
            self.refresh(&mut record)?;
        }
        Ok(record.view())
    }

    fn refresh(&self, record: &mut BatchRecord) -> Result<()> {
        let ids: Vec<String> = record.requests.iter().map(|(_, id)| id.clone()).collect();
        let jobs = self.store.get_many(&ids)?;
        let answered = |j: &Job| {
            j.answer
                .as_ref()
                .is_some_and(|a| (200..300).contains(&a.status))
        };
        record.completed = jobs
            .iter()
            .flatten()
            .filter(|j| j.status.is_final() && answered(j))
            .count() as u64;
        record.failed = jobs
            .iter()
            .flatten()
            .filter(|j| j.status.is_final() && !answered(j))
            .count() as u64;
        if !jobs
            .iter()
            .all(|j| j.as_ref().is_none_or(|j| j.status.is_final()))
        {
            return Ok(());
        }
        let mut output = String::new();
        let mut errors = String::new();
        for ((custom_id, job_id), job) in record.requests.iter().zip(&jobs) {
            let line = match job.as_ref().and_then(|j| j.answer.as_ref().map(|a| (j, a))) {
                Some((_, answer)) => {
                    let body = serde_json::from_str::<Value>(&answer.body)
                        .unwrap_or_else(|_| Value::String(answer.body.clone()));
                    json!({"id": format!("batch_req_{job_id}"), "custom_id": custom_id,
                           "response": {"status_code": answer.status, "request_id": job_id, "body": body},
                           "error": null})
                }
                None => {
                    let (code, message) = match job {
                        Some(j) => (
                            serde_json::to_value(j.status).unwrap_or_default(),
                            j.last_error
                                .clone()
                                .unwrap_or_else(|| format!("{:?}", j.status)),
                        ),
                        None => (json!("purged"), "the request is no longer kept".to_string()),
                    };
                    let line = json!({"id": format!("batch_req_{job_id}"), "custom_id": custom_id,
                                      "response": null, "error": {"code": code, "message": message}});
                    errors.push_str(&line.to_string());
                    errors.push('\n');
                    continue;
                }
            };
            output.push_str(&line.to_string());
            output.push('\n');
        }
        let now = now_s();
        for (text, name, slot) in [
            (output, "output", &mut record.output_file_id),
            (errors, "errors", &mut record.error_file_id),
        ] {
            if text.is_empty() {
                continue;
            }
            let filename = format!("{}_{name}.jsonl", record.id);
            let meta = self.new_file(
                &filename,
                "batch_output",
                text.as_bytes(),
                None,
                &record.owner,
            )?;
            self.put_file(&meta, text.as_bytes())?;
            *slot = Some(meta.id);
        }
        if record.status == BatchStatus::Cancelling {
            record.status = BatchStatus::Cancelled;
            record.cancelled_at = Some(now);
        } else {
            record.status = BatchStatus::Completed;
            record.completed_at = Some(now);
        }
        self.put_batch(record)
    }

    /// `caller`'s batches, newest first, after the batch `after`.
    pub fn list_batches(
        &self,
        limit: usize,
        after: Option<&str>,
        caller: &Caller,
    ) -> Result<Value> {
        let ids = self.store.blob_ids(BATCHES)?;
        // Newest first; ids sort by creation time.
        let mut ids: Vec<String> = ids.into_iter().rev().collect();
        if let Some(after) = after {
            if let Some(i) = ids.iter().position(|id| id == after) {
                ids.drain(..=i);
            }
        }
        list_page(ids.iter(), limit, |id| self.batch(id, caller))
    }

    /// Cancels a batch's requests not yet finished; it is `cancelled` once
    /// those under way are done.
    pub fn cancel_batch(&self, id: &str, caller: &Caller) -> Result<Value> {
        let mut record = self.visible_batch(id, caller)?;
        if record.status != BatchStatus::InProgress {
            return Err(ApiError(
                409,
                "batch_not_in_progress",
                format!(
                    "batch {id} is {}: only a batch in progress can be cancelled",
                    record.status.as_str()
                ),
            ));
        }
        let now = now_ms();
        for (_, job) in &record.requests {
            self.store.cancel(job, now)?;
        }
        self.changed.notify_waiters();
        record.status = BatchStatus::Cancelling;
        record.cancelling_at = Some(now / 1000);
        self.put_batch(&record)?;
        self.refresh(&mut record)?;
        Ok(record.view())
    }
}

/// An OpenAI list of the first `limit` objects `view` shows among `ids`
/// (in order), skipping those it answers 404 for: another tenant's, or
/// deleted since the ids were read.
fn list_page<'a>(
    ids: impl Iterator<Item = &'a String>,
    limit: usize,
    view: impl Fn(&str) -> Result<Value>,
) -> Result<Value> {
    let mut data = Vec::new();
    let mut has_more = false;
    for id in ids {
        let object = match view(id) {
            Ok(object) => object,
            Err(ApiError(404, ..)) => continue,
            Err(e) => return Err(e),
        };
        if data.len() == limit {
            has_more = true;
            break;
        }
        data.push(object);
    }
    Ok(json!({
        "object": "list",
        "first_id": data.first().map(|o| o["id"].clone()),
        "last_id": data.last().map(|o| o["id"].clone()),
        "has_more": has_more,
        "data": data,
    }))
}

fn no_file(id: &str) -> ApiError {
    ApiError(404, "file_not_found", format!("no file {id}"))
}

fn no_batch(id: &str) -> ApiError {
    ApiError(404, "batch_not_found", format!("no batch {id}"))
}

/// The input file's requests as jobs for `record`, one per line; every
/// line that is not a request for the batch's endpoint (not JSON, no or a
/// repeated `custom_id`, another method or url, no body object) is
/// recorded in `record.errors` with its line number instead.
fn read_input(
    record: &mut BatchRecord,
    text: &str,
    caller: &Caller,
    priority: i32,
) -> Vec<(NewJob, String)> {
    let mut jobs = Vec::new();
    let mut seen = std::collections::HashSet::new();
    for (i, line) in text
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
    {
        let n = i + 1;
        let mut fail = |code: &str, message: String| {
            record
                .errors
                .push(json!({"code": code, "message": message, "line": n}));
        };
        let Ok(v) = serde_json::from_str::<Value>(line) else {
            fail("invalid_json_line", format!("line {n} is not JSON"));
            continue;
        };
        let custom_id = v["custom_id"].as_str().unwrap_or_default().to_string();
        if custom_id.is_empty() {
            fail("missing_custom_id", format!("line {n} has no custom_id"));
            continue;
        }
        if !seen.insert(custom_id.clone()) {
            fail(
                "duplicate_custom_id",
                format!("custom_id {custom_id:?} appears twice"),
            );
            continue;
        }
        if v["method"] != "POST" || v["url"] != record.endpoint.as_str() {
            fail(
                "invalid_request",
                format!("line {n}: method must be POST and url {}", record.endpoint),
            );
            continue;
        }
        if !v["body"].is_object() {
            fail(
                "invalid_request",
                format!("line {n}: body must be an object"),
            );
            continue;
        }
        let job_id = format!("areq_{}_{}", record.id, record.requests.len());
        jobs.push((
            NewJob {
                path: record.endpoint.clone(),
                body: v["body"].to_string(),
                fairness_id: caller.tenant.clone(),
                priority,
                idempotency_key: Some(format!("batch:{}:{custom_id}", record.id)),
                deadline_ms: None,
                // A line's own body names its session, read on delivery.
                session: None,
            },
            job_id.clone(),
        ));
        record.requests.push((custom_id, job_id));
    }
    jobs
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Records already stored keep their meaning: each status is stored,
    /// and shown, by OpenAI's name.
    #[test]
    fn statuses_are_stored_and_shown_by_their_openai_names() {
        use BatchStatus::*;
        for s in [InProgress, Cancelling, Cancelled, Completed, Failed] {
            let stored = serde_json::to_value(s).unwrap();
            assert_eq!(stored, s.as_str());
            assert_eq!(serde_json::from_value::<BatchStatus>(stored).unwrap(), s);
        }
        assert!(serde_json::from_str::<BatchStatus>("\"paused\"").is_err());
    }
}
