//! HTTP access to a model server, shared by the engine adapters.

use reqwest::{Client, StatusCode};

/// A model server's base URL, the client that polls it, and its API key.
#[derive(Clone)]
pub struct BackendHttp {
    client: Client,
    base: String,
    api_key: Option<String>,
}

impl BackendHttp {
    pub fn new(client: Client, base: String, api_key: Option<String>) -> Self {
        BackendHttp {
            client,
            base,
            api_key,
        }
    }

    /// `GET path`: status and body, or a message naming the path.
    pub async fn get(&self, path: &str) -> Result<(StatusCode, bytes::Bytes), String> {
        let mut req = self.client.get(format!("{}{path}", self.base));
        if let Some(key) = &self.api_key {
            req = req.bearer_auth(key);
        }
        let resp = req.send().await.map_err(|e| format!("GET {path}: {e}"))?;
        let status = resp.status();
        let body = resp.bytes().await.map_err(|e| format!("GET {path}: {e}"))?;
        Ok((status, body))
    }

    /// `GET path`, requiring a 2xx answer.
    pub async fn get_ok(&self, path: &str) -> Result<bytes::Bytes, String> {
        match self.get(path).await? {
            (s, body) if s.is_success() => Ok(body),
            (s, _) => Err(format!("GET {path}: HTTP {s}")),
        }
    }

    /// `POST path` with a JSON body, waiting at most `timeout`: status and
    /// body, or a message naming the path.
    pub async fn post_json(
        &self,
        path: &str,
        body: &serde_json::Value,
        timeout: std::time::Duration,
    ) -> Result<(StatusCode, bytes::Bytes), String> {
        let mut req = (self.client.post(format!("{}{path}", self.base)))
            .json(body)
            .timeout(timeout);
        if let Some(key) = &self.api_key {
            req = req.bearer_auth(key);
        }
        let resp = req.send().await.map_err(|e| format!("POST {path}: {e}"))?;
        let status = resp.status();
        let body = resp
            .bytes()
            .await
            .map_err(|e| format!("POST {path}: {e}"))?;
        Ok((status, body))
    }
}
