//! `multipart/form-data` bodies (RFC 7578), held in memory: the Batch
//! API's file uploads and the audio routes' requests (whose `model` field
//! admission reads, and may rename).

/// One part of a `multipart/form-data` body.
#[derive(Debug, PartialEq)]
pub struct Part<'a> {
    pub name: String,
    pub filename: Option<String>,
    pub data: &'a [u8],
}

/// The `name="…"` parameter of a header value.
fn param(header: &str, name: &str) -> Option<String> {
    header.split(';').find_map(|p| {
        let (k, v) = p.trim().split_once('=')?;
        k.trim()
            .eq_ignore_ascii_case(name)
            .then(|| v.trim().trim_matches('"').to_string())
    })
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    if needle.is_empty() || haystack.len() < needle.len() {
        return None;
    }
    haystack.windows(needle.len()).position(|w| w == needle)
}

/// Splits a `multipart/form-data` body (RFC 7578), held in memory.
pub fn parse_multipart<'a>(
    content_type: &str,
    body: &'a [u8],
) -> std::result::Result<Vec<Part<'a>>, String> {
    if !content_type
        .trim_start()
        .to_ascii_lowercase()
        .starts_with("multipart/form-data")
    {
        return Err("expected a multipart/form-data body".into());
    }
    let boundary = param(content_type, "boundary")
        .filter(|b| !b.is_empty() && b.len() <= 200)
        .ok_or("the multipart content type names no boundary")?;
    let delimiter = format!("--{boundary}");
    let mut rest = match find(body, delimiter.as_bytes()) {
        Some(i) => &body[i + delimiter.len()..],
        None => return Err("the multipart body has no boundary line".into()),
    };
    let next = format!("\r\n--{boundary}");
    let mut parts = Vec::new();
    loop {
        if rest.starts_with(b"--") {
            return Ok(parts);
        }
        rest = rest
            .strip_prefix(b"\r\n")
            .ok_or("a multipart boundary must end its line")?;
        let head_end = find(rest, b"\r\n\r\n").ok_or("a multipart part has no header end")?;
        let head =
            std::str::from_utf8(&rest[..head_end]).map_err(|_| "a part header is not UTF-8")?;
        let after_head = &rest[head_end + 4..];
        let end = find(after_head, next.as_bytes()).ok_or("a multipart part is not closed")?;
        let disposition = head
            .split("\r\n")
            .find_map(|l| {
                let (k, v) = l.split_once(':')?;
                k.trim()
                    .eq_ignore_ascii_case("content-disposition")
                    .then_some(v)
            })
            .ok_or("a multipart part has no Content-Disposition")?;
        parts.push(Part {
            name: param(disposition, "name").ok_or("a multipart part has no name")?,
            filename: param(disposition, "filename"),
            data: &after_head[..end],
        });
        rest = &after_head[end + next.len()..];
    }
}

/// `body` with the text field `name` set to `value`: the part's data
/// replaced, or a part added first when there is none. `None` if `body`
/// is not `multipart/form-data` of `content_type`.
pub fn with_field(content_type: &str, body: &[u8], name: &str, value: &str) -> Option<Vec<u8>> {
    let parts = parse_multipart(content_type, body).ok()?;
    let mut out = Vec::with_capacity(body.len() + value.len() + 64);
    match parts
        .iter()
        .find(|p| p.name == name && p.filename.is_none())
    {
        Some(part) => {
            // The part's data is a slice of `body`: splice it out.
            let start = part.data.as_ptr() as usize - body.as_ptr() as usize;
            out.extend_from_slice(&body[..start]);
            out.extend_from_slice(value.as_bytes());
            out.extend_from_slice(&body[start + part.data.len()..]);
        }
        None => {
            let boundary = param(content_type, "boundary")?;
            let first = find(body, format!("--{boundary}").as_bytes())?;
            out.extend_from_slice(&body[..first]);
            out.extend_from_slice(
                format!(
                    "--{boundary}\r\nContent-Disposition: form-data; name=\"{name}\"\r\n\r\n{value}\r\n"
                )
                .as_bytes(),
            );
            out.extend_from_slice(&body[first..]);
        }
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const CT: &str = "multipart/form-data; boundary=XyZ";

    #[test]
    fn multipart_parts_come_out_with_names_and_files() {
        let body = b"--XyZ\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nbatch\r\n\
--XyZ\r\nContent-Disposition: form-data; name=\"file\"; filename=\"in.jsonl\"\r\n\
Content-Type: application/octet-stream\r\n\r\n{\"a\":1}\n{\"b\":2}\n\r\n--XyZ--\r\n";
        let parts = parse_multipart(CT, body).unwrap();
        assert_eq!(parts.len(), 2);
        assert_eq!(parts[0].name, "purpose");
        assert_eq!(parts[0].data, b"batch");
        assert_eq!(parts[1].filename.as_deref(), Some("in.jsonl"));
        assert_eq!(parts[1].data, b"{\"a\":1}\n{\"b\":2}\n");
        assert!(parse_multipart("application/json", body).is_err());
        assert!(
            parse_multipart("multipart/form-data", body).is_err(),
            "no boundary"
        );
        assert!(parse_multipart(CT, b"--XyZ\r\nno end").is_err());
    }

    #[test]
    fn with_field_replaces_or_adds_a_text_field() {
        let body = b"--XyZ\r\nContent-Disposition: form-data; name=\"model\"\r\n\r\nwhisper\r\n\
--XyZ\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a.wav\"\r\n\r\nRIFF\r\n--XyZ--\r\n";
        let out = with_field(CT, body, "model", "whisper-large").unwrap();
        let parts = parse_multipart(CT, &out).unwrap();
        assert_eq!(parts[0].data, b"whisper-large");
        assert_eq!(parts[1].data, b"RIFF");
        let none = b"--XyZ\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a.wav\"\r\n\r\nRIFF\r\n--XyZ--\r\n";
        let out = with_field(CT, none, "model", "m").unwrap();
        let parts = parse_multipart(CT, &out).unwrap();
        assert_eq!(
            (parts[0].name.as_str(), parts[0].data),
            ("model", &b"m"[..])
        );
        assert_eq!(parts[1].data, b"RIFF");
        assert!(with_field("application/json", body, "model", "m").is_none());
    }

    proptest! {
        #[test]
        fn multipart_parsing_never_panics(body in proptest::collection::vec(any::<u8>(), 0..300),
                                          boundary in "[A-Za-z0-9]{0,8}") {
            let _ = parse_multipart(&format!("multipart/form-data; boundary={boundary}"), &body);
        }
    }
}
