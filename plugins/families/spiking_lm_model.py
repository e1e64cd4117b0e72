"""The modules of the ``spiking_lm`` family (imported when a model is built or split).

Token ids ``[N, T, S]`` (each sample's S tokens repeated over its T time steps) -> logits ``[T, N, S, V]``;
inside, the residual stream is time-major ``[T, N, S, H]``. Spiking neurons (SpikingJelly's multi-step LIF) turn
the normalized stream into spikes before each projection: q, k and v are spikes, and the MLP's hidden layer
spikes. Every operation acts on one (time step, sample) alone or along time in a neuron, so the time steps can
be split across ranks.

Mixture-of-experts layers (:class:`MoEMLP`) return a load-balancing loss per time step in training. The stream
carries it from layer to layer in one extra sequence row (``[T, N, S + 1, H]``, the sum at ``[..., S, 0]``) and the
head hands it on as a row of the logits (``[T, N, S + 1, V]``), where the ``next_token`` loss reads and adds it:
the one tensor every pipeline stage and time split already passes on, so the loss is exact under every strategy.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

AUX_ROW = 1  # the stream's extra sequence row carrying the auxiliary loss, present in training with MoE layers


PROJECTED_THRESHOLD = 0.15  # of the neurons after a projection of spikes, whose currents are small at initialization


def lif(threshold: float = 1.0) -> nn.Module:
    from spikingjelly.activation_based import neuron, surrogate

    return neuron.LIFNode(tau=2.0, v_threshold=threshold, detach_reset=True, surrogate_function=surrogate.ATan(),
                          step_mode="m")


def split_carrier(stream: torch.Tensor, carried: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``stream`` ``[T, N, S (+1), H]`` as its tokens and, where ``carried``, the auxiliary loss row."""
    if not carried:
        return stream, None
    return stream[:, :, :-AUX_ROW], stream[:, :, -AUX_ROW:]


class TokenEmbedding(nn.Module):
    """Token ids ``[N, T, S]`` -> the stream ``[T, N, S, H]`` (token and learned position embeddings); in training
    with MoE layers, a zero auxiliary loss row appended. Ids given as floating-point frames (the core's probe
    batches) are read as ids. ``first_position``: the position of the first id it is given (a sequence split's
    rank's)."""

    def __init__(self, vocab: int, hidden: int, sequence_length: int, carries_aux: bool):
        super().__init__()
        self.tokens, self.positions = nn.Embedding(vocab, hidden), nn.Embedding(sequence_length, hidden)
        self.carries_aux, self.first_position = carries_aux, 0
        nn.init.normal_(self.tokens.weight, std=0.02)
        nn.init.normal_(self.positions.weight, std=0.02)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        ids = ids.transpose(0, 1).long()
        steps, samples, length = ids.shape
        first = self.first_position
        if first + length > self.positions.num_embeddings:
            raise ValueError(f"a sequence of {first + length} tokens is longer than the model's "
                             f"{self.positions.num_embeddings}")
        stream = self.tokens(ids) + self.positions.weight[first:first + length]
        if self.carries_aux and self.training:
            stream = torch.cat([stream, stream.new_zeros(steps, samples, AUX_ROW, stream.shape[-1])], dim=2)
        return stream


class CausalSelfAttention(nn.Module):
    """Spiking causal self-attention over ``[T, N, S, H]``: the normalized input spikes, q, k and v are spikes of
    their projections, each position attends to itself and the positions before it (Spikformer's softmax-free
    ``q k^T v``, averaged over the positions seen), and the heads' outputs are projected back.

    ``keys_values`` computes k and v of the input spikes, the place a sequence split across ranks extends: it may
    return the keys and values of positions before the queries' too, the queries then being the last positions."""

    def __init__(self, hidden: int, heads: int):
        super().__init__()
        if hidden % heads:
            raise ValueError(f"hidden size {hidden} is not divisible by {heads} heads")
        self.num_heads, self.head_dim = heads, hidden // heads
        self.norm = nn.LayerNorm(hidden)
        self.input_lif = lif()
        self.q, self.k, self.v = (nn.Linear(hidden, hidden, bias=False) for _ in range(3))
        self.q_lif, self.k_lif, self.v_lif = (lif(PROJECTED_THRESHOLD) for _ in range(3))
        self.proj = nn.Linear(hidden, hidden)

    def heads(self, x: torch.Tensor) -> torch.Tensor:
        """``[T, N, S, heads * d]`` -> ``[T, N, heads, S, d]``."""
        steps, samples, length, _ = x.shape
        return x.view(steps, samples, length, self.num_heads, self.head_dim).transpose(2, 3)

    def keys_values(self, spikes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.heads(self.k_lif(self.k(spikes))), self.heads(self.v_lif(self.v(spikes)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        spikes = self.input_lif(self.norm(x))
        q = self.heads(self.q_lif(self.q(spikes)))
        k, v = self.keys_values(spikes)
        length, before = q.shape[-2], k.shape[-2] - q.shape[-2]  # keys of positions before the queries' first
        causal = torch.ones(length, before + length, dtype=torch.bool, device=x.device).tril(before)
        scores = (q @ k.transpose(-2, -1)).masked_fill(~causal, 0.0)
        seen = torch.arange(before + 1, before + length + 1, device=x.device, dtype=x.dtype).unsqueeze(-1)
        mixed = (scores @ v) / seen  # [T, N, heads, S, d]
        return self.proj(mixed.transpose(2, 3).flatten(3))


class SpikingMLP(nn.Module):
    """``[T, N, S, H]``: normalized, spikes, ``fc1``, spikes (``hidden_lif``), ``fc2``."""

    def __init__(self, hidden: int, inner: int):
        super().__init__()
        self.norm, self.input_lif = nn.LayerNorm(hidden), lif()
        self.fc1, self.hidden_lif, self.fc2 = nn.Linear(hidden, inner), lif(PROJECTED_THRESHOLD), nn.Linear(inner, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.hidden_lif(self.fc1(self.input_lif(self.norm(x)))))


class Expert(nn.Module):
    """One expert of a :class:`MoEMLP`: ``fc1``, spikes, ``fc2`` on the tokens routed to it.

    Its neurons keep a state for every (token, sample) of the stream: a token not routed to the expert at a time
    step feeds it no current, so its membrane only leaks."""

    def __init__(self, hidden: int, inner: int):
        super().__init__()
        self.fc1, self.lif, self.fc2 = nn.Linear(hidden, inner), lif(PROJECTED_THRESHOLD), nn.Linear(inner, hidden)

    def forward(self, x: torch.Tensor, rows: torch.Tensor, steps: int, tokens: int) -> torch.Tensor:
        """``x`` ``[rows, H]``: the routed rows of the flattened ``[T x tokens, H]`` stream, ``rows`` their
        positions in it."""
        current = self.fc1(x)
        inner = current.shape[-1]
        dense = current.new_zeros(steps * tokens, inner).index_copy(0, rows, current)
        spikes = self.lif(dense.view(steps, tokens, inner)).view(-1, inner).index_select(0, rows)
        return self.fc2(spikes)


class MoEMLP(nn.Module):
    """A dropless mixture of spiking experts over ``[T, N, S, H]``: the normalized input spikes, ``router`` scores
    each (time step, token) on ``experts`` and sends it to its ``top_k``, whose outputs are summed weighted by the
    renormalized router probabilities. Every routed token is computed (no capacity, nothing dropped); tokens are
    gathered per expert in position order, so the result is deterministic.

    In training ``forward`` also returns the load-balancing loss of each time step ``[T]`` (Switch Transformer's
    ``experts x sum_e f_e P_e`` over that step's tokens, ``f_e`` the share of routed slots expert ``e`` takes and
    ``P_e`` its mean probability), times ``aux_weight``; None in evaluation."""

    def __init__(self, hidden: int, inner: int, experts: int, top_k: int, aux_weight: float):
        super().__init__()
        if not 1 <= top_k <= experts:
            raise ValueError(f"top_k = {top_k} must be between 1 and the {experts} experts")
        self.top_k, self.aux_weight = top_k, aux_weight
        self.norm, self.input_lif = nn.LayerNorm(hidden), lif()
        self.router = nn.Linear(hidden, experts, bias=False)
        self.experts = nn.ModuleList(Expert(hidden, inner) for _ in range(experts))

    def route(self, spikes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Router probabilities ``[M, E]``, the top-k experts ``[M, k]`` and their weights ``[M, k]`` of the
        flattened spikes ``[M, H]``."""
        probs = self.router(spikes).softmax(-1)
        weights, chosen = probs.topk(self.top_k, dim=-1)
        return probs, chosen, weights / weights.sum(-1, keepdim=True)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        steps, samples, length, hidden = x.shape
        spikes = self.input_lif(self.norm(x)).reshape(-1, hidden)
        probs, chosen, weights = self.route(spikes)
        out = self.mix(spikes, chosen, weights, steps)
        aux = self.balance_loss(probs, chosen, steps) if self.training else None
        return out.view(steps, samples, length, hidden), aux

    def mix(self, spikes: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor, steps: int) -> torch.Tensor:
        """The experts' outputs on the flattened spikes ``[T x tokens, H]``, each weighted and added in expert order
        (expert parallelism replaces this step with its dispatch and combine)."""
        out = torch.zeros_like(spikes)
        for index, expert in enumerate(self.experts):
            hit = chosen == index  # [M, k]
            rows = hit.any(-1).nonzero().squeeze(-1)
            y = expert(spikes.index_select(0, rows), rows, steps, spikes.shape[0] // steps)
            out = out.index_add(0, rows, y * (weights * hit).sum(-1).index_select(0, rows).unsqueeze(-1))
        return out

    def token_means(self, values: torch.Tensor) -> torch.Tensor:
        """The mean of ``values`` ``[T, tokens, C]`` over each step's tokens ``[T, C]``: the place a sequence split
        across ranks extends to the mean over every rank's tokens."""
        return values.mean(1)

    def balance_loss(self, probs: torch.Tensor, chosen: torch.Tensor, steps: int) -> torch.Tensor:
        experts = probs.shape[-1]
        taken = F.one_hot(chosen, experts).sum(1).to(probs.dtype).view(steps, -1, experts)  # [T, tokens, E]
        share, mean_prob = self.token_means(torch.cat([taken / self.top_k, probs.view(steps, -1, experts)], -1)
                                            ).split(experts, -1)
        return self.aux_weight * experts * (share * mean_prob).sum(-1)


class Block(nn.Module):
    """A pre-norm transformer block: ``x + attn(x)``, then ``x + mlp(x)``; a MoE layer's loss added to the
    carried row."""

    def __init__(self, hidden: int, heads: int, inner: int, experts: int, top_k: int, aux_weight: float,
                 carries_aux: bool):
        super().__init__()
        self.attn = CausalSelfAttention(hidden, heads)
        self.mlp = MoEMLP(hidden, inner, experts, top_k, aux_weight) if experts else SpikingMLP(hidden, inner)
        self.carries_aux = carries_aux

    def forward(self, stream: torch.Tensor) -> torch.Tensor:
        x, row = split_carrier(stream, self.carries_aux and self.training)
        x = x + self.attn(x)
        if isinstance(self.mlp, MoEMLP):
            y, aux = self.mlp(x)
            if row is not None:
                row = row + F.pad(aux.view(-1, 1, 1, 1).expand(-1, row.shape[1], 1, 1), (0, row.shape[-1] - 1))
        else:
            y = self.mlp(x)
        x = x + y
        return x if row is None else torch.cat([x, row], dim=2)


class LMHead(nn.Module):
    """The stream -> logits ``[T, N, S, V]`` (a final LayerNorm and a Linear); the carried auxiliary loss row
    appended as row ``S`` (the loss at column 0)."""

    def __init__(self, hidden: int, vocab: int, carries_aux: bool):
        super().__init__()
        self.norm, self.out = nn.LayerNorm(hidden), nn.Linear(hidden, vocab, bias=False)
        self.carries_aux = carries_aux

    def forward(self, stream: torch.Tensor) -> torch.Tensor:
        x, row = split_carrier(stream, self.carries_aux and self.training)
        logits = self.out(self.norm(x))
        if row is None:
            return logits
        return torch.cat([logits, F.pad(row[..., :1], (0, logits.shape[-1] - 1))], dim=2)


class SpikingLM(nn.Module):
    """A decoder-only spiking transformer: ``embed``, ``layers`` (MoE MLPs at ``moe_layers``), ``head``."""

    def __init__(self, vocab: int, hidden: int, layers: int, heads: int, mlp_ratio: float, sequence_length: int,
                 moe_layers: tuple[int, ...] = (), experts: int = 0, top_k: int = 2, aux_weight: float = 0.01):
        super().__init__()
        from spikingjelly.activation_based import functional

        carries = bool(moe_layers)
        inner = int(hidden * mlp_ratio)
        self.sequence_length = sequence_length
        self.embed = TokenEmbedding(vocab, hidden, sequence_length, carries)
        self.layers = nn.Sequential(*(
            Block(hidden, heads, inner, experts if i in moe_layers else 0, top_k, aux_weight, carries)
            for i in range(layers)))
        self.head = LMHead(hidden, vocab, carries)
        functional.set_step_mode(self, "m")

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.layers(self.embed(ids)))
