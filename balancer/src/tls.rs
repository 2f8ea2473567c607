//! Optional TLS (rustls) on the inference port.
//!
//! Pingora loads the certificate and key when the listener starts and panics
//! on a bad file, so [`TlsFiles::check`] loads them first and turns every problem into
//! one clear start-up error.

use std::path::{Path, PathBuf};

use pingora_core::listeners::tls::TlsSettings;
use pingora_core::tls::{install_default_crypto_provider, load_certs_and_key_files, ServerConfig};

/// The PEM files of the inference port's certificate chain and private key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsFiles {
    pub cert: PathBuf,
    pub key: PathBuf,
}

fn utf8(path: &Path) -> Result<&str, String> {
    path.to_str()
        .ok_or_else(|| format!("TLS file path {} is not UTF-8", path.display()))
}

impl TlsFiles {
    /// Loads both files and builds a server configuration from them, as
    /// Pingora will.
    pub fn check(&self) -> Result<(), String> {
        let (cert, key) = (utf8(&self.cert)?, utf8(&self.key)?);
        for path in [&self.cert, &self.key] {
            std::fs::metadata(path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
        }
        let Some((chain, private_key)) = load_certs_and_key_files(cert, key)
            .map_err(|e| format!("cannot load --tls-cert {cert} / --tls-key {key}: {e}"))?
        else {
            return Err(format!(
                "--tls-cert {cert} must hold at least one PEM certificate and --tls-key {key} \
                 a PEM private key (PKCS#1, PKCS#8 or SEC1)"
            ));
        };
        install_default_crypto_provider();
        ServerConfig::builder()
            .with_no_client_auth()
            .with_single_cert(chain, private_key)
            .map_err(|e| {
                format!("--tls-cert {cert} and --tls-key {key} do not work together: {e}")
            })?;
        Ok(())
    }

    /// The listener's TLS settings (HTTP/1.1; checked by [`TlsFiles::check`]).
    pub fn settings(&self) -> Result<TlsSettings, String> {
        TlsSettings::intermediate(utf8(&self.cert)?, utf8(&self.key)?)
            .map_err(|e| format!("TLS settings: {e}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(name: &str, text: &str) -> PathBuf {
        let path = std::env::temp_dir().join(format!("flowgate-tls-{}-{name}", std::process::id()));
        std::fs::write(&path, text).unwrap();
        path
    }

    #[test]
    fn missing_or_empty_files_are_clear_errors() {
        let missing = TlsFiles {
            cert: "/nonexistent/cert.pem".into(),
            key: "/nonexistent/key.pem".into(),
        };
        let err = missing.check().unwrap_err();
        assert!(err.contains("cannot read /nonexistent/cert.pem"), "{err}");

        let empty = file("empty.pem", "not a certificate\n");
        let files = TlsFiles {
            cert: empty.clone(),
            key: empty.clone(),
        };
        let err = files.check().unwrap_err();
        assert!(err.contains("at least one PEM certificate"), "{err}");
        let _ = std::fs::remove_file(empty);
    }
}
