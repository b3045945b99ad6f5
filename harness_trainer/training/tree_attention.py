"""Tree attention in linear memory: every token of the packed prefix tree attends to exactly its ancestors.

In depth-first order a node's subtree is the index range [j, end[j]), so key j is visible from query i iff

    j <= i < end[j]

A *segment* is a run of tokens each the child of the one before it (one stretch of a chain between forks).
Every query of a segment sees the same keys apart from the segment itself, which it sees causally, so one
micro-batch's attention is, per segment, a few blocks:

    its context: the ancestors before the micro-batch (a prefix of the cached path)      all visible
    its ancestor segments inside the micro-batch (slices of the micro-batch's keys)      all visible
    itself                                                                               causal

each one call of the fused kernel (CPU: flash; CUDA: memory-efficient), merged by their log-sum-exps:

    lse = logaddexp(lse_1, lse_2)        out = exp(lse_1 - lse) out_1 + exp(lse_2 - lse) out_2

The backward calls each block's kernel backward with the MERGED out and lse: the kernel recomputes that
block's exact share of the softmax, dQ sums over blocks and dK, dV land in each block's keys (the identity
ring attention uses). No N x N tensor exists: the kernels never materialise scores, and autograd keeps only
q, k, v, the output and the log-sum-exp. Exact to float rounding against one causal row per chain.
"""

from __future__ import annotations

import bisect
import contextlib
import contextvars
from dataclasses import dataclass, field

import torch

NAME = "tree"


@dataclass
class Block:
    source: str  # "context" (the cached ancestors before the micro-batch) or "own" (the micro-batch's keys)
    start: int
    stop: int
    causal: bool = False


@dataclass
class Segment:
    start: int  # local query indices [start, stop) in the micro-batch
    stop: int
    blocks: list[Block]


@dataclass
class TreeBatch:
    """What the attention of one micro-batch needs: passed through the model as its attention mask."""
    segments: list[Segment]
    kv: object = None  # per layer: context(layer) -> (k, v) | None, own(layer, k, v) (tree_forward._RangeKV)
    calls: dict = field(default_factory=dict)


def segments_of(parent: torch.Tensor, start: int, stop: int, path: torch.Tensor) -> list[Segment]:
    """The segments of tokens [start, stop) of a tree (global parent indices) and the blocks each attends to;
    `path` holds the global indices of the ancestors of `start` (ascending): the micro-batch's context."""
    n, par = stop - start, [p - start for p in parent[start:stop].tolist()]  # local; < 0: before the batch
    bounds = [i for i in range(n) if i == 0 or par[i] != i - 1] + [n]
    head_of = [0] * n
    for h, e in zip(bounds, bounds[1:]):
        head_of[h:e] = [h] * (e - h)
    path = path.tolist()
    out = []
    for h, e in zip(bounds, bounds[1:]):
        own, p = [], par[h]
        while p >= 0:  # up through the ancestor segments inside the micro-batch
            own.append((head_of[p], p + 1))
            p = par[head_of[p]]
        blocks = []
        if p + start >= 0:  # the nearest ancestor before the batch: the context up to it is visible
            blocks.append(Block("context", 0, bisect.bisect_right(path, p + start)))
        for s, t in reversed(own):
            if blocks and blocks[-1].source == "own" and blocks[-1].stop == s:
                blocks[-1].stop = t  # contiguous ancestors: one kernel call
            else:
                blocks.append(Block("own", s, t))
        blocks.append(Block("own", h, e, causal=True))
        out.append(Segment(h, e, blocks))
    return out


# ---- the fused kernels, with their log-sum-exp -------------------------------------------------------------

def _kernel_forward(q, k, v, causal: bool, scale: float):
    if q.device.type == "cuda":
        out, lse, seed, offset = torch.ops.aten._scaled_dot_product_efficient_attention(
            q, k, v, None, True, 0.0, causal, scale=scale)
        return out, lse[..., :q.shape[2]].float(), (lse.shape, seed, offset)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
    return out, lse, None


def _kernel_backward(g, q, k, v, out, lse, extra, causal: bool, scale: float):
    if q.device.type == "cuda":
        shape, seed, offset = extra
        full = lse.new_zeros(shape)
        full[..., :lse.shape[-1]] = lse
        dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
            g, q, k, v, None, out, full, seed, offset, 0.0, [True, True, True, False], causal, scale=scale)
        return dq, dk, dv
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        g, q, k, v, out, lse, 0.0, causal, scale=scale)


def _expand(x: torch.Tensor, rep: int) -> torch.Tensor:  # grouped-query attention: kv head h serves rep heads
    return x.repeat_interleave(rep, dim=1) if rep > 1 else x


def _reduce(dx: torch.Tensor, rep: int) -> torch.Tensor:
    return dx.unflatten(1, (-1, rep)).sum(2) if rep > 1 else dx


class _TreeAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, k_ctx, v_ctx, segments, scale):
        rep = q.shape[1] // k.shape[1]
        keys = {"own": (k, v), "context": (k_ctx, v_ctx)}
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
        lse = q.new_empty(q.shape[:3], dtype=torch.float32)
        extras = []
        for seg in segments:
            qs = q[:, :, seg.start:seg.stop].contiguous()
            acc, total, seg_extras = None, None, []
            for block in seg.blocks:
                kb, vb = (t[:, :, block.start:block.stop] for t in keys[block.source])
                o, block_lse, extra = _kernel_forward(qs, _expand(kb, rep).contiguous(), _expand(vb, rep).contiguous(),
                                                      block.causal, scale)
                seg_extras.append(extra)
                o = o.float()
                if acc is None:
                    acc, total = o, block_lse
                else:
                    merged = torch.logaddexp(total, block_lse)
                    acc = acc * torch.exp(total - merged)[..., None] + o * torch.exp(block_lse - merged)[..., None]
                    total = merged
            out[:, :, seg.start:seg.stop] = acc.to(q.dtype)
            lse[:, :, seg.start:seg.stop] = total
            extras.append(seg_extras)
        ctx.save_for_backward(q, k, v, k_ctx, v_ctx, out, lse)
        ctx.segments, ctx.scale, ctx.extras = segments, scale, extras
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, k_ctx, v_ctx, out, lse = ctx.saved_tensors
        rep = q.shape[1] // k.shape[1]
        keys = {"own": (k, v), "context": (k_ctx, v_ctx)}
        dq = torch.zeros_like(q, dtype=torch.float32)
        dkv = {"own": (torch.zeros_like(k, dtype=torch.float32), torch.zeros_like(v, dtype=torch.float32)),
               "context": (torch.zeros_like(k_ctx, dtype=torch.float32),
                           torch.zeros_like(v_ctx, dtype=torch.float32))}
        for seg, seg_extras in zip(ctx.segments, ctx.extras):
            sl = slice(seg.start, seg.stop)
            gs, qs = grad[:, :, sl].contiguous(), q[:, :, sl].contiguous()
            os_, ls = out[:, :, sl].contiguous(), lse[:, :, sl].contiguous()
            for block, extra in zip(seg.blocks, seg_extras):
                kb, vb = (t[:, :, block.start:block.stop] for t in keys[block.source])
                dqb, dkb, dvb = _kernel_backward(gs, qs, _expand(kb, rep).contiguous(), _expand(vb, rep).contiguous(),
                                                 os_, ls, extra, block.causal, ctx.scale)
                dq[:, :, sl] += dqb.float()
                dk, dv = dkv[block.source]
                dk[:, :, block.start:block.stop] += _reduce(dkb.float(), rep)
                dv[:, :, block.start:block.stop] += _reduce(dvb.float(), rep)
        return (dq.to(q.dtype), dkv["own"][0].to(k.dtype), dkv["own"][1].to(v.dtype),
                dkv["context"][0].to(k_ctx.dtype), dkv["context"][1].to(v_ctx.dtype), None, None)


# The batch rides to every layer in the forward's keyword arguments (`tree_batch=`), which every architecture
# passes down to its attention; not as the attention mask, which Llama-family models hand to create_causal_mask,
# which cannot read it. During a tree forward no mask is built at all (the depths as position ids would otherwise
# read as packed sequences and cost a dense n x n mask).
_TREE_FORWARD = contextvars.ContextVar("tree_forward", default=False)


@contextlib.contextmanager
def tree_forward_masks():
    """Inside: the model's mask builder returns no mask (the tree batch is the mask)."""
    token = _TREE_FORWARD.set(True)
    try:
        yield
    finally:
        _TREE_FORWARD.reset(token)


def _mask(*args, **kwargs):
    from transformers.masking_utils import sdpa_mask

    return None if _TREE_FORWARD.get() else sdpa_mask(*args, **kwargs)


def tree_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, tree_batch=None, **kwargs):
    """transformers' attention interface: query [1, H, n, D], key/value [1, Hkv, n, D] (after RoPE);
    returns [1, n, H, D]. Without a tree batch (a plain forward of the same model) it is sdpa."""
    if tree_batch is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                      **kwargs)
    if getattr(module, "sliding_window", None):
        raise NotImplementedError("tree attention with a sliding window is not built: this model's layers use one")
    if dropout and module.training:
        raise NotImplementedError("tree attention has no attention dropout: set the model's attention_dropout to 0")
    batch, layer = tree_batch, module.layer_idx
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    if batch.kv is not None:
        batch.kv.own(layer, key, value)
        context = batch.kv.context(layer)
    else:
        context = None
    if context is None:
        empty = key[:, :, :0]
        context = (empty, value[:, :, :0])
    out = _TreeAttention.apply(query, key, value, context[0], context[1], batch.segments, scale)
    return out.transpose(1, 2).contiguous(), None


def use_tree_attention(model) -> None:
    """Route the model's attention through tree_attention (a plain forward still runs sdpa)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    if NAME not in AttentionInterface._global_mapping:
        AttentionInterface.register(NAME, tree_attention)
        ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, _mask)
    model.config._attn_implementation = NAME
    for sub in model.modules():  # nested configs (a wrapped or multi-part model) follow the top one
        config = getattr(sub, "config", None)
        if config is not None and config is not model.config:
            config._attn_implementation = NAME
