"""Run the capture proxy in the proxy's environment: one process, one event loop, one capture (core.py).

    python -m harness_trainer.proxy.server --upstream http://127.0.0.1:8000 --port 8100 [--forward-port 8101]

Two listeners over the same sessions:
  reverse  (--port)          agents whose base URL points at the proxy, and the control routes (front.py)
  forward  (--forward-port)  agents that keep their built-in endpoint and get HTTPS_PROXY + the CA at /ca.pem;
                             their model calls are captured and sent to the session's upstream (mitmproxy's
                             master with addon.py: it intercepts TLS)
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import ipaddress
import os
import signal
import sys
from pathlib import Path

from harness_trainer.openfiles import raise_open_files_limit


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def parse_size(text: str) -> int:
    """'32m' -> bytes (k, m, g: powers of 1024)."""
    text = text.strip().lower()
    scale = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}.get(text[-1:], 1)
    try:
        return int(text[:-1] if scale > 1 else text) * scale
    except ValueError:
        raise SystemExit(f"harness-train proxy: --body-size-limit {text!r} is not a size (e.g. 32m)") from None


async def serve(args: argparse.Namespace) -> None:
    from harness_trainer.proxy.core import Capture
    from harness_trainer.proxy.front import Front
    from harness_trainer.proxy.store import SessionStore

    confdir = Path(args.confdir).expanduser()
    confdir.mkdir(parents=True, exist_ok=True)
    store = SessionStore(args.journal)
    capture = Capture(store, upstream=args.upstream, model=args.model, admin_key=args.admin_key,
                      public_url=args.public_url, confdir=str(confdir))
    await capture.running()
    syncing = asyncio.create_task(store.keep_synced())
    master = await forward_listener(args, capture, confdir) if args.forward_port else None
    front = Front(capture, args.host, args.port, parse_size(args.body_size_limit))
    await front.start()
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)
    print(f"capture proxy: reverse on http://{args.host}:{args.port} -> {', '.join(args.upstream)}"
          + (f", forward (HTTPS_PROXY) on {args.host}:{args.forward_port}" if args.forward_port else "")
          + f"; {len(store.sessions)} session(s) reloaded from the journal", flush=True)
    running = asyncio.create_task(master.run()) if master else None
    waits = [asyncio.create_task(stopping.wait())] + ([running] if running else [])
    await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    await front.stop()
    if master is not None:
        master.shutdown()
        await running
    await capture.done()
    syncing.cancel()
    await store.sync_all()


async def forward_listener(args: argparse.Namespace, capture, confdir: Path):
    """mitmproxy's master on the forward port only, with the capture hooks (addon.py)."""
    from mitmproxy.addons import core, errorcheck, next_layer, proxyserver, tlsconfig
    from mitmproxy.certs import CertStore
    from mitmproxy.master import Master
    from mitmproxy.options import Options

    from harness_trainer.proxy.addon import CaptureAddon

    CertStore.from_store(confdir, "mitmproxy", 2048)  # the CA exists before /ca.pem can be asked for it
    options = Options(listen_host=args.host, mode=[f"regular@{args.forward_port}"], confdir=str(confdir))
    # Only the addons a proxy needs: mitmproxy calls every addon on every event, and its ~35 defaults
    # (playback, blocklists, header rewriting, ...) cost more than the capture itself.
    master = Master(options, with_termlog=True)
    master.addons.add(core.Core(), proxyserver.Proxyserver(), next_layer.NextLayer(), tlsconfig.TlsConfig(),
                      errorcheck.ErrorCheck())
    master.options.update(
        connection_strategy="lazy",  # a model call is answered by the session's engine, never by the host asked
        body_size_limit=args.body_size_limit, ssl_insecure=True, keep_host_header=True,
        stream_large_bodies=None, termlog_verbosity=os.environ.get("HARNESS_PROXY_LOG_LEVEL", "warn"))
    master.addons.add(CaptureAddon(capture))
    return master


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="harness-train proxy", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--upstream", required=True, action="append",
                        help="an engine's base URL, e.g. http://127.0.0.1:8000; repeat for several (each session "
                             "is pinned to one)")
    parser.add_argument("--port", type=int, default=8100, help="reverse listener and control routes (8100)")
    parser.add_argument("--forward-port", type=int, default=None, help="forward (HTTPS_PROXY) listener (off)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (127.0.0.1)")
    parser.add_argument("--model", default=None, help="served model id (default: asked from the upstream)")
    parser.add_argument("--admin-key", default=os.environ.get("HARNESS_PROXY_ADMIN_KEY"),
                        help="key for the control routes (env HARNESS_PROXY_ADMIN_KEY); required off loopback")
    parser.add_argument("--journal", default=None, help="directory of per-session journals (off)")
    parser.add_argument("--confdir", default="~/.cache/harness-trainer/mitmproxy",
                        help="where mitmproxy keeps its CA (~/.cache/harness-trainer/mitmproxy)")
    parser.add_argument("--public-url", default=None, help="base URL sandboxes reach the proxy at")
    parser.add_argument("--body-size-limit", default="32m", help="largest request body accepted (32m)")
    return parser


def return_large_blocks() -> None:
    """Blocks of 128 KB and more (a call's body, its answer, a prompt's ids) are mapped for themselves and given
    back to the system when freed. glibc's default raises that threshold as such blocks are freed, after which they
    come from the heap and its high water stays: 8 rollouts at 120 turns grew the proxy by 12x their unique tokens
    that way, 4.4x with it (docs/benchmarks.md, long rollouts). Nothing on a libc without mallopt."""
    try:
        ctypes.CDLL(None).mallopt(-3, 128 * 1024)  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        pass


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    raise_open_files_limit()  # two connections a call in flight: 1,024 is ~500 agents
    return_large_blocks()
    if not is_loopback(args.host) and not args.admin_key:
        print(f"harness-train proxy: refusing to bind {args.host} without an admin key: anyone who can reach "
              "it could read every session. Pass --admin-key (or HARNESS_PROXY_ADMIN_KEY), or bind 127.0.0.1.",
              file=sys.stderr)
        return 2
    run(serve(args), mitmproxy=bool(args.forward_port))
    return 0


def run(main, *, mitmproxy: bool) -> None:
    """On uvloop (libuv's event loop), where it is installed and mitmproxy is not in the process: the sockets are
    most of a 1 KB call's cost, and uvloop's took the proxy's added p50 from 0.59 to 0.42 ms (docs/benchmarks.md).
    mitmproxy (the forward listener) keeps asyncio's own loop, the one it is tested on."""
    try:
        import uvloop
    except ImportError:
        uvloop = None
    if uvloop is None or mitmproxy:
        asyncio.run(main)
    else:
        uvloop.run(main)


if __name__ == "__main__":
    sys.exit(main())
