//! A real redis-server for the tests that share state through Redis.

use std::process::Command;
use std::time::Duration;

use super::free_port;

/// A real redis-server (Debian's `redis-server` package, installed by
/// `scripts/test`) on a port of the test's own, stopped when dropped.
pub struct Redis {
    child: std::process::Child,
    pub url: String,
}

impl Redis {
    /// A private redis-server on a port of its own. Another test's server
    /// may take the port picked for it between the pick and the bind: then
    /// this one exits, and it tries again on another port; it counts as up
    /// only once the server on the port says it is this process.
    pub async fn start() -> Redis {
        for _ in 0..5 {
            let port = free_port();
            let mut child = std::process::Command::new("redis-server")
                .args([
                    "--port",
                    &port.to_string(),
                    "--bind",
                    "127.0.0.1",
                    "--save",
                    "",
                ])
                .args(["--appendonly", "no", "--protected-mode", "yes"])
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::null())
                .spawn()
                .expect("redis-server (Debian's redis-server package; scripts/test installs it)");
            let deadline = std::time::Instant::now() + Duration::from_secs(10);
            while std::time::Instant::now() < deadline {
                if child.try_wait().ok().flatten().is_some() {
                    break;
                }
                if is_ours(port, child.id()).await {
                    return Redis {
                        child,
                        url: format!("redis://127.0.0.1:{port}/0"),
                    };
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            let _ = child.kill();
            let _ = child.wait();
        }
        panic!("redis-server did not start on any of 5 ports");
    }
}

impl Redis {
    /// Sends the redis-server a signal (`STOP`: it hangs, `CONT`).
    pub fn signal(&self, sig: &str) {
        let ok = Command::new("kill")
            .args([format!("-{sig}"), self.child.id().to_string()])
            .status()
            .is_ok_and(|s| s.success());
        assert!(ok, "kill -{sig} redis-server");
    }
}

/// Whether the Redis answering on `port` is the process `pid` (its
/// `INFO server` names its process id).
async fn is_ours(port: u16, pid: u32) -> bool {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let Ok(mut s) = tokio::net::TcpStream::connect(("127.0.0.1", port)).await else {
        return false;
    };
    if s.write_all(b"INFO server\r\n").await.is_err() {
        return false;
    }
    let want = format!("process_id:{pid}\r\n");
    let mut seen = Vec::new();
    let mut buf = [0u8; 4096];
    let read = tokio::time::timeout(Duration::from_secs(1), async {
        while let Ok(n) = s.read(&mut buf).await {
            if n == 0 {
                break;
            }
            seen.extend_from_slice(&buf[..n]);
            if String::from_utf8_lossy(&seen).contains(&want) {
                return true;
            }
        }
        false
    })
    .await;
    read.unwrap_or(false)
}

impl Drop for Redis {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Redis {
    /// The values of the session bindings the balancers shared
    /// (`flowgate:session:*`): endpoint addresses.
    pub fn session_bindings(&self) -> Vec<String> {
        let cli = |args: &[&str]| -> String {
            let out = Command::new("redis-cli")
                .args(["-u", &self.url])
                .args(args)
                .output()
                .expect("redis-cli (Debian's redis-tools, with redis-server)");
            String::from_utf8_lossy(&out.stdout).into_owned()
        };
        cli(&["--scan", "--pattern", "flowgate:session:*"])
            .lines()
            .map(|key| cli(&["GET", key.trim()]).trim().to_string())
            .collect()
    }
}
