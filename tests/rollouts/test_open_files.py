"""A run of hundreds of rollouts opens thousands of descriptors: the pool's process and the proxy raise their own
soft limit to the hard one (harness_trainer/openfiles.py), so a session started at the usual 1,024 does not fail
rollouts on "Too many open files" past ~200 in flight."""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent("""
    import json, resource, sys
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))  # a session's usual soft limit, lower still
    from harness_trainer.proxy.client import ProxyServer
    from harness_trainer.rollouts.pool import RolloutPool
    with RolloutPool(None, sys.argv[1], workers=1):
        pool = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))  # the proxy inherits 256, and must raise its own
    with ProxyServer("http://127.0.0.1:9", model="tiny", log_path=sys.argv[1] + "/proxy.log") as proxy:
        limits = open(f"/proc/{proxy.managed.process.pid}/limits").read()
    line = next(x for x in limits.splitlines() if x.startswith("Max open files"))
    print(json.dumps({"hard": hard, "pool": pool, "proxy": int(line.split()[3])}))
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the proxy's limits from /proc")
def test_the_pool_and_the_proxy_raise_their_open_files_limit_to_the_hard_one(tmp_path):
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard != resource.RLIM_INFINITY and hard <= 256:
        pytest.skip(f"the hard limit here is {hard}: nothing to raise to")
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    wanted = found["hard"] if found["hard"] != resource.RLIM_INFINITY else 1 << 20
    assert found["pool"] == wanted and found["proxy"] == wanted, found
