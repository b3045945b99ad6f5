"""One training step's forward and backward over the packed prefix tree, in memory linear in its tokens.

Micro-batches. The tree, in depth-first order, is cut into contiguous ranges of at most max_tokens tokens (at
segment starts where one fits, inside a segment where none does: a chain longer than the budget is split along
its length, never dropped or truncated). The context of a range [a, b) is the path of ancestors of its first
token, {j < a : end[j] > a}: all any of its tokens may see before it. A trained token's logprob is computed in
the range that holds its parent, the position whose logits predict it.

One range: a forward through the model with tree attention (tree_attention.py), logprobs only at the predicting
positions (chunked_logprobs: never a [tokens, vocab] tensor), backward.

Several ranges, exactly, with the shared prefix computed once per pass, never once per micro-batch:
    pass 1, no gradient, in order: each layer's keys/values at the positions later ranges need as context
            are cached (after RoPE)
    pass 2, in reverse order: a range runs with its context's cached keys/values as leaf tensors, its loss
            is back-propagated, and the gradient reaching those leaves is added to the cached positions'
            cotangents; when the range that produced them comes (it is earlier, so later in this pass), its
            own keys/values are back-propagated with those cotangents too.
Like gradient checkpointing, every range but the last is run forward twice; the gradient is that of one
pass over the whole tree, to float rounding, whatever the cut.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from harness_trainer.training.packing import PackedTree
from harness_trainer.training.tree_attention import TreeBatch, segments_of, tree_forward_masks, use_tree_attention

# logits of this many (position, vocabulary) entries at a time: 128 MiB in float32
CHUNK_ELEMENTS = 1 << 25


class _ChunkedLogprob(torch.autograd.Function):
    """log_softmax(h W^T / T)[target] per row of h, in chunks of rows; the backward recomputes each chunk's
    logits (d logp / d logits = onehot(target) - softmax), so only h and the log-sum-exps are kept."""

    @staticmethod
    def forward(ctx, h, weight, targets, temperature, want_entropy):
        rows = max(1, CHUNK_ELEMENTS // weight.shape[0])
        logp = h.new_empty(h.shape[0], dtype=torch.float32)
        lse, entropy = torch.empty_like(logp), torch.empty_like(logp)
        for c in range(0, h.shape[0], rows):
            logits = (h[c:c + rows] @ weight.T).float() / temperature
            lse[c:c + rows] = total = torch.logsumexp(logits, -1)
            logp[c:c + rows] = logits.gather(-1, targets[c:c + rows, None]).squeeze(-1) - total
            if want_entropy:  # H = lse - sum_v p_v logit_v
                entropy[c:c + rows] = total - (torch.softmax(logits, -1) * logits).sum(-1)
        ctx.save_for_backward(h, weight, targets, lse)
        ctx.temperature, ctx.rows = temperature, rows
        ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad, _entropy_grad):
        h, weight, targets, lse = ctx.saved_tensors
        dh, dw = torch.zeros_like(h, dtype=torch.float32), torch.zeros_like(weight, dtype=torch.float32)
        for c in range(0, h.shape[0], ctx.rows):
            hc, g = h[c:c + ctx.rows], grad[c:c + ctx.rows]
            logits = (hc @ weight.T).float() / ctx.temperature
            dlogits = -torch.exp(logits - lse[c:c + ctx.rows, None]) * g[:, None]
            dlogits.scatter_add_(-1, targets[c:c + ctx.rows, None], g[:, None])
            dlogits = (dlogits / ctx.temperature).to(weight.dtype)
            dh[c:c + ctx.rows] = dlogits @ weight
            dw += dlogits.T.float() @ hc.float()
        return dh.to(h.dtype), dw.to(weight.dtype), None, None, None


def chunked_logprobs(h: torch.Tensor, lm_head: torch.nn.Module, targets: torch.Tensor, temperature: float = 1.0,
                     entropy: bool = False):
    """Logprobs of `targets` from hidden states h [T, hidden] (and the entropy at those rows, no gradient)."""
    if getattr(lm_head, "bias", None) is not None:
        raise NotImplementedError("chunked logprobs need an LM head without bias")
    logp, ent = _ChunkedLogprob.apply(h, lm_head.weight, targets, float(temperature), entropy)
    return (logp, ent) if entropy else logp


@dataclass
class _Range:
    start: int
    stop: int
    path: torch.Tensor  # global indices of the context (ancestors of `start`), ascending
    predict: torch.Tensor  # indices into the tree's trained tokens whose parent lies in this range
    needed: torch.Tensor  # local positions whose keys/values later ranges use as context


def plan_ranges(tree: PackedTree, max_tokens: int | None) -> list[_Range]:
    """Cut the tree into contiguous depth-first ranges of at most max_tokens tokens (None: one range)."""
    n = len(tree)
    cuts = [0]
    if max_tokens and n > max_tokens:
        heads = torch.nonzero(tree.parent != torch.arange(n) - 1).squeeze(-1).tolist()
        last = 0
        for b in heads[1:] + [n]:  # segment starts after 0, then the end
            if b - cuts[-1] > max_tokens:
                if last > cuts[-1]:
                    cuts.append(last)
                while b - cuts[-1] > max_tokens:
                    cuts.append(cuts[-1] + max_tokens)
            last = b
    cuts.append(n)
    targets = torch.nonzero(tree.trained).squeeze(-1)
    predictor = tree.parent[targets]
    paths = [torch.nonzero(tree.end[:a] > a).squeeze(-1) for a in cuts[:-1]]
    needed = torch.zeros(n, dtype=torch.bool)
    for path in paths[1:]:
        needed[path] = True
    return [_Range(a, b, path, torch.nonzero((predictor >= a) & (predictor < b)).squeeze(-1),
                   torch.nonzero(needed[a:b]).squeeze(-1))
            for a, b, path in zip(cuts, cuts[1:], paths)]


class _Cache:
    """Per layer: keys/values at the positions some later range needs as context, and their cotangents."""

    def __init__(self, tree: PackedTree, ranges: list[_Range]):
        positions = torch.cat([r.needed + r.start for r in ranges])
        self.slot = torch.full((len(tree),), -1, dtype=torch.long)
        self.slot[positions] = torch.arange(positions.numel())
        self.size = positions.numel()
        self.k: dict[int, torch.Tensor] = {}
        self.v: dict[int, torch.Tensor] = {}
        self.dk: dict[int, torch.Tensor] = {}
        self.dv: dict[int, torch.Tensor] = {}

    def store(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        if layer not in self.k:
            shape = (k.shape[0], k.shape[1], self.size, k.shape[3])
            self.k[layer], self.v[layer] = k.new_zeros(shape), v.new_zeros(shape)
        self.k[layer][:, :, slots.to(k.device)] = k.detach()
        self.v[layer][:, :, slots.to(k.device)] = v.detach()

    def _cotangent_buffers(self, layer: int):
        if layer not in self.dk:
            self.dk[layer] = torch.zeros_like(self.k[layer], dtype=torch.float32)
            self.dv[layer] = torch.zeros_like(self.v[layer], dtype=torch.float32)
        return self.dk[layer], self.dv[layer]

    def cotangents(self, layer: int, slots: torch.Tensor):
        dk, dv = self._cotangent_buffers(layer)
        s = slots.to(dk.device)
        return dk[:, :, s], dv[:, :, s]

    def add_cotangents(self, layer: int, slots: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor) -> None:
        bk, bv = self._cotangent_buffers(layer)
        s = slots.to(bk.device)
        bk[:, :, s] += dk.float()
        bv[:, :, s] += dv.float()


class _RangeKV:
    """What tree_attention asks of one range in one pass: its context per layer, and its own keys/values.
    Calls after the first per layer (gradient checkpointing re-runs layers in the backward) change nothing."""

    def __init__(self, cache: _Cache | None, r: _Range, grad: bool):
        self.cache, self.range, self.grad = cache, r, grad
        self.leaves: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.own_kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def context(self, layer: int):
        if self.cache is None or not self.range.path.numel():
            return None
        if layer not in self.leaves:
            slots = self.cache.slot[self.range.path].to(self.cache.k[layer].device)
            k, v = self.cache.k[layer][:, :, slots], self.cache.v[layer][:, :, slots]
            self.leaves[layer] = (k.requires_grad_(self.grad), v.requires_grad_(self.grad))
        return self.leaves[layer]

    def own(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        if self.cache is None or not self.range.needed.numel():
            return
        local = self.range.needed.to(k.device)
        picked = (k[:, :, local], v[:, :, local])  # also when re-run: a checkpoint re-run must record the same ops
        if layer in self.own_kv:
            return
        self.own_kv[layer] = picked
        if not self.grad:
            self.cache.store(layer, self.cache.slot[self.range.needed + self.range.start], *self.own_kv[layer])


def _run_range(model, tree: PackedTree, r: _Range, kv: _RangeKV | None, temperature: float, entropy: bool):
    """Forward of one range; logprobs (and entropy, or None) of the trained tokens it predicts."""
    device = next(model.parameters()).device
    hidden = _hidden(model, tree, r, kv)
    targets = torch.nonzero(tree.trained).squeeze(-1)[r.predict]
    rows = (tree.parent[targets] - r.start).to(device)
    out = chunked_logprobs(hidden[rows], model.get_output_embeddings(), tree.ids[targets].to(device), temperature,
                           entropy=entropy)
    return out if entropy else (out, None)


def tree_logprobs(model, tree: PackedTree, temperature: float = 1.0, entropy: bool = False,
                  max_tokens: int | None = None):
    """Logprob under `model` of every trained token of the tree, in tree order ([T]); with entropy=True also the
    policy's entropy there ([T], no gradient). With gradients enabled the tree runs as one range (use
    tree_backward to train in micro-batches); without, in ranges of max_tokens."""
    use_tree_attention(model)
    ranges = plan_ranges(tree, None if torch.is_grad_enabled() else max_tokens)
    cache = _Cache(tree, ranges) if len(ranges) > 1 else None
    logp, ent = _outputs(tree, next(model.parameters()).device)
    for r in ranges:
        if not r.predict.numel() and not r.needed.numel():
            continue
        lp, en = _run_range(model, tree, r, _RangeKV(cache, r, grad=False) if cache else None, temperature, entropy)
        if len(ranges) == 1:
            return (lp, en) if entropy else lp
        logp[r.predict.to(logp.device)] = lp
        if entropy:
            ent[r.predict.to(ent.device)] = en
    return (logp, ent) if entropy else logp


def tree_backward(model, tree: PackedTree, loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                  temperature: float = 1.0, max_tokens: int | None = None):
    """Back-propagate sum over ranges of loss_fn(logp, index) (index: positions of those logprobs among the
    tree's trained tokens, so loss_fn can pick their advantages); the loss must be a sum over tokens (a token
    mean over the whole step's trained tokens is). Returns the step's logprobs (detached) and entropy."""
    use_tree_attention(model)
    device = next(model.parameters()).device
    ranges = plan_ranges(tree, max_tokens)
    cache = _Cache(tree, ranges) if len(ranges) > 1 else None
    logp, ent = _outputs(tree, device)
    if cache is not None:
        with torch.no_grad():  # pass 1: the keys/values later ranges see as context
            for r in ranges[:-1]:
                if r.needed.numel():
                    _hidden(model, tree, r, _RangeKV(cache, r, grad=False))
    for r in reversed(ranges):  # pass 2
        if not r.predict.numel() and not r.needed.numel():
            continue
        kv = _RangeKV(cache, r, grad=True) if cache else None
        lp, en = _run_range(model, tree, r, kv, temperature, entropy=True)
        index = r.predict.to(device)
        logp[index], ent[index] = lp.detach(), en
        outputs, grads = [loss_fn(lp, index)] if lp.numel() else [], [None] if lp.numel() else []
        if kv is not None:
            for layer, (k, v) in kv.own_kv.items():  # cotangents from the ranges that used them as context
                dk, dv = cache.cotangents(layer, cache.slot[r.needed + r.start])
                outputs += [k, v]
                grads += [dk.to(k.dtype), dv.to(v.dtype)]
        if outputs:
            torch.autograd.backward(outputs, grads)
        if kv is not None:
            for layer, (k, v) in kv.leaves.items():  # the gradient at the context goes back to its producers
                if k.grad is not None:
                    cache.add_cotangents(layer, cache.slot[r.path], k.grad, v.grad)
    return logp, ent


def _hidden(model, tree: PackedTree, r: _Range, kv: _RangeKV | None) -> torch.Tensor:
    """The decoder's last hidden states [n, hidden] for range r; the tree attention's batch rides as the mask."""
    device = next(model.parameters()).device
    batch = TreeBatch(segments_of(tree.parent, r.start, r.stop, r.path), kv)
    with tree_forward_masks():
        return model.get_decoder()(input_ids=tree.ids[None, r.start:r.stop].to(device),
                                   position_ids=tree.depth[None, r.start:r.stop].to(device),
                                   tree_batch=batch, use_cache=False).last_hidden_state[0]


def _outputs(tree: PackedTree, device):
    t = int(tree.trained.sum())
    return torch.zeros(t, device=device), torch.zeros(t, device=device)
