"""A stub engine that tokenizes as a chat template does, for long rollouts through the proxy.

vLLM renders the whole conversation at every call, so a turn's prompt is the last turn's prompt and completion
plus what the agent added: the prefix a capture stores once. A stub that answers with prompt ids as long as the
request (bench/stub_engine.py) shares no such prefix. This one renders for real, with a template of its own:

    render(messages) = for each message: [ROLE] + ids(content) + [END]; then [ASSISTANT] (the generation prompt)
    ids(text)        = its UTF-8 bytes, 4 at a time, as little-endian numbers mod VOCAB (+ FIRST_ID)
    completion       = ids(reply) + [END], reply = "turn N of <the first user message's [[marker]]>"

so an agent that sends the reply back gets a prompt that extends the last one exactly. Each session (its marker)
and turn gets its own reply and logprobs: a mix-up between sessions shows in what the proxy captured. numpy and
orjson do the work: 120k-token prompts are answered in milliseconds, far below what the proxy spends.

    python template_engine.py PORT
"""

from __future__ import annotations

import asyncio
import re
import sys
import zlib

import numpy as np
import orjson

VOCAB, FIRST_ID = 150_000, 16
ROLES = {"system": 1, "user": 2, "assistant": 3, "tool": 4}
END, ASSISTANT = 5, ROLES["assistant"]
MARKER = re.compile(r"\[\[([^\]]{1,200})\]\]")


def ids(text: str) -> np.ndarray:
    data = text.encode()
    data += b"\0" * (-len(data) % 4)
    return np.frombuffer(data, dtype="<u4").astype(np.int64) % VOCAB + FIRST_ID


def render(messages: list[dict]) -> np.ndarray:
    pieces = []
    for message in messages:
        pieces += [np.array([ROLES.get(message.get("role"), 2)]), ids(message.get("content") or ""), np.array([END])]
    pieces.append(np.array([ASSISTANT]))
    return np.concatenate(pieces)


def logprobs(marker: str, turn: int, n: int) -> list[float]:
    """Each session's and turn's own: -(1 + (seed + 7k) mod 997) / 1000."""
    seed = zlib.crc32(f"{marker}/{turn}".encode())
    return [-(1 + (seed + 7 * k) % 997) / 1000 for k in range(n)]


def answer(request: dict) -> bytes:
    messages = request["messages"]
    marker = next((m.group(1) for msg in messages if msg.get("role") == "user"
                   for m in [MARKER.search(msg.get("content") or "")] if m), "none")
    turn = sum(1 for m in messages if m.get("role") == "assistant")
    reply = f"turn {turn} of [[{marker}]]"
    sampled = [*ids(reply).tolist(), END]
    lps = logprobs(marker, turn, len(sampled))
    prompt = render(messages)
    return orjson.dumps({
        "id": f"chatcmpl-{marker}-{turn}", "object": "chat.completion", "created": 0, "model": request.get("model"),
        "prompt_token_ids": prompt,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": reply},
                     "logprobs": {"content": [{"token": f"token_id:{i}", "logprob": lp, "bytes": [],
                                               "top_logprobs": []} for i, lp in zip(sampled, lps)]},
                     "finish_reason": "stop", "token_ids": sampled}],
        "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(sampled),
                  "total_tokens": len(prompt) + len(sampled)}}, option=orjson.OPT_SERIALIZE_NUMPY)


MODELS = orjson.dumps({"object": "list", "data": [{"id": "tiny", "object": "model"}]})


async def connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            line, _, rest = head.partition(b"\r\n")
            length = next((int(h.split(b":", 1)[1]) for h in rest.split(b"\r\n")
                           if h.lower().startswith(b"content-length:")), 0)
            body = await reader.readexactly(length) if length else b""
            if line.startswith(b"POST"):
                status, out = b"200 OK", answer(orjson.loads(body))
            elif b"/v1/models" in line:
                status, out = b"200 OK", MODELS
            else:
                status, out = b"200 OK", b"{}"
            writer.write(b"HTTP/1.1 %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                         % (status, len(out), out))
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError):
        pass
    finally:
        writer.close()


async def main(port: int) -> None:
    server = await asyncio.start_server(connection, "127.0.0.1", port, backlog=4096, limit=1 << 24)
    async with server:
        await server.serve_forever()


def first_messages(marker: str) -> list[dict]:
    return [{"role": "system", "content": "You are a coding agent. Use the tools."},
            {"role": "user", "content": f"Fix the failing test. [[{marker}]]"}]


def tool_output(marker: str, turn: int, nbytes: int) -> dict:
    """What an agent adds after a reply: ~nbytes / 4 tokens of its own (hex of a seeded stream, unique to the
    session and turn, so unique tokens are counted honestly)."""
    text = np.random.default_rng(zlib.crc32(f"{marker}/{turn}".encode())).bytes(nbytes // 2).hex()
    return {"role": "tool", "tool_call_id": f"call-{turn}", "content": text}


TOOLS = [{"type": "function", "function": {
    "name": "bash", "description": "run a command",
    "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}}}}]


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1])))
