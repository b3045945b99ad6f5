"""The proxy's own HTTP routes (reverse-mode listener only):

  GET    /health                         liveness and session count (open)
  POST   /sessions                       mint a session; its id is the agent's API key      (admin)
  GET    /sessions                       list sessions                                      (admin)
  GET    /sessions/{id}                  one session's settings and call count              (admin or own key)
  GET    /sessions/{id}/trace            OpenEnv TrainingTrace, or 409 with why not          (admin or own key)
         /sessions/{id}/trace?form=compact  the same turns, each token once (traces/compact.py)
  GET    /sessions/{id}/rollout          the full capture document                          (admin or own key)
  GET    /sessions/{id}/graph            the same without token ids, requests, answers      (admin or own key)
  DELETE /sessions/{id}                  forget a session and its journal                   (admin)
  POST   /sessions/{id}/policy_version   {"policy_version": N} for one session              (admin)
  POST   /policy_version                 {"policy_version": N} for every session            (admin)
  GET    /engines[?cache=0]              each engine: state, sessions, calls, tokens, busy seconds, prefix-cache
                                         hits (not with cache=0: those ask each engine)              (admin)
  GET    /v1/models                      the served model                                   (a session key)
  GET    /ca.pem                         the CA certificate for forward (HTTPS_PROXY) mode  (open)

Without an admin key (loopback only) the admin routes are open to local callers; a request that carries a
session's key is still confined to that session's own routes.
"""

from __future__ import annotations

import hmac
from pathlib import Path
from urllib.parse import parse_qs

from harness_trainer import fastjson
from harness_trainer._exceptions import NoEngine, NotTrainable
from harness_trainer.proxy.capture import SamplingPolicy
from harness_trainer.proxy.session import compact_trace, rollout_document, training_trace
from harness_trainer.proxy.wire import Reply, Request, json_reply


def session_key(request: Request) -> str | None:
    """The key a request carries: a session's id (its agent's API key), or the admin key."""
    auth = request.headers.get("authorization", "")
    if auth.lower().startswith("bearer "):
        return auth[7:].strip()
    key = request.headers.get("x-api-key") or request.headers.get("x-goog-api-key")
    if key is None and "key=" in request.path:  # Google's API also takes its key in the query
        query = parse_qs(request.path.partition("?")[2]).get("key")
        key = query[0] if query else None
    return key


def _error(status: int, message: str) -> Reply:
    return json_reply(status, {"error": {"message": message, "code": status}})


class ControlRoutes:
    def __init__(self, addon, *, admin_key: str | None, public_url: str | None, confdir: str | None = None):
        self.addon = addon
        self.admin_key = admin_key
        self.public_url = public_url
        self.confdir = confdir  # where mitmproxy keeps the CA of forward mode

    def _caller(self, request: Request) -> tuple[bool, str | None]:
        """(is admin, session id the caller holds the key of)."""
        key = session_key(request) or request.headers.get("x-admin-key")
        if key and key in self.addon.store.sessions:
            return False, key
        if self.admin_key is None:
            return True, None
        return bool(key) and hmac.compare_digest(key, self.admin_key), None

    async def handle(self, request: Request) -> Reply:
        parts = [p for p in request.path.split("?", 1)[0].split("/") if p]
        method = request.method
        admin, own = self._caller(request)
        store = self.addon.store

        if parts == ["health"] and method == "GET":
            return json_reply(200, {"status": "ok", "sessions": len(store.sessions)})
        if parts == ["ca.pem"] and method == "GET":
            path = Path(self.confdir or "~/.cache/harness-trainer/mitmproxy").expanduser() / "mitmproxy-ca-cert.pem"
            if not path.is_file():
                return _error(404, "this proxy has no forward (HTTPS_PROXY) listener, so no CA: start it with "
                                   "--forward-port")
            return Reply(200, path.read_bytes(), "application/x-pem-file")
        if parts == ["v1", "models"] and method == "GET":
            if not (own or admin):
                return _error(401, "unknown API key")
            model = store.sessions[own].model if own else await self.addon.served_model(self.addon.upstream)
            return json_reply(200, {"object": "list", "data": [{"id": model, "object": "model"}]})
        if not parts or parts[0] not in ("sessions", "policy_version", "engines"):
            return _error(404, f"no route {method} {request.path}: model calls go to /v1/chat/completions, "
                               "/v1/messages or /v1/responses; control routes are under /sessions")
        session_id = parts[1] if len(parts) > 1 else None
        if not admin and not (own and own == session_id and method == "GET"):
            return _error(401 if not own else 403, "this route needs the proxy's admin key"
                          if not own else "a session key can only read its own session")

        body = {}
        if method in ("POST", "PUT", "PATCH") and request.content:
            try:
                body = fastjson.loads(request.content)
                if not isinstance(body, dict):
                    raise ValueError("expected a JSON object")
            except (ValueError, UnicodeDecodeError) as exc:
                return _error(400, f"request body is not valid JSON: {exc}")

        if parts[0] != "sessions" or len(parts) == 1:
            return await self._global(request, parts, body)
        session = store.sessions.get(session_id or "")
        if session is None:
            return _error(404, f"no session {session_id!r}")
        return await self._session(request, session, parts[2:], body)

    async def _global(self, request: Request, parts: list[str], body: dict) -> Reply:
        """/engines, /policy_version, /sessions (admin only)."""
        method, store = request.method, self.addon.store
        if parts == ["engines"] and method == "GET":  # ?cache=0: the proxy's own counts, no engine asked
            if request.path.partition("?")[2] == "cache=0":
                return json_reply(200, {"engines": self.addon.pool.summary()})
            return json_reply(200, {"engines": await self.addon.pool.metrics(self.addon.http)})
        if parts == ["policy_version"] and method == "POST":
            version, model = body.get("policy_version"), body.get("model")
            if not isinstance(version, int) or isinstance(version, bool):
                return _error(400, "'policy_version' must be an integer")
            if model is not None and not (isinstance(model, str) and model):
                return _error(400, "'model' must be the name new calls go to (a LoRA adapter's), or absent "
                                   "(the served model)")
            # sessions minted from now on start at this version (and model) too
            store.set_current(version, model)
            sessions = list(store.sessions.values())
            for session in sessions:  # each written before the answer (store.py: what the journal promises)
                store.set_policy_version(session, version, model)
            return json_reply(200, {"policy_version": version, "model": store.current_model,
                                       "sessions": len(store.sessions)})
        if parts == ["policy_version"] and method == "GET":  # what the trainer needs to unload old adapters
            return json_reply(200, {"policy_version": store.current_version, "model": store.current_model,
                                       "in_flight": {k: v for k, v in store.in_flight.items() if v}})
        if parts == ["sessions"] and method == "POST":
            return await self._create(request, body)
        if parts == ["sessions"] and method == "GET":
            return json_reply(200, {"sessions": [s.summary() for s in store.sessions.values()]})
        return _error(404, f"no route {method} {request.path}")

    async def _session(self, request: Request, session, tail: list[str], body: dict) -> Reply:
        """/sessions/ID[/trace|/rollout|/graph|/policy_version]: its own key may GET, the admin key all."""
        method, store = request.method, self.addon.store
        if tail == [] and method == "GET":
            return json_reply(200, session.summary())
        if tail == [] and method == "DELETE":
            store.delete(session.id)
            return json_reply(200, {"deleted": session.id})
        if tail == ["trace"] and method == "GET":
            compact = parse_qs(request.path.partition("?")[2]).get("form") == ["compact"]
            try:
                return json_reply(200, compact_trace(session) if compact else training_trace(session))
            except NotTrainable as exc:
                return json_reply(409, {"trainable": False, "reason": str(exc)})
        if tail == ["rollout"] and method == "GET":
            return json_reply(200, rollout_document(session))
        if tail == ["graph"] and method == "GET":
            return json_reply(200, rollout_document(session, ids=False))
        if tail == ["policy_version"] and method == "POST":
            version = body.get("policy_version")
            if not isinstance(version, int) or isinstance(version, bool):
                return _error(400, "'policy_version' must be an integer")
            store.set_policy_version(session, version)
            return json_reply(200, session.summary())
        return _error(404, f"no route {method} {request.path}")

    async def _create(self, request: Request, body: dict) -> Reply:
        checks = {"id": str, "upstream": str, "model": str, "policy": dict, "max_model_calls": int,
                  "policy_version": int, "metadata": dict}
        for key, kind in checks.items():
            value = body.get(key)
            if value is not None and (not isinstance(value, kind) or isinstance(value, bool)):
                return _error(400, f"'{key}' must be of type {kind.__name__}")
        try:
            SamplingPolicy.from_dict(body.get("policy"))
            body = dict(body, model=body.get("model") or await self.addon.served_model(
                (body.get("upstream") or self.addon.upstream).rstrip("/")))
            session = self.addon.new_session(body)
        except NoEngine as exc:  # every engine lost or behind: the caller may retry once one is back
            return _error(503, str(exc))
        except KeyError as exc:
            return _error(409, str(exc.args[0]))
        except (ValueError, TypeError) as exc:
            return _error(400, str(exc))
        except Exception as exc:  # the upstream could not be asked for its model
            return _error(502, f"could not ask the upstream for its served model: {exc}; pass 'model'")
        # written to its journal before its key is handed out (store.py: what the journal promises)
        base = self.public_url or f"http://{request.host_header or request.host}"
        return json_reply(201, dict(session.summary(), api_key=session.id, base_url=f"{base}/v1"))
