"""What a harness reads of a real run of its agent, replayed from that run's recorded logs."""

from pathlib import Path

from harness_trainer.agents.registry import make_harness
from harness_trainer.sandboxes.base import ExecResult
from harness_trainer.sandboxes.bubblewrap import LocalSandbox

RECORDED = Path(__file__).parent / "agents"


def replay(harness: str, recorded: str, tmp_path: Path):
    """What `harness` reads of a real run of its agent, from that run's logs (tests/agents/RECORDED/) put where the
    agent left them in a trial."""
    box = LocalSandbox(tmp_path / "trial")
    box.start()
    box.host_path("/logs/agent").mkdir(parents=True, exist_ok=True)
    for log in (RECORDED / recorded).iterdir():
        (box.host_path("/logs/agent") / log.name).write_text(log.read_text())
    return make_harness(harness).collect(box, ExecResult(0, "", "", timed_out=False, seconds=1.0))
