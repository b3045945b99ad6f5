"""The teacher of on-policy distillation: a vLLM engine that scores token sequences it did not sample.

    Teacher(url).logprobs(sequences)     per sequence, log p_teacher(token_i | tokens before it) for i >= 1
    Teacher(url).check_tokenizer(dir)    ModelError unless the teacher reads token ids as the student does

The scores are vLLM's prompt logprobs (`/v1/completions`, `prompt_logprobs: 0`: the given token's own logprob,
raw, at temperature 1), over the exact token ids sent: nothing is re-tokenized. The engine's prefix cache does
not serve prompt logprobs, so every request is a full prefill of what it sends; the caller sends each rollout's
longest sequences only (training/distill.py), and requests are batched up to `max_tokens_per_request`.
"""

from __future__ import annotations

import httpx

from harness_trainer._exceptions import EngineError, ModelError

# Text whose tokenization tells tokenizers apart: words, code, digits, whitespace runs, unicode, the chat
# markers of the common templates (a different tokenizer splits some of them differently).
PROBES = ("def f(x):\n    return x ** 2  # squares\n", "Hello, world! 12345 67.89e-3", "naïve café — 東京 🙂",
          "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", "<|begin_of_text|><|eot_id|></s><s>[INST]",
          "\t\t  spaces   and\n\n\nnewlines", "{\"tool_calls\": [{\"name\": \"bash\"}]}")


def check_same_tokenizer(student_dir: str, teacher_dir: str) -> None:
    """Before any engine starts: the two model folders' tokenizers have one vocabulary and read the probes alike."""
    from transformers import AutoTokenizer

    student, teacher = AutoTokenizer.from_pretrained(student_dir), AutoTokenizer.from_pretrained(teacher_dir)
    if student.get_vocab() != teacher.get_vocab():
        raise ModelError(f"the teacher ({teacher_dir}) does not share the student's tokenizer ({student_dir}): their "
                         f"vocabularies differ ({len(teacher)} and {len(student)} tokens). Distillation scores the "
                         "student's own token ids: use a teacher of the same tokenizer (the same model family)")
    for text in PROBES:
        if student.encode(text, add_special_tokens=False) != teacher.encode(text, add_special_tokens=False):
            raise ModelError(f"the teacher ({teacher_dir}) tokenizes {text!r} unlike the student ({student_dir}): "
                             "use a teacher of the same tokenizer")


class Teacher:
    def __init__(self, url: str, model: str | None = None, timeout_s: float = 600.0,
                 max_tokens_per_request: int = 32768):
        self.url, self.timeout_s, self.budget = url.rstrip("/"), timeout_s, max_tokens_per_request
        self.http = httpx.Client(timeout=timeout_s)
        self.model = model or self._served()
        self.requests = self.tokens = 0  # what it has scored (metrics)
        self.seconds = 0.0

    def _served(self) -> str:
        try:
            return self.http.get(f"{self.url}/v1/models").json()["data"][0]["id"]
        except (httpx.HTTPError, ValueError, KeyError, IndexError) as exc:
            raise EngineError(f"the teacher at {self.url} does not answer /v1/models ({exc}): start it with "
                              "`harness-train serve --model TEACHER`, or give --teacher-model") from None

    def take_costs(self) -> tuple[int, float]:
        """Tokens scored and seconds spent since the last call (a step's metrics)."""
        costs = (self.tokens, self.seconds)
        self.tokens, self.seconds = 0, 0.0
        return costs

    def logprobs(self, sequences: list[list[int]]) -> list[list[float | None]]:
        """Per sequence, its tokens' logprobs under the teacher (None for the first: it has no context)."""
        out: list[list[float | None]] = [[] for _ in sequences]
        batch: list[int] = []
        for i, ids in enumerate(sequences):
            if batch and sum(len(sequences[j]) for j in batch) + len(ids) > self.budget:
                self._score(sequences, batch, out)
                batch = []
            batch.append(i)
        if batch:
            self._score(sequences, batch, out)
        return out

    def _score(self, sequences: list[list[int]], batch: list[int], out: list) -> None:
        import time

        started = time.perf_counter()
        body = {"model": self.model, "prompt": [sequences[i] for i in batch], "max_tokens": 1, "prompt_logprobs": 0,
                "temperature": 1.0}
        try:
            response = self.http.post(f"{self.url}/v1/completions", json=body)
        except httpx.HTTPError as exc:
            raise EngineError(f"the teacher at {self.url} could not be reached: {exc}") from None
        if response.status_code != 200:
            raise EngineError(f"the teacher at {self.url} refused {len(batch)} sequence(s) of up to "
                              f"{max(len(sequences[i]) for i in batch)} tokens: HTTP {response.status_code} "
                              f"{response.text[:300]} (a sequence longer than its --max-model-len cannot be scored)")
        for i, choice in zip(batch, sorted(response.json()["choices"], key=lambda c: c["index"])):
            scored = choice.get("prompt_logprobs") or []
            out[i] = [None if entry is None else entry[str(token)]["logprob"]
                      for token, entry in zip(sequences[i], scored)]
            if len(out[i]) != len(sequences[i]):
                raise EngineError(f"the teacher at {self.url} scored {len(out[i])} of {len(sequences[i])} tokens")
        self.requests += 1
        self.tokens += sum(len(sequences[i]) for i in batch)
        self.seconds += time.perf_counter() - started

    def check_tokenizer(self, student_dir: str) -> None:
        """The teacher scores the student's own token ids, so both must read them alike: the probes tokenize to
        the same ids and a spread of ids decodes to the same text. ModelError with the first difference."""
        from transformers import AutoTokenizer

        student = AutoTokenizer.from_pretrained(student_dir)
        for text in PROBES:
            ours = student.encode(text, add_special_tokens=False)
            theirs = self._post("/tokenize", {"model": self.model, "prompt": text, "add_special_tokens": False})
            if theirs.get("tokens") != ours:
                raise ModelError(f"the teacher ({self.model} at {self.url}) does not share the student's tokenizer "
                                 f"({student_dir}): it reads {text!r} as {theirs.get('tokens')}, the student as "
                                 f"{ours}. Distillation scores the student's own token ids: use a teacher of the "
                                 "same tokenizer (the same model family)")
        step = max(1, len(student) // 64)
        ids = list(range(0, len(student), step))
        theirs = self._post("/detokenize", {"model": self.model, "tokens": ids}).get("prompt")
        if theirs != student.decode(ids):
            raise ModelError(f"the teacher ({self.model} at {self.url}) decodes token ids unlike the student's "
                             f"tokenizer ({student_dir}): use a teacher of the same tokenizer")

    def _post(self, path: str, body: dict) -> dict:
        try:
            response = self.http.post(f"{self.url}{path}", json=body)
            response.raise_for_status()
            return response.json()
        except (httpx.HTTPError, ValueError) as exc:
            raise EngineError(f"the teacher at {self.url}{path} failed: {exc}") from None

    def close(self) -> None:
        self.http.close()
