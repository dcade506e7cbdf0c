"""A small DeepSeek-style decoder in plain torch, and its LightningModule.

Architecture (after DeepSeek-V2/V3, scaled down to about a million parameters):

* Multi-head latent attention (MLA): keys and values are reconstructed from a low-rank latent
  ``c_kv`` (``kv_lora_rank``) plus a small rotary key part shared by all heads.
* Mixture-of-experts feed-forward: ``n_shared_experts`` always-on experts plus ``n_routed_experts``
  SwiGLU experts of which each token uses the top ``n_activated_experts`` (normalized softmax gates; a per-expert
  ``e_score_correction_bias``, zero unless a balancing callback moves it, takes part in choosing the experts, never
  in weighing them: DeepSeek-V3's auxiliary-loss-free balancing). The routed experts are packed as transformers
  packs them (:class:`PackedExperts`), the form expert parallelism shards. The first ``n_dense_layers`` blocks use a
  dense SwiGLU feed-forward instead.
* Byte-level tokens (vocabulary 256), RMSNorm, rotary position embeddings.

Pipeline parallelism: the model is a sequence of blocks (embedding, decoder layers, norm, head), each taking
one tensor; :class:`DeepSeekMini` names them in ``pipeline_blocks()`` (the ``PipelineModule`` protocol), so
``HybridParallelStrategy(pipeline_parallel_size=...)`` can cut it into stages.

Tensor parallelism: :meth:`DeepSeekTransformer.tensor_parallel_plan` shards attention heads (query and latent
up-projections column-wise, output row-wise) and the dense and shared-expert feed-forwards (gate/up column-wise,
down row-wise); the router, norms, embeddings and routed experts stay replicated over tp (expert parallelism,
``expert_parallel_size``, shards the routed experts over data-parallel ranks instead). With sequence parallelism (the
strategy's default under tp) the norms and residual stream hold ``1/tp`` of the sequence and the head's logits stay
vocabulary-sharded. The strategy applies it (``parallelize()``): the module only says what to shard.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

from lightning_ciuic import PipelineModule
from lightning_ciuic.parallel.experts import group_limited_top_k
from lightning_ciuic.parallel.regather import ColwiseSavingShard, ReplicatedSavingShard
from lightning_ciuic.parallel.tensor import (
    gathered_input,
    gathered_input_scattered_output,
    scattered_output,
    sum_grad_over,
    vocabulary_sharded_head,
)


@dataclass
class DeepSeekConfig:
    vocab_size: int = 256
    dim: int = 128
    n_layers: int = 4
    n_heads: int = 4
    kv_lora_rank: int = 32
    qk_nope_head_dim: int = 16
    qk_rope_head_dim: int = 8
    v_head_dim: int = 16
    n_dense_layers: int = 1
    dense_inter_dim: int = 256
    n_routed_experts: int = 4
    n_shared_experts: int = 1
    n_activated_experts: int = 2
    n_expert_groups: int = 1  # DeepSeek-V3's n_group: with topk_expert_groups, each token's experts in its best groups
    topk_expert_groups: int = 1
    moe_inter_dim: int = 96
    max_seq_len: int = 256
    rope_theta: float = 10000.0


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotary_tables(head_dim: int, seq_len: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2).float() / head_dim))
    angles = torch.outer(torch.arange(seq_len).float(), freqs)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs of ``x`` (batch, seq, heads, dim) by the position angles."""
    x1, x2 = x[..., 0::2], x[..., 1::2]
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)


class MultiHeadLatentAttention(nn.Module):
    def __init__(self, cfg: DeepSeekConfig) -> None:
        super().__init__()
        self.nope, self.rope, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.kv_lora_rank = cfg.kv_lora_rank
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * (self.nope + self.rope), bias=False)
        self.wkv_a = nn.Linear(cfg.dim, cfg.kv_lora_rank + self.rope, bias=False)
        self.kv_norm = RMSNorm(cfg.kv_lora_rank)
        self.wkv_b = nn.Linear(cfg.kv_lora_rank, cfg.n_heads * (self.nope + self.v_dim), bias=False)
        self.wo = nn.Linear(cfg.n_heads * self.v_dim, cfg.dim, bias=False)
        self._rope = (cfg.qk_rope_head_dim, cfg.max_seq_len, cfg.rope_theta)
        cos, sin = rotary_tables(*self._rope)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.tp_mesh = None  # set when tensor parallelism is applied

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """The rotary tables (the linear layers reset themselves): a model built on the meta device needs them."""
        cos, sin = rotary_tables(*self._rope)
        self.rope_cos.copy_(cos)
        self.rope_sin.copy_(sin)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        cos, sin = self.rope_cos[:s], self.rope_sin[:s]
        q = self.wq(x).view(b, s, -1, self.nope + self.rope)  # local heads under tensor parallelism
        heads = q.size(2)
        q_nope, q_rope = q.split([self.nope, self.rope], dim=-1)
        latent, k_rope = self.wkv_a(x).split([self.kv_lora_rank, self.rope], dim=-1)
        kv = self.wkv_b(self.kv_norm(latent)).view(b, s, heads, self.nope + self.v_dim)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        k_rope = sum_grad_over(k_rope, self.tp_mesh)  # shared by this rank's heads only: sum its gradient
        k_rope = apply_rotary(k_rope.unsqueeze(2), cos, sin).expand(-1, -1, heads, -1)
        q = torch.cat([q_nope, apply_rotary(q_rope, cos, sin)], dim=-1)
        k = torch.cat([k_nope, k_rope], dim=-1)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class SwiGLU(nn.Module):
    def __init__(self, dim: int, inter_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, inter_dim, bias=False)
        self.w3 = nn.Linear(dim, inter_dim, bias=False)
        self.w2 = nn.Linear(inter_dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class PackedExperts(nn.Module):
    """A layer's routed SwiGLU experts as two 3-D parameters, ``gate_up_proj`` [E, 2I, H] (gate rows, then up rows)
    and ``down_proj`` [E, H, I], as transformers' mixture-of-experts models hold them; ``forward(x, top_k_index,
    top_k_weights)`` is each token's weighted sum of its experts' outputs."""

    def __init__(self, n_experts: int, dim: int, inter_dim: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(n_experts, 2 * inter_dim, dim))
        self.down_proj = nn.Parameter(torch.empty(n_experts, dim, inter_dim))
        self.act_fn = F.silu
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """As ``nn.Linear`` initialises each expert's projections: uniform in +-1/sqrt(fan_in)."""
        nn.init.uniform_(self.gate_up_proj, -self.gate_up_proj.shape[-1] ** -0.5, self.gate_up_proj.shape[-1] ** -0.5)
        nn.init.uniform_(self.down_proj, -self.down_proj.shape[-1] ** -0.5, self.down_proj.shape[-1] ** -0.5)

    def forward(self, x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        for index in range(self.gate_up_proj.shape[0]):
            token, slot = torch.where(top_k_index == index)
            gate, up = F.linear(x[token], self.gate_up_proj[index]).chunk(2, dim=-1)
            expert = F.linear(self.act_fn(gate) * up, self.down_proj[index])
            out = out.index_add(0, token, (expert * top_k_weights[token, slot, None]).to(out.dtype))  # autocast: bf16
        return out


class MixtureOfExperts(nn.Module):
    router_score_function = "softmax"  # how ``gate``'s logits become scores (for the sequence-wise balance loss)

    def __init__(self, cfg: DeepSeekConfig) -> None:
        super().__init__()
        self.top_k = cfg.n_activated_experts
        # DeepSeek-V3's group-limited routing (a node limit where each node holds whole groups): 1 group, plain top-k
        self.n_group, self.topk_group = cfg.n_expert_groups, cfg.topk_expert_groups
        self.gate = nn.Linear(cfg.dim, cfg.n_routed_experts, bias=False)
        self.register_buffer("e_score_correction_bias", torch.zeros(cfg.n_routed_experts))
        self.experts = PackedExperts(cfg.n_routed_experts, cfg.dim, cfg.moe_inter_dim)
        self.shared = SwiGLU(cfg.dim, cfg.n_shared_experts * cfg.moe_inter_dim)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        self.e_score_correction_bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        scores = self.gate(x).softmax(dim=-1)
        chosen = group_limited_top_k(scores + self.e_score_correction_bias, self.top_k, self.n_group, self.topk_group)  # the bias chooses only
        weights = scores.gather(1, chosen)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return (self.experts(x, chosen, weights) + self.shared(x)).view(shape)


class Block(nn.Module):
    def __init__(self, cfg: DeepSeekConfig, layer: int) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.dim)
        self.attn = MultiHeadLatentAttention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim)
        self.ffn = SwiGLU(cfg.dim, cfg.dense_inter_dim) if layer < cfg.n_dense_layers else MixtureOfExperts(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.ffn(self.ffn_norm(x))


class DeepSeekTransformer(nn.Module):
    def __init__(self, cfg: DeepSeekConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))

    def block_names(self) -> list[str]:
        """The blocks that, applied in order, are :meth:`forward`."""
        return ["embed", *(f"layers.{i}" for i in range(len(self.layers))), "norm", "head"]

    def tensor_parallel_plan(self, tp_mesh: DeviceMesh, sequence_parallel: bool = False) -> dict:
        """What to shard over ``tp_mesh``; the attention layers keep the mesh for their shared rotary key's gradient.

        With ``sequence_parallel`` the residual stream (embedding output, norms, residual adds) holds ``1/tp`` of the
        sequence: each attention and feed-forward gathers its input and scatters its output back, and the head's
        logits stay vocabulary-sharded (a DTensor: the loss is computed from the shards, docs/hybrid_parallel_strategy.md).
        A mixture-of-experts layer routes the gathered sequence, as without it."""
        tp, heads = tp_mesh.size(), self.cfg.n_heads
        if heads % tp:
            raise ValueError(
                f"tensor_parallel_size={tp} does not divide n_heads={heads}; use a tensor_parallel_size"
                f" among {[d for d in range(1, heads + 1) if heads % d == 0]}."
            )
        out = Shard(1) if sequence_parallel else Replicate()  # the residual stream's layout
        # a column-parallel linear reading the gathered sequence keeps the rank's part for its backward (Megatron's)
        column = ColwiseSavingShard if sequence_parallel else ColwiseParallel
        plan = {}
        for i, layer in enumerate(self.layers):
            layer.attn.tp_mesh = tp_mesh
            prefix = f"layers.{i}"
            plan[f"{prefix}.attn.wq"] = column()
            plan[f"{prefix}.attn.wkv_b"] = ColwiseParallel()
            plan[f"{prefix}.attn.wo"] = RowwiseParallel(output_layouts=out)
            dense = isinstance(layer.ffn, SwiGLU)
            mlp = f"{prefix}.ffn" if dense else f"{prefix}.ffn.shared"
            plan[f"{mlp}.w1"] = column()
            plan[f"{mlp}.w3"] = column()
            plan[f"{mlp}.w2"] = RowwiseParallel(output_layouts=out if dense else Replicate())
            if sequence_parallel:
                plan[f"{prefix}.attn_norm"] = SequenceParallel()
                plan[f"{prefix}.attn"] = gathered_input()
                plan[f"{prefix}.attn.wkv_a"] = ReplicatedSavingShard()  # replicated, reading the gathered sequence too
                plan[f"{prefix}.ffn_norm"] = SequenceParallel()
                plan[f"{prefix}.ffn"] = gathered_input() if dense else gathered_input_scattered_output()
        if sequence_parallel:
            plan["embed"] = scattered_output()
            plan["norm"] = SequenceParallel()
            plan["head"] = vocabulary_sharded_head()
        return plan


class DeepSeekMini(PipelineModule, LightningModule):
    """Next-byte language modelling with :class:`DeepSeekTransformer`; works with any strategy.

    Under ``HybridParallelStrategy(tensor_parallel_size>1)`` the strategy shards it by ``tensor_parallel_plan``; under
    ``pipeline_parallel_size>1`` the strategy cuts it into stages through ``pipeline_blocks()``.
    """

    def __init__(
        self,
        dim: int = 128,
        n_layers: int = 4,
        n_heads: int = 4,
        kv_lora_rank: int = 32,
        n_routed_experts: int = 4,
        n_shared_experts: int = 1,
        n_activated_experts: int = 2,
        moe_inter_dim: int = 96,
        n_expert_groups: int = 1,
        topk_expert_groups: int = 1,
        dense_inter_dim: int = 256,
        n_dense_layers: int = 1,
        max_seq_len: int = 256,
        lr: float = 3e-3,
        weight_decay: float = 0.1,
        v_head_dim: int = 16,
        qk_rope_head_dim: int = 8,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.config = DeepSeekConfig(
            dim=dim, n_layers=n_layers, n_heads=n_heads, kv_lora_rank=kv_lora_rank,
            n_routed_experts=n_routed_experts, n_shared_experts=n_shared_experts,
            n_activated_experts=n_activated_experts, moe_inter_dim=moe_inter_dim, n_expert_groups=n_expert_groups,
            topk_expert_groups=topk_expert_groups,
            dense_inter_dim=dense_inter_dim, n_dense_layers=n_dense_layers, max_seq_len=max_seq_len,
            v_head_dim=v_head_dim, qk_rope_head_dim=qk_rope_head_dim,
        )
        self.model = DeepSeekTransformer(self.config)
        self._last_step_time: float | None = None

    def tensor_parallel_plan(self, tp_mesh: DeviceMesh, sequence_parallel: bool = False) -> dict:
        """The transformer's plan, named from this module (what ``parallelize()`` applies)."""
        plan = self.model.tensor_parallel_plan(tp_mesh, sequence_parallel)
        return {f"model.{name}": style for name, style in plan.items()}

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model(tokens)

    def pipeline_blocks(self) -> list[str]:
        return [f"model.{name}" for name in self.model.block_names()]

    def pipeline_loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self.pipelined_loss(batch)
        self.log("train/loss", loss, prog_bar=True)
        now = time.perf_counter()
        if self._last_step_time is not None:
            replicas = (getattr(self.trainer.strategy, "distributed_sampler_kwargs", None) or {}).get("num_replicas", 1)
            tokens = batch[0].numel() * replicas
            self.log("train/tokens_per_sec", tokens / (now - self._last_step_time), prog_bar=True)
        self._last_step_time = now
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self.log("val/loss", self.pipelined_loss(batch), prog_bar=True, sync_dist=True)

    def predict_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        """Next-byte predictions for the batch's inputs."""
        return self.pipelined_forward(self.pipeline_inputs(batch)[0]).argmax(dim=-1)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(
            self.parameters(), lr=self.hparams.lr, weight_decay=self.hparams.weight_decay, betas=(0.9, 0.95)
        )
