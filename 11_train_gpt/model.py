"""A small decoder-only transformer (GPT) in plain torch: what lesson 11 trains.

Replace it with your own model: train_gpt.py needs only `make_model()` to return an nn.Module whose
forward maps a batch of inputs to logits, and (for FSDP) a list of blocks to shard one by one, and
(for --tp) a method `tensor_parallel(tp_mesh)`, the plan that splits the blocks (and, if it has
`n_head`, train_gpt.py checks that --tp divides it).
"""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                               parallelize_module)

# What train_gpt.py --model names: (the GPT's shape, context, learning rate). gpt2-124m is GPT-2
# small: 124M parameters with GPT-2's vocabulary, 50,257 padded to 50,304 (a multiple of 64, for
# fast matmuls) as nanoGPT does; bytes use the first 256 rows, the rest learn never to be chosen.
SIZES = {"tiny": (dict(n_layer=2, n_head=4, n_embd=64, vocab_size=256), 64, 3e-3),
         "gpt2-124m": (dict(n_layer=12, n_head=12, n_embd=768, vocab_size=50304), 1024, 6e-4)}


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd, n_head, dropout):
        super().__init__()
        assert n_embd % n_head == 0, "n_embd must split evenly into heads"
        self.head_size, self.dropout = n_embd // n_head, dropout
        # q, k and v apart, not one fused layer: tensor parallelism splits each by whole heads
        self.q, self.k, self.v = (nn.Linear(n_embd, n_embd) for _ in range(3))
        self.proj = nn.Linear(n_embd, n_embd)
        self.drop = nn.Dropout(dropout)

    def forward(self, x):  # -1 heads, not n_head: under tensor parallelism a rank has n_head / tp
        q, k, v = (f(x).unflatten(2, (-1, self.head_size)).transpose(1, 2)
                   for f in (self.q, self.k, self.v))
        # is_causal: position t attends to positions <= t only, so the model cannot read its target
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0)
        return self.drop(self.proj(y.transpose(1, 2).flatten(2)))


class Block(nn.Module):
    """Pre-norm: x + attention(norm(x)), then x + mlp(norm(x)); FSDP shards one block at a time."""

    def __init__(self, n_embd, n_head, dropout):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(n_embd), nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head, dropout)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(),
                                 nn.Linear(4 * n_embd, n_embd), nn.Dropout(dropout))

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class GPT(nn.Module):
    def __init__(self, vocab_size=256, context=64, n_layer=2, n_head=2, n_embd=64, dropout=0.0):
        super().__init__()
        self.context, self.n_head = context, n_head
        self.token = nn.Embedding(vocab_size, n_embd)
        self.position = nn.Embedding(context, n_embd)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(n_embd, n_head, dropout) for _ in range(n_layer))
        self.norm = nn.LayerNorm(n_embd)
        self.head = nn.Linear(n_embd, vocab_size, bias=False)
        # Tied: the output layer reuses the input embedding (fewer parameters, as GPT-2). Both live
        # in the root module, so under FSDP one unit (the root) owns the one shared tensor.
        self.head.weight = self.token.weight
        for module in self.modules():  # GPT-2's initialization: normal(0, 0.02), zero biases
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)
        for name, p in self.named_parameters():  # what adds into the residual stream: smaller,
            if name.endswith(("attn.proj.weight", "mlp.2.weight")):  # so its variance stays put
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))

    def forward(self, idx):
        """(batch, time) token ids -> (batch, time, vocab) logits of the NEXT token at each place"""
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.drop(self.token(idx) + self.position(positions))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))

    def flops_per_token(self):
        """Training FLOPs per token, forward and backward, as the PaLM paper's appendix B counts
        them: 6 per parameter that multiplies (all but the position embedding; the tied embedding
        once, as the head), plus 12 x layers x width x context for attention's two matmuls (a
        causal mask skips half of those: counted all the same, as PaLM and FlopCounterMode do)."""
        weights = sum(p.numel() for p in self.parameters()) - self.position.weight.numel()
        return 6 * weights + 12 * len(self.blocks) * self.token.weight.shape[1] * self.context

    def tensor_parallel(self, tp_mesh):
        """Lesson 10's plan, for train_gpt.py --tp: in each block, q, k, v and the MLP's first layer
        split by output columns (whole heads), the layers after them by input rows (their partial
        sums all-reduced); the embeddings, norms and head stay whole on every rank of tp_mesh."""
        for block in self.blocks:
            parallelize_module(block, tp_mesh, {
                # q, k and v read one input: made a DTensor once, one all-reduce in backward
                "attn": PrepareModuleInput(input_layouts=Replicate(),
                                           desired_input_layouts=Replicate()),
                "attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(),
                "attn.v": ColwiseParallel(), "attn.proj": RowwiseParallel(),
                "mlp.0": ColwiseParallel(), "mlp.2": RowwiseParallel()})

    @torch.no_grad()
    def generate(self, idx, new_tokens, temperature=1.0, top_k=None, generator=None):
        """Appends `new_tokens` sampled tokens to idx (batch, time). Sampling draws from its own
        `generator`, never the global RNG, which a resumed run restores for dropout."""
        for _ in range(new_tokens):
            logits = self(idx[:, -self.context:])[:, -1, :] / temperature
            if top_k is not None:
                kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
                logits = logits.masked_fill(logits < kth, -float("inf"))
            next_token = torch.multinomial(F.softmax(logits, dim=-1), 1, generator=generator)
            idx = torch.cat([idx, next_token], dim=1)
        return idx


def unigram_entropy(dataset):
    """The loss (nats per token) of a model that ignores the context: learning beats it."""
    counts = torch.bincount(dataset.tokens.long(), minlength=256).double()
    p = counts[counts > 0] / counts.sum()
    return -(p * p.log()).sum().item()


def sample(model, prompt=b"def ", new_tokens=200, seed=0):
    """A few bytes the trained model writes after `prompt` (its own generator: no global RNG)."""
    idx = torch.tensor([list(prompt)], device=next(model.parameters()).device)
    generator = torch.Generator(idx.device).manual_seed(seed)  # on cuda, a cuda generator
    out = model.generate(idx, new_tokens, top_k=50, generator=generator)
    return bytes(out[0].tolist()).decode("utf-8", errors="replace")
