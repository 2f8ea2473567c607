#!/usr/bin/env python3
"""Sends a fixed number of requests of one kind to a proxy, for the
instruction budget (scripts/bench/proxy-profile --budget), and checks every
answer: a request that failed would make the count per request meaningless.

Usage: budget-load.py URL KIND REQUESTS CONNECTIONS [API_KEY]

KIND is one of
  small   the small chat (the same body as scripts/bench/post-chat.lua)
  stream  the same chat, streamed ("stream": true), read to the end
  queued  the small chat for model `queued-model` (a one-slot server, so
          every request but one waits in the balancer's queue)
  key     the small chat with `Authorization: Bearer API_KEY`

Each connection is kept alive and sends its share in turn. Prints the number
of requests answered 200 on stdout; exits 1 on any other answer.
"""

import http.client
import sys
import threading
import urllib.parse

BODIES = {
    "small": b'{"model":"sim-model","messages":[{"role":"user","content":"hi"}]}',
    "stream": b'{"model":"sim-model","stream":true,"messages":[{"role":"user","content":"hi"}]}',
    "queued": b'{"model":"queued-model","messages":[{"role":"user","content":"hi"}]}',
    "key": b'{"model":"sim-model","messages":[{"role":"user","content":"hi"}]}',
}


def main():
    url, kind, total, conns = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    key = sys.argv[5] if len(sys.argv) > 5 else None
    target = urllib.parse.urlsplit(url)
    headers = {"content-type": "application/json"}
    if kind == "key":
        headers["authorization"] = f"Bearer {key}"
    body = BODIES[kind]
    answered, failures, lock = [0], [], threading.Lock()

    def client(n):
        conn = http.client.HTTPConnection(target.hostname, target.port, timeout=120)
        try:
            for _ in range(n):
                conn.request("POST", target.path, body=body, headers=headers)
                resp = conn.getresponse()
                data = resp.read()
                if resp.status != 200 or (kind == "stream" and b"[DONE]" not in data):
                    with lock:
                        failures.append(f"{resp.status} {data[:200]!r}")
                    return
                with lock:
                    answered[0] += 1
        except Exception as e:  # a refused or reset connection is a failure too
            with lock:
                failures.append(repr(e))
        finally:
            conn.close()

    shares = [total // conns + (1 if i < total % conns else 0) for i in range(conns)]
    threads = [threading.Thread(target=client, args=(n,)) for n in shares]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if failures:
        print(f"budget-load: {kind}: {len(failures)} failed, first: {failures[0]}", file=sys.stderr)
        sys.exit(1)
    print(answered[0])


if __name__ == "__main__":
    main()
