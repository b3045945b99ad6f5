"""The engines behind the proxy: each session pinned to one, new sessions to the least loaded, a lost one fenced.

    ready     takes new sessions; its weights are the proxy's current policy version
    lost      stopped answering (a failed health check, or a call that could not reach it): its sessions'
              calls get a clean stop ("engine lost"), nothing is moved to another engine mid-rollout
    behind    answers again but may serve older weights than the version new calls are stamped with: no new
              sessions until it is seen serving the current policy (the trainer's sync puts it back)

Why pinned: a multi-turn agent resends its whole history every call; on the engine that served the previous call
that history is in the prefix cache, on any other it is recomputed from scratch. The session key is the
affinity key, so a rollout's calls never change engine unless its engine is gone (and then the rollout ends).

The addon (addon.py) has the pool check an engine (every HEALTH_EVERY_S, and after a call failed on it) and
tells it how each call ended.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import asdict, dataclass

import httpx

from harness_trainer._exceptions import NoEngine

ENGINE_LOST = "engine lost"  # the prefix of a session stop that makes its rollout unscorable (rollouts/session.py)
ENGINE_FAILED = "its last model call failed at the engine"  # ends a rollout unscorable too: the agent stopped on
# an answer the engine never gave (a refused connection, a 5xx after the retries, a stream broken off)


@dataclass
class Engine:
    url: str
    state: str = "ready"  # ready | lost | behind
    in_flight: int = 0  # calls sent and not yet answered
    sessions: int = 0  # sessions pinned here, ever
    calls: int = 0  # calls answered
    prompt_tokens: int = 0
    completion_tokens: int = 0
    why: str = ""  # why it is lost or behind
    # Since the proxy started: seconds with at least one call in flight, and calls in flight integrated over time
    # (call-seconds). Their differences over a training step are the rollout side's idle (training/timing.py).
    busy_s: float = 0.0
    call_s: float = 0.0
    changed: float = 0.0  # when in_flight last changed (or was counted), on the pool's clock

    def count_time(self, now: float) -> None:
        if self.in_flight > 0:
            self.busy_s += now - self.changed
            self.call_s += (now - self.changed) * self.in_flight
        self.changed = now

    def summary(self) -> dict:
        return {k: v for k, v in asdict(self).items() if k != "changed"}


class EnginePool:
    def __init__(self, urls: list[str], clock=time.monotonic):
        if not urls:
            raise ValueError("the proxy needs at least one upstream engine")
        self.clock = clock
        self.engines = {url.rstrip("/"): Engine(url.rstrip("/"), changed=clock()) for url in urls}

    @property
    def first(self) -> str:
        return next(iter(self.engines))

    def get(self, url: str) -> Engine | None:
        return self.engines.get(url.rstrip("/"))

    def pick(self) -> str:
        """The ready engine with the fewest calls in flight (then fewest sessions, then order given)."""
        ready = [e for e in self.engines.values() if e.state == "ready"]
        if not ready:
            raise NoEngine("no engine can take a new session: " + "; ".join(
                f"{e.url} {e.state} ({e.why})" for e in self.engines.values()))
        chosen = min(ready, key=lambda e: (e.in_flight, e.sessions))
        chosen.sessions += 1
        return chosen.url

    def is_lost(self, url: str) -> bool:
        engine = self.get(url)
        return engine is not None and engine.state == "lost"

    def lost(self, url: str, why: str) -> bool:
        """Mark it lost; True if it was not already."""
        engine = self.get(url)
        if engine is None or engine.state == "lost":
            return False
        engine.state, engine.why = "lost", why
        return True

    def answered_health(self, url: str, serves_policy: bool) -> None:
        """A health check answered: a lost engine is back, ready only if it serves the current policy."""
        engine = self.get(url)
        if engine is None:
            return
        if engine.state != "ready":
            engine.state, engine.why = ("ready", "") if serves_policy else (
                "behind", "answers again, waits for the trainer to sync the current policy into it")

    def call_started(self, url: str) -> None:
        if engine := self.get(url):
            engine.count_time(self.clock())
            engine.in_flight += 1

    def call_ended(self, url: str, prompt_tokens: int = 0, completion_tokens: int = 0, answered: bool = True) -> None:
        if engine := self.get(url):
            engine.count_time(self.clock())
            engine.in_flight -= 1
            if answered:
                engine.calls += 1
                engine.prompt_tokens += prompt_tokens
                engine.completion_tokens += completion_tokens

    def summary(self) -> list[dict]:
        now = self.clock()
        for engine in self.engines.values():
            engine.count_time(now)
        return [e.summary() for e in self.engines.values()]

    async def check(self, http: httpx.AsyncClient, url: str, version: int, model: str | None) -> bool:
        """Ask the engine's /health: a silent one is lost; one that answers again is ready only once it serves
        `version` (`model`: its adapter). True: it answered (or it is not one of the pool's)."""
        engine = self.get(url)
        if engine is None:
            return True
        try:
            (await http.get(f"{url}/health", timeout=3.0)).raise_for_status()
        except httpx.HTTPError as exc:
            self.lost(url, f"{url} stopped answering ({type(exc).__name__})")
            return False
        if engine.state != "ready":
            self.answered_health(url, await serves_policy(http, url, version, model))
        return True

    async def metrics(self, http: httpx.AsyncClient) -> list[dict]:
        """Each engine's counts with its prefix-cache hits from its own /metrics."""
        found = await asyncio.gather(*(prefix_cache(http, url) for url in self.engines))
        return [engine | cache for engine, cache in zip(self.summary(), found)]


async def serves_policy(http: httpx.AsyncClient, url: str, version: int, model: str | None) -> bool:
    """Whether the engine serves the weights new calls are stamped with: the adapter `model` by name (LoRA), or
    the weight version a reload sync stamped (an engine never synced serves the launch weights: version 0)."""
    try:
        if model:
            served = (await http.get(f"{url}/v1/models", timeout=5.0)).json()["data"]
            return any(m["id"] == model for m in served)
        answer = await http.get(f"{url}/weight_info", timeout=5.0)
        found = answer.json().get("weight_version") if answer.status_code == 200 else None
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        return False
    return str(found) == str(version) or (version == 0 and found in (None, "", "0", "default"))


async def prefix_cache(http: httpx.AsyncClient, url: str) -> dict:
    """The engine's prefix-cache counters from its Prometheus /metrics: tokens found in the cache over tokens
    looked up, since it started (None where it does not say)."""
    try:
        text = (await http.get(f"{url}/metrics", timeout=5.0)).text
    except httpx.HTTPError:
        text = ""
    hits = prometheus_total(text, "vllm:prefix_cache_hits")
    queries = prometheus_total(text, "vllm:prefix_cache_queries")
    return {"prefix_cache_hits": hits, "prefix_cache_queries": queries,
            "prefix_cache_hit_rate": hits / queries if hits is not None and queries else None}


def prometheus_total(text: str, name: str) -> float | None:
    """A Prometheus counter summed over its labels (`name_total{...} v` or `name{...} v`)."""
    total, seen = 0.0, False
    for line in text.splitlines():
        if line.startswith((name + "_total", name + "{", name + " ")):
            try:
                total, seen = total + float(line.rsplit(" ", 1)[1]), True
            except ValueError:
                continue
    return total if seen else None
