"""A run folder read for the viewer: found, indexed once, read lazily.

What is on disk (train.py, evaluate.py and proof.py write it):
  rollouts.jsonl   one record per rollout: task, status and why, reward, tool use, the agent's messages, the calls
  traces.jsonl     one OpenEnv TrainingTrace per trainable rollout; each turn's metadata.episode_id joins it
  metrics.jsonl    one line per training step        summary.json, config.yaml, proof.json   the rest

Indexing reads each file once, front to back, one line at a time, and keeps per rollout only its table row and
the byte offsets of its lines; a rollout's messages and a turn's tokens are read from disk when the page asks
for them, so thousands of rollouts with 100k-token traces never sit in memory at once. A file that grows (a run
still going) is indexed from where the last pass stopped. Token text comes from the run's own tokenizer: each
sampled or prompt id is decoded on its own, nothing is re-tokenised.
"""

from __future__ import annotations

import json
import re
from collections import OrderedDict
from pathlib import Path

from harness_trainer._exceptions import ViewerError
from harness_trainer.models.hub import cached_file
from harness_trainer.traces.files import turn_counts
from harness_trainer.traces.prefixes import longest_prefix_parents, root_break

RUN_FILES = ("rollouts.jsonl", "traces.jsonl", "metrics.jsonl")
CHUNK = 2048  # tokens per piece of a turn the page loads
_EPISODE = re.compile(rb'"episode_id": ?"([^"\\]*)"')


def is_run(folder: Path) -> bool:
    return any((folder / name).is_file() for name in RUN_FILES)


def find_runs(root: Path) -> list[Path]:
    """The folder itself when it is a run, else the runs one or two levels below it (a proof's stages)."""
    if not root.exists():
        raise ViewerError(f"{root} does not exist: give the --output-dir of a harness-train train or eval run, "
                          "or of the proof (make demo writes runs/demo)")
    if not root.is_dir():
        raise ViewerError(f"{root} is a file, not a run folder: give the folder that holds rollouts.jsonl")
    if is_run(root):
        return [root]
    runs = sorted({p for pattern in ("*", "*/*") for p in root.glob(pattern) if p.is_dir() and is_run(p)})
    if not runs:
        raise ViewerError(f"{root} is not a run folder: neither it nor its subfolders hold {', '.join(RUN_FILES)}. "
                          "Give the --output-dir of `harness-train train`, `harness-train eval` or the proof")
    return sorted(runs, key=lambda p: (not (p / "metrics.jsonl").exists(), str(p)))  # training runs first


def find_tokenizer(run: Path, root: Path, model: Path | None = None) -> Path | None:
    """tokenizer.json of the model the run sampled from: --model, the run's checkpoints, the proof's other stages,
    the model named in its config or summary."""
    candidates = [model / "tokenizer.json"] if model else []
    checkpoints = sorted(run.glob("checkpoint-*/tokenizer.json"), key=lambda p: int(p.parent.name.split("-")[-1])
                         if p.parent.name.split("-")[-1].isdigit() else -1, reverse=True)
    candidates += [run / "final" / "tokenizer.json", *checkpoints, run / "tokenizer.json"]
    candidates += sorted(root.glob("*/final/tokenizer.json")) + sorted(run.parent.glob("*/final/tokenizer.json"))
    for name in ("config.yaml", "summary.json"):
        named = _read_model_name(run / name)
        if named:  # a folder, or a Hub id already in the Hub cache (the view downloads nothing by itself)
            candidates.append(cached_file(named, "tokenizer.json") or Path(named) / "tokenizer.json")
    return next((c for c in candidates if c.is_file()), None)


def _read_model_name(path: Path) -> str | None:
    """The `model` of a config.yaml or summary.json (None when absent or unreadable)."""
    import yaml

    try:
        data = yaml.safe_load(path.read_text()) if path.is_file() else None  # JSON is YAML
    except yaml.YAMLError:
        return None
    return data.get("model") if isinstance(data, dict) else None


class Decoder:
    """Token ids -> text pieces with the run's own tokenizer (ids shown as ⟨id⟩ when there is none)."""

    def __init__(self, tokenizer_json: Path | None):
        self.source = str(tokenizer_json) if tokenizer_json else None
        self._tok = None
        if tokenizer_json:
            from tokenizers import Tokenizer

            self._tok = Tokenizer.from_file(str(tokenizer_json))

    def pieces(self, ids: list[int]) -> list[str]:
        if self._tok is None:
            return [f"⟨{i}⟩" for i in ids]
        return self._tok.decode_batch([[i] for i in ids], skip_special_tokens=False)


def _read_json(path: Path):
    try:
        return json.loads(path.read_text()) if path.is_file() else None
    except ValueError:
        return None


def _read_line(path: Path, at: tuple[int, int]) -> dict:
    with path.open("rb") as f:
        f.seek(at[0])
        return json.loads(f.read(at[1]))


def _complete_lines(path: Path, start: int):
    """(offset, bytes) of each whole line from byte `start` on; a half-written last line waits for next time."""
    if not path.is_file():
        return
    with path.open("rb") as f:
        f.seek(start)
        offset = start
        for line in f:
            if not line.endswith(b"\n"):
                return
            if line.strip():
                yield offset, line
            offset += len(line)


class RunFolder:
    """One run: its overview, its rollout table, one rollout, one piece of one turn's tokens."""

    def __init__(self, path: Path, decoder: Decoder):
        self.path, self.decoder = path, decoder
        self.rows: list[dict] = []
        self._record_at: list[tuple[int, int] | None] = []
        self._trace_at: dict[str, tuple[int, int]] = {}
        self._scanned = {"rollouts.jsonl": 0, "traces.jsonl": 0}
        self._traces: OrderedDict[int, list[dict]] = OrderedDict()  # the last few rollouts' parsed turns
        self.refresh()

    # -- the index -------------------------------------------------------------------------------------------
    def refresh(self) -> None:
        traces, records = self.path / "traces.jsonl", self.path / "rollouts.jsonl"
        for offset, line in _complete_lines(traces, self._scanned["traces.jsonl"]):
            found = _EPISODE.findall(line[-4096:]) or _EPISODE.findall(line)  # the last turn's metadata ends it
            key = found[-1].decode() if found else f"trace-{len(self._trace_at)}"
            self._trace_at[key] = (offset, len(line))
            self._scanned["traces.jsonl"] = offset + len(line)
            if not records.exists():  # a folder of traces alone: one row per trace
                self._add_row({"episode_id": key, "task": "", "status": "trace"}, None)
        for offset, line in _complete_lines(records, self._scanned["rollouts.jsonl"]):
            try:
                record = json.loads(line)
            except ValueError:
                record = {"status": "unreadable", "reason": f"line at byte {offset} of rollouts.jsonl is not JSON"}
            self._add_row(record, (offset, len(line)))
            self._scanned["rollouts.jsonl"] = offset + len(line)

    def _add_row(self, record: dict, at: tuple[int, int] | None) -> None:
        outcome = record.get("outcome") or {}
        old = outcome.get("trace")  # records written before rollouts.jsonl left the ids to traces.jsonl
        if "turns" not in record and old:
            record.update(turn_counts(old))
        by_name = outcome.get("tool_calls_by_name") or {}
        self.rows.append({
            "i": len(self.rows), "task": record.get("task", ""), "episode_id": record.get("episode_id", ""),
            "status": record.get("status", ""), "reason": record.get("reason", ""),
            # what was trained on (reward functions, rollout_reward_fn), else the verifier's (eval, older runs)
            "reward": record["reward"] if record.get("reward") is not None else outcome.get("env_reward"),
            "turns": record.get("turns"),
            "sampled_tokens": record.get("sampled_tokens"), "trained_tokens": record.get("trained_tokens"),
            "context_tokens": record.get("context_tokens"),
            "tool_calls": " ".join(f"{k}×{v}" for k, v in sorted(by_name.items())),
            "tool_failures": outcome.get("tool_failure_count"), "invalid_tool_calls": record.get("invalid_tool_calls"),
            "policy_versions": ",".join(str(v) for v in record.get("policy_versions") or []),
            "seconds": round(record["seconds"], 1) if isinstance(record.get("seconds"), (int, float)) else None})
        self._record_at.append(at)

    # -- what the page asks for ------------------------------------------------------------------------------
    def overview(self) -> dict:
        import yaml

        metrics = [json.loads(line) for _, line in _complete_lines(self.path / "metrics.jsonl", 0)]
        config = (self.path / "config.yaml")
        summary = _read_json(self.path / "summary.json")
        return {"name": self.path.name, "path": str(self.path),
                "kind": "train" if metrics or config.exists() else "eval" if self.rows else "traces",
                "config": yaml.safe_load(config.read_text()) if config.is_file() else None,
                "summary": summary, "metrics": metrics, "rollouts": len(self.rows),
                "eval_table": summary if isinstance(summary, dict) and "wins" in summary else None,
                "tokenizer": self.decoder.source}

    def rollout(self, i: int) -> dict:
        row = self.rows[i]
        at = self._record_at[i]
        record = _read_line(self.path / "rollouts.jsonl", at) if at else {}
        outcome = record.pop("outcome", {}) or {}
        turns = self.trace_turns(i)
        parents = longest_prefix_parents([t["prompt_token_ids"] for t in turns],
                                         [t["prompt_token_ids"] + t["completion_token_ids"] for t in turns])
        metas = []
        for j, t in enumerate(turns):
            path, k = [], j  # the turns on the way here: which context tokens the model sampled, and when
            while k is not None:
                path.append(k)
                k = parents[k]
            spans = [[len(turns[a]["prompt_token_ids"]), len(turns[a]["prompt_token_ids"]) +
                      len(turns[a]["completion_token_ids"]), a] for a in reversed(path)]
            meta = t.get("metadata") or {}
            choice = ((t.get("response") or {}).get("choices") or [{}])[0]
            metas.append({"j": j, "node_id": t.get("node_id"), "index": meta.get("index", j),
                          "parent": parents[j], "prompt_tokens": len(t["prompt_token_ids"]),
                          "completion_tokens": len(t["completion_token_ids"]), "trained": sum(t["loss_mask"]),
                          "version": meta.get("policy_version"), "model": meta.get("model"),
                          "finish_reason": choice.get("finish_reason"), "sampled_spans": spans,
                          "start": spans[-2][1] if len(spans) > 1 else 0})
            if j and parents[j] is None:  # a root after the first turn: where and why its prompt broke away
                before = turns[j - 1]
                answer = (((before.get("response") or {}).get("choices") or [{}])[0] or {}).get("message") or {}
                reasoned = bool(answer.get("reasoning"))
                metas[-1]["root_break"] = meta.get("root_break") or root_break(
                    t["prompt_token_ids"], before["prompt_token_ids"],
                    before["prompt_token_ids"] + before["completion_token_ids"], reasoned)
        in_trace = {m["node_id"]: m["j"] for m in metas}
        calls = record.pop("calls", None) or [
            {"node_id": m["node_id"], "index": m["index"], "role": "agent", "policy_version": m["version"],
             "parent": turns[m["parent"]]["node_id"] if m["parent"] is not None else None,
             "prompt_tokens": m["prompt_tokens"], "completion_tokens": m["completion_tokens"],
             "finish_reason": m["finish_reason"], "model": m["model"]} for m in metas]
        for call in calls:
            call["turn"] = in_trace.get(call.get("node_id"))
        record["messages"] = len(outcome.get("completion") or [])
        return {"row": row, "record": record, "turns": metas, "calls": calls, "chunk": CHUNK}

    def messages(self, i: int) -> dict:
        """The agent's own view of the rollout (its messages, tool calls and outputs), apart from the turns: it
        grows with the context, so the page asks for it only when it is shown."""
        at = self._record_at[i]
        outcome = (_read_line(self.path / "rollouts.jsonl", at).get("outcome") or {}) if at else {}
        return {"messages": outcome.get("completion") or []}

    def trace_turns(self, i: int) -> list[dict]:
        if i in self._traces:
            self._traces.move_to_end(i)
            return self._traces[i]
        at = self._trace_at.get(self.rows[i]["episode_id"])
        if at:
            turns = _read_line(self.path / "traces.jsonl", at).get("turns", [])
        else:
            record_at = self._record_at[i]
            turns = ((_read_line(self.path / "rollouts.jsonl", record_at).get("outcome") or {}).get("trace")
                     if record_at else None) or []
        self._traces[i] = turns
        while len(self._traces) > 8:
            self._traces.popitem(last=False)
        return turns

    def tokens(self, i: int, j: int, chunk: int) -> dict:
        turn = self.trace_turns(i)[j]
        prompt, completion = turn["prompt_token_ids"], turn["completion_token_ids"]
        total = len(prompt) + len(completion)
        lo, hi = chunk * CHUNK, min(total, (chunk + 1) * CHUNK)
        if not 0 <= lo < max(total, 1):
            raise KeyError(f"turn {j} has {total} tokens: no piece {chunk}")
        ids = (prompt + completion)[lo:hi]
        logps = turn["per_token_logps"]
        return {"i": i, "j": j, "chunk": chunk, "start": lo, "end": hi, "total": total, "prompt": len(prompt),
                "ids": ids, "text": self.decoder.pieces(ids), "mask": turn["loss_mask"][lo:hi],
                "logp": [round(logps[p - len(prompt)], 4) if p >= len(prompt) else None for p in range(lo, hi)]}
