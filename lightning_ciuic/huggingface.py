"""Hugging Face causal language models (Llama, Qwen2, DeepSeek-V3 families, ...) as pipeline-ready LightningModules.

Contract: ``HuggingFaceCausalLM(model_type, config)`` builds ``AutoModelForCausalLM.from_config`` from a
config given as a dictionary (no download; weights start random) with SDPA attention, and trains it on
``(input_ids, next-token targets)`` batches with cross-entropy. ``HuggingFaceCausalLM.from_pretrained(path,
**kwargs)`` (or ``pretrained=path``) takes the model type and config from a local directory in Hugging Face layout
and its weights from the directory's safetensors: they are read at the start of ``fit``, once the strategy has laid
the model out, so each rank reads only the slices it holds (see
:func:`~lightning_ciuic.checkpoint.huggingface.load_weights`); a run resumed from a checkpoint keeps the
checkpoint's weights. Under :class:`HybridParallelStrategy` it needs no code of its own:

* pipeline stages come from the model's ``_pp_plan`` (embedding, each decoder layer, final norm, LM head);
  decoder layers are run with the rotary position embeddings of the base
  model and causal attention, as the model's own forward runs them;
* tensor parallelism comes from the model's ``_tp_plan`` (see
  :func:`~lightning_ciuic.parallel.tensor.hugging_face_plan`): attention heads and MLPs are sharded where
  the plan says ``colwise`` / ``rowwise``; plan entries for packed expert weights are reported and left
  replicated. Where attention is sharded, attention and key/value head counts must divide by
  ``tensor_parallel_size``.

Only causal decoders are trained, the LM's position ``t`` predicting token ``t + 1`` from tokens ``<= t``: a
``model_type`` transformers does not know is refused with the nearest causal-LM types, one without a causal-LM class
(T5, ViT, ...) or whose causal-LM class attends both ways (BERT-style encoders unless ``is_decoder=True``, XLM unless
``causal=True``: :func:`check_causal_decoder`) is refused saying what works, before any step. A model transformers
gives no ``_pp_plan`` (BERT) runs without pipeline stages or activation checkpointing, and is refused with them.

Requires ``transformers`` (``pip install lightning-ciuic[hf]``); padding masks are not supported (every
sequence of a batch is full length, as in packed pre-training data).
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from typing import Any, Optional

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ParallelStyle

from lightning_ciuic import compat
from lightning_ciuic.checkpoint.huggingface import load_weights, read_config
from lightning_ciuic.parallel.pipeline import BlockCall
from lightning_ciuic.parallel.tensor import hugging_face_plan
from lightning_ciuic.parallel.pipeline_module import PipelineModule


def _import_transformers() -> Any:
    try:
        import transformers
    except ImportError as err:  # pragma: no cover - exercised only without the extra
        raise ImportError(
            "HuggingFaceCausalLM needs the 'transformers' package: pip install 'lightning-ciuic[hf]'."
        ) from err
    return transformers


DECODERS = "a decoder-only model type (llama, qwen2, mistral, gemma, deepseek_v3, ...)"


def check_causal_lm_type(model_type: str) -> None:
    """Raise unless transformers builds a causal LM for ``model_type``: a name it does not know is told the nearest
    causal-LM types (by spelling), one it knows without a causal-LM class (T5, ViT, ...) what works."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if model_type not in CONFIG_MAPPING:
        causal = {name.lower(): name for name in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES}
        nearest = [causal[n] for n in difflib.get_close_matches(model_type.lower(), list(causal), n=4, cutoff=0.5)]
        said = f"; the nearest causal-LM types: {', '.join(nearest)}" if nearest else f"; use {DECODERS}"
        raise ValueError(f"model_type={model_type!r} is not a transformers model type{said}.")
    if CONFIG_MAPPING[model_type] not in MODEL_FOR_CAUSAL_LM_MAPPING:
        raise ValueError(
            f"model_type={model_type!r} has no causal language model in transformers (AutoModelForCausalLM builds none"
            f" for it): HuggingFaceCausalLM trains causal decoders; use {DECODERS}."
        )


def check_causal_decoder(model_type: str, config: Any, model: Optional[nn.Module] = None) -> None:
    """Raise if the causal-LM class transformers builds for ``config`` (``model``, once built) attends both ways,
    every position seeing the tokens it is trained to predict, saying what would make it causal.

    BERT-style encoders (BERT, RoBERTa, ELECTRA, ...: a masked-LM type, not an encoder-decoder one, whose classes
    BART, mBART, MVP make their decoder causal themselves) have a causal-LM head that is causal only with
    ``is_decoder=True``, known from the config; with ``model``, any whose config says ``is_decoder=False`` while an
    attention module of it says ``is_causal=False`` (BertGeneration); XLM only with ``causal=True``."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_MASKED_LM_MAPPING_NAMES

    fix = None
    if getattr(config, "causal", None) is False:  # XLM, FlauBERT
        fix = "config={'causal': True}"
    elif getattr(config, "is_decoder", None) is False:
        encoder = model_type in MODEL_FOR_MASKED_LM_MAPPING_NAMES and not getattr(config, "is_encoder_decoder", False)
        both_ways = model is not None and any(getattr(m, "is_causal", None) is False for m in model.modules())
        if encoder or both_ways:
            fix = "config={'is_decoder': True}, which makes its attention causal"
    if fix is not None:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        built = type(model).__name__ if model is not None else MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type, "a model")
        raise ValueError(
            f"model_type={model_type!r} builds {built}, which attends both ways with this config: every position would"
            f" see the tokens it is trained to predict. HuggingFaceCausalLM trains causal decoders: use {DECODERS}, or"
            f" {fix}."
        )


class _DecoderLayerCall:
    """Runs a Hugging Face decoder layer on hidden states alone: positions 0..n-1, causal attention. Under sequence
    parallelism a layer after the first gets this tp rank's ``1/sequence_shards`` of the sequence (the pipeline runner
    checks that tp divides it) and its attention the whole sequence's rotary embeddings: ``n`` is the whole length."""

    def __init__(self, rotary: nn.Module, sequence_shards: int = 1) -> None:
        self.rotary, self.sequence_shards = rotary, sequence_shards

    def __call__(self, layer: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(hidden.shape[1] * self.sequence_shards, device=hidden.device).unsqueeze(0)
        out = layer(
            hidden, attention_mask=None, position_ids=positions, position_embeddings=self.rotary(hidden, positions)
        )
        return out[0] if isinstance(out, tuple) else out


class HuggingFaceCausalLM(PipelineModule, LightningModule):
    """A ``transformers`` causal LM built from a config, trainable with pp x dp x tp (see module docstring).

    Args:
        model_type: a ``transformers`` model type, e.g. ``"llama"``, ``"qwen2"``, ``"deepseek_v3"`` (with
            ``pretrained``: taken from its config.json when not given).
        config: keyword arguments of that model's config (sizes, layers, heads, ...); with ``pretrained``, they
            override the directory's config.json.
        lr, weight_decay: AdamW's.
        pretrained: a local directory in Hugging Face layout (config.json, ``*.safetensors``) to start from.
    """

    def __init__(
        self,
        model_type: Optional[str] = None,
        config: Optional[dict[str, Any]] = None,
        lr: float = 3e-4,
        weight_decay: float = 0.0,
        pretrained: Optional[str] = None,
    ) -> None:
        super().__init__()
        if pretrained is not None:
            stored_type, stored_config = read_config(pretrained)
            if model_type is not None and model_type != stored_type:
                raise ValueError(f"model_type={model_type!r}, but {pretrained}/config.json says {stored_type!r}; omit model_type.")
            model_type, config = stored_type, {**stored_config, **(config or {})}
        if model_type is None:
            raise ValueError("HuggingFaceCausalLM needs a model_type (e.g. 'llama'), or pretrained=<directory>.")
        self.save_hyperparameters(
            {"model_type": model_type, "config": config, "lr": lr, "weight_decay": weight_decay, "pretrained": pretrained}
        )
        self._pretrained_loaded = False
        transformers = _import_transformers()
        check_causal_lm_type(model_type)
        try:
            hf_config = transformers.AutoConfig.for_model(model_type, **(config or {}))
        except ValueError as err:
            raise ValueError(f"model_type={model_type!r} with config={config!r}: transformers refuses it: {err}") from err
        check_causal_decoder(model_type, hf_config)
        if getattr(hf_config, "tie_word_embeddings", False):
            raise ValueError(
                f"{model_type} with tie_word_embeddings=True shares the embedding with the LM head, which pipeline"
                " stages cannot split; pass config={'tie_word_embeddings': False, ...}."
            )
        self.model = transformers.AutoModelForCausalLM.from_config(hf_config, attn_implementation="sdpa")
        check_causal_decoder(model_type, hf_config, self.model)

    @classmethod
    def from_pretrained(cls, path: str, **kwargs: Any) -> "HuggingFaceCausalLM":
        """The model of the Hugging Face directory ``path``, its weights read at the start of ``fit`` (keyword
        arguments as the constructor's: ``lr``, ``weight_decay``, ``config`` overrides)."""
        return cls(pretrained=str(path), **kwargs)

    def load_pretrained(self) -> None:
        """Read the ``pretrained`` directory's weights into the model as it is laid out now (collective)."""
        if self.hparams.pretrained is None:
            raise ValueError("this HuggingFaceCausalLM was not built from a pretrained directory.")
        load_weights(self.model.state_dict(keep_vars=True), self.hparams.pretrained)
        self._pretrained_loaded = True

    def on_fit_start(self) -> None:
        if self.hparams.pretrained is not None and not self._pretrained_loaded and self.trainer.ckpt_path is None:
            self.load_pretrained()
            rank_zero_info(f"HuggingFaceCausalLM: weights read from {self.hparams.pretrained}")

    # -- the model ---------------------------------------------------------------------------------
    @property
    def _base(self) -> nn.Module:
        return getattr(self.model, self.model.base_model_prefix)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, use_cache=False).logits

    def tensor_parallel_plan(self, tp_mesh: DeviceMesh, sequence_parallel: bool = False) -> dict[str, ParallelStyle]:
        """The model's ``_tp_plan`` translated (what ``parallelize()`` applies), sequence-parallel if asked (the
        residual stream holds ``1/tp`` of the sequence, the logits stay vocabulary-sharded); heads must split whole."""
        tp, config = tp_mesh.size(), self.model.config
        plan, skipped = hugging_face_plan(
            self.model, compat.hugging_face_tp_plan(self.model) or {}, prefix="model.", sequence_parallel=sequence_parallel
        )
        if any(".self_attn." in name for name in plan):  # heads are split: each rank must get whole heads
            for name in ("num_attention_heads", "num_key_value_heads"):
                heads = getattr(config, name, None)
                if heads is not None and heads % tp:
                    raise ValueError(
                        f"tensor_parallel_size={tp} does not divide {name}={heads}; use a tensor_parallel_size among"
                        f" {[d for d in range(1, heads + 1) if heads % d == 0]}."
                    )
        if skipped:
            rank_zero_info(f"tensor parallel: kept replicated (style not translated): {skipped}")
        self._sequence_shards = tp if sequence_parallel else 1  # what a pipeline's decoder layers receive (the calls)
        return plan

    # -- the PipelineModule protocol -----------------------------------------------------------------
    def pipeline_blocks(self) -> list[str]:
        """The model's ``_pp_plan`` in forward order (base model's entries, then the head), layer lists expanded.
        A model transformers gives no ``_pp_plan`` is refused (pipeline stages and activation checkpointing cut by it)."""
        plan = list(compat.hugging_face_pp_plan(self.model) or {})
        if not plan:
            raise ValueError(
                f"model_type={self.hparams.model_type!r} ({type(self.model).__name__}) has no pipeline plan in"
                " transformers (_pp_plan: its blocks in order), which pipeline stages and activation checkpointing cut"
                f" it by: use pipeline_parallel_size=1 and gradient_checkpointing=False, or {DECODERS}."
            )
        base_first = sorted(plan, key=lambda name: not name.startswith(self.model.base_model_prefix + "."))
        names = []
        for name in base_first:
            child = self.model.get_submodule(name)
            if isinstance(child, nn.ModuleList):
                names.extend(f"model.{name}.{i}" for i in range(len(child)))
            else:
                names.append(f"model.{name}")
        return names

    def pipeline_block_calls(self) -> Mapping[str, BlockCall]:
        """Each decoder layer's call; under sequence parallelism (``tensor_parallel_plan`` asked for it) the layers
        after the first take sequence-sharded hidden states (the first cuts the embedding's whole output itself)."""
        prefix = f"model.{self.model.base_model_prefix}.layers."
        whole = _DecoderLayerCall(self._base.rotary_emb)
        sharded = _DecoderLayerCall(self._base.rotary_emb, getattr(self, "_sequence_shards", 1))
        return {name: whole if name == f"{prefix}0" else sharded for name in self.pipeline_blocks() if name.startswith(prefix)}

    def pipeline_loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Cross-entropy in at least float32 (16-bit logits are widened; float64 ones kept)."""
        logits = logits.reshape(-1, logits.size(-1))
        if logits.dtype in (torch.float16, torch.bfloat16):
            logits = logits.float()
        return F.cross_entropy(logits, targets.reshape(-1))

    # -- Lightning -----------------------------------------------------------------------------------
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self.pipelined_loss(batch)
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val/loss", self.pipelined_loss(batch), prog_bar=True, sync_dist=True)

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.pipelined_forward(self.pipeline_inputs(batch)[0]).argmax(dim=-1)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=self.hparams.weight_decay)
