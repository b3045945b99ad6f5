"""A stub engine for benches at scale: answers chat completions the way vLLM does (prompt ids as long as the
conversation, sampled ids, logprobs; JSON or SSE) after a set generation time, on one asyncio loop, with answers
built from bytes prepared once: thousands of calls in flight cost it little, so it is not what a bench measures.

    python stub_engine.py PORT GENERATION_S [CAPACITY]

CAPACITY (default: none) is the engine's batch: at most that many answers are generated at once, the others wait
their turn, as a vLLM at its max_num_seqs queues them; so running more rollouts than the engine serves at once does
not make generation faster.
The answer's text is "ok " + the last [[...]] marker of the request: an agent that gets another's answer sees it.
GET /stats: calls answered and the most in flight at once.
"""

from __future__ import annotations

import asyncio
import re
import sys

import orjson

TOKENS = 32
MAX_PROMPT = 400_000
MARKER = re.compile(rb"\[\[([^\]]{1,200})\]\]")
IDS = ",".join(str(i % 50_000 + 1) for i in range(MAX_PROMPT)).encode()
ENDS = [0] + [m.start() for m in re.finditer(b",", IDS)] + [len(IDS)]  # IDS[:ENDS[n]] = the first n ids
SAMPLED = list(range(100, 100 + TOKENS))
LOGPROBS = [{"token": f"token_id:{i}", "logprob": -0.5, "bytes": [120], "top_logprobs": []} for i in SAMPLED]
stats = {"calls": 0, "in_flight": 0, "most_in_flight": 0, "queued_s": 0.0}
batch: asyncio.Semaphore | None = None  # the engine's capacity (main sets it)


def prompt_ids(body: bytes) -> bytes:
    n = min(MAX_PROMPT, max(60, len(body) // 4))  # ~4 bytes of JSON a token
    return b"[" + IDS[:ENDS[n]] + b"]"


def answer_json(text: str, body: bytes) -> bytes:
    head = orjson.dumps({"id": "chatcmpl-stub", "object": "chat.completion", "created": 0, "model": "tiny",
                         "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                                      "logprobs": {"content": LOGPROBS}, "finish_reason": "stop",
                                      "token_ids": SAMPLED}],
                         "usage": {"prompt_tokens": len(body) // 4, "completion_tokens": TOKENS}})
    return head[:-1] + b',"prompt_token_ids":' + prompt_ids(body) + b"}"


def answer_events(text: str, body: bytes) -> list[bytes]:
    head = {"id": "chatcmpl-stub", "object": "chat.completion.chunk", "created": 0, "model": "tiny"}
    first = orjson.dumps({**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                               "logprobs": None, "finish_reason": None}]})
    events = [b"data: " + first[:-1] + b',"prompt_token_ids":' + prompt_ids(body) + b"}\n\n"]
    pieces = [text[k * len(text) // TOKENS:(k + 1) * len(text) // TOKENS] for k in range(TOKENS)]
    for k, piece in enumerate(pieces):
        events.append(b"data: " + orjson.dumps({**head, "choices": [{
            "index": 0, "delta": {"content": piece}, "logprobs": {"content": [LOGPROBS[k]]},
            "finish_reason": "stop" if k == TOKENS - 1 else None, "token_ids": [SAMPLED[k]]}]}) + b"\n\n")
    return events + [b"data: [DONE]\n\n"]


async def respond(writer: asyncio.StreamWriter, path: str, body: bytes, generation_s: float) -> None:
    if path == "/health":
        return send(writer, 200, b"{}")
    if path == "/v1/models":
        return send(writer, 200, b'{"object":"list","data":[{"id":"tiny","object":"model"}]}')
    if path == "/stats":
        return send(writer, 200, orjson.dumps(stats))
    markers = MARKER.findall(body)
    text = "ok " + (markers[-1].decode() if markers else "?")
    stats["in_flight"] += 1
    stats["most_in_flight"] = max(stats["most_in_flight"], stats["in_flight"])
    stream = re.search(rb'"stream"\s*:\s*true', body)
    events = answer_events(text, body) if stream else []
    try:
        if stream:  # as vLLM streams: the first event (with the prompt's ids) at once, the tokens as generated
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
            writer.write(b"%x\r\n%s\r\n" % (len(events[0]), events[0]))
            await writer.drain()
        if batch is None:
            await asyncio.sleep(generation_s)
        else:
            queued = asyncio.get_running_loop().time()
            async with batch:
                stats["queued_s"] += asyncio.get_running_loop().time() - queued
                await asyncio.sleep(generation_s)
    finally:
        stats["in_flight"] -= 1
    stats["calls"] += 1
    if stream:
        for event in events[1:]:
            writer.write(b"%x\r\n%s\r\n" % (len(event), event))
        writer.write(b"0\r\n\r\n")
    else:
        send(writer, 200, answer_json(text, body))


def send(writer: asyncio.StreamWriter, status: int, data: bytes) -> None:
    writer.write(b"HTTP/1.1 %d OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                 % (status, len(data), data))


async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, generation_s: float) -> None:
    try:
        while True:  # keep-alive: one request after another on the connection
            head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
            headers = dict((k.strip().lower(), v.strip()) for k, v in (h.split(":", 1) for h in head[1:] if ":" in h))
            body = await reader.readexactly(int(headers.get("content-length") or 0))
            await respond(writer, head[0].split(" ")[1], body, generation_s)
            await writer.drain()
            if headers.get("connection", "").lower() == "close":
                break
    except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError, IndexError, ValueError):
        pass
    finally:
        writer.close()


async def main(port: int, generation_s: float, capacity: int | None = None) -> None:
    global batch
    batch = asyncio.Semaphore(capacity) if capacity else None
    server = await asyncio.start_server(lambda r, w: serve(r, w, generation_s), "127.0.0.1", port, backlog=4096,
                                        limit=2 ** 24)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3]) if len(sys.argv) > 3 else None))
