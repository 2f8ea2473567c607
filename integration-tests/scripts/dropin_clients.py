"""The official `openai` and `anthropic` Python clients (PyPI) against one
server: llama-server directly, or Flowgate in front of it.

    python3 dropin_clients.py BASE_URL MODEL EMBEDDING_BASE_URL EMBEDDING_MODEL

(directly, embeddings come from a second llama-server started with
`--embeddings`; through Flowgate both are behind one base URL.)

Prints one JSON object: for each call, what a user of the client sees
(types, event names, whether text and usage came back), so that the answers
of two servers compare equal when a client cannot tell them apart, and the
`x-flowgate-served-model` header of a chat when there is one. A call that
raises fails the script (exit 1) with the client's error.
"""

import json
import sys

import anthropic
import httpx2
import openai
from openai import OpenAI

PROMPT = [{"role": "user", "content": "Say hi."}]
# Every generation is greedy (temperature 0): the same prompt gives the same
# answer directly and through Flowgate, so what the reports compare (text or
# none, several chunks or few) cannot differ by sampling. (This anthropic
# client takes no `temperature` argument: it goes in the body as is.)
GREEDY = {"temperature": 0}


def fresh_connections(sdk):
    """An HTTP client that opens a connection per request. llama-server
    (cpp-httplib) now and then closes a kept-alive connection just as the
    client reuses it: measured directly, without Flowgate, 1 of 40 runs of
    the anthropic calls below failed with "Server disconnected without
    sending a response". Real users get it retried (the SDKs retry twice by
    default); these clients retry nothing, so that every error Flowgate
    causes shows, and they reuse no connection instead."""
    return sdk.DefaultHttpxClient(limits=httpx2.Limits(max_keepalive_connections=0))


def openai_client(base):
    """The openai client against `base`, retrying nothing, a connection per
    request."""
    return OpenAI(
        base_url=base + "/v1",
        api_key="unused",
        max_retries=0,
        timeout=60,
        http_client=fresh_connections(openai),
    )


def openai_calls(base, model, embedding_base, embedding_model):
    client = openai_client(base)
    out = {}
    raw = client.chat.completions.with_raw_response.create(
        model=model, messages=PROMPT, max_tokens=8, temperature=0
    )
    chat = raw.parse()
    out["served_model"] = raw.headers.get("x-flowgate-served-model")
    out["chat"] = {
        "object": chat.object,
        "text": bool(chat.choices[0].message.content),
        "usage": chat.usage.completion_tokens > 0,
    }
    chunks = list(
        client.chat.completions.create(
            model=model,
            messages=PROMPT,
            max_tokens=8,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    out["chat_stream"] = {
        "object": chunks[0].object,
        "text": any(c.choices and c.choices[0].delta.content for c in chunks),
        "several": len(chunks) > 2,
        "usage_last": chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0,
    }
    response = client.responses.create(
        model=model, input="Say hi.", max_output_tokens=8, temperature=0
    )
    out["responses"] = {
        "object": response.object,
        "status": response.status,
        "text": bool(response.output_text),
        "usage": response.usage is not None and response.usage.total_tokens > 0,
    }
    events, text = [], ""
    for e in client.responses.create(
        model=model, input="Say hi.", max_output_tokens=8, temperature=0, stream=True
    ):
        events.append(e.type)
        if e.type == "response.output_text.delta":
            text += e.delta
    out["responses_stream"] = {"first": events[0], "last": events[-1], "text": bool(text)}
    embedder = openai_client(embedding_base)
    embedding = embedder.embeddings.create(model=embedding_model, input="hello")
    out["embeddings"] = {
        "object": embedding.object,
        "dims": len(embedding.data[0].embedding) > 0,
    }
    return out


def anthropic_calls(base, model):
    client = anthropic.Anthropic(
        base_url=base,
        api_key="unused",
        max_retries=0,
        timeout=60,
        http_client=fresh_connections(anthropic),
    )
    out = {}
    message = client.messages.create(model=model, max_tokens=8, messages=PROMPT, extra_body=GREEDY)
    out["messages"] = {
        "type": message.type,
        "role": message.role,
        "text": any(block.type == "text" and block.text for block in message.content),
    }
    # This llama-server sometimes leaves out `message_start` (directly as
    # through a proxy), so the first event compared is the one after it.
    events = [
        e.type
        for e in client.messages.create(
            model=model, max_tokens=8, messages=PROMPT, extra_body=GREEDY, stream=True
        )
        if e.type != "message_start"
    ]
    out["messages_stream"] = {
        "first": events[0],
        "last": events[-1],
        "deltas": "content_block_delta" in events,
    }
    counted = client.messages.count_tokens(model=model, messages=PROMPT)
    out["count_tokens"] = counted.input_tokens > 0
    return out


def main():
    base, model, embedding_base, embedding_model = sys.argv[1:5]
    report = openai_calls(base, model, embedding_base, embedding_model)
    report.update(anthropic_calls(base, model))
    print(json.dumps(report, sort_keys=True))


if __name__ == "__main__":
    main()
