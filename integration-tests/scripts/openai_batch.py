"""The OpenAI Batch API example, run with the official `openai` client against
a Flowgate balancer. Usage: openai_batch.py BASE_URL MODEL

Exits non-zero (with the reason) if anything differs from what the client
expects of the real API.
"""

import json
import os
import sys
import tempfile
import time

import openai
from openai import OpenAI

base_url, model = sys.argv[1], sys.argv[2]
client = OpenAI(base_url=base_url, api_key="not-needed")


def wait_done(batch_id, within=60.0):
    deadline = time.monotonic() + within
    while True:
        batch = client.batches.retrieve(batch_id)
        if batch.status in ("completed", "failed", "cancelled", "expired"):
            return batch
        if time.monotonic() > deadline:
            sys.exit(f"batch {batch_id} still {batch.status} after {within} s")
        time.sleep(0.1)


# 1. The input file: one chat completion per line.
lines = [
    {
        "custom_id": f"request-{i}",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {
            "model": model,
            "messages": [{"role": "user", "content": f"Say hello number {i}"}],
            "max_tokens": 8,
        },
    }
    for i in range(5)
]
with tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False) as f:
    for line in lines:
        f.write(json.dumps(line) + "\n")
    path = f.name

# 2. Upload it, 3. create the batch, 4. wait, 5. read the output file.
batch_input_file = client.files.create(file=open(path, "rb"), purpose="batch")
os.unlink(path)
assert batch_input_file.purpose == "batch", batch_input_file
assert batch_input_file.bytes > 0, batch_input_file

batch = client.batches.create(
    input_file_id=batch_input_file.id,
    endpoint="/v1/chat/completions",
    completion_window="24h",
    metadata={"description": "nightly eval job"},
)
assert batch.status in ("validating", "in_progress"), batch
assert batch.metadata == {"description": "nightly eval job"}, batch

batch = wait_done(batch.id)
assert batch.status == "completed", batch
assert batch.request_counts.total == 5, batch.request_counts
assert batch.request_counts.completed == 5, batch.request_counts
assert batch.output_file_id, batch

content = client.files.content(batch.output_file_id).text
results = [json.loads(l) for l in content.splitlines() if l.strip()]
assert sorted(r["custom_id"] for r in results) == [f"request-{i}" for i in range(5)], results
for r in results:
    assert r["error"] is None, r
    assert r["response"]["status_code"] == 200, r
    assert r["response"]["body"]["choices"][0]["message"]["content"], r

listed = client.batches.list(limit=10)
assert any(b.id == batch.id for b in listed.data), listed

# A finished batch cannot be cancelled.
try:
    client.batches.cancel(batch.id)
    sys.exit("cancelling a completed batch succeeded")
except openai.APIStatusError as e:
    assert e.status_code == 409, e

# A file with a bad line: the batch fails validation, nothing is queued.
bad = client.files.create(
    file=("bad.jsonl", b'{"custom_id": "x", "method": "GET", "url": "/v1/chat/completions", "body": {}}\n'),
    purpose="batch",
)
failed = client.batches.create(
    input_file_id=bad.id, endpoint="/v1/chat/completions", completion_window="24h"
)
assert failed.status == "failed", failed
assert failed.errors and failed.errors.data[0].line == 1, failed.errors

# An unknown batch is a 404 the client raises as NotFoundError.
try:
    client.batches.retrieve("batch_nope")
    sys.exit("an unknown batch was found")
except openai.NotFoundError:
    pass

print(json.dumps({"batch": batch.id, "results": len(results)}))
