"""The policy in the engine: the trainer's weights synced into vLLM after a step through one weight-sync
backend (serving/weight_sync.py: every weight by reload, or a LoRA adapter by name), probed, and put back when
the engine or the proxy restarted. The trainer holds one, given the policy (policy.py), the proxy and the weight
sync to use (a backend of serving/weight_sync.py, or one passed in: TRL's weight_transfer).

    sync_weights(step)      weights -> every engine as version + 1 (in parallel), each probed: vLLM's
                            teacher-forced logprobs must equal the trainer's; then the proxy is told, so no call
                            is stamped with a version its engine does not serve yet
    ensure_services(step)   before a step: engines and proxy answer (bounded waits, serving/supervise.py), a
                            restarted proxy gets the version again, a restarted engine the weights again

Several engines behind the proxy (proxy/engines.py): the proxy's list is the one synced; an engine it reports lost
is skipped (the run goes on with the others) and synced when it answers again.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

import httpx
import torch

from harness_trainer._exceptions import ConfigError, EngineUnreachable, ServiceDown, TrainingStopped, WeightSyncError
from harness_trainer.serving.engine import teacher_forced_logprobs
from harness_trainer.serving.gpu_sync import transfer_available
from harness_trainer.serving.process import engine_answers
from harness_trainer.serving.supervise import wait_for
from harness_trainer.serving.sync_steps import GPU_BACKENDS, IPC, RELOAD
from harness_trainer.serving.weight_sync import WeightSync, make_weight_sync, weight_version
from harness_trainer.training.policy import PROBE_IDS
from harness_trainer.training.protocols import TrainablePolicy

log = logging.getLogger("harness_trainer")
PARALLEL_SYNCS = 4  # engines loaded at once: each reads the same saved weights


@functools.cache
def preflight(backend: str, world_size: int = 1) -> None:
    """What the weight-sync backend needs of this machine, once a process (ConfigError naming the fix); the
    settings' own rules are AsyncGRPOConfig.check's."""
    if backend in GPU_BACKENDS and (missing := transfer_available()) is not None:
        raise ConfigError(f"weight_sync_backend='{backend}' cannot run here: {missing}")
    if backend == IPC and world_size > 1:  # its handle all-gather spans every rank
        raise ConfigError("weight_sync_backend='ipc' shares one GPU between one trainer process and the engine: with "
                         "several trainer ranks use nccl")


class PolicySync:
    """The EngineSync (protocols.py) of a run with engines: weights by a weight-sync backend, each sync probed."""

    def __init__(self, policy: TrainablePolicy, args, proxy=None, backend: str = RELOAD,
                 weight_sync: Callable[[str], WeightSync] | None = None, out: Path | None = None):
        """policy: the Policy (policy.py); proxy: the run's ProxyClient (None: no proxy to tell); backend: the
        weight_sync_backend; weight_sync: engine url -> a WeightSync, used instead of the backend's; out: the
        run's folder (named in the message of a stop)."""
        self.policy, self.args, self.proxy, self.backend, self.weight_sync = policy, args, proxy, backend, weight_sync
        self.out = Path(out or args.output_dir)
        self.version = 0  # the policy version the engines serve and the proxy stamps
        self.served_name: str | None = None  # what the engine serves the current version as (a LoRA adapter)
        self.weight_syncs: dict[str, WeightSync] = {}  # engine url -> its weight sync, made at its first sync
        self.recovered: list[str] = []  # what ensure_services put back since the trainer last logged a step
        self.last_probe_gap: float | None = None  # the probe after the last sync
        self.step = 0  # the trainer's step, for messages

    def take_recovered(self) -> list[str]:
        """What ensure_services put back since the last call (the trainer logs it with the next step)."""
        recovered, self.recovered = self.recovered, []
        return recovered

    def close(self) -> None:
        """Each engine's weight sync closed (a GPU transfer's process group, an HTTP client)."""
        for sync in self.weight_syncs.values():
            sync.close()

    def sync_weights(self, step: int) -> float:
        self.step = step
        url = self.args.vllm_server_base_url
        if not url:
            raise TrainingStopped("vllm_server_base_url is not set: the trainer has no engine to sync weights into")
        started, version = time.perf_counter(), self.version + 1
        urls = self._engine_urls(url)
        weights = self.policy.full_weights()  # FSDP: gathered once from every rank, else None
        with ThreadPoolExecutor(min(len(urls), PARALLEL_SYNCS)) as pool:
            names = list(pool.map(lambda u: self._sync_one(u, version, weights), urls))
        synced = [(u, n) for u, n in zip(urls, names) if n is not False]
        if not synced:
            raise TrainingStopped(f"weight sync at step {self.step}: no engine could take version {version}")
        self.version, self.served_name = version, synced[0][1]
        for engine_url, name in synced:  # every engine serves the new weights before any call is stamped with them
            self._probe(engine_url, name)
        proxy = self.proxy
        if proxy is not None:
            proxy.set_policy_version(self.version, model=self.served_name)
        if self.policy.peft is not None and proxy is not None:  # adapters no rollout may still sample from
            in_flight = proxy.policy_state()["in_flight"]
            for engine_url, _ in synced:
                self._sync_step(partial(self.weight_syncs[engine_url].unload_idle,
                                        self.version - self.args.max_staleness, in_flight))
        return time.perf_counter() - started

    def _engine_urls(self, url: str, lost_too: bool = False) -> list[str]:
        """The engines to sync: the proxy's when it has several (lost ones only with `lost_too`: they may be
        back), else the trainer's one."""
        engines = self._proxy_engines()
        if len(engines) < 2:
            return [url]
        return [e["url"] for e in engines if lost_too or e["state"] != "lost"] or [url]

    def _proxy_engines(self, cache: bool = False) -> list[dict]:
        """The engines behind the run's proxy, as it reports them (none without a proxy); `cache`: with their
        prefix-cache figures, which the proxy asks each engine for."""
        return self.proxy.engines(cache) if self.proxy is not None and hasattr(self.proxy, "engines") else []

    def engine_metrics(self) -> dict:
        """With several engines behind the proxy, each one's figures as engine{i}/{name}: state, sessions, calls,
        tokens, calls in flight and prefix-cache hit rate (vLLM's own counter, since the engine started)."""
        try:
            engines = self._proxy_engines(cache=True)
        except Exception:  # figures only: never fail a step over them
            return {}
        if len(engines) < 2:
            return {}
        return {f"engine{i}/{key}": e.get(key) for i, e in enumerate(engines)
                for key in ("url", "state", "sessions", "calls", "in_flight", "prompt_tokens", "completion_tokens",
                            "prefix_cache_hit_rate")}

    def engine_time(self) -> dict[str, tuple[float, float]]:
        """Each engine's (busy_s, call_s) since the proxy started (proxy/engines.py); {} when the proxy cannot say."""
        try:
            return {e["url"]: (e["busy_s"], e["call_s"]) for e in self._proxy_engines()}
        except Exception:  # figures only: never fail a step over them
            return {}

    def _sync_one(self, url: str, version: int, weights: dict | None = None):
        """Load `version` into one engine; returns its served name, or False when, among several, that engine
        went away during the sync (the proxy fences it; it is synced again when it answers)."""
        try:
            return self._load_weights(url, version, weights)
        except WeightSyncError as exc:
            if len(self._engine_urls(url, lost_too=True)) > 1 and not engine_answers(url):
                log.warning("step %d: engine %s went away during the weight sync (%s); the run goes on with the "
                            "others", self.step + 1, url, exc)
                return False
            if not isinstance(exc, EngineUnreachable):
                raise TrainingStopped(f"weight sync at step {self.step} failed: {exc}") from None
        # the run's one engine is gone: waited for as before a step (a restarted one gets the policy back), then
        # this version again; or the run stops with what to do
        self.ensure_services(self.step)
        return self._sync_step(partial(self._load_weights, url, version, weights))

    def _sync_step(self, step):
        """Run one weight-sync step; its failure stops the run with the step's own message."""
        try:
            return step()
        except WeightSyncError as exc:
            raise TrainingStopped(f"weight sync at step {self.step} failed: {exc}") from None

    def _load_weights(self, url: str, version: int, weights: dict | None = None) -> str | None:
        """The policy into the engine as `version` (`weights`: the whole model's, gathered, with FSDP); returns
        the name it is served under (a LoRA adapter's)."""
        if url not in self.weight_syncs:  # the one passed in (TRL's weight_transfer), else the backend's
            self.weight_syncs[url] = self.weight_sync(url) if self.weight_sync else \
                make_weight_sync(self.backend, url, self.args.weight_sync_timeout_s)
        policy = self.policy
        return self.weight_syncs[url].load(policy.peft if policy.peft is not None else policy.model, version,
                                           state_dict=weights)

    def ensure_services(self, step: int) -> bool:
        """Before a step is trained, the proxy and the engine must answer (each waited for up to
        service_recovery_timeout_s, then TrainingStopped) and hold the trainer's state: a restarted proxy is told
        the policy version again; a restarted engine, which serves the weights it was launched with, is synced
        again. True when the engine's weights were put back: rollouts may have sampled the wrong ones."""
        self.step = step
        timeout, url = self.args.service_recovery_timeout_s, self.args.vllm_server_base_url
        proxy, put_back, resynced = self.proxy, [], False
        try:
            if proxy is not None:
                state: dict = {}  # the liveness probe's answer is the state to check: asked once
                wait_for(f"the capture proxy at {proxy.url}", lambda: state.update(proxy.policy_state()), timeout)
                if state["policy_version"] != self.version:
                    proxy.set_policy_version(self.version, model=self.served_name)
                    put_back.append(f"the capture proxy restarted: its policy version is {self.version} again")
            if url:
                engines = self._engine_urls(url, lost_too=True)
                # several: one answering is enough to go on; a silent one is fenced by the proxy
                named = f"the engine at {url}" if len(engines) == 1 else f"any of the engines {', '.join(engines)}"
                wait_for(named, lambda: _any_answers(engines), timeout)
                engines = [u for u in engines if engine_answers(u)]
                for engine in engines:
                    if not self._engine_serves_policy(engine):
                        weights = self.policy.full_weights()
                        self._sync_step(partial(self._load_weights, engine, self.version, weights))
                        self._probe(engine, self.served_name)
                        put_back.append(f"the engine at {engine} restarted without the policy: version "
                                        f"{self.version} synced again")
                        resynced = True
        except ServiceDown as exc:
            raise TrainingStopped(f"{exc}. Start it again, then resume the run from {self.out / 'latest'} (the last "
                                  f"saved step)") from None
        for line in put_back:
            log.warning("step %d: %s", self.step + 1, line)
        self.recovered += put_back
        return resynced

    def _engine_serves_policy(self, url: str) -> bool:
        if self.served_name is None:  # full weights: the engine reports the version it was last given
            try:
                return weight_version(url) == str(self.version)
            except httpx.HTTPStatusError:  # an engine without the route cannot say: the probe after each sync must
                return True
            except httpx.TransportError:  # it answered /health and went away: the next sync meets it and waits
                return True
        try:
            served = httpx.get(f"{url.rstrip('/')}/v1/models", timeout=10).json()["data"]
        except httpx.TransportError:  # as above
            return True
        return any(m["id"] == self.served_name for m in served)

    def _probe(self, url: str, model: str | None = None) -> None:
        """vLLM must now score a fixed sequence exactly as the trainer's weights do (under `model`: the adapter)."""
        served = torch.tensor(teacher_forced_logprobs(url, PROBE_IDS, model=model))
        logits = self.policy.probe_logits()
        ours = torch.log_softmax(logits.double(), -1).gather(-1, torch.tensor(PROBE_IDS[1:])[:, None])[:, 0]
        gap = float((served.double() - ours).abs().max())
        tolerance = self.args.probe_tolerance
        if tolerance is None:  # what "the same weights" can mean at this precision
            tolerance = 1e-3 if self.policy.dtype == torch.float32 else 5e-2
        if gap > tolerance:
            tied = getattr(self.policy.model.config, "tie_word_embeddings", False) and self.policy.peft is None
            hint = (" This model ties lm_head to its embedding: the engine must serve it untied (`harness-train "
                    "serve` and a launched engine do; a plain `vllm serve` does not), or use --use-peft") \
                if tied else ""
            raise TrainingStopped(f"after syncing version {self.version}, vLLM's logprobs differ from the trainer's "
                                  f"by {gap:.2e} (> {tolerance}): the engine did not take the weights.{hint}")
        self.last_probe_gap = gap


def _any_answers(urls: list[str]) -> None:
    if not any(engine_answers(u) for u in urls):
        raise ConnectionError("no engine answers /health")
